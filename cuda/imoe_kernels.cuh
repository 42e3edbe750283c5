// imoe_kernels.cuh: the kernels. Included once, by imoe_cuda.cu.
//
//   k_check_nan / k_check_rows / k_check_tm   read-only validation; an error
//       is recorded in g_status, and every block writes its verdict word.
//   k_select<SRC>   per row: top-C selection (radix select on order-preserving
//       keys) or active indices, then the idempotent map (j-th hole <-> j-th
//       kept tail slot) streamed through two shared-memory rings; writes the
//       outputs and, fused, moves the buffers. Several blocks may work on one
//       row: each recomputes the (deterministic) selection and owns a share
//       of the output tiles and of the pairs.
//   k_apply        moves the pairs of a map (indices or target_map) over all
//       rows; many blocks per row.
#pragma once

#include "imoe_device.cuh"

namespace imoe_cu {

__device__ int g_status;        // first data error since the last read
__device__ int g_status_taken;  // staging for imoe_cuda_read_device_status
// Verdicts of a call's validation kernel: block b of call t writes
// g_verdict[t % kSlots][b] = (it found an error) ? t : 0, unconditionally, so
// a replay of a captured call starts from its own verdicts (no clearing, no
// counters). The validation grid has at most kVerdicts blocks (grid-stride).
__device__ unsigned g_verdict[kSlots][kVerdicts];
// Per call slot: the grid barrier of the NaN check that k_select_small and
// k_select_wide make themselves (a cooperative launch, see select_and_move;
// the helpers nan_arrive and nan_verdict). Bits 32-63: a sense-reversing
// arrival counter (block 0 adds 2^31 - (grid - 1), every other block 1, so
// bit 63 flips once every block has arrived and bits 32-62 return to their
// value). Bits 0-15 and 16-31: blocks that found a NaN, for launches whose
// bit 63 was 0 and 1 before they arrived; a launch clears the half its
// successor on the slot will use. The count travels in the arrival's own
// atomic, so the value that shows the flip shows every block's finding.
__device__ unsigned long long g_gridbar[kSlots];

__device__ __forceinline__ unsigned long long ld_relaxed_u64(const unsigned long long *p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void record_status(int code) { atomicCAS(&g_status, 0, code); }

// Diagnosis only (-DIMOE_PHASE_TIMES, the harness's --phases): thread 0 of
// each k_select_small block stamps the SM clock and the global timer at the
// end of each phase, and in the spare stamp its SM and its number of pairs;
// imoe_cuda_phase_read() copies the stamps out.
#ifdef IMOE_PHASE_TIMES
__device__ unsigned long long g_phase[kPhaseBlocks][2][kPhases];
__device__ __forceinline__ void phase_stamp(int k) {
  if (threadIdx.x == 0 && blockIdx.x < kPhaseBlocks) {
    unsigned long long gt;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
    g_phase[blockIdx.x][0][k] = (unsigned long long)clock64();
    g_phase[blockIdx.x][1][k] = gt;
    if (k == 0) {  // the block's SM, in the spare stamp
      unsigned smid;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      g_phase[blockIdx.x][0][kPhases - 1] = smid;
    }
  }
}
#define IMOE_PHASE(k) phase_stamp(k)
#else
#define IMOE_PHASE(k) ((void)0)
#endif

// One thread per validation block, at its end.
__device__ __forceinline__ void write_verdict(uint32_t token, bool bad) {
  if (token) g_verdict[token % kSlots][blockIdx.x] = bad ? token : 0u;
}

// Whether call `token` failed validation: the nv verdict words of its
// validation kernel, read once that grid has completed (griddepcontrol.wait
// or stream order), past L1. Every thread of the block must call it (one
// barrier); the answer is uniform. Only kernels after a validation kernel
// have a token.
// This thread's verdict word of call `token` (thread t reads word t).
__device__ __forceinline__ bool verdict_bad(uint32_t token, int nv) {
  static_assert(kVerdicts <= kApplyThreads && kVerdicts <= kSelThreads, "one word per thread");
  const int t = threadIdx.x;
  return token && t < nv && __ldcg(&g_verdict[token % kSlots][t]) == token;
}
__device__ __forceinline__ bool call_aborted(uint32_t token, int nv) {
  if (!token) return false;
  return __syncthreads_or(verdict_bad(token, nv)) != 0;
}

__global__ void k_take_status() { g_status_taken = atomicExch(&g_status, 0); }

// ------------------------------------------------------------ validation
// Whether a raw score (as ldg_raw reads it: 16-bit types zero-extended) is NaN.
__device__ __forceinline__ bool raw_is_nan(uint32_t raw, int dt) {
  if (dt == IMOE_DTYPE_F32) return (raw & 0x7FFFFFFFu) > 0x7F800000u;
  return (raw & 0x7FFFu) > (dt == IMOE_DTYPE_F16 ? 0x7C00u : 0x7F80u);
}

struct NanParams {
  Lead lead;
  int64_t N;
  InView scores;
  uint32_t bpr;    // pieces per row
  uint32_t items;  // rows x bpr pieces, grid-strided
  int64_t per;     // slots per piece
  uint32_t token;
  int32_t vec;     // dense 16-bit or 32-bit scores, 16-byte aligned: one flat
                   // row (lead nd 0) read as 16-byte vectors; per: a multiple of 8
};

// Whether a 16-byte vector of raw scores holds a NaN.
__device__ __forceinline__ bool vec_has_nan(uint4 q, int dt) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  bool bad = false;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (dt == IMOE_DTYPE_F32) bad |= raw_is_nan(w[j], dt);
    else bad |= raw_is_nan(w[j] & 0xFFFFu, dt) | raw_is_nan(w[j] >> 16, dt);
  }
  return bad;
}

__global__ void __launch_bounds__(1024) k_check_nan(const __grid_constant__ NanParams p) {
  griddep_launch_dependents();
  bool bad = false;
  const bool al = p.scores.aligned != 0;
  const int dt = p.scores.dtype;
  if (p.vec) {  // eight 16-byte loads in flight per thread
    const int epv = dt == IMOE_DTYPE_F32 ? 4 : 8;  // scores per vector
    const uint4 *v = reinterpret_cast<const uint4 *>(p.scores.data);
    for (uint32_t it = blockIdx.x; it < p.items; it += gridDim.x) {
      const int64_t x0 = (int64_t)it * p.per, x1 = min(x0 + p.per, p.N);
      const int64_t v0 = x0 / epv, v1 = x1 / epv;
      for (int64_t vb = v0 + threadIdx.x; vb < v1; vb += 8 * (int64_t)blockDim.x) {
        uint4 q[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int64_t k = vb + (int64_t)u * blockDim.x;
          q[u] = k < v1 ? __ldg(v + k) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) bad |= vec_has_nan(q[u], dt);
      }
      for (int64_t x = v1 * epv + threadIdx.x; x < x1; x += blockDim.x)  // a last partial vector
        bad |= raw_is_nan(ldg_raw(p.scores.data + x * p.scores.n_stride, dt, al), dt);
    }
  } else {
  for (uint32_t it = blockIdx.x; it < p.items; it += gridDim.x) {
  const uint32_t r = it / p.bpr, s = it - r * p.bpr;
  uint32_t c[kMaxDims];
  row_coords(p.lead, r, c);
  const char *row = p.scores.data + row_offset(p.lead, c, p.scores.lead);
  const int64_t x0 = (int64_t)s * p.per, x1 = min(x0 + p.per, p.N);
  for (int64_t xb = x0 + threadIdx.x; xb < x1; xb += 8 * (int64_t)blockDim.x) {
    uint32_t raw[8];  // eight independent loads in flight
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t x = xb + (int64_t)u * blockDim.x;
      raw[u] = x < x1 ? ldg_raw(row + x * p.scores.n_stride, dt, al) : 0u;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) bad |= raw_is_nan(raw[u], dt);
  }
  }
  }
  bad = __syncthreads_or(bad) != 0;
  if (threadIdx.x == 0) {
    if (bad) record_status(IMOE_ERR_NAN);
    write_verdict(p.token, bad);
  }
}

