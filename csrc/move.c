/* move.c: applies a valid map to the buffers, in parallel over
 * (row, slot range) items. Pairs are disjoint, so items never touch the
 * same slot and need no ordering. */
#include "imoe_internal.h"

/* Swaps go through a stack tile, never an O(row) heap buffer. Long rows
 * use libc memcpy on 1 KiB pieces (full speed, and the tile stays in L1);
 * short rows use fixed-size pieces the compiler turns into plain register
 * moves, where a libc call per piece would cost more than the bytes. */
#define SWAP_TILE 1024
#define SWAP_SHORT 256

#define SWAP_PIECE(size)            \
  do {                              \
    unsigned char x[size], y[size]; \
    memcpy(x, a, size);             \
    memcpy(y, b, size);             \
    memcpy(a, y, size);             \
    memcpy(b, x, size);             \
    a += size;                      \
    b += size;                      \
    n -= size;                      \
  } while (0)

void imoe_swap_bytes(char *a, char *b, size_t n) {
  if (n < SWAP_SHORT) {
    while (n >= 16) SWAP_PIECE(16);
    if (n >= 8) SWAP_PIECE(8);
    if (n >= 4) SWAP_PIECE(4);
    if (n >= 2) SWAP_PIECE(2);
    if (n >= 1) SWAP_PIECE(1);
    return;
  }
  unsigned char tile[SWAP_TILE];
  while (n > 0) {
    const size_t piece = n < SWAP_TILE ? n : SWAP_TILE;
    memcpy(tile, a, piece);
    memcpy(a, b, piece);
    memcpy(b, tile, piece);
    a += piece;
    b += piece;
    n -= piece;
  }
}

static void copy_bytes(char *dst, const char *src, size_t n) {
  switch (n) {
    case 2:
      memcpy(dst, src, 2);
      return;
    case 4:
      memcpy(dst, src, 4);
      return;
    case 8:
      memcpy(dst, src, 8);
      return;
    default:
      memcpy(dst, src, n);
  }
}

int64_t imoe_buffers_bytes(const imoe_view *buffers, int32_t num_buffers) {
  int64_t total = 0;
  for (int32_t b = 0; b < num_buffers; b++) {
    const int64_t rows = imoe_view_rows(&buffers[b]);
    /* Saturate: only a size hint. */
    if (rows != 0 && buffers[b].n > INT64_MAX / rows / buffers[b].row_bytes) return INT64_MAX;
    const int64_t bytes = rows * buffers[b].n * buffers[b].row_bytes;
    total = bytes > INT64_MAX - total ? INT64_MAX : total + bytes;
  }
  return total;
}

void imoe_apply_plan_init(imoe_apply_plan *plan, const imoe_view *buffers, int32_t num_buffers,
                          const imoe_view *map, imoe_mode mode, int num_threads) {
  plan->buffers = buffers;
  plan->num_buffers = num_buffers;
  plan->map = map;
  plan->mode = mode;
  plan->rows = imoe_view_rows(map);
  plan->slots = map->n;
  if (plan->rows == 0 || plan->slots == 0) {
    plan->chunk = 1;
    plan->per_row = 0;
    return;
  }
  /* A few items per thread balance rows with few and many moves; split a
   * row only as much as the row count falls short of that. */
  const int64_t want = 4 * (int64_t)num_threads;
  int64_t per_row = (want + plan->rows - 1) / plan->rows;
  if (per_row > plan->slots) per_row = plan->slots;
  plan->chunk = (plan->slots + per_row - 1) / per_row;
  plan->per_row = (plan->slots + plan->chunk - 1) / plan->chunk;
}

/* Addresses of one item's row in the map and in every buffer. */
typedef struct item_rows {
  const char *map;
  char *buf[IMOE_MAX_BUFFERS];
  int64_t lo, hi;
} item_rows;

static void locate(const imoe_apply_plan *plan, int64_t item, item_rows *out) {
  const int64_t row = item / plan->per_row, part = item % plan->per_row;
  out->map = imoe_row_base(plan->map, row);
  for (int32_t b = 0; b < plan->num_buffers; b++) {
    out->buf[b] = imoe_row_base(&plan->buffers[b], row);
  }
  out->lo = part * plan->chunk;
  out->hi = out->lo + plan->chunk < plan->slots ? out->lo + plan->chunk : plan->slots;
}

/* Slot `dst` takes slot `src` (move), or the two exchange (swap). */
static void move_pair(const imoe_apply_plan *plan, item_rows *rows, int64_t dst, int64_t src) {
  for (int32_t b = 0; b < plan->num_buffers; b++) {
    const imoe_view *v = &plan->buffers[b];
    char *d = rows->buf[b] + dst * v->n_stride;
    char *s = rows->buf[b] + src * v->n_stride;
    if (plan->mode == IMOE_MODE_SWAP) {
      imoe_swap_bytes(d, s, (size_t)v->row_bytes);
    } else {
      copy_bytes(d, s, (size_t)v->row_bytes);
    }
  }
}

/* One item of a map's rows: indices (slot i takes slot idx[i] when they
 * differ) or a target map (each 2-cycle x <-> tm[x] once, from its lower
 * slot). */
static void apply_map_item(const imoe_apply_plan *plan, int64_t item, int target_map) {
  const int64_t stride = plan->map->n_stride;
  const imoe_dtype dtype = plan->map->dtype;
  item_rows rows;
  locate(plan, item, &rows);
  for (int64_t x = rows.lo; x < rows.hi; x++) {
    const int64_t v = imoe_load_index(rows.map + x * stride, dtype);
    if (target_map ? x < v : v != x) move_pair(plan, &rows, x, v);
  }
}

imoe_status imoe_apply_indices_item(const void *ctx, int64_t item, unsigned char *workspace,
                                    imoe_error *err) {
  (void)workspace;
  (void)err;
  apply_map_item(ctx, item, 0);
  return IMOE_OK;
}

imoe_status imoe_apply_target_map_item(const void *ctx, int64_t item, unsigned char *workspace,
                                       imoe_error *err) {
  (void)workspace;
  (void)err;
  apply_map_item(ctx, item, 1);
  return IMOE_OK;
}
