/* test_core.c: C unit tests of the idempotent-moe core. Random cases are
 * checked against the naive reference (ref.c) through parity.c; the named
 * tests pin behaviour the reference could share a blind spot with. Fixed
 * seeds: every run checks the same cases. Last line: "N passed, N failed". */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "idempotent_moe.h"
#include "imoe_internal.h"
#include "parity.h"
#include "ref.h"
#include "tensor.h"

int checks_passed = 0, checks_failed = 0;

static imoe_view vec_view(void *data, int64_t n, imoe_dtype dtype, int64_t elem) {
  imoe_view v;
  memset(&v, 0, sizeof v);
  v.data = data;
  v.n = n;
  v.n_stride = elem;
  v.row_bytes = elem;
  v.dtype = dtype;
  return v;
}

/* indices of one row selected by the library from raw score elements. */
static imoe_status select_one(const void *scores, imoe_dtype dtype, int64_t elem, int64_t n,
                              int64_t c, int64_t p, int64_t w, imoe_nan_policy nan,
                              int64_t *indices) {
  const int64_t kept = c < n ? c : n;
  imoe_view s = vec_view((void *)scores, n, dtype, elem);
  imoe_view idx = vec_view(indices, kept, IMOE_DTYPE_I64, 8);
  imoe_selection sel = {&s, NULL, c, p, w, nan};
  return imoe_build_map(&sel, &idx, NULL, NULL, 0, NULL, NULL);
}

static int same_indices(const int64_t *got, const int64_t *want, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (got[i] != want[i]) return 0;
  }
  return 1;
}

/* ---- the reference's own conversions ------------------------------------ */

static void test_reference_conversions(void) {
  CHECK(ref_half_to_float(0x3c00) == 1.0f, "f16 1.0");
  CHECK(ref_half_to_float(0xc000) == -2.0f, "f16 -2.0");
  CHECK(ref_half_to_float(0x7bff) == 65504.0f, "f16 max");
  CHECK(ref_half_to_float(0x0001) == ldexpf(1.0f, -24), "f16 smallest subnormal");
  CHECK(ref_half_to_float(0x03ff) == ldexpf(1023.0f, -24), "f16 largest subnormal");
  CHECK(ref_half_to_float(0x0400) == ldexpf(1.0f, -14), "f16 smallest normal");
  CHECK(ref_half_to_float(0xfc00) == -INFINITY, "f16 -inf");
  CHECK(isnan(ref_half_to_float(0x7e00)) && isnan(ref_half_to_float(0xfc01)), "f16 NaN");
  CHECK(signbit(ref_half_to_float(0x8000)) && ref_half_to_float(0x8000) == 0.0f, "f16 -0");
  CHECK(ref_bf16_to_float(0x3f80) == 1.0f, "bf16 1.0");
  CHECK(ref_bf16_to_float(0x0001) == ldexpf(1.0f, -133), "bf16 smallest subnormal");
  CHECK(ref_bf16_to_float(0xff80) == -INFINITY, "bf16 -inf");
  CHECK(isnan(ref_bf16_to_float(0x7fc1)), "bf16 NaN");
}

/* ---- random cases against the reference --------------------------------- */

static const uint32_t special_f32[] = {0x00000000u, 0x80000000u, 0x3f800000u, 0xbf800000u,
                                       0x3f000000u, 0x7f800000u, 0xff800000u, 0x00000001u,
                                       0x80000001u, 0x7f7fffffu, 0xff7fffffu};
static const uint16_t special_f16[] = {0x0000, 0x8000, 0x3c00, 0xbc00, 0x3800, 0x7c00,
                                       0xfc00, 0x0001, 0x8001, 0x03ff, 0x7bff, 0xfbff};
static const uint16_t special_bf16[] = {0x0000, 0x8000, 0x3f80, 0xbf80, 0x3f00, 0x7f80,
                                        0xff80, 0x0001, 0x8001, 0x7f7f, 0xff7f};
static const uint32_t nan_f32[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xffffffffu};
static const uint16_t nan_f16[] = {0x7e00, 0xfe00, 0x7c01, 0xffff};
static const uint16_t nan_bf16[] = {0x7fc0, 0xffc0, 0x7f81, 0xffff};

#define PICK(rng, array) array[rng_next(rng) % (sizeof array / sizeof array[0])]

static int is_nan_bits(uint32_t bits, imoe_dtype dtype) {
  if (dtype == IMOE_DTYPE_F32) return (bits & 0x7fffffffu) > 0x7f800000u;
  return (bits & 0x7fffu) > (dtype == IMOE_DTYPE_F16 ? 0x7c00u : 0x7f80u);
}

