/* tensor.c: see tensor.h. */
#include "tensor.h"

#include <stdlib.h>
#include <string.h>

#define GUARD 32

uint64_t rng_next(uint64_t *state) {
  /* splitmix64: any seed, including 0, gives a good stream. */
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

int64_t rng_range(uint64_t *state, int64_t lo, int64_t hi) {
  return lo + (int64_t)(rng_next(state) % (uint64_t)(hi - lo + 1));
}

tensor tensor_make(int32_t lead_ndim, const int64_t *lead_shape, int64_t n, int64_t row_bytes,
                   imoe_dtype dtype, unsigned layout, uint64_t *seed) {
  tensor t;
  memset(&t, 0, sizeof t);
  imoe_view *v = &t.view;
  v->lead_ndim = lead_ndim;
  v->n = n;
  v->row_bytes = row_bytes;
  v->dtype = dtype;
  const int64_t pad = (layout & T_PAD) ? 3 : 0;
  v->n_stride = row_bytes + pad;
  /* Memory order of the lead axes: last innermost, or axis 0 innermost. */
  int order[IMOE_MAX_LEAD_DIMS];
  for (int32_t d = 0; d < lead_ndim; d++) order[d] = d;
  if ((layout & T_LEAD_REVERSED) && lead_ndim > 1) {
    for (int32_t d = 0; d < lead_ndim; d++) order[d] = d == 0 ? lead_ndim - 1 : d - 1;
  }
  int64_t stride = (n > 0 ? n : 1) * v->n_stride + pad;
  for (int32_t k = lead_ndim - 1; k >= 0; k--) {
    const int d = order[k];
    v->lead_shape[d] = lead_shape[d];
    v->lead_stride[d] = stride;
    stride *= lead_shape[d] > 0 ? lead_shape[d] : 1;
  }
  int64_t offset = GUARD;
  if (layout & T_NEG_SLOTS) {
    offset += (n > 0 ? n - 1 : 0) * v->n_stride;
    v->n_stride = -v->n_stride;
  }
  if ((layout & T_NEG_LEAD) && lead_ndim > 0) {
    offset += (lead_shape[0] > 0 ? lead_shape[0] - 1 : 0) * v->lead_stride[0];
    v->lead_stride[0] = -v->lead_stride[0];
  }
  t.bytes = (size_t)(stride + 2 * GUARD);
  t.alloc = malloc(t.bytes);
  for (size_t i = 0; i < t.bytes; i++) t.alloc[i] = (unsigned char)rng_next(seed);
  v->data = t.alloc + offset;
  return t;
}

void tensor_free(tensor *t) {
  free(t->alloc);
  t->alloc = NULL;
}

int64_t tensor_rows(const tensor *t) {
  int64_t rows = 1;
  for (int32_t d = 0; d < t->view.lead_ndim; d++) rows *= t->view.lead_shape[d];
  return rows;
}

unsigned char *tensor_at(const tensor *t, int64_t row, int64_t slot) {
  const imoe_view *v = &t->view;
  int64_t offset = slot * v->n_stride;
  for (int32_t d = v->lead_ndim - 1; d >= 0; d--) {
    offset += (row % v->lead_shape[d]) * v->lead_stride[d];
    row /= v->lead_shape[d];
  }
  return (unsigned char *)v->data + offset;
}

unsigned char *tensor_snapshot(const tensor *t) {
  unsigned char *copy = malloc(t->bytes);
  memcpy(copy, t->alloc, t->bytes);
  return copy;
}

int tensor_same(const tensor *t, const unsigned char *snapshot) {
  return memcmp(t->alloc, snapshot, t->bytes) == 0;
}

void tensor_put_index(unsigned char *p, imoe_dtype dtype, int64_t value) {
  if (dtype == IMOE_DTYPE_I32) {
    const int32_t v = (int32_t)value;
    memcpy(p, &v, 4);
  } else {
    memcpy(p, &value, 8);
  }
}

int64_t tensor_get_index(const unsigned char *p, imoe_dtype dtype) {
  if (dtype == IMOE_DTYPE_I32) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
  }
  int64_t v;
  memcpy(&v, p, 8);
  return v;
}
