// imoe_moe_gemm.cu: the small-M grouped GEMM of an experts layer on the
// device (imoe_grouped_gemm; contract in idempotent_moe.h, CPU core and
// argument checks in csrc/moe_gemm.c, design in docs/cuda-design.md,
// "The small-M grouped GEMM").
//   k_grouped_gemm  one launch. Block (tile, g): the g-th expert that has
//                   rows (at most min(E, R) groups have any), columns
//                   [tile x kGemmTile, + kGemmTile) of out. Every block reads
//                   all offsets: it finds its expert and judges them (all
//                   blocks see the same offsets, so on bad offsets none
//                   writes and block 0 records IMOE_ERR_INDEX_RANGE). Then,
//                   per chunk of at most max_rows rows, the rows of `a` are
//                   staged in shared memory and each warp streams kGemmCols
//                   K-contiguous weight columns with 16-byte loads
//                   (kGemmUnroll vectors per column in flight per lane).
// Summation order (the CPU core's, bit for bit): lane l of a warp owns the
// 16-byte vectors l, l + 32, ... of a column and accumulates their elements
// in increasing k with fmaf into one F32 sum per (row, column); the 32 lane
// sums are added by the butterfly h = 16, 8, 4, 2, 1 (__shfl_xor_sync) and
// one lane rounds the sum once into out's dtype (round to nearest even).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <string.h>

#include <atomic>

#include "imoe_device.cuh"
#include "imoe_launch.cuh"

namespace imoe_cu {

constexpr int kGemmThreads = 256;
constexpr int kGemmWarps = kGemmThreads / 32;
constexpr int kGemmCols = 4;                        // columns a warp streams at once
constexpr int kGemmUnroll = 2;                      // vectors per column in flight per lane
constexpr int kGemmMaxRows = 8;                     // rows of `a` staged per chunk
constexpr int kGemmTile = kGemmWarps * kGemmCols;   // columns of out per block
static_assert(kGemmMaxRows * kGemmCols <= 32, "one lane writes each (row, column) of a warp");

struct GemmParams {
  const char *a;  // [R, K], rows contiguous
  int64_t a_row;
  const char *w;  // [E, K, N], K contiguous: column (e, n) at w + e * w_e + n * w_n
  int64_t w_e, w_n;
  char *out;  // [R, N]
  int64_t out_row, out_col;
  const char *offs;  // [E] int32
  int64_t offs_stride;
  int32_t E, R, N;
  int32_t nvec;      // 16-byte vectors per column: K x size / 16
  int32_t tiles;     // column tiles: blockIdx.x = group x tiles + tile
  int32_t max_rows;  // rows per chunk (shared memory: max_rows x nvec x 16 bytes)
  int32_t a_vec;     // a's base and row stride are multiples of 16 bytes
  StatusWords words;
};

template <int DT>
struct GemmType {
  static constexpr int kV = DT == IMOE_DTYPE_F32 ? 4 : 8;  // elements per 16-byte vector
  static constexpr int kSize = DT == IMOE_DTYPE_F32 ? 4 : 2;
};

// A weight vector, read once: not cached in L1.
__device__ __forceinline__ uint4 ld_stream(const char *p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// The elements of a 16-byte vector in F32 (exact conversions).
template <int DT>
__device__ __forceinline__ void unpack(const uint4 &q, float (&f)[GemmType<DT>::kV]) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    if (DT == IMOE_DTYPE_F32) {
      f[u] = __uint_as_float(words[u]);
    } else if (DT == IMOE_DTYPE_BF16) {
      f[2 * u] = __uint_as_float(words[u] << 16);
      f[2 * u + 1] = __uint_as_float(words[u] & 0xFFFF0000u);
    } else {
      f[2 * u] = __half2float(__ushort_as_half((unsigned short)(words[u] & 0xFFFFu)));
      f[2 * u + 1] = __half2float(__ushort_as_half((unsigned short)(words[u] >> 16)));
    }
  }
}

template <int DT>
__device__ __forceinline__ void store_out(char *p, float v) {
  if (DT == IMOE_DTYPE_F32) *reinterpret_cast<float *>(p) = v;
  else if (DT == IMOE_DTYPE_F16) *reinterpret_cast<__half *>(p) = __float2half_rn(v);
  else *reinterpret_cast<__nv_bfloat16 *>(p) = __float2bfloat16_rn(v);
}

