// imoe_permute.cuh: the permutation engine on the device (imoe_permute,
// imoe_apply_ordered / imoe_restore_ordered, imoe_group_by_expert).
// Included once by imoe_cuda.cu, after its anonymous namespace: the kernels
// share that translation unit's status word and verdict slots.
//
// Method. A permutation p of a row's N slots (new slot i takes old slot p[i])
// is a product of two involutions made of disjoint swaps, each applied by
// k_apply (kind 1) in one all-parallel pass:
//   1. every slot x learns its cycle's leader m (the minimal slot) and its
//      forward distance e = steps from x to m along x -> p[x]: pointer
//      jumping over (jump, min, distance-to-min), ceil(log2 N) rounds;
//   2. L = e(p[m]) + 1; leaders' lengths are scanned into a base offset B(m)
//      and order[B(m) + e(x)] = x lays every cycle out contiguously;
//   3. in distance coordinates the permutation is the shift e -> e - 1
//      (p[x] is one step closer to m), the product of the reflections
//      tau1: e <-> -1 - e (mod L), then tau2: e <-> -e; the inverse is
//      tau1': e <-> 1 - e, then tau2.
// Everything before the two swap passes writes only the int32 workspace, and
// the swap passes read the verdict words of the call's validation first.
//
// Workspace (int32), `plan_rows x N` elements per region:
//   regions 0-5  jump / min / distance, double-buffered; reused for the base
//                offsets, the cycle layout and the two target maps;
//   region 6     the permutation itself when the device computes it
//                (grouping, ordered compaction).
// imoe_plan_workspace_elems (csrc/workspace.c) gives these sizes.
#pragma once

namespace imoe_cu {

constexpr int kPermThreads = 1024;   // one block per plan row
constexpr int kPermCheckThreads = 256;
constexpr int kGroupMaxExperts = 1024;  // k_group keeps per-warp counts of every expert in shared memory

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

// ------------------------------------------------------------ validation
// perm: every value in [0, N) (pass 1), each once (pass 2, after pass 1 in
// stream order, so a range error anywhere is recorded before a repeat).
// The same two passes check an ordered compaction's indices ([rows, m],
// m = C' <= n): in range, distinct; the scatter then marks the kept slots.
struct PermCheckParams {
  Lead lead;          // of the plan rows (per-row perm) or empty (shared)
  int64_t n;          // values lie in [0, n); the scatter rows have n entries
  int64_t m;          // entries per row of the checked view
  uint64_t items;     // plan_rows x m, grid-strided
  uint64_t scatter_items;  // plan_rows x n
  InView perm;
  int32_t *scatter;   // [plan_rows, n]: -1, then the position holding each value
  uint32_t token, prev_token;
  int32_t prev_nverdict;
};

__global__ void __launch_bounds__(kPermCheckThreads) k_perm_range(const __grid_constant__ PermCheckParams p) {
  const bool al = p.perm.aligned != 0;
  bool bad = false;
  const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; f < p.items; f += step) {
    const uint64_t r = f / (uint64_t)p.m, i = f - r * (uint64_t)p.m;
    uint32_t c[kMaxDims];
    row_coords(p.lead, (uint32_t)r, c);
    const int64_t v = load_index(p.perm.data + row_offset(p.lead, c, p.perm.lead) + (int64_t)i * p.perm.n_stride,
                                 p.perm.dtype, al);
    if (v < 0 || v >= p.n) bad = true;
  }
  for (uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; f < p.scatter_items; f += step)
    p.scatter[f] = -1;
  bad = __syncthreads_or(bad) != 0;
  if (threadIdx.x == 0) {
    if (bad) record_status(IMOE_ERR_INDEX_RANGE);
    write_verdict(p.token, bad);
  }
}

__global__ void __launch_bounds__(kPermCheckThreads) k_perm_unique(const __grid_constant__ PermCheckParams p) {
  const bool al = p.perm.aligned != 0;
  const bool before = call_aborted(p.prev_token, p.prev_nverdict);
  bool dup = false;
  const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; f < p.items; f += step) {
    const uint64_t r = f / (uint64_t)p.m, i = f - r * (uint64_t)p.m;
    uint32_t c[kMaxDims];
    row_coords(p.lead, (uint32_t)r, c);
    const int64_t v = load_index(p.perm.data + row_offset(p.lead, c, p.perm.lead) + (int64_t)i * p.perm.n_stride,
                                 p.perm.dtype, al);
    if (v < 0 || v >= p.n) continue;  // pass 1's error
    if (atomicCAS(&p.scatter[r * (uint64_t)p.n + (uint64_t)v], -1, (int32_t)i) != -1) dup = true;
  }
  dup = __syncthreads_or(dup) != 0;
  if (threadIdx.x == 0) {
    if (dup) record_status(IMOE_ERR_BAD_MAP);
    write_verdict(p.token, dup || before);
  }
}

