// imoe_slices.cu: a row permutation applied by column slices in shared
// memory (launch_slices, called first by launch_cycles_and_swaps in
// imoe_permute.cu, so permute_, restore_, the ordered apply, grouping and the
// ordered compaction all take it; docs/cuda-design.md, "Permutations and
// grouping").
//
// Method. A permutation of the N slots of a row moves every byte column of
// the slot the same way. Each buffer's slot is cut into slices of W bytes
// (W: the widest of 16, 8, 4, 2, 1 that divides the row bytes, the data
// pointer, the slot stride and every lead stride). One unit of work is
// (a group of RU rows, a chunk of S consecutive slices): a block stages
// those slices of M slots of those rows in shared memory (RU x M x S x W
// bytes), waits at a barrier, then writes them back in place. Forward
// (new[i] = old[p[i]] for i < M): it gathers old[p[i]] into stage i, then
// writes slots [0, M) in order; M = N for a permutation, M = C' for a move
// (only the kept slots [0, C') are wanted). Inverse (new[p[i]] = old[i]):
// it stages all N slots, then scatters. Every written byte is read once and
// written once, without workspace and without a grid-wide step. S grows
// (powers of two) until a slot's slices fill a 32-byte sector, or while a
// unit stages less than kSliceTarget bytes; RU > 1 only in the latter case.
// Units are numbered buffer by buffer,
// row group by row group, chunks fastest, so the blocks of neighbouring
// slices of a row (which share DRAM sectors) run together.
//
// It applies when every buffer's N x W fits the opt-in shared memory of a
// block (with the row tables); otherwise the caller runs the cycle engine.
// The kernel waits for its predecessor (PDL), then reads the verdict words
// of the call's validation and does nothing after a data error.
#include <cuda_runtime.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "imoe_device.cuh"
#include "imoe_launch.cuh"

