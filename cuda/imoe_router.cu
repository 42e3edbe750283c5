// imoe_router.cu: the router of a sparse-MoE block on the device
// (imoe_topk_softmax; contract and arithmetic in idempotent_moe.h, CPU core
// in csrc/moe_router.c, design in docs/cuda-design.md, "The router").
//   k_topk_softmax  one kernel: W = min(next_pow2(E), 32) lanes per row
//                   (32 / W rows a warp, 4 warps a block), the row's logits
//                   in registers; torch's softmax_warp_forward arithmetic
//                   (lane max, xor-butterfly max, expf, lane sums in slot
//                   order, xor-butterfly sum, division), then torch's CUDA
//                   topk: k rounds of a warp arg-max over the lanes' (radix
//                   key, expert) keys for the k-th largest key, gatherTopK's
//                   write order (above the k-th in expert order, then equal
//                   to it) through shared memory, SmallBitonicSort's 32-slot
//                   network over shuffles, and torch's reduction order for
//                   the renormalising sum (shfl_down B/2 .. 1).
// No allocation, no host synchronisation, no data errors; PDL on sm_90.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <string.h>

#include <initializer_list>

#include "imoe_device.cuh"
#include "imoe_launch.cuh"

namespace imoe_cu {
namespace {

constexpr int kRouterThreads = 128;  // 4 warps a block
constexpr unsigned kFull = 0xFFFFFFFFu;

struct RouterParams {
  const char *logits;
  int64_t l_row, l_col;  // bytes
  char *w;
  int64_t w_row, w_col;
  char *idx;
  int64_t i_row, i_col;
  int64_t T;
  int32_t E, k, renorm, wdt, idt;
};

template <int DT>
__device__ __forceinline__ float load_logit(const char *p) {
  if (DT == IMOE_DTYPE_F32) return *reinterpret_cast<const float *>(p);
  if (DT == IMOE_DTYPE_F16) return __half2float(*reinterpret_cast<const __half *>(p));
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16 *>(p));
}

// torch's radix key (SortingRadixSelect.cuh, TopKTypeConfig<float>::
// convert; csrc/moe_router.c, radix_key): the order-preserving bits, every
// NaN the largest key 0xFFFFFFFF.
__device__ __forceinline__ uint32_t radix_key(float p) {
  if (isnan(p)) return 0xFFFFFFFFu;
  const uint32_t b = __float_as_uint(p);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The selection key of expert e: the radix key above the complement of the
// expert, so every key of a row is distinct and never 0 (0: no candidate).
__device__ __forceinline__ uint64_t rank_key(float p, int e) {
  return ((uint64_t)radix_key(p) << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)e);
}

// GTOp<float, true> (SortingCommon.cuh): NaN above every number.
__device__ __forceinline__ bool gt_nan_first(float a, float b) {
  return (isnan(a) && !isnan(b)) || a > b;
}

// The lane's best key among its available slots (bit i of avail: slot i).
template <int ITERS, int W>
__device__ __forceinline__ uint64_t lane_best(const float (&x)[ITERS], uint32_t avail, int l) {
  uint64_t best = 0;
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const uint64_t key = rank_key(x[i], l + i * W);
    if (((avail >> i) & 1u) && key > best) best = key;
  }
  return best;
}

template <int LOG2, int DT>
__global__ void __launch_bounds__(kRouterThreads) k_topk_softmax(const __grid_constant__ RouterParams p) {
  constexpr int P = 1 << LOG2;
  constexpr int W = P < 32 ? P : 32;  // torch's WARP_SIZE
  constexpr int ITERS = P / W;        // torch's WARP_ITERATIONS
  constexpr int G = 32 / W;           // rows a warp
  griddep_wait();  // the logits are the previous kernel's output
  griddep_launch_dependents();
  const int lane = threadIdx.x & 31, l = lane % W, group = lane / W;
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = (int64_t)gridDim.x * blockDim.x / 32;
  __shared__ float s_val[kRouterThreads];  // the gathered values, W per row
  __shared__ int s_exp[kRouterThreads];    // and experts
  int bsum = 1;  // B: the largest power of two <= k
  while (2 * bsum <= p.k) bsum <<= 1;
  for (int64_t base = warp * G; base < p.T; base += warps * G) {  // uniform in the warp
    const int64_t t = base + group;
    const bool live = t < p.T;
    const char *in = p.logits + (live ? t : 0) * p.l_row;
    float x[ITERS];
    uint32_t avail = 0;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      const int j = l + i * W;
      x[i] = -INFINITY;
      if (live && j < p.E) x[i] = load_logit<DT>(in + j * p.l_col);
      if (j < p.E) avail |= 1u << i;
    }
    // softmax_warp_forward, step for step
    float m = x[0];
#pragma unroll
    for (int i = 1; i < ITERS; ++i) m = m > x[i] ? m : x[i];
#pragma unroll
    for (int o = W / 2; o > 0; o /= 2) {
      const float b = __shfl_xor_sync(kFull, m, o, W);
      m = m < b ? b : m;
    }
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      x[i] = expf(x[i] - m);
      s += x[i];
    }