// One vector v of every column against the M staged rows: k increasing.
template <int DT, int M>
__device__ __forceinline__ void gemm_step(float (&acc)[M][kGemmCols], const uint4 (&wq)[kGemmCols],
                                          const unsigned char *rows, int64_t row_bytes, int v) {
  constexpr int V = GemmType<DT>::kV;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float af[V];
    unpack<DT>(*reinterpret_cast<const uint4 *>(rows + m * row_bytes + (int64_t)v * 16), af);
#pragma unroll
    for (int c = 0; c < kGemmCols; ++c) {
      float wf[V];  // unpacked per row: a shift or a convert, cheaper than holding them all
      unpack<DT>(wq[c], wf);
#pragma unroll
      for (int u = 0; u < V; ++u) acc[m][c] = __fmaf_rn(af[u], wf[u], acc[m][c]);
    }
  }
}

// out[r0 + m, n0 + c] for the M staged rows and this warp's columns.
template <int DT, int M>
__device__ __forceinline__ void gemm_rows(const GemmParams &p, const unsigned char *rows,
                                          const char *const (&col)[kGemmCols], int64_t r0, int n0,
                                          int lane) {
  float acc[M][kGemmCols];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int c = 0; c < kGemmCols; ++c) acc[m][c] = 0.0f;
  const int nvec = p.nvec;
  const int64_t row_bytes = (int64_t)nvec * 16;
  int v = lane;
  for (; v + 32 * (kGemmUnroll - 1) < nvec; v += 32 * kGemmUnroll) {
    uint4 wq[kGemmUnroll][kGemmCols];
#pragma unroll
    for (int u = 0; u < kGemmUnroll; ++u)
#pragma unroll
      for (int c = 0; c < kGemmCols; ++c) wq[u][c] = ld_stream(col[c] + (int64_t)(v + 32 * u) * 16);
#pragma unroll
    for (int u = 0; u < kGemmUnroll; ++u) gemm_step<DT, M>(acc, wq[u], rows, row_bytes, v + 32 * u);
  }
  for (; v < nvec; v += 32) {  // the last vectors, fewer than kGemmUnroll per lane
    uint4 wq[kGemmCols];
#pragma unroll
    for (int c = 0; c < kGemmCols; ++c) wq[c] = ld_stream(col[c] + (int64_t)v * 16);
    gemm_step<DT, M>(acc, wq, rows, row_bytes, v);
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int c = 0; c < kGemmCols; ++c)
#pragma unroll
      for (int h = 16; h > 0; h >>= 1) acc[m][c] = __fadd_rn(acc[m][c], __shfl_xor_sync(0xFFFFFFFFu, acc[m][c], h));
  constexpr int size = GemmType<DT>::kSize;
  (void)size;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int c = 0; c < kGemmCols; ++c)
      if (lane == m * kGemmCols + c && n0 + c < p.N)
        store_out<DT>(p.out + (r0 + m) * p.out_row + (int64_t)(n0 + c) * p.out_col, acc[m][c]);
}

// Rows [r0, r0 + rows) of a into shared memory, row m at m x nvec x 16 bytes.
template <int DT>
__device__ __forceinline__ void stage_rows(const GemmParams &p, unsigned char *rows_smem, int64_t r0, int rows) {
  const int64_t nvec = p.nvec;
  if (p.a_vec) {
    for (int64_t i = threadIdx.x; i < rows * nvec; i += blockDim.x) {
      const int64_t m = i / nvec, v = i - m * nvec;
      *reinterpret_cast<uint4 *>(rows_smem + i * 16) =
          *reinterpret_cast<const uint4 *>(p.a + (r0 + m) * p.a_row + v * 16);
    }
    return;
  }
  constexpr int size = GemmType<DT>::kSize;
  const int64_t k_n = nvec * 16 / size;
  for (int64_t i = threadIdx.x; i < rows * k_n; i += blockDim.x) {
    const int64_t m = i / k_n, k = i - m * k_n;
    const char *src = p.a + (r0 + m) * p.a_row + k * size;
    if (size == 4) *reinterpret_cast<uint32_t *>(rows_smem + i * 4) = *reinterpret_cast<const uint32_t *>(src);
    else *reinterpret_cast<uint16_t *>(rows_smem + i * 2) = *reinterpret_cast<const uint16_t *>(src);
  }
}

__device__ __forceinline__ int32_t gemm_offset(const GemmParams &p, int e) {
  return *reinterpret_cast<const int32_t *>(p.offs + (int64_t)e * p.offs_stride);
}