// ------------------------------------------------------------ cycles
// Grid-wide kernels over every slot of every row of the permutation (flat
// index f = r * n + x), one launch per pointer-jumping round: the random
// int32 gathers of a round then spread over the whole GPU. Workspace regions
// (plan_rows x n each): set s is jump 3s, min 3s+1, distance 3s+2. With f
// the final set: B (cycle bases) in 3f; order in 3(1-f); tile totals, then
// tau1 in 3(1-f)+1; leader lengths, then tau2 in 3(1-f)+2.
struct CycleParams {
  Lead lead;        // of the plan rows (per-row) or empty (shared: one row)
  int64_t n;
  uint64_t items;   // plan_rows x n
  int64_t region;
  InView succ;      // the permutation p (caller's view or workspace region 6)
  int32_t *ws;
  int32_t src;      // round: the set read (the other one is written)
  int32_t w;        // round: window of the set read (slots per window)
  int32_t fin;      // the final set
  int32_t tiles;    // scan tiles per row
  int32_t inverse;
  uint32_t token;
  int32_t nverdict;
};

constexpr int kCycThreads = 256;

// The cycle kernels follow each other with programmatic dependent launch
// (sm_90): the next one is launched while this one runs and waits here for
// its predecessor's completion (and memory) before reading anything.
__device__ __forceinline__ void cyc_enter() {
  griddep_launch_dependents();
  griddep_wait();
}
constexpr int kScanItems = 8;                       // consecutive slots per thread in a scan tile
constexpr int kScanTile = kCycThreads * kScanItems;  // slots per scan tile

__device__ __forceinline__ int32_t succ_of(const CycleParams &p, uint32_t r, int64_t x) {
  uint32_t c[kMaxDims];
  row_coords(p.lead, r, c);
  return (int32_t)load_index(p.succ.data + row_offset(p.lead, c, p.succ.lead) + x * p.succ.n_stride, p.succ.dtype,
                             p.succ.aligned != 0);
}

// Set 0 after the first round (window 2): jump p[p[x]], min(x, p[x]), and
// the distance of that min (1 when p[x] < x).
__global__ void __launch_bounds__(kCycThreads) k_cyc_init(const __grid_constant__ CycleParams p) {
  cyc_enter();
  if (call_aborted(p.token, p.nverdict)) return;
  const uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (f >= p.items) return;
  const uint32_t r = (uint32_t)(f / (uint64_t)p.n);
  const int32_t x = (int32_t)(f - (uint64_t)r * (uint64_t)p.n);
  const int32_t px = succ_of(p, r, x);
  const int32_t ppx = succ_of(p, r, px);
  p.ws[f] = ppx;
  p.ws[p.region + f] = px < x ? px : x;
  p.ws[2 * p.region + f] = px < x ? 1 : 0;
}

// One pointer-jumping round: windows of w slots become windows of 2w.
__global__ void __launch_bounds__(kCycThreads) k_cyc_round(const __grid_constant__ CycleParams p) {
  cyc_enter();
  if (call_aborted(p.token, p.nverdict)) return;
  const uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (f >= p.items) return;
  const uint64_t row0 = f - f % (uint64_t)p.n;
  const int32_t *J = p.ws + 3 * p.src * p.region, *M = J + p.region, *D = J + 2 * p.region;
  int32_t *J2 = p.ws + 3 * (1 - p.src) * p.region, *M2 = J2 + p.region, *D2 = J2 + 2 * p.region;
  const int32_t j = J[f];
  const int32_t mx = M[f], dx = D[f];
  const int32_t mj = M[row0 + j], dj = D[row0 + j], jj = J[row0 + j];
  const bool better = mj < mx;
  M2[f] = better ? mj : mx;
  D2[f] = better ? p.w + dj : dx;
  J2[f] = jj;
}