#pragma unroll
    for (int o = W / 2; o > 0; o /= 2) s += __shfl_xor_sync(kFull, s, o, W);
#pragma unroll
    for (int i = 0; i < ITERS; ++i) x[i] = x[i] / s;
    // top-k as torch's CUDA topk orders it (idempotent_moe.h; csrc/moe_router.c,
    // torch_cuda_topk). 1. The k-th largest radix key: k rounds of a warp
    // arg-max over the (radix key, expert complement) keys, each taking one.
    const uint32_t in_range = avail;
    uint64_t mine = lane_best<ITERS, W>(x, avail, l), best = 0;
    for (int r = 0; r < p.k; ++r) {
      best = mine;
#pragma unroll
      for (int o = W / 2; o > 0; o /= 2) {
        const uint64_t other = __shfl_xor_sync(kFull, best, o, W);
        best = other > best ? other : best;
      }
      const int e = (int)(0xFFFFFFFFu - (uint32_t)best);
      if (e % W == l) {
        avail &= ~(1u << (e / W));
        mine = lane_best<ITERS, W>(x, avail, l);
      }
    }
    const uint32_t kth = (uint32_t)(best >> 32);
    // 2. gatherTopK's write order, through this row's W slots of shared
    // memory: the keys above the k-th in expert order (slot i, then lane),
    // then those equal to it in expert order while fewer than k are written.
    const unsigned below = (1u << lane) - 1u;  // the warp's lanes below this one
    const unsigned mine_group = W == 32 ? kFull : ((1u << W) - 1u) << (group * W);
    float *sv = s_val + (threadIdx.x - lane) + group * W;
    int *se = s_exp + (threadIdx.x - lane) + group * W;
    int n = 0;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      const bool take = ((in_range >> i) & 1u) && radix_key(x[i]) > kth;
      const unsigned b = __ballot_sync(kFull, take) & mine_group;
      if (take) sv[n + __popc(b & below)] = x[i], se[n + __popc(b & below)] = l + i * W;
      n += __popc(b);
    }
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      const bool take = ((in_range >> i) & 1u) && radix_key(x[i]) == kth;
      const unsigned b = __ballot_sync(kFull, take) & mine_group;
      const int at = n + __popc(b & below);
      if (take && at < p.k) sv[at] = x[i], se[at] = l + i * W;
      n += __popc(b);
    }
    __syncwarp();
    // 3. SmallBitonicSort (k >= 2): the 32-slot bitonic network with the k
    // gathered pairs valid at the front, slot l in lane l. A pair (l, l ^ s)
    // with s >= W never exchanges (its upper slot is invalid and the stage's
    // direction is false there), so a W-lane row runs only the strides < W.
    float my_v = l < p.k ? sv[l] : 0.0f;
    int my_e = l < p.k ? se[l] : -1;  // -1: an invalid slot
    __syncwarp();
    if (p.k > 1) {
#pragma unroll
      for (int size = 2; size <= 32; size *= 2) {
#pragma unroll
        for (int st = size / 2; st > 0; st /= 2) {
          if (st >= W) continue;
          const float o_v = __shfl_xor_sync(kFull, my_v, st, W);
          const int o_e = __shfl_xor_sync(kFull, my_e, st, W);
          const bool upper = (l & st) != 0;
          const float ka = upper ? o_v : my_v, kb = upper ? my_v : o_v;
          const bool va = (upper ? o_e : my_e) >= 0, vb = (upper ? my_e : o_e) >= 0;
          const bool dir = (l & size) != 0;  // bitonicSort's flag; false in the final merge
          const bool swap = (gt_nan_first(ka, kb) && va) || !vb;
          if (swap == dir) my_v = o_v, my_e = o_e;
        }
      }
    }
    // torch's sum over the k values: lane l < B adds v[l + B], then shfl_down B/2 .. 1
    float sum = 1.0f;
    if (p.renorm) {
      const float v = l < p.k ? my_v : 0.0f;
      const float hi = __shfl_down_sync(kFull, v, bsum, W);
      float part = l + bsum < p.k ? v + hi : v;
      for (int o = bsum / 2; o > 0; o /= 2) part = part + __shfl_down_sync(kFull, part, o, W);
      sum = __shfl_sync(kFull, part, 0, W);
    }
    if (live && l < p.k) {
      const float w = p.renorm ? my_v / sum : my_v;
      char *wp = p.w + t * p.w_row + l * p.w_col;
      if (p.wdt == IMOE_DTYPE_F32) *reinterpret_cast<float *>(wp) = w;
      else if (p.wdt == IMOE_DTYPE_F16) *reinterpret_cast<__half *>(wp) = __float2half_rn(w);
      else *reinterpret_cast<__nv_bfloat16 *>(wp) = __float2bfloat16_rn(w);
      char *ip = p.idx + t * p.i_row + l * p.i_col;
      if (p.idt == IMOE_DTYPE_I32) *reinterpret_cast<int32_t *>(ip) = my_e;
      else *reinterpret_cast<int64_t *>(ip) = my_e;
    }
  }
}

