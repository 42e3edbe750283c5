// imoe_moe_backward.cu: the MoE backward kernels on the device
// (imoe_gated_act_backward, imoe_moe_gather_rows, imoe_moe_weight_grad;
// contract in idempotent_moe.h, "MoE backward", CPU core in
// csrc/moe_backward.c). Every launch is on the caller's stream; no host
// synchronisation.
//   k_bwd_dest_check  a block per 8,192 entries (at most 256): dest checked
//                     against [-1, R); a bad entry is
//                     a recorded IMOE_ERR_INDEX_RANGE and the call's verdict,
//                     which the kernels after it read (nothing is written);
//                     the kept entries counted;
//   k_bwd_zero_rows   the gather's output zeroed (grid-stride; 16-byte
//                     stores where out's rows are whole aligned 16-byte
//                     chunks), unless the dest check counted R kept entries
//                     (every row is then written by the gather: a dropless
//                     dispatch's rows);
//   k_bwd_gather      one block per assignment (grid-stride): its token's row
//                     times its weight into its row (16-byte chunks where
//                     src and out also share a dtype and align: a copy, or
//                     each element's product rounded as one at a time);
//   k_bwd_weight_grad one warp per assignment: the dot product in the core's
//                     order (lane l sums h = l mod 32 in increasing h, then
//                     p[l] += p[l + s], s = 16 .. 1), the CPU's bits;
//   k_bwd_gated_act   one warp per row, 16-byte chunks where aligned:
//                     d(gate), d(up), and when asked the forward's value
//                     times the row's scale and the row's dot product with
//                     grad (the core's order); rows past the limit zero.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <string.h>

#include "imoe_act.cuh"
#include "imoe_device.cuh"
#include "imoe_launch.cuh"

namespace imoe_cu_bwd {
using namespace imoe_cu;

constexpr int kThreads = 256;

__device__ __forceinline__ float ld(const char *p, int dt) {
  if (dt == IMOE_DTYPE_F32) return *reinterpret_cast<const float *>(p);
  if (dt == IMOE_DTYPE_F16) return __half2float(*reinterpret_cast<const __half *>(p));
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16 *>(p));
}

__device__ __forceinline__ void st(char *p, int dt, float v) {
  if (dt == IMOE_DTYPE_F32) *reinterpret_cast<float *>(p) = v;
  else if (dt == IMOE_DTYPE_F16) *reinterpret_cast<__half *>(p) = __float2half_rn(v);
  else *reinterpret_cast<__nv_bfloat16 *>(p) = __float2bfloat16_rn(v);
}

__device__ __forceinline__ int esize(int dt) { return dt == IMOE_DTYPE_F32 ? 4 : 2; }

// A [T, k] index matrix: element (t, j) at data + t * row + j * col.
struct Idx {
  const char *data;
  int64_t row, col;
  int32_t dtype, aligned;
};

__device__ __forceinline__ int64_t idx_at(const Idx &m, int64_t t, int64_t j) {
  return load_index(m.data + t * m.row + j * m.col, m.dtype, m.aligned != 0);
}

struct BwdParams {
  Idx dest;
  const char *a, *b, *w;  // gather: a = src, w = weights or null; weight grad: a, b
  int64_t a_row, b_row, w_row, w_col;
  char *out;
  int64_t out_row, out_col;
  int64_t T, R, H;
  int32_t k, adt, bdt, wdt, odt, a_by_row;
  int32_t out_vec, gather_vec;  // 16-byte chunks: out's rows (zeroing); src's and out's rows (gather)
  int32_t check_blocks;         // blocks of k_bwd_dest_check: its verdict words
  uint32_t token;
  StatusWords words;
};

// The call's kept dest entries, counted by the dest check's blocks: per
// verdict slot, the call's token (high 32 bits) and its count so far (low
// 32). A block finding another token in the slot (an earlier call's) starts
// the count afresh. Kept entries are distinct (the contract), so R of them
// name every row: the gather then writes every row and needs no zeroing pass.
__device__ unsigned long long g_kept[kSlots];

