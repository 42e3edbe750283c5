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

// k_select_small for rows of at most 4096, 8192 and 16384 slots (src 3, 4,
// 5: 1024 threads), and for many rows of at most 4096 and 8192 slots (src
// 6, 7: 256 and 512 threads, several blocks per multiprocessor). Calls that
// move (not swap) take the kernels whose movers keep five loads in flight
// per thread: each kernel has its own copy of the mover, allocated by ptxas
// on its own, so neither loop spills (cuda/NOTES.md, run 63).
constexpr int kSmallKernels = 5;  // src 3 .. 7
typedef void (*SmallKernel)(SelParams);
SmallKernel small_kernel(int src, bool move5) {
  if (src == 3) return move5 ? k_select_small<4, true> : k_select_small<4, false>;
  if (src == 4) return move5 ? k_select_small<8, true> : k_select_small<8, false>;
  if (src == 6) return move5 ? k_select_small<16, true, 256> : k_select_small<16, false, 256>;
  if (src == 7) return move5 ? k_select_small<16, true, 512> : k_select_small<16, false, 512>;
  return move5 ? k_select_small<16, true> : k_select_small<16, false>;
}
int small_threads(int src) { return src == 6 ? 256 : (src == 7 ? 512 : kSelThreads); }

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
  di->words.verdict = static_cast<unsigned(*)[kVerdicts]>(verdict);
  *what = "cudaFuncSetAttribute";
  di->wide_cap = std::max(1, std::min(kWideMaxCap, (di->smem_optin - kStaticSmemWide - 4 * kWideSub) / 8));
  // One shared-memory carveout for every kernel: a kernel launched early
  // (PDL) can then share a multiprocessor with the one before it.
  const int carve = cudaSharedmemCarveoutMaxShared;
  if ((e = cudaFuncSetAttribute(k_select<0>, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) != cudaSuccess ||
      (e = cudaFuncSetAttribute(k_select<1>, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) != cudaSuccess ||
      (e = cudaFuncSetAttribute(k_select<2>, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) != cudaSuccess ||
      (e = cudaFuncSetAttribute(k_check_rows, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) != cudaSuccess ||
      (e = cudaFuncSetAttribute(k_check_nan, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) != cudaSuccess ||
      (e = cudaFuncSetAttribute(k_check_tm, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) != cudaSuccess ||
      (e = cudaFuncSetAttribute(k_apply, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) != cudaSuccess ||
      (e = cudaFuncSetAttribute(k_select_wide, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) !=
          cudaSuccess ||
      (e = raise_smem(k_select_wide, 8 * di->wide_cap + 4 * kWideSub)) != cudaSuccess)
    return e;
  for (int k = 0; k < 2 * kSmallKernels; ++k) {
    const SmallKernel sk = small_kernel(3 + k % kSmallKernels, k >= kSmallKernels);
    if ((e = cudaFuncSetAttribute(sk, cudaFuncAttributePreferredSharedMemoryCarveout, carve)) != cudaSuccess ||
        (e = raise_smem(sk, kSmallDynSmem)) != cudaSuccess)
      return e;
  }
  const int dyn = di->smem_optin - (int)kStaticSmemSelect;
  if ((e = raise_smem(k_select<0>, dyn)) != cudaSuccess || (e = raise_smem(k_select<1>, dyn)) != cudaSuccess ||
      (e = raise_smem(k_select<2>, dyn)) != cudaSuccess ||
      (e = raise_smem(k_check_rows, di->smem_optin - 1024)) != cudaSuccess)
    return e;
  for (int i = 0; i < 3 + kSmallKernels; ++i) di->occ_smem[i] = (size_t)-1;
  return cudaSuccess;
}

namespace {

int occupancy(DevInfo *di, int src, size_t smem) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (di->occ_smem[src] == smem) return di->occ_val[src];
  int nb = 1;
  cudaError_t e;
  if (src == 0) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_select<0>, kSelThreads, smem);
  else if (src == 1) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_select<1>, kSelThreads, smem);
  else if (src == 2) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_select<2>, kSelThreads, smem);
  else e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, small_kernel(src, false), small_threads(src), smem);
  if (e != cudaSuccess || nb < 1) {
    (void)cudaGetLastError();
    nb = 1;
  }
  di->occ_smem[src] = smem;
  di->occ_val[src] = nb;
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

// Apply kernels for buffer groups [first, num_buffers), each of kMaxBuf.
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
  const uint64_t work = pl.R * (uint64_t)M;
  const uint64_t target = (uint64_t)di->sms * 8u;
  uint64_t seg = 32;
  while (seg < 4096 && seg * target < work) seg <<= 1;
  ap.seg = (uint32_t)seg;
  ap.nseg = (uint32_t)((M + (int64_t)seg - 1) / (int64_t)seg);
  const uint64_t grid = pl.R * ap.nseg;
  if (grid > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  bool pdl = pdl_first;
  for (int g = first; g < num_buffers; g += kMaxBuf) {
    const int nb = std::min(kMaxBuf, num_buffers - g);
    ap.nbuf = nb;
    for (int b = 0; b < nb; ++b) ap.buf[b] = buf_desc(&buffers[g + b], pl.st[buf_st0 + g + b], pl.lead.nd);
    ap.pdl = pdl ? 1 : 0;
    const cudaError_t e = launch(k_apply, shape((unsigned)grid, kApplyThreads, (size_t)seg * sizeof(int2), pdl), st, ap);
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
imoe_status launch_nan_check(const char *fn, const CallRows &pl, int64_t N, const imoe_view *scores, uint32_t token,
                             cudaStream_t st, int *nverdict, imoe_error *err) {
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

}  // namespace

// build_map (num_buffers == 0, do_move false) and compact. `verdict`, when
// given, receives the call's verdict token (0: nothing was validated).
imoe_status select_and_move(const char *fn, const imoe_view *buffers, int32_t num_buffers,
                            const imoe_selection *sel, const imoe_view *oi, const imoe_view *otm, bool do_move,
                            imoe_mode mode, const imoe_exec *exec, imoe_error *err,
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
  if (scores) N = scores->n;
  else if (otm) N = otm->n;
  else if (num_buffers > 0) N = buffers[0].n;
  const int64_t K = active ? active->n : 0;
  int64_t Cp;
  if (oi) Cp = oi->n;
  else if (active) Cp = K;
  else Cp = std::min<int64_t>(sel->capacity, N);
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

  const bool validate = scores ? sel->nan_policy == IMOE_NAN_ERROR : true;
  const uint32_t token = validate ? next_token() : 0u;
  // A few long rows: k_select_wide spreads each row over the GPU (cooperative
  // launch; it checks for NaN itself). Ordered compactions keep the check
  // kernel, whose verdict words their later kernels read.
  const bool wide_try = scores && N > kSmallMaxN && Cp > 0 && Cp < N && di->coop &&
                        pl.R <= (uint64_t)std::min(kWideMaxRows, di->sms) && (verdict == nullptr || !validate);
  int nverdict = 0;
  const bool pdl_ok = di->cc_major >= 9;
  bool pdl = false;

  // ---- validation (read-only). A NaN check that k_select_small can do
  // itself is decided below, once the select's grid is known.
  bool nan_pending = false;
  if (validate && scores && (N <= kSmallMaxN || wide_try) && verdict == nullptr) {
    nan_pending = true;
  } else if (validate && scores) {
    s = launch_nan_check(fn, pl, N, scores, token, st, &nverdict, err);
    if (s != IMOE_OK) return s;
    pdl = pdl_ok;
  } else if (validate) {
    RowsParams rp;
    memset(&rp, 0, sizeof rp);
    const bool shared = active->lead_ndim == 0;
    rp.lead = shared ? Lead() : pl.lead;
    if (shared) memset(&rp.lead, 0, sizeof rp.lead);
    rp.N = N;
    rp.M = K;
    rp.kind = 1;
    rp.v = in_view(active, pl.st[0], nd);
    rp.token = token;
    const int64_t avail_bits = ((int64_t)(di->smem_optin - 1024) * 8) & ~(int64_t)(kTile - 1);
    const int64_t want = N >= 0 ? ((N + 31) & ~(int64_t)31) : avail_bits;
    rp.win_bits = (int32_t)std::max<int64_t>(32, std::min(want, avail_bits));
    rp.rows = shared ? 1u : (uint32_t)pl.R;
    nverdict = (int)std::min<uint32_t>(rp.rows, kVerdicts);
    const cudaError_t e =
        launch(k_check_rows, shape((unsigned)nverdict, kCheckThreads, (size_t)rp.win_bits / 8, false), st, rp);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_check_rows", e);
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
  sp.swap = mode == IMOE_MODE_SWAP ? 1 : 0;
  sp.token = token;
  sp.nverdict = nverdict;
  sp.cap = (int32_t)std::max<int64_t>(1, std::min<int64_t>(Cp, kListL + kTile));
  const size_t ring_bytes = (size_t)sp.cap * 8u;
  const size_t dyn_max = (size_t)di->smem_optin - kStaticSmemSelect;

  int src;
  size_t smem;
  if (scores && N <= kSmallMaxN) {
    // short rows: keys in registers, holes and tails in two arrays of
    // min(C', N - C') entries (the number of pairs is at most that)
    src = N <= 4 * kSelThreads ? 3 : (N <= 8 * kSelThreads ? 4 : 5);
    // many rows: a row per 256 (512) threads, several rows per multiprocessor
    if (pl.R >= 2u * (uint64_t)di->sms && N <= 8192) src = N <= 4096 ? 6 : 7;
    sp.cap = (int32_t)std::max<int64_t>(1, std::min<int64_t>(Cp, N - Cp));
    smem = (size_t)sp.cap * 8u;
  } else if (scores) {
    const int64_t nk = (N + kTile - 1) / kTile * kTile;
    if (N <= 65536 && (size_t)nk * 4u + ring_bytes <= dyn_max) {
      src = 0;
      sp.nk = (int32_t)nk;
      smem = (size_t)nk * 4u + ring_bytes;
    } else {
      src = 1;
      smem = ring_bytes;
    }
  } else {
    src = 2;
    const int64_t avail_words = (int64_t)(dyn_max - ring_bytes) / 4;
    if (N >= 0 && (N + 31) / 32 <= avail_words) {
      sp.two_win = 0;
      sp.win_bits = (int32_t)((N + 31) / 32 * 32);
    } else {
      sp.two_win = 1;
      sp.win_bits = (int32_t)(((avail_words / 2) * 32) & ~(int64_t)(kTile - 1));
    }
    smem = (size_t)(sp.win_bits / 32) * 4u * (sp.two_win ? 2u : 1u) + ring_bytes;
  }

  // Fused moves need every buffer disjoint from what the selection reads and
  // the map writes (a buffer may be the scores themselves: then the moves run
  // in a second kernel, after every block has read its scores).
  // C' == 0 or C' >= N: the map is the identity and nothing moves
  const bool trivial = N >= 0 && (Cp <= 0 || Cp >= N);
  if (trivial) num_buffers = 0;
  bool fused = do_move && num_buffers > 0;
  if (fused) {  // first: every buffer disjoint from the selection and the outputs
    uintptr_t slo, shi;
    std::vector<std::pair<uintptr_t, uintptr_t>> ro;
    const imoe_view *selv = scores ? scores : active;
    const int64_t sel_n = scores ? N : K;
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
    for (int b = 0; b < num_buffers && fused; ++b) {
      uintptr_t blo, bhi;
      extent(&buffers[b], pl, pl.st[3 + b], buffers[b].n, buffers[b].row_bytes, &blo, &bhi);
      for (auto &x : ro)
        if (overlaps(blo, bhi, x.first, x.second)) fused = false;
    }
  }
  cudaError_t e = cudaSuccess;
  bool launched = false;
  if (wide_try) {
    // nblk blocks per row, one per SM; each holds at most cap pairs at once
    const int64_t nblk_w = std::max<int64_t>(1, std::min<int64_t>(di->sms, kWideMaxBlocks) / (int64_t)pl.R);
    const int64_t per = (std::min(Cp, N - Cp) + nblk_w - 1) / nblk_w;
    SelParams wp = sp;
    wp.nblk = (int32_t)nblk_w;
    wp.cap = (int32_t)std::max<int64_t>(1, std::min<int64_t>(per, di->wide_cap));
    wp.wslot = (int32_t)((token ? token : next_token()) % kWideSlots);
    wp.fused_nan = nan_pending ? 1 : 0;
    wp.nverdict = 0;
    wp.pdl = 0;
    if (fused) {
      wp.do_move = 1;
      wp.nbuf = std::min(num_buffers, kMaxBuf);
      for (int b = 0; b < wp.nbuf; ++b) wp.buf[b] = buf_desc(&buffers[b], pl.st[3 + b], nd);
    }
    const size_t smem_w = (size_t)wp.cap * 8u + 4u * kWideSub;  // H, T and the batch of scores
    e = launch(k_select_wide, shape((unsigned)(pl.R * (uint64_t)nblk_w), kSelThreads, smem_w, false, true), st, wp);
    if (e == cudaSuccess) {
      launched = true;
      if (nan_pending) nverdict = 1;  // block 0 writes the verdict word
    } else {
      (void)cudaGetLastError();  // refused: the paths below
    }
  }
  if (fused && !launched && (src == 1 || src == 2) && pl.R < 2u * (uint64_t)di->sms) fused = false;

  int64_t nblk = 1;
  if (fused && !launched) {
    sp.do_move = 1;
    sp.nbuf = std::min(num_buffers, kMaxBuf);
    for (int b = 0; b < sp.nbuf; ++b) sp.buf[b] = buf_desc(&buffers[b], pl.st[3 + b], nd);
    if ((src == 0 || src >= 3) && N > 0) {
      // Several blocks per row, each recomputing the row's selection and
      // moving its share of the pairs: the GPU fills even for few rows.
      const int occ = occupancy(di, src, smem);
      const int64_t target = (int64_t)di->sms * occ;
      const int64_t hest = std::max<int64_t>(1, Cp * (N - Cp) / N);
      int64_t pair_bytes = 0;
      for (int b = 0; b < num_buffers; ++b) pair_bytes += buffers[b].row_bytes * (sp.swap ? 4 : 2);
      nblk = std::max<int64_t>(1, target / (int64_t)pl.R);
      nblk = std::min<int64_t>(nblk, std::max<int64_t>(1, hest * pair_bytes / 32768));
      nblk = std::min<int64_t>(nblk, 256);
    }
  }
  sp.nblk = (int32_t)nblk;
  const uint64_t grid = pl.R * (uint64_t)nblk;
  if (grid > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
  const bool move5 = sp.do_move && !sp.swap;  // k_select_small: the five-load movers
  if (nan_pending && !launched) {
    // Short rows: each select block checks its own row's scores (in its
    // registers anyway) and the blocks meet at a grid barrier before
    // anything is written, instead of a check kernel whose blocks would
    // keep select blocks off their SMs. The barrier needs every block
    // resident at once: a cooperative launch, where the grid fits.
    const uint64_t fit = src >= 3 ? (uint64_t)di->sms * (uint64_t)occupancy(di, src, smem) : 0u;
    if (di->coop && grid <= fit && grid < 32768u) {  // NaN counts stay below 2^16 (see g_gridbar)
      sp.fused_nan = 1;
      sp.nverdict = 0;
      sp.pdl = 0;
      e = launch(small_kernel(src, move5), shape((unsigned)grid, small_threads(src), smem, false, true), st, sp);
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
    if (!launched) {  // a check kernel first, as for long rows
      sp.fused_nan = 0;
      s = launch_nan_check(fn, pl, N, scores, token, st, &nverdict, err);
      if (s != IMOE_OK) return s;
      pdl = pdl_ok;
      sp.nverdict = nverdict;
    }
  }
  if (!launched) {
    sp.pdl = pdl ? 1 : 0;
    if (src == 0) e = launch(k_select<0>, shape((unsigned)grid, kSelThreads, smem, pdl), st, sp);
    else if (src == 1) e = launch(k_select<1>, shape((unsigned)grid, kSelThreads, smem, pdl), st, sp);
    else if (src == 2) e = launch(k_select<2>, shape((unsigned)grid, kSelThreads, smem, pdl), st, sp);
    else e = launch(small_kernel(src, move5), shape((unsigned)grid, small_threads(src), smem, pdl), st, sp);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_select", e);
  }

  // ---- remaining buffers (or all, unfused): apply the indices just written
  if (do_move && num_buffers > 0) {
    const InView map = in_view(oi, pl.st[1], nd);
    return launch_apply_groups(fn, buffers, fused ? kMaxBuf : 0, num_buffers, pl, 3, map, 0, Cp,
                               mode == IMOE_MODE_SWAP, token, nverdict, false, di, st, err);
  }
  return IMOE_OK;
}

namespace {

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
  if (kind == 0) {
    RowsParams rp;
    memset(&rp, 0, sizeof rp);
    rp.lead = pl.lead;
    rp.N = N;
    rp.M = M;
    rp.kind = 2;
    rp.v = mv;
    rp.token = token;
    const int64_t avail_bits = ((int64_t)(di->smem_optin - 1024) * 8) & ~(int64_t)(kTile - 1);
    const int64_t want = (N - M + 31) & ~(int64_t)31;
    rp.win_bits = (int32_t)std::max<int64_t>(32, std::min(want, avail_bits));
    if (pl.R > 0x7FFFFFFFull) return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
    rp.rows = (uint32_t)pl.R;
    nverdict = (int)std::min<uint32_t>(rp.rows, kVerdicts);
    e = launch(k_check_rows, shape((unsigned)nverdict, kCheckThreads, (size_t)rp.win_bits / 8, false), st, rp);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_check_rows", e);
  } else {
    TmParams tp;
    memset(&tp, 0, sizeof tp);
    tp.tm = mv;
    if (!plan_pieces(pl, M, 4096, token, &tp, &nverdict))
      return fail(err, IMOE_ERR_ARGUMENT, "%s: too many rows for one launch", fn);
    e = launch(k_check_tm, shape((unsigned)nverdict, 256, 0, false), st, tp);
    if (e != cudaSuccess) return cuda_fail(err, fn, "launch of k_check_tm", e);
  }
  return launch_apply_groups(fn, buffers, 0, num_buffers, pl, 1, mv, kind, M, mode == IMOE_MODE_SWAP, token, nverdict,
                             di->cc_major >= 9, di, st, err);
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
  return select_and_move("imoe_cuda_compact", buffers, num_buffers, sel, out_indices, out_target_map, true, mode,
                         exec, err);
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
