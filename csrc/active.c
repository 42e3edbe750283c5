/* active.c: the kept set of one row from explicit active indices. */

#include "imoe_internal.h"

imoe_status imoe_check_active_row(const imoe_view *active, int64_t row, int64_t n, uint8_t *seen,
                                  imoe_error *err) {
  const char *base = imoe_row_base(active, row);
  const int64_t k = active->n, stride = active->n_stride;
  imoe_status st = IMOE_OK;
  int64_t j = 0;
  for (; j < k; j++) {
    const int64_t slot = imoe_load_index(base + j * stride, active->dtype);
    if (slot < 0 || slot >= n) {
      st = imoe_fail_range(err, "active_indices", row, j, slot, n);
      break;
    }
    if (seen[slot]) {
      st = imoe_fail_repeat(err, IMOE_ERR_INDEX_DUPLICATE, "active_indices", row, j, slot);
      break;
    }
    seen[slot] = 1;
  }
  /* Hand the scratch back zeroed: clearing what was set costs O(K), not O(N). */
  for (int64_t i = 0; i < j; i++) seen[imoe_load_index(base + i * stride, active->dtype)] = 0;
  return st;
}

void imoe_select_active_row(const imoe_view *active, int64_t row, int64_t n, uint8_t *flags) {
  const char *base = imoe_row_base(active, row);
  memset(flags, 0, (size_t)n);
  for (int64_t j = 0; j < active->n; j++) {
    flags[imoe_load_index(base + j * active->n_stride, active->dtype)] = 1;
  }
}
