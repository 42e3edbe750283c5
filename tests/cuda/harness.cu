// tests/cuda/harness.cu: standalone test + benchmark of the CUDA launchers.
//
//   harness [--quick] [--bench] [--cases N] [--seed S]
//   harness --profile        a few W1 calls for Nsight Compute
//   harness --phases         W1 with per-phase stamps (a -DIMOE_PHASE_TIMES build:
//                            ARCH=sm_90 and the nvcc line of run.sh plus that flag)
//   harness --launch         what a launch costs in event time, by block shape,
//                            shared memory, carveout and cooperative launch
//
// Diagnosis only, for --bench and --phases (environment variables):
//   IMOE_BENCH_NOFLUSH=1     no L2 flush between calls (a warm L2)
//   IMOE_BENCH_SPIN=C        one thread spins C cycles after the flush, before
//                            the timed call (as the Python benchmark's spin)
//   IMOE_BENCH_IDX64=1       int64 indices, as torch callers pass them
//   IMOE_PHASE_LONG=1        --phases times one row of 131072 slots (k_select_wide)
//   IMOE_BENCH_SCORES=FILE   float32 scores [R, N] from FILE for the workload of
//                            that size (say the Python benchmark's draw)
//   IMOE_PHASE_DUMP=1        --phases also prints every block's stamps, SM and
//                            number of pairs
//
// (1) A plain CPU reference of select + map + apply (sort-based, written
//     here, independent of the kernels' radix select and key tricks).
// (2) Random cases checked bit for bit: every view lives inside a poisoned
//     "arena", and the whole arena is compared after each call, so writes
//     outside a view are caught too. Error paths, streams, graph capture.
// (3) --bench: W1, W2, W3 of docs/results.md#workloads with CUDA events, and a
//     device-to-device copy for the floor.
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "imoe_backend.h"

#define CK(x)                                                                                    \
  do {                                                                                           \
    cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                     \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));        \
      exit(2);                                                                                   \
    }                                                                                            \
  } while (0)

// ------------------------------------------------------------ random
static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd() {
  uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static int64_t rint_(int64_t lo, int64_t hi) { return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1)); }
static double runif() { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); }
template <class T>
static T pick(const std::vector<T> &v) {
  return v[rnd() % v.size()];
}

// ------------------------------------------------------------ score values
static double half_to_double(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0) v = ldexp((double)m, -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = ldexp((double)(m | 1024), e - 25);
  return s ? -v : v;
}
static double score_value(const uint8_t *p, imoe_dtype dt) {
  if (dt == IMOE_DTYPE_F32) {
    float f;
    memcpy(&f, p, 4);
    return (double)f;
  }
  uint16_t h;
  memcpy(&h, p, 2);
  if (dt == IMOE_DTYPE_F16) return half_to_double(h);
  const uint32_t b = (uint32_t)h << 16;
  float f;
  memcpy(&f, &b, 4);
  return (double)f;
}
static size_t dsize(imoe_dtype dt) {
  switch (dt) {
    case IMOE_DTYPE_F32: return 4;
    case IMOE_DTYPE_F16: return 2;
    case IMOE_DTYPE_BF16: return 2;
    case IMOE_DTYPE_I32: return 4;
    case IMOE_DTYPE_I64: return 8;
    default: return 1;
  }
}
// Random score bits: kind 0 continuous, 1 few distinct values (ties),
// 2 signed zeros and infinities mixed with ties, 3 like 1 plus NaNs.
static void gen_score(uint8_t *p, imoe_dtype dt, int kind, const std::vector<uint32_t> &pool) {
  uint32_t bits;
  if (kind == 0) {
    if (dt == IMOE_DTYPE_F32) {
      float f = (float)(runif() * 2.0 - 1.0);
      memcpy(&bits, &f, 4);
    } else {
      do {
        bits = (uint32_t)(rnd() & 0xFFFF);
      } while (dt == IMOE_DTYPE_F16 ? (bits & 0x7C00) == 0x7C00 : (bits & 0x7F80) == 0x7F80);
    }
  } else {
    bits = pick(pool);
  }
  if (dt == IMOE_DTYPE_F32) memcpy(p, &bits, 4);
  else {
    uint16_t h = (uint16_t)bits;
    memcpy(p, &h, 2);
  }
}
static std::vector<uint32_t> score_pool(imoe_dtype dt, int kind) {
  std::vector<uint32_t> pool;
  const bool f32 = dt == IMOE_DTYPE_F32;
  const int n = (int)rint_(1, 6);
  for (int i = 0; i < n; ++i) {
    if (f32) {
      float f = (float)rint_(-3, 3) * 0.5f;
      uint32_t b;
      memcpy(&b, &f, 4);
      pool.push_back(b);
    } else {
      pool.push_back((uint32_t)(rnd() & 0xFFFF) & (dt == IMOE_DTYPE_F16 ? 0xBBFFu : 0xBF7Fu));
    }
  }
  if (kind >= 2) {  // +0, -0, +inf, -inf
    pool.push_back(0u);
    pool.push_back(f32 ? 0x80000000u : 0x8000u);
    pool.push_back(f32 ? 0x7F800000u : (dt == IMOE_DTYPE_F16 ? 0x7C00u : 0x7F80u));
    pool.push_back(f32 ? 0xFF800000u : (dt == IMOE_DTYPE_F16 ? 0xFC00u : 0xFF80u));
  }
  if (kind == 3) {  // NaNs of both signs and payloads
    pool.push_back(f32 ? 0x7FC00000u : (dt == IMOE_DTYPE_F16 ? 0x7E00u : 0x7FC0u));
    pool.push_back(f32 ? 0xFFC00001u : (dt == IMOE_DTYPE_F16 ? 0xFE01u : 0xFFC1u));
  }
  return pool;
}

// ------------------------------------------------------------ arenas / views
struct Arena {
  std::vector<uint8_t> host;  // expected image
  std::vector<uint8_t> orig;  // image before the call
  uint8_t *dev = nullptr;
};
struct View {
  int arena = -1;
  int64_t off = 0;
  imoe_view v;
};
struct World {
  std::vector<Arena> arenas;
  ~World() {
    for (auto &a : arenas)
      if (a.dev) cudaFree(a.dev);
  }
  void upload() {
    for (auto &a : arenas) {
      if (!a.dev) CK(cudaMalloc(&a.dev, a.host.size()));
      CK(cudaMemcpy(a.dev, a.host.data(), a.host.size(), cudaMemcpyHostToDevice));
      a.orig = a.host;
    }
  }
  void reupload_orig() {
    for (auto &a : arenas) {
      CK(cudaMemcpy(a.dev, a.orig.data(), a.orig.size(), cudaMemcpyHostToDevice));
      a.host = a.orig;
    }
  }
  // compares device arenas with the expected images; returns first mismatch or -1
  bool check(const char *what, std::string *msg) {
    for (size_t i = 0; i < arenas.size(); ++i) {
      std::vector<uint8_t> got(arenas[i].host.size());
      CK(cudaMemcpy(got.data(), arenas[i].dev, got.size(), cudaMemcpyDeviceToHost));
      if (got != arenas[i].host) {
        size_t j = 0;
        while (got[j] == arenas[i].host[j]) ++j;
        char b[256];
        snprintf(b, sizeof b, "%s: arena %zu differs at byte %zu of %zu (got %d want %d, orig %d)", what, i, j,
                 got.size(), got[j], arenas[i].host[j], arenas[i].orig[j]);
        *msg = b;
        return false;
      }
    }
    return true;
  }
};

struct Lead {
  int nd = 0;
  int64_t shape[IMOE_MAX_LEAD_DIMS];
  int64_t R = 1;
};

static void fill_random(std::vector<uint8_t> &v) {
  size_t i = 0;
  for (; i + 8 <= v.size(); i += 8) {
    const uint64_t x = rnd();
    memcpy(&v[i], &x, 8);
  }
  for (; i < v.size(); ++i) v[i] = (uint8_t)rnd();
}

