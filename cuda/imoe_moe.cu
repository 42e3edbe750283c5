// imoe_moe.cu: the MoE dispatch, combine and gated activation on the device
// (imoe_moe_dispatch, imoe_moe_combine, imoe_gated_act; contract in
// idempotent_moe.h, CPU core in csrc/moe_dispatch.c and csrc/moe_combine.c,
// design in docs/cuda-design.md, "MoE dispatch and combine").
//   k_moe_sort      one block: checks every id, counts per expert, chooses
//                   each overloaded expert's kept assignments (capacity),
//                   and writes offsets, dest, src and the dropped count with
//                   a stable counting sort (tiles of 1024 assignments, warp
//                   match for the rank within a tile);
//   k_moe_sort_count  the multi-block sort (from IMOE_MOE_MULTI_SORT_MIN
//                   assignments, with a workspace: dropless and grouped, or
//                   with a capacity), B blocks, each over its own range of
//                   assignments: checks its ids and counts them per expert
//                   into the workspace (one verdict word per block; no
//                   output written);
//   k_moe_sort_scan   dropless, one block: each expert's start (a scan of the
//                   counts over the blocks and experts), offsets, the empty
//                   rows' src, the dropped count (0), and each block's first
//                   place per expert written back over its counts;
//   k_moe_sort_place  dropless, B blocks: each places its own range from its
//                   first places with the one-block sort's stable pass (dest,
//                   src);
//   k_moe_cap_scan, k_moe_cap_order  with a capacity: the dropless order of
//                   the assignments into the workspace (one block scans, B
//                   blocks place);
//   k_moe_cap_select  one block per expert: the key its kept assignments
//                   reach (the one-block sort's radix select);
//   k_moe_cap_count, k_moe_cap_rows, k_moe_cap_place  the kept assignments
//                   counted per block, scanned into offsets, the empty rows'
//                   src and the dropped count (one block), and placed (dest,
//                   src) as the dropless kernels place all;
//   k_moe_gather    one block per row: the row's token copied, or zeros;
//   k_moe_combine   one block per (token, chunk of 1,024 features): the
//                   weighted sum of its rows, in j order, in F32, each product
//                   rounded first (no FMA);
//   k_moe_dest_check  a block per 8,192 entries (at most 128, a verdict word
//                   each): the combine's dest checked, when there are too
//                   many entries for every combine block to check them;
//   k_gated_act     act(gate) x up, vectorised by 16 bytes where aligned.
// Data errors (ids or dest out of range) are recorded in the status word and
// nothing is written, as everywhere in the library.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <string.h>

#include <initializer_list>

#include "imoe_device.cuh"
#include "imoe_act.cuh"
#include "imoe_launch.cuh"

namespace imoe_cu {

constexpr int kSortThreads = 1024;   // k_moe_sort: one block; the multi-block sort's blocks
constexpr int64_t kMultiSortMin = IMOE_MOE_MULTI_SORT_MIN;  // fewest assignments sorted in blocks
constexpr int64_t kMultiSortItems = 4096;  // fewest assignments a block of the multi-block sort owns
constexpr int kRowThreads = 128;     // k_moe_gather, k_moe_combine, k_gated_act
// Most blocks of the multi-block sort: one verdict word each, and every
// block of the gather after it reads them all, one per thread.
constexpr int kMultiSortBlocks = kRowThreads < kVerdicts ? kRowThreads : kVerdicts;
constexpr int kRankDirect = 64;      // k_moe_sort: most assignments an expert ranks pairwise
constexpr int kInlineDestCheck = 2048;  // combine: at most this many dest entries are
                                        // checked by every block (no check kernel)
constexpr int kCombineChunk = kRowThreads * 8;  // combine: features one block sums
constexpr int kCombineStage = 64;   // combine: most k whose dest and weights go to shared memory
constexpr int kCombineBatch = 4;    // combine: rows loaded before any is added

// A 2-d typed array: element (r, c) at data + r * row + c * col (bytes).
struct Mat {
  char *data;
  int64_t row, col;
  int32_t dtype, aligned;
};

__device__ __forceinline__ int64_t mat_index(const Mat &m, int64_t r, int64_t c) {
  return load_index(m.data + r * m.row + c * m.col, m.dtype, m.aligned != 0);
}
__device__ __forceinline__ void mat_store_index(const Mat &m, int64_t r, int64_t c, int64_t v) {
  store_index(m.data + r * m.row + c * m.col, m.dtype, m.aligned != 0, v);
}

__device__ __forceinline__ float load_float(const char *p, int dt) {
  if (dt == IMOE_DTYPE_F32) return *reinterpret_cast<const float *>(p);
  if (dt == IMOE_DTYPE_F16) return __half2float(*reinterpret_cast<const __half *>(p));
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16 *>(p));
}
__device__ __forceinline__ void store_float(char *p, int dt, float v) {
  if (dt == IMOE_DTYPE_F32) *reinterpret_cast<float *>(p) = v;
  else if (dt == IMOE_DTYPE_F16) *reinterpret_cast<__half *>(p) = __float2half_rn(v);
  else *reinterpret_cast<__nv_bfloat16 *>(p) = __float2bfloat16_rn(v);
}

// ------------------------------------------------------------ the sort
struct SortParams {
  Mat ids, weights, dest;
  OutView offs, src;  // [E], [R]: n_stride, dtype, aligned
  char *dropped;      // [1] int64 or null
  int64_t T, R, C;    // C < 0: dropless
  int32_t k, E, padded, foreign;
  int32_t *ws;  // one block, capacity: [S] assignments by expert (dropless order), [S] kept flags;
                // multi-block: see counts (and CapWs with a capacity)
  int32_t *counts;  // multi-block: [blocks x E] counts, then first places, per (block, expert):
                    // ws (dropless), ws + S (capacity: CapWs)
  int64_t tile;    // multi-block: assignments per block (a multiple of kSortThreads)
  int32_t blocks;  // multi-block: blocks of the count and place kernels (<= kMultiSortBlocks)
  uint32_t token;
  StatusWords words;
};

// Whether assignment a beats assignment b for a place: higher weight, NaN
// lowest, ties to the lower assignment.
__device__ __forceinline__ bool better(float wa, int64_t a, float wb, int64_t b) {
  const bool na = isnan(wa), nb = isnan(wb);
  if (na != nb) return nb;
  if (!na && wa != wb) return wa > wb;
  return a < b;
}

// The key an assignment competes for a place with: higher is better. The
// weight's order-preserving bits (NaN lowest, -0.0 = +0.0) above the
// complement of the assignment (ties to the lower one): every key distinct.
__device__ __forceinline__ uint64_t place_key(const SortParams &p, int64_t i) {
  const float w = load_float(p.weights.data + (i / p.k) * p.weights.row + (i % p.k) * p.weights.col,
                             p.weights.dtype);
  uint32_t key = 0;
  if (!isnan(w)) {
    const uint32_t b = w == 0.0f ? 0u : __float_as_uint(w);
    key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  }
  return ((uint64_t)key << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)i);
}

