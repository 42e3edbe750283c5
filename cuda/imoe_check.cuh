// imoe_check.cuh: the read-only validation kernels of the select family
// (docs/cuda-design.md, "Data errors"). An error is recorded in the status
// word, and every block writes its verdict word.
//   k_check_nan    NaN scores under IMOE_NAN_ERROR, when the select does not
//                  check them itself;
//   k_check_rows   active indices (range, then duplicates), or caller-given
//                  indices (entry i is i, or in [C', N) and distinct);
//   k_check_tm     a caller-given target_map (range, involution).
#pragma once

#include "imoe_select_common.cuh"

namespace imoe_cu {

struct NanParams {
  Lead lead;
  int64_t N;
  InView scores;
  uint32_t bpr;    // pieces per row
  uint32_t items;  // rows x bpr pieces, grid-strided
  int64_t per;     // slots per piece
  uint32_t token;
  int32_t vec;     // dense 16-bit or 32-bit scores, 16-byte aligned: one flat
                   // row (lead nd 0) read as 16-byte vectors; per: a multiple of 8
};

// Whether a 16-byte vector of raw scores holds a NaN.
__device__ __forceinline__ bool vec_has_nan(uint4 q, int dt) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  bool bad = false;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (dt == IMOE_DTYPE_F32)
      bad |= raw_is_nan(w[j], dt);
    else
      bad |= raw_is_nan(w[j] & 0xFFFFu, dt) | raw_is_nan(w[j] >> 16, dt);
  }
  return bad;
}

__global__ void __launch_bounds__(1024) k_check_nan(const __grid_constant__ NanParams p) {
  griddep_launch_dependents();
  bool bad = false;
  const bool al = p.scores.aligned != 0;
  const int dt = p.scores.dtype;
  if (p.vec) {  // eight 16-byte loads in flight per thread
    const int epv = dt == IMOE_DTYPE_F32 ? 4 : 8;  // scores per vector
    const uint4 *v = reinterpret_cast<const uint4 *>(p.scores.data);
    for (uint32_t it = blockIdx.x; it < p.items; it += gridDim.x) {
      const int64_t x0 = (int64_t)it * p.per, x1 = min(x0 + p.per, p.N);
      const int64_t v0 = x0 / epv, v1 = x1 / epv;
      for (int64_t vb = v0 + threadIdx.x; vb < v1; vb += 8 * (int64_t)blockDim.x) {
        uint4 q[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int64_t k = vb + (int64_t)u * blockDim.x;
          q[u] = k < v1 ? __ldg(v + k) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) bad |= vec_has_nan(q[u], dt);
      }
      for (int64_t x = v1 * epv + threadIdx.x; x < x1; x += blockDim.x)  // a last partial vector
        bad |= raw_is_nan(ldg_raw(p.scores.data + x * p.scores.n_stride, dt, al), dt);
    }
  } else {
    for (uint32_t it = blockIdx.x; it < p.items; it += gridDim.x) {
      const uint32_t r = it / p.bpr, s = it - r * p.bpr;
      const char *row = row_data(p.lead, p.scores, r);
      const int64_t x0 = (int64_t)s * p.per, x1 = min(x0 + p.per, p.N);
      for (int64_t xb = x0 + threadIdx.x; xb < x1; xb += 8 * (int64_t)blockDim.x) {
        uint32_t raw[8];  // eight independent loads in flight
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int64_t x = xb + (int64_t)u * blockDim.x;
          raw[u] = x < x1 ? ldg_raw(row + x * p.scores.n_stride, dt, al) : 0u;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) bad |= raw_is_nan(raw[u], dt);
      }
    }
  }
  bad = __syncthreads_or(bad) != 0;
  if (threadIdx.x == 0) {
    if (bad) record_status(module_words(), IMOE_ERR_NAN);
    write_verdict(module_words(), p.token, bad);
  }
}

// Per row: active indices (kind 1: in [0, N), distinct) or caller-given
// indices (kind 2: entry i is i, or in [M, N) and distinct). Duplicates are
// found with a shared-memory bitmap over windows of win_bits slots.
struct RowsParams {
  Lead lead;
  int64_t N;  // < 0 (kind 1 only): unknown, then no upper bound
  int64_t M;  // entries per row
  int32_t kind;
  int32_t win_bits;
  uint32_t rows;  // grid-strided
  InView v;
  uint32_t token;
};

// Entries kb + u nt (u < 8) of a row of indices, eight loads in flight per
// thread (a few long rows are checked by one block each: the loads in
// flight set its speed). Entries at or past m read as 0.
__device__ __forceinline__ void load_index8(const char *row, int64_t kb, int nt, int64_t m, const InView &iv,
                                            bool al, int64_t (&v)[8]) {
  if (al && iv.dtype == IMOE_DTYPE_I64) {  // one uniform branch, then eight plain loads
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t k = kb + (int64_t)u * nt;
      v[u] = k < m ? (int64_t)__ldg(reinterpret_cast<const long long *>(row + k * iv.n_stride)) : 0;
    }
  } else if (al) {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t k = kb + (int64_t)u * nt;
      v[u] = k < m ? (int64_t)__ldg(reinterpret_cast<const int32_t *>(row + k * iv.n_stride)) : 0;
    }
  } else {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t k = kb + (int64_t)u * nt;
      v[u] = k < m ? load_index(row + k * iv.n_stride, iv.dtype, false) : 0;
    }
  }
}

