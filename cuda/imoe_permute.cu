// imoe_permute.cu: the permutation engine on the device (imoe_permute,
// imoe_apply_ordered / imoe_restore_ordered, imoe_group_by_expert;
// docs/cuda-design.md, "Permutations and grouping"). Its kernels take the
// status and verdict words (imoe_select.cu's module memory) as their last
// parameter; its seam swaps are k_apply launches (launch_apply_groups).
//
// Where every buffer's N slots of one W-byte slice fit a block's shared
// memory, launch_cycles_and_swaps hands the permutation to launch_slices
// (imoe_slices.cu: one read and one write of every byte, no workspace);
// the cycle engine below takes the rest.
//
// Method. A permutation p of a row's N slots (new slot i takes old slot p[i]):
//   1. every slot x learns its cycle's leader m (the minimal slot) and its
//      forward distance e = steps from x to m along x -> p[x]: each slot
//      first follows p for 16 steps itself, then pointer-jumping rounds over
//      (jump, min, distance-to-min) join up to 8 windows each;
//   2. L = e(p[m]) + 1; leaders' lengths are scanned into a base offset B(m)
//      and order[B(m) + e(x)] = x lays every cycle out contiguously; in
//      these coordinates p is the shift e -> e - 1 (p[x] is one step closer
//      to m): new[s_e] = old[s_(e-1)]; the inverse shifts the other way;
//   3. one data pass rotates every run of one cycle inside each chunk of 16
//      layout positions by one step, in registers (k_perm_rotate);
//   4. a cycle cut into ns > 1 runs still has one wrong slot per run; these
//      form the same kind of shift over ns slots, applied as two involutions
//      of disjoint swaps by k_apply (kind 1): in run coordinates i,
//      tau1: i <-> -1 - i (mod ns) (inverse: 1 - i), then tau2: i <-> -i.
// Every row is read and written about 1 + 2/16 times (2 with swaps alone).
// Everything before the data passes writes only the int32 workspace, and the
// data passes read the verdict words of the call's validation first.
//
// Workspace (int32), `plan_rows x N` elements per region:
//   regions 0-5  jump / min / distance, double-buffered; reused for the block
//                sums, the cycle layout and the two target maps;
//   region 6     the permutation itself when the device computes it
//                (grouping, ordered compaction).
// imoe_plan_workspace_elems (csrc/workspace.c) gives these sizes.
#include <cuda_runtime.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "imoe_device.cuh"
#include "imoe_launch.cuh"

namespace imoe_cu {

constexpr int kPermThreads = 1024;   // one block per plan row
constexpr int kPermCheckThreads = 256;
constexpr int kGroupMaxExperts = 1024;  // k_group keeps per-warp counts of every expert in shared memory

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
  StatusWords words;  // imoe_select.cu's status and verdict words (DevInfo::words)
};

// Element f of a grid-strided pass over rows of m indices: its row r, its
// place i in the row and its value.
__device__ __forceinline__ int64_t flat_index(const Lead &L, const InView &v, uint64_t f, uint64_t m, bool al,
                                              uint64_t &r, uint64_t &i) {
  r = f / m;
  i = f - r * m;
  return load_index(row_data(L, v, (uint32_t)r) + (int64_t)i * v.n_stride, v.dtype, al);
}

// Whether an index this thread visits, of `items` over rows of m, is outside [0, hi).
__device__ __forceinline__ bool any_out_of_range(const Lead &L, const InView &v, uint64_t items, uint64_t m,
                                                 int64_t hi) {
  const bool al = v.aligned != 0;
  bool bad = false;
  const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; f < items; f += step) {
    uint64_t r, i;
    const int64_t x = flat_index(L, v, f, m, al, r, i);
    if (x < 0 || x >= hi) bad = true;
  }
  return bad;
}

// Both let the next kernel launch early (it waits for them before reading);
// k_perm_unique, launched early itself by imoe_cuda_permute, waits for the
// scatter's reset.
__global__ void __launch_bounds__(kPermCheckThreads) k_perm_range(const __grid_constant__ PermCheckParams p) {
  griddep_launch_dependents();
  const bool bad = any_out_of_range(p.lead, p.perm, p.items, (uint64_t)p.m, p.n);
  const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; f < p.scatter_items; f += step)
    p.scatter[f] = -1;
  block_verdict(p.words, p.token, bad, IMOE_ERR_INDEX_RANGE);
}

__global__ void __launch_bounds__(kPermCheckThreads)
    k_perm_unique(const __grid_constant__ PermCheckParams p) {
  griddep_launch_dependents();
  griddep_wait();
  const bool al = p.perm.aligned != 0;
  const bool before = call_aborted(p.words, p.prev_token, p.prev_nverdict);
  bool dup = false;
  const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; f < p.items; f += step) {
    uint64_t r, i;
    const int64_t v = flat_index(p.lead, p.perm, f, (uint64_t)p.m, al, r, i);
    if (v < 0 || v >= p.n) continue;  // pass 1's error
    if (atomicCAS(&p.scatter[r * (uint64_t)p.n + (uint64_t)v], -1, (int32_t)i) != -1) dup = true;
  }
  block_verdict(p.words, p.token, dup, IMOE_ERR_BAD_MAP, before);
}