// The c-th largest place key among the n assignments list[0..n) (c < n),
// by radix select from the top byte; it stops as soon as the chosen bin is
// exactly the places left. Every thread of the block calls it.
__device__ uint64_t select_threshold(const SortParams &p, const int32_t *list, int n, int c, int *s_warp) {
  __shared__ int hist[256];
  __shared__ unsigned long long s_prefix;
  __shared__ int s_left, s_done;
  __syncthreads();  // every thread has read the previous call's answer
  if (threadIdx.x == 0) {
    s_prefix = 0;
    s_left = c;
    s_done = 0;
  }
  for (int d = 7; d >= 0; --d) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    if (s_done) break;
    const uint64_t high = d == 7 ? 0ull : ~0ull << (8 * (d + 1));
    const uint64_t prefix = s_prefix;
    for (int q = threadIdx.x; q < n; q += blockDim.x) {
      const uint64_t key = place_key(p, list[q]);
      if ((key & high) == prefix) atomicAdd(&hist[(key >> (8 * d)) & 255u], 1);
    }
    __syncthreads();
    // Bins from the top: the bin where the places left run out.
    const int b = 255 - (int)threadIdx.x;
    const int v = threadIdx.x < 256 ? hist[b] : 0;
    int total;
    const int above = perm_block_scan(v, &total, s_warp);
    const int left = s_left;
    __syncthreads();
    if (threadIdx.x < 256 && above < left && left <= above + v) {
      s_prefix = prefix | ((uint64_t)b << (8 * d));
      s_left = left - above;
      s_done = left - above == v;  // the whole bin is kept: no lower byte matters
    }
    __syncthreads();
  }
  return s_prefix;
}

// Assignment i's local expert, or -1 for a foreign id (every id checked
// before this is read).
__device__ __forceinline__ int local_expert(const SortParams &p, int64_t i) {
  const int64_t e = mat_index(p.ids, i / p.k, i % p.k);
  return e < p.E ? (int)e : -1;
}

// Counts assignments [lo, hi) per local expert into cnt (shared, zeroed);
// whether this thread met a bad id (< 0, or >= E without `foreign`).
__device__ __forceinline__ bool count_ids(const SortParams &p, int64_t lo, int64_t hi, int *cnt) {
  bool bad = false;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const int64_t e = mat_index(p.ids, i / p.k, i % p.k);
    if (e < 0 || (e >= p.E && !p.foreign)) bad = true;
    else if (e < p.E) atomicAdd(&cnt[e], 1);
  }
  return bad;
}

// What the sort's last stable pass writes for assignment i at `row` (e < 0:
// dropped or foreign, row -1): its dest, and the row's token.
__device__ __forceinline__ void store_place(const SortParams &p, int64_t i, int e, int row) {
  mat_store_index(p.dest, i / p.k, i % p.k, row);
  if (e >= 0) store_index(p.src.data + (int64_t)row * p.src.n_stride, p.src.dtype, p.src.aligned != 0, i / p.k);
}

__global__ void __launch_bounds__(kSortThreads) k_moe_sort(const __grid_constant__ SortParams p) {
  griddep_launch_dependents();  // the gather may start; it waits for this grid
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ int s_warp[33];
  __shared__ unsigned long long s_dropped;
  const int E = p.E, k = p.k;
  const int64_t S = p.T * k;
  int *cnt = reinterpret_cast<int *>(dsm);  // [E] assignments per expert
  int *start = cnt + E;                     // [E] first place (sort) or row (dispatch)
  int *base = start + E;                    // [E] running place
  int *wc = base + E;                       // [E x 33]
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  if (threadIdx.x == 0) s_dropped = 0;
  __syncthreads();
  const bool bad = __syncthreads_or(count_ids(p, 0, S, cnt)) != 0;
  if (threadIdx.x == 0) {
    if (bad) record_status(p.words, IMOE_ERR_INDEX_RANGE);
    write_verdict(p.words, p.token, bad);
  }
  if (bad) return;
  auto expert = [&](int64_t i) { return local_expert(p, i); };
  const bool capacity = p.C >= 0;
  int32_t *order = p.ws, *keep = p.ws + S;
  if (capacity) {  // each overloaded expert keeps its C best
    int carry = 0;
    for (int e0 = 0; e0 < E; e0 += blockDim.x) {
      const int e = e0 + threadIdx.x;
      int total;
      const int excl = perm_block_scan(e < E ? cnt[e] : 0, &total, s_warp);
      if (e < E) start[e] = base[e] = carry + excl;
      carry += total;
    }
    __syncthreads();
    stable_places(S, E, base, wc, expert, [&](int64_t i, int e, int place) {
      if (e >= 0) order[place] = (int32_t)i;
    });
    // An expert with few assignments ranks each one against the others; one
    // with many finds the C-th best key by radix select, 8 bits per pass.
    for (int64_t i = threadIdx.x; i < S; i += blockDim.x) {
      const int e = expert(i);
      int kept = e >= 0;
      if (e >= 0 && cnt[e] > p.C && p.C == 0) {
        kept = 0;
      } else if (e >= 0 && cnt[e] > p.C && cnt[e] <= kRankDirect) {
        const uint64_t mine = place_key(p, i);
        int64_t ahead = 0;
        for (int q = start[e], end = start[e] + cnt[e]; q < end; ++q) ahead += place_key(p, order[q]) > mine;
        kept = ahead < p.C;
      }
      keep[i] = kept;
    }
    __syncthreads();
    for (int e = 0; e < E; ++e) {
      if (cnt[e] <= p.C || cnt[e] <= kRankDirect || p.C == 0) continue;  // uniform across the block
      const uint64_t threshold = select_threshold(p, order + start[e], cnt[e], (int)p.C, s_warp);
      for (int q = threadIdx.x; q < cnt[e]; q += blockDim.x) {
        const int64_t i = order[start[e] + q];
        keep[i] = place_key(p, i) >= threshold;
      }
    }
    __syncthreads();
  }
  // Rows: each expert's kept assignments, in assignment order.
  int carry = 0;
  for (int e0 = 0; e0 < E; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    const int c = e < E ? cnt[e] : 0;
    const int kept = capacity && c > p.C ? (int)p.C : c;
    int total;
    const int excl = perm_block_scan(kept, &total, s_warp);
    if (e < E) {
      const int64_t first = p.padded ? (int64_t)e * p.C : (int64_t)(carry + excl);
      start[e] = base[e] = (int)first;
      const int64_t end = p.padded ? first + p.C : first + kept;
      store_index(p.offs.data + (int64_t)e * p.offs.n_stride, p.offs.dtype, p.offs.aligned != 0, end);
      if (c > kept) atomicAdd(&s_dropped, (unsigned long long)(c - kept));
    }
    carry += total;
  }
  for (int64_t r = threadIdx.x; r < p.R; r += blockDim.x)
    store_index(p.src.data + r * p.src.n_stride, p.src.dtype, p.src.aligned != 0, -1);
  __syncthreads();
  auto kept_expert = [&](int64_t i) -> int {
    const int e = expert(i);
    return e >= 0 && (!capacity || keep[i]) ? e : -1;
  };
  stable_places(S, E, base, wc, kept_expert, [&](int64_t i, int e, int row) { store_place(p, i, e, row); });
  if (threadIdx.x == 0 && p.dropped) *reinterpret_cast<long long *>(p.dropped) = (long long)s_dropped;
}

