// imoe_select_wide.cuh: the selection of a few long rows, spread over the GPU
// (k_select_wide; docs/cuda-design.md, "Select paths"). Part of imoe_select.cu.
//
// k_select (long rows) gives every block of a row the whole row: each one
// runs every radix pass and every hole and tail scan over all N slots, so a
// row of 131,072 slots costs the same on one SM as on a hundred. Here the
// row is cut into nblk chunks of S = ceil(N / nblk) slots, block b owns
// chunk b, and the blocks of a row meet at a row barrier (a word per row in
// module memory; the launch is cooperative, so every block is resident):
//   1. radix passes, 8 bits each from the top: a block counts its chunk's
//      candidates into a shared histogram and adds the non-zero bins to the
//      row's histogram in module memory; after the row barrier every block
//      reads the row's 256 bins and picks the same digit (at most four
//      passes, fewer when the threshold's bin is kept whole);
//   2. each block publishes its chunk's holes, kept tails and threshold
//      ties; after a row barrier every block scans the row's nblk counts:
//      the rank of the first hole, kept tail and tie of every chunk;
//   3. block b takes pairs [m b / nblk, m (b + 1) / nblk) (m pairs in the
//      row), finds their holes and tails again in the chunks that hold them
//      (their scores loaded into shared memory in batches of 8,192, then a
//      block scan per chunk), writes their indices and moves them. The
//      j-th hole pairs with the j-th kept tail, as on the CPU, and the
//      threshold's ties keep the lowest indices.
// Under nan=raise each block also checks its chunk for NaN during the first
// pass and the blocks meet at the call's grid barrier word before anything
// is written, as k_select_small does (g_gridbar).
//
// Module memory, per call slot (kWideSlots; the slot is a call token modulo
// kWideSlots, like the verdict slots): two 256-bin histograms per row (pass
// k adds into buffer k & 1 and takes its pass k - 2 counts back out; the
// last two passes' counts are taken out after the count barrier, when no
// block reads them any more, so every launch leaves them zero), a barrier
// word per row, and one count record per block.
#pragma once

#include "imoe_select_common.cuh"

namespace imoe_cu {

constexpr int kWideSlots = 16;
constexpr int kWideMaxRows = 64;
constexpr int kWideMaxBlocks = 1024;  // one chunk per thread in the rank scans
static_assert(kWideMaxBlocks <= kSelThreads, "a thread per chunk");
constexpr int kWideIpt = 8;                 // slots per thread in one block scan
constexpr int kWideSub = kSelThreads * kWideIpt;
constexpr int kWidePieces = 32;             // pieces of slots per batch
constexpr int kWideMaxCap = 16384;          // pairs a block holds at once (H and T: 128 KiB)
// The scratch: see above (2 MiB of histograms, 4 KiB of barrier words,
// 256 KiB of count records).

__device__ int g_whist[kWideSlots][kWideMaxRows][2][256];
__device__ unsigned g_wbar[kWideSlots][kWideMaxRows];
__device__ int4 g_wcnt[kWideSlots][kWideMaxBlocks];

__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned *p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every block of a row meets here (nb blocks; the row's block 0 leads). The
// word's bit 31 flips when the last block arrives (the leader adds
// 2^31 - (nb - 1), the others 1) and its low bits return to their value, so
// the word needs no reset between barriers or launches.
__device__ __forceinline__ void row_sync(unsigned *w, unsigned nb, bool leader) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned inc = leader ? 0x80000000u - (nb - 1u) : 1u;
    __threadfence();
    const unsigned old = atomicAdd(w, inc);
    while (((old ^ ld_acquire_u32(w)) & 0x80000000u) == 0u) {
    }
    __threadfence();
  }
  __syncthreads();
}

// Slot classes against the row's threshold.
enum { kDropped = 0, kKept = 1, kTie = 2 };

