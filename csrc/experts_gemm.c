/* experts_gemm.c: imoe_experts_gemm, the experts' grouped GEMM that reads
 * each row's input where it lies (through the dispatch's src) and may apply
 * the gated activation to its output: every argument check, the data checks
 * of offsets and src, and the CPU core (each dot product in F32 from +0.0 in
 * increasing k with fmaf, rounded once). The CUDA kernel is
 * cuda/imoe_experts_gemm.cu; contract in idempotent_moe.h. */
#include <inttypes.h>
#include <math.h>

#include "floats.h"
#include "imoe_backend.h"
#include "imoe_internal.h"

enum { XG_ROWS = 8, XG_COLS = 64 }; /* an item: rows x output columns */

typedef struct xg_ctx {
  const imoe_view *x, *src, *w, *offsets, *out;
  int64_t end, col_blocks, half; /* rows computed [0, end); gated: N / 2, else 0 */
  int32_t gated;
  imoe_act act;
} xg_ctx;

static int64_t row_source(const imoe_view *src, int64_t r) {
  return src ? imoe_load_index((const char *)src->data + r * src->n_stride, src->dtype) : r;
}

static float dot(const float *a, const imoe_view *w, int64_t e, int64_t n, int64_t k_n, imoe_dtype dt) {
  if (k_n == 0) return 0.0f;
  const char *col = (const char *)w->data + e * w->lead_stride[0] + n * w->n_stride;
  float acc = 0.0f;
  for (int64_t k = 0; k < k_n; k++) acc = fmaf(a[k], imoe_load_float(col + k * w->lead_stride[1], dt), acc);
  return acc;
}

/* Item: up to XG_ROWS rows x XG_COLS output columns. Workspace: the rows of
 * x in F32. */
static imoe_status xg_item(const void *vctx, int64_t item, unsigned char *mem, imoe_error *err) {
  const xg_ctx *g = vctx;
  (void)err;
  const imoe_view *x = g->x, *out = g->out;
  const imoe_dtype dt = (imoe_dtype)x->dtype;
  const int64_t k_n = x->n, n_n = out->n;
  const int64_t r0 = item / g->col_blocks * XG_ROWS, c0 = item % g->col_blocks * XG_COLS;
  const int64_t r1 = r0 + XG_ROWS < g->end ? r0 + XG_ROWS : g->end;
  const int64_t c1 = c0 + XG_COLS < n_n ? c0 + XG_COLS : n_n;
  float *rows = (float *)(void *)mem;
  /* K = 0: x and w have no element and their data may be NULL, so no
   * address into them is formed (every sum is +0.0). */
  for (int64_t r = r0; r < r1 && k_n > 0; r++) {
    const char *in = imoe_row_base(x, row_source(g->src, r));
    for (int64_t k = 0; k < k_n; k++) rows[(r - r0) * k_n + k] = imoe_load_float(in + k * x->n_stride, dt);
  }
  for (int64_t r = r0; r < r1; r++) {
    const int64_t e = imoe_gemm_expert_of_row(g->offsets, r);
    const float *a = rows + (r - r0) * k_n;
    char *o = imoe_row_base(out, r);
    for (int64_t n = c0; n < c1; n++) {
      float v = dot(a, g->w, e, n, k_n, dt);
      if (g->gated) {
        const float gate = imoe_round_to(v, dt), up = imoe_round_to(dot(a, g->w, e, g->half + n, k_n, dt), dt);
        v = imoe_gated(gate, up, g->act, dt);
      }
      imoe_store_float(o + n * out->n_stride, out->dtype, v);
    }
  }
  return IMOE_OK;
}

