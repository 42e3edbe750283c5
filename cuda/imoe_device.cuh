// imoe_device.cuh: device-side building blocks shared by every kernel family
// (views, row coordinates, score keys, the status and verdict words, block
// scans, byte moves). Every cuda/*.cu includes it; nothing here defines
// module memory, so each translation unit gets the same inline code and no
// relocatable device code is needed (docs/cuda-design.md, "Files").
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "idempotent_moe.h"

namespace imoe_cu {

constexpr int kMaxDims = IMOE_MAX_LEAD_DIMS;
constexpr int kMaxBuf = 16;             // buffers moved by one launch
constexpr int kSelThreads = 1024;       // select kernel block
constexpr int kSmallDigit = 11;         // k_select_small: radix digit bits,
constexpr int kSmallBins = 1 << kSmallDigit;  // bins per pass,
constexpr int kSmallPasses = 3;         // and passes (3 x 11 >= 32)
constexpr int kItems = 4;               // consecutive slots per thread in a tile
constexpr int kTile = kSelThreads * kItems;
constexpr int kListL = 4096;            // ring refill threshold
constexpr int kApplyThreads = 256;      // apply kernel block
constexpr int kCheckThreads = 512;      // validation kernels
constexpr unsigned kSlots = 64;         // per-call verdict slots
constexpr int kVerdicts = 256;          // most blocks of a validation kernel (one verdict word each)
constexpr int64_t kDestCheckItems = 8192;  // dest entries per block of a multi-block dest check

// Blocks of a multi-block dest check over `entries` dest entries: one per
// kDestCheckItems, at least one, at most kVerdicts (a verdict word each) and
// `readers` (the threads of each block after it, which read every word).
inline int32_t dest_check_blocks(int64_t entries, int readers) {
  const int64_t most = readers < kVerdicts ? readers : kVerdicts;
  const int64_t b = (entries + kDestCheckItems - 1) / kDestCheckItems;
  return (int32_t)(b < 1 ? 1 : b < most ? b : most);
}
// Rows of at most this many slots select with k_select_small: every key in
// registers, NT x IPT slots per block (NT = kSelThreads with IPT 4, 8 or 16;
// for many rows NT = 256 or 512 with IPT 16, several blocks per SM).
#ifndef IMOE_SMALL_MAX_N
#define IMOE_SMALL_MAX_N 16384
#endif
constexpr int kSmallMaxN = IMOE_SMALL_MAX_N;

// Row-major lead shape after the host merged contiguous axes and dropped 1s.
struct Lead {
  int32_t nd;
  uint32_t shape[kMaxDims];
};
struct Strides {
  int64_t s[kMaxDims];
};

// A typed view (scores, active indices, maps) seen from one row.
struct InView {
  const char *data;
  Strides lead;
  int64_t n_stride;
  int32_t dtype;
  int32_t aligned;  // data and strides are multiples of the element size
};
struct OutView {
  char *data;
  Strides lead;
  int64_t n_stride;
  int32_t dtype;
  int32_t aligned;
};
// A buffer: every slot start is congruent to `data` modulo vw, so each row
// is moved as `head` bytes, `body` vw-byte vectors, `tail` bytes.
struct BufDesc {
  char *data;
  Strides lead;
  int64_t n_stride;
  int32_t vw;
  int32_t head;
  int32_t tail;
  uint32_t body;
};

// ---------------------------------------------------------------- rows
__device__ __forceinline__ void row_coords(const Lead &L, uint32_t r, uint32_t (&c)[kMaxDims]) {
  if (L.nd == 1) {  // uniform: one lead axis, and r < its length unless a caller overruns
#pragma unroll
    for (int d = 1; d < kMaxDims; ++d) c[d] = 0;
    c[0] = r < L.shape[0] ? r : r % L.shape[0];
    return;
  }
#pragma unroll
  for (int d = kMaxDims - 1; d >= 0; --d) {
    if (d < L.nd) {
      const uint32_t s = L.shape[d];
      const uint32_t q = r / s;
      c[d] = r - q * s;
      r = q;
    } else {
      c[d] = 0;
    }
  }
}

__device__ __forceinline__ int64_t row_offset(const Lead &L, const uint32_t (&c)[kMaxDims],
                                              const Strides &st) {
  if (L.nd <= 1) return L.nd ? (int64_t)c[0] * st.s[0] : 0;  // uniform: most calls have one lead axis
  int64_t o = 0;
#pragma unroll
  for (int d = 0; d < kMaxDims; ++d)
    if (d < L.nd) o += (int64_t)c[d] * st.s[d];
  return o;
}

// The start of row r of a view laid out by L.
__device__ __forceinline__ const char *row_data(const Lead &L, const InView &v, uint32_t r) {
  uint32_t c[kMaxDims];
  row_coords(L, r, c);
  return v.data + row_offset(L, c, v.lead);
}

// ---------------------------------------------------------------- scalars
__device__ __forceinline__ uint32_t load_u16(const char *p, bool aligned) {
  if (aligned) return *reinterpret_cast<const unsigned short *>(p);
  const unsigned char *b = reinterpret_cast<const unsigned char *>(p);
  return (uint32_t)b[0] | ((uint32_t)b[1] << 8);
}
__device__ __forceinline__ uint32_t load_u32(const char *p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint32_t *>(p);
  const unsigned char *b = reinterpret_cast<const unsigned char *>(p);
  return (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
}
__device__ __forceinline__ uint64_t load_u64(const char *p, bool aligned) {
  if (aligned) return *reinterpret_cast<const unsigned long long *>(p);
  return (uint64_t)load_u32(p, false) | ((uint64_t)load_u32(p + 4, false) << 32);
}

// Raw element bits through the read-only path (inputs the kernel never writes).
__device__ __forceinline__ uint32_t ldg_raw(const char *p, int dtype, bool aligned) {
  if (dtype == IMOE_DTYPE_F32 || dtype == IMOE_DTYPE_I32) {
    if (aligned) return __ldg(reinterpret_cast<const unsigned int *>(p));
    return load_u32(p, false);
  }
  if (aligned) return __ldg(reinterpret_cast<const unsigned short *>(p));
  return load_u16(p, false);
}
// Order-preserving unsigned key: larger key = higher score. NaN ranks below
// -inf (key 0; -inf maps to 0x007FFFFF), and -0.0 ties +0.0.
__device__ __forceinline__ uint32_t key_of_bits(uint32_t b) {
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0u;
  if (b == 0x80000000u) b = 0u;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ uint32_t key_of_raw(uint32_t raw, int dtype) {
  if (dtype == IMOE_DTYPE_F32) return key_of_bits(raw);
  if (dtype == IMOE_DTYPE_F16)
    return key_of_bits(__float_as_uint(__half2float(__ushort_as_half((unsigned short)raw))));
  return key_of_bits(raw << 16);
}
__device__ __forceinline__ uint32_t load_key(const char *p, int dtype, bool aligned) {
  return key_of_raw(ldg_raw(p, dtype, aligned), dtype);
}

__device__ __forceinline__ int64_t load_index(const char *p, int dtype, bool aligned) {
  if (dtype == IMOE_DTYPE_I64) return (int64_t)load_u64(p, aligned);
  return (int64_t)(int32_t)load_u32(p, aligned);
}
__device__ __forceinline__ void store_index(char *p, int dtype, bool aligned, int64_t v) {
  if (dtype == IMOE_DTYPE_I64) {
    if (aligned) {
      *reinterpret_cast<long long *>(p) = (long long)v;
    } else {
      for (int i = 0; i < 8; ++i) p[i] = (char)((uint64_t)v >> (8 * i));
    }
  } else {
    if (aligned) {
      *reinterpret_cast<int32_t *>(p) = (int32_t)v;
    } else {
      for (int i = 0; i < 4; ++i) p[i] = (char)((uint32_t)v >> (8 * i));
    }
  }
}

// ---------------------------------------------------------------- PDL
// Programmatic dependent launch (sm_90): the host sets the launch attribute
// only when the previous kernel in the stream is this call's read-only
// validation kernel, so the secondary may read its inputs before the wait.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---------------------------------------------------------------- status and verdicts
// The device status word and the verdict words (fixed module memory of
// imoe_select.cu, docs/cuda-design.md, "Data errors"). Kernels of that
// translation unit name them directly (module_words()); the other families'
// kernels take their addresses as a kernel parameter.
struct StatusWords {
  int *status;                     // first data error since the last read
  unsigned (*verdict)[kVerdicts];  // [kSlots][kVerdicts]
};

__device__ __forceinline__ void record_status(const StatusWords &w, int code) {
  atomicCAS(w.status, 0, code);
}

// One thread per validation block, at its end.
__device__ __forceinline__ void write_verdict(const StatusWords &w, uint32_t token, bool bad) {
  if (token) w.verdict[token % kSlots][blockIdx.x] = bad ? token : 0u;
}

// The end of a validation block: `code` when any thread found `bad`, and the
// block's verdict (also bad when `aborted`: an earlier kernel's failure).
__device__ __forceinline__ void block_verdict(const StatusWords &w, uint32_t token, bool bad, int code,
                                              bool aborted = false) {
  bad = __syncthreads_or(bad) != 0;
  if (threadIdx.x == 0) {
    if (bad) record_status(w, code);
    write_verdict(w, token, bad || aborted);
  }
}

// This thread's verdict word of call `token` (thread t reads word t).
__device__ __forceinline__ bool verdict_bad(const StatusWords &w, uint32_t token, int nv) {
  static_assert(kVerdicts <= kApplyThreads && kVerdicts <= kSelThreads, "one word per thread");
  const int t = threadIdx.x;
  return token && t < nv && __ldcg(&w.verdict[token % kSlots][t]) == token;
}
// Whether call `token` failed validation: the nv verdict words of its
// validation kernel, read once that grid has completed (griddepcontrol.wait
// or stream order), past L1. Every thread of the block must call it (one
// barrier); the answer is uniform. Only kernels after a validation kernel
// have a token.
__device__ __forceinline__ bool call_aborted(const StatusWords &w, uint32_t token, int nv) {
  if (!token) return false;
  return __syncthreads_or(verdict_bad(w, token, nv)) != 0;
}

// Whether a raw score (as ldg_raw reads it: 16-bit types zero-extended) is NaN.
__device__ __forceinline__ bool raw_is_nan(uint32_t raw, int dt) {
  if (dt == IMOE_DTYPE_F32) return (raw & 0x7FFFFFFFu) > 0x7F800000u;
  return (raw & 0x7FFFu) > (dt == IMOE_DTYPE_F16 ? 0x7C00u : 0x7F80u);
}

// ---------------------------------------------------------------- scans
// Sum of v over lanes >= this lane.
__device__ __forceinline__ int warp_suffix_sum(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_down_sync(0xFFFFFFFFu, v, o);
    if (lane + o < 32) v += n;
  }
  return v;
}

// One warp (the block's first) over a 256-bin histogram h, bins counted
// from the top: the bin that holds the need-th key (1 <= need <= keys in h),
// written to out as {bin, keys in higher bins, keys in the bin}. The caller
// synchronises before (h complete) and after (out read).
__device__ __forceinline__ void find_bin256(const int *h, int need, int *out) {
  const int lane = threadIdx.x & 31;
  int s = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) s += h[8 * lane + j];
  const int suf = warp_suffix_sum(s);
  int acc = suf - s;
  if (acc < need && need <= suf) {
    for (int j = 7; j >= 0; --j) {
      const int c = h[8 * lane + j];
      if (acc + c >= need) {
        out[0] = 8 * lane + j;
        out[1] = acc;
        out[2] = c;
        break;
      }
      acc += c;
    }
  }
}

__device__ __forceinline__ int warp_incl_scan(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xFFFFFFFFu, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// Block-wide exclusive scan; `tmp` holds >= 32 ints. Ends with a barrier, so
// `tmp` may be reused at once.
__device__ __forceinline__ int block_excl_scan(int v, int *total, int *tmp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int inc = warp_incl_scan(v);
  if (lane == 31) tmp[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int t = lane < nw ? tmp[lane] : 0;
    t = warp_incl_scan(t);
    if (lane < nw) tmp[lane] = t;
  }
  __syncthreads();
  const int base = warp ? tmp[warp - 1] : 0;
  *total = tmp[nw - 1];
  __syncthreads();
  return base + inc - v;
}

// Block-wide exclusive scan with one barrier: every warp scans the warp
// totals itself. `wsum` (>= 32 ints) must not be reused without a barrier.
__device__ __forceinline__ int block_excl_scan_1sync(int v, int *total, int *wsum) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int inc = warp_incl_scan(v);
  if (lane == 31) wsum[warp] = inc;
  __syncthreads();
  int t = lane < nw ? wsum[lane] : 0;
  t = warp_incl_scan(t);
  const int base = __shfl_sync(0xFFFFFFFFu, t, (warp + 31) & 31);
  *total = __shfl_sync(0xFFFFFFFFu, t, 31);
  return (warp ? base : 0) + inc - v;
}

// Exclusive block scan of one int per thread; *total receives the sum.
// s_warp: 33 ints of shared memory. Every thread of the block calls it.
__device__ __forceinline__ int perm_block_scan(int v, int *total, int *s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int incl = warp_incl_scan(v);
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int w = lane < nw ? s_warp[lane] : 0;
    const int ws = warp_incl_scan(w);
    s_warp[lane] = ws - w;
    if (lane == 31) s_warp[32] = ws;
  }
  __syncthreads();
  const int excl = s_warp[warp] + incl - v;
  *total = s_warp[32];
  __syncthreads();  // s_warp is reused by the next call
  return excl;
}

