/* mapcheck.c: validity of caller-given maps, checked before any write. */
#include <inttypes.h>

#include "imoe_internal.h"

imoe_status imoe_check_indices_row(const imoe_view *indices, int64_t row, int64_t n, uint8_t *seen,
                                   imoe_error *err) {
  const char *base = imoe_row_base(indices, row);
  const int64_t kept = indices->n, stride = indices->n_stride;
  imoe_status st = IMOE_OK;
  int64_t i = 0;
  for (; i < kept; i++) {
    const int64_t e = imoe_load_index(base + i * stride, indices->dtype);
    if (e == i) continue;
    if (e < 0 || e >= n) {
      st = imoe_fail_range(err, "indices", row, i, e, n);
      break;
    }
    if (e < kept) {
      /* Both i and e lie below C': a swap would move a kept slot out. */
      st = imoe_fail(err, IMOE_ERR_BAD_MAP,
                     "indices: row %" PRId64 ", position %" PRId64 " holds %" PRId64
                     ": a moved slot must come from at or beyond C' = %" PRId64,
                     row, i, e, kept);
      break;
    }
    if (seen[e]) {
      st = imoe_fail_repeat(err, IMOE_ERR_BAD_MAP, "indices", row, i, e);
      break;
    }
    seen[e] = 1;
  }
  /* Entries before i are valid, so this clears exactly what was set. */
  for (int64_t j = 0; j < i; j++) {
    const int64_t e = imoe_load_index(base + j * stride, indices->dtype);
    if (e != j) seen[e] = 0;
  }
  return st;
}

imoe_status imoe_check_target_map_row(const imoe_view *target_map, int64_t row, imoe_error *err) {
  const char *base = imoe_row_base(target_map, row);
  const int64_t n = target_map->n, stride = target_map->n_stride;
  const imoe_dtype dtype = target_map->dtype;
  /* Ranges first, so that the involution pass only reads slots in [0, n)
   * and a range error is reported as one, wherever it is. */
  for (int64_t x = 0; x < n; x++) {
    const int64_t t = imoe_load_index(base + x * stride, dtype);
    if (t < 0 || t >= n) {
      return imoe_fail(err, IMOE_ERR_INDEX_RANGE,
                       "target_map: row %" PRId64 ", slot %" PRId64 " holds %" PRId64
                       ", outside [0, %" PRId64 ")",
                       row, x, t, n);
    }
  }
  for (int64_t x = 0; x < n; x++) {
    const int64_t t = imoe_load_index(base + x * stride, dtype);
    const int64_t back = imoe_load_index(base + t * stride, dtype);
    if (back != x) {
      return imoe_fail(err, IMOE_ERR_BAD_MAP,
                       "target_map: row %" PRId64 ", slot %" PRId64 " maps to %" PRId64
                       ", which maps to %" PRId64 ", not back: not an involution",
                       row, x, t, back);
    }
  }
  return IMOE_OK;
}