// Per row: active indices (kind 1: in [0, N), distinct) or caller-given
// indices (kind 2: entry i is i, or in [M, N) and distinct). Duplicates are
// found with a shared-memory bitmap over windows of win_bits slots.
struct RowsParams {
  Lead lead;
  int64_t N;  // < 0 (kind 1 only): unknown, then no upper bound
  int64_t M;  // entries per row
  int32_t kind;
  int32_t win_bits;
  uint32_t rows;  // grid-strided
  InView v;
  uint32_t token;
};

// Entries kb + u nt (u < 8) of a row of indices, eight loads in flight per
// thread (a few long rows are checked by one block each: the loads in
// flight set its speed). Entries at or past m read as 0.
__device__ __forceinline__ void load_index8(const char *row, int64_t kb, int nt, int64_t m, const InView &iv,
                                            bool al, int64_t (&v)[8]) {
  if (al && iv.dtype == IMOE_DTYPE_I64) {  // one uniform branch, then eight plain loads
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t k = kb + (int64_t)u * nt;
      v[u] = k < m ? (int64_t)__ldg(reinterpret_cast<const long long *>(row + k * iv.n_stride)) : 0;
    }
  } else if (al) {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t k = kb + (int64_t)u * nt;
      v[u] = k < m ? (int64_t)__ldg(reinterpret_cast<const int32_t *>(row + k * iv.n_stride)) : 0;
    }
  } else {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t k = kb + (int64_t)u * nt;
      v[u] = k < m ? load_index(row + k * iv.n_stride, iv.dtype, false) : 0;
    }
  }
}

// f(k, row[k]) for this thread's entries k of a row of m indices (k = tid,
// tid + nt, ...), eight loads in flight at a time.
template <class F>
__device__ __forceinline__ void for_each_index(const char *row, int64_t m, const InView &iv, bool al, F &&f) {
  const int nt = blockDim.x;
  for (int64_t kb = threadIdx.x; kb < m; kb += 8 * (int64_t)nt) {
    int64_t vv[8];
    load_index8(row, kb, nt, m, iv, al, vv);
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t k = kb + (int64_t)u * nt;
      if (k >= m) break;
      f(k, vv[u]);
    }
  }
}

__global__ void __launch_bounds__(kCheckThreads) k_check_rows(const __grid_constant__ RowsParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  uint32_t *bits = reinterpret_cast<uint32_t *>(dsm);
  __shared__ unsigned long long s_max;
  __shared__ int s_code;
  griddep_launch_dependents();
  const int tid = threadIdx.x, nt = blockDim.x;
  const bool al = p.v.aligned != 0;
  const int64_t lo = p.kind == 1 ? 0 : p.M;
  bool bad = false;  // thread 0
  for (uint32_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
  uint32_t c[kMaxDims];
  row_coords(p.lead, r, c);
  const char *row = p.v.data + row_offset(p.lead, c, p.v.lead);
  if (tid == 0) {
    s_max = (unsigned long long)max(p.M, (int64_t)0);
    s_code = 0;
  }
  __syncthreads();
  int code = 0;
  unsigned long long mx = 0;
  for_each_index(row, p.M, p.v, al, [&](int64_t k, int64_t v) {
    if (p.kind == 1) {
      if (v < 0 || (p.N >= 0 && v >= p.N) || v >= 0x7FFFFFFFLL) code = IMOE_ERR_INDEX_RANGE;
      else if ((unsigned long long)v + 1 > mx) mx = (unsigned long long)v + 1;
    } else if (v != k) {
      if (v < 0 || v >= p.N) code = IMOE_ERR_INDEX_RANGE;
      else if (v < p.M) code = IMOE_ERR_BAD_MAP;
    }
  });
  if (code) atomicCAS(&s_code, 0, code);
  if (mx) atomicMax(&s_max, mx);
  __syncthreads();
  const int64_t N = p.N >= 0 ? p.N : (int64_t)s_max;
  const int dup_code = p.kind == 1 ? IMOE_ERR_INDEX_DUPLICATE : IMOE_ERR_BAD_MAP;
  const int wwords = p.win_bits >> 5;
  for (int64_t w0 = lo; w0 < N && s_code == 0; w0 += p.win_bits) {
    for (int i = tid; i < wwords; i += nt) bits[i] = 0u;
    __syncthreads();
    for_each_index(row, p.M, p.v, al, [&](int64_t k, int64_t v) {
      const int64_t d = v - w0;
      if ((p.kind != 2 || v != k) && d >= 0 && d < p.win_bits) {
        const uint32_t b = 1u << (d & 31);
        if (atomicOr(&bits[d >> 5], b) & b) atomicCAS(&s_code, 0, dup_code);
      }
    });
    __syncthreads();
  }
  if (tid == 0 && s_code) {
    record_status(s_code);
    bad = true;
  }
  __syncthreads();  // s_code and s_max are reset for the next row
  }
  if (tid == 0) write_verdict(p.token, bad);
}

// target_map: every entry in [0, N) and tm[tm[x]] == x.
struct TmParams {
  Lead lead;
  int64_t N;
  InView tm;
  uint32_t bpr;
  uint32_t items;  // rows x bpr pieces, grid-strided
  int64_t per;
  uint32_t token;
};

__global__ void __launch_bounds__(256) k_check_tm(const __grid_constant__ TmParams p) {
  griddep_launch_dependents();
  const bool al = p.tm.aligned != 0;
  int code = 0;
  for (uint32_t it = blockIdx.x; it < p.items; it += gridDim.x) {
  const uint32_t r = it / p.bpr, s = it - r * p.bpr;
  uint32_t c[kMaxDims];
  row_coords(p.lead, r, c);
  const char *row = p.tm.data + row_offset(p.lead, c, p.tm.lead);
  const int64_t x0 = (int64_t)s * p.per, x1 = min(x0 + p.per, p.N);
  for (int64_t x = x0 + threadIdx.x; x < x1; x += blockDim.x) {
    const int64_t v = load_index(row + x * p.tm.n_stride, p.tm.dtype, al);
    if (v < 0 || v >= p.N) {
      code = IMOE_ERR_INDEX_RANGE;
    } else {
      // a partner that is itself out of range is that slot's range error
      // (the CPU core reports ranges before involution failures)
      const int64_t back = load_index(row + v * p.tm.n_stride, p.tm.dtype, al);
      if (back < 0 || back >= p.N) code = IMOE_ERR_INDEX_RANGE;
      else if (back != x) code = IMOE_ERR_BAD_MAP;
    }
  }
  }
  if (code) record_status(code);
  const bool bad = __syncthreads_or(code != 0) != 0;
  if (threadIdx.x == 0) write_verdict(p.token, bad);
}