// ------------------------------------------------------------ cycles
// Grid-wide kernels over every slot of every row of the permutation (flat
// index f = r * n + x), one launch per pointer-jumping round: the random
// int32 gathers of a round then spread over the whole GPU. Workspace regions
// (plan_rows x n each): set s is jump 3s, min 3s+1, distance 3s+2; s = fin
// is the final set. The kernel that computes the final set writes, instead
// of its jumps, one aggregate per block (the sum of the cycle lengths its
// leaders start) into region 3fin. k_cyc_bases then overwrites each
// leader's min (itself) with its cycle's base B (a leader is the one slot
// whose distance is 0); the layout goes to region 3(1-fin), the two
// second-pass target maps to 3(1-fin)+1 and 3(1-fin)+2.
struct CycleParams {
  Lead lead;        // of the plan rows (per-row) or empty (shared: one row)
  int64_t n;
  uint64_t items;   // plan_rows x n
  int64_t region;
  InView succ;      // the permutation p (caller's view or workspace region 6)
  int32_t *ws;
  int32_t src;      // round: the set read (the other one is written)
  int32_t w;        // round: window of the set read (slots per window)
  int32_t arity;    // round: windows joined into one
  int32_t last;     // init / round: this launch computes the final set
  int32_t fin;      // the final set
  uint32_t nagg;    // block aggregates (blocks of the flat kernels)
  int32_t agg_scanned;  // k_cyc_agg_scan turned the aggregates into prefixes
  int32_t inverse;
  uint32_t token;
  int32_t nverdict;
  StatusWords words;  // imoe_select.cu's status and verdict words (DevInfo::words)
};

constexpr int kCycThreads = 256;
constexpr int kWalkLog = 4;
constexpr int kWalk = 1 << kWalkLog;  // k_cyc_init follows p this many steps from every slot
constexpr int kArity = 8;              // most windows a round joins
constexpr uint32_t kAggDirect = 2048;  // up to this many aggregates, k_cyc_bases adds them up itself
constexpr int kRotK = 16;              // layout positions per rotation chunk
constexpr int kRotThreads = 384;

// The cycle kernels follow each other with programmatic dependent launch
// (sm_90): the next one is launched while this one runs and waits here for
// its predecessor's completion (and memory) before reading anything; then
// whether the call failed validation (the kernel then does nothing).
__device__ __forceinline__ bool cyc_enter(const CycleParams &p) {
  griddep_launch_dependents();
  griddep_wait();
  return call_aborted(p.words, p.token, p.nverdict);
}

__device__ __forceinline__ const char *succ_row(const CycleParams &p, uint32_t r) {
  uint32_t c[kMaxDims];
  row_coords(p.lead, r, c);
  return p.succ.data + row_offset(p.lead, c, p.succ.lead);
}
__device__ __forceinline__ int32_t succ_at(const CycleParams &p, const char *row, int64_t x) {
  return (int32_t)load_index(row + x * p.succ.n_stride, p.succ.dtype, p.succ.aligned != 0);
}

// Exclusive block scan (unsigned, 32 or 64 bits); every thread gets the
// total. s_warp: 33 words. Every thread of the block calls it.
template <class T>
__device__ __forceinline__ T cyc_block_scan(T v, T *total, T *s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  T incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T u = __shfl_up_sync(0xFFFFFFFFu, incl, o);
    if (lane >= o) incl += u;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const T wv = lane < nw ? s_warp[lane] : (T)0;
    T ws = wv;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T u = __shfl_up_sync(0xFFFFFFFFu, ws, o);
      if (lane >= o) ws += u;
    }
    s_warp[lane] = ws - wv;
    if (lane == 31) s_warp[32] = ws;
  }
  __syncthreads();
  const T excl = s_warp[warp] + incl - v;
  *total = s_warp[32];
  __syncthreads();
  return excl;
}

// The final kernel's block aggregate: the cycle lengths its leaders start
// (< 2^32: a block covers at most two rows, or rows shorter than itself).
__device__ __forceinline__ void cyc_write_aggregate(const CycleParams &p, uint32_t len, uint32_t *s_warp) {
  uint32_t total;
  cyc_block_scan<uint32_t>(len, &total, s_warp);
  if (threadIdx.x == 0) reinterpret_cast<uint32_t *>(p.ws + 3 * p.fin * p.region)[blockIdx.x] = total;
}

// A pass over every slot f of every row (row r, its first slot row0, place x
// in the row): `slot` does the slot's work and returns its cycle's length if
// it leads one, else 0; the last kernel's blocks then write their aggregates.
template <class Slot>
__device__ __forceinline__ void cyc_slots(const CycleParams &p, uint32_t *s_warp, Slot slot) {
  if (cyc_enter(p)) return;
  const uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t len = 0;
  if (f < p.items) {
    const uint32_t r = (uint32_t)(f / (uint64_t)p.n);
    const uint64_t row0 = (uint64_t)r * (uint64_t)p.n;
    len = slot(f, r, row0, (int32_t)(f - row0));
  }
  if (p.last) cyc_write_aggregate(p, len, s_warp);
}

// Set 0 after a window of kWalk: every slot follows p itself, kWalk steps:
// jump p^kWalk(x), the min of x .. p^(kWalk-1)(x) and its distance. A walk
// that comes back to x has seen its whole cycle: min and distance are final,
// and the jump stays at x (later rounds then change nothing). When
// n <= kWalk every walk comes back, and this is the final kernel.
__global__ void __launch_bounds__(kCycThreads) k_cyc_init(const __grid_constant__ CycleParams p) {
  __shared__ uint32_t s_warp[33];
  cyc_slots(p, s_warp, [&](uint64_t f, uint32_t r, uint64_t, int32_t x) -> uint32_t {
    const char *row = succ_row(p, r);
    int32_t y = x, mn = x, d = 0, L = 0;
    for (int t = 1; t <= kWalk; ++t) {
      y = succ_at(p, row, y);
      if (y == x) {
        L = t;
        break;
      }
      if (t < kWalk && y < mn) {
        mn = y;
        d = t;
      }
    }
    if (!p.last) p.ws[f] = L ? x : y;
    p.ws[p.region + f] = mn;
    p.ws[2 * p.region + f] = d;
    return mn == x ? (uint32_t)L : 0u;
  });
}