// A view [lead..., n, row] placed in a new arena. weird: permuted axis
// order, padding, negative strides, misaligned base.
static View make_view(World &w, const Lead &L, bool per_row, int64_t n, int64_t row_bytes, int64_t align,
                      imoe_dtype dt, bool weird) {
  const int nd = per_row ? L.nd : 0;
  const int na = nd + 1;
  int64_t sizes[IMOE_MAX_LEAD_DIMS + 1];
  for (int a = 0; a < nd; ++a) sizes[a] = L.shape[a];
  sizes[nd] = n;
  int order[IMOE_MAX_LEAD_DIMS + 1];
  for (int a = 0; a < na; ++a) order[a] = a;
  if (weird && rnd() % 3 == 0)
    for (int a = na - 1; a > 0; --a) std::swap(order[a], order[rnd() % (a + 1)]);
  int64_t stride[IMOE_MAX_LEAD_DIMS + 1];
  int64_t st = (row_bytes + align - 1) / align * align;
  if (weird && rnd() % 2) st += align * rint_(0, 2);
  for (int k = na - 1; k >= 0; --k) {
    const int a = order[k];
    stride[a] = st;
    st = st * std::max<int64_t>(sizes[a], 1);
    if (weird && rnd() % 3 == 0) st += align * rint_(0, 3);
  }
  int64_t shift = 0;
  for (int a = 0; a < na; ++a) {
    if (weird && rnd() % 4 == 0 && sizes[a] > 1) {
      shift += (sizes[a] - 1) * stride[a];
      stride[a] = -stride[a];
    }
  }
  int64_t mis = 0;
  if (weird) mis = align == 1 ? rint_(0, 15) : align * rint_(0, 3);
  const int64_t guard = 64;
  Arena A;
  A.host.resize((size_t)(guard + st + mis + guard + 16));
  fill_random(A.host);
  w.arenas.push_back(std::move(A));
  View V;
  V.arena = (int)w.arenas.size() - 1;
  V.off = guard + shift + mis;
  memset(&V.v, 0, sizeof V.v);
  V.v.lead_ndim = nd;
  for (int a = 0; a < nd; ++a) {
    V.v.lead_shape[a] = sizes[a];
    V.v.lead_stride[a] = stride[a];
  }
  V.v.n = n;
  V.v.n_stride = stride[nd];
  V.v.row_bytes = row_bytes;
  V.v.dtype = dt;
  return V;
}
static void bind(World &w, View &V) { V.v.data = w.arenas[V.arena].dev + V.off; }

// byte offset (from the arena start) of slot x of row r
static int64_t at(const View &V, int64_t r, int64_t x) {
  int64_t o = V.off;
  for (int d = V.v.lead_ndim - 1; d >= 0; --d) {
    const int64_t s = V.v.lead_shape[d];
    o += (r % s) * V.v.lead_stride[d];
    r /= s;
  }
  return o + x * V.v.n_stride;
}
static uint8_t *hptr(World &w, const View &V, int64_t r, int64_t x) { return &w.arenas[V.arena].host[at(V, r, x)]; }
static int64_t get_index(World &w, const View &V, int64_t r, int64_t x) {
  const uint8_t *p = hptr(w, V, r, x);
  if (V.v.dtype == IMOE_DTYPE_I64) {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
  }
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}
static void set_index(World &w, const View &V, int64_t r, int64_t x, int64_t val) {
  uint8_t *p = hptr(w, V, r, x);
  if (V.v.dtype == IMOE_DTYPE_I64) memcpy(p, &val, 8);
  else {
    int32_t v = (int32_t)val;
    memcpy(p, &v, 4);
  }
}

// ------------------------------------------------------------ reference
// kept[x] for one row from scores: top-C by value, ties to the lower index,
// -0 == +0, NaN below everything; prefix P and window W always kept.
static void ref_select_scores(World &w, const View &S, int64_t r, int64_t N, int64_t C, int64_t P, int64_t W,
                              std::vector<char> &kept) {
  kept.assign((size_t)N, 0);
  if (C >= N) {
    std::fill(kept.begin(), kept.end(), 1);
    return;
  }
  std::vector<double> val((size_t)N);
  for (int64_t x = 0; x < N; ++x) val[x] = score_value(hptr(w, S, r, x), S.v.dtype);
  std::vector<int64_t> cand;
  for (int64_t x = P; x < N - W; ++x) cand.push_back(x);
  std::sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) {
    const double va = val[a], vb = val[b];
    const bool na = std::isnan(va), nb = std::isnan(vb);
    if (na || nb) {
      if (na && nb) return a < b;
      return nb;  // a (a number) ranks above NaN
    }
    if (va != vb) return va > vb;
    return a < b;
  });
  for (int64_t x = 0; x < P; ++x) kept[x] = 1;
  for (int64_t x = N - W; x < N; ++x) kept[x] = 1;
  for (int64_t k = 0; k < C - P - W; ++k) kept[cand[k]] = 1;
}

static void ref_pairs(const std::vector<char> &kept, int64_t N, int64_t Cp, std::vector<int64_t> &holes,
                      std::vector<int64_t> &tails) {
  holes.clear();
  tails.clear();
  for (int64_t x = 0; x < Cp; ++x)
    if (!kept[x]) holes.push_back(x);
  for (int64_t x = Cp; x < N; ++x)
    if (kept[x]) tails.push_back(x);
}

static void ref_move(World &w, const View &B, int64_t r, int64_t dst, int64_t src, bool swap) {
  uint8_t *a = hptr(w, B, r, dst);
  uint8_t *b = hptr(w, B, r, src);
  if (swap) std::swap_ranges(a, a + B.v.row_bytes, b);
  else memmove(a, b, (size_t)B.v.row_bytes);
}

// ------------------------------------------------------------ cases
struct Stats {
  int cases = 0, checks = 0, failures = 0;
} g_stats;