// ------------------------------------------------------------ select + map
struct SelParams {
  Lead lead;
  int64_t N;  // < 0 (active only): unknown, taken as max(C', max index + 1)
  int64_t Cp, P, W, K;
  int32_t nblk;      // blocks per row
  int32_t cap;       // ring capacity (entries)
  int32_t nk;        // SRC 0: keys held in shared memory (multiple of kTile)
  int32_t win_bits;  // SRC 2: bits per window
  int32_t two_win;   // SRC 2: one window per phase, rebuilt as it advances
  int32_t has_idx, has_tm;
  int32_t do_move, swap, nbuf;
  int32_t pdl;
  int32_t nverdict;     // blocks of the validation kernel (verdict words)
  int32_t fused_nan;    // k_select_small checks every row for NaN itself (cooperative launch)
  uint32_t token;
  InView scores, active;
  OutView idx, tm;
  BufDesc buf[kMaxBuf];
  int32_t wslot;  // k_select_wide: its slot of module memory (imoe_wide.cuh)
};

// SRC 0: scores, keys cached in shared memory. SRC 1: scores, keys re-read
// from global memory on every pass (long rows). SRC 2: active indices.
template <int SRC>
__global__ void __launch_bounds__(kSelThreads, 1) k_select(const __grid_constant__ SelParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ int s_hist[256];
  __shared__ int s_hist_lo[256];
  __shared__ int s_tmp[32];
  __shared__ int s_b[3];  // the digit, keys in higher bins, keys in its bin
  __shared__ unsigned long long s_max;

  const int tid = threadIdx.x, nt = blockDim.x;
  const uint32_t r = blockIdx.x / (uint32_t)p.nblk;
  const uint32_t bsub = blockIdx.x - r * (uint32_t)p.nblk;
  const char *srow;
  const char *arow;
  char *irow;
  char *trow;
  {
    uint32_t c[kMaxDims];
    row_coords(p.lead, r, c);
    srow = SRC < 2 ? p.scores.data + row_offset(p.lead, c, p.scores.lead) : nullptr;
    arow = SRC == 2 ? p.active.data + row_offset(p.lead, c, p.active.lead) : nullptr;
    irow = p.has_idx ? p.idx.data + row_offset(p.lead, c, p.idx.lead) : nullptr;
    trow = p.has_tm ? p.tm.data + row_offset(p.lead, c, p.tm.lead) : nullptr;
  }
  // parameters are read at their uses (constant bank) rather than held in registers
#define sdt p.scores.dtype
#define sal (p.scores.aligned != 0)
#define sns p.scores.n_stride
#define adt p.active.dtype
#define aal (p.active.aligned != 0)
#define ans p.active.n_stride
#define idt p.idx.dtype
#define tdt p.tm.dtype
#define ial (p.idx.aligned != 0)
#define tal (p.tm.aligned != 0)
#define ins p.idx.n_stride
#define tns p.tm.n_stride
  const int64_t Cp = p.Cp;
  const int cap = p.cap;

  int64_t N = p.N;
  if (SRC == 2 && N < 0) {
    if (tid == 0) s_max = (unsigned long long)Cp;
    __syncthreads();
    unsigned long long mx = 0;
    for (int64_t k = tid; k < p.K; k += nt) {
      const int64_t v = load_index(arow + k * ans, adt, aal);
      if (v >= 0 && (unsigned long long)v + 1 > mx) mx = (unsigned long long)v + 1;
    }
    if (mx) atomicMax(&s_max, mx);
    __syncthreads();
    N = (int64_t)s_max;
  }
  const bool trivial = Cp <= 0 || Cp >= N;

  uint32_t *keys = reinterpret_cast<uint32_t *>(dsm);
  uint32_t *win = reinterpret_cast<uint32_t *>(dsm);
  const int wwords = p.win_bits >> 5;
  size_t ring_off = 0;
  if (SRC == 0) ring_off = (size_t)p.nk * 4u;
  if (SRC == 2) ring_off = (size_t)wwords * 4u * (p.two_win ? 2u : 1u);
  int32_t *H = reinterpret_cast<int32_t *>(dsm + ring_off);
  int32_t *T = H + cap;

  const int64_t clo = p.P, chi = N - p.W;
  uint32_t thr = 0xFFFFFFFFu;  // kept candidate: key > thr, or key == thr and
  bool take_eq = false;        //   (take_eq, or tie rank < Q when needs_rank)
  bool needs_rank = false;
  int64_t Q = 0, ties_lo = 0;
  int64_t wstart0 = 0, wstart1 = 0;
  bool wvalid0 = false, wvalid1 = false;

  auto build_window = [&](uint32_t *w, int64_t ws) {
    __syncthreads();
    for (int i = tid; i < wwords; i += nt) w[i] = 0u;
    __syncthreads();
    for (int64_t k = tid; k < p.K; k += nt) {
      const int64_t d = (adt == IMOE_DTYPE_I64 ? load_index(arow + k * ans, adt, aal)
                                               : (int64_t)(int32_t)ldg_raw(arow + k * ans, adt, aal)) - ws;
      if (d >= 0 && d < p.win_bits) atomicOr(&w[d >> 5], 1u << (d & 31));
    }
    __syncthreads();
  };

  // ---- read-only part: may overlap the validation kernel (PDL)
  if (!trivial) {
    if (SRC == 0) {  // eight independent loads in flight per thread
      for (int64_t x0 = tid; x0 < p.nk; x0 += 8 * (int64_t)nt) {
        uint32_t raw[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int64_t x = x0 + (int64_t)u * nt;
          raw[u] = x < N ? ldg_raw(srow + x * sns, sdt, sal) : 0u;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          // non-candidates (protected slots, padding) hold key 0; the radix
          // passes take their count back out of bin 0
          const int64_t x = x0 + (int64_t)u * nt;
          if (x < p.nk) keys[x] = (x >= clo && x < chi) ? key_of_raw(raw[u], sdt) : 0u;
        }
      }
      __syncthreads();
    }
    if (SRC < 2) {
      const int64_t Kp = Cp - p.P - p.W;
      if (Kp > 0) {
        int need = (int)Kp;
        uint32_t prefix = 0;
        for (int pass = 0; pass < 4; ++pass) {
          const int shift = 24 - 8 * pass;
          const uint32_t hmask = pass == 0 ? 0u : (0xFFFFFFFFu << (shift + 8));
          const bool last = pass == 3;
          for (int i = tid; i < 256; i += nt) {
            s_hist[i] = 0;
            s_hist_lo[i] = 0;
          }
          __syncthreads();
          if (SRC == 0) {
            // four keys per 16-byte shared load, 32-bit indices
            const uint32_t nk = (uint32_t)p.nk, cp = (uint32_t)Cp;
            for (uint32_t i = (uint32_t)tid * 4u; i < nk; i += (uint32_t)nt * 4u) {
              const uint4 q = *reinterpret_cast<const uint4 *>(keys + i);
              const uint32_t kq[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                if ((kq[j] & hmask) == prefix) {
                  const uint32_t d = (kq[j] >> shift) & 255u;
                  atomicAdd(&s_hist[d], 1);
                  if (last && i + j < cp) atomicAdd(&s_hist_lo[d], 1);
                }
              }
            }
            __syncthreads();
            if (tid == 0 && prefix == 0u) {  // the non-candidates all sit in bin 0
              s_hist[0] -= (int)((int64_t)p.nk - (chi - clo));
              if (last) s_hist_lo[0] -= (int)(clo + max((int64_t)0, Cp - chi));
            }
          } else {
            for (int64_t x = clo + tid; x < chi; x += nt) {
              const uint32_t k = load_key(srow + x * sns, sdt, sal);
              if ((k & hmask) == prefix) {
                const int d = (k >> shift) & 255;
                atomicAdd(&s_hist[d], 1);
                if (last && x < Cp) atomicAdd(&s_hist_lo[d], 1);
              }
            }
          }
          __syncthreads();
          if (tid < 32) find_bin256(s_hist, need, s_b);
          __syncthreads();
          const int d = s_b[0];
          need -= s_b[1];
          prefix |= (uint32_t)d << shift;
          const int E = s_hist[d];
          const int lo_cnt = s_hist_lo[d];
          __syncthreads();
          if (E == need) {  // the whole bin is kept: keep every key >= prefix
            if (prefix) {
              thr = prefix - 1u;
              take_eq = false;
            } else {
              thr = 0u;
              take_eq = true;
            }
            break;
          }
          if (last) {  // exact threshold; `need` of its ties, lowest index first
            thr = prefix;
            Q = need;
            needs_rank = true;
            ties_lo = lo_cnt;
          }
        }
      }
    } else if (!p.two_win) {
      build_window(win, 0);
      wvalid0 = wvalid1 = true;
    }
  }

  // ---- from here on the call writes: wait for the validation kernel
  if (p.pdl) griddep_wait();
  // through shared memory: a flag held in a register across the round loop
  // below costs the movers their registers (more spills)
  __shared__ int s_aborted;
  if (tid == 0) s_aborted = 0;
  if (call_aborted(p.token, p.nverdict) && tid == 0) s_aborted = 1;
  __syncthreads();
  const bool aborted = *(volatile int *)&s_aborted != 0;

  if (!aborted && trivial) {
    const int64_t step = (int64_t)p.nblk * kTile;
    for (int64_t t0 = (int64_t)bsub * kTile; t0 < N; t0 += step) {
      const int64_t t1 = min(t0 + kTile, N);
      for (int64_t x = t0 + tid; x < t1; x += nt) {
        if (irow && x < Cp) store_index(irow + x * ins, idt, ial, x);
        if (trow) store_index(trow + x * tns, tdt, tal, x);
      }
    }
  } else if (!aborted) {
    int hh = 0, nh = 0, th = 0, ntl = 0;
    int64_t hcur = 0, tcur = (Cp / kTile) * kTile;
    int64_t tie0 = 0, tie1 = ties_lo;

    // One tile of kTile slots: phase 0 collects holes in [0, C'), phase 1
    // kept tail slots in [C', N), in ascending order, into the rings.
    auto tile = [&](int ph, int64_t t0) {
      const int64_t lo = ph ? Cp : 0, hi = ph ? N : Cp;
      if (SRC == 2 && p.two_win) {
        const int64_t need_hi = min(t0 + kTile, hi);
        const int64_t ws = ph ? wstart1 : wstart0;
        const bool ok = ph ? wvalid1 : wvalid0;
        if (!ok || t0 < ws || need_hi > ws + p.win_bits) {
          build_window(win + (ph ? wwords : 0), t0);
          if (ph) {
            wstart1 = t0;
            wvalid1 = true;
          } else {
            wstart0 = t0;
            wvalid0 = true;
          }
        }
      }
      const int64_t x0 = t0 + (int64_t)tid * kItems;
      bool v[kItems], kept[kItems], eq[kItems];
      uint32_t kk[kItems];
      if (SRC == 0) {
        const uint4 q = *reinterpret_cast<const uint4 *>(keys + x0);
        kk[0] = q.x;
        kk[1] = q.y;
        kk[2] = q.z;
        kk[3] = q.w;
      }
      int ce = 0;
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const int64_t x = x0 + i;
        v[i] = x >= lo && x < hi;
        eq[i] = false;
        if (SRC == 2) {
          const uint32_t *w = win + ((p.two_win && ph) ? wwords : 0);
          const int64_t d = x - (p.two_win ? (ph ? wstart1 : wstart0) : 0);
          kept[i] = v[i] && ((w[d >> 5] >> (d & 31)) & 1u);
        } else {
          const bool cand = x >= clo && x < chi;
          uint32_t k = 0u;
          if (SRC == 0) k = kk[i];
          else if (v[i] && cand) k = load_key(srow + x * sns, sdt, sal);
          eq[i] = v[i] && cand && k == thr;
          kept[i] = !cand || k > thr || (eq[i] && take_eq);
          ce += eq[i] ? 1 : 0;
        }
      }
      if (needs_rank) {
        int tot;
        const int ex = block_excl_scan(ce, &tot, s_tmp);
        int64_t rk = (ph ? tie1 : tie0) + ex;
#pragma unroll
        for (int i = 0; i < kItems; ++i) {
          if (eq[i]) {
            kept[i] = rk < Q;
            ++rk;
          }
        }
        if (ph) tie1 += tot;
        else tie0 += tot;
      }
      bool sel[kItems];
      int cs = 0;
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        sel[i] = v[i] && (ph ? kept[i] : !kept[i]);
        cs += sel[i] ? 1 : 0;
      }
      int tot2;
      const int ex2 = block_excl_scan(cs, &tot2, s_tmp);
      int32_t *ring = ph ? T : H;
      int pos = (ph ? th + ntl : hh + nh) + ex2;
      while (pos >= cap) pos -= cap;
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        if (sel[i]) {
          ring[pos] = (int32_t)(x0 + i);
          if (++pos == cap) pos = 0;
        }
      }
      if (ph) ntl += tot2;
      else nh += tot2;
      if (((uint32_t)(t0 / kTile)) % (uint32_t)p.nblk == bsub) {
#pragma unroll
        for (int i = 0; i < kItems; ++i) {
          const int64_t x = x0 + i;
          if (!v[i]) continue;
          if (ph == 0 && kept[i]) {  // kept below C': fixed point
            if (irow) store_index(irow + x * ins, idt, ial, x);
            if (trow) store_index(trow + x * tns, tdt, tal, x);
          } else if (ph == 1 && !kept[i]) {  // dropped at or beyond C': fixed point
            if (trow) store_index(trow + x * tns, tdt, tal, x);
          }
        }
      }
    };

    for (;;) {
      while (nh < kListL && hcur < Cp) {
        tile(0, hcur);
        hcur += kTile;
      }
      while (ntl < kListL && tcur < N) {
        tile(1, tcur);
        tcur += kTile;
      }
      __syncthreads();
      const int m = min(nh, ntl);
      if (m == 0) break;
      // this round's m pairs are split evenly over the row's blocks
      {
        const uint32_t B = (uint32_t)p.nblk;
        const int qa = (int)((uint32_t)m * bsub / B), qb = (int)((uint32_t)m * (bsub + 1) / B);
        const int q0 = qa;
        const uint32_t np = (uint32_t)(qb - qa);
        int hb = hh + q0, tb = th + q0;
        if (hb >= cap) hb -= cap;
        if (tb >= cap) tb -= cap;
        RingPairs get;
        get.D = H;
        get.s_off = cap;
        get.a0 = hb;
        get.b0 = tb;
        get.cap = cap;
        if (irow || trow) {
          for (uint32_t q = tid; q < np; q += nt) {
            const int2 pr = get.slots(q);
            if (irow) store_index(irow + (int64_t)pr.x * ins, idt, ial, pr.y);
            if (trow) {
              store_index(trow + (int64_t)pr.x * tns, tdt, tal, pr.y);
              store_index(trow + (int64_t)pr.y * tns, tdt, tal, pr.x);
            }
          }
        }
        if (p.do_move) {
          uint32_t c[kMaxDims];
          row_coords(p.lead, r, c);
          for (int b = 0; b < p.nbuf; ++b) {
            const BufDesc &bd = p.buf[b];
            move_pairs<>(bd.data + row_offset(p.lead, c, bd.lead), &bd, np, p.swap, get);
          }
        }
      }
      __syncthreads();
      hh += m;
      if (hh >= cap) hh -= cap;
      th += m;
      if (th >= cap) th -= cap;
      nh -= m;
      ntl -= m;
    }
  }