// Scan, part 1: each leader's cycle length (L = e(p[m]) + 1, 0 elsewhere)
// into the lengths region, and each tile's sum into the totals region.
__global__ void __launch_bounds__(kCycThreads) k_cyc_lengths(const __grid_constant__ CycleParams p) {
  __shared__ int s_warp[33];
  cyc_enter();
  if (call_aborted(p.token, p.nverdict)) return;
  const uint32_t r = blockIdx.x / (uint32_t)p.tiles, t = blockIdx.x - r * (uint32_t)p.tiles;
  const int64_t row0 = (int64_t)r * p.n;
  const int32_t *M = p.ws + (3 * p.fin + 1) * p.region + row0, *D = p.ws + (3 * p.fin + 2) * p.region + row0;
  int32_t *len = p.ws + (3 * (1 - p.fin) + 2) * p.region + row0;
  int32_t *totals = p.ws + (3 * (1 - p.fin) + 1) * p.region;
  const int64_t xs = (int64_t)t * kScanTile + (int64_t)threadIdx.x * kScanItems;
  int v[kScanItems];
#pragma unroll
  for (int u = 0; u < kScanItems; ++u) {
    const int64_t x = xs + u;
    v[u] = (x < p.n && M[x] == (int32_t)x) ? -1 - succ_of(p, r, x) : 0;  // -1 - p[x] marks a leader
  }
  int sum = 0;
#pragma unroll
  for (int u = 0; u < kScanItems; ++u) {
    if (v[u] < 0) v[u] = D[-1 - v[u]] + 1;
    if (xs + u < p.n) len[xs + u] = v[u];
    sum += v[u];
  }
  int total;
  perm_block_scan(sum, &total, s_warp);
  if (threadIdx.x == 0) totals[(int64_t)r * p.tiles + t] = total;
}

// Scan, part 2: one block per row turns its tile totals into exclusive
// prefixes, in place.
__global__ void __launch_bounds__(kCycThreads) k_cyc_tile_scan(const __grid_constant__ CycleParams p) {
  __shared__ int s_warp[33];
  cyc_enter();
  if (call_aborted(p.token, p.nverdict)) return;
  int32_t *totals = p.ws + (3 * (1 - p.fin) + 1) * p.region + (int64_t)blockIdx.x * p.tiles;
  int carry = 0;
  for (int t0 = 0; t0 < p.tiles; t0 += blockDim.x) {
    const int t = t0 + threadIdx.x;
    const int v = t < p.tiles ? totals[t] : 0;
    int total;
    const int excl = perm_block_scan(v, &total, s_warp);
    if (t < p.tiles) totals[t] = carry + excl;
    carry += total;
  }
}

// Scan, part 3: every slot's base B = (tile prefix) + (scan within the tile).
__global__ void __launch_bounds__(kCycThreads) k_cyc_bases(const __grid_constant__ CycleParams p) {
  __shared__ int s_warp[33];
  cyc_enter();
  if (call_aborted(p.token, p.nverdict)) return;
  const uint32_t r = blockIdx.x / (uint32_t)p.tiles, t = blockIdx.x - r * (uint32_t)p.tiles;
  const int64_t row0 = (int64_t)r * p.n;
  const int32_t *len = p.ws + (3 * (1 - p.fin) + 2) * p.region + row0;
  const int32_t *totals = p.ws + (3 * (1 - p.fin) + 1) * p.region;
  int32_t *B = p.ws + 3 * p.fin * p.region + row0;
  const int64_t xs = (int64_t)t * kScanTile + (int64_t)threadIdx.x * kScanItems;
  int v[kScanItems];
  int sum = 0;
#pragma unroll
  for (int u = 0; u < kScanItems; ++u) {
    v[u] = xs + u < p.n ? len[xs + u] : 0;
    sum += v[u];
  }
  int total;
  int run = totals[(int64_t)r * p.tiles + t] + perm_block_scan(sum, &total, s_warp);
#pragma unroll
  for (int u = 0; u < kScanItems; ++u) {
    if (xs + u < p.n) B[xs + u] = run;
    run += v[u];
  }
}

// The cycles laid out: order[B(m) + e(x)] = x.
__global__ void __launch_bounds__(kCycThreads) k_cyc_order(const __grid_constant__ CycleParams p) {
  cyc_enter();
  if (call_aborted(p.token, p.nverdict)) return;
  const uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (f >= p.items) return;
  const uint64_t row0 = f - f % (uint64_t)p.n;
  const int32_t *B = p.ws + 3 * p.fin * p.region, *M = B + p.region, *D = B + 2 * p.region;
  int32_t *order = p.ws + 3 * (1 - p.fin) * p.region;
  order[row0 + B[row0 + M[f]] + D[f]] = (int32_t)(f - row0);
}