// Follows the jumps of the set read from slot x0 over `arity` windows of w
// slots: the min over them and its distance (the first occurrence: windows
// are visited in order and only a strictly smaller min replaces the best).
// Returns the slot of the last window's start; its jump ends the new window.
__device__ __forceinline__ int32_t cyc_jump(const int32_t *J, const int32_t *M, const int32_t *D,
                                            uint64_t row0, int32_t x0, int32_t w, int32_t arity, int32_t *bm,
                                            int32_t *bd) {
  int32_t cur = x0;
  int32_t m = M[row0 + x0], d = D[row0 + x0];
  for (int32_t a = 1; a < arity; ++a) {
    cur = J[row0 + cur];
    const int32_t mc = M[row0 + cur], dc = D[row0 + cur];
    if (mc < m) {
      m = mc;
      d = (int32_t)((int64_t)a * w + dc);
    }
  }
  *bm = m;
  *bd = d;
  return cur;
}

// One pointer-jumping round: windows of w slots become windows of arity x w
// (arity 2 to kArity: a few dependent gathers per slot cost less than a
// launch each). The last round also finds each leader's cycle length
// L = 1 + (distance of p[m]), which it computes for p[m] itself.
__global__ void __launch_bounds__(kCycThreads) k_cyc_round(const __grid_constant__ CycleParams p) {
  __shared__ uint32_t s_warp[33];
  cyc_slots(p, s_warp, [&](uint64_t f, uint32_t r, uint64_t row0, int32_t x) -> uint32_t {
    const int32_t *J = p.ws + 3 * p.src * p.region, *M = J + p.region, *D = J + 2 * p.region;
    int32_t *J2 = p.ws + 3 * (1 - p.src) * p.region, *M2 = J2 + p.region, *D2 = J2 + 2 * p.region;
    int32_t m2, d2;
    const int32_t cur = cyc_jump(J, M, D, row0, x, p.w, p.arity, &m2, &d2);
    M2[f] = m2;
    D2[f] = d2;
    if (!p.last) {
      J2[f] = J[row0 + cur];
    } else if (m2 == x) {
      const int32_t y = succ_at(p, succ_row(p, r), x);
      if (y == x) return 1u;
      int32_t my, dy;
      cyc_jump(J, M, D, row0, y, p.w, p.arity, &my, &dy);
      return (uint32_t)dy + 1u;
    }
    return 0u;
  });
}

// Many aggregates (more than kAggDirect): one block turns them, in place,
// into each block's prefix relative to the start of the row of its first
// slot (in [0, n]: every row's lengths add up to n).
__global__ void __launch_bounds__(kCycThreads) k_cyc_agg_scan(const __grid_constant__ CycleParams p) {
  __shared__ unsigned long long s_warp[33];
  if (cyc_enter(p)) return;
  uint32_t *agg = reinterpret_cast<uint32_t *>(p.ws + 3 * p.fin * p.region);
  unsigned long long carry = 0;
  for (uint32_t t0 = 0; t0 < p.nagg; t0 += blockDim.x) {
    const uint32_t t = t0 + threadIdx.x;
    const unsigned long long v = t < p.nagg ? agg[t] : 0u;
    unsigned long long total;
    const unsigned long long excl = cyc_block_scan<unsigned long long>(v, &total, s_warp);
    if (t < p.nagg) {
      const uint64_t rt = (uint64_t)t * kCycThreads / (uint64_t)p.n;
      agg[t] = (uint32_t)(carry + excl - rt * (uint64_t)p.n);
    }
    carry += total;
  }
}

// Every leader's base B (where its cycle starts in its row's layout):
// the prefix of the lengths before it, written over its min entry.
__global__ void __launch_bounds__(kCycThreads) k_cyc_bases(const __grid_constant__ CycleParams p) {
  __shared__ unsigned long long s_w64[33];
  __shared__ uint32_t s_w32[33];
  if (cyc_enter(p)) return;
  const uint32_t t = blockIdx.x;
  const uint64_t f0 = (uint64_t)t * blockDim.x;
  const uint64_t rt = f0 / (uint64_t)p.n;
  const uint32_t *agg = reinterpret_cast<const uint32_t *>(p.ws + 3 * p.fin * p.region);
  int64_t P;  // lengths before this block, from the start of row rt
  if (p.agg_scanned) {
    P = (int64_t)agg[t];
  } else {
    unsigned long long s = 0;
    for (uint32_t i = threadIdx.x; i < t; i += blockDim.x) s += agg[i];
    unsigned long long sum;
    cyc_block_scan<unsigned long long>(s, &sum, s_w64);
    P = (int64_t)(sum - rt * (uint64_t)p.n);
  }
  const uint64_t f = f0 + threadIdx.x;
  const bool valid = f < p.items;
  const uint32_t r = valid ? (uint32_t)(f / (uint64_t)p.n) : 0u;
  const uint64_t row0 = (uint64_t)r * (uint64_t)p.n;
  const int32_t x = (int32_t)(f - row0);
  int32_t *M = p.ws + (3 * p.fin + 1) * p.region;
  const int32_t *D = p.ws + (3 * p.fin + 2) * p.region;
  const bool leader = valid && M[f] == x;
  const uint32_t len = leader ? (uint32_t)D[row0 + succ_at(p, succ_row(p, r), x)] + 1u : 0u;
  uint32_t total;
  const uint32_t excl = cyc_block_scan<uint32_t>(len, &total, s_w32);
  if (leader) M[f] = (int32_t)(P + (int64_t)excl - (int64_t)(r - rt) * p.n);
}