#undef sdt
#undef sal
#undef sns
#undef adt
#undef aal
#undef ans
#undef idt
#undef tdt
#undef ial
#undef tal
#undef ins
#undef tns
}

// ------------------------------------------------------------ fused NaN check
// (k_select_small and k_select_wide; the protocol: g_gridbar above)
// The fused NaN check's arrival (thread 0): this block's finding goes into
// the half of the grid barrier word that bit 63 (read before arriving) names.
__device__ __forceinline__ void nan_arrive(unsigned long long *gbar, int ph, bool row_nan) {
  const unsigned long long G = gridDim.x;
  unsigned long long inc = blockIdx.x == 0 ? (0x80000000ull - (G - 1ull)) << 32 : 1ull << 32;
  if (row_nan) inc += 1ull << (16 * ph);
  atomicAdd(gbar, inc);
}

// The fused NaN check's verdict (thread 0), from `seen`, a read of the word
// made after arriving: waits until every block has arrived; true when some
// block found a NaN. Block 0 clears the half the next launch on the slot
// uses, records the status and writes verdict word 0.
__device__ __forceinline__ bool nan_verdict(unsigned long long *gbar, int ph, uint32_t token,
                                            unsigned long long seen) {
  while ((int)(seen >> 63) == ph) {  // not every block has arrived
    __nanosleep(100);
    seen = ld_relaxed_u64(gbar);
  }
  const bool bad = ((seen >> (16 * ph)) & 0xFFFFull) != 0ull;
  if (blockIdx.x == 0) {
    atomicAnd(gbar, ~(0xFFFFull << (16 * (ph ^ 1))));  // the next launch's half
    if (bad) record_status(IMOE_ERR_NAN);
    g_verdict[token % kSlots][0] = bad ? token : 0u;  // for the call's later kernels
  }
  return bad;
}

