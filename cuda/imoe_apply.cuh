// imoe_apply.cuh: k_apply, the moves (or swaps) of a map over all rows, many
// blocks per row. Used by apply_indices / apply_target_map, by a compaction
// whose moves are not fused into its select kernel (and for buffer groups
// beyond the first kMaxBuf), and by the permutation engine's seam swaps.
#pragma once

#include "imoe_select_common.cuh"

namespace imoe_cu {

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

// The n pairs (s_dst[i], s_dst[seg + i]) of one row, moved (or swapped) in
// every buffer: the row at coordinates c.
__device__ __forceinline__ void move_row_pairs(int32_t *s_dst, uint32_t seg, int n, const BufDesc *buf, int nbuf,
                                               const Lead &lead, const uint32_t (&c)[kMaxDims], int32_t swap) {
  RingPairs get;
  get.D = s_dst;
  get.s_off = (int)seg;
  get.a0 = 0;
  get.b0 = 0;
  get.cap = 0x7FFFFFFF;
  for (int b = 0; b < nbuf; ++b)
    move_pairs_inline(buf[b].data + row_offset(lead, c, buf[b].lead), buf[b], (uint32_t)n, swap, get);
}

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
  const bool aborted = call_aborted(module_words(), p.token, p.nverdict);
  __syncthreads();
  const int n = s_n;
  if (!aborted && n > 0) move_row_pairs(s_dst, p.seg, n, p.buf, p.nbuf, p.lead, c, p.swap);
}

}  // namespace imoe_cu