// A stable counting sort's placing pass, tile by tile of blockDim.x items
// (k_group, k_moe_sort): each item i < n with key(i) >= 0 gets its place
// among the items of its key, in item order, from base[key]; emit(i, key,
// place) runs for every i < n (key -1: place -1), and base advances by the
// counts. __match_any_sync ranks an item within its warp, per-warp counts
// wc [E x 33] (padded) across the warps. Every thread of the block calls it.
template <class Key, class Emit>
__device__ __forceinline__ void stable_places(int64_t S, int E, int *base, int *wc, Key key, Emit emit) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t i0 = 0; i0 < S; i0 += blockDim.x) {
    for (int x = threadIdx.x; x < E * 33; x += blockDim.x) wc[x] = 0;
    __syncthreads();
    const int64_t i = i0 + threadIdx.x;
    const int e = i < S ? key(i) : -1;
    const unsigned peers = __match_any_sync(0xFFFFFFFFu, e);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    if (e >= 0 && rank == 0) wc[e * 33 + warp] = __popc(peers);
    __syncthreads();
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
      int sum = base[x];
      for (int w = 0; w < 32; ++w) {
        const int c = wc[x * 33 + w];
        wc[x * 33 + w] = sum;
        sum += c;
      }
      base[x] = sum;
    }
    __syncthreads();
    if (i < S) emit(i, e, e >= 0 ? wc[e * 33 + warp] + rank : -1);
    __syncthreads();
  }
}