// ------------------------------------------------------------ select + map, short rows
// Bits [max(a - x0, 0), min(b - x0, ipt)) of a thread's ipt-slot mask: its
// slots x0 + i that lie in [a, b).
__device__ __forceinline__ uint32_t slot_bits(int x0, int a, int b, int ipt) {
  const int lo = min(max(a - x0, 0), ipt), hi = min(max(b - x0, 0), ipt);
  return lo >= hi ? 0u : ((1u << hi) - 1u) & ~((1u << lo) - 1u);
}

// N <= kSelThreads * IPT. Thread t holds slots [t*IPT, t*IPT + IPT) of the
// row in registers, as keys, so a radix pass is IPT register compares and a
// few shared atomics into that pass's own (pre-zeroed) histogram. Barriers:
// one after zeroing the histograms; two per radix pass (histogram complete;
// warp 0's digit published); one per block scan (a tie-rank scan only when
// the threshold key is split); one when H and T are complete; one for the
// verdict. The j-th hole and the j-th kept tail land at H[j] and T[j]
// (shared memory) straight from one packed scan (holes | tails << 16).
// Several blocks per row (nblk) each recompute the selection and take an
// even share of the fixed-point slots and of the pairs, which they move at
// once. Under nan=raise (p.fused_nan, a cooperative launch) each block also
// checks its own row's scores and the blocks meet at a grid barrier word
// before anything is written (g_gridbar; cuda/NOTES.md, runs 33-37).
template <int IPT>
__device__ __forceinline__ void load_raw_row(const char *srow, int x0, int N, int dt, bool al, int64_t ns,
                                             bool vec, uint32_t (&raw)[IPT]) {
  if (vec && x0 + IPT <= N) {
    if (dt == IMOE_DTYPE_F32) {
      const uint4 *v = reinterpret_cast<const uint4 *>(srow) + (x0 >> 2);
#pragma unroll
      for (int g = 0; g < IPT / 4; ++g) {
        const uint4 q = __ldg(v + g);
        raw[4 * g] = q.x;
        raw[4 * g + 1] = q.y;
        raw[4 * g + 2] = q.z;
        raw[4 * g + 3] = q.w;
      }
    } else if (IPT == 4) {
      const uint2 q = __ldg(reinterpret_cast<const uint2 *>(srow) + (x0 >> 2));
      raw[0] = q.x & 0xFFFFu;
      raw[1] = q.x >> 16;
      raw[2] = q.y & 0xFFFFu;
      raw[3] = q.y >> 16;
    } else {
      const uint4 *v = reinterpret_cast<const uint4 *>(srow) + (x0 >> 3);
#pragma unroll
      for (int g = 0; g < IPT / 8; ++g) {
        const uint4 q = __ldg(v + g);
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          raw[8 * g + 2 * j] = w[j] & 0xFFFFu;
          raw[8 * g + 2 * j + 1] = w[j] >> 16;
        }
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < IPT; ++i) {
      const int x = x0 + i;
      raw[i] = x < N ? ldg_raw(srow + (int64_t)x * ns, dt, al) : 0u;
    }
  }
}