// The two involutions as target maps: tau1 (e <-> -1 - e, or 1 - e for the
// inverse) and tau2 (e <-> -e), mod L.
__global__ void __launch_bounds__(kCycThreads) k_cyc_maps(const __grid_constant__ CycleParams p) {
  cyc_enter();
  if (call_aborted(p.token, p.nverdict)) return;
  const uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (f >= p.items) return;
  const uint32_t r = (uint32_t)(f / (uint64_t)p.n);
  const uint64_t row0 = (uint64_t)r * (uint64_t)p.n;
  const int32_t *B = p.ws + 3 * p.fin * p.region, *M = B + p.region, *D = B + 2 * p.region;
  const int32_t *order = p.ws + 3 * (1 - p.fin) * p.region;
  int32_t *tm1 = p.ws + (3 * (1 - p.fin) + 1) * p.region, *tm2 = p.ws + (3 * (1 - p.fin) + 2) * p.region;
  const int32_t m = M[f], e = D[f];
  const int32_t b = B[row0 + m];
  const int32_t L = D[row0 + succ_of(p, r, m)] + 1;
  const int32_t e1 = p.inverse ? (L + 1 - e) % L : L - 1 - e;
  const int32_t e2 = (L - e) % L;
  tm1[f] = order[row0 + b + e1];
  tm2[f] = order[row0 + b + e2];
}

// ------------------------------------------------------------ ordered plans
// P = indices ++ (the other slots, ascending), into workspace region 6. The
// indices were checked by k_perm_range / k_perm_unique, whose scatter
// (region 3) now marks every kept slot (>= 0) and every dropped one (-1).
struct OrderedPlanParams {
  Lead lead;
  int64_t n, kept;
  int64_t region;
  InView idx;
  int32_t *ws;
  uint32_t token;
  int32_t nverdict;
};

__global__ void __launch_bounds__(kPermThreads) k_ordered_plan(const __grid_constant__ OrderedPlanParams p) {
  __shared__ int s_warp[33];
  if (call_aborted(p.token, p.nverdict)) return;
  const uint32_t r = blockIdx.x;
  const int64_t n = p.n;
  uint32_t c[kMaxDims];
  row_coords(p.lead, r, c);
  const char *irow = p.idx.data + row_offset(p.lead, c, p.idx.lead);
  const bool al = p.idx.aligned != 0;
  const int32_t *scatter = p.ws + 3 * p.region + (int64_t)r * n;
  int32_t *plan = p.ws + 6 * p.region + (int64_t)r * n;
  for (int64_t i = threadIdx.x; i < p.kept; i += blockDim.x)
    plan[i] = (int32_t)load_index(irow + i * p.idx.n_stride, p.idx.dtype, al);
  int carry = 0;
  for (int64_t x0 = 0; x0 < n; x0 += blockDim.x) {
    const int64_t x = x0 + threadIdx.x;
    const int drop = x < n && scatter[x] < 0;
    int total;
    const int excl = perm_block_scan(drop, &total, s_warp);
    if (drop) plan[p.kept + carry + excl] = (int32_t)x;
    carry += total;
  }
}

// ------------------------------------------------------------ grouping
struct GroupCheckParams {
  Lead lead;
  int64_t n, experts;
  uint64_t items;
  InView ids;
  uint32_t token;
};

__global__ void __launch_bounds__(kPermCheckThreads) k_group_check(const __grid_constant__ GroupCheckParams p) {
  const bool al = p.ids.aligned != 0;
  bool bad = false;
  const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; f < p.items; f += step) {
    const uint64_t r = f / (uint64_t)p.n, t = f - r * (uint64_t)p.n;
    uint32_t c[kMaxDims];
    row_coords(p.lead, (uint32_t)r, c);
    const int64_t e = load_index(p.ids.data + row_offset(p.lead, c, p.ids.lead) + (int64_t)t * p.ids.n_stride,
                                 p.ids.dtype, al);
    if (e < 0 || e >= p.experts) bad = true;
  }
  bad = __syncthreads_or(bad) != 0;
  if (threadIdx.x == 0) {
    if (bad) record_status(IMOE_ERR_INDEX_RANGE);
    write_verdict(p.token, bad);
  }
}

struct GroupParams {
  Lead lead;
  int64_t n;  // T
  int32_t experts;
  int32_t has_perm;
  int64_t region;
  InView ids;
  OutView offsets, perm;
  int32_t *ws;
  uint32_t token;
  int32_t nverdict;
};

