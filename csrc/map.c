/* map.c: the idempotent map of one row from its kept flags. The j-th hole
 * (dropped slot below C', ascending) pairs with the j-th kept tail slot
 * (kept slot at or beyond C', ascending). */
#include "imoe_internal.h"

void imoe_write_map_row(const uint8_t *flags, int64_t n, int64_t kept, uint32_t *list,
                        const imoe_view *indices, const imoe_view *target_map, int64_t row) {
  /* Holes go to list[0, holes), kept tail slots to list[kept, kept + tails):
   * gathered without branches, since kept flags are as good as random. */
  int64_t holes = 0, tails = 0;
  for (int64_t h = 0; h < kept; h++) {
    list[holes] = (uint32_t)h;
    holes += !flags[h];
  }
  uint32_t *tail = list + kept;
  for (int64_t t = kept; t < n; t++) {
    tail[tails] = (uint32_t)t;
    tails += flags[t];
  }
  /* Exactly `kept` flags are set, so tails == holes. */
  if (indices != NULL) {
    char *idx = imoe_row_base(indices, row);
    const int64_t stride = indices->n_stride;
    const imoe_dtype dtype = indices->dtype;
    for (int64_t i = 0; i < kept; i++) imoe_store_index(idx + i * stride, dtype, i);
    for (int64_t j = 0; j < holes; j++) imoe_store_index(idx + list[j] * stride, dtype, tail[j]);
  }
  if (target_map != NULL) {
    char *tm = imoe_row_base(target_map, row);
    const int64_t stride = target_map->n_stride;
    for (int64_t x = 0; x < n; x++) imoe_store_index(tm + x * stride, IMOE_DTYPE_I32, x);
    for (int64_t j = 0; j < holes; j++) {
      imoe_store_index(tm + list[j] * stride, IMOE_DTYPE_I32, tail[j]);
      imoe_store_index(tm + tail[j] * stride, IMOE_DTYPE_I32, list[j]);
    }
  }
}