// ------------------------------------------------------------ the multi-block sort
// From kMultiSortMin assignments with a workspace: dropless and grouped, or
// with a capacity (either layout). Block b of the count and place kernels
// owns assignments [b x tile, (b + 1) x tile) (clipped to S); its first
// place for expert e is first(e) plus the counts of e in the blocks before
// it, so a stable pass over each block's range from those places gives the
// places of the one-block sort. The kernels after the count follow with
// programmatic dependent launch (sm_90): each waits for the kernel before
// (and its memory) before reading anything, and reads every count block's
// verdict before writing anything.
//
// Dropless, every assignment is kept, so the rows are the stable counting
// sort alone: k_moe_sort_count, k_moe_sort_scan, k_moe_sort_place.
//
// With a capacity C, the kept assignments are chosen first, as k_moe_sort
// chooses them, in the workspace (CapWs), then sorted as dropless:
//   k_moe_sort_count  (as dropless) each block's counts per expert;
//   k_moe_cap_scan    one block: each expert's count and start in the
//                     dropless order, each block's first places in it;
//   k_moe_cap_order   B blocks: the dropless order, order[place] = i;
//   k_moe_cap_select  one block per expert: its threshold, the C-th largest
//                     of its keys by k_moe_sort's radix select over its part
//                     of the order; 0 (every key) when it has at most C,
//                     kKeepNone when C = 0;
//   k_moe_cap_count   B blocks: each block's kept counts per expert;
//   k_moe_cap_rows    one block: offsets, dropped, src -1 for every row no
//                     kept assignment fills, each block's first rows;
//   k_moe_cap_place   B blocks: the kept assignments placed (dest, src),
//                     the others dest -1.
// The keys are distinct (place_key: the assignment in the low word), so an
// overloaded expert's C best are exactly its keys >= its C-th largest: the
// set k_moe_sort keeps, by pairwise ranking (at most kRankDirect) or by the
// same radix select.

constexpr uint64_t kKeepNone = ~0ull;  // threshold with C = 0 (no key reaches it either:
                                       // a key's high word is at most +inf's, 0xFF800000)

// The assignments block b owns.
__device__ __forceinline__ void block_range(const SortParams &p, int64_t *lo, int64_t *hi) {
  const int64_t S = p.T * p.k, first = (int64_t)blockIdx.x * p.tile;
  *lo = first < S ? first : S;
  *hi = first + p.tile < S ? first + p.tile : S;
}

// The capacity's workspace (2 x S int32, imoe_moe_workspace_elems):
// order [S], then counts [B x E] (p.counts), cnt [E], start [E] and
// threshold [E x 2] (high word, low word: no 8-byte alignment needed);
// S + B x E + 4 x E <= S + (S / 4 + 1024) + 4096 <= 2 x S for S >=
// kMultiSortMin (the host checks cap_ws_elems against the workspace).
struct CapWs {
  int32_t *order, *cnt, *start, *thr;
};
__host__ __device__ __forceinline__ int64_t cap_ws_elems(int64_t S, int64_t blocks, int64_t E) {
  return S + blocks * E + 4 * E;
}
__device__ __forceinline__ CapWs cap_ws(const SortParams &p) {
  CapWs w;
  w.order = p.ws;
  w.cnt = p.counts + (int64_t)p.blocks * p.E;
  w.start = w.cnt + p.E;
  w.thr = w.start + p.E;
  return w;
}
__device__ __forceinline__ uint64_t load_threshold(const CapWs &w, int e) {
  return ((uint64_t)(uint32_t)w.thr[2 * e] << 32) | (uint32_t)w.thr[2 * e + 1];
}
// Whether assignment i, of an expert of threshold thr, is kept.
__device__ __forceinline__ bool kept_by(const SortParams &p, int64_t i, uint64_t thr) {
  return thr == 0 || (thr != kKeepNone && place_key(p, i) >= thr);
}

// One block, one thread per expert (chunks of blockDim.x experts, with a
// carry): total, the sum of counts[b x E + e] over the blocks, and start,
// the exclusive scan of the totals in expert order; the counts rewritten as
// each block's first place per expert from first(e, start) on; then
// done(e, start, total). Returns the sum of the totals (uniform).
template <class First, class Done>
__device__ __forceinline__ int scan_counts(const SortParams &p, int *s_warp, First first, Done done) {
  const int E = p.E;
  int carry = 0;  // uniform: the totals of the chunks before
  for (int e0 = 0; e0 < E; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    int total = 0;
    if (e < E)
      for (int b = 0; b < p.blocks; ++b) total += p.counts[(int64_t)b * E + e];
    int chunk;
    const int excl = perm_block_scan(total, &chunk, s_warp);
    if (e < E) {
      const int start = carry + excl;
      int place = first(e, start);
      for (int b = 0; b < p.blocks; ++b) {
        int32_t *w = p.counts + (int64_t)b * E + e;
        const int c = *w;
        *w = place;
        place += c;
      }
      done(e, start, total);
    }
    carry += chunk;
  }
  return carry;
}

// The dynamic shared memory of the placing kernels: base [E] (the running
// place), wc [E x 33] (stable_places' per-warp counts), then what the
// kernel adds (8-byte aligned: 136 x E bytes in).
constexpr int kPlaceSmemInts = 34;  // per expert

// Every multi-block kernel after the count begins here: it lets the next
// kernel launch (that one waits for this grid), waits for the kernel before
// and its memory, and says whether the count found a bad id, in which case
// it writes nothing. Every thread calls it (one barrier).
__device__ __forceinline__ bool stage_aborted(const SortParams &p) {
  griddep_launch_dependents();
  griddep_wait();
  return call_aborted(p.words, p.token, p.blocks);
}

// Block b's stable pass (k_moe_sort's) over its range from its first places
// (counts[b x E + e]): emit(i, e, place) for every assignment i of the
// range, e = key(i) (-1: no place, place -1). smem: the kernel's dynamic
// shared memory (base and wc; kPlaceSmemInts x E ints).
template <class Key, class Emit>
__device__ __forceinline__ void place_range(const SortParams &p, unsigned char *smem, Key key, Emit emit) {
  int *base = reinterpret_cast<int *>(smem);  // [E] running place
  int *wc = base + p.E;                       // [E x 33]
  int64_t lo, hi;
  block_range(p, &lo, &hi);
  const int32_t *first = p.counts + (int64_t)blockIdx.x * p.E;
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) base[e] = first[e];
  __syncthreads();
  // stable_places counts from 0: item q is assignment lo + q.
  stable_places(hi - lo, p.E, base, wc, [&](int64_t q) -> int { return key(lo + q); },
                [&](int64_t q, int e, int place) { emit(lo + q, e, place); });
}

