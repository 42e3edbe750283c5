// imoe_paged.cu: imoe_paged_apply_target_map on the device (docs/cuda-design.md,
// "Paged pools"). Its kernels take the status and verdict words (imoe_select.cu's
// module memory) as their last parameter.
//
// Three kernels on the caller's stream:
//   k_paged_check  read-only on the caller's data: per (sequence, run of
//       table entries), every map entry of every row of the sequence (range,
//       then involution), which entries hold a moved slot (touched), and the
//       block of each touched entry (range). The smallest error key
//       (sequence, row, kind) of the block goes to the workspace, so that the
//       CPU core's precedence is kept exactly; each touched entry e writes
//       flag[e] = its block and claim[block] = e (plain stores: no clearing,
//       no atomics, a graph replay starts from its own writes).
//   k_paged_dups   after k_paged_check: when that found an error, records the
//       smallest key's status; otherwise a touched entry whose block's claim
//       is not itself shares that block with another touched entry
//       (IMOE_ERR_INDEX_DUPLICATE). Both kernels write verdict words (k_paged_check
//       [0, n1), k_paged_dups [n1, n1 + n2)).
//   k_paged_apply  per (row, segment of slots): gathers the 2-cycles x < t of
//       the segment with both slots' (block, offset) into shared memory, reads
//       the verdicts and moves (or swaps) every buffer's rows, 16-byte
//       vectors where the pool's strides and base allow (BufDesc head / body /
//       tail as in k_apply).
// Workspace (int32): claim [num_blocks] | flag [S x max_blocks] | error keys
// [2 x 256].
#include <cuda_runtime.h>
#include <string.h>

#include <algorithm>

#include "imoe_device.cuh"
#include "imoe_launch.cuh"

namespace imoe_cu {

constexpr int kPagedThreads = 256;
constexpr int kPagedMaxEntries = 1024;  // table entries per k_paged_check item
constexpr int kPagedCheckGrid = 128;     // k_paged_check and k_paged_dups: at most this many blocks each
constexpr uint32_t kPagedSegMax = 2048;  // slots per k_paged_apply block

struct PagedCheckParams {
  Lead inner;  // the rows of one sequence (the pools' lead axes after the block axis)
  Strides map_inner;
  int64_t map_seq;  // byte stride of the map between sequences
  InView map;       // n_stride, dtype, aligned, data (lead unused)
  InView tab;       // lead.s[0]: byte stride between sequences
  int64_t N, bs, num_blocks;
  uint32_t per_seq, jn, J, ipseq, items;
  int32_t *claim, *flag;
  uint32_t *keys;
  uint32_t token;
  StatusWords words;  // imoe_select.cu's status and verdict words (DevInfo::words)
};

__device__ __forceinline__ unsigned long long block_min_u64(unsigned long long v, unsigned long long *tmp) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long w = __shfl_down_sync(0xFFFFFFFFu, v, o);
    v = w < v ? w : v;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) tmp[warp] = v;
  __syncthreads();
  unsigned long long m = ~0ull;
  for (int i = 0; i < nw; ++i) m = tmp[i] < m ? tmp[i] : m;
  __syncthreads();
  return m;
}

