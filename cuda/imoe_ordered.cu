// imoe_ordered.cu: ordered compaction on the device (imoe_compact_ordered
// and imoe_build_map_ordered with STABLE or SCORE; docs/cuda-design.md,
// "Ordered compaction"). It runs select_and_move (imoe_select.cu) for the
// selection and launch_cycles_and_swaps (imoe_permute.cu) for the moves; its
// kernels take the status and verdict words as their last parameter.
//
// Method, per call (every kernel on the caller's stream, nothing allocated):
//   1. select_and_move (validation + k_select / k_select_small) writes the
//      row's target map into workspace region 0 instead of the caller's
//      outputs. A slot x is kept iff (x < C') == (tm[x] == x): below C' the
//      kept slots are the fixed points, at or beyond C' the paired tails.
//   2. k_ord_kept (one block per row) scans those flags: the kept slots
//      ascending go to P[0, C') (workspace region 6; region 3 when the rank
//      sort follows) and, for a compaction, the dropped ones ascending to
//      P[C', N). STABLE: it also writes out_indices.
//   3. SCORE: the order is the CPU core's (score descending, slot
//      ascending), with the same keys (-0 == +0, NaN lowest). Rows with
//      C' <= 4096 take k_ord_rank: grid rows x ceil(C' / 256), each block
//      stages the row's C' keys in shared memory and each thread counts the
//      kept slots before its own (smaller key, or equal key and lower slot):
//      its place in P[0, C') and out_indices. Longer rows take k_ord_sort
//      (one block per row): a stable LSD radix sort of P[0, C') (8-bit
//      digits; 4 passes for f32 keys, 2 for f16 / bf16), so ties keep the
//      ascending slot order; it then writes out_indices.
//   4. Compaction: launch_cycles_and_swaps applies P to every buffer; in move
//      mode only P's first C' slots are written where the slice path runs.
// Every kernel reads the verdict words of step 1's validation first and does
// nothing after a data error (NaN under IMOE_NAN_ERROR, bad active indices),
// so out_indices and the buffers keep their bytes; only the workspace is
// written before the verdict is known.
//
// Workspace (int32, rows x N elements per region, IMOE_PLAN_ORDERED): region
// 0 the target map; 1 and 2 the sort keys (ping, pong); 3 the sorted slots
// (pong), or the kept slots ascending (the rank sort's input); 6 P. Regions
// 0-5 are then free for the cycle kernels.
#include <cuda_runtime.h>
#include <string.h>

#include <vector>

#include "imoe_device.cuh"
#include "imoe_launch.cuh"