// Checks the block's ids (as k_moe_sort does) and writes its count per
// expert to counts[b x E + e]; its verdict word says whether it found a bad
// id. Nothing but the workspace is written, so a bad id leaves every output
// as it was.
__global__ void __launch_bounds__(kSortThreads) k_moe_sort_count(const __grid_constant__ SortParams p) {
  griddep_launch_dependents();  // the scan may start; it waits for this grid
  __shared__ int cnt[IMOE_MOE_MAX_EXPERTS];
  const int E = p.E;
  int64_t lo, hi;
  block_range(p, &lo, &hi);
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  const bool bad = count_ids(p, lo, hi, cnt);
  __syncthreads();
  int32_t *mine = p.counts + (int64_t)blockIdx.x * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) mine[e] = cnt[e];
  block_verdict(p.words, p.token, bad, IMOE_ERR_INDEX_RANGE);
}

// Dropless. One block: each expert's start, offsets[e] = start[e] + its
// total, and each block's first places. Rows past the last assignment (only
// with foreign ids) hold none: src -1. Dropless drops nothing. Rows below
// are all written by k_moe_sort_place.
__global__ void __launch_bounds__(kSortThreads) k_moe_sort_scan(const __grid_constant__ SortParams p) {
  __shared__ int s_warp[33];
  if (stage_aborted(p)) return;
  const int64_t rows = scan_counts(
      p, s_warp, [](int, int start) { return start; },
      [&](int e, int start, int total) {
        store_index(p.offs.data + (int64_t)e * p.offs.n_stride, p.offs.dtype, p.offs.aligned != 0,
                    (int64_t)start + total);
      });
  for (int64_t r = rows + threadIdx.x; r < p.R; r += blockDim.x)
    store_index(p.src.data + r * p.src.n_stride, p.src.dtype, p.src.aligned != 0, -1);
  if (threadIdx.x == 0 && p.dropped) *reinterpret_cast<long long *>(p.dropped) = 0;
}

// Dropless. Block b places its assignments from its first places with the
// stable pass k_moe_sort ends with, and writes what that pass writes: dest
// for every assignment (-1 for a foreign id), src for every row.
// Dynamic shared memory: base [E], wc [E x 33].
__global__ void __launch_bounds__(kSortThreads) k_moe_sort_place(const __grid_constant__ SortParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  if (stage_aborted(p)) return;
  place_range(p, dsm, [&](int64_t i) { return local_expert(p, i); },
              [&](int64_t i, int e, int row) { store_place(p, i, e, row); });
}

// Capacity. One block: each expert's count cnt[e] and start[e] in the
// dropless order, and each block's first places in it. No output written.
__global__ void __launch_bounds__(kSortThreads) k_moe_cap_scan(const __grid_constant__ SortParams p) {
  __shared__ int s_warp[33];
  if (stage_aborted(p)) return;
  const CapWs w = cap_ws(p);
  scan_counts(
      p, s_warp, [](int, int start) { return start; },
      [&](int e, int start, int total) {
        w.cnt[e] = total;
        w.start[e] = start;
      });
}

// Capacity. Block b places its assignments in the dropless order (the
// first stable pass of k_moe_sort): order[place] = i. No output written.
// Dynamic shared memory: base [E], wc [E x 33].
__global__ void __launch_bounds__(kSortThreads) k_moe_cap_order(const __grid_constant__ SortParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  if (stage_aborted(p)) return;
  const CapWs w = cap_ws(p);
  place_range(p, dsm, [&](int64_t i) { return local_expert(p, i); }, [&](int64_t i, int e, int place) {
    if (e >= 0) w.order[place] = (int32_t)i;
  });
}

// Capacity. Block e: expert e's threshold, the key its kept assignments
// reach: 0 with at most C assignments (all kept), kKeepNone with C = 0
// (none), else its C-th largest key, by select_threshold over
// order[start[e], start[e] + cnt[e]). No output written.
__global__ void __launch_bounds__(kSortThreads) k_moe_cap_select(const __grid_constant__ SortParams p) {
  __shared__ int s_warp[33];
  if (stage_aborted(p)) return;
  const CapWs w = cap_ws(p);
  const int e = blockIdx.x, n = w.cnt[e];
  uint64_t thr = 0;
  if (n > p.C)  // uniform across the block
    thr = p.C == 0 ? kKeepNone : select_threshold(p, w.order + w.start[e], n, (int)p.C, s_warp);
  if (threadIdx.x == 0) {
    w.thr[2 * e] = (int32_t)(uint32_t)(thr >> 32);
    w.thr[2 * e + 1] = (int32_t)(uint32_t)thr;
  }
}

// Capacity. Block b counts its kept assignments per expert into
// counts[b x E + e] (its first places of the dropless order, read by
// k_moe_cap_order, are spent). No output written.
__global__ void __launch_bounds__(kSortThreads) k_moe_cap_count(const __grid_constant__ SortParams p) {
  __shared__ int cnt[IMOE_MOE_MAX_EXPERTS];
  __shared__ unsigned long long thr[IMOE_MOE_MAX_EXPERTS];
  if (stage_aborted(p)) return;
  const CapWs w = cap_ws(p);
  const int E = p.E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    cnt[e] = 0;
    thr[e] = load_threshold(w, e);
  }
  __syncthreads();
  int64_t lo, hi;
  block_range(p, &lo, &hi);
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const int e = local_expert(p, i);
    if (e >= 0 && kept_by(p, i, thr[e])) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  int32_t *mine = p.counts + (int64_t)blockIdx.x * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) mine[e] = cnt[e];
}