template <int DT>
__global__ void __launch_bounds__(kGemmThreads, 2) k_grouped_gemm(const __grid_constant__ GemmParams p) {
  extern __shared__ __align__(16) unsigned char rows_smem[];
  __shared__ int s_count[kGemmWarps];
  __shared__ int s_e, s_lo, s_hi;
  griddep_wait();  // offsets and a may come from the kernel before
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile = blockIdx.x % p.tiles, group = blockIdx.x / p.tiles;
  if (threadIdx.x == 0) s_e = -1;
  // Find the group-th expert with rows; judge every offset on the way.
  bool bad = false;
  int seen = 0;  // experts with rows in earlier passes
  for (int e0 = 0; e0 < p.E; e0 += kGemmThreads) {
    const int e = e0 + threadIdx.x;
    int lo = 0, hi = 0;
    if (e < p.E) {
      hi = gemm_offset(p, e);
      lo = e > 0 ? gemm_offset(p, e - 1) : 0;
      bad = bad || hi < lo || hi > p.R;
    }
    const bool has_rows = hi > lo;
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, has_rows);
    if (lane == 0) s_count[warp] = __popc(ballot);
    __syncthreads();
    int before = seen + __popc(ballot & ((1u << lane) - 1u)), total = 0;
#pragma unroll
    for (int q = 0; q < kGemmWarps; ++q) {
      before += q < warp ? s_count[q] : 0;
      total += s_count[q];
    }
    if (has_rows && before == group) {
      s_e = e;
      s_lo = lo;
      s_hi = hi;
    }
    seen += total;
    __syncthreads();
  }
  if (__syncthreads_or(bad)) {
    if (threadIdx.x == 0 && blockIdx.x == 0) record_status(p.words, IMOE_ERR_INDEX_RANGE);
    return;
  }
  const int e = s_e;
  if (e < 0) return;  // fewer experts have rows than there are groups (most blocks at decode)
  const int lo = s_lo, hi = s_hi;
  const int n0 = tile * kGemmTile + warp * kGemmCols;
  const char *col[kGemmCols];
#pragma unroll
  for (int c = 0; c < kGemmCols; ++c) {
    const int n = n0 + c < p.N ? n0 + c : p.N - 1;  // past N: a column read again, never written
    col[c] = p.w + (int64_t)e * p.w_e + (int64_t)n * p.w_n;
  }
  for (int r0 = lo; r0 < hi; r0 += p.max_rows) {
    const int rows = hi - r0 < p.max_rows ? hi - r0 : p.max_rows;
    __syncthreads();  // the previous chunk's rows are read
    stage_rows<DT>(p, rows_smem, r0, rows);
    __syncthreads();
    if (n0 >= p.N) continue;
    switch (rows) {
      case 1: gemm_rows<DT, 1>(p, rows_smem, col, r0, n0, lane); break;
      case 2: gemm_rows<DT, 2>(p, rows_smem, col, r0, n0, lane); break;
      case 3: gemm_rows<DT, 3>(p, rows_smem, col, r0, n0, lane); break;
      case 4: gemm_rows<DT, 4>(p, rows_smem, col, r0, n0, lane); break;
      case 5: gemm_rows<DT, 5>(p, rows_smem, col, r0, n0, lane); break;
      case 6: gemm_rows<DT, 6>(p, rows_smem, col, r0, n0, lane); break;
      case 7: gemm_rows<DT, 7>(p, rows_smem, col, r0, n0, lane); break;
      default: gemm_rows<DT, 8>(p, rows_smem, col, r0, n0, lane); break;
    }
  }
}

namespace {

// The dynamic shared memory each device's kernels may take, raised once.
std::atomic<int> g_gemm_smem[kMaxDevices][3];

template <int DT>
cudaError_t launch_gemm(const LaunchShape &s, int dev, int slot, cudaStream_t st, const GemmParams &p) {
  if (s.smem > 48 * 1024 && (int)s.smem > g_gemm_smem[dev][slot].load(std::memory_order_relaxed)) {
    cudaError_t e = cudaFuncSetAttribute(k_grouped_gemm<DT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s.smem);
    if (e != cudaSuccess) return e;
    g_gemm_smem[dev][slot].store((int)s.smem, std::memory_order_relaxed);
  }
  return launch(k_grouped_gemm<DT>, s, st, p);
}

bool multiple16(int64_t x) { return x % 16 == 0; }

}  // namespace
}  // namespace imoe_cu