__device__ __forceinline__ void add_kept(uint32_t token, unsigned long long n) {
  unsigned long long *w = &g_kept[token % kSlots], old = *w, seen;
  do {
    seen = old;
    const unsigned long long ours = seen >> 32 == token ? seen + n : ((unsigned long long)token << 32) | n;
    old = atomicCAS(w, seen, ours);
  } while (old != seen);
}

// check_blocks blocks of 1024, each over its share of dest: a verdict word
// each, and its kept entries added to the call's count.
__global__ void __launch_bounds__(1024) k_bwd_dest_check(const __grid_constant__ BwdParams p) {
  __shared__ unsigned long long kept;
  if (threadIdx.x == 0) kept = 0;
  __syncthreads();
  const int64_t n = p.T * p.k, per = (n + gridDim.x - 1) / gridDim.x;
  const int64_t lo = blockIdx.x * per < n ? blockIdx.x * per : n, hi = lo + per < n ? lo + per : n;
  bool bad = false;
  unsigned long long mine = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const int64_t d = idx_at(p.dest, i / p.k, i % p.k);
    bad |= d < -1 || d >= p.R;
    mine += d >= 0;
  }
  atomicAdd(&kept, mine);
  block_verdict(p.words, p.token, bad, IMOE_ERR_INDEX_RANGE);  // its barrier orders the sum
  if (threadIdx.x == 0 && p.token) add_kept(p.token, kept);
}

// Whether the dest check counted R kept entries for this call (read past L1,
// as verdicts are; the check's grid has completed).
__device__ __forceinline__ bool every_row_named(const BwdParams &p) {
  if (!p.token) return false;
  const unsigned long long w = __ldcg(&g_kept[p.token % kSlots]);
  return w >> 32 == p.token && (w & 0xFFFFFFFFull) == (unsigned long long)p.R;
}

__global__ void __launch_bounds__(kThreads) k_bwd_zero_rows(const __grid_constant__ BwdParams p) {
  if (call_aborted(p.words, p.token, p.check_blocks) || every_row_named(p)) return;
  if (p.out_vec) {  // 16-byte stores: rows of whole 16-byte chunks, 16-byte aligned
    const int64_t per_row = p.H * esize(p.odt) / 16;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.R * per_row;
         i += (int64_t)gridDim.x * blockDim.x) {
      const int64_t r = i / per_row, c = i - r * per_row;
      reinterpret_cast<uint4 *>(p.out + r * p.out_row)[c] = make_uint4(0u, 0u, 0u, 0u);
    }
    return;
  }
  const int size = esize(p.odt);
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.R * p.H;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / p.H, h = i - r * p.H;
    st(p.out + r * p.out_row + h * size, p.odt, 0.0f);
  }
}

// One 16-byte chunk of a row (16 / size elements of dtype dt) times w, each
// product rounded as the scalar path rounds it (w == 1 and no weights: the
// values themselves, whose conversion round trip is exact).
__device__ __forceinline__ uint4 scale_chunk(uint4 v, int dt, float w) {
  char *b = reinterpret_cast<char *>(&v);
  const int size = esize(dt);
  for (int e = 0; e < 16; e += size) st(b + e, dt, __fmul_rn(w, ld(b + e, dt)));
  return v;
}

__global__ void __launch_bounds__(kThreads) k_bwd_gather(const __grid_constant__ BwdParams p) {
  if (call_aborted(p.words, p.token, p.check_blocks)) return;
  const int asize = esize(p.adt), osize = esize(p.odt);
  for (int64_t item = blockIdx.x; item < p.T * p.k; item += gridDim.x) {
    const int64_t t = item / p.k, j = item - t * p.k;
    const int64_t d = idx_at(p.dest, t, j);
    if (d < 0) continue;
    const float w = p.w ? ld(p.w + t * p.w_row + j * p.w_col, p.wdt) : 1.0f;
    const char *src = p.a + t * p.a_row;
    char *out = p.out + d * p.out_row;
    if (p.gather_vec) {  // src and out of one dtype, both rows of whole aligned 16-byte chunks
      const int64_t chunks = p.H * osize / 16;
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
        const uint4 v = reinterpret_cast<const uint4 *>(src)[c];
        reinterpret_cast<uint4 *>(out)[c] = p.w ? scale_chunk(v, p.odt, w) : v;
      }
      continue;
    }
    for (int64_t h = threadIdx.x; h < p.H; h += blockDim.x) {
      const float v = ld(src + h * asize, p.adt);
      st(out + h * osize, p.odt, p.w ? __fmul_rn(w, v) : v);
    }
  }
}