// The cycles laid out: order[B(m) + e(x)] = x, written as ~x where e = 0
// (a cycle starts there).
__global__ void __launch_bounds__(kCycThreads) k_cyc_order(const __grid_constant__ CycleParams p) {
  if (cyc_enter(p)) return;
  const uint64_t f = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (f >= p.items) return;
  const uint64_t row0 = f - f % (uint64_t)p.n;
  const int32_t x = (int32_t)(f - row0);
  const int32_t *M = p.ws + (3 * p.fin + 1) * p.region, *D = M + p.region;
  int32_t *order = p.ws + 3 * (1 - p.fin) * p.region;
  const int32_t mx = M[f], e = D[f];
  const int32_t b = e == 0 ? mx : M[row0 + mx];
  order[row0 + b + e] = e == 0 ? ~x : x;
}

// ------------------------------------------------------------ data passes
// Pass 1 (k_perm_rotate): every row's layout is cut into chunks of kRotK
// positions; inside a chunk, each maximal run of one cycle (a segment) is
// rotated by one step in registers: new[s_e] = old[s_(e-1)] (forward: the
// segment's first slot takes its last slot's row), or new[s_e] = old[s_(e+1)]
// (inverse: the last slot takes the first's). A cycle inside one chunk is
// then done. A cycle over ns > 1 segments has one wrong slot per segment:
// its first (forward) or last (inverse), the "fix" slots F_0 .. F_(ns-1), and
// F_i holds what F_(i+1) (forward) or F_(i-1) (inverse) needs: the same shift
// over ns slots. Pass 2 does it with two all-parallel swap passes (k_apply,
// kind 1) over the target maps written here: in segment coordinates i,
// tau1: i <-> -1 - i (mod ns) (inverse: 1 - i), then tau2: i <-> -i; every
// other slot maps to itself.
struct RotateParams {
  CycleParams c;
  Lead lead;       // the buffers' rows
  uint64_t rows;   // buffer rows
  uint32_t nblk;   // chunks per row: ceil(n / kRotK)
  int32_t per_row;
  int32_t maps;    // this launch also writes the pass-2 target maps
  int32_t nbuf;
  BufDesc buf[kMaxBuf];
};

__device__ __forceinline__ int32_t layout_slot(int32_t v) { return v < 0 ? ~v : v; }

// Segment i's fix slot position: its first (forward) or last (inverse).
__device__ __forceinline__ int32_t fix_pos(int32_t i, int32_t b, int32_t L, int32_t ns, int32_t b0,
                                           bool inverse) {
  if (!inverse) return i == 0 ? b : (b0 + i) * kRotK;
  return i == ns - 1 ? b + L - 1 : (b0 + i + 1) * kRotK - 1;
}

__device__ __forceinline__ void fix_maps_item(const CycleParams &p, uint64_t f) {
  const uint32_t r = (uint32_t)(f / (uint64_t)p.n);
  const uint64_t row0 = (uint64_t)r * (uint64_t)p.n;
  const int32_t x = (int32_t)(f - row0);
  const int32_t *M = p.ws + (3 * p.fin + 1) * p.region, *D = M + p.region;
  const int32_t *order = p.ws + 3 * (1 - p.fin) * p.region + row0;
  int32_t *tm1 = p.ws + (3 * (1 - p.fin) + 1) * p.region, *tm2 = tm1 + p.region;
  const int32_t mx = M[f], e = D[f];
  const int32_t m = e == 0 ? x : mx;
  const int32_t b = e == 0 ? mx : M[row0 + mx];
  const int32_t L = D[row0 + succ_at(p, succ_row(p, r), m)] + 1;
  int32_t t1 = x, t2 = x;
  const int32_t q = b + e, b0 = b / kRotK;
  const int32_t ns = (b + L - 1) / kRotK - b0 + 1;
  const bool fix = p.inverse ? (e == L - 1 || q % kRotK == kRotK - 1) : (e == 0 || q % kRotK == 0);
  if (ns > 1 && fix) {
    const int32_t i = q / kRotK - b0;
    const int32_t i1 = p.inverse ? (ns + 1 - i) % ns : ns - 1 - i;
    const int32_t i2 = (ns - i) % ns;
    t1 = layout_slot(order[fix_pos(i1, b, L, ns, b0, p.inverse != 0)]);
    t2 = layout_slot(order[fix_pos(i2, b, L, ns, b0, p.inverse != 0)]);
  }
  tm1[f] = t1;
  tm2[f] = t2;
}

// One column (a T-sized piece at byte offset `off`) of one chunk: K
// independent loads, then the K stores of the rotated segments. st: segment
// starts, en: segment ends, mv: slots that change (segments of 2 or more).
template <class T>
__device__ __forceinline__ void rotate_column(char *base, int64_t ns, int64_t off, const int32_t (&x)[kRotK],
                                              uint32_t st, uint32_t en, uint32_t mv, bool inverse) {
  T v[kRotK];
#pragma unroll
  for (int j = 0; j < kRotK; ++j)
    if ((mv >> j) & 1u) v[j] = *reinterpret_cast<const T *>(base + (int64_t)x[j] * ns + off);
  if (!inverse) {
    T last = v[kRotK - 1];
#pragma unroll
    for (int j = kRotK - 1; j >= 0; --j) {
      if ((en >> j) & 1u) last = v[j];
      if ((mv >> j) & 1u)
        *reinterpret_cast<T *>(base + (int64_t)x[j] * ns + off) =
            ((st >> j) & 1u) ? last : v[j > 0 ? j - 1 : 0];
    }
  } else {
    T first = v[0];
#pragma unroll
    for (int j = 0; j < kRotK; ++j) {
      if ((st >> j) & 1u) first = v[j];
      if ((mv >> j) & 1u)
        *reinterpret_cast<T *>(base + (int64_t)x[j] * ns + off) =
            ((en >> j) & 1u) ? first : v[j < kRotK - 1 ? j + 1 : j];
    }
  }
}