__global__ void __launch_bounds__(kPagedThreads) k_paged_check(const __grid_constant__ PagedCheckParams p) {
  __shared__ uint32_t s_minrow[kPagedMaxEntries];
  __shared__ unsigned long long s_tmp[kPagedThreads / 32];
  griddep_launch_dependents();
  const int tid = threadIdx.x, nt = blockDim.x;
  const bool mal = p.map.aligned != 0, tal = p.tab.aligned != 0;
  unsigned long long best = ~0ull;  // (row of the whole map) * 3 + kind
  for (uint32_t it = blockIdx.x; it < p.items; it += gridDim.x) {
    const uint32_t s = it / p.ipseq;
    const uint32_t jb = (it - s * p.ipseq) * p.J;
    const uint32_t jc = min(p.J, p.jn - jb);
    const int64_t x0 = (int64_t)jb * p.bs, x1 = min((int64_t)(jb + jc) * p.bs, p.N);
    const uint64_t span = (uint64_t)(x1 - x0);
    for (uint32_t j = tid; j < jc; j += nt) s_minrow[j] = 0xFFFFFFFFu;
    __syncthreads();
    const char *mseq = p.map.data + (int64_t)s * p.map_seq;
    const uint64_t total = (uint64_t)p.per_seq * span;
    for (uint64_t u = tid; u < total; u += nt) {
      const uint32_t r = (uint32_t)(u / span);
      const int64_t x = x0 + (int64_t)(u - (uint64_t)r * span);
      uint32_t c[kMaxDims];
      row_coords(p.inner, r, c);
      const char *row = mseq + row_offset(p.inner, c, p.map_inner);
      const int64_t t = load_index(row + x * p.map.n_stride, p.map.dtype, mal);
      const unsigned long long rk = ((unsigned long long)s * p.per_seq + r) * 3ull;
      if (t < 0 || t >= p.N) {
        best = min(best, rk);
      } else {
        const int64_t back = load_index(row + t * p.map.n_stride, p.map.dtype, mal);
        if (back != x) best = min(best, rk + 1);
      }
      if (t != x) atomicMin(&s_minrow[(uint32_t)(x / p.bs) - jb], r);
    }
    __syncthreads();
    for (uint32_t jl = tid; jl < jc; jl += nt) {
      const uint32_t j = jb + jl;
      const int64_t e = (int64_t)s * p.jn + j;
      int32_t f = -1;
      const uint32_t mr = s_minrow[jl];
      if (mr != 0xFFFFFFFFu) {
        const int64_t blk = load_index(
            p.tab.data + (int64_t)s * p.tab.lead.s[0] + (int64_t)j * p.tab.n_stride, p.tab.dtype, tal);
        if (blk < 0 || blk >= p.num_blocks) {
          best = min(best, ((unsigned long long)s * p.per_seq + mr) * 3ull + 2ull);
        } else {
          f = (int32_t)blk;
          p.claim[blk] = (int32_t)e;
        }
      }
      p.flag[e] = f;
    }
    __syncthreads();  // s_minrow is reset for the next item
  }
  best = block_min_u64(best, s_tmp);
  if (tid == 0) {
    p.keys[2 * blockIdx.x] = (uint32_t)best;
    p.keys[2 * blockIdx.x + 1] = (uint32_t)(best >> 32);
    write_verdict(p.words, p.token, best != ~0ull);
  }
}

struct PagedDupParams {
  const int32_t *claim, *flag;
  const uint32_t *keys;
  uint64_t entries;  // S x jn
  int32_t n1;        // k_paged_check's blocks (its verdict words and keys)
  int32_t pdl;
  uint32_t token;
  StatusWords words;  // imoe_select.cu's status and verdict words (DevInfo::words)
};

__global__ void __launch_bounds__(kPagedThreads) k_paged_dups(const __grid_constant__ PagedDupParams p) {
  __shared__ unsigned long long s_tmp[kPagedThreads / 32];
  if (p.pdl) griddep_wait();
  griddep_launch_dependents();
  const int tid = threadIdx.x;
  if (call_aborted(p.words, p.token, p.n1)) {
    // k_paged_check found an error: report the first one, as the CPU core does
    if (blockIdx.x == 0) {
      unsigned long long k = ~0ull;
      if (tid < p.n1)
        k = (unsigned long long)__ldcg(&p.keys[2 * tid]) |
            ((unsigned long long)__ldcg(&p.keys[2 * tid + 1]) << 32);
      k = block_min_u64(k, s_tmp);
      if (tid == 0 && k != ~0ull)
        record_status(p.words, k % 3ull == 1ull ? IMOE_ERR_BAD_MAP : IMOE_ERR_INDEX_RANGE);
    }
    if (tid == 0) p.words.verdict[p.token % kSlots][p.n1 + blockIdx.x] = 0u;
    return;
  }
  bool bad = false;
  for (uint64_t e = (uint64_t)blockIdx.x * blockDim.x + tid; e < p.entries;
       e += (uint64_t)gridDim.x * blockDim.x) {
    const int32_t b = __ldcg(&p.flag[e]);
    if (b >= 0 && __ldcg(&p.claim[b]) != (int32_t)e) bad = true;
  }
  bad = __syncthreads_or(bad) != 0;
  if (tid == 0) {
    if (bad) record_status(p.words, IMOE_ERR_INDEX_DUPLICATE);
    p.words.verdict[p.token % kSlots][p.n1 + blockIdx.x] = bad ? p.token : 0u;
  }
}