__global__ void __launch_bounds__(kThreads) k_bwd_weight_grad(const __grid_constant__ BwdParams p) {
  if (call_aborted(p.words, p.token, p.check_blocks)) return;
  const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
  const int asize = esize(p.adt), bsize = esize(p.bdt);
  for (int64_t item = (int64_t)blockIdx.x * warps + threadIdx.x / 32; item < p.T * p.k;
       item += (int64_t)gridDim.x * warps) {
    const int64_t t = item / p.k, j = item - t * p.k;
    const int64_t d = idx_at(p.dest, t, j);
    float s = 0.0f;
    if (d >= 0) {
      const char *a = p.a + (p.a_by_row ? d : t) * p.a_row, *b = p.b + d * p.b_row;
      for (int64_t h = lane; h < p.H; h += 32)
        s = __fadd_rn(s, __fmul_rn(ld(a + h * asize, p.adt), ld(b + h * bsize, p.bdt)));
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) s = __fadd_rn(s, __shfl_down_sync(0xFFFFFFFFu, s, o));
    }
    if (lane == 0) st(p.out + t * p.out_row + j * p.out_col, p.odt, s);
  }
}

struct ActBwdParams {
  const char *in, *grad, *scale;
  int64_t in_row, grad_row, scale_row;
  char *out, *act_out, *dot;  // act_out, dot: null when not asked for
  int64_t out_row, act_row, dot_row;
  InView limit;  // [E] offsets, or data null
  int64_t limit_last;
  int64_t R, I;
  int32_t act, dt, gdt, sdt;
};

// act(x) and act'(x) in F32 (the CPU core's formulas).
__device__ __forceinline__ float act_slope(float x, int act, float *slope) {
  switch (act) {
    case IMOE_ACT_SILU: {
      const float s = 1.0f / (1.0f + expf(-x));
      *slope = s * (1.0f + x * (1.0f - s));
      return x * s;
    }
    case IMOE_ACT_GELU: {
      const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752440f));
      const float pdf = 0.39894228040143267794f * expf(-0.5f * x * x);
      *slope = cdf + x * pdf;
      return x * cdf;
    }
    case IMOE_ACT_GELU_TANH: {
      const float beta = 0.7978845608028654f, kappa = 0.044715f;
      const float x2 = x * x;
      const float t = tanhf(beta * (x + kappa * x2 * x));
      *slope = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * beta * (1.0f + 3.0f * kappa * x2);
      return 0.5f * x * (1.0f + t);
    }
    default:
      *slope = x > 0.0f ? 1.0f : 0.0f;
      return x > 0.0f ? x : 0.0f;
  }
}

constexpr int kChunk = 8;  // features per lane and step: 16 bytes of a 2-byte dtype

// n <= kChunk elements of dtype dt from p into x: one 16-byte load when VEC.
template <bool VEC>
__device__ __forceinline__ void load_chunk(const char *p, int dt, int n, float *x) {
  if (VEC) {
    const uint4 v = *reinterpret_cast<const uint4 *>(p);
    const char *b = reinterpret_cast<const char *>(&v);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) x[e] = ld(b + 2 * e, dt);
  } else {
    const int size = esize(dt);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) x[e] = e < n ? ld(p + e * size, dt) : 0.0f;
  }
}

template <bool VEC>
__device__ __forceinline__ void store_chunk(char *p, int dt, int n, const float *x) {
  if (VEC) {
    uint4 v;
    char *b = reinterpret_cast<char *>(&v);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) st(b + 2 * e, dt, x[e]);
    *reinterpret_cast<uint4 *>(p) = v;
  } else {
    const int size = esize(dt);
#pragma unroll
    for (int e = 0; e < kChunk; ++e)
      if (e < n) st(p + e * size, dt, x[e]);
  }
}