template <int DT>
cudaError_t launch_router(int log2, const LaunchShape &s, cudaStream_t st, const RouterParams &rp) {
  switch (log2) {
    case 0: return launch(k_topk_softmax<0, DT>, s, st, rp);
    case 1: return launch(k_topk_softmax<1, DT>, s, st, rp);
    case 2: return launch(k_topk_softmax<2, DT>, s, st, rp);
    case 3: return launch(k_topk_softmax<3, DT>, s, st, rp);
    case 4: return launch(k_topk_softmax<4, DT>, s, st, rp);
    case 5: return launch(k_topk_softmax<5, DT>, s, st, rp);
    case 6: return launch(k_topk_softmax<6, DT>, s, st, rp);
    case 7: return launch(k_topk_softmax<7, DT>, s, st, rp);
    case 8: return launch(k_topk_softmax<8, DT>, s, st, rp);
    case 9: return launch(k_topk_softmax<9, DT>, s, st, rp);
    default: return launch(k_topk_softmax<10, DT>, s, st, rp);
  }
}

}  // namespace
}  // namespace imoe_cu

using namespace imoe_cu;

extern "C" {

imoe_status imoe_cuda_topk_softmax(const imoe_view *logits, int64_t k, int32_t renormalize,
                                   const imoe_view *out_weights, const imoe_view *out_indices,
                                   const imoe_exec *exec, imoe_error *err) {
  const char *fn = "imoe_cuda_topk_softmax";
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  for (const imoe_view *v : {logits, out_weights, out_indices}) {
    const int64_t size = dtype_size(v->dtype);
    if ((uintptr_t)v->data % size || v->lead_stride[0] % size || v->n_stride % size)
      return fail(err, IMOE_ERR_ARGUMENT, "%s: logits, out_weights and out_indices must be aligned to their "
                  "element size on CUDA", fn);
  }
  RouterParams rp;
  memset(&rp, 0, sizeof rp);
  rp.logits = static_cast<const char *>(logits->data);
  rp.l_row = logits->lead_stride[0];
  rp.l_col = logits->n_stride;
  rp.w = static_cast<char *>(out_weights->data);
  rp.w_row = out_weights->lead_stride[0];
  rp.w_col = out_weights->n_stride;
  rp.idx = static_cast<char *>(out_indices->data);
  rp.i_row = out_indices->lead_stride[0];
  rp.i_col = out_indices->n_stride;
  rp.T = logits->lead_shape[0];
  rp.E = (int32_t)logits->n;
  rp.k = (int32_t)k;
  rp.renorm = renormalize != 0;
  rp.wdt = out_weights->dtype;
  rp.idt = out_indices->dtype;
  int log2 = 0;
  while ((1 << log2) < rp.E) ++log2;
  const int width = log2 < 5 ? 1 << log2 : 32;
  const int64_t rows_per_block = (int64_t)(kRouterThreads / 32) * (32 / width);
  const int64_t blocks = (rp.T + rows_per_block - 1) / rows_per_block;
  const int64_t cap = (int64_t)di->sms * 16;
  const LaunchShape ls = shape((unsigned)(blocks < cap ? blocks : cap), kRouterThreads, 0, di->cc_major >= 9);
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  cudaError_t e;
  switch (logits->dtype) {
    case IMOE_DTYPE_F32: e = launch_router<IMOE_DTYPE_F32>(log2, ls, st, rp); break;
    case IMOE_DTYPE_F16: e = launch_router<IMOE_DTYPE_F16>(log2, ls, st, rp); break;
    default: e = launch_router<IMOE_DTYPE_BF16>(log2, ls, st, rp); break;
  }
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_topk_softmax", e);
  return IMOE_OK;
}

}  // extern "C"
