/* moe_gemm.c: imoe_grouped_gemm, the small-M grouped GEMM of an experts
 * layer: every argument check, the offsets' data check, and the CPU core,
 * which computes each dot product in the one documented order (the CUDA
 * kernel's, cuda/imoe_moe_gemm.cu: 32 lane partial sums, each fed its
 * 16-byte vectors of K in increasing k with fmaf, then the butterfly), so
 * the two devices agree bit for bit. Contract: idempotent_moe.h. Built with
 * -ffp-contract=off: the only fused multiply-adds are the fmaf calls. */
#include <inttypes.h>
#include <math.h>

#include "floats.h"
#include "imoe_backend.h"
#include "imoe_internal.h"

enum {
  GEMM_LANES = 32, /* partial sums: the lanes of a warp */
  GEMM_ROWS = 8,   /* rows of a per item (converted to F32 once) */
  GEMM_COLS = 64   /* columns of out per item */
};

/* sum_k a[k] w[k] in the documented order: lane (k / ve) mod 32, increasing
 * k within a lane, fmaf; then the butterfly h = 16, 8, 4, 2, 1. */
static float dot_in_lane_order(const float *a, const float *w, int64_t k_n, int ve) {
  float p[GEMM_LANES] = {0.0f};
  int lane = 0;
  for (int64_t k0 = 0; k0 < k_n; k0 += ve) {
    const int64_t k1 = k0 + ve < k_n ? k0 + ve : k_n;
    float acc = p[lane];
    for (int64_t k = k0; k < k1; k++) acc = fmaf(a[k], w[k], acc);
    p[lane] = acc;
    lane = (lane + 1) & (GEMM_LANES - 1);
  }
  for (int h = GEMM_LANES / 2; h > 0; h >>= 1)
    for (int l = 0; l < h; l++) p[l] = p[l] + p[l + h];
  return p[0];
}

typedef struct gemm_ctx {
  const imoe_view *a, *w, *offsets, *out;
  int64_t end, col_blocks; /* rows computed: [0, offsets[E - 1]) */
  int ve;                  /* elements of a 16-byte vector */
} gemm_ctx;

int64_t imoe_gemm_offset(const imoe_view *offsets, int64_t e) {
  return imoe_load_index((const char *)offsets->data + e * offsets->n_stride, offsets->dtype);
}

int64_t imoe_gemm_expert_of_row(const imoe_view *offsets, int64_t r) {
  int64_t lo = 0, hi = offsets->n - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (imoe_gemm_offset(offsets, mid) > r) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

/* Item: up to GEMM_ROWS rows x GEMM_COLS columns of out. Workspace: the
 * rows of a, then one column of w, in F32. */
static imoe_status gemm_item(const void *vctx, int64_t item, unsigned char *mem, imoe_error *err) {
  const gemm_ctx *g = vctx;
  (void)err;
  const imoe_view *a = g->a, *w = g->w, *out = g->out;
  const int64_t k_n = a->n, n_n = out->n, dt = a->dtype;
  const int64_t r0 = item / g->col_blocks * GEMM_ROWS, c0 = item % g->col_blocks * GEMM_COLS;
  const int64_t r1 = r0 + GEMM_ROWS < g->end ? r0 + GEMM_ROWS : g->end;
  const int64_t c1 = c0 + GEMM_COLS < n_n ? c0 + GEMM_COLS : n_n;
  float *rows = (float *)(void *)mem, *col = rows + GEMM_ROWS * k_n;
  int64_t expert[GEMM_ROWS];
  /* K = 0: a and w have no element and their data may be NULL, so no
   * address into them is formed (every sum is +0.0). */
  for (int64_t r = r0; r < r1; r++) {
    if (k_n > 0) {
      const char *src = imoe_row_base(a, r);
      for (int64_t k = 0; k < k_n; k++)
        rows[(r - r0) * k_n + k] = imoe_load_float(src + k * a->n_stride, (imoe_dtype)dt);
    }
    expert[r - r0] = imoe_gemm_expert_of_row(g->offsets, r);
  }
  for (int64_t n = c0; n < c1; n++) {
    int64_t loaded = -1;
    for (int64_t r = r0; r < r1; r++) {
      const int64_t e = expert[r - r0];
      if (e != loaded && k_n > 0) {
        const char *src = (const char *)w->data + e * w->lead_stride[0] + n * w->n_stride;
        for (int64_t k = 0; k < k_n; k++)
          col[k] = imoe_load_float(src + k * w->lead_stride[1], (imoe_dtype)dt);
        loaded = e;
      }
      const float v = dot_in_lane_order(rows + (r - r0) * k_n, col, k_n, g->ve);
      imoe_store_float(imoe_row_base(out, r) + n * out->n_stride, out->dtype, v);
    }
  }
  return IMOE_OK;
}

imoe_status imoe_gemm_check_weights(const imoe_view *w, const imoe_view *a, int64_t e_n, int64_t k_n,
                                    imoe_error *err) {
  imoe_status st = imoe_check_view(w, "w", err);
  if (st == IMOE_OK) st = imoe_check_typed(w, "w", IMOE_DTYPE_BIT(a->dtype), err);
  if (st != IMOE_OK) return st;
  if (w->lead_ndim != 2 || w->lead_shape[0] != e_n || w->lead_shape[1] != k_n) {
    if (w->lead_ndim != 2)
      return imoe_fail(err, IMOE_ERR_ARGUMENT, "w must be [E = %" PRId64 ", K = %" PRId64 ", N], got %d axes",
                       e_n, k_n, (int)w->lead_ndim + 1);
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "w must be [E = %" PRId64 ", K = %" PRId64 ", N], got [%" PRId64 ", %" PRId64
                     ", %" PRId64 "]",
                     e_n, k_n, w->lead_shape[0], w->lead_shape[1], w->n);
  }
  return IMOE_OK;
}