// MOVE5: the movers keep five loads in flight per thread instead of four
// (the host takes these kernels for moves, not swaps): a W1 block of
// 65-67 pairs of 2 KiB (8,320-8,576 vectors for 1024 threads) then moves
// in two rounds, not three (cuda/NOTES.md, run 63).
// NT: threads per block. 1024 by default; many short rows take 256 or 512
// (16 keys each) so that several rows select at once on one
// multiprocessor, each block hiding the others' latency (NOTES, run 78).
template <int IPT, bool MOVE5, int NT = kSelThreads>
__global__ void __launch_bounds__(NT, kSelThreads / NT) k_select_small(const __grid_constant__ SelParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ __align__(16) int s_hist[kSmallPasses][kSmallBins];  // one per radix pass
  __shared__ int s_part[kSmallPasses][32];  // per pass: keys in each group of 64 bins
  __shared__ uint32_t s_mm[2][32];          // per warp: least and greatest candidate key
  __shared__ int s_wsum[2][32];
  __shared__ int s_phase;  // fused NaN check: this launch's barrier phase
  __shared__ uint32_t s_sink[4];  // written, never read (the parameter reads below)
  constexpr int NW = NT / 32;  // warps; warp w sums the groups w, w + NW, ...
  static_assert(NT % 32 == 0 && 32 % NW == 0 && kSmallBins == 32 * 64, "32 groups of 64 bins");
  static_assert(kSmallPasses * kSmallBins == 6 * kSelThreads, "six histogram words per thread to zero");
  static_assert(NT == kSelThreads || kSmallPasses * kSmallBins / 4 % NT == 0, "whole rounds of 16-byte zeroing stores");
  static_assert(kVerdicts <= NT, "verdict_bad: one verdict word per thread");

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t r = blockIdx.x / (uint32_t)p.nblk;
  const uint32_t bsub = blockIdx.x - r * (uint32_t)p.nblk;
  uint32_t rc[kMaxDims];
  row_coords(p.lead, r, rc);
  const char *srow = p.scores.data + row_offset(p.lead, rc, p.scores.lead);
  const int N = (int)p.N, Cp = (int)p.Cp;
  const int clo = (int)p.P, chi = N - (int)p.W;
  const int x0 = tid * IPT;
  const int dt = p.scores.dtype;

  IMOE_PHASE(0);
  {
    int4 *hz = reinterpret_cast<int4 *>(&s_hist[0][0]);
    if constexpr (NT == kSelThreads) {
      hz[tid] = make_int4(0, 0, 0, 0);
      if (tid < kSelThreads / 2) hz[tid + kSelThreads] = make_int4(0, 0, 0, 0);
    } else {
#pragma unroll
      for (int i = 0; i < kSmallPasses * kSmallBins / 4; i += NT) hz[i + tid] = make_int4(0, 0, 0, 0);
    }
  }
  // fused NaN check: the barrier word before this launch's arrivals (its
  // bit 63, the phase, says which NaN half is this launch's), read while the
  // keys load
  unsigned long long bar = 0ull;
  if (p.fused_nan && tid == 0) bar = ld_relaxed_u64(&g_gridbar[p.token % kSlots]);
  bool nan_here = false;

  // ---- read-only part: may overlap the validation kernel (PDL)
  char *irow;
  char *trow;
  uint32_t key[IPT];  // non-candidates (protected, window, padding) hold 0
  {
    const int es = dt == IMOE_DTYPE_F32 ? 4 : 2;
    const uintptr_t vb = (uintptr_t)min(16, es * IPT);
    const bool vec = p.scores.aligned && p.scores.n_stride == es && ((uintptr_t)srow & (vb - 1)) == 0;
    uint32_t raw[IPT];
    load_raw_row<IPT>(srow, x0, N, dt, p.scores.aligned != 0, p.scores.n_stride, vec, raw);
    // the constant-bank words the write phase reads first (the outputs'
    // views, the first buffer's descriptor), read by one lane of warps 1-4
    // (one per scheduler) while the keys load; the volatile shared store
    // keeps the reads (cuda/NOTES.md, run 98)
    if (lane == 0 && warp >= 1 && warp <= 4) {
      uint64_t v = (uint64_t)p.idx.n_stride ^ (uint64_t)p.tm.n_stride ^ (uint64_t)(uintptr_t)p.buf[0].data ^
                   (uint64_t)p.buf[0].n_stride;
      v ^= (uint32_t)(p.idx.dtype ^ p.idx.aligned ^ p.tm.dtype ^ p.tm.aligned ^ p.do_move ^ p.nbuf ^ p.swap ^
                      p.buf[0].vw ^ (int)p.buf[0].body);
      *(volatile uint32_t *)&s_sink[warp - 1] = (uint32_t)v ^ (uint32_t)(v >> 32);
    }
    if (p.fused_nan) {  // every slot of the row, as k_check_nan (slots >= N read as 0)
#pragma unroll
      for (int i = 0; i < IPT; ++i) nan_here |= raw_is_nan(raw[i], dt);
    }
    // the outputs' rows while the keys are on their way
    irow = p.has_idx ? p.idx.data + row_offset(p.lead, rc, p.idx.lead) : nullptr;
    trow = p.has_tm ? p.tm.data + row_offset(p.lead, rc, p.tm.lead) : nullptr;
    // one uniform branch on the dtype, then straight-line conversions
    if (dt == IMOE_DTYPE_F32) {
#pragma unroll
      for (int i = 0; i < IPT; ++i) key[i] = key_of_bits(raw[i]);
    } else if (dt == IMOE_DTYPE_F16) {
#pragma unroll
      for (int i = 0; i < IPT; ++i)
        key[i] = key_of_bits(__float_as_uint(__half2float(__ushort_as_half((unsigned short)raw[i]))));
    } else {
#pragma unroll
      for (int i = 0; i < IPT; ++i) key[i] = key_of_bits(raw[i] << 16);
    }
    // the candidates' least and greatest key: the first pass bins that range
    uint32_t kmn = 0xFFFFFFFFu, kmx = 0u;
#pragma unroll
    for (int i = 0; i < IPT; ++i) {
      const int x = x0 + i;
      if (x < clo || x >= chi) {
        key[i] = 0u;
      } else {
        kmn = min(kmn, key[i]);
        kmx = max(kmx, key[i]);
      }
    }
    kmn = __reduce_min_sync(0xFFFFFFFFu, kmn);
    kmx = __reduce_max_sync(0xFFFFFFFFu, kmx);
    if (lane == 0) {
      s_mm[0][warp] = kmn;
      s_mm[1][warp] = kmx;
    }
  }
  const bool all_kept = Cp >= N;
  const int Kp = Cp - clo - (int)p.W;  // candidates to keep
  uint32_t thr = 0xFFFFFFFFu;  // kept candidate: key > thr, or key == thr and
  bool take_eq = false;        //   (take_eq, or tie rank < Q when needs_rank)
  bool needs_rank = false;
  int Q = 0;
#ifdef IMOE_PHASE_TIMES
  if (key[0] == 0xDEADBEEFu) s_wsum[0][0] = 1;  // waits for the keys
#endif
  if (p.fused_nan) {  // uniform: arrive, with this row's finding
    const bool row_nan = __syncthreads_or(nan_here) != 0;
    if (tid == 0) {
      // bit 63 flips only once this block has arrived: the phase of this launch
      const int ph = (int)(bar >> 63);
      s_phase = ph;
      nan_arrive(&g_gridbar[p.token % kSlots], ph, row_nan);
    }
  } else {
    __syncthreads();
  }
  IMOE_PHASE(1);
  if (!all_kept && Kp > 0) {
    const int noncand = NT * IPT - (chi - clo);
    int need = Kp;
    // Keys in play lie in [base, base + span]; a pass bins them by
    // (key - base) >> sh into at most kSmallBins bins. The first pass spans
    // the candidates' keys only, so scores that share their high bits (say
    // all in [0, 1)) resolve in two passes; any keys resolve in three.
    uint32_t base = __reduce_min_sync(0xFFFFFFFFu, NW == 32 || lane < NW ? s_mm[0][lane] : 0xFFFFFFFFu);
    uint32_t span = __reduce_max_sync(0xFFFFFFFFu, NW == 32 || lane < NW ? s_mm[1][lane] : 0u) - base;
    int sh = max(0, 32 - __clz(span) - kSmallDigit);
#pragma unroll 1
    for (int pass = 0; pass < kSmallPasses; ++pass) {
      int *hist = s_hist[pass];
#pragma unroll
      for (int i = 0; i < IPT; ++i) {
        const uint32_t d = key[i] - base;
        // no branch around the atomic: a key out of play adds 0 to the bin
        // of its lane's number (an add of the constant 1 under a condition
        // compiles to a branch pair per key; NOTES, run 97)
        const bool in = d <= span;
        atomicAdd(&hist[in ? d >> sh : (uint32_t)lane], (int)in);
      }
      __syncthreads();
      // the non-candidates (key 0) are in play, in bin 0, when base is 0
      const int drop0 = base == 0u ? noncand : 0;
#pragma unroll
      for (int gi = 0; gi < 32 / NW; ++gi) {  // group g: bins [64 g, 64 g + 64)
        const int g = warp + gi * NW;
        const int2 h = *reinterpret_cast<const int2 *>(hist + 64 * g + 2 * lane);
        const int v = __reduce_add_sync(0xFFFFFFFFu, h.x + h.y - (gi == 0 && tid == 0 ? drop0 : 0));
        if (lane == 0) s_part[pass][g] = v;
      }
      __syncthreads();
      // every warp finds the digit itself (no third barrier): the group of
      // 64 bins that holds the need-th key from the top, then the bin
      const int g = s_part[pass][lane];
      const int sg = warp_suffix_sum(g);  // keys in groups >= lane
      const int G = 31 - __clz(__ballot_sync(0xFFFFFFFFu, sg >= need));
      const int above_g = __shfl_sync(0xFFFFFFFFu, sg - g, G);
      const int2 h = *reinterpret_cast<const int2 *>(hist + 64 * G + 2 * lane);
      const int h0 = h.x - (G == 0 && lane == 0 ? drop0 : 0);
      const int v = h0 + h.y;
      const int sv = warp_suffix_sum(v) + above_g;  // keys in bins >= 64 G + 2 lane
      const int L = 31 - __clz(__ballot_sync(0xFFFFFFFFu, sv >= need));
      const int a = sv - v;  // keys above this lane's two bins
      const bool up = a + h.y >= need;
      const int dg = 64 * G + 2 * lane + (up ? 1 : 0);
      const int bl = up ? a : a + h.y;  // keys in higher bins
      const int at = up ? h.y : h0;     // keys in the digit's bin
      const uint32_t digit = (uint32_t)__shfl_sync(0xFFFFFFFFu, dg, L);
      need -= __shfl_sync(0xFFFFFFFFu, bl, L);
      const int inbin = __shfl_sync(0xFFFFFFFFu, at, L);
      IMOE_PHASE(2 + pass);
      base += digit << sh;
      if (inbin == need) {  // the whole bin is kept: keep every key >= base
        if (base) {
          thr = base - 1u;
        } else {
          thr = 0u;
          take_eq = true;
        }
        break;
      }
      if (sh == 0) {  // exact threshold; `need` of its ties, lowest index first
        thr = base;
        Q = need;
        needs_rank = true;
        break;
      }
      span = (1u << sh) - 1u;
      sh = max(sh - kSmallDigit, 0);
    }
  }

  // fused NaN check: every block arrived long ago, most likely; the read is
  // in flight while the flags, ranks and H, T are built
  unsigned long long seen = 0ull;
  if (p.fused_nan && tid == 0) seen = ld_relaxed_u64(&g_gridbar[p.token % kSlots]);

  // ---- kept flags, then holes in [0, C') and kept tails in [C', N); bit i
  // of a mask stands for slot x0 + i
  const uint32_t inrow = slot_bits(x0, 0, N, IPT), cand = slot_bits(x0, clo, chi, IPT);
  const uint32_t below = slot_bits(x0, 0, Cp, IPT);
  uint32_t keptm = inrow & ~cand;  // protected and window slots
  if (all_kept || Kp > 0) {        // else no candidate is kept
    // a kept candidate has key >= lo (thr < 0xFFFFFFFF here: no overflow)
    const uint32_t lo = all_kept ? 0u : thr + (take_eq ? 0u : 1u);
    uint32_t ge = 0u;
#pragma unroll
    for (int i = 0; i < IPT; ++i) ge |= (key[i] >= lo ? 1u : 0u) << i;
    keptm |= inrow & cand & ge;
  }
  if (needs_rank) {  // uniform
    uint32_t eqm = 0u;
#pragma unroll
    for (int i = 0; i < IPT; ++i) eqm |= (key[i] == thr ? 1u : 0u) << i;
    eqm &= cand & inrow;
    int tot;
    int rk = block_excl_scan_1sync(__popc(eqm), &tot, s_wsum[0]);
#pragma unroll
    for (int i = 0; i < IPT; ++i) {
      if ((eqm >> i) & 1u) {
        if (rk < Q) keptm |= 1u << i;
        ++rk;
      }
    }
  }
  IMOE_PHASE(6);
  const uint32_t holem = below & inrow & ~keptm, tailm = ~below & keptm;
  int tot;
  const int ex = block_excl_scan_1sync(__popc(holem) | (__popc(tailm) << 16), &tot, s_wsum[1]);
  const int m = tot & 0xFFFF;  // holes == kept tails
  int32_t *H = reinterpret_cast<int32_t *>(dsm);
  int32_t *T = H + p.cap;
  {  // shared-space addresses computed once, not per predicated store
    uint32_t ah = (uint32_t)__cvta_generic_to_shared(H) + 4u * (uint32_t)(ex & 0xFFFF);
    uint32_t at = (uint32_t)__cvta_generic_to_shared(T) + 4u * (uint32_t)(ex >> 16);
#pragma unroll
    for (int i = 0; i < IPT; ++i) {
      if ((holem >> i) & 1u) {
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(ah), "r"(x0 + i) : "memory");
        ah += 4u;
      }
      if ((tailm >> i) & 1u) {
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(at), "r"(x0 + i) : "memory");
        at += 4u;
      }
    }
  }
  const uint32_t B = (uint32_t)p.nblk;
  // this block's even share of the pairs
  const int qa = (int)((uint32_t)m * bsub / B), qb = (int)((uint32_t)m * (bsub + 1u) / B);
  IMOE_PHASE(7);