struct PagedApplyParams {
  Lead inner;
  Strides map_inner;
  int64_t map_seq;
  InView map;
  InView tab;
  int64_t N, bs;
  uint32_t per_seq, seg, nseg;
  int32_t swap, nbuf, pdl, nverdict;
  uint32_t token;
  int64_t bstride[kMaxBuf];  // each pool's byte stride between blocks
  BufDesc buf[kMaxBuf];      // lead: the pool's strides of the inner axes
  StatusWords words;  // imoe_select.cu's status and verdict words (DevInfo::words)
};

// Pair q of the block: (dst block, dst offset, src block, src offset) in a
// pool whose blocks are bstr bytes apart.
struct PagedPairs {
  const int4 *pairs;
  int64_t bstr;
  __device__ __forceinline__ longlong2 operator()(uint32_t q, int64_t ns) const {
    const int4 pr = pairs[q];
    return make_longlong2((int64_t)pr.x * bstr + (int64_t)pr.y * ns,
                          (int64_t)pr.z * bstr + (int64_t)pr.w * ns);
  }
};

__global__ void __launch_bounds__(kPagedThreads) k_paged_apply(const __grid_constant__ PagedApplyParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  int4 *s_pairs = reinterpret_cast<int4 *>(dsm);
  __shared__ int s_n;
  const uint32_t row = blockIdx.x / p.nseg, sg = blockIdx.x - row * p.nseg;
  const uint32_t s = row / p.per_seq, r = row - s * p.per_seq;
  const int64_t i0 = (int64_t)sg * p.seg, i1 = min(i0 + (int64_t)p.seg, p.N);
  uint32_t c[kMaxDims];
  row_coords(p.inner, r, c);
  const char *mrow = p.map.data + (int64_t)s * p.map_seq + row_offset(p.inner, c, p.map_inner);
  const char *trow = p.tab.data + (int64_t)s * p.tab.lead.s[0];
  const bool mal = p.map.aligned != 0, tal = p.tab.aligned != 0;
  if (threadIdx.x == 0) s_n = 0;
  __syncthreads();
  // Read-only gathering (before the verdicts: it overlaps the checks under
  // PDL). An invalid map is never followed outside [0, N): such a call is
  // aborted below anyway.
  for (int64_t x = i0 + threadIdx.x; x < i1; x += blockDim.x) {
    const int64_t t = load_index(mrow + x * p.map.n_stride, p.map.dtype, mal);
    if (t > x && t < p.N) {
      const uint32_t jx = (uint32_t)x / (uint32_t)p.bs, jt = (uint32_t)t / (uint32_t)p.bs;
      const int64_t bx = load_index(trow + (int64_t)jx * p.tab.n_stride, p.tab.dtype, tal);
      const int64_t bt = load_index(trow + (int64_t)jt * p.tab.n_stride, p.tab.dtype, tal);
      const int q = atomicAdd(&s_n, 1);
      s_pairs[q] = make_int4((int)bx, (int)((uint32_t)x - jx * (uint32_t)p.bs), (int)bt,
                             (int)((uint32_t)t - jt * (uint32_t)p.bs));
    }
  }
  if (p.pdl) griddep_wait();
  const bool aborted = call_aborted(p.words, p.token, p.nverdict);
  __syncthreads();
  const uint32_t n = (uint32_t)s_n;
  if (aborted || n == 0) return;
  for (int b = 0; b < p.nbuf; ++b) {
    const BufDesc &bd = p.buf[b];
    char *base = bd.data + row_offset(p.inner, c, bd.lead);
    PagedPairs get;
    get.pairs = s_pairs;
    get.bstr = p.bstride[b];
    if (p.swap)
      move_pairs_t<true>(base, bd, n, get);
    else
      move_pairs_t<false>(base, bd, n, get);
  }
}