/* Element bits from one of several distributions: raw bits, special values
 * (ties, zeros of both signs, infinities, subnormals), a narrow range (many
 * ties in 16-bit formats), or one constant. */
static void random_scores(uint64_t *rng, imoe_dtype dtype, int64_t count, int nan_rate,
                          uint8_t *out) {
  const int dist = (int)(rng_next(rng) % 4);
  const int wide = dtype == IMOE_DTYPE_F32;
  uint32_t constant;
  do {
    constant = (uint32_t)rng_next(rng) & (wide ? 0xffffffffu : 0xffffu);
  } while (is_nan_bits(constant, dtype));
  for (int64_t i = 0; i < count; i++) {
    uint32_t bits;
    if (nan_rate > 0 && (int)(rng_next(rng) % 100) < nan_rate) {
      bits = wide                      ? PICK(rng, nan_f32)
             : dtype == IMOE_DTYPE_F16 ? PICK(rng, nan_f16)
                                       : PICK(rng, nan_bf16);
    } else {
      do {
        switch (dist) {
          case 0:
            bits = (uint32_t)rng_next(rng);
            break;
          case 1:
            bits = wide                      ? PICK(rng, special_f32)
                   : dtype == IMOE_DTYPE_F16 ? PICK(rng, special_f16)
                                             : PICK(rng, special_bf16);
            break;
          case 2:
            bits = wide                      ? 0x3f000000u | ((uint32_t)rng_next(rng) & 0x7fffffu)
                   : dtype == IMOE_DTYPE_F16 ? 0x3800u | ((uint32_t)rng_next(rng) & 0x3ffu)
                                             : 0x3f00u | ((uint32_t)rng_next(rng) & 0x7fu);
            break;
          default:
            bits = constant;
            break;
        }
        if (!wide) bits &= 0xffffu;
      } while (is_nan_bits(bits, dtype));
    }
    memcpy(out + i * (wide ? 4 : 2), &bits, wide ? 4 : 2);
  }
}

static const int64_t row_sizes[] = {1, 2, 3, 4, 5, 8, 12, 16, 17, 32, 100, 1031};

static int64_t random_n(uint64_t *rng) {
  switch (rng_next(rng) % 8) {
    case 0:
      return rng_range(rng, 0, 2);
    case 1:
      return rng_range(rng, 300, 3000);
    default:
      return rng_range(rng, 3, 60);
  }
}

/* A random subset of size k of [0, n), in random order, in out[0, k). */
static void random_subset(uint64_t *rng, int64_t n, int64_t k, int64_t *out) {
  int64_t *perm = malloc(sizeof *perm * (size_t)(n + 1));
  for (int64_t i = 0; i < n; i++) perm[i] = i;
  for (int64_t i = 0; i < k; i++) {
    const int64_t j = rng_range(rng, i, n - 1);
    const int64_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
    out[i] = perm[i];
  }
  free(perm);
}

