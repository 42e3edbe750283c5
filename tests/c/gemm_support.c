/* gemm_support.c: see gemm_support.h. */
#include "gemm_support.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "floats.h"

const imoe_dtype gemm_dtypes[3] = {IMOE_DTYPE_F32, IMOE_DTYPE_F16, IMOE_DTYPE_BF16};

int64_t gemm_elem_size(imoe_dtype dt) { return dt == IMOE_DTYPE_F32 ? 4 : 2; }

const char *gemm_dtype_name(imoe_dtype dt) {
  return dt == IMOE_DTYPE_F32 ? "f32" : dt == IMOE_DTYPE_F16 ? "f16" : "bf16";
}

const char *const gemm_w_layout_name[W_LAYOUTS] = {"N-contiguous", "K-contiguous", "strided"};

tensor gemm_weights_make(int64_t e_n, int64_t k_n, int64_t n_n, imoe_dtype dt, int layout, uint64_t *seed) {
  const int64_t lead[2] = {e_n, k_n}, size = gemm_elem_size(dt);
  if (layout == W_N_CONTIG) return tensor_make(2, lead, n_n, size, dt, 0, seed);
  if (layout == W_STRIDED)
    return tensor_make(2, lead, n_n, size, dt, T_PAD | T_NEG_SLOTS | T_NEG_LEAD | T_LEAD_REVERSED, seed);
  tensor t;
  memset(&t, 0, sizeof t);
  imoe_view *v = &t.view;
  const int64_t kk = k_n > 0 ? k_n : 1, nn = n_n > 0 ? n_n : 1, ee = e_n > 0 ? e_n : 1;
  v->lead_ndim = 2;
  v->lead_shape[0] = e_n;
  v->lead_shape[1] = k_n;
  v->lead_stride[1] = size;
  v->n_stride = kk * size;
  v->lead_stride[0] = nn * kk * size + 16;
  v->n = n_n;
  v->row_bytes = size;
  v->dtype = dt;
  t.bytes = (size_t)(ee * v->lead_stride[0] + 64);
  t.alloc = malloc(t.bytes);
  for (size_t i = 0; i < t.bytes; i++) t.alloc[i] = (unsigned char)rng_next(seed);
  v->data = t.alloc + 32;
  return t;
}

void gemm_fill_values(tensor *t, int64_t rows, int64_t n, uint64_t *rng) {
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t s = 0; s < n; s++) {
      const double u = (double)(rng_next(rng) >> 11) * ldexp(1.0, -53);
      imoe_store_float((char *)tensor_at(t, r, s), t->view.dtype, (float)(4.0 * u - 2.0));
    }
  }
}

float gemm_load_at(const tensor *t, int64_t row, int64_t slot) {
  return imoe_load_float((const char *)tensor_at(t, row, slot), t->view.dtype);
}

void gemm_random_offsets(uint64_t *rng, int32_t *offsets, int64_t e_n, int64_t end) {
  const int kind = (int)(rng_next(rng) % 4);
  const int64_t one = rng_range(rng, 0, e_n - 1);
  for (int64_t e = 0; e < e_n - 1; e++)
    offsets[e] = (int32_t)(kind == 0 ? (e < one ? 0 : end) : rng_range(rng, 0, end));
  offsets[e_n - 1] = (int32_t)end;
  for (int64_t i = 1; i < e_n; i++) /* insertion sort */
    for (int64_t j = i; j > 0 && offsets[j - 1] > offsets[j]; j--) {
      const int32_t t = offsets[j];
      offsets[j] = offsets[j - 1];
      offsets[j - 1] = t;
    }
}

const unsigned gemm_view_layouts[5] = {0, T_PAD, T_NEG_SLOTS, T_NEG_LEAD | T_PAD, T_NEG_SLOTS | T_NEG_LEAD};