// a / d and a % d, in 32 bits when the dividend allows.
__device__ __forceinline__ uint64_t divmod_u64(uint64_t a, uint32_t d, uint32_t *rem, bool small) {
  if (small) {
    const uint32_t q = (uint32_t)a / d;
    *rem = (uint32_t)a - q * d;
    return q;
  }
  const uint64_t q = a / d;
  *rem = (uint32_t)(a - q * d);
  return q;
}

// Work units (row, chunk, column), columns fastest: a warp reads a chunk's
// layout entries once (broadcast) and 16-byte pieces of the same rows.
template <int VW>
__device__ __forceinline__ void rotate_buffer(const RotateParams &p, const BufDesc &bd, uint64_t gtid,
                                              uint64_t step) {
  typedef typename VecOf<VW>::T V;
  const uint32_t C = bd.body + (uint32_t)(bd.head + bd.tail);
  if (C == 0) return;
  const uint64_t tasks = p.rows * (uint64_t)p.nblk;
  const uint64_t units = tasks * C;
  const bool small_u = units <= 0xFFFFFFFFull, small_t = tasks <= 0xFFFFFFFFull;
  const int32_t *order = p.c.ws + 3 * (1 - p.c.fin) * p.c.region;
  const int64_t tail0 = (int64_t)bd.head + (int64_t)bd.body * VW;
  const bool inverse = p.c.inverse != 0;
  for (uint64_t u = gtid; u < units; u += step) {
    uint32_t w, j;
    const uint64_t q = divmod_u64(u, C, &w, small_u);
    const uint32_t r = (uint32_t)divmod_u64(q, p.nblk, &j, small_t);
    const int64_t pos0 = (int64_t)j * kRotK;
    const int32_t *ord = order + (p.per_row ? (int64_t)r * p.c.n : 0) + pos0;
    const int64_t cnt = min((int64_t)kRotK, p.c.n - pos0);
    int32_t x[kRotK];
    uint32_t st = 1u;
#pragma unroll
    for (int i = 0; i < kRotK; ++i) {
      const int32_t v = i < cnt ? __ldg(ord + i) : -1;
      if (v < 0) st |= 1u << i;
      x[i] = layout_slot(v);
    }
    const uint32_t valid = (1u << cnt) - 1u;
    const uint32_t en = (st >> 1) | (1u << (kRotK - 1));
    const uint32_t mv = valid & ~(st & en);
    if (mv == 0) continue;
    uint32_t c[kMaxDims];
    row_coords(p.lead, r, c);
    char *base = bd.data + row_offset(p.lead, c, bd.lead);
    if (w < bd.body) {
      rotate_column<V>(base, bd.n_stride, (int64_t)bd.head + (int64_t)w * VW, x, st, en, mv, inverse);
    } else {
      const uint32_t k = w - bd.body;
      const int64_t off = k < (uint32_t)bd.head ? (int64_t)k : tail0 + (int64_t)(k - (uint32_t)bd.head);
      rotate_column<unsigned char>(base, bd.n_stride, off, x, st, en, mv, inverse);
    }
  }
}

// One launch per vector width: each instance keeps only its own loads live.
// Buffers of other widths in the group are left to their own launch.
template <int VW>
__global__ void __launch_bounds__(kRotThreads, 1) k_perm_rotate(const __grid_constant__ RotateParams p) {
  griddep_wait();
  if (call_aborted(p.c.words, p.c.token, p.c.nverdict)) return;
  const uint64_t gtid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
  if (p.maps)
    for (uint64_t f = gtid; f < p.c.items; f += step) fix_maps_item(p.c, f);
  for (int b = 0; b < p.nbuf; ++b) {
    const BufDesc &bd = p.buf[b];
    if (bd.vw == VW) rotate_buffer<VW>(p, bd, gtid, step);
  }
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
  StatusWords words;  // imoe_select.cu's status and verdict words (DevInfo::words)
};

__global__ void __launch_bounds__(kPermThreads) k_ordered_plan(const __grid_constant__ OrderedPlanParams p) {
  __shared__ int s_warp[33];
  if (call_aborted(p.words, p.token, p.nverdict)) return;
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
  StatusWords words;  // imoe_select.cu's status and verdict words (DevInfo::words)
};

__global__ void __launch_bounds__(kPermCheckThreads)
    k_group_check(const __grid_constant__ GroupCheckParams p) {
  const bool bad = any_out_of_range(p.lead, p.ids, p.items, (uint64_t)p.n, p.experts);
  block_verdict(p.words, p.token, bad, IMOE_ERR_INDEX_RANGE);
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
  StatusWords words;  // imoe_select.cu's status and verdict words (DevInfo::words)
};