namespace {

// The moves see the call as the checks did: sequences, map, tables and sizes.
void copy_geometry(PagedApplyParams &ap, const PagedCheckParams &cp) {
  ap.inner = cp.inner;
  ap.map_inner = cp.map_inner;
  ap.map_seq = cp.map_seq;
  ap.map = cp.map;
  ap.tab = cp.tab;
  ap.N = cp.N;
  ap.bs = cp.bs;
  ap.per_seq = cp.per_seq;
}

imoe_status paged_apply(const imoe_view *pools, int32_t num_pools, const imoe_view *tables,
                        const imoe_view *map, imoe_mode mode, int32_t *workspace, int64_t workspace_elems,
                        const imoe_exec *exec, imoe_error *err) {
  const char *fn = "imoe_cuda_paged_apply_target_map";
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  const int64_t S = tables->lead_shape[0], maxb = tables->n;
  const int64_t num_blocks = pools[0].lead_shape[0], bs = pools[0].n, N = map->n;
  const int inner_nd = pools[0].lead_ndim - 1;
  uint64_t per_seq = 1;
  for (int d = 0; d < inner_nd; ++d) per_seq *= (uint64_t)pools[0].lead_shape[d + 1];
  if (S == 0 || per_seq == 0 || N == 0 || maxb == 0) return IMOE_OK;
  if (N >= 0x7FFFFFFFLL || num_blocks >= 0x7FFFFFFFLL || bs >= 0x7FFFFFFFLL)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: the CUDA path takes N, num_blocks and block_size below 2^31",
                fn);
  const int64_t jn = (N + bs - 1) / bs;  // entries that hold slots (<= max_blocks, checked)
  if ((uint64_t)S * per_seq > 0xFFFFFFFFull || S * jn >= 0x7FFFFFFFLL || (uint64_t)S >= 0xFFFFFFFFull)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: more than 2^32 - 1 rows or 2^31 - 1 table entries", fn);
  for (int b = 0; b < num_pools; ++b)
    if (pools[b].row_bytes > ((int64_t)1 << 24))
      return fail(err, IMOE_ERR_ARGUMENT, "%s: buffers[%d]: rows above 16 MiB are not supported on CUDA", fn,
                  b);
  if (workspace == nullptr || workspace_elems < imoe_paged_workspace_elems(num_blocks, S, maxb))
    return fail(err, IMOE_ERR_ARGUMENT, "%s: workspace too small", fn);

  Lead inner;
  memset(&inner, 0, sizeof inner);
  inner.nd = inner_nd;
  Strides map_inner;
  memset(&map_inner, 0, sizeof map_inner);
  for (int d = 0; d < inner_nd; ++d) {
    inner.shape[d] = (uint32_t)pools[0].lead_shape[d + 1];
    map_inner.s[d] = map->lead_stride[d + 1];
  }
  Strides tab_st;
  memset(&tab_st, 0, sizeof tab_st);
  tab_st.s[0] = tables->lead_stride[0];
  const InView mv = in_view(map, map_inner, inner_nd);
  const InView tv = in_view(tables, tab_st, 1);
  int32_t *claim = workspace, *flag = workspace + num_blocks;
  uint32_t *keys = reinterpret_cast<uint32_t *>(workspace + num_blocks + S * maxb);
  const uint32_t token = next_token();
  const bool pdl = di->cc_major >= 9;