namespace imoe_cu {

constexpr int kOrdThreads = 1024;  // one block per row
constexpr int kOrdItems = 4;       // consecutive slots per thread in k_ord_kept
constexpr int kOrdTile = kOrdThreads * kOrdItems;
constexpr int kOrdBins = 256;      // 8-bit digits
static_assert(kOrdThreads == 4 * kOrdBins, "k_ord_sort scans each digit's warp counts with 4 threads");
constexpr int kOrdTm = 0, kOrdKeysA = 1, kOrdKeysB = 2, kOrdSlotsB = 3, kOrdPlan = 6;  // workspace regions

struct OrdParams {
  Lead lead;          // of the call's rows
  int64_t n, kept;    // N, C'
  int64_t region;     // rows x N
  InView scores;      // SCORE only
  OutView idx;        // the caller's out_indices [rows, C']
  int32_t *ws;
  int32_t key16;      // 16-bit score keys (F16, BF16)
  int32_t write_idx;  // this kernel writes out_indices (the order is final)
  int32_t plan_dropped;  // append the dropped slots to P (compaction)
  int32_t kept_region;   // k_ord_kept: where the kept slots go (P, or the rank sort's input)
  uint32_t token;
  int32_t nverdict;
  StatusWords words;  // imoe_select.cu's status and verdict words (DevInfo::words)
};

// The CPU core's order-preserving keys (csrc/select.c): f32 as key_of_bits;
// f16 / bf16 as 16-bit keys straight from their bits (the same order and
// the same ties as widening them, in half the radix passes).
__device__ __forceinline__ uint32_t ord_key(uint32_t raw, int dtype) {
  if (dtype == IMOE_DTYPE_F32) return key_of_bits(raw);
  const uint32_t inf = dtype == IMOE_DTYPE_F16 ? 0x7C00u : 0x7F80u;
  uint32_t b = raw & 0xFFFFu;
  if ((b & 0x7FFFu) > inf) return 0u;  // NaN: below -inf
  if (b == 0x8000u) b = 0u;            // -0 ties +0
  return (b & 0x8000u) ? (~b & 0xFFFFu) : (b | 0x8000u);
}

__device__ __forceinline__ char *ord_out_row(const OrdParams &p, uint32_t r) {
  uint32_t c[kMaxDims];
  row_coords(p.lead, r, c);
  return p.idx.data + row_offset(p.lead, c, p.idx.lead);
}

// Kept slots ascending into P[0, C') (region kept_region: k_ord_rank's input
// for the rank sort), dropped ones ascending into P[C', N).
__global__ void __launch_bounds__(kOrdThreads) k_ord_kept(const __grid_constant__ OrdParams p) {
  __shared__ int s_warp[33];
  if (call_aborted(p.words, p.token, p.nverdict)) return;
  const uint32_t r = blockIdx.x;
  const int64_t n = p.n, kept = p.kept;
  const int32_t *tm = p.ws + kOrdTm * p.region + (int64_t)r * n;
  int32_t *plan = p.ws + kOrdPlan * p.region + (int64_t)r * n;
  int32_t *keep = p.ws + p.kept_region * p.region + (int64_t)r * n;
  char *orow = p.write_idx ? ord_out_row(p, r) : nullptr;
  const bool oal = p.idx.aligned != 0;
  int64_t carry = 0;  // kept slots before the tile
  for (int64_t t0 = 0; t0 < n; t0 += kOrdTile) {
    const int64_t xs = t0 + (int64_t)threadIdx.x * kOrdItems;
    unsigned bits = 0;
#pragma unroll
    for (int u = 0; u < kOrdItems; ++u) {
      const int64_t x = xs + u;
      if (x < n && (x < kept) == (tm[x] == (int32_t)x)) bits |= 1u << u;
    }
    int total;
    int64_t k = carry + perm_block_scan(__popc(bits), &total, s_warp);
#pragma unroll
    for (int u = 0; u < kOrdItems; ++u) {
      const int64_t x = xs + u;
      if (x >= n) break;
      if ((bits >> u) & 1u) {
        keep[k] = (int32_t)x;
        if (orow) store_index(orow + k * p.idx.n_stride, p.idx.dtype, oal, x);
        ++k;
      } else if (p.plan_dropped) {
        plan[kept + x - k] = (int32_t)x;  // x - k dropped slots precede x
      }
    }
    carry += total;
  }
}

// P[0, C') (ascending slots) sorted by descending score key, stably, then
// written to out_indices. Each LSD pass is a stable counting sort over tiles
// of one slot per thread: a slot's place is its digit's base, plus the slots
// of that digit in earlier warps of the tile (per-warp counts scanned per
// digit), plus its rank among equal digits of its warp (__match_any_sync).
__global__ void __launch_bounds__(kOrdThreads) k_ord_sort(const __grid_constant__ OrdParams p) {
  __shared__ int hist[4][kOrdBins];
  __shared__ int base[kOrdBins];
  __shared__ int wc[kOrdBins * 33];
  __shared__ int s_tot[kOrdBins / 32];
  if (call_aborted(p.words, p.token, p.nverdict)) return;
  const uint32_t r = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n = p.n;
  const int kept = (int)p.kept;
  uint32_t c[kMaxDims];
  row_coords(p.lead, r, c);
  const char *srow = p.scores.data + row_offset(p.lead, c, p.scores.lead);
  const bool sal = p.scores.aligned != 0;
  const int dt = p.scores.dtype;
  int32_t *plan = p.ws + kOrdPlan * p.region + (int64_t)r * n;
  uint32_t *ka = reinterpret_cast<uint32_t *>(p.ws + kOrdKeysA * p.region + (int64_t)r * n);
  uint32_t *kb = reinterpret_cast<uint32_t *>(p.ws + kOrdKeysB * p.region + (int64_t)r * n);
  int32_t *sb = p.ws + kOrdSlotsB * p.region + (int64_t)r * n;
  const int passes = p.key16 ? 2 : 4;
  const uint32_t mask = p.key16 ? 0xFFFFu : 0xFFFFFFFFu;

  for (int i = tid; i < 4 * kOrdBins; i += blockDim.x) (&hist[0][0])[i] = 0;
  __syncthreads();
  // Keys inverted (ascending sort = descending score), every pass's digit
  // histogram at once: a stable pass keeps the multiset of digits.
  for (int i = tid; i < kept; i += blockDim.x) {
    const int32_t x = plan[i];
    const uint32_t d = ~ord_key(ldg_raw(srow + (int64_t)x * p.scores.n_stride, dt, sal), dt) & mask;
    ka[i] = d;
    for (int q = 0; q < passes; ++q) atomicAdd(&hist[q][(d >> (8 * q)) & 0xFFu], 1);
  }
  __syncthreads();

  const uint32_t *ks = ka;
  const int32_t *ss = plan;
  uint32_t *kd = kb;
  int32_t *sd = sb;
  for (int q = 0; q < passes; ++q) {
    // a digit shared by every key leaves the order as it is
    if (__syncthreads_or(tid < kOrdBins && hist[q][tid] == kept)) continue;
    {
      const int v = tid < kOrdBins ? hist[q][tid] : 0;
      const int incl = warp_incl_scan(v);
      if (lane == 31 && warp < kOrdBins / 32) s_tot[warp] = incl;
      __syncthreads();
      if (tid < kOrdBins) {
        int off = 0;
        for (int w = 0; w < warp; ++w) off += s_tot[w];
        base[tid] = off + incl - v;
      }
    }
    const int shift = 8 * q;
    for (int t0 = 0; t0 < kept; t0 += blockDim.x) {
      for (int i = tid; i < kOrdBins * 33; i += blockDim.x) wc[i] = 0;
      __syncthreads();  // also publishes base
      const int i = t0 + tid;
      const bool valid = i < kept;
      const uint32_t key = valid ? ks[i] : 0u;
      const int32_t slot = valid ? ss[i] : 0;
      const int d = valid ? (int)((key >> shift) & 0xFFu) : kOrdBins;
      const unsigned peers = __match_any_sync(0xFFFFFFFFu, d);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      if (valid && rank == 0) wc[d * 33 + warp] = __popc(peers);
      __syncthreads();
      {
        // per digit, the 32 warp counts become exclusive prefixes from the
        // digit's base: 4 threads per digit (lanes 4j..4j+3), 8 warps each
        const int d = tid >> 2, part = tid & 3;
        int *row = wc + d * 33 + part * 8;
        const int b = base[d];
        int v[8], sum = 0;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
          v[w] = row[w];
          sum += v[w];
        }
        int incl = sum;
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
          const int up = __shfl_up_sync(0xFFFFFFFFu, incl, o, 4);
          if (part >= o) incl += up;
        }
        __syncwarp();  // every part has read base[d] before part 3 updates it
        int run = b + incl - sum;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
          row[w] = run;
          run += v[w];
        }
        if (part == 3) base[d] = run;
      }
      __syncthreads();
      if (valid) {
        const int pos = wc[d * 33 + warp] + rank;
        kd[pos] = key;
        sd[pos] = slot;
      }
      __syncthreads();  // the pass's writes are seen by the next; wc is free again
    }
    const uint32_t *kt = ks;
    ks = kd;
    kd = const_cast<uint32_t *>(kt);
    const int32_t *st = ss;
    ss = sd;
    sd = const_cast<int32_t *>(st);
  }
  char *orow = ord_out_row(p, r);
  const bool oal = p.idx.aligned != 0;
  for (int i = tid; i < kept; i += blockDim.x) {
    const int32_t x = ss[i];
    if (ss != plan) plan[i] = x;
    store_index(orow + (int64_t)i * p.idx.n_stride, p.idx.dtype, oal, x);
  }
}

