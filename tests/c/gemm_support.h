/* gemm_support.h: what the grouped GEMM tests share (test_moe_gemm.c for
 * imoe_grouped_gemm, test_experts_gemm.c for imoe_experts_gemm): the
 * dtypes they run, weights [E, K, N] in three layouts, values and offsets
 * drawn from a seed, the view layouts they cycle through. */
#ifndef IMOE_TEST_GEMM_SUPPORT_H
#define IMOE_TEST_GEMM_SUPPORT_H

#include <stdint.h>

#include "idempotent_moe.h"
#include "tensor.h"

/* The byte out is filled with before a call; bytes a call may not write
 * keep it. */
#define GEMM_SENTINEL 0xA5

/* F32, F16, BF16. */
extern const imoe_dtype gemm_dtypes[3];
int64_t gemm_elem_size(imoe_dtype dt);
const char *gemm_dtype_name(imoe_dtype dt);

/* Weights [E, K, N]. */
enum {
  W_N_CONTIG, /* row-major [E, K, N] */
  W_K_CONTIG, /* stored [E, N, K] with a gap after each expert, seen as [E, K, N] */
  W_STRIDED,  /* padded, negative N and E strides, E innermost of the lead axes */
  W_LAYOUTS
};

extern const char *const gemm_w_layout_name[W_LAYOUTS];
/* Every byte of the allocation drawn from *seed, as tensor_make does. */
tensor gemm_weights_make(int64_t e_n, int64_t k_n, int64_t n_n, imoe_dtype dt, int layout, uint64_t *seed);

/* rows x n elements of t, uniform in [-2, 2], rounded to t's dtype by the
 * store. */
void gemm_fill_values(tensor *t, int64_t rows, int64_t n, uint64_t *rng);
/* The element at (row, slot) of a F32/F16/BF16 tensor, widened to F32. */
float gemm_load_at(const tensor *t, int64_t row, int64_t slot);

/* offsets[0, e_n) of e_n experts over [0, end]: random cuts, sometimes all
 * rows in one expert; non-decreasing, the last one end. */
void gemm_random_offsets(uint64_t *rng, int32_t *offsets, int64_t e_n, int64_t end);

/* View layouts for activations and out (all five), and for the [E] or [R]
 * index views (the first three). */
extern const unsigned gemm_view_layouts[5];

#endif