#ifdef IMOE_PHASE_TIMES
  if (tid == 0 && blockIdx.x < kPhaseBlocks) g_phase[blockIdx.x][1][kPhases - 1] = (unsigned long long)(qb - qa);
#endif

  // ---- from here on the call writes: wait for the validation (the verdict
  // words of the check kernel, or the grid barrier), then one barrier: H and
  // T complete, and the verdict
  bool bad = false;
  if (p.fused_nan) {
    if (tid == 0) bad = nan_verdict(&g_gridbar[p.token % kSlots], s_phase, p.token, seen);
  } else {
    if (p.pdl) griddep_wait();
    bad = verdict_bad(p.token, p.nverdict);
  }
  if (__syncthreads_or(bad)) return;
  IMOE_PHASE(8);

  // ---- MOVE5, one buffer: the first round of its moves (whole pairs of
  // 16-byte vectors) is loaded into registers before the index writes, so
  // that its latency overlaps them. Not before the verdict: a barrier waits
  // for the loads its threads have in flight. Two buffers (W2) measured
  // slower with it through the API (cuda/NOTES.md, runs 98-100).
  constexpr int PU = 5;  // vectors per thread, the mover's round
  uint4 pre[PU];
  int npre = 0;  // pairs of this block's share held in `pre`
  uint32_t pU = 1u;
  // vector k of this thread's round in buffer 0's row b0: false past the
  // round, else *v = vector w of slot S[qa + q] (S: T to load, H to store)
  auto round_vec = [&](char *b0, int k, const int32_t *S, uint4 *&v) -> bool {
    const uint32_t u = (uint32_t)(tid + k * NT), q = u / pU, w = u - q * pU;
    if (q >= (uint32_t)npre) return false;
    v = reinterpret_cast<uint4 *>(b0 + (int64_t)S[qa + (int)q] * p.buf[0].n_stride) + w;
    return true;
  };
  auto buf0_row = [&]() { return p.buf[0].data + row_offset(p.lead, rc, p.buf[0].lead); };
  if (MOVE5 && p.do_move && p.nbuf == 1 && qb > qa && p.buf[0].vw == 16 && p.buf[0].head == 0 &&
      p.buf[0].tail == 0 && p.buf[0].body <= (uint32_t)(PU * NT)) {  // uniform
    pU = p.buf[0].body;
    npre = min(qb - qa, (int)((uint32_t)(PU * NT) / pU));
    char *b0 = buf0_row();
#pragma unroll
    for (int k = 0; k < PU; ++k) {
      uint4 *v;
      if (round_vec(b0, k, T, v)) pre[k] = *v;
    }
  }

  {  // fixed points of this block's share of the slots
    const int f0 = (int)((uint32_t)N * bsub / B), f1 = (int)((uint32_t)N * (bsub + 1u) / B);
    if (x0 < f1 && x0 + IPT > f0) {
#pragma unroll
      for (int i = 0; i < IPT; ++i) {
        const int x = x0 + i;
        if (x < f0 || x >= f1) continue;
        const bool k = (keptm >> i) & 1u;
        if (x < Cp) {
          if (k) {
            if (irow) store_index(irow + (int64_t)x * p.idx.n_stride, p.idx.dtype, p.idx.aligned != 0, x);
            if (trow) store_index(trow + (int64_t)x * p.tm.n_stride, p.tm.dtype, p.tm.aligned != 0, x);
          }
        } else if (!k) {
          if (trow) store_index(trow + (int64_t)x * p.tm.n_stride, p.tm.dtype, p.tm.aligned != 0, x);
        }
      }
    }
  }
  if (irow || trow) {
    for (int q = qa + tid; q < qb; q += NT) {
      const int hx = H[q], tx = T[q];
      if (irow) store_index(irow + (int64_t)hx * p.idx.n_stride, p.idx.dtype, p.idx.aligned != 0, tx);
      if (trow) {
        store_index(trow + (int64_t)hx * p.tm.n_stride, p.tm.dtype, p.tm.aligned != 0, tx);
        store_index(trow + (int64_t)tx * p.tm.n_stride, p.tm.dtype, p.tm.aligned != 0, hx);
      }
    }
  }
  IMOE_PHASE(9);
  if (npre > 0) {  // the preloaded round's stores
    char *b0 = buf0_row();
#pragma unroll
    for (int k = 0; k < PU; ++k) {
      uint4 *v;
      if (round_vec(b0, k, H, v)) *v = pre[k];
    }
  }
  if (p.do_move && qb > qa) {
    RingPairs get;
    get.D = H;
    get.s_off = p.cap;
    get.cap = 0x7FFFFFFF;
    uint32_t c[kMaxDims];
    row_coords(p.lead, r, c);
    for (int b = 0; b < p.nbuf; ++b) {
      const int done = b == 0 ? npre : 0;  // pairs the preloaded round moved
      if (qb - qa == done) continue;
      get.a0 = qa + done;
      get.b0 = qa + done;
      const BufDesc &bd = p.buf[b];
      char *base = bd.data + row_offset(p.lead, c, bd.lead);
      move_pairs<MOVE5 ? 5 : 4>(base, &bd, (uint32_t)(qb - qa - done), p.swap, get);
    }
  }
