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

/* torch's CUDA topk (TensorTopK.cu, SortingRadixSelect.cuh, Sort.cu,
 * SortUtils.cuh; the order is spelt out in idempotent_moe.h), emulated
 * step for step so that equal probabilities come out in torch's order:
 *   1. the k-th largest radix key (TopKTypeConfig<float>::convert: the
 *      order-preserving bits, every NaN the largest key 0xFFFFFFFF);
 *   2. gatherTopK's write order: the experts whose key is above the k-th,
 *      ascending, then those equal to it, ascending, as many as are missing;
 *   3. for k >= 2, sortKeyValueInplace's SmallBitonicSort: the bitonic
 *      network of 32 slots (16 threads x 2) over (value, expert) with the
 *      gathered k valid at the front, bitonicSwap and GTOp<float, true>. */
static uint32_t radix_key(float p) {
  if (isnan(p)) return 0xFFFFFFFFu;
  const uint32_t b = imoe_bits_from_f32(p);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* GTOp<float, true> (SortingCommon.cuh): NaN above every number. */
static int gt_nan_first(float a, float b) { return (isnan(a) && !isnan(b)) || a > b; }

enum { SORT_SLOTS = 32 }; /* SmallBitonicSort: sort_size 32, block_x 16 */

/* bitonicSortKVInPlace<..., block_x = 16, ...> on one slice of n <= 32
 * (value, expert) pairs in place: the same compare-exchanges in the same
 * stages, bitonicSwap's rule (invalid slots always sort to the end). */
static void small_bitonic_sort(float *v, int64_t *e, int64_t n) {
  float key[SORT_SLOTS];
  int64_t val[SORT_SLOTS];
  int ok[SORT_SLOTS];
  for (int i = 0; i < SORT_SLOTS; i++) {
    ok[i] = i < n;
    key[i] = ok[i] ? v[i] : 0.0f;
    val[i] = ok[i] ? e[i] : 0;
  }
  for (int size = 2; size <= SORT_SLOTS; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int t = 0; t < SORT_SLOTS / 2; t++) {
        /* size < 32: flag = t & (size / 2) (the final merge: false) */
        const int dir = size < SORT_SLOTS && (t & (size / 2)) != 0;
        const int a = 2 * t - (t & (stride - 1)), b = a + stride;
        const int swap = (gt_nan_first(key[a], key[b]) && ok[a]) || !ok[b];
        if (swap == dir) {
          const float tk = key[a];
          const int64_t tv = val[a];
          const int to = ok[a];
          key[a] = key[b], val[a] = val[b], ok[a] = ok[b];
          key[b] = tk, val[b] = tv, ok[b] = to;
        }
      }
    }
  }
  for (int64_t i = 0; i < n; i++) v[i] = key[i], e[i] = val[i];
}

/* Steps 1 to 3 on the probabilities x[0 .. e_n): v, idx get the k values
 * and experts in torch's output order. */
static void torch_cuda_topk(const float *x, int64_t e_n, int64_t k, float *v, int64_t *idx) {
  uint32_t top[IMOE_ROUTER_MAX_K]; /* the k largest keys, descending, with repeats */
  int64_t have = 0;
  for (int64_t j = 0; j < e_n; j++) {
    const uint32_t key = radix_key(x[j]);
    if (have == k && key <= top[k - 1]) continue;
    int64_t at = have < k ? have++ : k - 1;
    for (; at > 0 && top[at - 1] < key; at--) top[at] = top[at - 1];
    top[at] = key;
  }
  const uint32_t kth = top[k - 1];
  int64_t n = 0;
  for (int64_t j = 0; j < e_n; j++)
    if (radix_key(x[j]) > kth) v[n] = x[j], idx[n++] = j;
  for (int64_t j = 0; j < e_n && n < k; j++)
    if (radix_key(x[j]) == kth) v[n] = x[j], idx[n++] = j;
  if (k > 1) small_bitonic_sort(v, idx, k); /* sort_size 1: torch leaves it */
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
  float v[IMOE_ROUTER_MAX_K];
  int64_t idx[IMOE_ROUTER_MAX_K];
  torch_cuda_topk(x, e_n, k, v, idx);
  const float sum = c->renormalize ? router_sum(v, k) : 1.0f;
  char *ow = imoe_row_base(c->weights, t), *oi = imoe_row_base(c->indices, t);
  for (int64_t r = 0; r < k; r++) {
    imoe_store_float(ow + r * c->weights->n_stride, c->weights->dtype, c->renormalize ? v[r] / sum : v[r]);
    imoe_store_index(oi + r * c->indices->n_stride, c->indices->dtype, idx[r]);
  }
  return IMOE_OK;
}

imoe_status imoe_topk_softmax_shape(const imoe_view *logits, int64_t k, int64_t out_shape[2],
                                    imoe_error *err) {
  imoe_status st = imoe_check_matrix(logits, "logits", IMOE_SCORE_DTYPES, -1, -1, 0, 0, err);
  if (st != IMOE_OK) return st;
  const int64_t e_n = logits->n;
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
  if (out_shape != NULL) {
    out_shape[0] = logits->lead_shape[0];
    out_shape[1] = k;
  }
  return IMOE_OK;
}

imoe_status imoe_topk_softmax(const imoe_view *logits, int64_t k, int32_t renormalize,
                              const imoe_view *out_weights, const imoe_view *out_indices,
                              const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_topk_softmax_shape(logits, k, NULL, err);
  if (st != IMOE_OK) return st;
  const int64_t t_n = logits->lead_shape[0], e_n = logits->n;
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