/* Fills c (and the arrays it points into) with a random case. */
static void random_case(uint64_t *rng, parity_case *c, uint8_t **scores, int64_t **active) {
  memset(c, 0, sizeof *c);
  c->seed = rng_next(rng);
  c->lead_ndim = (int32_t)rng_range(rng, 0, 3);
  for (int32_t d = 0; d < c->lead_ndim; d++) {
    c->lead_shape[d] = rng_next(rng) % 25 == 0 ? 0 : rng_range(rng, 1, 3);
  }
  int64_t rows = 1;
  for (int32_t d = 0; d < c->lead_ndim; d++) rows *= c->lead_shape[d];
  c->n = random_n(rng);
  if (rows * c->n > 20000) c->n = 20000 / (rows > 0 ? rows : 1);
  c->capacity = rng_next(rng) % 6 == 0 ? c->n + rng_range(rng, 0, 2) : rng_range(rng, 0, c->n);
  c->nan_policy = rng_next(rng) % 2 ? IMOE_NAN_LOWEST : IMOE_NAN_ERROR;
  c->mode = rng_next(rng) % 2 ? IMOE_MODE_MOVE : IMOE_MODE_SWAP;
  c->num_buffers = (int32_t)rng_range(rng, 1, 3);
  for (int32_t b = 0; b < c->num_buffers; b++) {
    c->row_bytes[b] = PICK(rng, row_sizes);
    c->buffer_layout[b] = (unsigned)rng_range(rng, 0, 15);
  }
  c->score_layout = (unsigned)rng_range(rng, 0, 15);
  c->output_layout = (unsigned)rng_range(rng, 0, 15);
  c->index_dtype = rng_next(rng) % 2 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
  c->with_target = (int)(rng_next(rng) % 2);
  c->threads = (int)rng_range(rng, -1, 2);
  c->use_active = rng_next(rng) % 4 == 0;

  if (!c->use_active) {
    c->prefix = rng_range(rng, 0, c->capacity);
    c->window = rng_range(rng, 0, c->capacity - c->prefix);
    const imoe_dtype dtypes[] = {IMOE_DTYPE_F32, IMOE_DTYPE_F16, IMOE_DTYPE_BF16};
    c->score_dtype = PICK(rng, dtypes);
    const int nan_rate = c->nan_policy == IMOE_NAN_LOWEST ? (int)rng_range(rng, 0, 30)
                         : rng_next(rng) % 10 == 0        ? 1
                                                          : 0;
    const int64_t count = rows * c->n, size = c->score_dtype == IMOE_DTYPE_F32 ? 4 : 2;
    *scores = malloc((size_t)(count * size) + 1);
    random_scores(rng, c->score_dtype, count, nan_rate, *scores);
    c->score_bytes = *scores;
    c->score_bytes_len = (size_t)(count * size);
    return;
  }
  c->capacity = rng_range(rng, 0, c->n);
  c->shared_active = (int)(rng_next(rng) % 2);
  c->active_dtype = rng_next(rng) % 2 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
  const int64_t arows = c->shared_active ? 1 : rows, k = c->capacity;
  *active = malloc(sizeof **active * (size_t)(arows * k + 1));
  for (int64_t r = 0; r < arows; r++) random_subset(rng, c->n, k, *active + r * k);
  if (arows > 0 && k > 0 && rng_next(rng) % 6 == 0) {
    /* Break one entry of one row: out of range or a repeat. */
    const int64_t r = rng_range(rng, 0, arows - 1), j = rng_range(rng, 0, k - 1);
    const int64_t bad[] = {-1, c->n, c->n + 7, (*active)[r * k + rng_range(rng, 0, k - 1)]};
    (*active)[r * k + j] = PICK(rng, bad);
  }
  c->active_values = *active;
}

static void test_random_parity(uint64_t seed, int cases) {
  uint64_t rng = seed;
  int failed = 0;
  for (int i = 0; i < cases; i++) {
    parity_case c;
    uint8_t *scores = NULL;
    int64_t *active = NULL;
    random_case(&rng, &c, &scores, &active);
    char why[256] = "";
    const int bad = parity_run(&c, why, sizeof why);
    CHECK(bad == 0 || failed > 20, "random case %d (n %lld, C %lld, P %lld, W %lld, %s): %s", i,
          (long long)c.n, (long long)c.capacity, (long long)c.prefix, (long long)c.window,
          c.use_active ? "active" : "scores", why);
    failed += bad != 0;
    free(scores);
    free(active);
  }
}

/* Maps valid by construction (from a random kept set), some then broken. */
static void test_random_maps(uint64_t seed, int cases) {
  uint64_t rng = seed;
  for (int i = 0; i < cases; i++) {
    map_case c;
    memset(&c, 0, sizeof c);
    c.seed = rng_next(&rng);
    c.lead_ndim = (int32_t)rng_range(&rng, 0, 2);
    int64_t rows = 1;
    for (int32_t d = 0; d < c.lead_ndim; d++) rows *= (c.lead_shape[d] = rng_range(&rng, 1, 3));
    c.n = rng_range(&rng, 0, 40);
    const int64_t kept = rng_range(&rng, 0, c.n);
    c.is_target = (int)(rng_next(&rng) % 2);
    c.map_n = c.is_target ? c.n : kept;
    c.map_dtype = rng_next(&rng) % 2 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
    c.mode = rng_next(&rng) % 2 ? IMOE_MODE_MOVE : IMOE_MODE_SWAP;
    c.row_bytes = PICK(&rng, row_sizes);
    c.layout = (unsigned)rng_range(&rng, 0, 15);
    c.threads = (int)rng_range(&rng, -1, 2);
    int64_t *values = malloc(sizeof *values * (size_t)(rows * c.map_n + 1));
    int64_t *chosen = malloc(sizeof *chosen * (size_t)(c.n + 1));
    int64_t *target = malloc(sizeof *target * (size_t)(c.n + 1));
    int64_t *indices = malloc(sizeof *indices * (size_t)(c.n + 1));
    uint8_t *flags = malloc((size_t)c.n + 1);
    for (int64_t r = 0; r < rows; r++) {
      random_subset(&rng, c.n, kept, chosen);
      memset(flags, 0, (size_t)c.n);
      for (int64_t j = 0; j < kept; j++) flags[chosen[j]] = 1;
      ref_pairing(flags, c.n, kept, indices, target);
      memcpy(values + r * c.map_n, c.is_target ? target : indices,
             sizeof *values * (size_t)c.map_n);
    }
    if (rows * c.map_n > 0 && rng_next(&rng) % 3 == 0) {
      const int64_t at = rng_range(&rng, 0, rows * c.map_n - 1);
      const int64_t bad[] = {-1, c.n, rng_range(&rng, 0, c.n),
                             values[rng_range(&rng, 0, rows * c.map_n - 1)], (int64_t)1 << 40};
      values[at] = PICK(&rng, bad);
    }
    c.values = values;
    char why[256] = "";
    CHECK(parity_map_run(&c, why, sizeof why) == 0, "random map %d (n %lld, C' %lld): %s", i,
          (long long)c.n, (long long)c.map_n, why);
    free(values);
    free(chosen);
    free(target);
    free(indices);
    free(flags);
  }
}

