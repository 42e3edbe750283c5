// imoe_experts_gemm.cu: the experts' grouped GEMM on tensor cores
// (imoe_experts_gemm; contract in idempotent_moe.h, CPU core and argument
// checks in csrc/experts_gemm.c, design in docs/cuda-design.md, "The experts
// GEMM").
//   k_xg_check  one block, only with src: offsets non-decreasing in [0, R]
//               and src[r] in [0, T) below offsets[E - 1]; a bad entry is a
//               recorded IMOE_ERR_INDEX_RANGE and the call's verdict, which
//               the GEMM reads (nothing is written).
//   k_xg        block (m-slot, n-tile) in grouped order (kGroupM m-slots
//               side by side share each weight tile in L2). An m-slot is BM
//               rows of one expert: every block reads all offsets, finds
//               its expert and first row with a block scan of the experts'
//               tile counts, and judges the offsets on the way (all blocks
//               see the same, so on bad offsets none writes). Rows of x are
//               read through src as their tiles load (cp.async, 16 bytes,
//               zero-filled past the rows and past K), weight columns K
//               contiguous; STAGES shared-memory stages of kBK = 64 columns
//               of K (128-byte rows, 16-byte chunks XOR-swizzled by row),
//               ldmatrix, mma.sync m16n8k16 with F32 accumulators.
//               Gated: a warp's columns are half gate, half the up columns
//               of the same features, so act(gate) x up is formed in
//               registers and only [rows, N / 2] is written.
// The tile plan (xg_plan) is a pure function of the rows per expert, E, N
// and the device's multiprocessor count.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "imoe_act.cuh"
#include "imoe_device.cuh"
#include "imoe_launch.cuh"

namespace imoe_cu_xg {
using namespace imoe_cu;

constexpr int kBK = 64;     // K per stage: rows of 128 bytes, 8 chunks of 16 bytes
constexpr int kGroupM = 8;  // m-slots per group of the block order
constexpr size_t kStaticSmem = 128;  // at least k_xg's static shared memory (its block scan's), bytes

struct XgParams {
  const char *x;
  int64_t x_row;       // bytes
  const char *src;     // [R] int32, or null
  int64_t src_stride;  // bytes
  const char *w;
  int64_t w_e, w_n;  // bytes; K contiguous
  char *out;
  int64_t out_row;  // bytes; columns contiguous
  const char *offs;
  int64_t offs_stride;  // bytes
  int32_t E, R, T, K, N;  // N: out's columns (gated: the features I)
  int32_t n_up;           // gated: w's column where up starts (I)
  int32_t act, tiles_n, slots;
  uint32_t token;
  StatusWords words;
};

__device__ __forceinline__ int32_t xg_offset(const XgParams &p, int e) {
  return *reinterpret_cast<const int32_t *>(p.offs + (int64_t)e * p.offs_stride);
}
__device__ __forceinline__ int32_t xg_src(const XgParams &p, int64_t r) {
  return *reinterpret_cast<const int32_t *>(p.src + r * p.src_stride);
}

__global__ void __launch_bounds__(1024) k_xg_check(const __grid_constant__ XgParams p) {
  bool bad = false;
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) {
    const int32_t hi = xg_offset(p, e), lo = e > 0 ? xg_offset(p, e - 1) : 0;
    bad |= hi < lo || hi > p.R;
  }
  int32_t end = xg_offset(p, p.E - 1);
  end = end < 0 ? 0 : end > p.R ? p.R : end;
  for (int64_t r = threadIdx.x; r < end; r += blockDim.x) {
    const int32_t s = xg_src(p, r);
    bad |= s < 0 || s >= p.T;
  }
  block_verdict(p.words, p.token, bad, IMOE_ERR_INDEX_RANGE);
}

// ---------------------------------------------------------------- PTX
__device__ __forceinline__ void cp_async16(uint32_t smem, const void *g, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(g), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Byte offset of (row, 16-byte chunk) in a stage's [rows][kBK] tile.
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return (uint32_t)(row * (kBK * 2) + ((chunk ^ (row & 7)) << 4));
}

template <class T>
__device__ __forceinline__ float round_t(float v) {
  return static_cast<float>(T(v));
}