// One block of kPermThreads per row: a stable counting sort. Shared memory:
// base[E + 1] (running first slot of each expert), then per-warp counts
// wc[E][33] (padded) of the current tile of kPermThreads tokens.
__global__ void __launch_bounds__(kPermThreads) k_group(const __grid_constant__ GroupParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ int s_warp[33];
  int *base = reinterpret_cast<int *>(dsm);
  int *wc = base + p.experts + 1;
  if (call_aborted(p.token, p.nverdict)) return;
  const uint32_t r = blockIdx.x;
  const int64_t n = p.n;
  const int E = p.experts;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t c[kMaxDims];
  row_coords(p.lead, r, c);
  const char *irow = p.ids.data + row_offset(p.lead, c, p.ids.lead);
  char *orow = p.offsets.data + row_offset(p.lead, c, p.offsets.lead);
  char *prow = p.has_perm ? p.perm.data + row_offset(p.lead, c, p.perm.lead) : nullptr;
  const bool ial = p.ids.aligned != 0;
  int32_t *plan = p.ws + 6 * p.region + (int64_t)r * n;
  for (int e = threadIdx.x; e <= E; e += blockDim.x) base[e] = 0;
  __syncthreads();
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x)
    atomicAdd(&base[(int)load_index(irow + t * p.ids.n_stride, p.ids.dtype, ial)], 1);
  __syncthreads();
  int carry = 0;
  for (int e0 = 0; e0 <= E; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    const int cnt = e <= E ? base[e] : 0;
    int total;
    const int excl = perm_block_scan(cnt, &total, s_warp);  // its barriers order the reads before the writes
    if (e <= E) {
      base[e] = carry + excl;
      store_index(orow + (int64_t)e * p.offsets.n_stride, p.offsets.dtype, p.offsets.aligned != 0, carry + excl);
    }
    carry += total;
  }
  __syncthreads();
  for (int64_t t0 = 0; t0 < n; t0 += blockDim.x) {
    for (int k = threadIdx.x; k < E * 33; k += blockDim.x) wc[k] = 0;
    __syncthreads();
    const int64_t t = t0 + threadIdx.x;
    const int e = t < n ? (int)load_index(irow + t * p.ids.n_stride, p.ids.dtype, ial) : -1;
    const unsigned peers = __match_any_sync(0xFFFFFFFFu, e);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    if (e >= 0 && rank == 0) wc[e * 33 + warp] = __popc(peers);
    __syncthreads();
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
      int sum = base[x];
      for (int w = 0; w < 32; ++w) {
        const int k = wc[x * 33 + w];
        wc[x * 33 + w] = sum;
        sum += k;
      }
      base[x] = sum;
    }
    __syncthreads();
    if (e >= 0) {
      const int pos = wc[e * 33 + warp] + rank;
      plan[pos] = (int32_t)t;
      if (prow) store_index(prow + (int64_t)pos * p.perm.n_stride, p.perm.dtype, p.perm.aligned != 0, t);
    }
    __syncthreads();
  }
}

}  // namespace imoe_cu