/* ---- shapes and options at their edges ---------------------------------- */

static void run_named_case(const char *name, parity_case *c, uint64_t score_seed) {
  int64_t rows = 1;
  for (int32_t d = 0; d < c->lead_ndim; d++) rows *= c->lead_shape[d];
  const int64_t size = c->score_dtype == IMOE_DTYPE_F32 ? 4 : 2;
  uint8_t *scores = malloc((size_t)(rows * c->n * size) + 1);
  uint64_t rng = score_seed;
  random_scores(&rng, c->score_dtype, rows * c->n, c->nan_policy == IMOE_NAN_LOWEST ? 10 : 0,
                scores);
  c->score_bytes = scores;
  c->score_bytes_len = (size_t)(rows * c->n * size);
  for (int threads = -1; threads <= 2; threads++) {
    for (int mode = 0; mode < 2; mode++) {
      c->threads = threads;
      c->mode = (imoe_mode)mode;
      char why[256] = "";
      CHECK(parity_run(c, why, sizeof why) == 0, "%s (threads %d, mode %d): %s", name, threads,
            mode, why);
    }
  }
  free(scores);
}

static parity_case base_case(int32_t lead_ndim, int64_t r0, int64_t n, int64_t c) {
  parity_case pc;
  memset(&pc, 0, sizeof pc);
  pc.lead_ndim = lead_ndim;
  for (int32_t d = 0; d < lead_ndim; d++) pc.lead_shape[d] = d == 0 ? r0 : 2;
  pc.n = n;
  pc.capacity = c;
  pc.score_dtype = IMOE_DTYPE_F32;
  pc.nan_policy = IMOE_NAN_LOWEST;
  pc.num_buffers = 2;
  pc.row_bytes[0] = 6;
  pc.row_bytes[1] = 4;
  pc.index_dtype = IMOE_DTYPE_I32;
  pc.with_target = 1;
  pc.seed = 42;
  return pc;
}

static void test_edge_shapes(void) {
  parity_case c;
  c = base_case(1, 0, 10, 4), run_named_case("R = 0", &c, 1);
  c = base_case(1, 3, 0, 4), run_named_case("N = 0", &c, 2);
  c = base_case(1, 3, 1, 0), run_named_case("N = 1, C = 0", &c, 3);
  c = base_case(1, 3, 1, 1), run_named_case("N = 1, C = 1", &c, 4);
  c = base_case(1, 3, 50, 0), run_named_case("C = 0", &c, 5);
  c = base_case(1, 3, 50, 50), run_named_case("C = N", &c, 6);
  c = base_case(1, 3, 50, 80), run_named_case("C > N", &c, 7);
  c = base_case(1, 3, 50, 49), run_named_case("C = N - 1", &c, 8);
  c = base_case(0, 1, 200, 77), run_named_case("lead_ndim 0", &c, 9);
  c = base_case(3, 2, 40, 13), run_named_case("lead_ndim 3", &c, 10);
  c = base_case(2, 3, 64, 20);
  c.prefix = 4, c.window = 16, run_named_case("P + W = C", &c, 11);
  c = base_case(2, 3, 64, 20);
  c.prefix = 3, c.window = 5, c.score_dtype = IMOE_DTYPE_F16, run_named_case("P, W, f16", &c, 12);
  c = base_case(2, 3, 64, 20);
  c.score_dtype = IMOE_DTYPE_BF16, run_named_case("bf16", &c, 13);
  c = base_case(2, 2, 30, 11);
  c.row_bytes[0] = 1, c.row_bytes[1] = 1, run_named_case("1-byte rows", &c, 14);
  c = base_case(1, 2, 12, 5);
  c.num_buffers = 1, c.row_bytes[0] = 65536, run_named_case("64 KiB rows", &c, 15);
  c = base_case(2, 3, 40, 15);
  c.buffer_layout[0] = T_NEG_SLOTS | T_NEG_LEAD, c.buffer_layout[1] = T_PAD | T_NEG_SLOTS;
  c.score_layout = T_NEG_SLOTS | T_LEAD_REVERSED, c.output_layout = T_NEG_SLOTS | T_NEG_LEAD;
  run_named_case("negative strides", &c, 16);
  c = base_case(1, 2, 5000, 2500);
  c.index_dtype = IMOE_DTYPE_I64, run_named_case("long rows", &c, 17);
  c = base_case(1, 1, 4096, 1000);
  c.num_buffers = 1, c.row_bytes[0] = 256, run_named_case("R = 1, long row, threads", &c, 18);
}