// f(k, row[k]) for this thread's entries k of a row of m indices (k = tid,
// tid + nt, ...), eight loads in flight at a time.
template <class F>
__device__ __forceinline__ void for_each_index(const char *row, int64_t m, const InView &iv, bool al, F &&f) {
  const int nt = blockDim.x;
  for (int64_t kb = threadIdx.x; kb < m; kb += 8 * (int64_t)nt) {
    int64_t vv[8];
    load_index8(row, kb, nt, m, iv, al, vv);
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t k = kb + (int64_t)u * nt;
      if (k >= m) break;
      f(k, vv[u]);
    }
  }
}

__global__ void __launch_bounds__(kCheckThreads) k_check_rows(const __grid_constant__ RowsParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  uint32_t *bits = reinterpret_cast<uint32_t *>(dsm);
  __shared__ unsigned long long s_max;
  __shared__ int s_code;
  griddep_launch_dependents();
  const int tid = threadIdx.x, nt = blockDim.x;
  const bool al = p.v.aligned != 0;
  const int64_t lo = p.kind == 1 ? 0 : p.M;
  bool bad = false;  // thread 0
  for (uint32_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const char *row = row_data(p.lead, p.v, r);
    if (tid == 0) {
      s_max = (unsigned long long)max(p.M, (int64_t)0);
      s_code = 0;
    }
    __syncthreads();
    int code = 0;
    unsigned long long mx = 0;
    for_each_index(row, p.M, p.v, al, [&](int64_t k, int64_t v) {
      if (p.kind == 1) {
        if (v < 0 || (p.N >= 0 && v >= p.N) || v >= 0x7FFFFFFFLL)
          code = IMOE_ERR_INDEX_RANGE;
        else if ((unsigned long long)v + 1 > mx)
          mx = (unsigned long long)v + 1;
      } else if (v != k) {
        if (v < 0 || v >= p.N)
          code = IMOE_ERR_INDEX_RANGE;
        else if (v < p.M)
          code = IMOE_ERR_BAD_MAP;
      }
    });
    if (code) atomicCAS(&s_code, 0, code);
    if (mx) atomicMax(&s_max, mx);
    __syncthreads();
    const int64_t N = p.N >= 0 ? p.N : (int64_t)s_max;
    const int dup_code = p.kind == 1 ? IMOE_ERR_INDEX_DUPLICATE : IMOE_ERR_BAD_MAP;
    const int wwords = p.win_bits >> 5;
    for (int64_t w0 = lo; w0 < N && s_code == 0; w0 += p.win_bits) {
      for (int i = tid; i < wwords; i += nt) bits[i] = 0u;
      __syncthreads();
      for_each_index(row, p.M, p.v, al, [&](int64_t k, int64_t v) {
        const int64_t d = v - w0;
        if ((p.kind != 2 || v != k) && d >= 0 && d < p.win_bits) {
          const uint32_t b = 1u << (d & 31);
          if (atomicOr(&bits[d >> 5], b) & b) atomicCAS(&s_code, 0, dup_code);
        }
      });
      __syncthreads();
    }
    if (tid == 0 && s_code) {
      record_status(module_words(), s_code);
      bad = true;
    }
    __syncthreads();  // s_code and s_max are reset for the next row
  }
  if (tid == 0) write_verdict(module_words(), p.token, bad);
}

// target_map: every entry in [0, N) and tm[tm[x]] == x.
struct TmParams {
  Lead lead;
  int64_t N;
  InView tm;
  uint32_t bpr;
  uint32_t items;  // rows x bpr pieces, grid-strided
  int64_t per;
  uint32_t token;
};

__global__ void __launch_bounds__(256) k_check_tm(const __grid_constant__ TmParams p) {
  griddep_launch_dependents();
  const bool al = p.tm.aligned != 0;
  int code = 0;
  for (uint32_t it = blockIdx.x; it < p.items; it += gridDim.x) {
    const uint32_t r = it / p.bpr, s = it - r * p.bpr;
    const char *row = row_data(p.lead, p.tm, r);
    const int64_t x0 = (int64_t)s * p.per, x1 = min(x0 + p.per, p.N);
    for (int64_t x = x0 + threadIdx.x; x < x1; x += blockDim.x) {
      const int64_t v = load_index(row + x * p.tm.n_stride, p.tm.dtype, al);
      if (v < 0 || v >= p.N) {
        code = IMOE_ERR_INDEX_RANGE;
      } else {
        // a partner that is itself out of range is that slot's range error
        // (the CPU core reports ranges before involution failures)
        const int64_t back = load_index(row + v * p.tm.n_stride, p.tm.dtype, al);
        if (back < 0 || back >= p.N)
          code = IMOE_ERR_INDEX_RANGE;
        else if (back != x)
          code = IMOE_ERR_BAD_MAP;
      }
    }
  }
  if (code) record_status(module_words(), code);
  const bool bad = __syncthreads_or(code != 0) != 0;
  if (threadIdx.x == 0) write_verdict(module_words(), p.token, bad);
}

}  // namespace imoe_cu
