// imoe_select_small.cuh: k_select_small, the select + map (+ fused moves) of
// rows of at most kSmallMaxN slots with scores: every key in registers
// (docs/cuda-design.md, "Select paths").
#pragma once

#include "imoe_select_common.cuh"

namespace imoe_cu {

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
// before anything is written (g_gridbar; docs/cuda-design.md, "Data errors").
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

// Every pass's histogram zeroed up front (16-byte stores).
template <int NT>
__device__ __forceinline__ void small_zero_histograms(int (*s_hist)[kSmallBins], int tid) {
  int4 *hz = reinterpret_cast<int4 *>(&s_hist[0][0]);
  if constexpr (NT == kSelThreads) {
    hz[tid] = make_int4(0, 0, 0, 0);
    if (tid < kSelThreads / 2) hz[tid + kSelThreads] = make_int4(0, 0, 0, 0);
  } else {
#pragma unroll
    for (int i = 0; i < kSmallPasses * kSmallBins / 4; i += NT) hz[i + tid] = make_int4(0, 0, 0, 0);
  }
}

// MOVE5: the movers keep five loads in flight per thread instead of four
// (the host takes these kernels for moves, not swaps): a W1 block of
// 65-67 pairs of 2 KiB (8,320-8,576 vectors for 1024 threads) then moves
// in two rounds, not three (docs/cuda-design.md, "Moves").
// NT: threads per block. 1024 by default; many short rows take 256 or 512
// (16 keys each) so that several rows select at once on one
// multiprocessor, each block hiding the others' latency (docs/cuda-design.md,
// "Select paths").
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
  static_assert(NT == kSelThreads || kSmallPasses * kSmallBins / 4 % NT == 0,
                "whole rounds of 16-byte zeroing stores");
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
  small_zero_histograms<NT>(s_hist, tid);
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
    // keeps the reads (docs/cuda-design.md, "The write phase")
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
  IMOE_PHASE_WAIT_KEYS(key[0], s_wsum[0][0]);
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
        // compiles to a branch pair per key; docs/cuda-design.md, "Select paths")
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
  IMOE_PHASE_PAIRS(tid, qb - qa);

  // ---- from here on the call writes: wait for the validation (the verdict
  // words of the check kernel, or the grid barrier), then one barrier: H and
  // T complete, and the verdict
  bool bad = false;
  if (p.fused_nan) {
    if (tid == 0) bad = nan_verdict(&g_gridbar[p.token % kSlots], s_phase, p.token, seen);
  } else {
    if (p.pdl) griddep_wait();
    bad = verdict_bad(module_words(), p.token, p.nverdict);
  }
  if (__syncthreads_or(bad)) return;
  IMOE_PHASE(8);

  // ---- MOVE5, one buffer: the first round of its moves (whole pairs of
  // 16-byte vectors) is loaded into registers before the index writes, so
  // that its latency overlaps them. Not before the verdict: a barrier waits
  // for the loads its threads have in flight. Two buffers (W2) measured
  // slower with it through the API (docs/cuda-design.md, "The write phase").
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
  IMOE_PHASE_END(10);
}

}  // namespace imoe_cu
