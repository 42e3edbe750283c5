/* workspace.c: layout of the per-thread row workspace (imoe_row_workspace). */
#include "imoe_internal.h"

static size_t align64(size_t x) { return (x + 63) & ~(size_t)63; }

size_t imoe_row_workspace_bytes(int64_t n, int full) {
  /* Never 0: every item then gets a real pointer, even for n == 0. */
  size_t bytes = align64((size_t)n + 1);
  if (full) bytes += align64(IMOE_RADIX_HIST * sizeof(uint32_t)) + 2 * align64((size_t)n * 4);
  return bytes;
}

imoe_row_workspace imoe_row_workspace_at(unsigned char *mem, int64_t n, int full) {
  imoe_row_workspace ws = {NULL, NULL, NULL, NULL};
  if (full) {
    ws.hist = (uint32_t *)(void *)mem;
    mem += align64(IMOE_RADIX_HIST * sizeof(uint32_t));
    ws.keys = (uint32_t *)(void *)mem;
    mem += align64((size_t)n * 4);
    ws.list = (uint32_t *)(void *)mem;
    mem += align64((size_t)n * 4);
  }
  ws.flags = mem;
  return ws;
}

int64_t imoe_plan_workspace_elems(imoe_plan_kind kind, imoe_device_type device, int64_t rows,
                                  int64_t n) {
  if (rows < 0 || n < 0) return -1;
  int64_t regions = 1;
  if (device == IMOE_DEVICE_CUDA) regions = kind == IMOE_PLAN_PERMUTE ? 6 : 7;
  if (rows != 0 && n > INT64_MAX / rows / regions) return -1;
  return regions * rows * n;
}