// Capacity. One block, as the rows of k_moe_sort: expert e's first row
// (grouped: the kept assignments of the experts before; padded: e x C),
// offsets[e] (its end; padded (e + 1) x C), each block's first rows, and
// dropped = the sum of cnt[e] - kept. src -1 for every row that holds no
// kept assignment (grouped: past the last kept one; padded: past each
// expert's kept ones); k_moe_cap_place writes the others.
__global__ void __launch_bounds__(kSortThreads) k_moe_cap_rows(const __grid_constant__ SortParams p) {
  __shared__ int s_warp[33];
  __shared__ int s_kept[IMOE_MOE_MAX_EXPERTS];
  __shared__ unsigned long long s_dropped;
  if (stage_aborted(p)) return;
  const CapWs w = cap_ws(p);
  if (threadIdx.x == 0) s_dropped = 0;
  __syncthreads();
  const int64_t kept = scan_counts(
      p, s_warp, [&](int e, int start) { return p.padded ? (int)((int64_t)e * p.C) : start; },
      [&](int e, int start, int total) {
        s_kept[e] = total;
        const int64_t end = p.padded ? ((int64_t)e + 1) * p.C : (int64_t)start + total;
        store_index(p.offs.data + (int64_t)e * p.offs.n_stride, p.offs.dtype, p.offs.aligned != 0, end);
        const int c = w.cnt[e];
        if (c > total) atomicAdd(&s_dropped, (unsigned long long)(c - total));
      });
  __syncthreads();
  if (!p.padded) {
    for (int64_t r = kept + threadIdx.x; r < p.R; r += blockDim.x)
      store_index(p.src.data + r * p.src.n_stride, p.src.dtype, p.src.aligned != 0, -1);
  } else {  // R = E x C (C > 0 where R > 0)
    for (int64_t r = threadIdx.x; r < p.R; r += blockDim.x)
      if (r % p.C >= s_kept[r / p.C])
        store_index(p.src.data + r * p.src.n_stride, p.src.dtype, p.src.aligned != 0, -1);
  }
  if (threadIdx.x == 0 && p.dropped) *reinterpret_cast<long long *>(p.dropped) = (long long)s_dropped;
}

// Capacity. Block b places its kept assignments from its first rows with
// the stable pass k_moe_sort ends with, and writes what that pass writes:
// dest for every assignment (-1 for a dropped or foreign one), src for
// every kept row. Dynamic shared memory: base [E], wc [E x 33], then the
// thresholds [E] (8-byte aligned: 136 x E bytes in).
__global__ void __launch_bounds__(kSortThreads) k_moe_cap_place(const __grid_constant__ SortParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  if (stage_aborted(p)) return;
  const CapWs w = cap_ws(p);
  uint64_t *thr = reinterpret_cast<uint64_t *>(reinterpret_cast<int *>(dsm) + (int64_t)p.E * kPlaceSmemInts);
  for (int e = threadIdx.x; e < p.E; e += blockDim.x) thr[e] = load_threshold(w, e);
  // (place_range's first barrier publishes thr)
  auto kept_expert = [&](int64_t i) -> int {
    const int e = local_expert(p, i);
    return e >= 0 && kept_by(p, i, thr[e]) ? e : -1;
  };
  place_range(p, dsm, kept_expert, [&](int64_t i, int e, int row) { store_place(p, i, e, row); });
}

// ------------------------------------------------------------ the gather
struct GatherParams {
  const char *hidden;
  int64_t hidden_row;
  char *rows;
  int64_t rows_row;
  InView src;  // [R]: n_stride, dtype, aligned
  int64_t R, row_bytes;
  uint32_t token;
  int32_t nverdict;  // verdict words of the sort's check: 1, or the multi-block sort's blocks
  StatusWords words;
};

template <int VW>
__global__ void __launch_bounds__(kRowThreads) k_moe_gather(const __grid_constant__ GatherParams p) {
  typedef typename VecOf<VW>::T V;
  griddep_wait();
  if (call_aborted(p.words, p.token, p.nverdict)) return;
  const int64_t nv = p.row_bytes / VW, step = blockDim.x;
  for (int64_t r = blockIdx.x; r < p.R; r += gridDim.x) {
    const int64_t s = load_index(p.src.data + r * p.src.n_stride, p.src.dtype, p.src.aligned != 0);
    V *to = reinterpret_cast<V *>(p.rows + r * p.rows_row);
    if (s < 0) {
      V zero;
      memset(&zero, 0, sizeof zero);
      for (int64_t x = threadIdx.x; x < nv; x += step) to[x] = zero;
    } else {
      // Two vectors in flight per thread: a row of 2,048 bf16 is two 16-byte
      // vectors for each of 128 threads, both loaded before either is stored.
      const V *from = reinterpret_cast<const V *>(p.hidden + s * p.hidden_row);
      for (int64_t x = threadIdx.x; x < nv; x += 2 * step) {
        const bool second = x + step < nv;
        const V a = from[x];
        V b;
        if (second) b = from[x + step];
        to[x] = a;
        if (second) to[x + step] = b;
      }
    }
  }
}

// ------------------------------------------------------------ the combine
struct CombineParams {
  const char *rows;
  int64_t rows_row;
  Mat dest, weights;
  char *out;
  int64_t out_row;
  int64_t T, R, H;
  int32_t k, ydt, odt, tdt;  // rows, out and term dtypes
  int32_t inline_check;      // every block checks all of dest (else k_moe_dest_check did)
  int32_t check_blocks;      // blocks of k_moe_dest_check: its verdict words
  uint32_t token;
  StatusWords words;
};

// Whether any of dest's entries [lo, hi) (flat, t k + j) lies outside [-1, R).
__device__ __forceinline__ bool dest_bad(const Mat &dest, int64_t lo, int64_t hi, int k, int64_t R) {
  bool bad = false;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const int64_t d = mat_index(dest, i / k, i % k);
    bad |= d < -1 || d >= R;
  }
  return __syncthreads_or(bad) != 0;
}

// check_blocks blocks, each over its share of dest: one verdict word each.
__global__ void __launch_bounds__(1024) k_moe_dest_check(const __grid_constant__ CombineParams p) {
  griddep_launch_dependents();
  const int64_t n = p.T * p.k, per = (n + gridDim.x - 1) / gridDim.x, lo = blockIdx.x * per;
  const bool bad = dest_bad(p.dest, lo < n ? lo : n, lo + per < n ? lo + per : n, p.k, p.R);
  if (threadIdx.x == 0) {
    if (bad) record_status(p.words, IMOE_ERR_INDEX_RANGE);
    write_verdict(p.words, p.token, bad);
  }
}

// Eight features of a row, as floats: two 16-byte loads of F32, one of 16-bit.
template <int YDT>
__device__ __forceinline__ void load8(const char *y, float v[8]) {
  if (YDT == IMOE_DTYPE_F32) {
    const float4 a = reinterpret_cast<const float4 *>(y)[0], b = reinterpret_cast<const float4 *>(y)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 q = *reinterpret_cast<const uint4 *>(y);
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint16_t lo = (uint16_t)(words[u] & 0xFFFFu), hi = (uint16_t)(words[u] >> 16);
      if (YDT == IMOE_DTYPE_F16) {
        v[2 * u] = __half2float(__ushort_as_half(lo));
        v[2 * u + 1] = __half2float(__ushort_as_half(hi));
      } else {
        v[2 * u] = __bfloat162float(__ushort_as_bfloat16(lo));
        v[2 * u + 1] = __bfloat162float(__ushort_as_bfloat16(hi));
      }
    }
  }
}