// ------------------------------------------------------------ host side
namespace {

int perm_rounds(int64_t n) {
  int k = 0;
  while (((int64_t)1 << k) < n) ++k;
  return k;
}

// Row-major strides (bytes) of a [plan rows, n] int32 workspace region over
// the merged lead axes; all zero for a shared plan.
Strides ws_strides(const Lead &lead, int64_t n, bool per_row) {
  Strides s;
  memset(&s, 0, sizeof s);
  if (!per_row) return s;
  int64_t acc = n * 4;
  for (int d = lead.nd - 1; d >= 0; --d) {
    s.s[d] = acc;
    acc *= (int64_t)lead.shape[d];
  }
  return s;
}

InView ws_view(const int32_t *data, const Lead &lead, int64_t n, bool per_row) {
  InView v;
  memset(&v, 0, sizeof v);
  v.data = reinterpret_cast<const char *>(data);
  v.lead = ws_strides(lead, n, per_row);
  v.n_stride = 4;
  v.dtype = IMOE_DTYPE_I32;
  v.aligned = 1;
  return v;
}

imoe_status check_workspace(const char *fn, int32_t *ws, int64_t elems, int64_t need, imoe_error *err) {
  if (need > 0 && (ws == nullptr || elems < need))
    return fail(err, IMOE_ERR_ARGUMENT,
                "%s: the CUDA path needs a device workspace of %lld int32 elements (got %lld): "
                "imoe_plan_workspace_elems gives the size",
                fn, (long long)need, (long long)(ws ? elems : 0));
  return IMOE_OK;
}

// The cycle kernels and the two swap passes: buffers [buf_st0, ...) of pl,
// the permutation `succ` ([plan rows, n]), after the validation of `token`.
imoe_status launch_cycles_and_swaps(const char *fn, const imoe_view *buffers, int32_t num_buffers, const Plan &pl,
                                    size_t buf_st0, const InView &succ, bool per_row, int64_t n, bool inverse,
                                    int32_t *ws, uint32_t token, int nverdict, DevInfo *di, cudaStream_t st,
                                    imoe_error *err) {
  if (n < 2) return IMOE_OK;  // nothing can move
  const uint64_t rows = per_row ? pl.R : 1u;
  CycleParams cp;
  memset(&cp, 0, sizeof cp);
  cp.lead = pl.lead;
  if (!per_row) memset(&cp.lead, 0, sizeof cp.lead);
  cp.n = n;
  cp.items = rows * (uint64_t)n;
  cp.region = (int64_t)cp.items;
  cp.succ = succ;
  cp.ws = ws;
  cp.inverse = inverse ? 1 : 0;
  cp.token = token;
  cp.nverdict = nverdict;
  cp.tiles = (int32_t)((n + kScanTile - 1) / kScanTile);
  const uint64_t flat = (cp.items + kCycThreads - 1) / kCycThreads;
  const uint64_t tiled = rows * (uint64_t)cp.tiles;
  if (flat > 0x7FFFFFFFull || tiled > 0x7FFFFFFFull || rows > 0x7FFFFFFFull)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  const int rounds = perm_rounds(n);  // >= 1: the first is k_cyc_init's
  const bool pdl = di->cc_major >= 9;
  cudaError_t e = launch(k_cyc_init, (unsigned)flat, kCycThreads, 0, st, pdl, cp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_cyc_init", e);
  int s = 0;
  for (int k = 1; k < rounds; ++k) {
    cp.src = s;
    cp.w = 1 << k;
    e = launch(k_cyc_round, (unsigned)flat, kCycThreads, 0, st, pdl, cp);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_cyc_round", e);
    s = 1 - s;
  }
  cp.fin = s;
  if ((e = launch(k_cyc_lengths, (unsigned)tiled, kCycThreads, 0, st, pdl, cp)) != cudaSuccess)
    return cuda_fail(err, fn, "launch of k_cyc_lengths", e);
  if ((e = launch(k_cyc_tile_scan, (unsigned)rows, kCycThreads, 0, st, pdl, cp)) != cudaSuccess)
    return cuda_fail(err, fn, "launch of k_cyc_tile_scan", e);
  if ((e = launch(k_cyc_bases, (unsigned)tiled, kCycThreads, 0, st, pdl, cp)) != cudaSuccess)
    return cuda_fail(err, fn, "launch of k_cyc_bases", e);
  if ((e = launch(k_cyc_order, (unsigned)flat, kCycThreads, 0, st, pdl, cp)) != cudaSuccess)
    return cuda_fail(err, fn, "launch of k_cyc_order", e);
  if ((e = launch(k_cyc_maps, (unsigned)flat, kCycThreads, 0, st, pdl, cp)) != cudaSuccess)
    return cuda_fail(err, fn, "launch of k_cyc_maps", e);
  const int32_t *tm1 = ws + (3 * (1 - s) + 1) * cp.region;
  const int32_t *tm2 = ws + (3 * (1 - s) + 2) * cp.region;
  imoe_status r = launch_apply_groups(fn, buffers, 0, num_buffers, pl, buf_st0, ws_view(tm1, pl.lead, n, per_row),
                                      1, n, true, token, nverdict, false, di, st, err);
  if (r != IMOE_OK) return r;
  return launch_apply_groups(fn, buffers, 0, num_buffers, pl, buf_st0, ws_view(tm2, pl.lead, n, per_row), 1, n,
                             true, token, nverdict, false, di, st, err);
}

int check_grid(uint64_t items) {
  const uint64_t want = (items + 2047) / 2048;
  return (int)std::max<uint64_t>(1, std::min<uint64_t>(want, kVerdicts));
}

}  // namespace

extern "C" {

imoe_status imoe_cuda_permute(const imoe_view *buffers, int32_t num_buffers, const imoe_view *perm,
                              int32_t inverse, int32_t *workspace, int64_t workspace_elems, const imoe_exec *exec,
                              imoe_error *err) {
  const char *fn = "imoe_cuda_permute";
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  const int64_t n = buffers[0].n;
  if (n >= 0x7FFFFFFFLL)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: N = %lld slots: the CUDA path takes N < 2^31", fn, (long long)n);
  std::vector<const imoe_view *> views;
  views.push_back(perm);
  for (int b = 0; b < num_buffers; ++b) views.push_back(&buffers[b]);
  Plan pl;
  if (!make_plan(&buffers[0], views, &pl)) return fail(err, IMOE_ERR_ARGUMENT, "%s: more than 2^32 - 1 rows", fn);
  const bool per_row = perm->lead_ndim > 0;
  const uint64_t rows = per_row ? pl.R : 1u;
  s = check_workspace(fn, workspace, workspace_elems,
                      imoe_plan_workspace_elems(IMOE_PLAN_PERMUTE, IMOE_DEVICE_CUDA, (int64_t)rows, n), err);
  if (s != IMOE_OK) return s;
  if (pl.R == 0 || n == 0) return IMOE_OK;
  const int nd = pl.lead.nd;
  PermCheckParams cp;
  memset(&cp, 0, sizeof cp);
  cp.lead = pl.lead;
  if (!per_row) memset(&cp.lead, 0, sizeof cp.lead);
  cp.n = n;
  cp.m = n;
  cp.items = rows * (uint64_t)n;
  cp.scatter_items = cp.items;
  cp.perm = in_view(perm, pl.st[0], nd);
  cp.scatter = workspace + 3 * (int64_t)rows * n;
  const int grid = check_grid(cp.items);
  cp.token = next_token();
  cudaError_t e = launch(k_perm_range, (unsigned)grid, kPermCheckThreads, 0, st, false, cp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_perm_range", e);
  cp.prev_token = cp.token;
  cp.prev_nverdict = grid;
  cp.token = next_token();
  e = launch(k_perm_unique, (unsigned)grid, kPermCheckThreads, 0, st, false, cp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_perm_unique", e);
  return launch_cycles_and_swaps(fn, buffers, num_buffers, pl, 1, cp.perm, per_row, n, inverse != 0, workspace,
                                 cp.token, grid, di, st, err);
}

imoe_status imoe_cuda_apply_ordered(const imoe_view *buffers, int32_t num_buffers, const imoe_view *indices,
                                    int32_t restore, int32_t *workspace, int64_t workspace_elems,
                                    const imoe_exec *exec, imoe_error *err) {
  const char *fn = restore ? "imoe_cuda_restore_ordered" : "imoe_cuda_apply_ordered";
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  const int64_t n = buffers[0].n, kept = indices->n;
  if (n >= 0x7FFFFFFFLL)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: N = %lld slots: the CUDA path takes N < 2^31", fn, (long long)n);
  std::vector<const imoe_view *> views;
  views.push_back(indices);
  for (int b = 0; b < num_buffers; ++b) views.push_back(&buffers[b]);
  Plan pl;
  if (!make_plan(&buffers[0], views, &pl)) return fail(err, IMOE_ERR_ARGUMENT, "%s: more than 2^32 - 1 rows", fn);
  const bool per_row = indices->lead_ndim > 0;
  const uint64_t rows = per_row ? pl.R : 1u;
  s = check_workspace(fn, workspace, workspace_elems,
                      imoe_plan_workspace_elems(IMOE_PLAN_ORDERED, IMOE_DEVICE_CUDA, (int64_t)rows, n), err);
  if (s != IMOE_OK) return s;
  if (pl.R == 0 || n == 0) return IMOE_OK;
  if (rows > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  const int nd = pl.lead.nd;
  Lead plead = pl.lead;
  if (!per_row) memset(&plead, 0, sizeof plead);
  // the indices: in [0, N), then distinct (IMOE_ERR_BAD_MAP, as the CPU core)
  PermCheckParams cp;
  memset(&cp, 0, sizeof cp);
  cp.lead = plead;
  cp.n = n;
  cp.m = kept;
  cp.items = rows * (uint64_t)kept;
  cp.scatter_items = rows * (uint64_t)n;
  cp.perm = in_view(indices, pl.st[0], nd);
  cp.scatter = workspace + 3 * (int64_t)rows * n;
  const int nverdict = check_grid(std::max(cp.items, cp.scatter_items));
  cp.token = next_token();
  cudaError_t e = launch(k_perm_range, (unsigned)nverdict, kPermCheckThreads, 0, st, false, cp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_perm_range", e);
  cp.prev_token = cp.token;
  cp.prev_nverdict = nverdict;
  cp.token = next_token();
  e = launch(k_perm_unique, (unsigned)nverdict, kPermCheckThreads, 0, st, false, cp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_perm_unique", e);
  const uint32_t token = cp.token;
  OrderedPlanParams op;
  memset(&op, 0, sizeof op);
  op.lead = plead;
  op.n = n;
  op.kept = kept;
  op.region = (int64_t)rows * n;
  op.idx = cp.perm;
  op.ws = workspace;
  op.token = token;
  op.nverdict = nverdict;
  e = launch(k_ordered_plan, (unsigned)rows, kPermThreads, 0, st, false, op);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_ordered_plan", e);
  const InView plan = ws_view(workspace + 6 * op.region, pl.lead, n, per_row);
  return launch_cycles_and_swaps(fn, buffers, num_buffers, pl, 1, plan, per_row, n, restore != 0, workspace, token,
                                 nverdict, di, st, err);
}

imoe_status imoe_cuda_group_by_expert(const imoe_view *buffers, int32_t num_buffers, const imoe_view *expert_ids,
                                      int64_t num_experts, const imoe_view *out_offsets, const imoe_view *out_perm,
                                      int32_t *workspace, int64_t workspace_elems, const imoe_exec *exec,
                                      imoe_error *err) {
  const char *fn = "imoe_cuda_group_by_expert";
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  const int64_t n = buffers[0].n;
  if (n >= 0x7FFFFFFFLL)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: T = %lld slots: the CUDA path takes T < 2^31", fn, (long long)n);
  if (num_experts > kGroupMaxExperts)
    return fail(err, IMOE_ERR_UNSUPPORTED, "%s: num_experts = %lld: the CUDA path takes at most %d experts", fn,
                (long long)num_experts, kGroupMaxExperts);
  // views: 0 ids, 1.. buffers, then offsets and perm
  std::vector<const imoe_view *> views;
  views.push_back(expert_ids);
  for (int b = 0; b < num_buffers; ++b) views.push_back(&buffers[b]);
  views.push_back(out_offsets);
  views.push_back(out_perm);
  Plan pl;
  if (!make_plan(&buffers[0], views, &pl)) return fail(err, IMOE_ERR_ARGUMENT, "%s: more than 2^32 - 1 rows", fn);
  const uint64_t rows = pl.R;
  s = check_workspace(fn, workspace, workspace_elems,
                      imoe_plan_workspace_elems(IMOE_PLAN_GROUP, IMOE_DEVICE_CUDA, (int64_t)rows, n), err);
  if (s != IMOE_OK) return s;
  if (pl.R == 0) return IMOE_OK;
  if (rows > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  const int nd = pl.lead.nd;
  const size_t ob = 1 + (size_t)num_buffers;
  GroupCheckParams gc;
  memset(&gc, 0, sizeof gc);
  gc.lead = pl.lead;
  gc.n = n;
  gc.experts = num_experts;
  gc.items = rows * (uint64_t)n;
  gc.ids = in_view(expert_ids, pl.st[0], nd);
  gc.token = next_token();
  const int grid = check_grid(gc.items);
  cudaError_t e = launch(k_group_check, (unsigned)grid, kPermCheckThreads, 0, st, false, gc);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_group_check", e);
  GroupParams gp;
  memset(&gp, 0, sizeof gp);
  gp.lead = pl.lead;
  gp.n = n;
  gp.experts = (int32_t)num_experts;
  gp.has_perm = out_perm ? 1 : 0;
  gp.region = (int64_t)rows * n;
  gp.ids = gc.ids;
  gp.offsets = out_view(out_offsets, pl.st[ob], nd);
  if (out_perm) gp.perm = out_view(out_perm, pl.st[ob + 1], nd);
  gp.ws = workspace;
  gp.token = gc.token;
  gp.nverdict = grid;
  const size_t smem = ((size_t)num_experts + 1 + (size_t)num_experts * 33) * sizeof(int);
  if (smem > 48 * 1024) {
    e = cudaFuncSetAttribute(k_group, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return cuda_fail(err, fn, "cudaFuncSetAttribute", e);
  }
  e = launch(k_group, (unsigned)rows, kPermThreads, smem, st, false, gp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_group", e);
  const InView plan = ws_view(workspace + 6 * gp.region, pl.lead, n, true);
  return launch_cycles_and_swaps(fn, buffers, num_buffers, pl, 1, plan, true, n, false, workspace, gc.token, grid,
                                 di, st, err);
}

}  // extern "C"