template <class T>
__device__ __forceinline__ void store_pair(char *p, float a, float b, bool both) {
  if (both) {
    T v[2] = {T(a), T(b)};
    *reinterpret_cast<uint32_t *>(p) = *reinterpret_cast<const uint32_t *>(v);
  } else {
    *reinterpret_cast<T *>(p) = T(a);
  }
}

// ---------------------------------------------------------------- the kernel
// BM x BN block tile, WM x WN warps, each warp (BM / WM) x (BN / WN).
template <class T, int BM, int BN, int WM, int WN, int STAGES, bool GATED>
__global__ void __launch_bounds__(32 * WM * WN) k_xg(const __grid_constant__ XgParams p) {
  constexpr int kThreads = 32 * WM * WN;
  constexpr int WTM = BM / WM, WTN = BN / WN;
  constexpr int MI = WTM / 16, NI = WTN / 8, NJ = WTN / 16;
  constexpr int kA = (BM * 8 + kThreads - 1) / kThreads;  // A chunks per thread and stage
  constexpr int kB = BN * 8 / kThreads;                    // B chunks per thread and stage
  constexpr uint32_t kStageA = BM * kBK * 2, kStage = (BM + BN) * kBK * 2;
  static_assert(WTM % 16 == 0 && WTN % 16 == 0 && (BN * 8) % kThreads == 0, "tile shape");
  static_assert(!GATED || NI % 2 == 0, "gated: a warp's columns are half gate, half up");
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_e, s_row0, s_rows;
  __shared__ int s_warp[kThreads / 32];
  if (call_aborted(p.words, p.token, 1)) return;

  // Block -> (slot, tile) in grouped order.
  const int per_group = kGroupM * p.tiles_n;
  const int group = blockIdx.x / per_group, first = group * kGroupM;
  const int gsize = p.slots - first < kGroupM ? p.slots - first : kGroupM;
  const int local = blockIdx.x - group * per_group;
  const int slot = first + local % gsize, tile = local / gsize;

  // Slot -> (expert, first row): a block scan of the experts' tile counts.
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) s_e = -1;
  bool bad = false;
  int seen = 0;
  for (int e0 = 0; e0 < p.E; e0 += kThreads) {
    const int e = e0 + tid;
    int lo = 0, hi = 0;
    if (e < p.E) {
      hi = xg_offset(p, e);
      lo = e > 0 ? xg_offset(p, e - 1) : 0;
      bad = bad || hi < lo || hi > p.R;
    }
    const int count = hi > lo ? (hi - lo + BM - 1) / BM : 0;
    int incl = count;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    int before = seen + incl - count, total = 0;
#pragma unroll
    for (int q = 0; q < kThreads / 32; ++q) {
      before += q < warp ? s_warp[q] : 0;
      total += s_warp[q];
    }
    if (count > 0 && slot >= before && slot < before + count) {
      s_e = e;
      s_row0 = lo + (slot - before) * BM;
      s_rows = hi - s_row0 < BM ? hi - s_row0 : BM;
    }
    seen += total;
    __syncthreads();
  }
  if (__syncthreads_or(bad)) {
    if (tid == 0 && blockIdx.x == 0) record_status(p.words, IMOE_ERR_INDEX_RANGE);
    return;
  }
  const int e = s_e;
  if (e < 0) return;  // the slot bound exceeds the slots that have rows
  const int row0 = s_row0, rows = s_rows;

  // This thread's cp.async sources: A rows (through src), B columns.
  const char *a_src[kA];
  uint32_t a_dst[kA];
  bool a_ok[kA];
  const int chunk = tid & 7;
#pragma unroll
  for (int i = 0; i < kA; ++i) {
    const int id = tid + i * kThreads, r = id >> 3;
    a_ok[i] = id < BM * 8 && r < rows;
    int64_t xr = 0;
    if (a_ok[i]) xr = p.src ? (int64_t)xg_src(p, row0 + r) : (int64_t)(row0 + r);
    a_src[i] = p.x + xr * p.x_row + chunk * 16;
    a_dst[i] = id < BM * 8 ? swz(r, chunk) : 0xFFFFFFFFu;
  }
  const char *b_src[kB];
  bool b_ok[kB];