// One block per (token, chunk of kCombineChunk features). The token's dest
// and weights are staged in shared memory (k <= kCombineStage), and the VEC
// path loads kCombineBatch rows before adding any, so that a token's k row
// loads overlap instead of waiting one after another; the sum is the same, in
// j order. VEC: 8 consecutive features per thread, 16-byte loads of 16-bit rows.
template <int YDT, bool VEC>
__global__ void __launch_bounds__(kRowThreads) k_moe_combine(const __grid_constant__ CombineParams p) {
  __shared__ int64_t s_dest[kCombineStage];
  __shared__ float s_weight[kCombineStage];
  if (p.inline_check) {
    if (dest_bad(p.dest, 0, p.T * p.k, p.k, p.R)) {
      if (threadIdx.x == 0 && blockIdx.x == 0) record_status(p.words, IMOE_ERR_INDEX_RANGE);
      return;
    }
  } else {
    griddep_wait();
    if (call_aborted(p.words, p.token, p.check_blocks)) return;
  }
  constexpr int ysize = YDT == IMOE_DTYPE_F32 ? 4 : 2;
  const int osize = p.odt == IMOE_DTYPE_F32 ? 4 : 2;
  const bool staged = p.k <= kCombineStage;
  const int64_t chunks = (p.H + kCombineChunk - 1) / kCombineChunk;
  for (int64_t item = blockIdx.x; item < p.T * chunks; item += gridDim.x) {
    const int64_t t = item / chunks, c0 = item % chunks * kCombineChunk;
    const int64_t c1 = c0 + kCombineChunk < p.H ? c0 + kCombineChunk : p.H;
    if (staged) {
      __syncthreads();  // the previous item's readers are done
      for (int j = threadIdx.x; j < p.k; j += blockDim.x) {
        s_dest[j] = mat_index(p.dest, t, j);
        s_weight[j] = load_float(p.weights.data + t * p.weights.row + j * p.weights.col, p.weights.dtype);
      }
      __syncthreads();
    }
    auto dest_of = [&](int j) -> int64_t { return staged ? s_dest[j] : mat_index(p.dest, t, j); };
    auto weight_of = [&](int j) -> float {
      return staged ? s_weight[j]
                    : load_float(p.weights.data + t * p.weights.row + j * p.weights.col, p.weights.dtype);
    };
    char *out = p.out + t * p.out_row;
    if (VEC) {
      const int64_t h0 = c0 + (int64_t)threadIdx.x * 8;  // H % 8 == 0: all 8 are in the row
      if (h0 >= c1) continue;
      float acc[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] = 0.0f;
      for (int j0 = 0; j0 < p.k; j0 += kCombineBatch) {
        int64_t d[kCombineBatch];
        float v[kCombineBatch][8];
#pragma unroll
        for (int b = 0; b < kCombineBatch; ++b) {
          d[b] = j0 + b < p.k ? dest_of(j0 + b) : -1;
          if (d[b] >= 0) load8<YDT>(p.rows + d[b] * p.rows_row + h0 * ysize, v[b]);
        }
#pragma unroll
        for (int b = 0; b < kCombineBatch; ++b) {
          if (d[b] < 0) continue;
          const float w = weight_of(j0 + b);
#pragma unroll
          for (int u = 0; u < 8; ++u) acc[u] = __fadd_rn(acc[u], round_to(__fmul_rn(v[b][u], w), p.tdt));
        }
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) store_float(out + (h0 + u) * osize, p.odt, acc[u]);
    } else {
      for (int64_t h = c0 + threadIdx.x; h < c1; h += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < p.k; ++j) {
          const int64_t d = dest_of(j);
          if (d < 0) continue;
          const float y = load_float(p.rows + d * p.rows_row + h * ysize, YDT);
          acc = __fadd_rn(acc, round_to(__fmul_rn(y, weight_of(j)), p.tdt));
        }
        store_float(out + h * osize, p.odt, acc);
      }
    }
  }
}

// ------------------------------------------------------------ the gated activation
struct ActParams {
  const char *in;
  int64_t in_row;
  char *out;
  int64_t out_row;
  InView limit;  // [E] offsets, or data null
  int64_t limit_last;  // E - 1
  int64_t R, I;
  int32_t act;
};

template <int DT, bool VEC>
__global__ void __launch_bounds__(kRowThreads) k_gated_act(const __grid_constant__ ActParams p) {
  constexpr int size = DT == IMOE_DTYPE_F32 ? 4 : 2;
  int64_t rows = p.R;
  if (p.limit.data) {
    const int64_t end = load_index(p.limit.data + p.limit_last * p.limit.n_stride, p.limit.dtype,
                                   p.limit.aligned != 0);
    rows = end < 0 ? 0 : end < p.R ? end : p.R;
  }
  constexpr int per = VEC ? 16 / size : 1;  // features per thread and step
  const int64_t steps = p.I / per;
  for (int64_t item = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; item < rows * steps;
       item += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = item / steps, i0 = (item - r * steps) * per;
    const char *gate = p.in + r * p.in_row + i0 * size;
    const char *up = gate + p.I * size;
    char *out = p.out + r * p.out_row + i0 * size;
    if (VEC) {
      const uint4 g = *reinterpret_cast<const uint4 *>(gate), u = *reinterpret_cast<const uint4 *>(up);
      uint4 o;
      const char *gb = reinterpret_cast<const char *>(&g), *ub = reinterpret_cast<const char *>(&u);
      char *ob = reinterpret_cast<char *>(&o);
#pragma unroll
      for (int e = 0; e < per; ++e) {
        const float gate_e = load_float(gb + e * size, DT), up_e = load_float(ub + e * size, DT);
        store_float(ob + e * size, DT, gated(gate_e, up_e, p.act, DT));
      }
      *reinterpret_cast<uint4 *>(out) = o;
    } else {
      store_float(out, DT, gated(load_float(gate, DT), load_float(up, DT), p.act, DT));
    }
  }
}

