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
constexpr int kPermIlp = 8;         // slots per thread with loads in flight together
constexpr int kCycleThreads = 512;  // k_perm_cycles block (128 registers per thread for the ILP)
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
struct PermCycleParams {
  Lead lead;        // of the plan rows (per-row) or empty (shared: one row)
  int64_t n;
  int64_t region;   // plan_rows x n
  InView succ;      // the permutation p (caller's view or workspace region 6)
  int32_t *ws;
  int32_t rounds;   // ceil(log2 n)
  int32_t inverse;
  uint32_t token;
  int32_t nverdict;
};

// One block per plan row: writes the two target maps tau1 (region
// 3 * (1 - f) + 1) and tau2 (region 3 * (1 - f) + 2), f = rounds & 1.
__global__ void __launch_bounds__(kCycleThreads) k_perm_cycles(const __grid_constant__ PermCycleParams p) {
  __shared__ int s_warp[33];
  if (call_aborted(p.token, p.nverdict)) return;
  const uint32_t r = blockIdx.x;
  const int n = (int)p.n;  // < 2^31 (host check)
  const int tid = threadIdx.x, nt = blockDim.x;
  uint32_t c[kMaxDims];
  row_coords(p.lead, r, c);
  const char *srow = p.succ.data + row_offset(p.lead, c, p.succ.lead);
  const bool al = p.succ.aligned != 0;
  const int64_t sst = p.succ.n_stride;
  const int sdt = p.succ.dtype;
  int32_t *const base = p.ws + (int64_t)r * n;
  // set s: jump region 3s, min 3s+1, distance 3s+2
  for (int x = tid; x < n; x += nt) {
    base[x] = (int32_t)load_index(srow + x * sst, sdt, al);
    base[p.region + x] = x;
    base[2 * p.region + x] = 0;
  }
  __syncthreads();
  // Every step is a dependent gather from L2: each thread keeps kPermIlp
  // slots' loads in flight before it stores.
  int s = 0;
  int w = 1;
  for (int k = 0; k < p.rounds; ++k, w <<= 1) {
    const int32_t *J = base + 3 * s * p.region, *M = J + p.region, *D = J + 2 * p.region;
    int32_t *J2 = base + 3 * (1 - s) * p.region, *M2 = J2 + p.region, *D2 = J2 + 2 * p.region;
    for (int x0 = 0; x0 < n; x0 += nt * kPermIlp) {
      int32_t j[kPermIlp], mx[kPermIlp], dx[kPermIlp], mj[kPermIlp], dj[kPermIlp], jj[kPermIlp];
#pragma unroll
      for (int u = 0; u < kPermIlp; ++u) {
        const int x = x0 + u * nt + tid;
        if (x < n) {
          j[u] = J[x];
          mx[u] = M[x];
          dx[u] = D[x];
        }
      }
#pragma unroll
      for (int u = 0; u < kPermIlp; ++u) {
        if (x0 + u * nt + tid < n) {
          mj[u] = M[j[u]];
          dj[u] = D[j[u]];
          jj[u] = J[j[u]];
        }
      }
#pragma unroll
      for (int u = 0; u < kPermIlp; ++u) {
        const int x = x0 + u * nt + tid;
        if (x < n) {
          const bool better = mj[u] < mx[u];
          M2[x] = better ? mj[u] : mx[u];
          D2[x] = better ? w + dj[u] : dx[u];
          J2[x] = jj[u];
        }
      }
    }
    __syncthreads();
    s = 1 - s;
  }
  const int32_t *M = base + (3 * s + 1) * p.region, *D = base + (3 * s + 2) * p.region;
  int32_t *B = base + 3 * s * p.region, *order = base + 3 * (1 - s) * p.region;
  int32_t *tm1 = order + p.region, *tm2 = order + 2 * p.region;
  // base offsets of the cycles: an exclusive scan of the leaders' lengths,
  // kPermIlp consecutive slots per thread
  int carry = 0;
  for (int x0 = 0; x0 < n; x0 += nt * kPermIlp) {
    const int xs = x0 + tid * kPermIlp;
    int len[kPermIlp];
#pragma unroll
    for (int u = 0; u < kPermIlp; ++u) {
      const int x = xs + u;
      len[u] = 0;
      if (x < n && M[x] == x) len[u] = -1 - (int)load_index(srow + x * sst, sdt, al);  // -1 - p[x]
    }
    int sum = 0;
#pragma unroll
    for (int u = 0; u < kPermIlp; ++u) {
      if (len[u] < 0) len[u] = D[-1 - len[u]] + 1;
      sum += len[u];
    }
    int total;
    int run = carry + perm_block_scan(sum, &total, s_warp);
#pragma unroll
    for (int u = 0; u < kPermIlp; ++u) {
      if (xs + u < n) B[xs + u] = run;
      run += len[u];
    }
    carry += total;
  }
  __syncthreads();
  for (int x0 = 0; x0 < n; x0 += nt * kPermIlp) {
    int32_t m[kPermIlp], e[kPermIlp];
#pragma unroll
    for (int u = 0; u < kPermIlp; ++u) {
      const int x = x0 + u * nt + tid;
      if (x < n) {
        m[u] = M[x];
        e[u] = D[x];
      }
    }
#pragma unroll
    for (int u = 0; u < kPermIlp; ++u) {
      const int x = x0 + u * nt + tid;
      if (x < n) order[B[m[u]] + e[u]] = x;
    }
  }
  __syncthreads();
  for (int x0 = 0; x0 < n; x0 += nt * kPermIlp) {
    int32_t m[kPermIlp], e[kPermIlp], b[kPermIlp], pm[kPermIlp];
#pragma unroll
    for (int u = 0; u < kPermIlp; ++u) {
      const int x = x0 + u * nt + tid;
      if (x < n) {
        m[u] = M[x];
        e[u] = D[x];
      }
    }
#pragma unroll
    for (int u = 0; u < kPermIlp; ++u) {
      if (x0 + u * nt + tid < n) {
        pm[u] = (int32_t)load_index(srow + (int64_t)m[u] * sst, sdt, al);
        b[u] = B[m[u]];
      }
    }
#pragma unroll
    for (int u = 0; u < kPermIlp; ++u) {
      const int x = x0 + u * nt + tid;
      if (x < n) {
        const int32_t L = D[pm[u]] + 1;
        const int32_t e1 = p.inverse ? (L + 1 - e[u]) % L : L - 1 - e[u];
        const int32_t e2 = (L - e[u]) % L;
        tm1[x] = order[b[u] + e1];
        tm2[x] = order[b[u] + e2];
      }
    }
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

// The cycle kernel and the two swap passes: buffers [buf_st0, ...) of pl,
// the permutation `succ` ([plan rows, n]), after the validation of `token`.
imoe_status launch_cycles_and_swaps(const char *fn, const imoe_view *buffers, int32_t num_buffers, const Plan &pl,
                                    size_t buf_st0, const InView &succ, bool per_row, int64_t n, bool inverse,
                                    int32_t *ws, uint32_t token, int nverdict, DevInfo *di, cudaStream_t st,
                                    imoe_error *err) {
  if (n < 2) return IMOE_OK;  // nothing can move
  const uint64_t rows = per_row ? pl.R : 1u;
  if (rows > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  Lead plead = pl.lead;
  if (!per_row) memset(&plead, 0, sizeof plead);
  PermCycleParams cp;
  memset(&cp, 0, sizeof cp);
  cp.lead = plead;
  cp.n = n;
  cp.region = (int64_t)rows * n;
  cp.succ = succ;
  cp.ws = ws;
  cp.rounds = perm_rounds(n);
  cp.inverse = inverse ? 1 : 0;
  cp.token = token;
  cp.nverdict = nverdict;
  cudaError_t e = launch(k_perm_cycles, (unsigned)rows, kCycleThreads, 0, st, false, cp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_perm_cycles", e);
  const int f = cp.rounds & 1;
  const int32_t *tm1 = ws + (3 * (1 - f) + 1) * cp.region;
  const int32_t *tm2 = ws + (3 * (1 - f) + 2) * cp.region;
  imoe_status s = launch_apply_groups(fn, buffers, 0, num_buffers, pl, buf_st0, ws_view(tm1, pl.lead, n, per_row),
                                      1, n, true, token, nverdict, false, di, st, err);
  if (s != IMOE_OK) return s;
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