#pragma unroll
  for (int i = 0; i < kB; ++i) {
    const int c = (tid + i * kThreads) >> 3;  // the block's column
    int n;
    if (GATED) {  // warp column group wc: its first half gate, second half up, the same features
      const int wc = c / WTN, cc = c % WTN, j = wc * (WTN / 2) + cc % (WTN / 2);
      const int feat = tile * (BN / 2) + j;
      b_ok[i] = feat < p.N;
      n = (cc < WTN / 2 ? 0 : p.n_up) + feat;
    } else {
      n = tile * BN + c;
      b_ok[i] = n < p.N;
    }
    b_src[i] = p.w + (int64_t)e * p.w_e + (int64_t)(b_ok[i] ? n : 0) * p.w_n + chunk * 16;
  }
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  const int ktiles = (p.K + kBK - 1) / kBK;

  auto load_stage = [&](int kt, int stage) {
    const uint32_t sa = base + stage * kStage, sb = sa + kStageA;
    const bool k_ok = kt * kBK + chunk * 8 < p.K;
    const int64_t koff = (int64_t)kt * kBK * 2;
#pragma unroll
    for (int i = 0; i < kA; ++i)
      if (a_dst[i] != 0xFFFFFFFFu) cp_async16(sa + a_dst[i], a_src[i] + (a_ok[i] && k_ok ? koff : 0),
                                              a_ok[i] && k_ok ? 16 : 0);
#pragma unroll
    for (int i = 0; i < kB; ++i) {
      const int c = (tid + i * kThreads) >> 3;
      cp_async16(sb + swz(c, chunk), b_src[i] + (b_ok[i] && k_ok ? koff : 0), b_ok[i] && k_ok ? 16 : 0);
    }
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    cp_async_commit();
  }
  const int wm = warp / WN, wn = warp % WN;
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt - 1 is read by all
    const int next = kt + STAGES - 1;
    if (next < ktiles) load_stage(next, next % STAGES);
    cp_async_commit();
    const uint32_t sa = base + (kt % STAGES) * kStage, sb = sa + kStageA;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t af[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
        ldmatrix_x4(af[mi], sa + swz(wm * WTM + mi * 16 + (lane & 15), kk * 2 + (lane >> 4)));
      uint32_t bf[NJ][4];
#pragma unroll
      for (int nj = 0; nj < NJ; ++nj)
        ldmatrix_x4(bf[nj], sb + swz(wn * WTN + nj * 16 + (lane & 7) + ((lane >> 4) << 3),
                                     kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
          mma16816<T>(acc[mi][ni], af[mi], bf[ni >> 1][(ni & 1) * 2], bf[ni >> 1][(ni & 1) * 2 + 1]);
    }
  }
  cp_async_wait<0>();

  // Epilogue: fragment (mi, ni) element q at row (lane / 4) + 8 (q / 2),
  // column 2 (lane % 4) + q % 2 of its 16 x 8 tile.
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * WTM + mi * 16 + (lane >> 2) + h * 8;
      if (r >= rows) continue;
      char *orow = p.out + (int64_t)(row0 + r) * p.out_row;
      if (GATED) {
#pragma unroll
        for (int ni = 0; ni < NI / 2; ++ni) {
          const int feat = tile * (BN / 2) + wn * (WTN / 2) + ni * 8 + (lane & 3) * 2;
          if (feat >= p.N) continue;
          float v[2];
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const float g = round_t<T>(acc[mi][ni][h * 2 + q]), u = round_t<T>(acc[mi][ni + NI / 2][h * 2 + q]);
            v[q] = __fmul_rn(round_t<T>(activate(g, p.act)), u);
          }
          store_pair<T>(orow + (int64_t)feat * 2, v[0], v[1], feat + 1 < p.N);
        }
      } else {
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const int n = tile * BN + wn * WTN + ni * 8 + (lane & 3) * 2;
          if (n >= p.N) continue;
          store_pair<T>(orow + (int64_t)n * 2, acc[mi][ni][h * 2], acc[mi][ni][h * 2 + 1], n + 1 < p.N);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- the plan
// Tile configurations: rows per m-slot BM, columns of w per block BN, warps,
// shared-memory stages. Decode (a few rows per expert): BM 16 and deep
// pipelines, the weights streamed once (the HBM floor); BN 64 where BN 128
// leaves the device's multiprocessors short of blocks. Larger M: BM 64 / 128.
enum XgConfig { kXg16x128 = 0, kXg16x64 = 1, kXg64x128 = 2, kXg128x128 = 3, kXgConfigs = 4 };
struct XgShape {
  int bm, bn, threads, stages;
};
constexpr XgShape kXgShapes[kXgConfigs] = {{16, 128, 128, 6}, {16, 64, 128, 8}, {64, 128, 256, 4}, {128, 128, 256, 3}};

size_t xg_smem(int cfg) { return (size_t)(kXgShapes[cfg].bm + kXgShapes[cfg].bn) * kBK * 2 * kXgShapes[cfg].stages; }

// The configuration for R rows over E experts, N out columns (gated: N
// features, 2N columns of w), on a device of `sms` multiprocessors whose
// blocks may opt in to `smem_optin` bytes of shared memory (BM 16 x BN 128's
// 108 KiB exceeds the 99 KiB of sm_86 and sm_89: BN 64 there).
int xg_plan(int64_t R, int64_t E, int64_t N, bool gated, int sms, int smem_optin) {
  const int64_t active = E < R ? E : R;
  const int64_t per_expert = active > 0 ? (R + active - 1) / active : 0;
  if (per_expert > 64) return kXg128x128;
  if (per_expert > 16) return kXg64x128;
  const int64_t cols = gated ? 2 * N : N;
  const int64_t blocks128 = active * ((cols + 127) / 128);
  const bool fits128 = xg_smem(kXg16x128) + kStaticSmem <= (size_t)smem_optin;
  return blocks128 < 2 * (int64_t)sms || !fits128 ? kXg16x64 : kXg16x128;
}

namespace {

template <class T, int BM, int BN, int WM, int WN, int STAGES, bool GATED>
cudaError_t launch_xg(const LaunchShape &s, int dev, cudaStream_t st, const XgParams &p) {
  auto kernel = k_xg<T, BM, BN, WM, WN, STAGES, GATED>;
  static std::atomic<bool> set[kMaxDevices];  // its dynamic shared-memory limit raised, per device
  if (!set[dev].load(std::memory_order_relaxed)) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s.smem);
    if (e != cudaSuccess) return e;
    set[dev].store(true, std::memory_order_relaxed);
  }
  return launch(kernel, s, st, p);
}