// One warp per row (grid-stride); lane l takes the chunks of 8 features
// c = l, l + 32, ...: d(gate), d(up), and when asked the forward's value
// times the row's scale (act_out) and the dot product in the core's order
// (lane l sums feature i with (i / 8) mod 32 = l in increasing i, then
// p[l] += p[l + s], s = 16 .. 1). VEC: a 2-byte dtype DT throughout, I % 8
// == 0, every row 16-byte aligned; DT and ACT fixed at compile time there
// (no per-element switch), read from p elsewhere (DT, ACT = -1). act_out
// may be grad: a lane loads its chunk of grad before it stores act_out's.
template <int DT, int ACT, bool VEC>
__global__ void __launch_bounds__(kThreads, 4) k_bwd_gated_act(const __grid_constant__ ActBwdParams p) {
  const int dt = DT >= 0 ? DT : p.dt, gdt = DT >= 0 ? DT : p.gdt, act = ACT >= 0 ? ACT : p.act;
  int64_t rows = p.R;
  if (p.limit.data) {
    const int64_t end = load_index(p.limit.data + p.limit_last * p.limit.n_stride, p.limit.dtype,
                                   p.limit.aligned != 0);
    rows = end < 0 ? 0 : end < p.R ? end : p.R;
  }
  const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
  const int size = esize(dt), gsize = esize(gdt);
  const int64_t chunks = (p.I + kChunk - 1) / kChunk;
  const bool fwd = p.act_out != nullptr || p.dot != nullptr;
  for (int64_t r = (int64_t)blockIdx.x * warps + threadIdx.x / 32; r < p.R; r += (int64_t)gridDim.x * warps) {
    char *out = p.out + r * p.out_row;
    char *ao = p.act_out ? p.act_out + r * p.act_row : nullptr;
    const bool live = r < rows;
    const float w = live && p.scale ? ld(p.scale + r * p.scale_row, p.sdt) : 1.0f;
    const char *in = p.in + r * p.in_row, *grad = p.grad + r * p.grad_row;
    float sum = 0.0f;
    for (int64_t c = lane; c < chunks; c += 32) {
      const int64_t i0 = c * kChunk;
      const int n = p.I - i0 < kChunk ? (int)(p.I - i0) : kChunk;
      float dg[kChunk], du[kChunk], a[kChunk];
      if (live) {
        float g[kChunk], u[kChunk], d[kChunk];
        load_chunk<VEC>(in + i0 * size, dt, n, g);
        load_chunk<VEC>(in + (p.I + i0) * size, dt, n, u);
        load_chunk<VEC>(grad + i0 * gsize, gdt, n, d);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) {
          float slope;
          const float b = act_slope(g[e], act, &slope);
          const float ds = p.scale ? __fmul_rn(d[e], w) : d[e];
          dg[e] = ds * u[e] * slope;
          du[e] = ds * b;
          if (fwd) {
            const float f = round_to(gated(g[e], u[e], act, dt), dt);
            if (e < n) sum = __fadd_rn(sum, __fmul_rn(d[e], f));
            a[e] = p.scale ? __fmul_rn(f, w) : f;
          }
        }
      } else {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) dg[e] = du[e] = a[e] = 0.0f;
      }
      store_chunk<VEC>(out + i0 * size, dt, n, dg);
      store_chunk<VEC>(out + (p.I + i0) * size, dt, n, du);
      if (ao) store_chunk<VEC>(ao + i0 * size, dt, n, a);
    }
    if (p.dot) {
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) sum = __fadd_rn(sum, __shfl_down_sync(0xFFFFFFFFu, sum, o));
      if (lane == 0) *reinterpret_cast<float *>(p.dot + r * p.dot_row) = sum;
    }
  }
}