// ------------------------------------------------------------ host side
namespace {

Mat mat_of(const imoe_view *v) {
  Mat m;
  m.data = static_cast<char *>(v->data);
  m.row = v->lead_ndim ? v->lead_stride[0] : 0;
  m.col = v->n_stride;
  m.dtype = v->dtype;
  const int64_t size = dtype_size(v->dtype);
  m.aligned = (uintptr_t)m.data % size == 0 && m.row % size == 0 && m.col % size == 0;
  return m;
}

OutView vec_of(const imoe_view *v) {
  OutView o;
  memset(&o, 0, sizeof o);
  o.data = static_cast<char *>(v->data);
  o.n_stride = v->n_stride;
  o.dtype = v->dtype;
  const int64_t size = dtype_size(v->dtype);
  o.aligned = (uintptr_t)o.data % size == 0 && o.n_stride % size == 0;
  return o;
}

InView in_vec_of(const imoe_view *v) {
  const OutView o = vec_of(v);
  InView i;
  memset(&i, 0, sizeof i);
  i.data = o.data;
  i.n_stride = o.n_stride;
  i.dtype = o.dtype;
  i.aligned = o.aligned;
  return i;
}

int64_t gcd64(int64_t a, int64_t b) {
  a = a < 0 ? -a : a;
  b = b < 0 ? -b : b;
  while (b) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// The widest vector (16, 8, 4, 2, 1 bytes) every row start and the row length are multiples of.
int vector_width(std::initializer_list<int64_t> values) {
  int64_t g = 16;
  for (int64_t v : values) g = gcd64(g, v);
  return g >= 16 ? 16 : g >= 8 ? 8 : g >= 4 ? 4 : g >= 2 ? 2 : 1;
}

unsigned grid_for(int64_t items, const DevInfo *di) {
  const int64_t cap = (int64_t)di->sms * 16;
  return (unsigned)(items < 1 ? 1 : items < cap ? items : cap);
}

// Opts a sort kernel in to `smem` bytes of dynamic shared memory where that
// is above the 48 KiB every kernel may use.
cudaError_t allow_smem(void (*kernel)(SortParams), size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
}

// The multi-block sort's blocks and tile for S assignments (S >=
// kMultiSortMin): B = min(kMultiSortBlocks, ceil(S / kMultiSortItems)),
// the tile ceil(S / B) rounded up to a multiple of kSortThreads, then B =
// ceil(S / tile) (the rounding may leave fewer blocks work: none is
// empty). B x E <= S / 4 + 1024 <= S: see imoe_moe_workspace_elems (and
// CapWs with a capacity).
void multi_sort_shape(int64_t S, int32_t *blocks, int64_t *tile) {
  int64_t b = (S + kMultiSortItems - 1) / kMultiSortItems;
  if (b > kMultiSortBlocks) b = kMultiSortBlocks;
  int64_t t = (S + b - 1) / b;
  t = (t + kSortThreads - 1) / kSortThreads * kSortThreads;
  *tile = t;
  *blocks = (int32_t)((S + t - 1) / t);
}

template <int YDT>
cudaError_t launch_combine(bool vec, unsigned grid, bool pdl, cudaStream_t st, const CombineParams &cp) {
  return vec ? launch(k_moe_combine<YDT, true>, shape(grid, kRowThreads, 0, pdl), st, cp)
             : launch(k_moe_combine<YDT, false>, shape(grid, kRowThreads, 0, pdl), st, cp);
}

template <int DT>
cudaError_t launch_act(bool vec, unsigned grid, cudaStream_t st, const ActParams &ap) {
  return vec ? launch(k_gated_act<DT, true>, shape(grid, kRowThreads), st, ap)
             : launch(k_gated_act<DT, false>, shape(grid, kRowThreads), st, ap);
}

}  // namespace
}  // namespace imoe_cu

using namespace imoe_cu;