template <class T, bool GATED>
cudaError_t launch_cfg(int cfg, const LaunchShape &s, int dev, cudaStream_t st, const XgParams &p) {
  switch (cfg) {
    case kXg16x128: return launch_xg<T, 16, 128, 1, 4, 6, GATED>(s, dev, st, p);
    case kXg16x64: return launch_xg<T, 16, 64, 1, 4, 8, GATED>(s, dev, st, p);
    case kXg64x128: return launch_xg<T, 64, 128, 2, 4, 4, GATED>(s, dev, st, p);
    default: return launch_xg<T, 128, 128, 2, 4, 3, GATED>(s, dev, st, p);
  }
}

bool multiple(int64_t x, int64_t m) { return x % m == 0; }

}  // namespace
}  // namespace imoe_cu_xg

using namespace imoe_cu_xg;

extern "C" imoe_status imoe_cuda_experts_gemm(const imoe_view *x, const imoe_view *src, const imoe_view *w,
                                              const imoe_view *offsets, int32_t gated, imoe_act act,
                                              const imoe_view *out, const imoe_exec *exec, imoe_error *err) {
  const char *fn = "imoe_cuda_experts_gemm";
  const int64_t T = x->lead_shape[0], K = x->n, E = offsets->n, N = out->n;
  const int64_t R = src ? src->n : T;
  if (x->dtype != IMOE_DTYPE_F16 && x->dtype != IMOE_DTYPE_BF16)
    return fail(err, IMOE_ERR_UNSUPPORTED, "x: on CUDA float16 or bfloat16 (its tensor cores' inputs)");
  if (K > 1 && x->n_stride != 2)
    return fail(err, IMOE_ERR_UNSUPPORTED, "x: on CUDA its rows must be contiguous (last axis stride 1 element)");
  if (K > 1 && w->lead_stride[1] != 2)
    return fail(err, IMOE_ERR_UNSUPPORTED,
                "w: on CUDA its K axis must be contiguous (stride 1 element): pass an [E, N, K] weight "
                "such as transformers' gate_up_proj transposed to [E, K, N]");
  if (!multiple(K, 8))
    return fail(err, IMOE_ERR_UNSUPPORTED, "x, w: on CUDA K must be a multiple of 8 (K = %lld)", (long long)K);
  if (!multiple((int64_t)(uintptr_t)x->data, 16) || (T > 1 && !multiple(x->lead_stride[0], 16)))
    return fail(err, IMOE_ERR_UNSUPPORTED, "x: on CUDA its base and row stride must be multiples of 16 bytes");
  if (!multiple((int64_t)(uintptr_t)w->data, 16) || (E > 1 && !multiple(w->lead_stride[0], 16)) ||
      (w->n > 1 && !multiple(w->n_stride, 16)))
    return fail(err, IMOE_ERR_UNSUPPORTED, "w: on CUDA its base and its E and N strides must be multiples of 16 bytes");
  if ((N > 1 && out->n_stride != 2) || !multiple((int64_t)(uintptr_t)out->data, 4) ||
      (R > 1 && !multiple(out->lead_stride[0], 4)))
    return fail(err, IMOE_ERR_UNSUPPORTED,
                "out: on CUDA its rows must be contiguous, its base and row stride multiples of 4 bytes");
  if (E > IMOE_MOE_MAX_EXPERTS)
    return fail(err, IMOE_ERR_UNSUPPORTED, "offsets: at most %d experts on CUDA, got %lld", IMOE_MOE_MAX_EXPERTS,
                (long long)E);
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  const int cfg = xg_plan(R, E, N, gated != 0, di->sms, di->smem_optin);
  if (xg_smem(cfg) + kStaticSmem > (size_t)di->smem_optin)
    return fail(err, IMOE_ERR_UNSUPPORTED, "%s: this device's blocks take %d bytes of shared memory, the kernel %zu", fn,
                di->smem_optin, xg_smem(cfg) + kStaticSmem);
  const XgShape &xs = kXgShapes[cfg];
  const int64_t cols = gated ? xs.bn / 2 : xs.bn;
  const int64_t tiles_n = (N + cols - 1) / cols, active = E < R ? E : R;
  const int64_t slots = (R + xs.bm - 1) / xs.bm + active;
  if (R > INT32_MAX || T > INT32_MAX || w->n > INT32_MAX || tiles_n * slots > INT32_MAX)
    return fail(err, IMOE_ERR_UNSUPPORTED, "%s: R = %lld rows and N = %lld columns are beyond the kernel's limits",
                fn, (long long)R, (long long)N);
  XgParams p;
  memset(&p, 0, sizeof p);
  p.x = static_cast<const char *>(x->data);
  p.x_row = T > 0 ? x->lead_stride[0] : 0;
  p.src = src ? static_cast<const char *>(src->data) : nullptr;
  p.src_stride = src ? src->n_stride : 0;
  p.w = static_cast<const char *>(w->data);
  p.w_e = w->lead_stride[0];
  p.w_n = w->n_stride;
  p.out = static_cast<char *>(out->data);
  p.out_row = out->lead_stride[0];
  p.offs = static_cast<const char *>(offsets->data);
  p.offs_stride = offsets->n_stride;
  p.E = (int32_t)E;
  p.R = (int32_t)R;
  p.T = (int32_t)T;
  p.K = (int32_t)K;
  p.N = (int32_t)N;
  p.n_up = gated ? (int32_t)(w->n / 2) : 0;
  p.act = act;
  p.tiles_n = (int32_t)tiles_n;
  p.slots = (int32_t)slots;
  p.words = di->words;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  cudaError_t e;
  if (src) {
    p.token = next_token();
    e = launch(k_xg_check, shape(1, 1024), st, p);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_xg_check", e);
  }
  const LaunchShape ls = shape((unsigned)(tiles_n * slots), (unsigned)xs.threads, xg_smem(cfg));
  const int dev = exec->device_id;
  if (x->dtype == IMOE_DTYPE_BF16)
    e = gated ? launch_cfg<__nv_bfloat16, true>(cfg, ls, dev, st, p) : launch_cfg<__nv_bfloat16, false>(cfg, ls, dev, st, p);
  else
    e = gated ? launch_cfg<__half, true>(cfg, ls, dev, st, p) : launch_cfg<__half, false>(cfg, ls, dev, st, p);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_xg", e);
  return IMOE_OK;
}