static void expect(bool ok, const std::string &what) {
  ++g_stats.checks;
  if (!ok) {
    ++g_stats.failures;
    if (g_stats.failures < 30) fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

static int32_t read_status(const imoe_exec &ex) {
  int32_t s = -1;
  const imoe_status st = imoe_cuda_read_device_status(&ex, &s);
  if (st != IMOE_OK) {
    fprintf(stderr, "read_device_status failed\n");
    exit(2);
  }
  return s;
}

struct CaseCfg {
  Lead L;
  int64_t N = 1, C = 0, P = 0, W = 0;
  bool active = false, active_shared = false;
  imoe_dtype sdt = IMOE_DTYPE_F32, adt = IMOE_DTYPE_I32, idt = IMOE_DTYPE_I32;
  int score_kind = 0;
  imoe_nan_policy nanp = IMOE_NAN_LOWEST;
  bool with_idx = true, with_tm = false;
  int op = 0;  // 0 compact, 1 build_map
  imoe_mode mode = IMOE_MODE_SWAP;
  std::vector<int64_t> rows;  // row bytes of each buffer
  bool alias_scores = false;  // the scores are also compacted as a buffer
  bool weird = false;
  int error = 0;  // 0 none, 1 NaN, 2 duplicate active, 3 active out of range
  bool use_stream = false;
};

static std::string describe(const CaseCfg &c) {
  char b[512];
  std::string lead;
  for (int d = 0; d < c.L.nd; ++d) lead += std::to_string(c.L.shape[d]) + ",";
  snprintf(b, sizeof b,
           "[%s] N=%lld C=%lld P=%lld W=%lld %s%s sdt=%d kind=%d nan=%d idx=%d/%d tm=%d op=%d mode=%d nbuf=%zu row0=%lld "
           "alias=%d weird=%d err=%d",
           lead.c_str(), (long long)c.N, (long long)c.C, (long long)c.P, (long long)c.W,
           c.active ? "active" : "scores", c.active_shared ? "(shared)" : "", (int)c.sdt, c.score_kind, (int)c.nanp,
           (int)c.with_idx, (int)c.idt, (int)c.with_tm, c.op, (int)c.mode, c.rows.size(),
           (long long)(c.rows.empty() ? 0 : c.rows[0]), (int)c.alias_scores, (int)c.weird, c.error);
  return b;
}

static cudaStream_t g_stream = nullptr;

static void run_case(const CaseCfg &c) {
  ++g_stats.cases;
  const std::string name = describe(c);
  World w;
  const Lead &L = c.L;
  const int64_t N = c.N, C = c.C;
  const int64_t Cp = std::min(C, N);
  View S, A, I, T;
  std::vector<View> B;
  if (!c.active) {
    S = make_view(w, L, true, N, (int64_t)dsize(c.sdt), (int64_t)dsize(c.sdt), c.sdt, c.weird);
    const std::vector<uint32_t> pool = score_pool(c.sdt, c.score_kind);
    for (int64_t r = 0; r < L.R; ++r)
      for (int64_t x = 0; x < N; ++x) gen_score(hptr(w, S, r, x), c.sdt, c.score_kind, pool);
    if (c.error == 1) {  // one NaN somewhere
      const int64_t r = rint_(0, L.R - 1), x = rint_(0, N - 1);
      uint8_t *p = hptr(w, S, r, x);
      if (c.sdt == IMOE_DTYPE_F32) {
        const uint32_t nb = 0x7FC00000u;
        memcpy(p, &nb, 4);
      } else {
        const uint16_t nb = c.sdt == IMOE_DTYPE_F16 ? 0x7E00 : 0x7FC0;
        memcpy(p, &nb, 2);
      }
    }
  } else {
    A = make_view(w, L, !c.active_shared, Cp, (int64_t)dsize(c.adt), (int64_t)dsize(c.adt), c.adt, c.weird);
    const int64_t ar = c.active_shared ? 1 : L.R;
    std::vector<int64_t> perm((size_t)N);
    for (int64_t r = 0; r < ar; ++r) {
      // K distinct slots: partial Fisher-Yates
      for (int64_t x = 0; x < N; ++x) perm[x] = x;
      for (int64_t k = 0; k < Cp; ++k) std::swap(perm[k], perm[rint_(k, N - 1)]);
      for (int64_t k = 0; k < Cp; ++k) set_index(w, A, r, k, perm[k]);
    }
    if (c.error == 2 && Cp >= 2) {
      const int64_t r = rint_(0, ar - 1), k = rint_(1, Cp - 1);
      set_index(w, A, r, k, get_index(w, A, r, rint_(0, k - 1)));
    }
    if (c.error == 3 && Cp >= 1) set_index(w, A, rint_(0, ar - 1), rint_(0, Cp - 1), rnd() % 2 ? N : -1);
  }
  if (c.with_idx) I = make_view(w, L, true, Cp, (int64_t)dsize(c.idt), (int64_t)dsize(c.idt), c.idt, c.weird);
  if (c.with_tm) T = make_view(w, L, true, N, 4, 4, IMOE_DTYPE_I32, c.weird);
  for (int64_t rb : c.rows) B.push_back(make_view(w, L, true, N, rb, 1, IMOE_DTYPE_BYTES, c.weird));
  if (c.alias_scores && !c.active) {
    View SB = S;
    SB.v.dtype = IMOE_DTYPE_BYTES;
    B.push_back(SB);
  }
  w.upload();
  if (!c.active) bind(w, S);
  else bind(w, A);
  if (c.with_idx) bind(w, I);
  if (c.with_tm) bind(w, T);
  for (auto &b : B) bind(w, b);

  // reference
  const bool expect_error = c.error != 0 && !(c.error == 2 && Cp < 2) && !(c.error == 3 && Cp < 1);
  int64_t total_pairs = 0;
  if (!expect_error) {
    std::vector<char> kept;
    std::vector<int64_t> holes, tails;
    for (int64_t r = 0; r < L.R; ++r) {
      if (!c.active) {
        ref_select_scores(w, S, r, N, C, c.P, c.W, kept);
      } else {
        kept.assign((size_t)N, 0);
        for (int64_t k = 0; k < Cp; ++k) kept[get_index(w, A, c.active_shared ? 0 : r, k)] = 1;
      }
      ref_pairs(kept, N, Cp, holes, tails);
      if (holes.size() != tails.size()) {
        expect(false, name + ": reference holes != tails");
        return;
      }
      total_pairs += (int64_t)holes.size();
      if (c.with_idx) {
        for (int64_t x = 0; x < Cp; ++x) set_index(w, I, r, x, x);
        for (size_t j = 0; j < holes.size(); ++j) set_index(w, I, r, holes[j], tails[j]);
      }
      if (c.with_tm) {
        for (int64_t x = 0; x < N; ++x) set_index(w, T, r, x, x);
        for (size_t j = 0; j < holes.size(); ++j) {
          set_index(w, T, r, holes[j], tails[j]);
          set_index(w, T, r, tails[j], holes[j]);
        }
      }
      if (c.op == 0)
        for (auto &b : B)
          for (size_t j = 0; j < holes.size(); ++j) ref_move(w, b, r, holes[j], tails[j], c.mode == IMOE_MODE_SWAP);
    }
  }

  imoe_selection sel;
  memset(&sel, 0, sizeof sel);
  sel.scores = c.active ? nullptr : &S.v;
  sel.active = c.active ? &A.v : nullptr;
  sel.capacity = C;
  sel.protected_prefix = c.P;
  sel.recent_window = c.W;
  sel.nan_policy = c.nanp;
  imoe_exec ex;
  memset(&ex, 0, sizeof ex);
  ex.device = IMOE_DEVICE_CUDA;
  ex.device_id = 0;
  ex.stream = c.use_stream ? (void *)g_stream : nullptr;
  imoe_error err;
  memset(&err, 0, sizeof err);
  std::vector<imoe_view> bv;
  for (auto &b : B) bv.push_back(b.v);
  imoe_status st;
  if (c.op == 0)
    st = imoe_cuda_compact(bv.data(), (int32_t)bv.size(), &sel, &I.v, c.with_tm ? &T.v : nullptr, c.mode, &ex, &err);
  else
    st = imoe_cuda_build_map(&sel, c.with_idx ? &I.v : nullptr, c.with_tm ? &T.v : nullptr, &ex, &err);
  expect(st == IMOE_OK, name + ": launcher returned " + std::to_string(st) + " " + err.message);
  const int32_t ds = read_status(ex);
  if (expect_error) {
    const int want = c.error == 1 ? IMOE_ERR_NAN : c.error == 2 ? IMOE_ERR_INDEX_DUPLICATE : IMOE_ERR_INDEX_RANGE;
    expect(ds == want, name + ": device status " + std::to_string(ds) + " want " + std::to_string(want));
  } else {
    expect(ds == 0, name + ": device status " + std::to_string(ds));
  }
  std::string msg;
  expect(w.check("after call", &msg), name + ": " + msg);
  if (expect_error || c.op != 0) return;

  // swap twice restores: apply the indices again in swap mode
  if (c.mode == IMOE_MODE_SWAP && c.with_idx && !B.empty()) {
    st = imoe_cuda_apply_indices(bv.data(), (int32_t)bv.size(), &I.v, IMOE_MODE_SWAP, &ex, &err);
    expect(st == IMOE_OK, name + ": apply_indices returned " + std::to_string(st));
    expect(read_status(ex) == 0, name + ": apply_indices status");
    // expected: buffers back to their original images, outputs as written
    for (size_t i = 0; i < w.arenas.size(); ++i) {
      bool is_buf = false;
      for (auto &b : B) is_buf |= (size_t)b.arena == i;
      if (is_buf && !(c.alias_scores && !c.active && (size_t)S.arena == i)) w.arenas[i].host = w.arenas[i].orig;
    }
    if (c.alias_scores && !c.active) w.arenas[S.arena].host = w.arenas[S.arena].orig;
    expect(w.check("after restore", &msg), name + ": swap twice: " + msg);
  }
  // apply_target_map on the original buffers gives the same result
  if (c.with_tm && !B.empty() && !c.alias_scores) {
    // the expected images: recompute from the original via the reference map
    for (auto &b : B) {
      w.arenas[b.arena].host = w.arenas[b.arena].orig;
      CK(cudaMemcpy(w.arenas[b.arena].dev, w.arenas[b.arena].orig.data(), w.arenas[b.arena].orig.size(),
                    cudaMemcpyHostToDevice));
      for (int64_t r = 0; r < L.R; ++r)
        for (int64_t x = 0; x < N; ++x) {
          const int64_t t = get_index(w, T, r, x);
          if (t > x) ref_move(w, b, r, x, t, c.mode == IMOE_MODE_SWAP);
        }
    }
    st = imoe_cuda_apply_target_map(bv.data(), (int32_t)bv.size(), &T.v, c.mode, &ex, &err);
    expect(st == IMOE_OK, name + ": apply_target_map returned " + std::to_string(st));
    expect(read_status(ex) == 0, name + ": apply_target_map status");
    expect(w.check("apply_target_map", &msg), name + ": apply_target_map: " + msg);
  }
  (void)total_pairs;
}

// Bad caller-given maps: nothing may change, the status says why.
static void run_bad_map_case(int variant) {
  ++g_stats.cases;
  World w;
  Lead L;
  L.nd = 1;
  L.shape[0] = rint_(1, 5);
  L.R = L.shape[0];
  const int64_t N = rint_(4, 3000), Cp = rint_(2, N - 2);
  const bool weird = rnd() % 2;
  View I = make_view(w, L, true, Cp, 8, 8, IMOE_DTYPE_I64, weird);
  View T = make_view(w, L, true, N, 4, 4, IMOE_DTYPE_I32, weird);
  View B = make_view(w, L, true, N, rint_(1, 40), 1, IMOE_DTYPE_BYTES, weird);
  // a valid map first: holes take tails
  for (int64_t r = 0; r < L.R; ++r) {
    for (int64_t x = 0; x < Cp; ++x) set_index(w, I, r, x, x);
    for (int64_t x = 0; x < N; ++x) set_index(w, T, r, x, x);
    const int64_t np = std::min(Cp, N - Cp) / 2;
    for (int64_t j = 0; j < np; ++j) {
      set_index(w, I, r, 2 * j, Cp + 2 * j + 1);
      set_index(w, T, r, 2 * j, Cp + 2 * j + 1);
      set_index(w, T, r, Cp + 2 * j + 1, 2 * j);
    }
  }
  const int64_t r = rint_(0, L.R - 1);
  int want;
  const bool use_tm = variant >= 3;
  switch (variant) {
    case 0:  // indices entry below C' but not i
      set_index(w, I, r, 1, 0);
      want = IMOE_ERR_BAD_MAP;
      break;
    case 1:  // out of range
      set_index(w, I, r, rint_(0, Cp - 1), rnd() % 2 ? N : -5);
      want = IMOE_ERR_INDEX_RANGE;
      break;
    case 2:  // duplicate entry >= C'
      set_index(w, I, r, 0, N - 1);
      set_index(w, I, r, 1, N - 1);
      want = IMOE_ERR_BAD_MAP;
      break;
    case 3:  // not an involution: 0 points at the fixed point 1
      set_index(w, T, r, 0, 1);
      want = IMOE_ERR_BAD_MAP;
      break;
    default:  // out of range, at the fixed point 1 (so no other violation races it)
      set_index(w, T, r, 1, rnd() % 2 ? N : -1);
      want = IMOE_ERR_INDEX_RANGE;
      break;
  }
  w.upload();
  bind(w, I);
  bind(w, T);
  bind(w, B);
  imoe_exec ex;
  memset(&ex, 0, sizeof ex);
  ex.device = IMOE_DEVICE_CUDA;
  ex.stream = rnd() % 2 ? (void *)g_stream : nullptr;
  imoe_error err;
  memset(&err, 0, sizeof err);
  const imoe_mode mode = rnd() % 2 ? IMOE_MODE_SWAP : IMOE_MODE_MOVE;
  imoe_status st = use_tm ? imoe_cuda_apply_target_map(&B.v, 1, &T.v, mode, &ex, &err)
                          : imoe_cuda_apply_indices(&B.v, 1, &I.v, mode, &ex, &err);
  const std::string name = "bad map variant " + std::to_string(variant) + " N=" + std::to_string(N) +
                           " Cp=" + std::to_string(Cp);
  expect(st == IMOE_OK, name + ": launcher status");
  const int32_t ds = read_status(ex);
  expect(ds == want, name + ": device status " + std::to_string(ds) + " want " + std::to_string(want));
  std::string msg;
  expect(w.check("bad map", &msg), name + ": " + msg);
  // a valid call right after works (the abort is per call)
  set_index(w, I, r, 0, 0);
  set_index(w, I, r, 1, 1);
  for (int64_t x = 0; x < Cp; ++x) {
    const int64_t v = get_index(w, I, r, x);
    if (v != x && (v < Cp || v >= N)) set_index(w, I, r, x, x);
  }
  // keep it simple: make row r the identity
  for (int64_t x = 0; x < Cp; ++x) set_index(w, I, r, x, x);
  w.upload();
  for (int64_t rr = 0; rr < L.R; ++rr)
    for (int64_t x = 0; x < Cp; ++x) {
      const int64_t v = get_index(w, I, rr, x);
      if (v != x) ref_move(w, B, rr, x, v, mode == IMOE_MODE_SWAP);
    }
  st = imoe_cuda_apply_indices(&B.v, 1, &I.v, mode, &ex, &err);
  expect(st == IMOE_OK && read_status(ex) == 0, name + ": valid call after an error");
  expect(w.check("after bad map", &msg), name + ": valid call after an error: " + msg);
}

static CaseCfg random_case(bool quick) {
  CaseCfg c;
  static const std::vector<int64_t> Rs = {1, 1, 2, 3, 7, 8, 32, 100, 300, 4096};
  static const std::vector<int64_t> Ns = {1,    2,    3,    5,    17,    100,   1000,  2047,  2048,
                                          2049, 4096, 5000, 8192, 40000, 70000, 300000, 1 << 20};
  static const std::vector<int64_t> rowbs = {1, 2, 3, 4, 7, 8, 16, 24, 100, 256, 1000, 2048, 14336, 65536};
  int64_t R, N;
  const int64_t slot_cap = quick ? 20000 : 2100000;
  do {
    R = pick(Rs);
    N = pick(Ns);
    if (quick) {
      R = std::min<int64_t>(R, 8);
      N = std::min<int64_t>(N, 5000);
    }
  } while (R * N > slot_cap);
  // lead dims: factor R into up to 3 axes, sometimes with 1s
  c.L.nd = (int)rint_(0, 3);
  if (R > 1 && c.L.nd == 0) c.L.nd = 1;
  int64_t rem = R;
  for (int d = 0; d < c.L.nd; ++d) {
    int64_t f = 1;
    if (d == c.L.nd - 1) f = rem;
    else {
      for (int64_t t = rint_(1, 8); t >= 1; --t)
        if (rem % t == 0) {
          f = t;
          break;
        }
    }
    c.L.shape[d] = f;
    rem /= f;
  }
  c.L.R = R;
  c.N = N;
  const int cm = (int)rint_(0, 9);
  if (cm == 0) c.C = 0;
  else if (cm == 1) c.C = N;
  else if (cm == 2) c.C = N + rint_(1, 10);
  else if (cm == 3) c.C = std::max<int64_t>(0, N - 1);
  else if (cm == 4) c.C = std::min<int64_t>(N, 1);
  else c.C = rint_(0, N);
  c.active = rnd() % 4 == 0;
  if (c.active) {
    c.C = std::min(c.C, N);
    c.active_shared = rnd() % 2;
    c.adt = rnd() % 2 ? IMOE_DTYPE_I32 : IMOE_DTYPE_I64;
  } else {
    c.sdt = pick(std::vector<imoe_dtype>{IMOE_DTYPE_F32, IMOE_DTYPE_F16, IMOE_DTYPE_BF16});
    c.score_kind = (int)rint_(0, 3);
    c.nanp = c.score_kind == 3 ? IMOE_NAN_LOWEST : (rnd() % 2 ? IMOE_NAN_LOWEST : IMOE_NAN_ERROR);
    if (rnd() % 2 && c.C > 0) {
      c.P = rint_(0, std::min<int64_t>(c.C, 6));
      c.W = rint_(0, std::min<int64_t>(c.C - c.P, 6));
      if (rnd() % 4 == 0) c.W = rint_(0, c.C - c.P);
      c.P = std::min(c.P, N);
      c.W = std::min(c.W, N - c.P);
    }
  }
  c.idt = rnd() % 2 ? IMOE_DTYPE_I32 : IMOE_DTYPE_I64;
  c.with_tm = rnd() % 2;
  c.op = rnd() % 5 == 0 ? 1 : 0;
  if (c.op == 1) {
    c.with_idx = rnd() % 3 != 0;
    if (!c.with_idx) c.with_tm = true;
  }
  c.mode = rnd() % 2 ? IMOE_MODE_SWAP : IMOE_MODE_MOVE;
  if (c.op == 0) {
    const int nb = rnd() % 10 == 0 ? (int)rint_(17, 19) : (int)rint_(1, 3);
    const int64_t byte_cap = quick ? (1 << 20) : (int64_t)48 << 20;
    for (int b = 0; b < nb; ++b) {
      int64_t rb;
      do {
        rb = pick(rowbs);
      } while (rb * R * N > byte_cap / nb && rb > 1);
      c.rows.push_back(rb);
    }
    c.alias_scores = !c.active && rnd() % 8 == 0;
  }
  c.weird = rnd() % 2;
  c.use_stream = rnd() % 2;
  const int e = (int)rint_(0, 11);
  if (!c.active && c.nanp == IMOE_NAN_ERROR && e == 0) c.error = 1;
  if (c.active && e <= 1) c.error = 2 + e;
  // an active selection with only out_indices has no N: no upper range check
  if (c.op == 1 && c.active && !c.with_tm && c.error == 3) c.with_tm = true;
  return c;
}

// ------------------------------------------------------------ graph capture
static void graph_test() {
  ++g_stats.cases;
  World w;
  Lead L;
  L.nd = 2;
  L.shape[0] = 2;
  L.shape[1] = 3;
  L.R = 6;
  const int64_t N = 3000, C = 1200;
  View S = make_view(w, L, true, N, 4, 4, IMOE_DTYPE_F32, true);
  View I = make_view(w, L, true, C, 8, 8, IMOE_DTYPE_I64, false);
  View T = make_view(w, L, true, N, 4, 4, IMOE_DTYPE_I32, true);
  View B0 = make_view(w, L, true, N, 256, 1, IMOE_DTYPE_BYTES, false);
  View B1 = make_view(w, L, true, N, 6, 1, IMOE_DTYPE_BYTES, true);
  const std::vector<uint32_t> pool = score_pool(IMOE_DTYPE_F32, 1);
  for (int64_t r = 0; r < L.R; ++r)
    for (int64_t x = 0; x < N; ++x) gen_score(hptr(w, S, r, x), IMOE_DTYPE_F32, rnd() % 2 ? 0 : 1, pool);
  w.upload();
  for (View *v : {&S, &I, &T, &B0, &B1}) bind(w, *v);
  // expected result
  std::vector<char> kept;
  std::vector<int64_t> holes, tails;
  for (int64_t r = 0; r < L.R; ++r) {
    ref_select_scores(w, S, r, N, C, 2, 3, kept);
    ref_pairs(kept, N, C, holes, tails);
    for (int64_t x = 0; x < C; ++x) set_index(w, I, r, x, x);
    for (int64_t x = 0; x < N; ++x) set_index(w, T, r, x, x);
    for (size_t j = 0; j < holes.size(); ++j) {
      set_index(w, I, r, holes[j], tails[j]);
      set_index(w, T, r, holes[j], tails[j]);
      set_index(w, T, r, tails[j], holes[j]);
      ref_move(w, B0, r, holes[j], tails[j], true);
      ref_move(w, B1, r, holes[j], tails[j], true);
    }
  }
  imoe_selection sel;
  memset(&sel, 0, sizeof sel);
  sel.scores = &S.v;
  sel.capacity = C;
  sel.protected_prefix = 2;
  sel.recent_window = 3;
  sel.nan_policy = IMOE_NAN_ERROR;
  imoe_exec ex;
  memset(&ex, 0, sizeof ex);
  ex.device = IMOE_DEVICE_CUDA;
  ex.stream = g_stream;
  imoe_error err;
  memset(&err, 0, sizeof err);
  imoe_view bv[2] = {B0.v, B1.v};
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal));
  const imoe_status st = imoe_cuda_compact(bv, 2, &sel, &I.v, &T.v, IMOE_MODE_SWAP, &ex, &err);
  CK(cudaStreamEndCapture(g_stream, &graph));
  expect(st == IMOE_OK, std::string("graph capture: compact returned ") + err.message);
  CK(cudaGraphInstantiate(&exec, graph, 0));
  std::string msg;
  for (int rep = 0; rep < 3; ++rep) {
    for (auto &a : w.arenas)
      CK(cudaMemcpyAsync(a.dev, a.orig.data(), a.orig.size(), cudaMemcpyHostToDevice, g_stream));
    CK(cudaGraphLaunch(exec, g_stream));
    expect(read_status(ex) == 0, "graph replay status");
    expect(w.check("graph replay", &msg), "graph replay " + std::to_string(rep) + ": " + msg);
  }
  // a NaN in the scores: the replay must write nothing and report it
  std::vector<std::vector<uint8_t>> good;
  for (auto &a : w.arenas) good.push_back(a.host);
  Arena &sa = w.arenas[S.arena];
  std::vector<uint8_t> bad = sa.orig;
  const float nanv = NAN;
  memcpy(&bad[at(S, 4, 1777)], &nanv, 4);
  for (auto &a : w.arenas)
    CK(cudaMemcpyAsync(a.dev, a.orig.data(), a.orig.size(), cudaMemcpyHostToDevice, g_stream));
  CK(cudaMemcpyAsync(sa.dev, bad.data(), bad.size(), cudaMemcpyHostToDevice, g_stream));
  CK(cudaGraphLaunch(exec, g_stream));
  expect(read_status(ex) == IMOE_ERR_NAN, "graph replay with NaN: status");
  for (auto &a : w.arenas) a.host = a.orig;
  sa.host = bad;
  expect(w.check("graph replay NaN", &msg), "graph replay with NaN: " + msg);
  // and the next clean replay works again
  for (auto &a : w.arenas)
    CK(cudaMemcpyAsync(a.dev, a.orig.data(), a.orig.size(), cudaMemcpyHostToDevice, g_stream));
  CK(cudaGraphLaunch(exec, g_stream));
  expect(read_status(ex) == 0, "graph replay after NaN: status");
  for (size_t i = 0; i < w.arenas.size(); ++i) w.arenas[i].host = good[i];
  expect(w.check("graph replay after NaN", &msg), "graph replay after NaN: " + msg);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
}

