/* moe_router.c: imoe_topk_softmax, the router of a sparse-MoE block after
 * its linear: softmax in F32, top-k, optional renormalisation. The CPU core
 * here; CUDA in cuda/imoe_router.cu. Contract (and the arithmetic, which is
 * torch's CUDA routing step for step): idempotent_moe.h. Built with
 * -ffp-contract=off: every operation below is one rounded F32 operation,
 * the fused ones spelt fmaf. */
#include <inttypes.h>
#include <math.h>

#include "floats.h"
#include "imoe_backend.h"
#include "imoe_internal.h"

enum { ROUTER_LANES = 32 }; /* a warp */

/* W: the lanes of one row, min(next_pow2(E), 32); *pow2 = next_pow2(E). */
static int router_width(int64_t e_n, int *pow2) {
  int p = 1;
  while (p < e_n) p <<= 1;
  *pow2 = p;
  return p < ROUTER_LANES ? p : ROUTER_LANES;
}

/* CUDA's expf as nvcc 13 emits it (libdevice __nv_expf, sm_80/90/100): a
 * range reduction x log2(e) = f + (n - 127) in F32 fmas, then
 * ex2.approx.ftz(f) x 2^(n - 127). Every step is reproduced exactly except
 * ex2.approx, the hardware's approximation, for which this takes 2^f
 * correctly rounded: the two agree to the approximation's error (a couple
 * of ulp at most), not bit for bit. */
static float cuda_expf(float x) {
  const float t = fmaf(x, imoe_f32_from_bits(0x3BBB989Du), 0.5f);
  const float sat = t > 0.0f ? (t < 1.0f ? t : 1.0f) : 0.0f; /* cvt.sat: NaN -> +0 */
  /* fma.rm(sat, 252, 12582913): the product is exact in double and the
   * addend an integer, so rounding down is floor of the product. */
  const float n = 12582913.0f + (float)floor((double)sat * 252.0);
  const float j = n + imoe_f32_from_bits(0xCB40007Fu); /* n - 12583039: exact */
  const float r = fmaf(x, imoe_f32_from_bits(0x3FB8AA3Bu), -j);
  const float f = fmaf(x, imoe_f32_from_bits(0x32A57060u), r);
  const float scale = imoe_f32_from_bits(imoe_bits_from_f32(n) << 23);
  const float ff = fpclassify(f) == FP_SUBNORMAL ? 0.0f : f; /* .ftz input */
  return (float)exp2((double)ff) * scale;
}

/* The order of a probability among the others: higher is better; NaN
 * lowest; the complement of the expert below it, so ties go to the lower
 * expert. Every key of a row is distinct. */
static uint64_t rank_key(float p, int64_t e) {
  uint32_t key = 0;
  if (!isnan(p)) {
    const uint32_t b = imoe_bits_from_f32(p);
    key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  }
  return ((uint64_t)key << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)e);
}

/* torch's CUDA sum of k values over the last axis (Reduce.cuh, k <= 32:
 * B = the largest power of two <= k lanes, lane l holding v[l] and v[l + B],
 * then warp_shfl_down with offsets B/2 .. 1). */
static float router_sum(const float *v, int64_t k) {
  int b = 1;
  while (2 * b <= k) b <<= 1;
  float part[ROUTER_LANES];
  for (int l = 0; l < b; l++) part[l] = l + b < k ? v[l] + v[l + b] : v[l];
  for (int o = b / 2; o > 0; o /= 2)
    for (int l = 0; l < o; l++) part[l] = part[l] + part[l + o];
  return part[0];
}

typedef struct router_ctx {
  const imoe_view *logits, *weights, *indices;
  int64_t k;
  int renormalize, width, pow2;
} router_ctx;