// One radix pass over this block's chunk [c0, c1): the candidates' keys
// whose higher digits match prefix counted into this pass's histogram
// (hist); with nan_pass, also whether a score of the chunk is NaN (returned).
__device__ __forceinline__ bool wide_count_chunk(const char *srow, int64_t c0, int64_t c1, int64_t clo,
                                                 int64_t chi, int dt, bool sal, int64_t sns, int tid, int nt,
                                                 int pass, int shift, uint32_t prefix, bool nan_pass,
                                                 bool done, int *hist) {
  bool nan_here = false;
  for (int64_t x = c0 + tid; x < c1; x += nt) {
    const uint32_t raw = ldg_raw(srow + x * sns, dt, sal);
    if (nan_pass) nan_here |= raw_is_nan(raw, dt);
    if (!done && x >= clo && x < chi) {
      const uint32_t key = key_of_raw(raw, dt);
      if (pass == 0 || (key >> (shift + 8)) == (prefix >> (shift + 8)))
        atomicAdd(&hist[(key >> shift) & 255u], 1);
    }
  }
  return nan_here;
}

// Bin tid of this block's pass counts added to the row's histogram (buffer
// pass & 1), and its pass - 2 counts taken back out (every block read those
// before the last row barrier).
__device__ __forceinline__ void wide_publish_counts(int (*G)[256], const int (*s_h)[256], int pass, int tid) {
  const int v = s_h[pass][tid];
  if (v) atomicAdd(&G[pass & 1][tid], v);
  if (pass >= 2) {
    const int u = s_h[pass - 2][tid];
    if (u) atomicSub(&G[pass & 1][tid], u);
  }
}

// This chunk's holes (dropped below C'), kept tails (at or beyond C', ties
// aside), ties and ties below C' into its count record of g_wcnt; cls(x, raw)
// is a slot's class against the row's threshold.
template <class Cls>
__device__ __forceinline__ void wide_chunk_counts(const SelParams &p, const char *srow, int64_t c0,
                                                  int64_t c1, int64_t Cp, int dt, bool sal, int64_t sns,
                                                  int tid, int lane, int nt, const Cls &cls, int *s_cnt) {
  int hn = 0, tn = 0, ti = 0, tl = 0;
  for (int64_t x = c0 + tid; x < c1; x += nt) {
    const int c = cls(x, ldg_raw(srow + x * sns, dt, sal));
    if (c == kTie) {
      ++ti;
      tl += x < Cp ? 1 : 0;
    } else if (x < Cp) {
      hn += c == kDropped ? 1 : 0;
    } else {
      tn += c == kKept ? 1 : 0;
    }
  }
  hn = __reduce_add_sync(0xFFFFFFFFu, hn);
  tn = __reduce_add_sync(0xFFFFFFFFu, tn);
  ti = __reduce_add_sync(0xFFFFFFFFu, ti);
  tl = __reduce_add_sync(0xFFFFFFFFu, tl);
  if (lane == 0) {
    if (hn) atomicAdd(&s_cnt[0], hn);
    if (tn) atomicAdd(&s_cnt[1], tn);
    if (ti) atomicAdd(&s_cnt[2], ti);
    if (tl) atomicAdd(&s_cnt[3], tl);
  }
  __syncthreads();
  if (tid == 0) __stcg(&g_wcnt[p.wslot][blockIdx.x], make_int4(s_cnt[0], s_cnt[1], s_cnt[2], s_cnt[3]));
}

// The row's ranks from its chunks' count records (g_wcnt: holes, kept tails,
// ties, ties below C'): one thread per chunk (nblk <= kSelThreads),
// three block scans. Per chunk the row rank of its first hole, kept tail and
// tie, and its ties below C' (entry nblk: the row's totals). A chunk's kept
// ties are its lowest: min(max(Q - ties before it, 0), its ties).
__device__ __forceinline__ void wide_row_ranks(const SelParams &p, uint32_t r, int nblk, bool rank, int Q,
                                               int tid, int (*s_wsum)[32], int *s_hpre, int *s_tpre,
                                               int *s_tq, int *s_tlo) {
  const int4 v = tid < nblk ? __ldcg(&g_wcnt[p.wslot][r * (uint32_t)nblk + tid]) : make_int4(0, 0, 0, 0);
  int tq, hp, tp;
  const int tqc = block_excl_scan_1sync(v.z, &tq, s_wsum[0]);  // ties before chunk tid
  const int kc = rank ? min(max(Q - tqc, 0), v.z) : 0;           // its kept ties (its lowest)
  const int klo = min(kc, v.w);                                  // ... below C'
  const int holes = v.x + (v.w - klo), tails = v.y + (kc - klo);
  const int hx = block_excl_scan_1sync(holes, &hp, s_wsum[1]);
  const int tx = block_excl_scan_1sync(tails, &tp, s_wsum[2]);
  if (tid < nblk) {
    s_tq[tid] = tqc;
    s_tlo[tid] = v.w;
    s_hpre[tid] = hx;
    s_tpre[tid] = tx;
  }
  if (tid == 0) {
    s_hpre[nblk] = hp;
    s_tpre[nblk] = tp;
    s_tq[nblk] = tq;
  }
}