extern "C" {

imoe_status imoe_cuda_moe_dispatch(const imoe_moe_routing *routing, const imoe_view *hidden, int64_t rows,
                                   const imoe_view *out_rows, const imoe_view *out_offsets,
                                   const imoe_view *out_dest, const imoe_view *out_src,
                                   const imoe_view *out_dropped, int32_t *workspace, int64_t workspace_elems,
                                   const imoe_exec *exec, imoe_error *err) {
  const char *fn = "imoe_cuda_moe_dispatch";
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  SortParams sp;
  memset(&sp, 0, sizeof sp);
  sp.ids = mat_of(routing->top_k_index);
  if (routing->capacity >= 0) sp.weights = mat_of(routing->top_k_weights);
  sp.dest = mat_of(out_dest);
  sp.offs = vec_of(out_offsets);
  sp.src = vec_of(out_src);
  sp.dropped = out_dropped ? static_cast<char *>(out_dropped->data) : nullptr;
  sp.T = routing->top_k_index->lead_shape[0];
  sp.k = (int32_t)routing->top_k_index->n;
  sp.E = (int32_t)routing->num_experts;
  sp.C = routing->capacity;
  sp.R = rows;
  sp.padded = routing->layout == IMOE_MOE_PADDED;
  sp.foreign = routing->skip_foreign != 0;
  sp.ws = workspace;
  sp.token = next_token();
  sp.words = di->words;
  const size_t smem = (size_t)sp.E * 36 * sizeof(int);
  if (smem > (size_t)di->smem_optin)
    return fail(err, IMOE_ERR_UNSUPPORTED, "%s: %d experts need %zu bytes of shared memory", fn, (int)sp.E, smem);
  // From kMultiSortMin assignments (dropless, grouped; or with a capacity,
  // either layout: padded always has one) the sort runs in blocks where the
  // workspace holds what they share (dropless: the counts, B x E; capacity:
  // CapWs); else in one block. Both give the same bytes.
  const int64_t S = sp.T * sp.k;
  const bool capacity = sp.C >= 0;
  if (S >= kMultiSortMin && workspace != nullptr) {
    multi_sort_shape(S, &sp.blocks, &sp.tile);
    const int64_t need = capacity ? cap_ws_elems(S, sp.blocks, sp.E) : (int64_t)sp.blocks * sp.E;
    sp.counts = capacity ? workspace + S : workspace;
    if (workspace_elems < need) sp.blocks = 0;
  }
  cudaError_t e;
  const bool pdl = di->cc_major >= 9;
  const size_t place_smem = (size_t)sp.E * kPlaceSmemInts * sizeof(int);  // base [E], wc [E x 33]
  if (sp.blocks > 0 && !capacity) {
    if ((e = allow_smem(k_moe_sort_place, place_smem)) != cudaSuccess)
      return cuda_fail(err, fn, "cudaFuncSetAttribute", e);
    if ((e = launch(k_moe_sort_count, shape((unsigned)sp.blocks, kSortThreads), st, sp)) != cudaSuccess)
      return cuda_fail(err, fn, "launch of k_moe_sort_count", e);
    if ((e = launch(k_moe_sort_scan, shape(1, kSortThreads, 0, pdl), st, sp)) != cudaSuccess)
      return cuda_fail(err, fn, "launch of k_moe_sort_scan", e);
    if ((e = launch(k_moe_sort_place, shape((unsigned)sp.blocks, kSortThreads, place_smem, pdl), st, sp)) !=
        cudaSuccess)
      return cuda_fail(err, fn, "launch of k_moe_sort_place", e);
  } else if (sp.blocks > 0) {
    const size_t cap_smem = place_smem + (size_t)sp.E * sizeof(uint64_t);  // and the thresholds [E]
    const unsigned B = (unsigned)sp.blocks;
    if ((e = allow_smem(k_moe_cap_order, place_smem)) != cudaSuccess ||
        (e = allow_smem(k_moe_cap_place, cap_smem)) != cudaSuccess)
      return cuda_fail(err, fn, "cudaFuncSetAttribute", e);
    if ((e = launch(k_moe_sort_count, shape(B, kSortThreads), st, sp)) != cudaSuccess)
      return cuda_fail(err, fn, "launch of k_moe_sort_count", e);
    if ((e = launch(k_moe_cap_scan, shape(1, kSortThreads, 0, pdl), st, sp)) != cudaSuccess)
      return cuda_fail(err, fn, "launch of k_moe_cap_scan", e);
    if ((e = launch(k_moe_cap_order, shape(B, kSortThreads, place_smem, pdl), st, sp)) != cudaSuccess)
      return cuda_fail(err, fn, "launch of k_moe_cap_order", e);
    if ((e = launch(k_moe_cap_select, shape((unsigned)sp.E, kSortThreads, 0, pdl), st, sp)) != cudaSuccess)
      return cuda_fail(err, fn, "launch of k_moe_cap_select", e);
    if ((e = launch(k_moe_cap_count, shape(B, kSortThreads, 0, pdl), st, sp)) != cudaSuccess)
      return cuda_fail(err, fn, "launch of k_moe_cap_count", e);
    if ((e = launch(k_moe_cap_rows, shape(1, kSortThreads, 0, pdl), st, sp)) != cudaSuccess)
      return cuda_fail(err, fn, "launch of k_moe_cap_rows", e);
    if ((e = launch(k_moe_cap_place, shape(B, kSortThreads, cap_smem, pdl), st, sp)) != cudaSuccess)
      return cuda_fail(err, fn, "launch of k_moe_cap_place", e);
  } else {
    if ((e = allow_smem(k_moe_sort, smem)) != cudaSuccess) return cuda_fail(err, fn, "cudaFuncSetAttribute", e);
    if ((e = launch(k_moe_sort, shape(1, kSortThreads, smem), st, sp)) != cudaSuccess)
      return cuda_fail(err, fn, "launch of k_moe_sort", e);
  }
  if (rows == 0 || out_rows->row_bytes == 0) return IMOE_OK;
  GatherParams gp;
  memset(&gp, 0, sizeof gp);
  gp.hidden = static_cast<const char *>(hidden->data);
  gp.hidden_row = hidden->n_stride;
  gp.rows = static_cast<char *>(out_rows->data);
  gp.rows_row = out_rows->n_stride;
  gp.src = in_vec_of(out_src);
  gp.R = rows;
  gp.row_bytes = out_rows->row_bytes;
  gp.token = sp.token;
  gp.nverdict = sp.blocks > 0 ? sp.blocks : 1;
  gp.words = di->words;
  const int vw = vector_width({(int64_t)(uintptr_t)gp.hidden, gp.hidden_row, (int64_t)(uintptr_t)gp.rows,
                               gp.rows_row, gp.row_bytes});
  const LaunchShape gs = shape(grid_for(rows, di), kRowThreads, 0, di->cc_major >= 9);
  switch (vw) {
    case 16: e = launch(k_moe_gather<16>, gs, st, gp); break;
    case 8: e = launch(k_moe_gather<8>, gs, st, gp); break;
    case 4: e = launch(k_moe_gather<4>, gs, st, gp); break;
    case 2: e = launch(k_moe_gather<2>, gs, st, gp); break;
    default: e = launch(k_moe_gather<1>, gs, st, gp); break;
  }
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_moe_gather", e);
  return IMOE_OK;
}

imoe_status imoe_cuda_moe_combine(const imoe_view *rows, const imoe_view *dest, const imoe_view *weights,
                                  const imoe_view *out, const imoe_exec *exec, imoe_error *err) {
  const char *fn = "imoe_cuda_moe_combine";
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  CombineParams cp;
  memset(&cp, 0, sizeof cp);
  cp.rows = static_cast<const char *>(rows->data);
  cp.rows_row = rows->lead_stride[0];
  cp.dest = mat_of(dest);
  cp.weights = mat_of(weights);
  cp.out = static_cast<char *>(out->data);
  cp.out_row = out->lead_stride[0];
  cp.T = dest->lead_shape[0];
  cp.k = (int32_t)dest->n;
  cp.R = rows->lead_shape[0];
  cp.H = rows->n;
  cp.ydt = rows->dtype;
  cp.odt = out->dtype;
  cp.tdt = rows->dtype == weights->dtype ? rows->dtype : IMOE_DTYPE_F32;
  cp.words = di->words;
  cp.inline_check = cp.T * cp.k <= kInlineDestCheck;
  cudaError_t e;
  if (!cp.inline_check) {
    cp.token = next_token();
    cp.check_blocks = dest_check_blocks(cp.T * cp.k, kRowThreads);  // the combine's blocks read them
    e = launch(k_moe_dest_check, shape((unsigned)cp.check_blocks, 1024), st, cp);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_moe_dest_check", e);
  }
  const bool vec = cp.H % 8 == 0 && vector_width({(int64_t)(uintptr_t)cp.rows, cp.rows_row}) >= 16;
  const unsigned grid = grid_for(cp.T * ((cp.H + kCombineChunk - 1) / kCombineChunk), di);
  const bool pdl = !cp.inline_check && di->cc_major >= 9;
  switch (cp.ydt) {
    case IMOE_DTYPE_F32: e = launch_combine<IMOE_DTYPE_F32>(vec, grid, pdl, st, cp); break;
    case IMOE_DTYPE_F16: e = launch_combine<IMOE_DTYPE_F16>(vec, grid, pdl, st, cp); break;
    default: e = launch_combine<IMOE_DTYPE_BF16>(vec, grid, pdl, st, cp); break;
  }
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_moe_combine", e);
  return IMOE_OK;
}

imoe_status imoe_cuda_gated_act(const imoe_view *gate_up, const imoe_view *out, imoe_act act,
                                const imoe_view *limit, const imoe_exec *exec, imoe_error *err) {
  const char *fn = "imoe_cuda_gated_act";
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  ActParams ap;
  memset(&ap, 0, sizeof ap);
  ap.in = static_cast<const char *>(gate_up->data);
  ap.in_row = gate_up->lead_stride[0];
  ap.out = static_cast<char *>(out->data);
  ap.out_row = out->lead_stride[0];
  if (limit) {
    ap.limit = in_vec_of(limit);
    ap.limit_last = limit->n - 1;
  }
  ap.R = gate_up->lead_shape[0];
  ap.I = out->n;
  ap.act = act;
  const int64_t size = dtype_size(gate_up->dtype);
  const bool vec = (ap.I * size) % 16 == 0 &&
                   vector_width({(int64_t)(uintptr_t)ap.in, ap.in_row, (int64_t)(uintptr_t)ap.out, ap.out_row}) >= 16;
  const int64_t items = ap.R * (vec ? ap.I * size / 16 : ap.I);
  const unsigned grid = grid_for((items + kRowThreads - 1) / kRowThreads, di);
  cudaError_t e;
  switch (gate_up->dtype) {
    case IMOE_DTYPE_F32: e = launch_act<IMOE_DTYPE_F32>(vec, grid, st, ap); break;
    case IMOE_DTYPE_F16: e = launch_act<IMOE_DTYPE_F16>(vec, grid, st, ap); break;
    default: e = launch_act<IMOE_DTYPE_BF16>(vec, grid, st, ap); break;
  }
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_gated_act", e);
  return IMOE_OK;
}

}  // extern "C"
