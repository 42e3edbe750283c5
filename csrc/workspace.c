/* workspace.c: layout of the per-thread row workspace (imoe_row_workspace). */
#include "imoe_internal.h"

static size_t align64(size_t x) { return (x + 63) & ~(size_t)63; }

int64_t imoe_radix_hist_entries(int64_t n) {
  if (n <= IMOE_RANK_MAX_KEYS_16) return 0;
  return n < IMOE_HIST_COPIES_MIN_KEYS ? 2048 : IMOE_RADIX_HIST;
}

static size_t hist_bytes(int64_t n) {
  return align64((size_t)imoe_radix_hist_entries(n) * sizeof(uint32_t));
}

size_t imoe_row_workspace_bytes(int64_t n, int full) {
  /* Never 0: every item then gets a real pointer, even for n == 0. */
  size_t bytes = align64((size_t)n + 1);
  if (full) bytes += hist_bytes(n) + 2 * align64((size_t)n * 4);
  return bytes;
}

imoe_row_workspace imoe_row_workspace_at(unsigned char *mem, int64_t n, int full) {
  imoe_row_workspace ws = {NULL, NULL, NULL, NULL};
  if (full) {
    ws.hist = imoe_radix_hist_entries(n) > 0 ? (uint32_t *)(void *)mem : NULL;
    mem += hist_bytes(n);
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