// Rows of at most kOrdSmallSort kept slots: the same order as ranks, over
// blocks of kOrdRankThreads kept slots each (grid rows x ceil(C' / 256)).
// k_ord_kept wrote the kept slots ascending to region kOrdSlotsB (not P:
// the blocks of a row write P while the others read the kept slots); every
// block stages the row's C' keys (~ord_key, so ascending = descending score)
// in shared memory, and the thread of kept slot i counts the slots that
// precede it: smaller keys, and equal keys at lower i (the slot ascending).
// Keys and i are distinct together, so the ranks are a permutation of
// [0, C'); slot i goes to P[rank] and out_indices[rank].
constexpr int kOrdSmallSort = 4096;
constexpr int kOrdRankThreads = 256;

__global__ void __launch_bounds__(kOrdRankThreads) k_ord_rank(const __grid_constant__ OrdParams p) {
  __shared__ __align__(16) uint32_t s_key[kOrdSmallSort];
  if (call_aborted(p.words, p.token, p.nverdict)) return;
  const int kept = (int)p.kept;
  const uint32_t nb = (uint32_t)((kept + kOrdRankThreads - 1) / kOrdRankThreads);
  const uint32_t r = blockIdx.x / nb, blk = blockIdx.x - r * nb;
  const int tid = threadIdx.x;
  const char *srow = row_data(p.lead, p.scores, r);
  const bool sal = p.scores.aligned != 0;
  const int dt = p.scores.dtype;
  const uint32_t mask = p.key16 ? 0xFFFFu : 0xFFFFFFFFu;
  const int32_t *slots = p.ws + kOrdSlotsB * p.region + (int64_t)r * p.n;
  int32_t *plan = p.ws + kOrdPlan * p.region + (int64_t)r * p.n;
  const int padded = (kept + 3) & ~3;
  for (int j = tid; j < padded; j += blockDim.x) {
    uint32_t k = 0xFFFFFFFFu;  // pads: no key is above them
    if (j < kept) k = ~ord_key(ldg_raw(srow + (int64_t)slots[j] * p.scores.n_stride, dt, sal), dt) & mask;
    s_key[j] = k;
  }
  __syncthreads();
  const int i = (int)blk * kOrdRankThreads + tid;
  const int wb = i & ~31;  // the warp's first slot: uniform across the warp
  if (wb >= kept) return;
  const uint32_t me = i < kept ? s_key[i] : 0u;
  const uint4 *s4 = reinterpret_cast<const uint4 *>(s_key);
  int before = 0, after = 0;
  // slots of lower i (whole words of 4): equal keys precede
  for (int j4 = 0; j4 < wb / 4; ++j4) {
    const uint4 v = s4[j4];
    before += (v.x <= me) + (v.y <= me) + (v.z <= me) + (v.w <= me);
  }
  // slots of higher i, from the next warp's first: only smaller keys precede
  for (int j4 = (wb + 32) / 4; j4 < padded / 4; ++j4) {
    const uint4 v = s4[j4];
    after += (v.x < me) + (v.y < me) + (v.z < me) + (v.w < me);
  }
  // the warp's own 32
  const int we = min(wb + 32, kept);
  for (int j = wb; j < we; ++j) {
    const uint32_t v = s_key[j];
    before += v < me || (v == me && j < i);
  }
  if (i >= kept) return;
  const int rank = before + after;
  const int32_t x = slots[i];
  plan[rank] = x;
  store_index(ord_out_row(p, r) + (int64_t)rank * p.idx.n_stride, p.idx.dtype, p.idx.aligned != 0, x);
}