// ------------------------------------------------------------ benchmark
// Evicts the inputs from L2 by reading a large buffer: the L2 is left holding
// clean lines, so the timed call pays no write-back of someone else's data.
__global__ void k_flush_read(const uint4 *p, size_t n, uint4 *sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = p[i];
    acc.x ^= v.x;
    acc.y ^= v.y;
    acc.z ^= v.z;
    acc.w ^= v.w;
  }
  if ((acc.x & acc.y & acc.z & acc.w) == 0xFFFFFFFFu && threadIdx.x == 1023) *sink = acc;
}
__global__ void k_empty() {}
// One thread spinning for `cycles` SM cycles (as torch.cuda._sleep).
__global__ void k_spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
static void flush_l2(void *flush, size_t bytes) {
  static const bool off = getenv("IMOE_BENCH_NOFLUSH") != nullptr;  // diagnosis only: warm L2
  // diagnosis only: a spin of one thread between the flush and the timed call
  static const long long spin = getenv("IMOE_BENCH_SPIN") ? atoll(getenv("IMOE_BENCH_SPIN")) : 0;
  if (off) return;
  k_flush_read<<<1056, 256, 0, g_stream>>>((const uint4 *)flush, bytes / 16, (uint4 *)flush);
  CK(cudaGetLastError());
  if (spin > 0) k_spin<<<1, 1, 0, g_stream>>>(spin);
}