// One block of kPermThreads per row: a stable counting sort. Shared memory:
// base[E + 1] (running first slot of each expert), then per-warp counts
// wc[E][33] (padded) of the current tile of kPermThreads tokens. offsets[e]
// is expert e's end (its first slot plus its count), grouped_mm's `offs`.
__global__ void __launch_bounds__(kPermThreads) k_group(const __grid_constant__ GroupParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ int s_warp[33];
  int *base = reinterpret_cast<int *>(dsm);
  int *wc = base + p.experts + 1;
  if (call_aborted(p.words, p.token, p.nverdict)) return;
  const uint32_t r = blockIdx.x;
  const int64_t n = p.n;
  const int E = p.experts;
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
    if (e <= E) base[e] = carry + excl;
    if (e < E) {
      store_index(orow + (int64_t)e * p.offsets.n_stride, p.offsets.dtype, p.offsets.aligned != 0,
                  carry + excl + cnt);
    }
    carry += total;
  }
  __syncthreads();
  const auto key = [&](int64_t t) { return (int)load_index(irow + t * p.ids.n_stride, p.ids.dtype, ial); };
  stable_places(n, E, base, wc, key, [&](int64_t t, int e, int pos) {
    if (e < 0) return;
    plan[pos] = (int32_t)t;
    if (prow) store_index(prow + (int64_t)pos * p.perm.n_stride, p.perm.dtype, p.perm.aligned != 0, t);
  });
}

// ------------------------------------------------------------ host side
namespace {

typedef void (*RotateKernel)(RotateParams);

RotateKernel rotate_kernel(int vw) {
  switch (vw) {
    case 16: return k_perm_rotate<16>;
    case 8: return k_perm_rotate<8>;
    case 4: return k_perm_rotate<4>;
    case 2: return k_perm_rotate<2>;
    default: return k_perm_rotate<1>;
  }
}

// Blocks of k_perm_rotate<vw> resident per multiprocessor, once per device.
int rotate_blocks_per_sm(const DevInfo *di, int vw) {
  static std::atomic<int> cache[kMaxDevices][5];
  const ptrdiff_t d = di - g_dev;
  const int k = vw >= 16 ? 4 : vw >= 8 ? 3 : vw >= 4 ? 2 : vw >= 2 ? 1 : 0;
  const bool cached = d >= 0 && d < kMaxDevices;
  int v = cached ? cache[d][k].load(std::memory_order_relaxed) : 0;
  if (v > 0) return v;
  int nb = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, rotate_kernel(vw), kRotThreads, 0) != cudaSuccess ||
      nb < 1) {
    (void)cudaGetLastError();
    nb = 1;
  }
  if (cached) cache[d][k].store(nb, std::memory_order_relaxed);
  return nb;
}

// The pointer-jumping rounds of a row of n slots: k_cyc_init covers a window
// of kWalk slots; round k multiplies it by arity[k] (2 to kArity), until
// the window covers the row.
struct CyclePlan {
  int rounds;
  int arity[32];
};

CyclePlan plan_cycles(int64_t n) {
  CyclePlan c;
  c.rounds = 0;
  for (int64_t window = kWalk; window < n; ++c.rounds) {
    int a = 2;
    while (a < kArity && window * a < n) a <<= 1;
    c.arity[c.rounds] = a;
    window *= a;
  }
  return c;
}

}  // namespace

