// imoe_select_rows.cuh: k_select<SRC>, the select + map (+ fused moves) of
// rows that k_select_small and k_select_wide do not take: rows longer than
// kSmallMaxN slots, and active indices (docs/cuda-design.md, "Select paths").
// Per row: top-C selection (radix select on order-preserving keys) or active
// indices, then the idempotent map (j-th hole <-> j-th kept tail slot)
// streamed through two shared-memory rings; writes the outputs and, fused,
// moves the buffers. Several blocks may work on one row: each recomputes the
// (deterministic) selection and owns a share of the output tiles and of the
// pairs.
#pragma once

#include "imoe_select_common.cuh"

namespace imoe_cu {

// SRC 0: the row's keys into shared memory, eight independent loads in
// flight per thread. Non-candidates (protected slots, padding) hold key 0;
// the radix passes take their count back out of bin 0.
__device__ __forceinline__ void rows_load_keys(const SelParams &p, const char *srow, uint32_t *keys,
                                               int64_t N, int64_t clo, int64_t chi, int tid, int nt) {
  for (int64_t x0 = tid; x0 < p.nk; x0 += 8 * (int64_t)nt) {
    uint32_t raw[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t x = x0 + (int64_t)u * nt;
      raw[u] = x < N ? ldg_raw(srow + x * p.scores.n_stride, p.scores.dtype, (p.scores.aligned != 0)) : 0u;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t x = x0 + (int64_t)u * nt;
      if (x < p.nk) keys[x] = (x >= clo && x < chi) ? key_of_raw(raw[u], p.scores.dtype) : 0u;
    }
  }
}

// k_select's radix select (SRC 0: keys in shared memory; SRC 1: re-read
// from global memory): 8-bit passes from the top find the threshold that
// keeps C' - P - W candidates of [clo, chi), exiting early when a whole bin
// is kept. A kept candidate has key > thr, or key == thr and (take_eq, or
// tie rank < Q when needs_rank); ties_lo: the threshold's ties below C'.
template <int SRC>
__device__ __forceinline__ void rows_radix_select(const SelParams &p, const char *srow, const uint32_t *keys,
                                                  int64_t Cp, int64_t clo, int64_t chi, int tid, int nt,
                                                  int *s_hist, int *s_hist_lo, int *s_b, uint32_t &thr,
                                                  bool &take_eq, bool &needs_rank, int64_t &Q,
                                                  int64_t &ties_lo) {
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
          const uint32_t k = load_key(srow + x * p.scores.n_stride, p.scores.dtype, (p.scores.aligned != 0));
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
}

// C' <= 0 or C' >= N: the map is the identity. This block's share of the
// row's tiles (tile t belongs to block t mod nblk) writes it.
__device__ __forceinline__ void rows_write_identity(const SelParams &p, int64_t N, int64_t Cp, uint32_t bsub,
                                                    int tid, int nt, char *irow, char *trow) {
  const int64_t step = (int64_t)p.nblk * kTile;
  for (int64_t t0 = (int64_t)bsub * kTile; t0 < N; t0 += step) {
    const int64_t t1 = min(t0 + kTile, N);
    for (int64_t x = t0 + tid; x < t1; x += nt) {
      if (irow && x < Cp) store_index(irow + x * p.idx.n_stride, p.idx.dtype, p.idx.aligned != 0, x);
      if (trow) store_index(trow + x * p.tm.n_stride, p.tm.dtype, p.tm.aligned != 0, x);
    }
  }
}

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
                                               : (int64_t)(int32_t)ldg_raw(arow + k * ans, adt, aal)) -
                        ws;
      if (d >= 0 && d < p.win_bits) atomicOr(&w[d >> 5], 1u << (d & 31));
    }
    __syncthreads();
  };

  // ---- read-only part: may overlap the validation kernel (PDL)
  if (!trivial) {
    if (SRC == 0) {
      rows_load_keys(p, srow, keys, N, clo, chi, tid, nt);
      __syncthreads();
    }
    if (SRC < 2) {
      rows_radix_select<SRC>(p, srow, keys, Cp, clo, chi, tid, nt, s_hist, s_hist_lo, s_b, thr, take_eq,
                             needs_rank, Q, ties_lo);
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
  if (call_aborted(module_words(), p.token, p.nverdict) && tid == 0) s_aborted = 1;
  __syncthreads();
  const bool aborted = *(volatile int *)&s_aborted != 0;

  if (!aborted && trivial) {
    rows_write_identity(p, N, Cp, bsub, tid, nt, irow, trow);
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
          if (SRC == 0)
            k = kk[i];
          else if (v[i] && cand)
            k = load_key(srow + x * sns, sdt, sal);
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
        if (ph)
          tie1 += tot;
        else
          tie0 += tot;
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
      if (ph)
        ntl += tot2;
      else
        nh += tot2;
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

}  // namespace imoe_cu