static float median_of(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// --launch (diagnosis): what a launch itself costs in event time after the
// flush, by block shape, shared memory, carveout and cooperative launch.
__global__ void k_empty_a() {
  extern __shared__ int sm_a[];
  if (threadIdx.x == 1u << 30) sm_a[0] = 1;
}
__global__ void k_empty_b() {
  extern __shared__ int sm_b[];
  if (threadIdx.x == 1u << 30) sm_b[0] = 1;
}
static void bench_launch() {
  const size_t flush_bytes = (size_t)256 << 20;
  void *flush;
  CK(cudaMalloc(&flush, flush_bytes));
  CK(cudaMemset(flush, 0x5A, flush_bytes));
  const int dyn = 88 << 10;
  CK(cudaFuncSetAttribute(k_empty_a, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn));
  CK(cudaFuncSetAttribute(k_empty_a, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  CK(cudaFuncSetAttribute(k_empty_b, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const char *names[6] = {"empty 1x32", "empty 128x1024", "128x1024 88 KB, carveout max shared",
                          "128x1024 88 KB, carveout default", "128x1024 88 KB max shared, cooperative",
                          "128x1024 88 KB max shared, twice"};
  for (int rep = 0; rep < 2; ++rep)
    for (int v = 0; v < 6; ++v) {
      std::vector<float> t;
      for (int it = 0; it < 210; ++it) {
        flush_l2(flush, flush_bytes);
        CK(cudaEventRecord(e0, g_stream));
        if (v == 0) k_empty<<<1, 32, 0, g_stream>>>();
        else if (v == 1) k_empty_b<<<128, 1024, 0, g_stream>>>();
        else if (v == 2 || v == 5) k_empty_a<<<128, 1024, dyn, g_stream>>>();
        else if (v == 3) k_empty_b<<<128, 1024, dyn, g_stream>>>();
        else {
          cudaLaunchConfig_t cfg = {};
          cudaLaunchAttribute at[1];
          at[0].id = cudaLaunchAttributeCooperative;
          at[0].val.cooperative = 1;
          cfg.gridDim = dim3(128);
          cfg.blockDim = dim3(1024);
          cfg.dynamicSmemBytes = dyn;
          cfg.stream = g_stream;
          cfg.attrs = at;
          cfg.numAttrs = 1;
          CK(cudaLaunchKernelEx(&cfg, k_empty_a));
        }
        if (v == 5) k_empty_a<<<128, 1024, dyn, g_stream>>>();
        CK(cudaEventRecord(e1, g_stream));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 10) t.push_back(ms * 1000.0f);
      }
      printf("launch: %-44s median %.2f us, min %.2f us\n", names[v], median_of(t),
             *std::min_element(t.begin(), t.end()));
    }
  CK(cudaFree(flush));
}

struct BenchRow {
  std::string name;
  float med_us, min_us, floor_us;
  double bytes;
  bool correct;
};

static double g_bw = 0;  // bytes read + written per second, device-to-device copy

// --phases (a build with -DIMOE_PHASE_TIMES): where the time of one W1 call
// goes inside k_select_small, from the stamps of thread 0 of every block.
static bool g_phases = false;
#ifdef IMOE_PHASE_TIMES
extern "C" int imoe_cuda_phase_read(unsigned long long *out, int reset);
static void print_phases() {
  const int NB = 1024, NP = 12;
  std::vector<unsigned long long> st((size_t)NB * 2 * NP);
  if (imoe_cuda_phase_read(st.data(), 0) != 0) {
    printf("phases: read failed\n");
    return;
  }
  auto ck = [&](int b, int k) { return st[((size_t)b * 2 + 0) * NP + k]; };
  auto gt = [&](int b, int k) { return st[((size_t)b * 2 + 1) * NP + k]; };
  int clock_khz = 0;
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  std::vector<int> blocks;
  for (int b = 0; b < NB; ++b)
    if (ck(b, 0)) blocks.push_back(b);
  if (blocks.empty()) {
    printf("phases: no stamps\n");
    return;
  }
  unsigned long long g0 = ~0ull, g0max = 0, g10min = ~0ull, g10max = 0;
  for (int b : blocks) {
    g0 = std::min(g0, gt(b, 0));
    g0max = std::max(g0max, gt(b, 0));
    if (gt(b, 10)) {
      g10min = std::min(g10min, gt(b, 10));
      g10max = std::max(g10max, gt(b, 10));
    }
  }
  printf("phases: %zu blocks, SM clock attribute %.0f MHz; globaltimer: starts spread %.0f ns, ends %.0f..%.0f ns "
         "after the first start\n",
         blocks.size(), clock_khz / 1e3, (double)(g0max - g0), (double)(g10min - g0), (double)(g10max - g0));
  const char *names[11] = {"start",      "keys loaded", "pass 1",      "pass 2",         "pass 3",   "pass 4",
                           "kept flags", "H, T ready",  "verdict ok",  "indices written", "moves done"};
  for (int k = 1; k <= 10; ++k) {
    std::vector<double> c, g;
    for (int b : blocks)
      if (ck(b, k)) {
        c.push_back((double)(ck(b, k) - ck(b, 0)));
        g.push_back((double)(gt(b, k) - g0));
      }
    if (c.empty()) continue;
    std::sort(c.begin(), c.end());
    std::sort(g.begin(), g.end());
    printf("  %-16s %4zu blocks  cycles since block start: median %7.0f max %7.0f | ns since first start: median "
           "%7.0f max %7.0f\n",
           names[k], c.size(), c[c.size() / 2], c.back(), g[g.size() / 2], g.back());
  }
  // IMOE_PHASE_DUMP=1: every block's stamps (ns since the first start), its
  // SM and its number of pairs (k_select_small writes both in the spare stamp)
  if (getenv("IMOE_PHASE_DUMP")) {
    printf("  block sm pairs:");
    for (int k = 0; k <= 10; ++k) printf(" %s;", names[k]);
    printf("\n");
    for (int b : blocks) {
      printf("  %d %llu %llu:", b, ck(b, NP - 1), gt(b, NP - 1));
      for (int k = 0; k <= 10; ++k) printf(" %lld", gt(b, k) ? (long long)(gt(b, k) - g0) : -1ll);
      printf("\n");
    }
  }
}
#endif

static void bench_copy() {
  const size_t bytes = (size_t)1 << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int i = 0; i < 25; ++i) {
    CK(cudaEventRecord(e0, g_stream));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, g_stream));
    CK(cudaEventRecord(e1, g_stream));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 5) t.push_back(ms);
  }
  const float med = median_of(t);
  g_bw = 2.0 * (double)bytes / (med * 1e-3);
  printf("D2D copy 1 GiB: median %.3f ms -> %.1f GB/s (read + write)\n", med, g_bw / 1e9);
  CK(cudaFree(a));
  CK(cudaFree(b));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
}

