// imoe_apply_small.cuh: k_check_apply, apply_indices of a small call in one
// launch. One block checks every row's indices (as k_check_rows, kind 2:
// entry i is i, or in [M, N) and distinct), and only when all are good moves
// every row's pairs (as k_apply). A bad map records its status and changes no
// row; the block barrier between the two phases is what k_check_rows' verdict
// words and k_apply's wait give a call of two launches.
#pragma once

#include "imoe_apply.cuh"
#include "imoe_check.cuh"

namespace imoe_cu {

struct CheckApplyParams {
  Lead lead;
  int64_t N;         // slots per row
  int64_t M;         // entries per row of the indices (C')
  int32_t win_bits;  // the duplicate bitmap's window (a multiple of 32)
  int32_t swap, nbuf;
  uint32_t rows;
  InView map;
  BufDesc buf[kMaxBuf];
};

// Dynamic shared memory: the row's pairs (2 x M int32), then the bitmap.
__global__ void __launch_bounds__(kApplyThreads) k_check_apply(const __grid_constant__ CheckApplyParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  int32_t *s_dst = reinterpret_cast<int32_t *>(dsm);
  int32_t *s_src = s_dst + p.M;
  uint32_t *bits = reinterpret_cast<uint32_t *>(s_src + p.M);
  __shared__ int s_code, s_n;
  const int tid = threadIdx.x, nt = blockDim.x;
  const bool al = p.map.aligned != 0;
  if (tid == 0) s_code = 0;
  __syncthreads();
  // Phase 1: every row checked. Every thread reads s_code between two
  // barriers with no write between them, so each loop's condition is uniform.
  for (uint32_t r = 0; r < p.rows; ++r) {
    const bool stop = s_code != 0;
    __syncthreads();  // read by all before this row's checks can write it
    if (stop) break;
    const char *row = row_data(p.lead, p.map, r);
    int code = 0;
    for_each_index(row, p.M, p.map, al, [&](int64_t k, int64_t v) {
      if (v != k) {
        if (v < 0 || v >= p.N)
          code = IMOE_ERR_INDEX_RANGE;
        else if (v < p.M)
          code = IMOE_ERR_BAD_MAP;
      }
    });
    if (code) atomicCAS(&s_code, 0, code);
    __syncthreads();
    for (int64_t w0 = p.M; w0 < p.N && s_code == 0; w0 += p.win_bits) {
      for (int i = tid; i < (p.win_bits >> 5); i += nt) bits[i] = 0u;
      __syncthreads();
      for_each_index(row, p.M, p.map, al, [&](int64_t k, int64_t v) {
        const int64_t d = v - w0;
        if (v != k && d >= 0 && d < p.win_bits) {
          const uint32_t b = 1u << (d & 31);
          if (atomicOr(&bits[d >> 5], b) & b) atomicCAS(&s_code, 0, IMOE_ERR_BAD_MAP);
        }
      });
      __syncthreads();
    }
  }
  if (s_code != 0) {  // uniform: read after the last barrier of phase 1
    if (tid == 0) record_status(module_words(), s_code);
    return;
  }
  // Phase 2: every row's pairs (i, idx[i]) with idx[i] != i, moved or swapped.
  for (uint32_t r = 0; r < p.rows; ++r) {
    if (tid == 0) s_n = 0;
    __syncthreads();
    uint32_t c[kMaxDims];
    row_coords(p.lead, r, c);
    const char *mrow = p.map.data + row_offset(p.lead, c, p.map.lead);
    for (int64_t i = tid; i < p.M; i += nt) {
      const int64_t v = load_index(mrow + i * p.map.n_stride, p.map.dtype, al);
      if (v != i) {
        const int s = atomicAdd(&s_n, 1);
        s_dst[s] = (int32_t)i;
        s_src[s] = (int32_t)v;
      }
    }
    __syncthreads();
    const int n = s_n;
    if (n > 0) move_row_pairs(s_dst, (uint32_t)p.M, n, p.buf, p.nbuf, p.lead, c, p.swap);
    __syncthreads();  // the pairs are read before the next row writes them
  }
}

}  // namespace imoe_cu