// ---------------------------------------------------------------- moves
template <int VW>
struct VecOf;
template <>
struct VecOf<16> {
  typedef uint4 T;
};
template <>
struct VecOf<8> {
  typedef uint2 T;
};
template <>
struct VecOf<4> {
  typedef uint32_t T;
};
template <>
struct VecOf<2> {
  typedef unsigned short T;
};
template <>
struct VecOf<1> {
  typedef unsigned char T;
};

// Moves (or swaps) np pairs of rows of a buffer: get(q, ns) = the byte
// offsets from base of pair q's destination and source rows, ns the buffer's
// slot stride. Flat (pair, vector) work spread over the block; MU (a swap:
// two pairs of) independent loads in flight per thread before the stores.
template <int VW, bool SWAP, class G, int MU = 4>
__device__ __forceinline__ void move_body(char *base, int64_t ns, int64_t off0, uint32_t U, uint32_t np,
                                          const G &get) {
  typedef typename VecOf<VW>::T V;
  constexpr int UNR = SWAP ? 2 : MU;
  if (U == 0 || np == 0) return;
  const uint32_t nt = blockDim.x;
  // U is often a power of two (rows of 2^k bytes): shifts instead of divisions
  const bool pow2 = (U & (U - 1u)) == 0u;
  const int sh = __ffs(U) - 1;
  const uint32_t maxp = max(1u, pow2 ? 0x40000000u >> sh : 0x40000000u / U);
  for (uint32_t p0 = 0; p0 < np; p0 += maxp) {
    const uint32_t pb = min(maxp, np - p0);
    const uint32_t total = pb * U;
    // unit u = q * U + w; advance (q, w) by nt per step without dividing
    const uint32_t dq = pow2 ? nt >> sh : nt / U, dw = nt - dq * U;
    uint32_t q = pow2 ? threadIdx.x >> sh : threadIdx.x / U, w = threadIdx.x - q * U;
    for (uint32_t u0 = threadIdx.x; u0 < total; u0 += UNR * nt) {
      V a[UNR], b[UNR];
      char *pd[UNR];
      char *ps[UNR];  // swap only: the move keeps just the destination
#pragma unroll
      for (int k = 0; k < UNR; ++k) {
        pd[k] = nullptr;
        if (q < pb) {
          const longlong2 pr = get(p0 + q, ns);
          const int64_t o = off0 + (int64_t)w * VW;
          pd[k] = base + pr.x + o;
          const char *src = base + pr.y + o;
          a[k] = *reinterpret_cast<const V *>(src);
          if (SWAP) {
            ps[k] = const_cast<char *>(src);
            b[k] = *reinterpret_cast<const V *>(pd[k]);
          }
        }
        q += dq;
        w += dw;
        if (w >= U) {
          w -= U;
          ++q;
        }
      }
#pragma unroll
      for (int k = 0; k < UNR; ++k) {
        if (pd[k] != nullptr) {
          *reinterpret_cast<V *>(pd[k]) = a[k];
          if (SWAP) *reinterpret_cast<V *>(ps[k]) = b[k];
        }
      }
    }
  }
}