imoe_status imoe_gemm_check_offsets(const imoe_view *offsets, int64_t r_n, imoe_error *err) {
  int64_t prev = 0;
  for (int64_t e = 0; e < offsets->n; e++) {
    const int64_t v = imoe_gemm_offset(offsets, e);
    if (v < prev || v > r_n) {
      return imoe_fail(err, IMOE_ERR_INDEX_RANGE,
                       "offsets[%" PRId64 "] = %" PRId64 " is outside [%" PRId64 ", R = %" PRId64
                       "]: offsets must be non-decreasing and at most the rows of a",
                       e, v, prev, r_n);
    }
    prev = v;
  }
  return IMOE_OK;
}

imoe_status imoe_gemm_check_offsets_view(const imoe_view *offsets, imoe_error *err) {
  imoe_status st = imoe_check_view(offsets, "offsets", err);
  if (st == IMOE_OK) st = imoe_check_typed(offsets, "offsets", IMOE_DTYPE_BIT(IMOE_DTYPE_I32), err);
  if (st == IMOE_OK && (offsets->lead_ndim != 0 || offsets->n < 1)) {
    st = imoe_fail(err, IMOE_ERR_ARGUMENT, "offsets must be [E] with E >= 1 (the offsets of moe_dispatch)");
  }
  return st;
}

imoe_status imoe_grouped_gemm_shape(const imoe_view *a, const imoe_view *w, const imoe_view *offsets,
                                    int64_t out_shape[2], imoe_error *err) {
  imoe_status st = imoe_check_matrix(a, "a", IMOE_SCORE_DTYPES, -1, -1, 0, 0, err);
  if (st == IMOE_OK) st = imoe_gemm_check_offsets_view(offsets, err);
  if (st == IMOE_OK) st = imoe_gemm_check_weights(w, a, offsets->n, a->n, err);
  if (st == IMOE_OK && out_shape != NULL) {
    out_shape[0] = a->lead_shape[0];
    out_shape[1] = w->n;
  }
  return st;
}

imoe_status imoe_grouped_gemm(const imoe_view *a, const imoe_view *w, const imoe_view *offsets,
                              const imoe_view *out, const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_grouped_gemm_shape(a, w, offsets, NULL, err);
  if (st != IMOE_OK) return st;
  const int64_t r_n = a->lead_shape[0], k_n = a->n;
  st = imoe_check_matrix(out, "out", IMOE_DTYPE_BIT(a->dtype), r_n, w->n, 1, 0, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  const imoe_call_args call = {NULL, 0, NULL, {a, w, offsets}, {"a", "w", "offsets"},
                               {out}, {"out"}, NULL, 0};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK) return st;
  if (imoe_on_cuda(exec)) {
    if (r_n == 0 || out->n == 0) return IMOE_OK;
    return imoe_cuda_grouped_gemm(a, w, offsets, out, exec, err);
  }
  st = imoe_gemm_check_offsets(offsets, r_n, err);
  if (st != IMOE_OK) return st;
  const int64_t end = imoe_gemm_offset(offsets, offsets->n - 1), n_n = out->n;
  if (end == 0 || n_n == 0) return IMOE_OK;
  const int64_t col_blocks = (n_n + GEMM_COLS - 1) / GEMM_COLS;
  const int64_t items = (end + GEMM_ROWS - 1) / GEMM_ROWS * col_blocks;
  const gemm_ctx g = {a, w, offsets, out, end, col_blocks, a->dtype == IMOE_DTYPE_F32 ? 4 : 8};
  const imoe_stage stage = {gemm_item, &g, items};
  const size_t mem = (size_t)(GEMM_ROWS + 1) * (size_t)(k_n > 0 ? k_n : 1) * sizeof(float);
  return imoe_run_stages(&stage, 1, mem, imoe_thread_count(exec, end * n_n * k_n, items), err);
}