imoe_status imoe_experts_gemm_shape(const imoe_view *x, const imoe_view *src, const imoe_view *w,
                                    const imoe_view *offsets, int32_t gated, imoe_act act,
                                    int64_t out_shape[2], imoe_error *err) {
  imoe_status st = imoe_check_matrix(x, "x", IMOE_SCORE_DTYPES, -1, -1, 0, 0, err);
  if (st == IMOE_OK && src != NULL) {
    st = imoe_check_view(src, "src", err);
    if (st == IMOE_OK) st = imoe_check_typed(src, "src", IMOE_DTYPE_BIT(IMOE_DTYPE_I32), err);
    if (st == IMOE_OK && src->lead_ndim != 0)
      st = imoe_fail(err, IMOE_ERR_ARGUMENT, "src must be [R] (the out_src of moe_dispatch), got %d axes",
                     (int)src->lead_ndim + 1);
  }
  if (st == IMOE_OK) st = imoe_gemm_check_offsets_view(offsets, err);
  if (st == IMOE_OK) st = imoe_gemm_check_weights(w, x, offsets->n, x->n, err);
  if (st != IMOE_OK) return st;
  if (gated != 0 && gated != 1) return imoe_fail(err, IMOE_ERR_ARGUMENT, "gated must be 0 or 1, got %d", (int)gated);
  if (gated && (act < IMOE_ACT_SILU || act > IMOE_ACT_RELU))
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "act %d is not an imoe_act", (int)act);
  if (gated && w->n % 2 != 0)
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "w: gated, its N = %" PRId64 " must be even (gate columns, then as many up columns)", w->n);
  if (out_shape != NULL) {
    out_shape[0] = src != NULL ? src->n : x->lead_shape[0];
    out_shape[1] = gated ? w->n / 2 : w->n;
  }
  return IMOE_OK;
}

/* src[r] in [0, T) for every r < end. Reads the data. */
static imoe_status check_src(const imoe_view *src, int64_t end, int64_t t_n, imoe_error *err) {
  for (int64_t r = 0; r < end; r++) {
    const int64_t v = row_source(src, r);
    if (v < 0 || v >= t_n)
      return imoe_fail(err, IMOE_ERR_INDEX_RANGE,
                       "src[%" PRId64 "] = %" PRId64 " is outside [0, T = %" PRId64 ") (a row below offsets[-1])", r,
                       v, t_n);
  }
  return IMOE_OK;
}

imoe_status imoe_experts_gemm(const imoe_view *x, const imoe_view *src, const imoe_view *w,
                              const imoe_view *offsets, int32_t gated, imoe_act act, const imoe_view *out,
                              const imoe_exec *exec, imoe_error *err) {
  int64_t shape[2];
  imoe_status st = imoe_experts_gemm_shape(x, src, w, offsets, gated, act, shape, err);
  if (st != IMOE_OK) return st;
  const int64_t r_n = shape[0], k_n = x->n;
  st = imoe_check_matrix(out, "out", IMOE_DTYPE_BIT(x->dtype), r_n, shape[1], 1, 0, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  const imoe_call_args call = {NULL, 0, NULL, {x, src, w, offsets}, {"x", "src", "w", "offsets"},
                               {out}, {"out"}, NULL, 0};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK) return st;
  if (imoe_on_cuda(exec)) {
    if (r_n == 0 || out->n == 0) return IMOE_OK;
    return imoe_cuda_experts_gemm(x, src, w, offsets, gated, act, out, exec, err);
  }
  st = imoe_gemm_check_offsets(offsets, r_n, err);
  if (st != IMOE_OK) return st;
  const int64_t end = imoe_gemm_offset(offsets, offsets->n - 1), n_n = out->n;
  if (src != NULL) {
    st = check_src(src, end, x->lead_shape[0], err);
    if (st != IMOE_OK) return st;
  }
  if (end == 0 || n_n == 0) return IMOE_OK;
  const int64_t col_blocks = (n_n + XG_COLS - 1) / XG_COLS;
  const int64_t items = (end + XG_ROWS - 1) / XG_ROWS * col_blocks;
  const xg_ctx g = {x, src, w, offsets, out, end, col_blocks, gated ? w->n / 2 : 0, gated, act};
  const imoe_stage stage = {xg_item, &g, items};
  const size_t mem = (size_t)XG_ROWS * (size_t)(k_n > 0 ? k_n : 1) * sizeof(float);
  return imoe_run_stages(&stage, 1, mem, imoe_thread_count(exec, end * w->n * k_n, items), err);
}