/* ---- behaviour pinned by hand ------------------------------------------- */

static void test_ties(void) {
  /* All equal: the lowest indices of the middle win; the window is kept. */
  float s[10];
  for (int i = 0; i < 10; i++) s[i] = 0.5f;
  int64_t got[6];
  const int64_t want[6] = {0, 1, 2, 3, 8, 9};
  CHECK(select_one(s, IMOE_DTYPE_F32, 4, 10, 6, 1, 2, IMOE_NAN_ERROR, got) == IMOE_OK, "ties");
  CHECK(same_indices(got, want, 6), "ties: got %lld %lld %lld %lld %lld %lld", (long long)got[0],
        (long long)got[1], (long long)got[2], (long long)got[3], (long long)got[4],
        (long long)got[5]);
  /* A tie at the threshold: of the three 2.0s, the two lowest indices win.
   * Kept {1, 2, 3}: hole 0 takes 3. */
  const float t[6] = {1.0f, 3.0f, 2.0f, 2.0f, 0.0f, 2.0f};
  const int64_t want_t[3] = {3, 1, 2};
  int64_t got_t[3];
  CHECK(select_one(t, IMOE_DTYPE_F32, 4, 6, 3, 0, 0, IMOE_NAN_ERROR, got_t) == IMOE_OK, "tie 2");
  CHECK(same_indices(got_t, want_t, 3), "threshold tie: got %lld %lld %lld", (long long)got_t[0],
        (long long)got_t[1], (long long)got_t[2]);
}

static void test_signed_zero(void) {
  /* -0.0 and +0.0 tie, so the lower index wins whatever the sign. */
  const float s[5] = {-1.0f, 0.0f, -0.0f, -0.0f, 0.0f};
  int64_t got[2];
  const int64_t want[2] = {2, 1};
  CHECK(select_one(s, IMOE_DTYPE_F32, 4, 5, 2, 0, 0, IMOE_NAN_ERROR, got) == IMOE_OK, "zeros");
  CHECK(same_indices(got, want, 2), "signed zero f32: got %lld %lld", (long long)got[0],
        (long long)got[1]);
  const uint16_t h[5] = {0xbc00, 0x0000, 0x8000, 0x8000, 0x0000};
  CHECK(select_one(h, IMOE_DTYPE_F16, 2, 5, 2, 0, 0, IMOE_NAN_ERROR, got) == IMOE_OK, "zeros f16");
  CHECK(same_indices(got, want, 2), "signed zero f16");
  const uint16_t b[5] = {0xbf80, 0x0000, 0x8000, 0x8000, 0x0000};
  CHECK(select_one(b, IMOE_DTYPE_BF16, 2, 5, 2, 0, 0, IMOE_NAN_ERROR, got) == IMOE_OK,
        "zeros bf16");
  CHECK(same_indices(got, want, 2), "signed zero bf16");
}

/* Ordered ascending by value: keeping the top k must keep the last k. */
static void check_ascending(const char *name, const uint16_t *bits, int64_t n, imoe_dtype dtype) {
  for (int64_t k = 1; k < n; k++) {
    int64_t got[32];
    int64_t want[32];
    /* Kept: slots n-k..n-1; holes 0..k-1 (all of them dropped) take them. */
    for (int64_t i = 0; i < k; i++) want[i] = n - k + i;
    if (k > n - k) {
      for (int64_t i = n - k; i < k; i++) want[i] = i;
      for (int64_t i = 0, t = k; i < n - k; i++) want[i] = t++;
    }
    CHECK(select_one(bits, dtype, 2, n, k, 0, 0, IMOE_NAN_LOWEST, got) == IMOE_OK, "%s", name);
    CHECK(same_indices(got, want, k), "%s: order broken at k = %lld", name, (long long)k);
  }
}