// ------------------------------------------------------------ host side
namespace {

// Step 3's kernel: none (STABLE, or nothing kept), ranks over many blocks
// per row for rows of at most kOrdSmallSort kept slots (while the grid fits
// one launch), a radix sort beyond.
enum class OrderSort { kNone, kRank, kRadix };

OrderSort plan_order_sort(imoe_order order, int64_t kept, uint64_t rows) {
  if (order != IMOE_ORDER_SCORE || kept <= 0) return OrderSort::kNone;
  const uint64_t blocks = rows * (uint64_t)((kept + kOrdRankThreads - 1) / kOrdRankThreads);
  return kept <= kOrdSmallSort && blocks <= 0x7FFFFFFFull ? OrderSort::kRank : OrderSort::kRadix;
}

// Steps 1-4 above. num_buffers == 0: imoe_build_map_ordered (out_indices
// only); else imoe_compact_ordered (move mode writes P's first C' slots
// where the slice path applies it, and all of P otherwise).
imoe_status ordered_select(const char *fn, const imoe_view *buffers, int32_t num_buffers,
                           const imoe_selection *sel, imoe_order order, imoe_mode mode, const imoe_view *oi,
                           int64_t n,
                           int32_t *ws, int64_t ws_elems, const imoe_exec *exec, imoe_error *err) {
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  if (n >= 0x7FFFFFFFLL)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: N = %lld slots: the CUDA path takes N < 2^31", fn, (long long)n);
  if (order != IMOE_ORDER_STABLE && !(order == IMOE_ORDER_SCORE && sel->scores))
    return fail(err, IMOE_ERR_ARGUMENT, "%s: order %d is not STABLE, or SCORE with scores", fn, (int)order);
  const imoe_view *scores = sel->scores;
  // views: 0 scores (absent for active indices), 1 out_indices, 2.. buffers
  std::vector<const imoe_view *> views;
  views.push_back(scores);
  views.push_back(oi);
  for (int b = 0; b < num_buffers; ++b) views.push_back(&buffers[b]);
  CallRows pl;
  if (!merge_rows(oi, views, &pl)) return fail(err, IMOE_ERR_ARGUMENT, "%s: more than 2^32 - 1 rows", fn);
  const uint64_t rows = pl.R;
  s = check_workspace(fn, ws, ws_elems,
                      imoe_plan_workspace_elems(IMOE_PLAN_ORDERED, IMOE_DEVICE_CUDA, (int64_t)rows, n), err);
  if (s != IMOE_OK) return s;
  if (rows == 0 || n == 0) return IMOE_OK;
  if (rows > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  const int64_t kept = oi->n;
  const int nd = pl.lead.nd;

  // 1. validation and selection; the target map goes to workspace region 0,
  // a row-major [lead of out_indices..., N] int32 view
  imoe_view tm;
  memset(&tm, 0, sizeof tm);
  tm.data = ws + kOrdTm * (int64_t)rows * n;
  tm.lead_ndim = oi->lead_ndim;
  int64_t acc = n * 4;
  for (int d = oi->lead_ndim - 1; d >= 0; --d) {
    tm.lead_shape[d] = oi->lead_shape[d];
    tm.lead_stride[d] = acc;
    acc *= oi->lead_shape[d];
  }
  tm.n = n;
  tm.n_stride = 4;
  tm.row_bytes = 4;
  tm.dtype = IMOE_DTYPE_I32;
  SelectVerdict v;
  s = select_and_move(fn, nullptr, 0, sel, nullptr, &tm, false, IMOE_MODE_SWAP, exec, err, &v);
  if (s != IMOE_OK) return s;

  // 2. P = kept ascending ++ dropped ascending; 3. the score order
  OrdParams op;
  memset(&op, 0, sizeof op);
  op.lead = pl.lead;
  op.n = n;
  op.kept = kept;
  op.region = (int64_t)rows * n;
  if (scores) op.scores = in_view(scores, pl.st[0], nd);
  op.idx = out_view(oi, pl.st[1], nd);
  op.ws = ws;
  op.key16 = scores && scores->dtype != IMOE_DTYPE_F32 ? 1 : 0;
  op.write_idx = order == IMOE_ORDER_STABLE ? 1 : 0;
  op.plan_dropped = num_buffers > 0 ? 1 : 0;
  op.token = v.token;
  op.nverdict = v.nverdict;
  op.words = di->words;
  const OrderSort sort = plan_order_sort(order, kept, rows);
  op.kept_region = sort == OrderSort::kRank ? kOrdSlotsB : kOrdPlan;
  cudaError_t e = launch(k_ord_kept, shape((unsigned)rows, kOrdThreads), st, op);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_ord_kept", e);
  if (sort == OrderSort::kRank) {
    op.write_idx = 1;
    const uint64_t nb = (uint64_t)((kept + kOrdRankThreads - 1) / kOrdRankThreads);
    e = launch(k_ord_rank, shape((unsigned)(rows * nb), kOrdRankThreads), st, op);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_ord_rank", e);
  } else if (sort == OrderSort::kRadix) {
    op.write_idx = 1;
    e = launch(k_ord_sort, shape((unsigned)rows, kOrdThreads), st, op);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_ord_sort", e);
  }

  // 4. apply P, unless it is the identity
  if (num_buffers == 0 || kept == 0 || (order == IMOE_ORDER_STABLE && kept == n)) return IMOE_OK;
  const InView plan = ws_view(ws + kOrdPlan * op.region, pl.lead, n, true);
  return launch_cycles_and_swaps(fn, buffers, num_buffers, pl, 2, plan, true, n, false, ws, v.token,
                                 v.nverdict, di, st, err, mode == IMOE_MODE_MOVE ? kept : n);
}

}  // namespace

}  // namespace imoe_cu

using namespace imoe_cu;

extern "C" {

imoe_status imoe_cuda_compact_ordered(const imoe_view *buffers, int32_t num_buffers,
                                      const imoe_selection *sel, imoe_order order, imoe_mode mode,
                                      const imoe_view *out_indices, int32_t *workspace,
                                      int64_t workspace_elems, const imoe_exec *exec, imoe_error *err) {
  return ordered_select("imoe_cuda_compact_ordered", buffers, num_buffers, sel, order, mode, out_indices,
                        buffers[0].n, workspace, workspace_elems, exec, err);
}

imoe_status imoe_cuda_build_map_ordered(const imoe_selection *sel, imoe_order order, int64_t n,
                                        const imoe_view *out_indices, int32_t *workspace,
                                        int64_t workspace_elems, const imoe_exec *exec, imoe_error *err) {
  return ordered_select("imoe_cuda_build_map_ordered", nullptr, 0, sel, order, IMOE_MODE_SWAP, out_indices, n,
                        workspace,
                        workspace_elems, exec, err);
}

}  // extern "C"