template <bool SWAP, class G>
__device__ __forceinline__ void move_edges(char *base, const BufDesc &B, uint32_t np, const G &get) {
  const uint32_t E = (uint32_t)(B.head + B.tail);
  if (E == 0 || np == 0) return;
  const uint32_t total = np * E;
  const int64_t tail0 = (int64_t)B.head + (int64_t)B.body * B.vw;
  for (uint32_t u = threadIdx.x; u < total; u += blockDim.x) {
    const uint32_t q = u / E;
    const uint32_t k = u - q * E;
    const int64_t o = k < (uint32_t)B.head ? (int64_t)k : tail0 + (k - B.head);
    const longlong2 pr = get(q, B.n_stride);
    char *pd = base + pr.x + o;
    char *ps = base + pr.y + o;
    const char a = *ps;
    if (SWAP) {
      const char b = *pd;
      *ps = b;
    }
    *pd = a;
  }
}

// Pairs read from shared memory: pair q is (D[wrap(a0 + q)], S[wrap(b0 + q)]),
// where wrap folds indices of a ring of `cap` entries (a0, b0 < cap, q < cap).
struct RingPairs {
  const int32_t *D;  // S = D + s_off (both rings in one shared-memory block)
  int s_off, a0, b0, cap;
  __device__ __forceinline__ int2 slots(uint32_t q) const {
    int a = a0 + (int)q, b = b0 + (int)q;
    if (a >= cap) a -= cap;
    if (b >= cap) b -= cap;
    return make_int2(D[a], D[s_off + b]);
  }
  __device__ __forceinline__ longlong2 operator()(uint32_t q, int64_t ns) const {
    const int2 s = slots(q);
    return make_longlong2((int64_t)s.x * ns, (int64_t)s.y * ns);
  }
};