  // ---- checks (read-only on the caller's data)
  PagedCheckParams cp;
  memset(&cp, 0, sizeof cp);
  cp.inner = inner;
  cp.map_inner = map_inner;
  cp.map_seq = map->lead_stride[0];
  cp.map = mv;
  cp.tab = tv;
  cp.N = N;
  cp.bs = bs;
  cp.num_blocks = num_blocks;
  cp.per_seq = (uint32_t)per_seq;
  cp.jn = (uint32_t)jn;
  // About 512 items over the whole call, at most kPagedMaxEntries entries each.
  int64_t J = (S * jn + 511) / 512;
  J = std::max<int64_t>(1, std::min<int64_t>(J, kPagedMaxEntries));
  cp.J = (uint32_t)J;
  cp.ipseq = (uint32_t)((jn + J - 1) / J);
  const uint64_t items = (uint64_t)S * cp.ipseq;
  if (items > 0x7FFFFFFFull)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: too many table entries for one launch", fn);
  cp.items = (uint32_t)items;
  cp.claim = claim;
  cp.flag = flag;
  cp.keys = keys;
  cp.token = token;
  const int n1 = (int)std::min<uint64_t>(items, kPagedCheckGrid);
  cp.words = di->words;
  cudaError_t e = launch(k_paged_check, shape((unsigned)n1, kPagedThreads, 0, false), st, cp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_paged_check", e);

  PagedDupParams dp;
  memset(&dp, 0, sizeof dp);
  dp.claim = claim;
  dp.flag = flag;
  dp.keys = keys;
  dp.entries = (uint64_t)S * (uint64_t)jn;
  dp.n1 = n1;
  dp.pdl = pdl ? 1 : 0;
  dp.token = token;
  const int n2 = (int)std::max<uint64_t>(
      1, std::min<uint64_t>((dp.entries + kPagedThreads - 1) / kPagedThreads, kPagedCheckGrid));
  dp.words = di->words;
  e = launch(k_paged_dups, shape((unsigned)n2, kPagedThreads, 0, pdl), st, dp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_paged_dups", e);

  // ---- moves
  PagedApplyParams ap;
  memset(&ap, 0, sizeof ap);
  copy_geometry(ap, cp);
  ap.swap = mode == IMOE_MODE_SWAP ? 1 : 0;
  ap.nverdict = n1 + n2;
  ap.token = token;
  const uint64_t rows = (uint64_t)S * per_seq;
  const uint64_t work = rows * (uint64_t)N;
  const uint64_t target = (uint64_t)di->sms * 8u;
  uint64_t seg = 32;
  while (seg < kPagedSegMax && seg * target < work) seg <<= 1;
  ap.seg = (uint32_t)seg;
  ap.nseg = (uint32_t)((N + (int64_t)seg - 1) / (int64_t)seg);
  const uint64_t grid = rows * ap.nseg;
  if (grid > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  bool pdl_apply = pdl;
  for (int g = 0; g < num_pools; g += kMaxBuf) {
    const int nb = std::min(kMaxBuf, num_pools - g);
    ap.nbuf = nb;
    for (int b = 0; b < nb; ++b) {
      const imoe_view *v = &pools[g + b];
      // Vector width from every stride a slot start depends on: block, inner axes, slot.
      Strides all;
      memset(&all, 0, sizeof all);
      for (int d = 0; d < v->lead_ndim; ++d) all.s[d] = v->lead_stride[d];
      ap.buf[b] = buf_desc(v, all, v->lead_ndim);
      memset(&ap.buf[b].lead, 0, sizeof(Strides));
      for (int d = 0; d < inner_nd; ++d) ap.buf[b].lead.s[d] = v->lead_stride[d + 1];
      ap.bstride[b] = v->lead_stride[0];
    }
    ap.pdl = pdl_apply ? 1 : 0;
    ap.words = di->words;
    e = launch(k_paged_apply, shape((unsigned)grid, kPagedThreads, (size_t)seg * sizeof(int4), pdl_apply), st,
               ap);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_paged_apply", e);
    pdl_apply = false;
  }
  return IMOE_OK;
}

}  // namespace

}  // namespace imoe_cu

using namespace imoe_cu;

extern "C" imoe_status imoe_cuda_paged_apply_target_map(const imoe_view *buffers, int32_t num_buffers,
                                                        const imoe_view *block_tables,
                                                        const imoe_view *target_map, imoe_mode mode,
                                                        int32_t *workspace, int64_t workspace_elems,
                                                        const imoe_exec *exec, imoe_error *err) {
  return paged_apply(buffers, num_buffers, block_tables, target_map, mode, workspace, workspace_elems, exec,
                     err);
}