static void test_half_keys(void) {
  /* NaN below -inf, then -inf, -max, -1, -subnormals, 0, subnormals, 1,
   * max, inf. */
  const uint16_t f16[] = {0x7e01, 0xfc00, 0xfbff, 0xbc00, 0x8400, 0x83ff, 0x8001, 0x0000,
                          0x0001, 0x03ff, 0x0400, 0x3c00, 0x3c01, 0x7bff, 0x7c00};
  check_ascending("f16 order", f16, (int64_t)(sizeof f16 / 2), IMOE_DTYPE_F16);
  const uint16_t bf16[] = {0xffc0, 0xff80, 0xff7f, 0xbf80, 0x8080, 0x807f, 0x8001, 0x0000,
                           0x0001, 0x007f, 0x0080, 0x3f80, 0x3f81, 0x7f7f, 0x7f80};
  check_ascending("bf16 order", bf16, (int64_t)(sizeof bf16 / 2), IMOE_DTYPE_BF16);
}

static void test_nan_policies(void) {
  const float nan = NAN;
  const float s[6] = {1.0f, nan, -INFINITY, 2.0f, nan, 0.5f};
  int64_t got[5];
  imoe_view sv = vec_view((void *)s, 6, IMOE_DTYPE_F32, 4);
  imoe_view iv = vec_view(got, 4, IMOE_DTYPE_I64, 8);
  imoe_selection sel = {&sv, NULL, 4, 0, 0, IMOE_NAN_ERROR};
  imoe_error err;
  for (int i = 0; i < 4; i++) got[i] = -7;
  CHECK(imoe_build_map(&sel, &iv, NULL, NULL, 0, NULL, &err) == IMOE_ERR_NAN, "NaN error");
  CHECK(strstr(err.message, "scores") && strstr(err.message, "slot 1"), "NaN message: %s",
        err.message);
  CHECK(got[0] == -7 && got[3] == -7, "NaN error wrote the output");
  /* NaN fails even when every slot is kept: the policy judges the data. */
  int64_t all[6];
  imoe_view iv6 = vec_view(all, 6, IMOE_DTYPE_I64, 8);
  sel.capacity = 6;
  CHECK(imoe_build_map(&sel, &iv6, NULL, NULL, 0, NULL, NULL) == IMOE_ERR_NAN, "NaN error, C = N");
  /* LOWEST: the NaNs go below -inf. Ranking 3, 0, 5, 2, then 1 and 4:
   * kept {0, 2, 3, 5}, hole 1 takes 5. */
  const int64_t want[4] = {0, 5, 2, 3};
  CHECK(select_one(s, IMOE_DTYPE_F32, 4, 6, 4, 0, 0, IMOE_NAN_LOWEST, got) == IMOE_OK, "lowest");
  CHECK(same_indices(got, want, 4), "NaN lowest: got %lld %lld %lld %lld", (long long)got[0],
        (long long)got[1], (long long)got[2], (long long)got[3]);
  /* Only NaNs left to choose from: ties among NaNs go to the lower index. */
  const float all_nan[4] = {nan, nan, nan, nan};
  const int64_t want_n[2] = {0, 1};
  CHECK(select_one(all_nan, IMOE_DTYPE_F32, 4, 4, 2, 0, 0, IMOE_NAN_LOWEST, got) == IMOE_OK,
        "all NaN");
  CHECK(same_indices(got, want_n, 2), "all NaN order");
}

static void test_move_mode(void) {
  /* Move copies the kept tail into the holes and leaves the tail alone. */
  uint8_t data[6] = {10, 11, 12, 13, 14, 15};
  const float s[6] = {5, 0, 4, 0, 9, 8};
  int64_t idx[3];
  imoe_view dv = vec_view(data, 6, IMOE_DTYPE_BYTES, 1);
  imoe_view sv = vec_view((void *)s, 6, IMOE_DTYPE_F32, 4);
  imoe_view iv = vec_view(idx, 3, IMOE_DTYPE_I64, 8);
  imoe_selection sel = {&sv, NULL, 3, 0, 0, IMOE_NAN_ERROR};
  /* Kept {0, 4, 5}: holes 1, 2 take 4, 5. */
  CHECK(imoe_compact(&dv, 1, &sel, &iv, NULL, IMOE_MODE_MOVE, NULL, 0, NULL, NULL) == IMOE_OK, "move");
  const uint8_t want[6] = {10, 14, 15, 13, 14, 15};
  CHECK(memcmp(data, want, 6) == 0, "move result %d %d %d %d %d %d", data[0], data[1], data[2],
        data[3], data[4], data[5]);
  CHECK(idx[0] == 0 && idx[1] == 4 && idx[2] == 5, "move indices");
  uint8_t swapped[6] = {10, 11, 12, 13, 14, 15};
  dv.data = swapped;
  CHECK(imoe_compact(&dv, 1, &sel, &iv, NULL, IMOE_MODE_SWAP, NULL, 0, NULL, NULL) == IMOE_OK, "swap");
  const uint8_t want_swap[6] = {10, 14, 15, 13, 11, 12};
  CHECK(memcmp(swapped, want_swap, 6) == 0, "swap result");
}