// The permutation `succ` ([plan rows, n]) applied to buffers [buf_st0, ...)
// of pl, after the validation of `token`: by slices (imoe_slices.cu) when
// they fit, else the cycle kernels and the data passes.
imoe_status launch_cycles_and_swaps(const char *fn, const imoe_view *buffers, int32_t num_buffers,
                                    const CallRows &pl, size_t buf_st0, const InView &succ, bool per_row,
                                    int64_t n, bool inverse, int32_t *ws, uint32_t token, int nverdict,
                                    DevInfo *di, cudaStream_t st, imoe_error *err, int64_t written) {
  if (n < 2 || num_buffers <= 0) return IMOE_OK;  // nothing can move
  if (written < 0 || written > n || inverse) written = n;
  bool done = false;
  imoe_status sr = launch_slices(fn, buffers, num_buffers, pl, buf_st0, succ, per_row, n, written, inverse,
                                 token, nverdict, di, st, err, &done);
  if (sr != IMOE_OK || done) return sr;
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
  cp.words = di->words;
  const uint64_t flat = (cp.items + kCycThreads - 1) / kCycThreads;
  if (flat > 0x7FFFFFFFull || rows > 0x7FFFFFFFull)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  const CyclePlan cyc = plan_cycles(n);
  const int rounds = cyc.rounds;
  const int *arity = cyc.arity;
  const bool pdl = di->cc_major >= 9;
  cp.last = rounds == 0;
  cp.fin = 0;
  cudaError_t e = launch(k_cyc_init, shape((unsigned)flat, kCycThreads, 0, pdl), st, cp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_cyc_init", e);
  int s = 0;
  int64_t window = kWalk;
  for (int k = 0; k < rounds; ++k) {
    cp.src = s;
    cp.w = (int32_t)window;
    cp.arity = arity[k];
    cp.last = k == rounds - 1;
    cp.fin = 1 - s;
    e = launch(k_cyc_round, shape((unsigned)flat, kCycThreads, 0, pdl), st, cp);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_cyc_round", e);
    s = 1 - s;
    window *= arity[k];
  }
  cp.last = 0;
  cp.fin = s;
  cp.nagg = (uint32_t)flat;
  cp.agg_scanned = flat > kAggDirect;
  if (cp.agg_scanned && (e = launch(k_cyc_agg_scan, shape(1u, kCycThreads, 0, pdl), st, cp)) != cudaSuccess)
    return cuda_fail(err, fn, "launch of k_cyc_agg_scan", e);
  if ((e = launch(k_cyc_bases, shape((unsigned)flat, kCycThreads, 0, pdl), st, cp)) != cudaSuccess)
    return cuda_fail(err, fn, "launch of k_cyc_bases", e);
  if ((e = launch(k_cyc_order, shape((unsigned)flat, kCycThreads, 0, pdl), st, cp)) != cudaSuccess)
    return cuda_fail(err, fn, "launch of k_cyc_order", e);
  // pass 1: rotations inside chunks (and the pass-2 maps), up to kMaxBuf buffers a launch
  RotateParams rp;
  memset(&rp, 0, sizeof rp);
  rp.c = cp;
  rp.lead = pl.lead;
  rp.rows = pl.R;
  rp.nblk = (uint32_t)((n + kRotK - 1) / kRotK);
  rp.per_row = per_row ? 1 : 0;
  bool maps = true;
  for (int g = 0; g < num_buffers; g += kMaxBuf) {
    rp.nbuf = std::min(kMaxBuf, num_buffers - g);
    uint64_t work[17] = {0};  // by vector width
    for (int b = 0; b < rp.nbuf; ++b) {
      rp.buf[b] = buf_desc(&buffers[g + b], pl.st[buf_st0 + g + b], pl.lead.nd);
      const uint64_t cols = rp.buf[b].body + (uint64_t)(rp.buf[b].head + rp.buf[b].tail);
      work[rp.buf[b].vw] += pl.R * (uint64_t)rp.nblk * cols;
    }
    for (int vw = 16; vw >= 1; vw >>= 1) {
      bool present = false;
      for (int b = 0; b < rp.nbuf; ++b) present = present || rp.buf[b].vw == vw;
      if (!present) continue;
      rp.maps = maps ? 1 : 0;
      const uint64_t need = std::max(work[vw], maps ? cp.items : 0);
      maps = false;
      const uint64_t cap = (uint64_t)di->sms * (uint64_t)rotate_blocks_per_sm(di, vw);
      const uint64_t grid = std::max<uint64_t>(1, std::min(cap, (need + kRotThreads - 1) / kRotThreads));
      if ((e = launch(rotate_kernel(vw), shape((unsigned)grid, kRotThreads, 0, pdl), st, rp)) != cudaSuccess)
        return cuda_fail(err, fn, "launch of k_perm_rotate", e);
    }
  }
  // pass 2: the fix slots, two swap passes
  const int32_t *tm1 = ws + (3 * (1 - s) + 1) * cp.region;
  const int32_t *tm2 = ws + (3 * (1 - s) + 2) * cp.region;
  imoe_status r =
      launch_apply_groups(fn, buffers, 0, num_buffers, pl, buf_st0, ws_view(tm1, pl.lead, n, per_row), 1, n,
                          true, token, nverdict, false, di, st, err);
  if (r != IMOE_OK) return r;
  return launch_apply_groups(fn, buffers, 0, num_buffers, pl, buf_st0, ws_view(tm2, pl.lead, n, per_row), 1,
                             n, true, token, nverdict, false, di, st, err);
}

namespace {

int check_grid(uint64_t items) {
  const uint64_t want = (items + 2047) / 2048;
  return (int)std::max<uint64_t>(1, std::min<uint64_t>(want, kVerdicts));
}

// The start shared by a permutation and an ordered apply: the device and
// stream, N < 2^31, the plan over the map (perm or indices) and the buffers,
// the map's rows (1 when it is shared by every row) and the workspace check.
// c->empty: nothing to do (no rows or no slots).
struct PermCall {
  DevInfo *di;
  cudaStream_t st;
  CallRows pl;
  int64_t n;
  bool per_row;
  uint64_t rows;
  bool empty;
};

imoe_status start_perm_call(const char *fn, const imoe_view *buffers, int32_t num_buffers,
                            const imoe_view *map, imoe_plan_kind kind, int32_t *workspace,
                            int64_t workspace_elems, const imoe_exec *exec, imoe_error *err,
                            DeviceGuard *guard, PermCall *c) {
  c->di = nullptr;
  c->empty = true;
  imoe_status s = enter(exec, fn, err, guard, &c->di);
  if (s != IMOE_OK) return s;
  c->st = static_cast<cudaStream_t>(exec->stream);
  c->n = buffers[0].n;
  if (c->n >= 0x7FFFFFFFLL)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: N = %lld slots: the CUDA path takes N < 2^31", fn,
                (long long)c->n);
  std::vector<const imoe_view *> views;
  views.push_back(map);
  for (int b = 0; b < num_buffers; ++b) views.push_back(&buffers[b]);
  if (!merge_rows(&buffers[0], views, &c->pl))
    return fail(err, IMOE_ERR_ARGUMENT, "%s: more than 2^32 - 1 rows", fn);
  c->per_row = map->lead_ndim > 0;
  c->rows = c->per_row ? c->pl.R : 1u;
  s = check_workspace(fn, workspace, workspace_elems,
                      imoe_plan_workspace_elems(kind, IMOE_DEVICE_CUDA, (int64_t)c->rows, c->n), err);
  if (s != IMOE_OK) return s;
  c->empty = c->pl.R == 0 || c->n == 0;
  return IMOE_OK;
}

// The checks of m entries per row of `map` (values in [0, N), then distinct):
// k_perm_range, then k_perm_unique (launched early when pdl_unique) on
// *nverdict blocks; *cp comes back with the second's token.
imoe_status launch_perm_checks(const char *fn, const PermCall &c, const imoe_view *map, int64_t m,
                               int32_t *workspace, bool pdl_unique, PermCheckParams *cp, int *nverdict,
                               imoe_error *err) {
  memset(cp, 0, sizeof *cp);
  cp->lead = c.pl.lead;
  if (!c.per_row) memset(&cp->lead, 0, sizeof cp->lead);
  cp->n = c.n;
  cp->m = m;
  cp->items = c.rows * (uint64_t)m;
  cp->scatter_items = c.rows * (uint64_t)c.n;
  cp->perm = in_view(map, c.pl.st[0], c.pl.lead.nd);
  cp->scatter = workspace + 3 * (int64_t)c.rows * c.n;
  const int grid = check_grid(std::max(cp->items, cp->scatter_items));
  cp->token = next_token();
  cp->words = c.di->words;
  cudaError_t e = launch(k_perm_range, shape((unsigned)grid, kPermCheckThreads, 0, false), c.st, *cp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_perm_range", e);
  cp->prev_token = cp->token;
  cp->prev_nverdict = grid;
  cp->token = next_token();
  e = launch(k_perm_unique, shape((unsigned)grid, kPermCheckThreads, 0, pdl_unique), c.st, *cp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_perm_unique", e);
  *nverdict = grid;
  return IMOE_OK;
}

}  // namespace

}  // namespace imoe_cu

using namespace imoe_cu;

extern "C" {

imoe_status imoe_cuda_permute(const imoe_view *buffers, int32_t num_buffers, const imoe_view *perm,
                              int32_t inverse, int32_t *workspace, int64_t workspace_elems,
                              const imoe_exec *exec, imoe_error *err) {
  const char *fn = "imoe_cuda_permute";
  DeviceGuard guard;
  PermCall c;
  imoe_status s = start_perm_call(fn, buffers, num_buffers, perm, IMOE_PLAN_PERMUTE, workspace,
                                  workspace_elems, exec, err, &guard, &c);
  if (s != IMOE_OK || c.empty) return s;
  PermCheckParams cp;
  int grid;
  s = launch_perm_checks(fn, c, perm, c.n, workspace, c.di->cc_major >= 9, &cp, &grid, err);
  if (s != IMOE_OK) return s;
  return launch_cycles_and_swaps(fn, buffers, num_buffers, c.pl, 1, cp.perm, c.per_row, c.n, inverse != 0,
                                 workspace, cp.token, grid, c.di, c.st, err);
}

imoe_status imoe_cuda_apply_ordered(const imoe_view *buffers, int32_t num_buffers, const imoe_view *indices,
                                    int32_t restore, int32_t *workspace, int64_t workspace_elems,
                                    const imoe_exec *exec, imoe_error *err) {
  const char *fn = restore ? "imoe_cuda_restore_ordered" : "imoe_cuda_apply_ordered";
  DeviceGuard guard;
  PermCall c;
  imoe_status s = start_perm_call(fn, buffers, num_buffers, indices, IMOE_PLAN_ORDERED, workspace,
                                  workspace_elems, exec, err, &guard, &c);
  if (s != IMOE_OK || c.empty) return s;
  const int64_t kept = indices->n;
  if (c.rows > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  // the indices: in [0, N), then distinct (IMOE_ERR_BAD_MAP, as the CPU core)
  PermCheckParams cp;
  int nverdict;
  s = launch_perm_checks(fn, c, indices, kept, workspace, false, &cp, &nverdict, err);
  if (s != IMOE_OK) return s;
  const uint32_t token = cp.token;
  OrderedPlanParams op;
  memset(&op, 0, sizeof op);
  op.lead = cp.lead;
  op.n = c.n;
  op.kept = kept;
  op.region = (int64_t)c.rows * c.n;
  op.idx = cp.perm;
  op.ws = workspace;
  op.token = token;
  op.nverdict = nverdict;
  op.words = c.di->words;
  cudaError_t e = launch(k_ordered_plan, shape((unsigned)c.rows, kPermThreads, 0, false), c.st, op);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_ordered_plan", e);
  const InView plan = ws_view(workspace + 6 * op.region, c.pl.lead, c.n, c.per_row);
  return launch_cycles_and_swaps(fn, buffers, num_buffers, c.pl, 1, plan, c.per_row, c.n, restore != 0,
                                 workspace, token, nverdict, c.di, c.st, err);
}

imoe_status imoe_cuda_group_by_expert(const imoe_view *buffers, int32_t num_buffers,
                                      const imoe_view *expert_ids, int64_t num_experts,
                                      const imoe_view *out_offsets, const imoe_view *out_perm,
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
    return fail(err, IMOE_ERR_UNSUPPORTED, "%s: num_experts = %lld: the CUDA path takes at most %d experts",
                fn, (long long)num_experts, kGroupMaxExperts);
  // views: 0 ids, 1.. buffers, then offsets and perm
  std::vector<const imoe_view *> views;
  views.push_back(expert_ids);
  for (int b = 0; b < num_buffers; ++b) views.push_back(&buffers[b]);
  views.push_back(out_offsets);
  views.push_back(out_perm);
  CallRows pl;
  if (!merge_rows(&buffers[0], views, &pl))
    return fail(err, IMOE_ERR_ARGUMENT, "%s: more than 2^32 - 1 rows", fn);
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
  gc.words = di->words;
  cudaError_t e = launch(k_group_check, shape((unsigned)grid, kPermCheckThreads, 0, false), st, gc);
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
  gp.words = di->words;
  e = launch(k_group, shape((unsigned)rows, kPermThreads, smem, false), st, gp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_group", e);
  const InView plan = ws_view(workspace + 6 * gp.region, pl.lead, n, true);
  return launch_cycles_and_swaps(fn, buffers, num_buffers, pl, 1, plan, true, n, false, workspace, gc.token,
                                 grid, di, st, err);
}

}  // extern "C"