using namespace imoe_cu;

extern "C" imoe_status imoe_cuda_grouped_gemm(const imoe_view *a, const imoe_view *w, const imoe_view *offsets,
                                              const imoe_view *out, const imoe_exec *exec, imoe_error *err) {
  const char *fn = "imoe_cuda_grouped_gemm";
  const int64_t size = dtype_size(a->dtype), R = a->lead_shape[0], K = a->n, E = offsets->n, N = out->n;
  if (K > 1 && a->n_stride != size)
    return fail(err, IMOE_ERR_UNSUPPORTED, "a: on CUDA its rows must be contiguous (last axis stride 1 element)");
  if (K > 1 && w->lead_stride[1] != size)
    return fail(err, IMOE_ERR_UNSUPPORTED,
                "w: on CUDA its K axis must be contiguous (stride 1 element): pass an [E, N, K] weight "
                "such as transformers' gate_up_proj transposed to [E, K, N]");
  if (!multiple16(K * size))
    return fail(err, IMOE_ERR_UNSUPPORTED, "a, w: on CUDA K x element size must be a multiple of 16 bytes (K = %lld)",
                (long long)K);
  if (!multiple16((int64_t)(uintptr_t)w->data) || (E > 1 && !multiple16(w->lead_stride[0])) ||
      (N > 1 && !multiple16(w->n_stride)))
    return fail(err, IMOE_ERR_UNSUPPORTED, "w: on CUDA its base and its E and N strides must be multiples of 16 bytes");
  if (E > IMOE_MOE_MAX_EXPERTS)
    return fail(err, IMOE_ERR_UNSUPPORTED, "offsets: at most %d experts on CUDA, got %lld", IMOE_MOE_MAX_EXPERTS,
                (long long)E);
  const int64_t tiles = (N + kGemmTile - 1) / kGemmTile, groups = E < R ? E : R;
  if (R > INT32_MAX || N > INT32_MAX || tiles * groups > INT32_MAX)
    return fail(err, IMOE_ERR_UNSUPPORTED, "%s: R = %lld rows and N = %lld columns are beyond the kernel's limits", fn,
                (long long)R, (long long)N);
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  const int64_t row_bytes = K * size;
  if (row_bytes > di->smem_optin)
    return fail(err, IMOE_ERR_UNSUPPORTED, "a: a row of %lld bytes does not fit in shared memory (%d bytes)",
                (long long)row_bytes, di->smem_optin);
  int64_t max_rows = R < kGemmMaxRows ? R : kGemmMaxRows;
  while (max_rows > 1 && max_rows * row_bytes > di->smem_optin) --max_rows;
  GemmParams p;
  memset(&p, 0, sizeof p);
  p.a = static_cast<const char *>(a->data);
  p.a_row = a->lead_stride[0];
  p.w = static_cast<const char *>(w->data);
  p.w_e = w->lead_stride[0];
  p.w_n = w->n_stride;
  p.out = static_cast<char *>(out->data);
  p.out_row = out->lead_stride[0];
  p.out_col = out->n_stride;
  p.offs = static_cast<const char *>(offsets->data);
  p.offs_stride = offsets->n_stride;
  p.E = (int32_t)E;
  p.R = (int32_t)R;
  p.N = (int32_t)N;
  p.nvec = (int32_t)(row_bytes / 16);
  p.tiles = (int32_t)tiles;
  p.max_rows = (int32_t)max_rows;
  p.a_vec = multiple16((int64_t)(uintptr_t)p.a) && (R <= 1 || multiple16(p.a_row));
  p.words = di->words;
  const LaunchShape ls = shape((unsigned)(tiles * groups), kGemmThreads, (size_t)(max_rows * row_bytes),
                               di->cc_major >= 9);
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  const int dev = exec->device_id;
  cudaError_t e;
  switch (a->dtype) {
    case IMOE_DTYPE_F32: e = launch_gemm<IMOE_DTYPE_F32>(ls, dev, 0, st, p); break;
    case IMOE_DTYPE_F16: e = launch_gemm<IMOE_DTYPE_F16>(ls, dev, 1, st, p); break;
    default: e = launch_gemm<IMOE_DTYPE_BF16>(ls, dev, 2, st, p); break;
  }
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_grouped_gemm", e);
  return IMOE_OK;
}