/* Compacting the scores with the data (the same memory is the selection
 * and a buffer), then again with the compacted scores, moves nothing. */
static void test_idempotence(void) {
  const imoe_dtype dtypes[] = {IMOE_DTYPE_F32, IMOE_DTYPE_F16, IMOE_DTYPE_BF16};
  uint64_t rng = 7;
  for (int t = 0; t < 3; t++) {
    for (int trial = 0; trial < 20; trial++) {
      const int64_t lead[2] = {3, 2}, n = rng_range(&rng, 1, 300);
      const int64_t c = rng_range(&rng, 0, n + 1);
      const int64_t p = rng_range(&rng, 0, c < n ? c : n);
      const imoe_dtype dt = dtypes[t];
      const int64_t size = dt == IMOE_DTYPE_F32 ? 4 : 2;
      const imoe_nan_policy nan = trial % 2 ? IMOE_NAN_LOWEST : IMOE_NAN_ERROR;
      tensor data = tensor_make(2, lead, n, 24, IMOE_DTYPE_BYTES, (unsigned)trial % 16, &rng);
      tensor scores = tensor_make(2, lead, n, size, dt, T_PAD, &rng);
      const int64_t kept = c < n ? c : n;
      tensor idx = tensor_make(2, lead, kept, 8, IMOE_DTYPE_I64, 0, &rng);
      uint8_t *bits = malloc((size_t)(6 * n * size));
      random_scores(&rng, dt, 6 * n, nan == IMOE_NAN_LOWEST ? 5 : 0, bits);
      for (int64_t r = 0; r < 6; r++) {
        for (int64_t s = 0; s < n; s++)
          memcpy(tensor_at(&scores, r, s), bits + (r * n + s) * size, (size_t)size);
      }
      imoe_view buffers[2] = {data.view, scores.view};
      imoe_selection sel = {&scores.view, NULL, c, p, 0, nan};
      imoe_exec exec = {IMOE_DEVICE_CPU, 0, 1 + trial % 2, NULL};
      imoe_error err;
      imoe_status st = imoe_compact(buffers, 2, &sel, &idx.view, NULL, IMOE_MODE_SWAP, NULL, 0, &exec, &err);
      CHECK(st == IMOE_OK, "idempotence first pass: %s", err.message);
      unsigned char *after_once = tensor_snapshot(&data), *scores_once = tensor_snapshot(&scores);
      st = imoe_compact(buffers, 2, &sel, &idx.view, NULL, IMOE_MODE_SWAP, NULL, 0, &exec, &err);
      CHECK(st == IMOE_OK, "idempotence second pass: %s", err.message);
      int identity = 1;
      for (int64_t r = 0; r < 6; r++) {
        for (int64_t i = 0; i < kept; i++) {
          int64_t v;
          memcpy(&v, tensor_at(&idx, r, i), 8);
          identity &= v == i;
        }
      }
      CHECK(identity, "idempotence: second pass moved slots (%s, n %lld, C %lld, P %lld)",
            dt == IMOE_DTYPE_F32 ? "f32" : "16-bit", (long long)n, (long long)c, (long long)p);
      CHECK(tensor_same(&data, after_once) && tensor_same(&scores, scores_once),
            "idempotence: second pass changed data");
      free(after_once);
      free(scores_once);
      free(bits);
      tensor_free(&data);
      tensor_free(&scores);
      tensor_free(&idx);
    }
  }
}

/* R = 0 reads and writes nothing, so even views with no memory behind them
 * (data NULL) and the largest N pass, without a workspace for that N. */