namespace imoe_cu {

constexpr int kSliceThreads = 512;
constexpr int kSliceUnroll = 4;       // loads in flight per thread (64 KB per multiprocessor)
constexpr int kSliceBlocksPerSm = 2;  // 64 registers a thread (at 3 blocks, 40 spill)
constexpr int64_t kSliceTarget = 64 * 1024;   // staged bytes a unit grows to with S, RU > 1
constexpr int64_t kSliceSectorMax = 128 * 1024;  // staged bytes S may reach to fill a sector
constexpr int kSliceSector = 32;                  // bytes of a DRAM sector
constexpr int kSliceMaxRows = 32;             // RU at most
// The row starts of a unit (buffer rows, then permutation rows), at the front
// of the dynamic shared memory.
constexpr size_t kSliceTables = 2 * kSliceMaxRows * sizeof(void *);

struct SliceBuf {
  uint64_t first;   // the buffer's first unit
  uint32_t chunks;  // chunks per row group: ceil(slices / S)
  int32_t sh_s;     // log2 S
  int32_t sh_r;     // log2 RU
};

struct SliceParams {
  Lead lead;        // the buffers' rows
  uint64_t rows;
  int64_t n;
  int64_t m;        // slots staged per row: written (forward), n (inverse)
  uint64_t units;
  InView succ;      // the permutation p: [plan rows, n]
  int32_t per_row;  // one p per row (else one shared by every row)
  int32_t inverse;
  int32_t nbuf;
  uint32_t token;
  int32_t nverdict;
  StatusWords words;  // imoe_select.cu's status and verdict words (DevInfo::words)
  SliceBuf sb[kMaxBuf];
  BufDesc buf[kMaxBuf];  // vw = W, body = slices per slot, head = tail = 0
};

// p[x] from its address: aligned int32 (every device-computed plan) and int64
// read directly, anything else byte by byte.
__device__ __forceinline__ int32_t succ_at(const char *a, int dtype, bool al) {
  if (al) {
    if (dtype == IMOE_DTYPE_I32) return *reinterpret_cast<const int32_t *>(a);
    return (int32_t)*reinterpret_cast<const long long *>(a);
  }
  return (int32_t)load_index(a, dtype, false);
}

// One unit of one buffer, W-byte slices: item k = ((x * RU) + rr) * S + s is
// slice j0 + s of slot x of row rr of the group; the stage holds item k at k.
// ONE: S = RU = 1 (item k is slot k), the shape of large rows.
template <int W, bool ONE>
__device__ __forceinline__ void slice_unit(const SliceParams &p, const SliceBuf &sb, const BufDesc &bd,
                                           uint32_t j0, uint32_t nr, char *const *s_row,
                                           const char *const *s_succ, unsigned char *stage) {
  typedef typename VecOf<W>::T V;
  V *sm = reinterpret_cast<V *>(stage);
  const int shs = ONE ? 0 : sb.sh_s, shr = ONE ? 0 : sb.sh_r, shx = shs + shr;
  const uint32_t smask = (1u << shs) - 1u, rmask = (1u << shr) - 1u;
  const uint32_t cnt = min(1u << shs, bd.body - j0);
  const uint32_t total = (uint32_t)p.m << shx;  // m x S x RU x W <= the shared memory
  const int64_t ns = bd.n_stride;
  const bool al = p.succ.aligned != 0;
  const bool inverse = p.inverse != 0;
  constexpr uint32_t kStep = kSliceUnroll * kSliceThreads;
  // The slots of items k0 + q x threads: x, or p[x] where `mapped`.
  auto slots = [&](uint32_t k0, bool mapped, uint32_t(&y)[kSliceUnroll]) {
#pragma unroll
    for (int q = 0; q < kSliceUnroll; ++q) {
      const uint32_t k = k0 + (uint32_t)q * kSliceThreads;
      const uint32_t s = k & smask, rr = (k >> shs) & rmask, x = k >> shx;
      y[q] = x;
      if (mapped && k < total && s < cnt && rr < nr)
        y[q] = (uint32_t)succ_at(s_succ[rr] + (int64_t)x * p.succ.n_stride, p.succ.dtype, al);
    }
  };
  // Stage: forward gathers old[p[x]], inverse reads old[x].
  for (uint32_t k0 = threadIdx.x; k0 < total; k0 += kStep) {
    uint32_t y[kSliceUnroll];
    slots(k0, !inverse, y);
    V v[kSliceUnroll];
#pragma unroll
    for (int q = 0; q < kSliceUnroll; ++q) {
      const uint32_t k = k0 + (uint32_t)q * kSliceThreads;
      const uint32_t s = k & smask, rr = (k >> shs) & rmask;
      if (k < total && s < cnt && rr < nr)
        v[q] = *reinterpret_cast<const V *>(s_row[rr] + (int64_t)y[q] * ns + (int64_t)(j0 + s) * W);
    }
#pragma unroll
    for (int q = 0; q < kSliceUnroll; ++q) {
      const uint32_t k = k0 + (uint32_t)q * kSliceThreads;
      const uint32_t s = k & smask, rr = (k >> shs) & rmask;
      if (k < total && s < cnt && rr < nr) sm[k] = v[q];
    }
  }
  __syncthreads();
  // Write: forward slot x in order, inverse slot p[x].
  for (uint32_t k0 = threadIdx.x; k0 < total; k0 += kStep) {
    uint32_t y[kSliceUnroll];
    slots(k0, inverse, y);
#pragma unroll
    for (int q = 0; q < kSliceUnroll; ++q) {
      const uint32_t k = k0 + (uint32_t)q * kSliceThreads;
      const uint32_t s = k & smask, rr = (k >> shs) & rmask;
      if (k < total && s < cnt && rr < nr)
        *reinterpret_cast<V *>(s_row[rr] + (int64_t)y[q] * ns + (int64_t)(j0 + s) * W) = sm[k];
    }
  }
}

template <bool ONE>
__device__ __forceinline__ void slice_width(const SliceParams &p, const SliceBuf &sb, const BufDesc &bd,
                                            uint32_t j0, uint32_t nr, char *const *s_row,
                                            const char *const *s_succ, unsigned char *stage) {
  switch (bd.vw) {
    case 16: slice_unit<16, ONE>(p, sb, bd, j0, nr, s_row, s_succ, stage); break;
    case 8: slice_unit<8, ONE>(p, sb, bd, j0, nr, s_row, s_succ, stage); break;
    case 4: slice_unit<4, ONE>(p, sb, bd, j0, nr, s_row, s_succ, stage); break;
    case 2: slice_unit<2, ONE>(p, sb, bd, j0, nr, s_row, s_succ, stage); break;
    default: slice_unit<1, ONE>(p, sb, bd, j0, nr, s_row, s_succ, stage); break;
  }
}

__global__ void __launch_bounds__(kSliceThreads, kSliceBlocksPerSm)
    k_perm_slices(const __grid_constant__ SliceParams p) {
  extern __shared__ __align__(16) unsigned char dsm[];
  char **s_row = reinterpret_cast<char **>(dsm);
  const char **s_succ = reinterpret_cast<const char **>(dsm + kSliceMaxRows * sizeof(void *));
  unsigned char *stage = dsm + kSliceTables;
  griddep_wait();
  if (call_aborted(p.words, p.token, p.nverdict)) return;
  for (uint64_t u = blockIdx.x; u < p.units; u += gridDim.x) {
    int b = 0;
    while (b + 1 < p.nbuf && u >= p.sb[b + 1].first) ++b;
    const SliceBuf &sb = p.sb[b];
    const BufDesc &bd = p.buf[b];
    const uint64_t local = u - sb.first;
    const uint64_t g = local / sb.chunks;
    const uint32_t j0 = (uint32_t)(local - g * sb.chunks) << sb.sh_s;
    const uint64_t r0 = g << sb.sh_r;
    const uint64_t left = p.rows - r0;
    const uint32_t ru = 1u << sb.sh_r;
    const uint32_t nr = left < ru ? (uint32_t)left : ru;
    if (threadIdx.x < nr) {
      uint32_t c[kMaxDims];
      row_coords(p.lead, (uint32_t)(r0 + threadIdx.x), c);
      s_row[threadIdx.x] = bd.data + row_offset(p.lead, c, bd.lead);
      s_succ[threadIdx.x] = p.succ.data + (p.per_row ? row_offset(p.lead, c, p.succ.lead) : 0);
    }
    __syncthreads();
    if (sb.sh_s == 0 && sb.sh_r == 0)
      slice_width<true>(p, sb, bd, j0, nr, s_row, s_succ, stage);
    else
      slice_width<false>(p, sb, bd, j0, nr, s_row, s_succ, stage);
    __syncthreads();  // the stage and the row tables are free for the next unit
  }
}

// ------------------------------------------------------------ host side
namespace {

uint32_t ceil_pow2(uint64_t v) {
  uint32_t p = 1;
  while (p < v && p < 0x80000000u) p <<= 1;
  return p;
}
int log2_of(uint32_t p) {
  int s = 0;
  while ((1u << s) < p) ++s;
  return s;
}

// Raises the kernel's dynamic shared memory limit to the opt-in maximum,
// once per device.
cudaError_t slices_smem_attribute(const DevInfo *di) {
  static std::atomic<int> done[kMaxDevices];
  const ptrdiff_t d = di - g_dev;
  const bool cached = d >= 0 && d < kMaxDevices;
  if (cached && done[d].load(std::memory_order_relaxed)) return cudaSuccess;
  const cudaError_t e =
      cudaFuncSetAttribute(k_perm_slices, cudaFuncAttributeMaxDynamicSharedMemorySize, di->smem_optin);
  if (e == cudaSuccess && cached) done[d].store(1, std::memory_order_relaxed);
  return e;
}

}  // namespace

// Buffers [buf_st0, ...) of pl permuted by `succ` ([plan rows, n]) after the
// validation of `token`, kMaxBuf buffers a launch. *done = false (nothing
// launched) when some buffer's N x W does not fit a block's shared memory.
imoe_status launch_slices(const char *fn, const imoe_view *buffers, int32_t num_buffers, const CallRows &pl,
                          size_t buf_st0, const InView &succ, bool per_row, int64_t n, int64_t written,
                          bool inverse, uint32_t token, int nverdict, DevInfo *di, cudaStream_t st,
                          imoe_error *err, bool *done) {
  *done = false;
  const int64_t m = inverse ? n : written;  // slots staged per row
  if (m <= 0) {
    *done = true;  // nothing is written
    return IMOE_OK;
  }
  const int64_t avail = (int64_t)di->smem_optin - (int64_t)kSliceTables;
  const int64_t target = std::min(kSliceTarget, avail);
  std::vector<BufDesc> bds((size_t)num_buffers);
  for (int b = 0; b < num_buffers; ++b) {
    BufDesc bd = buf_desc(&buffers[b], pl.st[buf_st0 + b], pl.lead.nd);
    const int64_t rb = buffers[b].row_bytes;
    int w = bd.vw;
    while (w > 1 && ((uintptr_t)bd.data % (uintptr_t)w != 0 || rb % w != 0)) w >>= 1;
    if (m * w > avail) return IMOE_OK;
    bd.vw = w;
    bd.head = 0;
    bd.tail = 0;
    bd.body = (uint32_t)(rb / w);
    if ((int64_t)bd.body * w != rb) return IMOE_OK;  // rows of 2^32 slices or more
    bds[(size_t)b] = bd;
  }
  *done = true;
  if (slices_smem_attribute(di) != cudaSuccess) {
    (void)cudaGetLastError();
    *done = false;  // the cycle engine needs no opt-in shared memory
    return IMOE_OK;
  }
  SliceParams sp;
  memset(&sp, 0, sizeof sp);
  sp.lead = pl.lead;
  sp.rows = pl.R;
  sp.n = n;
  sp.m = m;
  sp.succ = succ;
  sp.per_row = per_row ? 1 : 0;
  sp.inverse = inverse ? 1 : 0;
  sp.token = token;
  sp.nverdict = nverdict;
  sp.words = di->words;
  const bool pdl = di->cc_major >= 9;
  const uint64_t cap = (uint64_t)std::max(1, di->sms) * 32u;
  for (int g = 0; g < num_buffers; g += kMaxBuf) {
    sp.nbuf = std::min(kMaxBuf, num_buffers - g);
    uint64_t units = 0;
    int64_t smem = 0;
    for (int b = 0; b < sp.nbuf; ++b) {
      const BufDesc &bd = bds[(size_t)(g + b)];
      const int64_t slot = m * bd.vw;
      const uint32_t sp2 = ceil_pow2(bd.body);
      uint32_t S = 1, RU = 1;
      while (S < sp2 && (slot * S * 2 <= target ||
                         (S * bd.vw < kSliceSector && slot * S * 2 <= std::min(kSliceSectorMax, avail))))
        S <<= 1;
      if (S >= bd.body) {
        const uint32_t rmax = std::min<uint32_t>(kSliceMaxRows, ceil_pow2(pl.R));
        while (RU < rmax && slot * S * RU * 2 <= target) RU <<= 1;
      }
      SliceBuf &sb = sp.sb[b];
      sb.first = units;
      sb.chunks = std::max<uint32_t>(1u, (uint32_t)(((uint64_t)bd.body + S - 1) / S));
      sb.sh_s = log2_of(S);
      sb.sh_r = log2_of(RU);
      sp.buf[b] = bd;
      if (bd.body > 0) {
        units += (pl.R + RU - 1) / RU * (uint64_t)sb.chunks;
        smem = std::max(smem, slot * (int64_t)S * (int64_t)RU);
      } else {
        sp.buf[b].body = 0;  // no units (its `first` equals the next one's)
      }
    }
    if (units == 0) continue;
    sp.units = units;
    const unsigned grid = (unsigned)std::min(units, cap);
    const cudaError_t e =
        launch(k_perm_slices, shape(grid, kSliceThreads, kSliceTables + (size_t)smem, pdl), st, sp);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_perm_slices", e);
  }
  return IMOE_OK;
}

}  // namespace imoe_cu