// Moves (or swaps) np pairs of rows of one buffer (get: see move_body).
template <bool SWAP, class G, int MU = 4>
__device__ __forceinline__ void move_pairs_t(char *base, const BufDesc &B, uint32_t np, const G &get) {
  switch (B.vw) {
    case 16: move_body<16, SWAP, G, MU>(base, B.n_stride, B.head, B.body, np, get); break;
    case 8: move_body<8, SWAP, G, MU>(base, B.n_stride, B.head, B.body, np, get); break;
    case 4: move_body<4, SWAP, G, MU>(base, B.n_stride, B.head, B.body, np, get); break;
    case 2: move_body<2, SWAP, G, MU>(base, B.n_stride, B.head, B.body, np, get); break;
    default: move_body<1, SWAP, G, MU>(base, B.n_stride, B.head, B.body, np, get); break;
  }
  move_edges<SWAP>(base, B, np, get);
}

__device__ __forceinline__ void move_pairs_inline(char *base, const BufDesc &B, uint32_t np, int swap,
                                                  const RingPairs &get) {
  if (swap)
    move_pairs_t<true>(base, B, np, get);
  else
    move_pairs_t<false>(base, B, np, get);
}

// Not inlined on purpose: the movers get their own register budget, and the
// caller's live state is saved once per call instead of spilling in the loop.
// MU: moves in flight per thread (k_select_small's MOVE5 kernels take 5;
// each kernel has its own copy of this function, and in the MOVE5 ones
// ptxas keeps the five-load 16-byte move loop unspilled while their swap
// loop spills more, so the host sends swaps to the other kernels).
template <int MU = 4>
__device__ __noinline__ void move_pairs(char *base, const BufDesc *B, uint32_t np, int swap, RingPairs get) {
  if (swap)
    move_pairs_t<true>(base, *B, np, get);
  else
    move_pairs_t<false, RingPairs, MU>(base, *B, np, get);
}

}  // namespace imoe_cu