#ifdef IMOE_PHASE_TIMES
  __syncthreads();
  IMOE_PHASE(10);
#endif
}

// ------------------------------------------------------------ apply a map
struct ApplyParams {
  Lead lead;
  int64_t M;     // map entries per row
  int32_t kind;  // 0: indices [C'] (i <-> idx[i] when different); 1: target_map (x <-> tm[x] when tm[x] > x)
  int32_t swap, nbuf, pdl;
  int32_t nverdict;
  uint32_t seg, nseg;
  uint32_t token;
  InView map;
  BufDesc buf[kMaxBuf];
};

__global__ void __launch_bounds__(kApplyThreads, 4) k_apply(const __grid_constant__ ApplyParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  int32_t *s_dst = reinterpret_cast<int32_t *>(dsm);
  int32_t *s_src = s_dst + p.seg;
  __shared__ int s_n;
  const uint32_t r = blockIdx.x / p.nseg, sg = blockIdx.x - r * p.nseg;
  const int64_t i0 = (int64_t)sg * p.seg, i1 = min(i0 + (int64_t)p.seg, p.M);
  uint32_t c[kMaxDims];
  row_coords(p.lead, r, c);
  const char *mrow = p.map.data + row_offset(p.lead, c, p.map.lead);
  const bool al = p.map.aligned != 0;
  if (threadIdx.x == 0) s_n = 0;
  __syncthreads();
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const int64_t v = load_index(mrow + i * p.map.n_stride, p.map.dtype, al);
    if (p.kind == 0 ? v != i : v > i) {
      const int s = atomicAdd(&s_n, 1);
      s_dst[s] = (int32_t)i;
      s_src[s] = (int32_t)v;
    }
  }
  if (p.pdl) griddep_wait();
  const bool aborted = call_aborted(p.token, p.nverdict);
  __syncthreads();
  const int n = s_n;
  if (!aborted && n > 0) {
    RingPairs get;
    get.D = s_dst;
    get.s_off = (int)p.seg;
    get.a0 = 0;
    get.b0 = 0;
    get.cap = 0x7FFFFFFF;
    for (int b = 0; b < p.nbuf; ++b) {
      const BufDesc &bd = p.buf[b];
      move_pairs_inline(bd.data + row_offset(p.lead, c, bd.lead), bd, (uint32_t)n, p.swap, get);
    }
  }
}

}  // namespace imoe_cu