namespace {

Idx idx_of(const imoe_view *v) {
  Idx m;
  m.data = static_cast<const char *>(v->data);
  m.row = v->lead_ndim ? v->lead_stride[0] : 0;
  m.col = v->n_stride;
  m.dtype = v->dtype;
  const int64_t size = dtype_size(v->dtype);
  m.aligned = (uintptr_t)m.data % size == 0 && m.row % size == 0 && m.col % size == 0;
  return m;
}

unsigned grid_of(int64_t items, const DevInfo *di) {
  const int64_t cap = (int64_t)di->sms * 8;
  return (unsigned)(items < 1 ? 1 : items < cap ? items : cap);
}

template <int DT>
cudaError_t launch_act_bwd(int act, unsigned grid, cudaStream_t s, const ActBwdParams &p) {
  switch (act) {
    case IMOE_ACT_SILU: return launch(k_bwd_gated_act<DT, IMOE_ACT_SILU, true>, shape(grid, kThreads), s, p);
    case IMOE_ACT_GELU: return launch(k_bwd_gated_act<DT, IMOE_ACT_GELU, true>, shape(grid, kThreads), s, p);
    case IMOE_ACT_GELU_TANH:
      return launch(k_bwd_gated_act<DT, IMOE_ACT_GELU_TANH, true>, shape(grid, kThreads), s, p);
    default: return launch(k_bwd_gated_act<DT, IMOE_ACT_RELU, true>, shape(grid, kThreads), s, p);
  }
}

// The 16-byte kernel of a 2-byte dtype, its activation fixed.
cudaError_t launch_act_bwd(bool bf16, int act, unsigned grid, cudaStream_t s, const ActBwdParams &p) {
  return bf16 ? launch_act_bwd<IMOE_DTYPE_BF16>(act, grid, s, p) : launch_act_bwd<IMOE_DTYPE_F16>(act, grid, s, p);
}

// The params every dest-reading call shares, and its check kernel launched.
bool aligned16(const void *ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

cudaError_t begin(const imoe_view *dest, int64_t rows, DevInfo *di, cudaStream_t s, BwdParams *p) {
  memset(p, 0, sizeof *p);
  p->dest = idx_of(dest);
  p->T = dest->lead_shape[0];
  p->k = (int32_t)dest->n;
  p->R = rows;
  p->words = di->words;
  p->token = next_token();
  p->check_blocks = dest_check_blocks(p->T * p->k, kThreads);  // the backward's blocks read them
  return launch(k_bwd_dest_check, shape((unsigned)p->check_blocks, 1024), s, *p);
}

}  // namespace
}  // namespace imoe_cu_bwd

using namespace imoe_cu_bwd;