// Time one compaction per iteration on freshly restored inputs; the restore
// (D2D copy) and an L2 flush (a 256 MiB read) run outside the timed region.
static void bench_workload(const char *wname, int nlead, const int64_t *lead, int64_t N, int64_t row_bytes, int nbuf,
                           int64_t C, int64_t P, std::vector<BenchRow> &rows, int iters) {
  int64_t R = 1;
  for (int d = 0; d < nlead; ++d) R *= lead[d];
  const size_t buf_bytes = (size_t)(R * N * row_bytes);
  std::vector<uint8_t *> bufs(nbuf), pristine(nbuf);
  std::vector<uint8_t> hbuf(buf_bytes);
  for (int b = 0; b < nbuf; ++b) {
    CK(cudaMalloc(&bufs[b], buf_bytes));
    CK(cudaMalloc(&pristine[b], buf_bytes));
    fill_random(hbuf);
    CK(cudaMemcpy(pristine[b], hbuf.data(), buf_bytes, cudaMemcpyHostToDevice));
  }
  std::vector<float> hs((size_t)(R * N));
  for (auto &v : hs) v = (float)runif();
  // IMOE_BENCH_SCORES=file (diagnosis): float32 scores [R, N] from a file
  // (say the ones the Python benchmark draws), for workloads of that size
  if (const char *fn = getenv("IMOE_BENCH_SCORES")) {
    FILE *f = fopen(fn, "rb");
    if (f) {
      fseek(f, 0, SEEK_END);
      if (ftell(f) == (long)(hs.size() * 4)) {
        fseek(f, 0, SEEK_SET);
        if (fread(hs.data(), 4, hs.size(), f) == hs.size()) printf("%s: scores from %s\n", wname, fn);
      }
      fclose(f);
    }
  }
  float *scores;
  void *idx;
  CK(cudaMalloc(&scores, hs.size() * 4));
  CK(cudaMemcpy(scores, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
  const int64_t Cp = std::min(C, N);
  // IMOE_BENCH_IDX64=1: int64 indices, as torch callers pass them
  const bool idx64 = getenv("IMOE_BENCH_IDX64") != nullptr;
  const int ies = idx64 ? 8 : 4;
  CK(cudaMalloc(&idx, (size_t)(R * Cp) * ies));
  const size_t flush_bytes = (size_t)256 << 20;
  void *flush;
  CK(cudaMalloc(&flush, flush_bytes));
  CK(cudaMemset(flush, 0x5A, flush_bytes));

  auto view = [&](void *data, int64_t n, int64_t rb, imoe_dtype dt) {
    imoe_view v;
    memset(&v, 0, sizeof v);
    v.data = data;
    v.lead_ndim = nlead;
    int64_t s = n * rb;
    for (int d = nlead - 1; d >= 0; --d) {
      v.lead_shape[d] = lead[d];
      v.lead_stride[d] = s;
      s *= lead[d];
    }
    v.n = n;
    v.n_stride = rb;
    v.row_bytes = rb;
    v.dtype = dt;
    return v;
  };
  std::vector<imoe_view> bv;
  for (int b = 0; b < nbuf; ++b) bv.push_back(view(bufs[b], N, row_bytes, IMOE_DTYPE_BYTES));
  imoe_view sv = view(scores, N, 4, IMOE_DTYPE_F32);
  imoe_view iv = view(idx, Cp, ies, idx64 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32);
  imoe_exec ex;
  memset(&ex, 0, sizeof ex);
  ex.device = IMOE_DEVICE_CUDA;
  ex.stream = g_stream;
  imoe_error err;
  memset(&err, 0, sizeof err);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // the indices of the last call, as int32 whatever their dtype
  auto read_indices = [&]() {
    std::vector<int32_t> got((size_t)(R * Cp));
    if (idx64) {
      std::vector<int64_t> got64(got.size());
      CK(cudaMemcpy(got64.data(), idx, got64.size() * 8, cudaMemcpyDeviceToHost));
      for (size_t j = 0; j < got.size(); ++j) got[j] = (int32_t)got64[j];
    } else {
      CK(cudaMemcpy(got.data(), idx, got.size() * 4, cudaMemcpyDeviceToHost));
    }
    return got;
  };

  // pairs per the reference (host), for the floor and the check
  int64_t pairs = 0;
  std::vector<int32_t> want_idx((size_t)(R * Cp));
  {
    for (int64_t r = 0; r < R; ++r) {
      std::vector<int64_t> ord((size_t)N);
      for (int64_t x = 0; x < N; ++x) ord[x] = x;
      const float *s = &hs[(size_t)(r * N)];
      std::sort(ord.begin() + P, ord.end(), [&](int64_t a, int64_t b) { return s[a] != s[b] ? s[a] > s[b] : a < b; });
      std::vector<char> kept((size_t)N, 0);
      for (int64_t k = 0; k < Cp; ++k) kept[ord[k]] = 1;
      std::vector<int64_t> holes, tails;
      ref_pairs(kept, N, Cp, holes, tails);
      pairs += (int64_t)holes.size();
      for (int64_t x = 0; x < Cp; ++x) want_idx[(size_t)(r * Cp + x)] = (int32_t)x;
      for (size_t j = 0; j < holes.size(); ++j) want_idx[(size_t)(r * Cp + holes[j])] = (int32_t)tails[j];
    }
  }
  for (int m = 0; m < 2; ++m) {
    for (int np = 0; np < 2; ++np) {
      const imoe_mode mode = m ? IMOE_MODE_SWAP : IMOE_MODE_MOVE;
      imoe_selection sel;
      memset(&sel, 0, sizeof sel);
      sel.scores = &sv;
      sel.capacity = C;
      sel.protected_prefix = P;
      sel.nan_policy = np ? IMOE_NAN_ERROR : IMOE_NAN_LOWEST;
      std::vector<float> t;
      for (int it = 0; it < iters + 10; ++it) {
        for (int b = 0; b < nbuf; ++b)
          CK(cudaMemcpyAsync(bufs[b], pristine[b], buf_bytes, cudaMemcpyDeviceToDevice, g_stream));
#ifdef IMOE_PHASE_TIMES
        if (g_phases && it == iters + 9) imoe_cuda_phase_read(nullptr, 1);
#endif
        flush_l2(flush, flush_bytes);
        CK(cudaEventRecord(e0, g_stream));
        const imoe_status st = imoe_cuda_compact(bv.data(), nbuf, &sel, &iv, nullptr, mode, &ex, &err);
        CK(cudaEventRecord(e1, g_stream));
        if (st != IMOE_OK) {
          fprintf(stderr, "bench: compact failed: %s\n", err.message);
          exit(2);
        }
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 10) t.push_back(ms * 1000.0f);
      }
#ifdef IMOE_PHASE_TIMES
      if (g_phases) {
        printf("%s %s %s: median %.2f us\n", wname, m ? "swap" : "move", np ? "nan=error" : "nan=lowest",
               median_of(t));
        print_phases();
      }
#endif
      // correctness of the last run: indices and the first buffer
      bool ok = read_status(ex) == 0;
      const std::vector<int32_t> got = read_indices();
      ok = ok && got == want_idx;
      std::vector<uint8_t> out(buf_bytes), orig(buf_bytes);
      CK(cudaMemcpy(out.data(), bufs[0], buf_bytes, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(orig.data(), pristine[0], buf_bytes, cudaMemcpyDeviceToHost));
      for (int64_t r = 0; r < R && ok; ++r)
        for (int64_t x = 0; x < Cp && ok; ++x) {
          const int64_t src = want_idx[(size_t)(r * Cp + x)];
          ok = memcmp(&out[(size_t)((r * N + x) * row_bytes)], &orig[(size_t)((r * N + src) * row_bytes)],
                      (size_t)row_bytes) == 0;
        }
      const double bytes = (double)pairs * (double)row_bytes * nbuf * (m ? 4.0 : 2.0);
      BenchRow br;
      br.name = std::string(wname) + (m ? " swap" : " move") + (np ? " nan=error" : " nan=lowest");
      br.med_us = median_of(t);
      br.min_us = *std::min_element(t.begin(), t.end());
      br.bytes = bytes;
      br.floor_us = (float)(bytes / g_bw * 1e6);
      br.correct = ok;
      rows.push_back(br);
    }
  }
  // the same call captured once in a CUDA graph and replayed (restore outside)
  for (int m = 0; m < 2; ++m) {
    const imoe_mode mode = m ? IMOE_MODE_SWAP : IMOE_MODE_MOVE;
    imoe_selection sel;
    memset(&sel, 0, sizeof sel);
    sel.scores = &sv;
    sel.capacity = C;
    sel.protected_prefix = P;
    sel.nan_policy = IMOE_NAN_ERROR;
    cudaGraph_t graph;
    cudaGraphExec_t gexec;
    CK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal));
    const imoe_status st = imoe_cuda_compact(bv.data(), nbuf, &sel, &iv, nullptr, mode, &ex, &err);
    CK(cudaStreamEndCapture(g_stream, &graph));
    if (st != IMOE_OK) {
      fprintf(stderr, "bench: capture failed: %s\n", err.message);
      exit(2);
    }
    CK(cudaGraphInstantiate(&gexec, graph, 0));
    std::vector<float> t;
    for (int it = 0; it < iters + 10; ++it) {
      for (int b = 0; b < nbuf; ++b)
        CK(cudaMemcpyAsync(bufs[b], pristine[b], buf_bytes, cudaMemcpyDeviceToDevice, g_stream));
      flush_l2(flush, flush_bytes);
      CK(cudaEventRecord(e0, g_stream));
      CK(cudaGraphLaunch(gexec, g_stream));
      CK(cudaEventRecord(e1, g_stream));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (it >= 10) t.push_back(ms * 1000.0f);
    }
    const std::vector<int32_t> got = read_indices();
    const double bytes = (double)pairs * (double)row_bytes * nbuf * (m ? 4.0 : 2.0);
    BenchRow br;
    br.name = std::string(wname) + (m ? " swap nan=error graph" : " move nan=error graph");
    br.med_us = median_of(t);
    br.min_us = *std::min_element(t.begin(), t.end());
    br.bytes = bytes;
    br.floor_us = (float)(bytes / g_bw * 1e6);
    br.correct = read_status(ex) == 0 && got == want_idx;
    rows.push_back(br);
    CK(cudaGraphExecDestroy(gexec));
    CK(cudaGraphDestroy(graph));
  }
  // the two halves of a move compaction, timed alone (labelled as such):
  // select + map only (build_map), and applying the map (check + moves);
  // then build_map without the NaN check, and an empty kernel (what the
  // method itself costs: events and a launch)
  {
    imoe_selection sel;
    memset(&sel, 0, sizeof sel);
    sel.scores = &sv;
    sel.capacity = C;
    sel.protected_prefix = P;
    sel.nan_policy = IMOE_NAN_ERROR;
    for (int part = 0; part < 4; ++part) {
      sel.nan_policy = part == 2 ? IMOE_NAN_LOWEST : IMOE_NAN_ERROR;
      std::vector<float> t;
      for (int it = 0; it < iters + 10; ++it) {
        for (int b = 0; b < nbuf; ++b)
          CK(cudaMemcpyAsync(bufs[b], pristine[b], buf_bytes, cudaMemcpyDeviceToDevice, g_stream));
        flush_l2(flush, flush_bytes);
        CK(cudaEventRecord(e0, g_stream));
        imoe_status st = IMOE_OK;
        if (part == 0 || part == 2) st = imoe_cuda_build_map(&sel, &iv, nullptr, &ex, &err);
        else if (part == 1) st = imoe_cuda_apply_indices(bv.data(), nbuf, &iv, IMOE_MODE_MOVE, &ex, &err);
        else k_empty<<<1, 32, 0, g_stream>>>();
        CK(cudaEventRecord(e1, g_stream));
        if (st != IMOE_OK) {
          fprintf(stderr, "bench: part %d failed: %s\n", part, err.message);
          exit(2);
        }
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 10) t.push_back(ms * 1000.0f);
      }
      const double bytes = part != 1 ? 0.0 : (double)pairs * (double)row_bytes * nbuf * 2.0;
      BenchRow br;
      static const char *const labels[4] = {" [select+map only]", " [apply move only]",
                                            " [select+map only, nan=lowest]", " [empty kernel]"};
      br.name = std::string(wname) + labels[part];
      br.med_us = median_of(t);
      br.min_us = *std::min_element(t.begin(), t.end());
      br.bytes = bytes;
      br.floor_us = (float)(bytes / g_bw * 1e6);
      br.correct = read_status(ex) == 0;
      rows.push_back(br);
    }
  }
  for (int b = 0; b < nbuf; ++b) {
    CK(cudaFree(bufs[b]));
    CK(cudaFree(pristine[b]));
  }
  CK(cudaFree(scores));
  CK(cudaFree(idx));
  CK(cudaFree(flush));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
}