static imoe_status route_row(const void *vctx, int64_t t, unsigned char *mem, imoe_error *err) {
  const router_ctx *c = vctx;
  (void)err;
  const int64_t e_n = c->logits->n, k = c->k;
  const int w = c->width, iters = c->pow2 / w;
  float *x = (float *)(void *)mem; /* [pow2]: x[l + i W] is lane l's slot i */
  const char *in = imoe_row_base(c->logits, t);
  for (int64_t j = 0; j < c->pow2; j++)
    x[j] = j < e_n ? imoe_load_float(in + j * c->logits->n_stride, c->logits->dtype) : -INFINITY;
  float lane_max[ROUTER_LANES], lane_sum[ROUTER_LANES], other[ROUTER_LANES];
  for (int l = 0; l < w; l++) {
    float m = x[l];
    for (int i = 1; i < iters; i++) m = m > x[l + i * w] ? m : x[l + i * w];
    lane_max[l] = m;
  }
  for (int o = w / 2; o > 0; o /= 2) { /* xor butterfly, every lane at once */
    for (int l = 0; l < w; l++) other[l] = lane_max[l ^ o];
    for (int l = 0; l < w; l++) lane_max[l] = lane_max[l] < other[l] ? other[l] : lane_max[l];
  }
  for (int l = 0; l < w; l++) {
    float s = 0.0f;
    for (int i = 0; i < iters; i++) {
      x[l + i * w] = cuda_expf(x[l + i * w] - lane_max[l]);
      s += x[l + i * w];
    }
    lane_sum[l] = s;
  }
  for (int o = w / 2; o > 0; o /= 2) {
    for (int l = 0; l < w; l++) other[l] = lane_sum[l ^ o];
    for (int l = 0; l < w; l++) lane_sum[l] = lane_sum[l] + other[l];
  }
  for (int64_t j = 0; j < e_n; j++) x[j] = x[j] / lane_sum[j % w];
  /* top-k: k rounds of the best key not yet taken */
  float v[IMOE_ROUTER_MAX_K];
  int64_t idx[IMOE_ROUTER_MAX_K];
  uint64_t last = UINT64_MAX;
  for (int64_t r = 0; r < k; r++) {
    uint64_t best = 0;
    int64_t at = -1;
    for (int64_t j = 0; j < e_n; j++) {
      const uint64_t key = rank_key(x[j], j);
      if (key < last && (at < 0 || key > best)) best = key, at = j;
    }
    last = best;
    v[r] = x[at];
    idx[r] = at;
  }
  const float sum = c->renormalize ? router_sum(v, k) : 1.0f;
  char *ow = imoe_row_base(c->weights, t), *oi = imoe_row_base(c->indices, t);
  for (int64_t r = 0; r < k; r++) {
    imoe_store_float(ow + r * c->weights->n_stride, c->weights->dtype, c->renormalize ? v[r] / sum : v[r]);
    imoe_store_index(oi + r * c->indices->n_stride, c->indices->dtype, idx[r]);
  }
  return IMOE_OK;
}

imoe_status imoe_topk_softmax(const imoe_view *logits, int64_t k, int32_t renormalize,
                              const imoe_view *out_weights, const imoe_view *out_indices,
                              const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_check_matrix(logits, "logits", IMOE_SCORE_DTYPES, -1, -1, 0, 0, err);
  if (st != IMOE_OK) return st;
  const int64_t t_n = logits->lead_shape[0], e_n = logits->n;
  if (e_n < 1 || e_n > IMOE_MOE_MAX_EXPERTS) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "logits: %" PRId64 " experts; 1 to %d are supported",
                     e_n, IMOE_MOE_MAX_EXPERTS);
  }
  const int64_t k_max = e_n < IMOE_ROUTER_MAX_K ? e_n : IMOE_ROUTER_MAX_K;
  if (k < 1 || k > k_max) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "k = %" PRId64 " is outside [1, min(experts = %" PRId64 ", %d)]", k, e_n,
                     IMOE_ROUTER_MAX_K);
  }
  st = imoe_check_matrix(out_weights, "out_weights", IMOE_SCORE_DTYPES, t_n, k, 1, 0, err);
  if (st == IMOE_OK)
    st = imoe_check_matrix(out_indices, "out_indices", IMOE_INDEX_DTYPES, t_n, k, 1, 0, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  const imoe_call_args call = {NULL, 0, NULL, {logits}, {"logits"},
                               {out_weights, out_indices}, {"out_weights", "out_indices"}, NULL, 0};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK || t_n == 0) return st;
  if (imoe_on_cuda(exec))
    return imoe_cuda_topk_softmax(logits, k, renormalize, out_weights, out_indices, exec, err);
  router_ctx c = {logits, out_weights, out_indices, k, renormalize != 0, 0, 0};
  c.width = router_width(e_n, &c.pow2);
  const imoe_stage stage = {route_row, &c, t_n};
  return imoe_run_stages(&stage, 1, (size_t)c.pow2 * sizeof(float),
                         imoe_thread_count(exec, t_n * e_n * 4 * 8, t_n), err);
}