extern "C" {

imoe_status imoe_cuda_moe_gather_rows(const imoe_view *src, const imoe_view *dest, const imoe_view *weights,
                                      const imoe_view *out, const imoe_exec *exec, imoe_error *err) {
  const char *fn = "imoe_cuda_moe_gather_rows";
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t stream = static_cast<cudaStream_t>(exec->stream);
  BwdParams p;
  cudaError_t e = begin(dest, out->lead_shape[0], di, stream, &p);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_bwd_dest_check", e);
  p.a = static_cast<const char *>(src->data);
  p.a_row = src->lead_ndim ? src->lead_stride[0] : 0;
  p.adt = src->dtype;
  if (weights) {
    p.w = static_cast<const char *>(weights->data);
    p.w_row = weights->lead_ndim ? weights->lead_stride[0] : 0;
    p.w_col = weights->n_stride;
    p.wdt = weights->dtype;
  }
  p.out = static_cast<char *>(out->data);
  p.out_row = out->lead_stride[0];
  p.odt = out->dtype;
  p.H = out->n;
  // Whole, aligned 16-byte chunks (rows contiguous: the core checked it).
  const int64_t row_bytes = p.H * (p.odt == IMOE_DTYPE_F32 ? 4 : 2);
  p.out_vec = row_bytes % 16 == 0 && (p.R < 2 || p.out_row % 16 == 0) && aligned16(p.out);
  p.gather_vec = p.out_vec && p.adt == p.odt && (p.T < 2 || p.a_row % 16 == 0) && aligned16(p.a);
  if (p.R * p.H > 0) {
    const int64_t items = p.out_vec ? p.R * (row_bytes / 16) : p.R * p.H;
    e = launch(k_bwd_zero_rows, shape(grid_of((items + kThreads - 1) / kThreads, di), kThreads), stream, p);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_bwd_zero_rows", e);
  }
  if (p.T * p.k > 0 && p.H > 0) {
    e = launch(k_bwd_gather, shape(grid_of(p.T * p.k, di), kThreads), stream, p);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_bwd_gather", e);
  }
  return IMOE_OK;
}

imoe_status imoe_cuda_moe_weight_grad(const imoe_view *a, int32_t a_by_row, const imoe_view *b,
                                      const imoe_view *dest, const imoe_view *out, const imoe_exec *exec,
                                      imoe_error *err) {
  const char *fn = "imoe_cuda_moe_weight_grad";
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t stream = static_cast<cudaStream_t>(exec->stream);
  BwdParams p;
  cudaError_t e = begin(dest, b->lead_shape[0], di, stream, &p);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_bwd_dest_check", e);
  p.a = static_cast<const char *>(a->data);
  p.a_row = a->lead_ndim ? a->lead_stride[0] : 0;
  p.adt = a->dtype;
  p.a_by_row = a_by_row;
  p.b = static_cast<const char *>(b->data);
  p.b_row = b->lead_ndim ? b->lead_stride[0] : 0;
  p.bdt = b->dtype;
  p.out = static_cast<char *>(out->data);
  p.out_row = out->lead_ndim ? out->lead_stride[0] : 0;
  p.out_col = out->n_stride;
  p.odt = out->dtype;
  p.H = b->n;
  const int warps = kThreads / 32;
  e = launch(k_bwd_weight_grad, shape(grid_of((p.T * p.k + warps - 1) / warps, di), kThreads), stream, p);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_bwd_weight_grad", e);
  return IMOE_OK;
}

imoe_status imoe_cuda_gated_act_backward(const imoe_view *gate_up, const imoe_view *grad_act, imoe_act act,
                                         const imoe_view *limit, const imoe_view *row_scale,
                                         const imoe_view *grad_gate_up, const imoe_view *act_out,
                                         const imoe_view *row_dot, const imoe_exec *exec, imoe_error *err) {
  const char *fn = "imoe_cuda_gated_act_backward";
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t stream = static_cast<cudaStream_t>(exec->stream);
  ActBwdParams p;
  memset(&p, 0, sizeof p);
  p.in = static_cast<const char *>(gate_up->data);
  p.in_row = gate_up->lead_stride[0];
  p.grad = static_cast<const char *>(grad_act->data);
  p.grad_row = grad_act->lead_stride[0];
  p.out = static_cast<char *>(grad_gate_up->data);
  p.out_row = grad_gate_up->lead_stride[0];
  if (row_scale) {
    p.scale = static_cast<const char *>(row_scale->data);
    p.scale_row = row_scale->lead_stride[0];
    p.sdt = row_scale->dtype;
  }
  if (act_out) {
    p.act_out = static_cast<char *>(act_out->data);
    p.act_row = act_out->lead_stride[0];
  }
  if (row_dot) {
    p.dot = static_cast<char *>(row_dot->data);
    p.dot_row = row_dot->lead_stride[0];
  }
  if (limit) {
    p.limit.data = static_cast<char *>(limit->data);
    p.limit.n_stride = limit->n_stride;
    p.limit.dtype = limit->dtype;
    const int64_t size = dtype_size(limit->dtype);
    p.limit.aligned = (uintptr_t)limit->data % size == 0 && limit->n_stride % size == 0;
    p.limit_last = limit->n - 1;
  }
  p.R = gate_up->lead_shape[0];
  p.I = grad_act->n;
  p.act = act;
  p.dt = gate_up->dtype;
  p.gdt = grad_act->dtype;
  // 16-byte chunks: a 2-byte dtype throughout, every row start 16-byte aligned.
  const auto at16 = [](const void *ptr, int64_t row) { return (uintptr_t)ptr % 16 == 0 && row % 16 == 0; };
  const bool vec = p.dt != IMOE_DTYPE_F32 && p.gdt == p.dt && p.I % kChunk == 0 && at16(p.in, p.in_row) &&
                   at16(p.grad, p.grad_row) && at16(p.out, p.out_row) && (!p.act_out || at16(p.act_out, p.act_row));
  const int warps = kThreads / 32;
  const unsigned grid = grid_of((p.R + warps - 1) / warps, di);
  const cudaError_t e = vec ? launch_act_bwd(p.dt == IMOE_DTYPE_BF16, act, grid, stream, p)
                            : launch(k_bwd_gated_act<-1, -1, false>, shape(grid, kThreads), stream, p);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_bwd_gated_act", e);
  return IMOE_OK;
}

}  // extern "C"