int main(int argc, char **argv) {
  bool quick = false, bench = false, profile = false;
  int ncases = -1;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--quick")) quick = true;
    else if (!strcmp(argv[i], "--bench")) bench = true;
    else if (!strcmp(argv[i], "--profile")) profile = true;
    else if (!strcmp(argv[i], "--phases")) g_phases = true;
    else if (!strcmp(argv[i], "--launch")) {
      CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
      bench_launch();
      return 0;
    }
    else if (!strcmp(argv[i], "--cases") && i + 1 < argc) ncases = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--seed") && i + 1 < argc) g_rng = strtoull(argv[++i], nullptr, 0);
  }
  if (ncases < 0) ncases = quick ? 40 : 400;
  if (g_phases || profile) {  // W1 only: with the phase stamps, or a few calls for ncu
    CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    g_bw = 4.2e12;
    std::vector<BenchRow> rows;
    const int64_t w1[1] = {8}, one[1] = {1};
    if (getenv("IMOE_PHASE_LONG"))  // k_select_wide: one row of 131072 slots
      bench_workload("W5 long row", 1, one, 131072, 2048, 1, 65536, 0, rows, g_phases ? 30 : 1);
    else
      bench_workload("W1", 1, w1, 4096, 2048, 1, 2048, 0, rows, g_phases ? 30 : 1);
    return 0;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s, %d SMs, cc %d.%d\n", prop.name, prop.multiProcessorCount, prop.major, prop.minor);
  CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));

  // fixed edge cases first
  {
    CaseCfg c;
    c.L.nd = 1;
    c.L.shape[0] = 3;
    c.L.R = 3;
    c.rows = {16};
    for (int64_t N : {1, 2, 7, 2048, 2049}) {
      for (int64_t C : {(int64_t)0, N / 2, N, N + 3}) {
        c.N = N;
        c.C = C;
        c.score_kind = 2;
        run_case(c);
      }
    }
    CaseCfg d = c;  // W1-like, both modes, NaN error policy
    d.L.shape[0] = 8;
    d.L.R = 8;
    d.N = 4096;
    d.C = 2048;
    d.rows = {2048};
    d.nanp = IMOE_NAN_ERROR;
    d.score_kind = 0;
    for (int m = 0; m < 2 && !quick; ++m) {
      d.mode = m ? IMOE_MODE_MOVE : IMOE_MODE_SWAP;
      run_case(d);
    }
    if (!quick) {  // one long row of 1M slots, scores and active
      CaseCfg e = c;
      e.L.nd = 0;
      e.L.R = 1;
      e.N = 1 << 20;
      e.C = 300000;
      e.P = 4;
      e.W = 100;
      e.rows = {8};
      e.score_kind = 1;
      e.with_tm = true;
      run_case(e);
      e.score_kind = 0;
      e.sdt = IMOE_DTYPE_BF16;
      run_case(e);
      e.active = true;
      e.P = e.W = 0;
      run_case(e);
    }
  }
  for (int v = 0; v < 5; ++v) run_bad_map_case(v);
  graph_test();
  for (int i = 0; i < ncases; ++i) {
    const CaseCfg c = random_case(quick);
    run_case(c);
    CK(cudaGetLastError());
  }
  for (int v = 0; v < 10; ++v) run_bad_map_case(v % 5);
  printf("tests: %d cases, %d checks, %d failures\n", g_stats.cases, g_stats.checks, g_stats.failures);

  if (bench) {
    bench_copy();
    std::vector<BenchRow> rows;
    const int iters = 200;
    const int64_t w1[1] = {8};
    bench_workload("W1 [8,4096,1024] f16 C=2048", 1, w1, 4096, 2048, 1, 2048, 0, rows, iters);
    const int64_t w2[2] = {1, 32};
    bench_workload("W2 K,V [1,32,8192,128] f16 C=4096 P=4", 2, w2, 8192, 256, 2, 4096, 4, rows, iters);
    const int64_t w3[1] = {32};
    bench_workload("W3 [32,1024,7168] bf16 C=512", 1, w3, 1024, 14336, 1, 512, 0, rows, iters);
    const int64_t l1[1] = {1}, l2[1] = {2};  // few long rows (k_select_wide)
    bench_workload("W5 [1,131072,1024] f16 C=65536", 1, l1, 131072, 2048, 1, 65536, 0, rows, iters);
    bench_workload("W5 [2,65536,1024] f16 C=32768", 1, l2, 65536, 2048, 1, 32768, 0, rows, iters);
    printf("\n%-58s %10s %10s %10s %8s %8s\n", "workload (one compaction, end to end)", "median us", "min us",
           "floor us", "x floor", "correct");
    for (auto &r : rows)
      printf("%-58s %10.2f %10.2f %10.2f %8.2f %8s\n", r.name.c_str(), r.med_us, r.min_us, r.floor_us,
             r.floor_us > 0 ? r.med_us / r.floor_us : 0.0, r.correct ? "yes" : "NO");
    for (auto &r : rows)
      if (!r.correct) ++g_stats.failures;
  }
  CK(cudaStreamDestroy(g_stream));
  return g_stats.failures ? 1 : 0;
}
