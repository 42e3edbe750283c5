// imoe_select.cu: the select and move family (docs/cuda-design.md, "Select
// paths"): imoe_cuda_build_map, imoe_cuda_compact, imoe_cuda_apply_indices,
// imoe_cuda_apply_target_map and imoe_cuda_read_device_status. Host side:
// turn the validated views into kernel parameters, plan the launches, and
// enqueue them on the caller's stream; no allocation, no synchronisation
// (except read_device_status). This translation unit owns the fixed module
// memory every family's kernels write: the status word and the verdict words
// (other translation units get their addresses from DevInfo::words).
#define IMOE_SELECT_TRANSLATION_UNIT
#include <cuda_runtime.h>
#include <string.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "imoe_apply.cuh"
#include "imoe_apply_small.cuh"
#include "imoe_check.cuh"
#include "imoe_launch.cuh"
#include "imoe_select_common.cuh"
#include "imoe_select_rows.cuh"
#include "imoe_select_small.cuh"
#include "imoe_select_wide.cuh"

namespace imoe_cu {

namespace {

constexpr size_t kStaticSmemSelect = 4096;  // upper bound of k_select's static shared memory
constexpr int kStaticSmemWide = 24576;      // ... and of k_select_wide's
// k_select_small: H and T, min(C', N - C') <= N / 2 entries each
constexpr int kSmallDynSmem = kSmallMaxN * 4 > 0 ? kSmallMaxN * 4 : 4;

// The kernel variants of a select (docs/cuda-design.md, "Select paths").
// The values index DevInfo's occupancy cache.
enum class SelectPath : int {
  kRowsKeysShared = 0,  // k_select<0>: longer rows, keys cached in shared memory (N <= 65536)
  kRowsKeysGlobal = 1,  // k_select<1>: longer rows, keys re-read from global memory every pass
  kActive = 2,          // k_select<2>: active indices
  kSmall4 = 3,          // k_select_small, 1024 threads x 4 keys: N <= 4096
  kSmall8 = 4,          // ... x 8 keys: N <= 8192
  kSmall16 = 5,         // ... x 16 keys: N <= 16384
  kMany256 = 6,         // many rows (>= 2 x SMs) of N <= 4096: 256 threads x 16 keys
  kMany512 = 7,         // many rows of N <= 8192: 512 threads x 16 keys
};
constexpr int kSelectPaths = 8;
constexpr int kSmallKernels = 5;  // kSmall4 .. kMany512
bool is_small(SelectPath p) { return (int)p >= (int)SelectPath::kSmall4; }

// k_select_small for one path. Calls that move (not swap) take the kernels
// whose movers keep five loads in flight per thread (move5): each kernel has
// its own copy of the mover, allocated by ptxas on its own, so neither loop
// spills (docs/cuda-design.md, "Moves").
typedef void (*SmallKernel)(SelParams);
SmallKernel small_kernel(SelectPath path, bool move5) {
  switch (path) {
    case SelectPath::kSmall4: return move5 ? k_select_small<4, true> : k_select_small<4, false>;
    case SelectPath::kSmall8: return move5 ? k_select_small<8, true> : k_select_small<8, false>;
    case SelectPath::kMany256: return move5 ? k_select_small<16, true, 256> : k_select_small<16, false, 256>;
    case SelectPath::kMany512: return move5 ? k_select_small<16, true, 512> : k_select_small<16, false, 512>;
    default: return move5 ? k_select_small<16, true> : k_select_small<16, false>;
  }
}
unsigned select_threads(SelectPath path) {
  return path == SelectPath::kMany256 ? 256u : (path == SelectPath::kMany512 ? 512u : (unsigned)kSelThreads);
}

template <class K>
cudaError_t raise_smem(K kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

}  // namespace

// Once per device (enter(), under g_mu): the select family's kernel
// attributes and the addresses of its module memory.
cudaError_t setup_select_device(DevInfo *di, const char **what) {
  cudaError_t e;
  *what = "cudaGetSymbolAddress";
  void *status = nullptr, *verdict = nullptr;
  if ((e = cudaGetSymbolAddress(&status, g_status)) != cudaSuccess ||
      (e = cudaGetSymbolAddress(&verdict, g_verdict)) != cudaSuccess)
    return e;
  di->words.status = static_cast<int *>(status);
  di->words.verdict = static_cast<unsigned (*)[kVerdicts]>(verdict);
  *what = "cudaFuncSetAttribute";
  di->wide_cap = std::max(1, std::min(kWideMaxCap, (di->smem_optin - kStaticSmemWide - 4 * kWideSub) / 8));
  // One shared-memory carveout for every kernel: a kernel launched early
  // (PDL) can then share a multiprocessor with the one before it.
  const int carve = cudaSharedmemCarveoutMaxShared;
  if ((e = cudaFuncSetAttribute(k_select<0>, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) !=
          cudaSuccess ||
      (e = cudaFuncSetAttribute(k_select<1>, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) !=
          cudaSuccess ||
      (e = cudaFuncSetAttribute(k_select<2>, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) !=
          cudaSuccess ||
      (e = cudaFuncSetAttribute(k_check_rows, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) !=
          cudaSuccess ||
      (e = cudaFuncSetAttribute(k_check_nan, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) !=
          cudaSuccess ||
      (e = cudaFuncSetAttribute(k_check_tm, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) !=
          cudaSuccess ||
      (e = cudaFuncSetAttribute(k_apply, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) !=
          cudaSuccess ||
      (e = cudaFuncSetAttribute(k_select_wide, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) !=
          cudaSuccess ||
      (e = raise_smem(k_select_wide, 8 * di->wide_cap + 4 * kWideSub)) != cudaSuccess)
    return e;
  for (int k = 0; k < 2 * kSmallKernels; ++k) {
    const SelectPath path = (SelectPath)((int)SelectPath::kSmall4 + k % kSmallKernels);
    const SmallKernel sk = small_kernel(path, k >= kSmallKernels);
    if ((e = cudaFuncSetAttribute(sk, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) !=
            cudaSuccess ||
        (e = raise_smem(sk, kSmallDynSmem)) != cudaSuccess)
      return e;
  }
  const int dyn = di->smem_optin - (int)kStaticSmemSelect;
  if ((e = raise_smem(k_select<0>, dyn)) != cudaSuccess ||
      (e = raise_smem(k_select<1>, dyn)) != cudaSuccess ||
      (e = raise_smem(k_select<2>, dyn)) != cudaSuccess ||
      (e = raise_smem(k_check_rows, di->smem_optin - 1024)) != cudaSuccess)
    return e;
  for (int i = 0; i < kSelectPaths; ++i) di->occ_smem[i] = (size_t)-1;
  return cudaSuccess;
}

namespace {

// Blocks of a path's kernel resident per multiprocessor with smem bytes of
// dynamic shared memory (cached per device and path for the last smem).
int occupancy(DevInfo *di, SelectPath path, size_t smem) {
  const int i = (int)path;
  std::lock_guard<std::mutex> lock(g_mu);
  if (di->occ_smem[i] == smem) return di->occ_val[i];
  int nb = 1;
  const unsigned nt = select_threads(path);
  cudaError_t e;
  switch (path) {
    case SelectPath::kRowsKeysShared:
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_select<0>, nt, smem);
      break;
    case SelectPath::kRowsKeysGlobal:
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_select<1>, nt, smem);
      break;
    case SelectPath::kActive:
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_select<2>, nt, smem);
      break;
    default:
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, small_kernel(path, false), nt, smem);
      break;
  }
  if (e != cudaSuccess || nb < 1) {
    (void)cudaGetLastError();
    nb = 1;
  }
  di->occ_smem[i] = smem;
  di->occ_val[i] = nb;
  return nb;
}

cudaError_t launch0(void (*kernel)(), cudaStream_t st) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1, 1, 1);
  cfg.blockDim = dim3(1, 1, 1);
  cfg.stream = st;
  return cudaLaunchKernelEx(&cfg, kernel);
}

}  // namespace

namespace {

// k_apply's shape: each block gathers the pairs of `seg` map entries of one
// row (a power of two, 32 to 4096) into shared memory, seg growing until
// the grid is about 8 blocks per SM.
struct ApplyPlan {
  uint32_t seg, nseg;  // entries per block, blocks per row
  uint64_t grid;
};

ApplyPlan plan_apply(uint64_t R, int64_t M, int sms) {
  ApplyPlan p;
  const uint64_t work = R * (uint64_t)M;
  const uint64_t target = (uint64_t)sms * 8u;
  uint64_t seg = 32;
  while (seg < 4096 && seg * target < work) seg <<= 1;
  p.seg = (uint32_t)seg;
  p.nseg = (uint32_t)((M + (int64_t)seg - 1) / (int64_t)seg);
  p.grid = R * p.nseg;
  return p;
}

}  // namespace

imoe_status launch_apply_groups(const char *fn, const imoe_view *buffers, int first, int num_buffers,
                                const CallRows &pl, size_t buf_st0, const InView &map, int kind, int64_t M,
                                bool swap, uint32_t token, int nverdict, bool pdl_first, DevInfo *di,
                                cudaStream_t st, imoe_error *err) {
  if (first >= num_buffers || M <= 0) return IMOE_OK;
  ApplyParams ap;
  memset(&ap, 0, sizeof ap);
  ap.lead = pl.lead;
  ap.M = M;
  ap.kind = kind;
  ap.swap = swap ? 1 : 0;
  ap.token = token;
  ap.nverdict = nverdict;
  ap.map = map;
  const ApplyPlan plan = plan_apply(pl.R, M, di->sms);
  ap.seg = plan.seg;
  ap.nseg = plan.nseg;
  const uint64_t grid = plan.grid;
  if (grid > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  bool pdl = pdl_first;
  for (int g = first; g < num_buffers; g += kMaxBuf) {
    const int nb = std::min(kMaxBuf, num_buffers - g);
    ap.nbuf = nb;
    for (int b = 0; b < nb; ++b) ap.buf[b] = buf_desc(&buffers[g + b], pl.st[buf_st0 + g + b], pl.lead.nd);
    ap.pdl = pdl ? 1 : 0;
    const cudaError_t e =
        launch(k_apply, shape((unsigned)grid, kApplyThreads, (size_t)plan.seg * sizeof(int2), pdl), st, ap);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_apply", e);
    pdl = false;
  }
  return IMOE_OK;
}

namespace {

// The grid of a check kernel that works in pieces (k_check_nan, k_check_tm):
// R rows of n entries in pieces of `per`, grid-strided over at most
// kVerdicts blocks, one verdict word each. Fills q's shape fields and the
// block count; false when the pieces do not fit one launch.
template <class P>
bool plan_pieces(const CallRows &pl, int64_t n, int64_t per, uint32_t token, P *q, int *nverdict) {
  q->lead = pl.lead;
  q->N = n;
  q->per = per;
  q->bpr = (uint32_t)((n + per - 1) / per);
  q->token = token;
  const uint64_t items = pl.R * q->bpr;
  if (items > 0x7FFFFFFFull) return false;
  q->items = (uint32_t)items;
  *nverdict = (int)std::min<uint64_t>(items, kVerdicts);
  return true;
}

// The NaN check kernel of a call (read-only): every score of every row.
imoe_status launch_nan_check(const char *fn, const CallRows &pl, int64_t N, const imoe_view *scores,
                             uint32_t token, cudaStream_t st, int *nverdict, imoe_error *err) {
  NanParams np;
  memset(&np, 0, sizeof np);
  np.scores = in_view(scores, pl.st[0], pl.lead.nd);
  // Dense scores (slots contiguous, rows one after another, 16-byte aligned
  // 16- or 32-bit): one flat row of R x N scores, read as 16-byte vectors.
  const int64_t es = dtype_size(scores->dtype);
  bool dense = (es == 2 || es == 4) && scores->n_stride == es && (uintptr_t)scores->data % 16 == 0;
  int64_t next = N * es;
  for (int d = pl.lead.nd - 1; d >= 0 && dense; --d) {
    if (pl.lead.shape[d] > 1 && pl.st[0].s[d] != next) dense = false;
    next *= (int64_t)pl.lead.shape[d];
  }
  if (dense) {
    CallRows flat;
    flat.lead = Lead();
    memset(&flat.lead, 0, sizeof flat.lead);
    flat.R = 1;
    np.vec = 1;
    np.scores.lead = Strides();
    memset(&np.scores.lead, 0, sizeof np.scores.lead);
    if (!plan_pieces(flat, (int64_t)pl.R * N, 32768, token, &np, nverdict))
      return fail(err, IMOE_ERR_ARGUMENT, "%s: too many scores for one launch", fn);
  } else if (!plan_pieces(pl, N, 2048, token, &np, nverdict)) {
    return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  }
  // 1024 threads of dense scores keep 128 KiB of loads in flight per multiprocessor
  const cudaError_t e = launch(k_check_nan, shape((unsigned)*nverdict, dense ? 1024 : 256, 0, false), st, np);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_check_nan", e);
  return IMOE_OK;
}

// ------------------------------------------------------------ the select plan
// How a select_and_move call validates its data before anything is written.
enum class SelectCheck {
  kNone,        // nothing to check (scores under IMOE_NAN_LOWEST)
  kActiveRows,  // k_check_rows over the active indices, first
  kNanKernel,   // k_check_nan over every score, first
  kNanInSelect, // the select checks its rows itself (k_select_wide, or k_select_small in a
                 // cooperative launch) when its grid can be resident at once; else k_check_nan
};

// What the plan needs to know of a call (host values only).
struct SelectCall {
  int64_t N;  // < 0: unknown (active indices without a target map or buffers)
  int64_t Cp, K;
  uint64_t R;
  bool scores;  // scores (else active indices)
  bool validate;  // a data error is possible: NaN under IMOE_NAN_ERROR, or active indices
  bool verdict;  // the caller reads the validation's verdict words later (ordered compaction)
  bool moves;  // buffers to move (compact, and the map is not the identity)
  bool disjoint;  // every buffer disjoint from the selection and the outputs
  bool swap;
  int64_t pair_bytes;  // bytes a pair moves over every buffer (read + write)
};

// The launches of a select_and_move call: a pure function of the call and
// the device (plan_select), completed with the chosen kernel's occupancy
// when it needs one (plan_select_grid).
struct SelectPlan {
  SelectCheck check;
  // k_select_wide first (a few long rows with scores; cooperative): when the
  // launch is refused, the path below
  bool try_wide;
  LaunchShape wide;
  int32_t wide_nblk, wide_cap;
  bool wide_fused;  // the wide kernel moves the first kMaxBuf buffers itself
  // the path otherwise
  SelectPath path;
  size_t smem;
  int32_t cap;  // ring (k_select) or H, T (k_select_small) entries
  int32_t nk;  // kRowsKeysShared: keys in shared memory
  int32_t win_bits;  // kActive: bits per window of the kept bitmap
  int32_t two_win;  // kActive: one window per phase
  bool fused;  // the select kernel moves the first kMaxBuf buffers itself
  bool needs_occupancy;
  // from the occupancy (plan_select_grid)
  int64_t nblk;  // blocks per row
  uint64_t grid;
  bool coop_nan;  // kNanInSelect with a small path whose grid fits: one cooperative launch
  bool move5;  // the five-load movers (moves, not swaps)
};

SelectPlan plan_select(const SelectCall &c, const DevInfo &di) {
  SelectPlan p;
  memset(&p, 0, sizeof p);
  const int64_t N = c.N, Cp = c.Cp;
  // A few long rows: k_select_wide spreads each row over the GPU (cooperative
  // launch; it checks for NaN itself). Ordered compactions keep the check
  // kernel, whose verdict words their later kernels read.
  p.try_wide = c.scores && N > kSmallMaxN && Cp > 0 && Cp < N && di.coop &&
               c.R <= (uint64_t)std::min(kWideMaxRows, di.sms) && (!c.verdict || !c.validate);
  if (!c.validate)
    p.check = SelectCheck::kNone;
  else if (!c.scores)
    p.check = SelectCheck::kActiveRows;
  else if ((N <= kSmallMaxN || p.try_wide) && !c.verdict)
    p.check = SelectCheck::kNanInSelect;
  else
    p.check = SelectCheck::kNanKernel;

  const size_t dyn_max = (size_t)di.smem_optin - kStaticSmemSelect;
  p.cap = (int32_t)std::max<int64_t>(1, std::min<int64_t>(Cp, kListL + kTile));
  const size_t ring_bytes = (size_t)p.cap * 8u;
  if (c.scores && N <= kSmallMaxN) {
    // short rows: keys in registers, holes and tails in two arrays of
    // min(C', N - C') entries (the number of pairs is at most that)
    p.path = N <= 4 * kSelThreads ? SelectPath::kSmall4
                                  : (N <= 8 * kSelThreads ? SelectPath::kSmall8 : SelectPath::kSmall16);
    // many rows: a row per 256 (512) threads, several rows per multiprocessor
    if (c.R >= 2u * (uint64_t)di.sms && N <= 8192)
      p.path = N <= 4096 ? SelectPath::kMany256 : SelectPath::kMany512;
    p.cap = (int32_t)std::max<int64_t>(1, std::min<int64_t>(Cp, N - Cp));
    p.smem = (size_t)p.cap * 8u;
  } else if (c.scores) {
    const int64_t nk = (N + kTile - 1) / kTile * kTile;
    if (N <= 65536 && (size_t)nk * 4u + ring_bytes <= dyn_max) {
      p.path = SelectPath::kRowsKeysShared;
      p.nk = (int32_t)nk;
      p.smem = (size_t)nk * 4u + ring_bytes;
    } else {
      p.path = SelectPath::kRowsKeysGlobal;
      p.smem = ring_bytes;
    }
  } else {
    p.path = SelectPath::kActive;
    const int64_t avail_words = (int64_t)(dyn_max - ring_bytes) / 4;
    if (N >= 0 && (N + 31) / 32 <= avail_words) {
      p.two_win = 0;
      p.win_bits = (int32_t)((N + 31) / 32 * 32);
    } else {
      p.two_win = 1;
      p.win_bits = (int32_t)(((avail_words / 2) * 32) & ~(int64_t)(kTile - 1));
    }
    p.smem = (size_t)(p.win_bits / 32) * 4u * (p.two_win ? 2u : 1u) + ring_bytes;
  }

  // Fused moves need every buffer disjoint from what the selection reads and
  // the map writes (a buffer may be the scores themselves: then the moves run
  // in k_apply, after every block has read its scores). Long rows with few
  // rows move faster in k_apply than in one select block per row.
  const bool fusable = c.moves && c.disjoint;
  if (p.try_wide) {
    // nblk blocks per row, one per SM; each holds at most cap pairs at once
    const int64_t nblk_w = std::max<int64_t>(1, std::min<int64_t>(di.sms, kWideMaxBlocks) / (int64_t)c.R);
    const int64_t per = (std::min(Cp, N - Cp) + nblk_w - 1) / nblk_w;
    p.wide_nblk = (int32_t)nblk_w;
    p.wide_cap = (int32_t)std::max<int64_t>(1, std::min<int64_t>(per, di.wide_cap));
    p.wide_fused = fusable;
    // H, T and the batch of scores
    p.wide = shape((unsigned)(c.R * (uint64_t)nblk_w), kSelThreads, (size_t)p.wide_cap * 8u + 4u * kWideSub,
                   false, true);
  }
  const bool long_rows = p.path == SelectPath::kRowsKeysGlobal || p.path == SelectPath::kActive;
  p.fused = fusable && !(long_rows && c.R < 2u * (uint64_t)di.sms);
  const bool several_blocks = p.fused && (p.path == SelectPath::kRowsKeysShared || is_small(p.path)) && N > 0;
  p.needs_occupancy = several_blocks || (p.check == SelectCheck::kNanInSelect && is_small(p.path));
  p.nblk = 1;
  p.grid = c.R;
  p.move5 = p.fused && !c.swap;
  return p;
}

// The grid of the path, from its kernel's occupancy (blocks per SM; used only
// when p->needs_occupancy).
void plan_select_grid(SelectPlan *p, const SelectCall &c, const DevInfo &di, int occ) {
  if (p->fused && (p->path == SelectPath::kRowsKeysShared || is_small(p->path)) && c.N > 0) {
    // Several blocks per row, each recomputing the row's selection and
    // moving its share of the pairs: the GPU fills even for few rows.
    const int64_t target = (int64_t)di.sms * occ;
    const int64_t hest = std::max<int64_t>(1, c.Cp * (c.N - c.Cp) / c.N);
    int64_t nblk = std::max<int64_t>(1, target / (int64_t)c.R);
    nblk = std::min<int64_t>(nblk, std::max<int64_t>(1, hest * c.pair_bytes / 32768));
    p->nblk = std::min<int64_t>(nblk, 256);
  }
  p->grid = c.R * (uint64_t)p->nblk;
  // Short rows: each select block checks its own row's scores (in its
  // registers anyway) and the blocks meet at a grid barrier before anything
  // is written, instead of a check kernel whose blocks would keep select
  // blocks off their SMs. The barrier needs every block resident at once: a
  // cooperative launch, where the grid fits (NaN counts stay below 2^16, see
  // g_gridbar).
  const uint64_t fit = is_small(p->path) ? (uint64_t)di.sms * (uint64_t)occ : 0u;
  p->coop_nan = p->check == SelectCheck::kNanInSelect && di.coop && p->grid <= fit && p->grid < 32768u;
}

// Whether every buffer is disjoint from the selection (scores or active
// indices) and from the outputs: the condition for moves fused into the
// select kernel. views: 0 selection, 1 indices, 2 target_map, 3.. buffers.
bool buffers_disjoint(const imoe_view *selv, int64_t sel_n, const imoe_view *oi, const imoe_view *otm,
                      const imoe_view *buffers, int num_buffers, const CallRows &pl) {
  uintptr_t slo, shi;
  std::vector<std::pair<uintptr_t, uintptr_t>> ro;
  extent(selv, pl, pl.st[0], sel_n, dtype_size(selv->dtype), &slo, &shi);
  ro.push_back({slo, shi});
  if (oi) {
    extent(oi, pl, pl.st[1], oi->n, dtype_size(oi->dtype), &slo, &shi);
    ro.push_back({slo, shi});
  }
  if (otm) {
    extent(otm, pl, pl.st[2], otm->n, dtype_size(otm->dtype), &slo, &shi);
    ro.push_back({slo, shi});
  }
  for (int b = 0; b < num_buffers; ++b) {
    uintptr_t blo, bhi;
    extent(&buffers[b], pl, pl.st[3 + b], buffers[b].n, buffers[b].row_bytes, &blo, &bhi);
    for (auto &x : ro)
      if (overlaps(blo, bhi, x.first, x.second)) return false;
  }
  return true;
}

// k_check_rows over a call's active indices (kind 1) or caller-given indices
// (kind 2): one block per row, at most kVerdicts blocks.
imoe_status launch_rows_check(const char *fn, const InView &v, const Lead &lead, uint32_t rows, int64_t N,
                              int64_t M, int kind, uint32_t token, const DevInfo *di, cudaStream_t st,
                              int *nverdict, imoe_error *err) {
  RowsParams rp;
  memset(&rp, 0, sizeof rp);
  rp.lead = lead;
  rp.N = N;
  rp.M = M;
  rp.kind = kind;
  rp.v = v;
  rp.token = token;
  const int64_t avail_bits = ((int64_t)(di->smem_optin - 1024) * 8) & ~(int64_t)(kTile - 1);
  const int64_t want =
      kind == 1 ? (N >= 0 ? ((N + 31) & ~(int64_t)31) : avail_bits) : ((N - M + 31) & ~(int64_t)31);
  rp.win_bits = (int32_t)std::max<int64_t>(32, std::min(want, avail_bits));
  rp.rows = rows;
  *nverdict = (int)std::min<uint32_t>(rp.rows, kVerdicts);
  const cudaError_t e =
      launch(k_check_rows, shape((unsigned)*nverdict, kCheckThreads, (size_t)rp.win_bits / 8), st, rp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_check_rows", e);
  return IMOE_OK;
}

}  // namespace

// build_map (num_buffers == 0, do_move false) and compact. `verdict`, when
// given, receives the call's verdict token (0: nothing was validated).
// The launches, in stream order: the check kernel (plan.check), then
// k_select_wide, or k_select / k_select_small (after k_check_nan when the
// select cannot check its rows itself), then k_apply for the buffers the
// select kernel did not move.
imoe_status select_and_move(const char *fn, const imoe_view *buffers, int32_t num_buffers,
                            const imoe_selection *sel, const imoe_view *oi, const imoe_view *otm,
                            bool do_move, imoe_mode mode, const imoe_exec *exec, imoe_error *err,
                            SelectVerdict *verdict) {
  if (verdict) *verdict = SelectVerdict{0u, 0};
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  const imoe_view *scores = sel->scores;
  const imoe_view *active = scores ? nullptr : sel->active;
  if (!do_move) num_buffers = 0;

  int64_t N = -1;
  if (scores)
    N = scores->n;
  else if (otm)
    N = otm->n;
  else if (num_buffers > 0)
    N = buffers[0].n;
  const int64_t K = active ? active->n : 0;
  int64_t Cp;
  if (oi)
    Cp = oi->n;
  else if (active)
    Cp = K;
  else
    Cp = std::min<int64_t>(sel->capacity, N);
  if (N >= 0x7FFFFFFFLL || Cp >= 0x7FFFFFFFLL)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: N = %lld slots: the CUDA path takes N < 2^31", fn, (long long)N);

  // views: 0 selection, 1 indices, 2 target_map, 3.. buffers
  std::vector<const imoe_view *> views;
  views.push_back(scores ? scores : active);
  views.push_back(oi);
  views.push_back(otm);
  for (int b = 0; b < num_buffers; ++b) views.push_back(&buffers[b]);
  const imoe_view *ref = oi ? oi : (otm ? otm : (num_buffers ? &buffers[0] : scores));
  CallRows pl;
  if (!merge_rows(ref, views, &pl)) return fail(err, IMOE_ERR_ARGUMENT, "%s: more than 2^32 - 1 rows", fn);
  if (pl.R == 0 || N == 0) return IMOE_OK;
  const int nd = pl.lead.nd;

  // C' == 0 or C' >= N: the map is the identity and nothing moves
  const bool trivial = N >= 0 && (Cp <= 0 || Cp >= N);
  if (trivial) num_buffers = 0;
  SelectCall call;
  memset(&call, 0, sizeof call);
  call.N = N;
  call.Cp = Cp;
  call.K = K;
  call.R = pl.R;
  call.scores = scores != nullptr;
  call.validate = scores ? sel->nan_policy == IMOE_NAN_ERROR : true;
  call.verdict = verdict != nullptr;
  call.moves = do_move && num_buffers > 0;
  call.swap = mode == IMOE_MODE_SWAP;
  if (call.moves)
    call.disjoint =
        buffers_disjoint(scores ? scores : active, scores ? N : K, oi, otm, buffers, num_buffers, pl);
  for (int b = 0; b < num_buffers; ++b) call.pair_bytes += buffers[b].row_bytes * (call.swap ? 4 : 2);
  SelectPlan plan = plan_select(call, *di);

  const uint32_t token = call.validate ? next_token() : 0u;
  int nverdict = 0;
  const bool pdl_ok = di->cc_major >= 9;
  bool pdl = false;

  // ---- validation (read-only)
  if (plan.check == SelectCheck::kNanKernel) {
    s = launch_nan_check(fn, pl, N, scores, token, st, &nverdict, err);
    if (s != IMOE_OK) return s;
    pdl = pdl_ok;
  } else if (plan.check == SelectCheck::kActiveRows) {
    const bool shared = active->lead_ndim == 0;
    Lead lead = pl.lead;
    if (shared) memset(&lead, 0, sizeof lead);
    s = launch_rows_check(fn, in_view(active, pl.st[0], nd), lead, shared ? 1u : (uint32_t)pl.R, N, K, 1,
                          token, di, st, &nverdict, err);
    if (s != IMOE_OK) return s;
    pdl = pdl_ok;
  }
  if (verdict) *verdict = SelectVerdict{token, nverdict};

  // ---- select + map (+ moves when fused)
  SelParams sp;
  memset(&sp, 0, sizeof sp);
  sp.lead = pl.lead;
  sp.N = N;
  sp.Cp = Cp;
  sp.P = scores ? sel->protected_prefix : 0;
  sp.W = scores ? sel->recent_window : 0;
  sp.K = K;
  sp.scores = in_view(scores, pl.st[0], nd);
  sp.active = in_view(active, pl.st[0], nd);
  sp.has_idx = oi ? 1 : 0;
  sp.has_tm = otm ? 1 : 0;
  if (oi) sp.idx = out_view(oi, pl.st[1], nd);
  if (otm) sp.tm = out_view(otm, pl.st[2], nd);
  sp.swap = call.swap ? 1 : 0;
  sp.token = token;
  sp.nverdict = nverdict;
  sp.cap = plan.cap;
  sp.nk = plan.nk;
  sp.win_bits = plan.win_bits;
  sp.two_win = plan.two_win;

  cudaError_t e = cudaSuccess;
  bool launched = false, fused = false;
  if (plan.try_wide) {
    SelParams wp = sp;
    wp.nblk = plan.wide_nblk;
    wp.cap = plan.wide_cap;
    wp.wslot = (int32_t)((token ? token : next_token()) % kWideSlots);
    wp.fused_nan = plan.check == SelectCheck::kNanInSelect ? 1 : 0;
    wp.nverdict = 0;
    wp.pdl = 0;
    if (plan.wide_fused) {
      wp.do_move = 1;
      wp.nbuf = std::min(num_buffers, kMaxBuf);
      for (int b = 0; b < wp.nbuf; ++b) wp.buf[b] = buf_desc(&buffers[b], pl.st[3 + b], nd);
    }
    e = launch(k_select_wide, plan.wide, st, wp);
    if (e == cudaSuccess) {
      launched = true;
      fused = plan.wide_fused;
      if (plan.check == SelectCheck::kNanInSelect) nverdict = 1;  // block 0 writes the verdict word
    } else {
      (void)cudaGetLastError();  // refused: the paths below
    }
  }

  if (!launched) {
    if (plan.needs_occupancy)
      plan_select_grid(&plan, call, *di, occupancy(di, plan.path, plan.smem));
    else
      plan_select_grid(&plan, call, *di, 1);
    fused = plan.fused;
  }
  if (plan.grid > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  if (!launched) {
    if (plan.fused) {
      sp.do_move = 1;
      sp.nbuf = std::min(num_buffers, kMaxBuf);
      for (int b = 0; b < sp.nbuf; ++b) sp.buf[b] = buf_desc(&buffers[b], pl.st[3 + b], nd);
    }
    sp.nblk = (int32_t)plan.nblk;
    const unsigned grid = (unsigned)plan.grid, block = select_threads(plan.path);
    if (plan.coop_nan) {
      sp.fused_nan = 1;
      sp.nverdict = 0;
      sp.pdl = 0;
      e = launch(small_kernel(plan.path, plan.move5), shape(grid, block, plan.smem, false, true), st, sp);
      if (e == cudaSuccess) {
        launched = true;
        nverdict = 1;  // block 0 writes the verdict word for the call's later kernels
      } else {
        // refused (more blocks than can be resident now, say under MPS): the
        // check kernel instead; an error that is not about the launch's
        // shape shows again in the launches below and is reported there
        (void)cudaGetLastError();
      }
    }
    if (!launched && plan.check == SelectCheck::kNanInSelect) {  // a check kernel first, as for long rows
      sp.fused_nan = 0;
      s = launch_nan_check(fn, pl, N, scores, token, st, &nverdict, err);
      if (s != IMOE_OK) return s;
      pdl = pdl_ok;
      sp.nverdict = nverdict;
    }
  }
  if (!launched) {
    sp.pdl = pdl ? 1 : 0;
    const LaunchShape sh = shape((unsigned)plan.grid, select_threads(plan.path), plan.smem, pdl);
    switch (plan.path) {
      case SelectPath::kRowsKeysShared: e = launch(k_select<0>, sh, st, sp); break;
      case SelectPath::kRowsKeysGlobal: e = launch(k_select<1>, sh, st, sp); break;
      case SelectPath::kActive: e = launch(k_select<2>, sh, st, sp); break;
      default: e = launch(small_kernel(plan.path, plan.move5), sh, st, sp); break;
    }
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_select", e);
  }

  // ---- remaining buffers (or all, unfused): apply the indices just written
  if (do_move && num_buffers > 0) {
    const InView map = in_view(oi, pl.st[1], nd);
    return launch_apply_groups(fn, buffers, fused ? kMaxBuf : 0, num_buffers, pl, 3, map, 0, Cp, call.swap,
                               token, nverdict, false, di, st, err);
  }
  return IMOE_OK;
}

namespace {

// apply_indices in one launch (k_check_apply) when one block does the whole
// call quickly: at most kMaxBuf buffers, kOneBlockEntries indices, a
// duplicate window of kOneBlockWindow slots and kOneBlockBytes of rows named
// by the indices. Larger calls check and move in two launches, over the GPU.
constexpr int64_t kOneBlockEntries = 4096;
constexpr int64_t kOneBlockWindow = 65536;
constexpr uint64_t kOneBlockBytes = 256u << 10;

bool one_block_apply(const CallRows &pl, int64_t N, int64_t M, const imoe_view *buffers, int32_t num_buffers) {
  if (num_buffers > kMaxBuf || M > kOneBlockEntries || pl.R * (uint64_t)M > (uint64_t)kOneBlockEntries ||
      N - M > kOneBlockWindow)
    return false;
  uint64_t row_bytes = 0;
  for (int b = 0; b < num_buffers; ++b) row_bytes += (uint64_t)buffers[b].row_bytes;
  return row_bytes * pl.R * (uint64_t)M <= kOneBlockBytes;
}

imoe_status launch_check_apply(const char *fn, const imoe_view *buffers, int32_t num_buffers, const CallRows &pl,
                               const InView &map, int64_t N, int64_t M, bool swap, cudaStream_t st,
                               imoe_error *err) {
  CheckApplyParams cp;
  memset(&cp, 0, sizeof cp);
  cp.lead = pl.lead;
  cp.N = N;
  cp.M = M;
  cp.win_bits = (int32_t)std::max<int64_t>(32, (N - M + 31) & ~(int64_t)31);
  cp.swap = swap ? 1 : 0;
  cp.nbuf = num_buffers;
  cp.rows = (uint32_t)pl.R;
  cp.map = map;
  for (int b = 0; b < num_buffers; ++b) cp.buf[b] = buf_desc(&buffers[b], pl.st[1 + b], pl.lead.nd);
  const size_t smem = (size_t)M * 2 * sizeof(int32_t) + (size_t)cp.win_bits / 8;
  const cudaError_t e = launch(k_check_apply, shape(1u, kApplyThreads, smem), st, cp);
  if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_check_apply", e);
  return IMOE_OK;
}

imoe_status apply_map(const char *fn, const imoe_view *buffers, int32_t num_buffers, const imoe_view *map,
                      int kind, imoe_mode mode, const imoe_exec *exec, imoe_error *err) {
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_status s = enter(exec, fn, err, &guard, &di);
  if (s != IMOE_OK) return s;
  if (num_buffers <= 0) return IMOE_OK;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  const int64_t N = buffers[0].n;
  const int64_t M = map->n;
  if (N >= 0x7FFFFFFFLL)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: N = %lld slots: the CUDA path takes N < 2^31", fn, (long long)N);
  std::vector<const imoe_view *> views;
  views.push_back(map);
  for (int b = 0; b < num_buffers; ++b) views.push_back(&buffers[b]);
  CallRows pl;
  if (!merge_rows(map, views, &pl)) return fail(err, IMOE_ERR_ARGUMENT, "%s: more than 2^32 - 1 rows", fn);
  if (pl.R == 0 || N == 0 || M == 0) return IMOE_OK;
  const int nd = pl.lead.nd;
  const uint32_t token = next_token();
  int nverdict = 0;
  const InView mv = in_view(map, pl.st[0], nd);
  cudaError_t e;
  if (kind == 0 && one_block_apply(pl, N, M, buffers, num_buffers))
    return launch_check_apply(fn, buffers, num_buffers, pl, mv, N, M, mode == IMOE_MODE_SWAP, st, err);
  if (kind == 0) {
    if (pl.R > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
    s = launch_rows_check(fn, mv, pl.lead, (uint32_t)pl.R, N, M, 2, token, di, st, &nverdict, err);
    if (s != IMOE_OK) return s;
  } else {
    TmParams tp;
    memset(&tp, 0, sizeof tp);
    tp.tm = mv;
    if (!plan_pieces(pl, M, 4096, token, &tp, &nverdict))
      return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
    e = launch(k_check_tm, shape((unsigned)nverdict, 256, 0, false), st, tp);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_check_tm", e);
  }
  return launch_apply_groups(fn, buffers, 0, num_buffers, pl, 1, mv, kind, M, mode == IMOE_MODE_SWAP, token,
                             nverdict, di->cc_major >= 9, di, st, err);
}

}  // namespace

}  // namespace imoe_cu

using namespace imoe_cu;

extern "C" {

int imoe_backend_has_cuda(void) { return 1; }

imoe_status imoe_cuda_build_map(const imoe_selection *sel, const imoe_view *out_indices,
                                const imoe_view *out_target_map, const imoe_exec *exec, imoe_error *err) {
  return select_and_move("imoe_cuda_build_map", nullptr, 0, sel, out_indices, out_target_map, false,
                         IMOE_MODE_SWAP, exec, err);
}

imoe_status imoe_cuda_compact(const imoe_view *buffers, int32_t num_buffers, const imoe_selection *sel,
                              const imoe_view *out_indices, const imoe_view *out_target_map, imoe_mode mode,
                              const imoe_exec *exec, imoe_error *err) {
  return select_and_move("imoe_cuda_compact", buffers, num_buffers, sel, out_indices, out_target_map, true,
                         mode, exec, err);
}

imoe_status imoe_cuda_apply_indices(const imoe_view *buffers, int32_t num_buffers, const imoe_view *indices,
                                    imoe_mode mode, const imoe_exec *exec, imoe_error *err) {
  return apply_map("imoe_cuda_apply_indices", buffers, num_buffers, indices, 0, mode, exec, err);
}

imoe_status imoe_cuda_apply_target_map(const imoe_view *buffers, int32_t num_buffers,
                                       const imoe_view *target_map, imoe_mode mode, const imoe_exec *exec,
                                       imoe_error *err) {
  return apply_map("imoe_cuda_apply_target_map", buffers, num_buffers, target_map, 1, mode, exec, err);
}

imoe_status imoe_cuda_read_device_status(const imoe_exec *exec, int32_t *status_out) {
  DeviceGuard guard;
  DevInfo *di = nullptr;
  imoe_error err;
  imoe_status s = enter(exec, "imoe_cuda_read_device_status", &err, &guard, &di);
  if (s != IMOE_OK) return s;
  cudaStream_t st = static_cast<cudaStream_t>(exec->stream);
  cudaError_t e = launch0(k_take_status, st);
  if (e != cudaSuccess) return IMOE_ERR_DEVICE;
  int v = 0;
  e = cudaMemcpyFromSymbolAsync(&v, g_status_taken, sizeof(int), 0, cudaMemcpyDeviceToHost, st);
  if (e != cudaSuccess) return IMOE_ERR_DEVICE;
  e = cudaStreamSynchronize(st);
  if (e != cudaSuccess) return IMOE_ERR_DEVICE;
  if (status_out) *status_out = v;
  return IMOE_OK;
}

}  // extern "C"