__global__ void __launch_bounds__(kSelThreads, 1) k_select_wide(const __grid_constant__ SelParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ int s_h[4][256];  // this block's counts, one histogram per pass
  __shared__ int s_g[256];     // the row's counts of the current pass
  __shared__ int s_pick[3];    // digit, keys in higher bins, keys in the digit's bin
  __shared__ int s_cnt[4];     // holes, kept tails (ties aside), ties, ties below C'
  __shared__ int s_run[4];     // first and last chunk holding a round's holes, and kept tails
  // a batch of pieces: offset in kbuf (entry npc: the batch's size), first
  // slot, mode, the task's first tie rank (-1: a task's later piece) and
  // first selected rank
  __shared__ int s_pc_off[kWidePieces + 1], s_pc_x[kWidePieces], s_pc_mode[kWidePieces],
      s_pc_tie[kWidePieces], s_pc_sel[kWidePieces];
  __shared__ int s_npc;
  __shared__ int s_wsum[4][32];
  // per chunk of the row: rank of its first hole, kept tail and tie; its
  // ties below C' (entry nblk: the row's totals)
  __shared__ int s_hpre[kWideMaxBlocks + 1], s_tpre[kWideMaxBlocks + 1], s_tq[kWideMaxBlocks + 1],
      s_tlo[kWideMaxBlocks];

  const int tid = threadIdx.x, lane = tid & 31, nt = kSelThreads;
  const int nblk = p.nblk;
  const uint32_t r = blockIdx.x / (uint32_t)nblk;
  const int b = (int)(blockIdx.x - r * (uint32_t)nblk);
  uint32_t rc[kMaxDims];
  row_coords(p.lead, r, rc);
  const char *srow = p.scores.data + row_offset(p.lead, rc, p.scores.lead);
  char *irow = p.has_idx ? p.idx.data + row_offset(p.lead, rc, p.idx.lead) : nullptr;
  char *trow = p.has_tm ? p.tm.data + row_offset(p.lead, rc, p.tm.lead) : nullptr;
  const int64_t N = p.N, Cp = p.Cp, clo = p.P, chi = N - p.W;
  const int64_t S = (N + nblk - 1) / nblk;
  const int64_t c0 = min(N, (int64_t)b * S), c1 = min(N, c0 + S);
  const int dt = p.scores.dtype;
  const bool sal = p.scores.aligned != 0;
  const int64_t sns = p.scores.n_stride;
  int (*G)[256] = g_whist[p.wslot][r];
  unsigned *rbar = &g_wbar[p.wslot][r];
  const bool leader = b == 0;

  IMOE_PHASE(0);
  static_assert(kSelThreads == 4 * 256, "one thread per histogram word");
  s_h[tid >> 8][tid & 255] = 0;
  if (tid < 4) s_cnt[tid] = 0;
  unsigned long long *gbar = &g_gridbar[p.token % kSlots];
  __shared__ int s_phase;
  if (p.fused_nan && tid == 0) s_phase = (int)(ld_relaxed_u64(gbar) >> 63);
  __syncthreads();

  // ---- 1. radix passes; the first also checks the chunk for NaN
  const int64_t Kp = Cp - clo - p.W;  // candidates to keep
  int need = Kp > 0 ? (int)Kp : 0;
  uint32_t prefix = 0, thr = 0;  // kept candidate: key >= thr, or (rank) key > thr, ties by rank
  bool rank = false;
  int Q = 0, last = -1;
  bool done = Kp <= 0;  // no candidate is kept
#pragma unroll 1
  for (int pass = 0; pass < 4; ++pass) {
    const bool nan_pass = pass == 0 && p.fused_nan;
    if (done && !nan_pass) break;  // uniform over the row
    const int shift = 24 - 8 * pass;
    const bool nan_here = wide_count_chunk(srow, c0, c1, clo, chi, dt, sal, sns, tid, nt, pass, shift, prefix,
                                           nan_pass, done, s_h[pass]);
    if (nan_pass) {
      const bool row_nan = __syncthreads_or(nan_here) != 0;
      if (tid == 0) nan_arrive(gbar, s_phase, row_nan);
    } else {
      __syncthreads();
    }
    if (pass == 0) IMOE_PHASE(1);
    if (done) break;
    if (tid < 256) wide_publish_counts(G, s_h, pass, tid);
    last = pass;
    row_sync(rbar, (unsigned)nblk, leader);
    if (tid < 256) s_g[tid] = __ldcg(&G[pass & 1][tid]);
    __syncthreads();
    if (tid < 32) find_bin256(s_g, need, s_pick);  // the bin that holds the need-th key from the top
    __syncthreads();
    IMOE_PHASE(2 + pass);
    prefix |= (uint32_t)s_pick[0] << shift;
    need -= s_pick[1];
    if (s_pick[2] == need) {  // the whole bin is kept: every key >= its least
      thr = prefix;
      done = true;
    } else if (pass == 3) {  // exact threshold; `need` of its ties, lowest index first
      thr = prefix;
      rank = true;
      Q = need;
      done = true;
    }
  }
  const bool none = Kp <= 0;
  // the class of slot x from its raw score
  auto cls = [&](int64_t x, uint32_t raw) -> int {
    if (x < clo || x >= chi) return kKept;
    if (none) return kDropped;
    const uint32_t key = key_of_raw(raw, dt);
    if (!rank) return key >= thr ? kKept : kDropped;
    return key > thr ? kKept : (key == thr ? kTie : kDropped);
  };

  // ---- 2. this chunk's counts, then the row's ranks
  wide_chunk_counts(p, srow, c0, c1, Cp, dt, sal, sns, tid, lane, nt, cls, s_cnt);
  row_sync(rbar, (unsigned)nblk, leader);
  IMOE_PHASE(6);
  if (last >= 0 && tid < 256) {  // no block reads the row's histograms any more
    const int v = s_h[last][tid];
    if (v) atomicSub(&G[last & 1][tid], v);
    if (last >= 1) {
      const int u = s_h[last - 1][tid];
      if (u) atomicSub(&G[(last - 1) & 1][tid], u);
    }
  }
  wide_row_ranks(p, r, nblk, rank, Q, tid, s_wsum, s_hpre, s_tpre, s_tq, s_tlo);

  // ---- from here on the call writes: the NaN verdict, or the check kernel's
  bool bad = false;
  if (p.fused_nan) {
    if (tid == 0) bad = nan_verdict(gbar, s_phase, p.token, ld_relaxed_u64(gbar));
  } else {
    bad = verdict_bad(module_words(), p.token, p.nverdict);
  }
  if (__syncthreads_or(bad)) return;  // also completes the ranks above
  IMOE_PHASE(7);

  // ---- 3. this chunk's fixed points, then this block's share of the pairs,
  // cap at a time. Every scan of slots goes through the one visit below.
  const int m = s_hpre[nblk];  // holes == kept tails
  const int qa = (int)((int64_t)m * b / nblk), qb = (int)((int64_t)m * (b + 1) / nblk);
  int32_t *H = reinterpret_cast<int32_t *>(dsm);
  int32_t *T = H + p.cap;
  uint32_t *kbuf = reinterpret_cast<uint32_t *>(T + p.cap);  // kWideSub raw scores
  const bool fixed = irow || trow;
  int it = 0;  // block scans so far (alternating scratch; uniform)
#pragma unroll 1
  for (int ra = qa, first = 1; first || ra < qb; first = 0, ra += p.cap) {
    const int rb = min(qb, ra + p.cap);
    // the chunks holding holes, and kept tails, of rank [ra, rb): two runs
    // of consecutive chunks, found by one thread per chunk
    if (tid < 4) s_run[tid] = tid & 1 ? -1 : nblk;
    __syncthreads();
    if (tid < nblk && ra < rb) {
      if (s_hpre[tid] < rb && s_hpre[tid + 1] > ra) {
        atomicMin(&s_run[0], tid);
        atomicMax(&s_run[1], tid);
      }
      if (s_tpre[tid] < rb && s_tpre[tid + 1] > ra) {
        atomicMin(&s_run[2], tid);
        atomicMax(&s_run[3], tid);
      }
    }
    __syncthreads();
    const int h0 = s_run[0], nh = max(0, s_run[1] - h0 + 1), t0 = s_run[2], ntl = max(0, s_run[3] - t0 + 1);
    // tasks: -1 this chunk's fixed points (first round), then the hole
    // chunks, then the tail chunks; task t is slots [a, e) whose first tie
    // and first selected slot have row ranks tie0 and sel0
    const int te = nh + ntl;
    auto task = [&](int t, int64_t &a, int64_t &e, int &mode, int &tie0, int &sel0) {
      if (t < 0) {
        a = c0;
        e = c1;
        mode = 2;
        tie0 = s_tq[b];
        sel0 = 0;
        return;
      }
      mode = t < nh ? 0 : 1;
      const int k = mode ? t0 + (t - nh) : h0 + t;
      a = min(N, (int64_t)k * S);
      e = min(N, a + S);
      if (mode == 0)
        e = min(e, Cp);
      else
        a = max(a, Cp);
      tie0 = s_tq[k] + (mode ? s_tlo[k] : 0);
      sel0 = mode ? s_tpre[k] : s_hpre[k];
    };
    // Batches of at most kWidePieces pieces and kWideSub slots. Thread 0
    // alone cuts the tasks into the batch's pieces (their scalar work would
    // otherwise run on all 32 warps); every thread then loads its slots of
    // the batch, kWideIpt independent loads, into shared memory, and the
    // pieces are visited in order, a block scan each. A task longer than
    // what is left of a batch goes on in the next.
    int cur_t = first && fixed ? -1 : 0;  // thread 0's cursor: task and slot
    int64_t cur_x = -1;                    //   (-1: the task's start)
    int run_tie = 0, run_sel = 0;
#pragma unroll 1
    for (;;) {
      if (tid == 0) {
        int npc = 0, off = 0;
        while (cur_t < te && off < kWideSub && npc < kWidePieces) {
          int64_t a, e;
          int mode, tie0, sel0;
          task(cur_t, a, e, mode, tie0, sel0);
          const bool head = cur_x < 0;
          if (head) cur_x = a;
          const int len = (int)max((int64_t)0, min(e - cur_x, (int64_t)(kWideSub - off)));
          if (len > 0) {
            s_pc_off[npc] = off;
            s_pc_x[npc] = (int)cur_x;
            s_pc_mode[npc] = mode;
            s_pc_tie[npc] = head ? tie0 : -1;
            s_pc_sel[npc] = sel0;
            ++npc;
          }
          off += len;
          cur_x += len;
          if (cur_x < e) break;
          ++cur_t;
          cur_x = -1;
        }
        s_pc_off[npc] = off;
        s_npc = npc;
      }
      __syncthreads();
      if (s_npc == 0) break;  // uniform: every task is done
      const int npc = s_npc, total = s_pc_off[npc];
      {  // element j of the batch: piece p's slot x + (j - off); j rises with i
        uint32_t rv[kWideIpt];
        int pc = 0;
#pragma unroll
        for (int i = 0; i < kWideIpt; ++i) {
          const int j = tid + i * nt;
          rv[i] = 0u;
          if (j < total) {
            while (s_pc_off[pc + 1] <= j) ++pc;
            rv[i] = ldg_raw(srow + ((int64_t)s_pc_x[pc] + (j - s_pc_off[pc])) * sns, dt, sal);
          }
        }
#pragma unroll
        for (int i = 0; i < kWideIpt; ++i)
          if (tid + i * nt < total) kbuf[tid + i * nt] = rv[i];
      }
      __syncthreads();
#pragma unroll 1
      for (int pc = 0; pc < npc; ++pc) {
        const int off = s_pc_off[pc], len = s_pc_off[pc + 1] - off, mode = s_pc_mode[pc];
        if (s_pc_tie[pc] >= 0) {  // a task's first piece
          run_tie = s_pc_tie[pc];
          run_sel = s_pc_sel[pc];
        }
        // slots x0 + [0, len), g consecutive ones per thread
        const int g = (len + nt - 1) / nt;
        const int j0 = tid * g;
        const int gi = max(0, min(g, len - j0));
        const int64_t xs = (int64_t)s_pc_x[pc] + j0;
        uint32_t keptm = 0u, tiem = 0u;
#pragma unroll 1
        for (int i = 0; i < gi; ++i) {
          const int c = cls(xs + i, kbuf[off + j0 + i]);
          keptm |= (c == kKept ? 1u : 0u) << i;
          tiem |= (c == kTie ? 1u : 0u) << i;
        }
        const uint32_t inm = gi > 0 ? (gi >= 32 ? 0xFFFFFFFFu : (1u << gi) - 1u) : 0u;
        if (rank) {  // uniform: the row's first Q ties are kept
          int tot;
          const int ex = block_excl_scan_1sync(__popc(tiem), &tot, s_wsum[(it & 1) * 2]);
          const int nk =
              min(max(Q - (run_tie + ex), 0), __popc(tiem));  // this thread's kept ties: its first nk
          uint32_t tm_ = tiem;
#pragma unroll 1
          for (int j = 0; j < nk; ++j) {
            keptm |= tm_ & (0u - tm_);
            tm_ &= tm_ - 1u;
          }
          run_tie += tot;
        }
        if (mode == 2) {
#pragma unroll 1
          for (uint32_t w = inm; w; w &= w - 1u) {
            const int i = __ffs(w) - 1;
            const int64_t x = xs + i;
            const bool k = (keptm >> i) & 1u;
            if (x < Cp && k) {
              if (irow) store_index(irow + x * p.idx.n_stride, p.idx.dtype, p.idx.aligned != 0, x);
              if (trow) store_index(trow + x * p.tm.n_stride, p.tm.dtype, p.tm.aligned != 0, x);
            } else if (x >= Cp && !k) {
              if (trow) store_index(trow + x * p.tm.n_stride, p.tm.dtype, p.tm.aligned != 0, x);
            }
          }
        } else {
          int32_t *out = mode ? T : H;
          const uint32_t selm = mode == 0 ? inm & ~keptm : keptm;
          int tot;
          int q = run_sel + block_excl_scan_1sync(__popc(selm), &tot, s_wsum[(it & 1) * 2 + 1]);
#pragma unroll 1
          for (uint32_t w = selm; w; w &= w - 1u, ++q)
            if (q >= ra && q < rb) out[q - ra] = (int32_t)(xs + __ffs(w) - 1);
          run_sel += tot;
        }
        ++it;
      }
      __syncthreads();  // thread 0 refills the pieces, every thread kbuf
    }
    if (first) IMOE_PHASE(8);
    const int np = rb - ra;
    if (np <= 0) break;
    if (fixed) {
      for (int q = tid; q < np; q += nt) {
        const int hx = H[q], tx = T[q];
        if (irow) store_index(irow + (int64_t)hx * p.idx.n_stride, p.idx.dtype, p.idx.aligned != 0, tx);
        if (trow) {
          store_index(trow + (int64_t)hx * p.tm.n_stride, p.tm.dtype, p.tm.aligned != 0, tx);
          store_index(trow + (int64_t)tx * p.tm.n_stride, p.tm.dtype, p.tm.aligned != 0, hx);
        }
      }
    }
    if (first) IMOE_PHASE(9);
    if (p.do_move) {
      RingPairs get;
      get.D = H;
      get.s_off = p.cap;
      get.a0 = 0;
      get.b0 = 0;
      get.cap = 0x7FFFFFFF;
      uint32_t c[kMaxDims];
      row_coords(p.lead, r, c);
      for (int k = 0; k < p.nbuf; ++k) {
        const BufDesc &bd = p.buf[k];
        move_pairs<>(bd.data + row_offset(p.lead, c, bd.lead), &bd, (uint32_t)np, p.swap, get);
      }
    }
    __syncthreads();
  }
  IMOE_PHASE_END(10);
}

}  // namespace imoe_cu