static void test_empty_rows(void) {
  imoe_view s = vec_view(NULL, INT32_MAX, IMOE_DTYPE_F32, 4);
  s.lead_ndim = 1;
  s.lead_shape[0] = 0;
  s.lead_stride[0] = 4;
  imoe_view tm = s;
  tm.dtype = IMOE_DTYPE_I32;
  imoe_view idx = tm;
  idx.n = 1000;
  imoe_view buf = s;
  buf.dtype = IMOE_DTYPE_BYTES;
  buf.row_bytes = 4096;
  buf.n_stride = 4096;
  imoe_selection sel = {&s, NULL, 1000, 10, 10, IMOE_NAN_ERROR};
  imoe_error err;
  CHECK(imoe_build_map(&sel, &idx, &tm, NULL, 0, NULL, &err) == IMOE_OK, "R = 0 build_map: %s", err.message);
  CHECK(imoe_compact(&buf, 1, &sel, &idx, &tm, IMOE_MODE_SWAP, NULL, 0, NULL, &err) == IMOE_OK,
        "R = 0 compact: %s", err.message);
  CHECK(imoe_apply_target_map(&buf, 1, &tm, IMOE_MODE_MOVE, NULL, &err) == IMOE_OK,
        "R = 0 apply: %s", err.message);
}

/* imoe_mark_top_k against a sort by (key descending, index ascending), on
 * rows either side of the lengths where it ranks by comparison instead of
 * radix passes (12 keys of 16 bits, 32 of 32); keys drawn from a few values (ties at the threshold) or
 * from all 32 or 16 bits, at an offset lo > 0. */
static int by_key_then_index(const void *a, const void *b) {
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static void test_mark_top_k(void) {
  enum { MAX_N = 80, LO = 3 };
  static uint32_t keys[LO + MAX_N], hist[IMOE_RADIX_HIST], cand[MAX_N];
  static uint8_t kept[LO + MAX_N], want[LO + MAX_N];
  static uint64_t order[MAX_N];
  uint64_t rng = 0x70b0c4;
  int bad = 0;
  for (int64_t n = 2; n <= MAX_N && !bad; n++) {
    for (int trial = 0; trial < 24 && !bad; trial++) {
      const int key_bits = trial % 2 ? 16 : 32;
      const uint32_t mask = key_bits == 32 ? 0xffffffffu : 0xffffu;
      const uint32_t values = trial % 3 == 0 ? 3u : 0u; /* few values: ties */
      for (int64_t i = 0; i < n; i++) {
        const uint32_t r = (uint32_t)rng_next(&rng);
        keys[LO + i] = (values ? (r % values) * (mask / 3u) : r) & mask;
      }
      const int64_t k = rng_range(&rng, 1, n - 1);
      /* Sorting (~key, index) ascending puts the kept keys first. */
      for (int64_t i = 0; i < n; i++)
        order[i] = ((uint64_t)(~keys[LO + i] & mask) << 32) | (uint64_t)(LO + i);
      qsort(order, (size_t)n, sizeof order[0], by_key_then_index);
      memset(want, 0, sizeof want);
      for (int64_t j = 0; j < k; j++) want[order[j] & 0xffffffffu] = 1;
      memset(kept, 7, sizeof kept);
      imoe_mark_top_k(keys, LO, LO + n, k, key_bits, hist, cand, kept);
      bad = memcmp(kept + LO, want + LO, (size_t)n) != 0;
      CHECK(!bad, "mark_top_k: n %lld, k %lld, %d-bit keys, %s", (long long)n, (long long)k,
            key_bits, values ? "few values" : "random");
    }
  }
}

static void test_status_strings(void) {
  CHECK(strncmp(imoe_status_string(IMOE_OK), "IMOE_OK", 7) == 0, "OK string");
  CHECK(strncmp(imoe_status_string(IMOE_ERR_NAN), "IMOE_ERR_NAN:", 13) == 0, "NAN string");
  CHECK(strncmp(imoe_status_string(IMOE_ERR_UNSUPPORTED), "IMOE_ERR_UNSUPPORTED:", 21) == 0,
        "UNSUPPORTED string");
  CHECK(imoe_status_string((imoe_status)99) != NULL, "unknown status string");
  /* The C tests link the core with csrc/backend_none.c. */
  CHECK(imoe_cuda_compiled() == 0, "cuda not compiled");
  CHECK(imoe_cuda_device_count() == 0, "no CUDA device usable without the CUDA backend");
}

int main(void) {
  test_reference_conversions();
  test_status_strings();
  test_ties();
  test_mark_top_k();
  test_signed_zero();
  test_half_keys();
  test_nan_policies();
  test_move_mode();
  test_idempotence();
  test_edge_shapes();
  test_empty_rows();
  test_random_maps(0x5eed0001, 1500);
  test_random_parity(0x5eed0002, 2500);
  test_status_paths();
  test_permute_all();
  test_moe_gemm_all();
  test_router_all();
  test_moe_shapes_all();
  test_experts_gemm_all();
  printf("%d passed, %d failed\n", checks_passed, checks_failed);
  return checks_failed == 0 ? 0 : 1;
}
