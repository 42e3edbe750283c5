/* test_moe_gemm.c: imoe_grouped_gemm on the CPU. Every element of out is
 * checked bit for bit against a reimplementation of the documented order
 * (element k to partial sum (k / V) mod 32, fmaf in increasing k, the
 * butterfly 16, 8, 4, 2, 1, one rounding into the dtype) and within a
 * bound derived from K and the dtypes' unit roundoff against a double
 * reference; every byte out may not write (rows at or past offsets[E - 1],
 * padding, guards) keeps its sentinel. Weights come N-contiguous, K
 * contiguous (transformers' weights transposed) and generally strided.
 * Every argument error returns its status, names the argument and leaves
 * every byte as it was. Fixed seeds. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "floats.h"
#include "gemm_support.h"
#include "idempotent_moe.h"
#include "tensor.h"

/* Unit roundoff of the dtype, and half its smallest subnormal (the absolute
 * error of a rounding into it near zero). */
static double unit_roundoff(imoe_dtype dt) {
  return dt == IMOE_DTYPE_F32 ? ldexp(1.0, -24) : dt == IMOE_DTYPE_F16 ? ldexp(1.0, -11) : ldexp(1.0, -8);
}

static double tiny_error(imoe_dtype dt) {
  return dt == IMOE_DTYPE_F16 ? ldexp(1.0, -25) : ldexp(1.0, -150);
}

/* The documented order, written from the header: element k to partial sum
 * (k / v) mod 32, fmaf in increasing k, then the butterfly. */
static float lane_order_dot(const float *a, const float *w, int64_t k_n, int64_t v) {
  float p[32];
  for (int l = 0; l < 32; l++) p[l] = 0.0f;
  for (int64_t k = 0; k < k_n; k++) {
    const int64_t l = (k / v) % 32;
    p[l] = fmaf(a[k], w[k], p[l]);
  }
  for (int h = 16; h >= 1; h /= 2)
    for (int l = 0; l < h; l++) p[l] = p[l] + p[l + h];
  return p[0];
}

/* ---- one case ------------------------------------------------------------- */

typedef struct gemm_case {
  imoe_dtype dtype;
  int64_t r, k, n, e;
  int32_t offsets[16];
  unsigned a_layout, out_layout, offsets_layout;
  int w_layout;
} gemm_case;

static void run_case(const gemm_case *c, uint64_t *rng, const char *label) {
  const imoe_dtype dt = c->dtype;
  const int64_t size = gemm_elem_size(dt), v = 16 / size;
  tensor a = tensor_make(1, &c->r, c->k, size, dt, c->a_layout, rng);
  tensor w = gemm_weights_make(c->e, c->k, c->n, dt, c->w_layout, rng);
  tensor offs = tensor_make(0, NULL, c->e, 4, IMOE_DTYPE_I32, c->offsets_layout, rng);
  tensor out = tensor_make(1, &c->r, c->n, size, dt, c->out_layout, rng);
  gemm_fill_values(&a, c->r, c->k, rng);
  gemm_fill_values(&w, c->e * c->k, c->n, rng);
  for (int64_t e = 0; e < c->e; e++) tensor_put_index(tensor_at(&offs, 0, e), IMOE_DTYPE_I32, c->offsets[e]);
  memset(out.alloc, GEMM_SENTINEL, out.bytes);
  unsigned char *snap_a = tensor_snapshot(&a), *snap_w = tensor_snapshot(&w);
  unsigned char *snap_offs = tensor_snapshot(&offs), *sentinel = tensor_snapshot(&out);

  /* Expected bytes: the sentinel, with rows below offsets[E - 1] written. */
  const int64_t end = c->offsets[c->e - 1];
  unsigned char *want = tensor_snapshot(&out);
  float *arow = malloc((size_t)(c->k > 0 ? c->k : 1) * sizeof(float));
  float *wcol = malloc((size_t)(c->k > 0 ? c->k : 1) * sizeof(float));
  const double gamma = (double)(c->k + 5) * ldexp(1.0, -24) / (1.0 - (double)(c->k + 5) * ldexp(1.0, -24));
  double worst = 0.0;
  int64_t bound_fail = 0;
  for (int64_t r = 0, e = 0; r < end; r++) {
    while (c->offsets[e] <= r) e++;
    for (int64_t k = 0; k < c->k; k++) arow[k] = gemm_load_at(&a, r, k);
    for (int64_t n = 0; n < c->n; n++) {
      double ref = 0.0, mag = 0.0;
      for (int64_t k = 0; k < c->k; k++) {
        wcol[k] = gemm_load_at(&w, e * c->k + k, n);
        ref += (double)arow[k] * (double)wcol[k]; /* each product exact in double */
        mag += fabs((double)arow[k] * (double)wcol[k]);
      }
      const float sum = lane_order_dot(arow, wcol, c->k, v);
      unsigned char *at = want + ((unsigned char *)tensor_at(&out, r, n) - out.alloc);
      imoe_store_float((char *)at, dt, sum);
      const double got = imoe_load_float((const char *)at, dt);
      const double u = unit_roundoff(dt);
      const double bound = gamma * mag + u * (fabs(ref) + gamma * mag) + tiny_error(dt);
      const double err = fabs(got - ref);
      if (err > bound) bound_fail++;
      if (bound > 0 && err / bound > worst) worst = err / bound;
    }
  }
  CHECK(bound_fail == 0, "%s: %lld elements outside the K-epsilon bound (worst %.3g of it), %s K %lld",
        label, (long long)bound_fail, worst, gemm_dtype_name(dt), (long long)c->k);

  /* threads 1, then 4, then exec NULL: each from the sentinel, each the expected bytes. */
  const imoe_exec execs[2] = {{IMOE_DEVICE_CPU, 0, 1, NULL}, {IMOE_DEVICE_CPU, 0, 4, NULL}};
  for (int x = 0; x < 3; x++) {
    memcpy(out.alloc, sentinel, out.bytes);
    imoe_error err;
    memset(&err, 0, sizeof err);
    const imoe_status st =
        imoe_grouped_gemm(&a.view, &w.view, &offs.view, &out.view, x < 2 ? &execs[x] : NULL, &err);
    CHECK(st == IMOE_OK, "%s: status %d (%s)", label, (int)st, err.message);
    int64_t first = -1;
    for (size_t i = 0; i < out.bytes && first < 0; i++)
      if (out.alloc[i] != want[i]) first = (int64_t)i;
    CHECK(first < 0, "%s (%s, R %lld K %lld N %lld E %lld end %lld, w %s, run %d): out differs from the "
          "documented order at byte %lld",
          label, gemm_dtype_name(dt), (long long)c->r, (long long)c->k, (long long)c->n, (long long)c->e,
          (long long)end, gemm_w_layout_name[c->w_layout], x, (long long)first);
    CHECK(tensor_same(&a, snap_a) && tensor_same(&w, snap_w) && tensor_same(&offs, snap_offs),
          "%s: an input changed", label);
  }
  free(arow);
  free(wcol);
  free(want);
  free(sentinel);
  free(snap_a);
  free(snap_w);
  free(snap_offs);
  tensor_free(&a);
  tensor_free(&w);
  tensor_free(&offs);
  tensor_free(&out);
}

static const int64_t k_sizes[] = {1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33, 64, 127,
                                  128, 129, 255, 256, 257, 260, 511, 1031};
static const int64_t n_sizes[] = {1, 2, 3, 7, 63, 64, 65, 130};

static void test_random_cases(uint64_t seed, int cases) {
  uint64_t rng = seed;
  char label[64];
  for (int i = 0; i < cases; i++) {
    gemm_case c;
    memset(&c, 0, sizeof c);
    c.dtype = gemm_dtypes[i % 3];
    c.w_layout = (i / 3) % W_LAYOUTS;
    c.k = k_sizes[rng_next(&rng) % (sizeof k_sizes / sizeof k_sizes[0])];
    c.n = n_sizes[rng_next(&rng) % (sizeof n_sizes / sizeof n_sizes[0])];
    c.r = rng_range(&rng, 0, c.k * c.n > 20000 ? 12 : 40);
    c.e = rng_range(&rng, 1, 9);
    const int64_t end = rng_next(&rng) % 2 ? c.r : rng_range(&rng, 0, c.r);
    gemm_random_offsets(&rng, c.offsets, c.e, end);
    c.a_layout = gemm_view_layouts[rng_next(&rng) % 5];
    c.out_layout = gemm_view_layouts[rng_next(&rng) % 5];
    c.offsets_layout = gemm_view_layouts[rng_next(&rng) % 3];
    snprintf(label, sizeof label, "random case %d", i);
    run_case(&c, &rng, label);
  }
}

/* ---- named shapes --------------------------------------------------------- */

static void named(imoe_dtype dt, int w_layout, int64_t r, int64_t k, int64_t n, int64_t e,
                  const int32_t *offsets, const char *label) {
  gemm_case c;
  memset(&c, 0, sizeof c);
  c.dtype = dt;
  c.w_layout = w_layout;
  c.r = r;
  c.k = k;
  c.n = n;
  c.e = e;
  memcpy(c.offsets, offsets, (size_t)e * sizeof(int32_t));
  c.out_layout = T_PAD;
  uint64_t rng = 0x9e11u + (uint64_t)k * 31u + (uint64_t)n;
  run_case(&c, &rng, label);
}

static void test_named_shapes(void) {
  for (int t = 0; t < 3; t++) {
    const imoe_dtype dt = gemm_dtypes[t];
    for (int wl = 0; wl < W_LAYOUTS; wl++) {
      const int32_t empty_experts[7] = {0, 0, 3, 3, 3, 7, 7};
      named(dt, wl, 7, 40, 9, 7, empty_experts, "empty experts");
      const int32_t in_first[4] = {11, 11, 11, 11}, in_third[4] = {0, 0, 11, 11}, in_last[4] = {0, 0, 0, 11};
      named(dt, wl, 11, 70, 66, 4, in_first, "all rows in expert 0");
      named(dt, wl, 11, 70, 66, 4, in_third, "all rows in expert 2");
      named(dt, wl, 11, 70, 66, 4, in_last, "all rows in the last expert");
      const int32_t short_end[3] = {2, 5, 6}, none[2] = {0, 0};
      named(dt, wl, 10, 24, 5, 3, short_end, "rows past offsets[E - 1]");
      named(dt, wl, 10, 24, 5, 2, none, "offsets[E - 1] = 0: nothing written");
      const int32_t one[1] = {9};
      named(dt, wl, 9, 13, 1, 1, one, "N = 1, K = 13 (not a multiple of the vector)");
      named(dt, wl, 9, 1, 1, 1, one, "K = 1, N = 1");
      named(dt, wl, 9, 32 * 8 * 3 + 5, 1, 1, one, "K past 32 vectors: lanes wrap, a ragged tail");
      named(dt, wl, 9, 7, 200, 1, one, "K = 7 < V, N over three column blocks");
      const int32_t single[2] = {0, 1};
      named(dt, wl, 1, 100, 3, 2, single, "R = 1 in the last of two experts");
      const int32_t zero_rows[3] = {0, 0, 0};
      named(dt, wl, 0, 16, 4, 3, zero_rows, "R = 0");
    }
  }
}

/* The exact check can tell the documented order from a plain left-to-right
 * fmaf sum (else it would prove little). */
static void test_order_matters(void) {
  uint64_t rng = 41;
  const int64_t k_n = 1031;
  float a[1031], w[1031];
  int64_t differ = 0;
  for (int trial = 0; trial < 50; trial++) {
    for (int64_t k = 0; k < k_n; k++) {
      a[k] = (float)((double)(rng_next(&rng) >> 11) * ldexp(1.0, -52) - 1.0);
      w[k] = (float)((double)(rng_next(&rng) >> 11) * ldexp(1.0, -52) - 1.0);
    }
    float plain = 0.0f;
    for (int64_t k = 0; k < k_n; k++) plain = fmaf(a[k], w[k], plain);
    differ += imoe_bits_from_f32(plain) != imoe_bits_from_f32(lane_order_dot(a, w, k_n, 4));
  }
  CHECK(differ > 10, "lane order matches a plain sum in %lld of 50 trials", (long long)(50 - differ));
}

/* K = 0: a and w have no element (data NULL is fine); rows below
 * offsets[E - 1] become +0.0, the others keep their bytes. */
static void test_k_zero(void) {
  for (int t = 0; t < 3; t++) {
    const imoe_dtype dt = gemm_dtypes[t];
    const int64_t size = gemm_elem_size(dt), r_n = 5, n_n = 3, e_n = 2, lead[2] = {e_n, 0};
    uint64_t rng = 5;
    tensor a = tensor_make(1, &r_n, 0, size, dt, 0, &rng);
    tensor w = tensor_make(2, lead, n_n, size, dt, 0, &rng);
    tensor offs = tensor_make(0, NULL, e_n, 4, IMOE_DTYPE_I32, 0, &rng);
    tensor out = tensor_make(1, &r_n, n_n, size, dt, T_PAD, &rng);
    tensor_put_index(tensor_at(&offs, 0, 0), IMOE_DTYPE_I32, 1);
    tensor_put_index(tensor_at(&offs, 0, 1), IMOE_DTYPE_I32, 4);
    a.view.data = NULL;
    w.view.data = NULL;
    memset(out.alloc, GEMM_SENTINEL, out.bytes);
    unsigned char *want = tensor_snapshot(&out);
    for (int64_t r = 0; r < 4; r++)
      for (int64_t n = 0; n < n_n; n++)
        imoe_store_float((char *)want + ((unsigned char *)tensor_at(&out, r, n) - out.alloc), dt, 0.0f);
    imoe_error err;
    memset(&err, 0, sizeof err);
    const imoe_exec exec = {IMOE_DEVICE_CPU, 0, 2, NULL};
    const imoe_status st = imoe_grouped_gemm(&a.view, &w.view, &offs.view, &out.view, &exec, &err);
    CHECK(st == IMOE_OK, "K = 0 %s: status %d (%s)", gemm_dtype_name(dt), (int)st, err.message);
    CHECK(tensor_same(&out, want), "K = 0 %s: out is not +0.0 below offsets[E - 1] and untouched past it",
          gemm_dtype_name(dt));
    free(want);
    tensor_free(&a);
    tensor_free(&w);
    tensor_free(&offs);
    tensor_free(&out);
  }
}

/* ---- argument errors -------------------------------------------------------- */

enum { G_A, G_W, G_OFFS, G_OUT, G_COUNT };

typedef struct gemm_world {
  tensor t[G_COUNT];
  unsigned char *snap[G_COUNT];
} gemm_world;

#define GR 6
#define GK 10
#define GN 5
#define GE 3

static void gemm_world_init(gemm_world *g) {
  uint64_t seed = 77;
  const int64_t r_n = GR, w_lead[2] = {GE, GK};
  g->t[G_A] = tensor_make(1, &r_n, GK, 4, IMOE_DTYPE_F32, T_PAD, &seed);
  g->t[G_W] = tensor_make(2, w_lead, GN, 4, IMOE_DTYPE_F32, 0, &seed);
  g->t[G_OFFS] = tensor_make(0, NULL, GE, 4, IMOE_DTYPE_I32, 0, &seed);
  g->t[G_OUT] = tensor_make(1, &r_n, GN, 4, IMOE_DTYPE_F32, T_NEG_SLOTS, &seed);
  gemm_fill_values(&g->t[G_A], GR, GK, &seed);
  gemm_fill_values(&g->t[G_W], GE * GK, GN, &seed);
  const int32_t offsets[GE] = {2, 2, 5};
  for (int e = 0; e < GE; e++) tensor_put_index(tensor_at(&g->t[G_OFFS], 0, e), IMOE_DTYPE_I32, offsets[e]);
  memset(g->t[G_OUT].alloc, GEMM_SENTINEL, g->t[G_OUT].bytes);
  for (int i = 0; i < G_COUNT; i++) g->snap[i] = tensor_snapshot(&g->t[i]);
}

static void gemm_world_free(gemm_world *g) {
  for (int i = 0; i < G_COUNT; i++) {
    tensor_free(&g->t[i]);
    free(g->snap[i]);
  }
}

static void set_offsets(gemm_world *g, int32_t o0, int32_t o1, int32_t o2) {
  const int32_t offsets[GE] = {o0, o1, o2};
  for (int e = 0; e < GE; e++) tensor_put_index(tensor_at(&g->t[G_OFFS], 0, e), IMOE_DTYPE_I32, offsets[e]);
  free(g->snap[G_OFFS]);
  g->snap[G_OFFS] = tensor_snapshot(&g->t[G_OFFS]);
}

static int gemm_expect_line;

static void gemm_expect(const gemm_world *g, const char *label, imoe_status got, imoe_status want,
                        const imoe_error *err, const char *mention) {
  CHECK(got == want, "line %d, %s: status %d, expected %d (%s)", gemm_expect_line, label, (int)got,
        (int)want, err->message);
  CHECK(strstr(err->message, mention) != NULL, "line %d, %s: message \"%s\" lacks \"%s\"",
        gemm_expect_line, label, err->message, mention);
  for (int i = 0; i < G_COUNT; i++)
    CHECK(tensor_same(&g->t[i], g->snap[i]), "line %d, %s: view %d changed", gemm_expect_line, label, i);
}

#define GEMM_EXPECT(label, a_, w_, offs_, out_, exec_, want, mention)                             \
  do {                                                                                            \
    imoe_error err_;                                                                              \
    memset(&err_, 0, sizeof err_);                                                                \
    gemm_expect_line = __LINE__;                                                                  \
    const imoe_status got_ = imoe_grouped_gemm(a_, w_, offs_, out_, exec_, &err_);                \
    gemm_expect(&g, label, got_, want, &err_, mention);                                           \
    const imoe_status quiet_ = imoe_grouped_gemm(a_, w_, offs_, out_, exec_, NULL);               \
    CHECK(quiet_ == want, "line %d, %s with err NULL: status %d", __LINE__, label, (int)quiet_);   \
  } while (0)

static void test_argument_errors(void) {
  gemm_world g;
  gemm_world_init(&g);
  const imoe_view *a = &g.t[G_A].view, *w = &g.t[G_W].view, *offs = &g.t[G_OFFS].view,
                  *out = &g.t[G_OUT].view;
  const imoe_exec cpu = {IMOE_DEVICE_CPU, 0, 2, NULL};
  imoe_view v;

  /* NULL views: every one is required. */
  GEMM_EXPECT("a NULL", NULL, w, offs, out, &cpu, IMOE_ERR_ARGUMENT, "a is NULL");
  GEMM_EXPECT("w NULL", a, NULL, offs, out, &cpu, IMOE_ERR_ARGUMENT, "w is NULL");
  GEMM_EXPECT("offsets NULL", a, w, NULL, out, &cpu, IMOE_ERR_ARGUMENT, "offsets is NULL");
  GEMM_EXPECT("out NULL", a, w, offs, NULL, &cpu, IMOE_ERR_ARGUMENT, "out is NULL");
  v = *a, v.data = NULL;
  GEMM_EXPECT("a data NULL", &v, w, offs, out, &cpu, IMOE_ERR_ARGUMENT, "a: data is NULL");
  v = *w, v.data = NULL;
  GEMM_EXPECT("w data NULL", a, &v, offs, out, &cpu, IMOE_ERR_ARGUMENT, "w: data is NULL");
  v = *offs, v.data = NULL;
  GEMM_EXPECT("offsets data NULL", a, w, &v, out, &cpu, IMOE_ERR_ARGUMENT, "offsets: data is NULL");
  v = *out, v.data = NULL;
  GEMM_EXPECT("out data NULL", a, w, offs, &v, &cpu, IMOE_ERR_ARGUMENT, "out: data is NULL");

  /* dtypes */
  v = *a, v.dtype = IMOE_DTYPE_I32;
  GEMM_EXPECT("a I32", &v, w, offs, out, &cpu, IMOE_ERR_DTYPE, "a: dtype I32");
  v = *a, v.dtype = IMOE_DTYPE_BYTES, v.row_bytes = 1;
  GEMM_EXPECT("a BYTES", &v, w, offs, out, &cpu, IMOE_ERR_DTYPE, "a: dtype BYTES");
  v = *w, v.dtype = IMOE_DTYPE_F16, v.row_bytes = 2;
  GEMM_EXPECT("w F16 with a F32", a, &v, offs, out, &cpu, IMOE_ERR_DTYPE, "w: dtype F16");
  v = *w, v.dtype = IMOE_DTYPE_I32;
  GEMM_EXPECT("w I32", a, &v, offs, out, &cpu, IMOE_ERR_DTYPE, "w: dtype I32");
  v = *out, v.dtype = IMOE_DTYPE_BF16, v.row_bytes = 2;
  GEMM_EXPECT("out BF16 with a F32", a, w, offs, &v, &cpu, IMOE_ERR_DTYPE, "out: dtype BF16");
  v = *offs, v.dtype = IMOE_DTYPE_I64, v.row_bytes = 8, v.n_stride = 8;
  GEMM_EXPECT("offsets I64", a, w, &v, out, &cpu, IMOE_ERR_DTYPE, "offsets: dtype I64");
  v = *offs, v.dtype = IMOE_DTYPE_F32;
  GEMM_EXPECT("offsets F32", a, w, &v, out, &cpu, IMOE_ERR_DTYPE, "offsets: dtype F32");
  v = *a, v.row_bytes = 8;
  GEMM_EXPECT("a row_bytes", &v, w, offs, out, &cpu, IMOE_ERR_ARGUMENT, "a: row_bytes");

  /* shapes */
  v = *a, v.lead_ndim = 2, v.lead_shape[1] = 1, v.lead_stride[1] = 0;
  GEMM_EXPECT("a with two lead axes", &v, w, offs, out, &cpu, IMOE_ERR_ARGUMENT, "a must be");
  v = *a, v.lead_ndim = 0;
  GEMM_EXPECT("a without rows", &v, w, offs, out, &cpu, IMOE_ERR_ARGUMENT, "a must be");
  v = *w, v.lead_ndim = 1;
  GEMM_EXPECT("w [E, N]", a, &v, offs, out, &cpu, IMOE_ERR_ARGUMENT, "w must be");
  v = *w, v.lead_shape[0] = GE - 1;
  GEMM_EXPECT("w E against offsets", a, &v, offs, out, &cpu, IMOE_ERR_ARGUMENT, "w must be");
  v = *w, v.lead_shape[1] = GK - 1;
  GEMM_EXPECT("w K against a", a, &v, offs, out, &cpu, IMOE_ERR_ARGUMENT, "w must be");
  v = *out, v.lead_shape[0] = GR - 1;
  GEMM_EXPECT("out rows against a", a, w, offs, &v, &cpu, IMOE_ERR_ARGUMENT, "out must be");
  v = *out, v.n = GN - 1;
  GEMM_EXPECT("out cols against w", a, w, offs, &v, &cpu, IMOE_ERR_ARGUMENT, "out must be");
  v = *out, v.lead_ndim = 2, v.lead_shape[1] = 1, v.lead_stride[1] = 0;
  GEMM_EXPECT("out with two lead axes", a, w, offs, &v, &cpu, IMOE_ERR_ARGUMENT, "out must be");
  v = *offs, v.n = 0;
  GEMM_EXPECT("E = 0", a, w, &v, out, &cpu, IMOE_ERR_ARGUMENT, "offsets must be [E] with E >= 1");
  v = *offs, v.lead_ndim = 1, v.lead_shape[0] = 1, v.lead_stride[0] = 12;
  GEMM_EXPECT("offsets [1, E]", a, w, &v, out, &cpu, IMOE_ERR_ARGUMENT, "offsets must be [E]");
  v = *a, v.n = -1;
  GEMM_EXPECT("a negative K", &v, w, offs, out, &cpu, IMOE_ERR_ARGUMENT, "a: n is negative");

  /* out must be writable and share no byte with an input */
  v = *out, v.lead_stride[0] = 0;
  GEMM_EXPECT("out rows overlapping", a, w, offs, &v, &cpu, IMOE_ERR_ARGUMENT, "out has a zero stride");
  v = *a, v.n = GN;
  GEMM_EXPECT("out inside a", a, w, offs, &v, &cpu, IMOE_ERR_ARGUMENT, "a shares memory with out");
  {
    /* out as a itself (K = N): a row of a is read for every column, so even
     * the same slots are refused. */
    const int64_t w_lead[2] = {GE, GK};
    uint64_t seed = 3;
    tensor wsq = tensor_make(2, w_lead, GK, 4, IMOE_DTYPE_F32, 0, &seed);
    GEMM_EXPECT("out is a", a, &wsq.view, offs, a, &cpu, IMOE_ERR_ARGUMENT, "shares memory");
    tensor_free(&wsq);
  }
  v = *w, v.lead_ndim = 1, v.lead_shape[0] = GR, v.lead_stride[0] = GN * 4, v.n = GN;
  GEMM_EXPECT("out inside w", a, w, offs, &v, &cpu, IMOE_ERR_ARGUMENT, "w shares memory with out");
  v = *offs, v.data = g.t[G_OUT].view.data;
  GEMM_EXPECT("offsets inside out", a, w, &v, out, &cpu, IMOE_ERR_ARGUMENT, "offsets shares memory with out");

  /* exec */
  const imoe_exec bad_device = {(imoe_device_type)7, 0, 1, NULL};
  GEMM_EXPECT("exec device 7", a, w, offs, out, &bad_device, IMOE_ERR_ARGUMENT, "exec");
  const imoe_exec cuda = {IMOE_DEVICE_CUDA, 0, 0, NULL};
  GEMM_EXPECT("exec CUDA without the backend", a, w, offs, out, &cuda, IMOE_ERR_UNSUPPORTED, "exec");

  /* offsets' data: non-decreasing, in [0, R]; the bad entry named */
  set_offsets(&g, 3, 2, 5);
  GEMM_EXPECT("offsets decreasing", a, w, offs, out, &cpu, IMOE_ERR_INDEX_RANGE, "offsets[1] = 2");
  set_offsets(&g, 2, 2, 1);
  GEMM_EXPECT("offsets decreasing at the end", a, w, offs, out, &cpu, IMOE_ERR_INDEX_RANGE, "offsets[2] = 1");
  set_offsets(&g, 2, 2, GR + 1);
  GEMM_EXPECT("offsets past R", a, w, offs, out, &cpu, IMOE_ERR_INDEX_RANGE, "offsets[2] = 7");
  set_offsets(&g, 2, GR + 5, GR + 5);
  GEMM_EXPECT("offsets past R in the middle", a, w, offs, out, &cpu, IMOE_ERR_INDEX_RANGE, "offsets[1] = 11");
  set_offsets(&g, -1, 2, 5);
  GEMM_EXPECT("offsets negative", a, w, offs, out, &cpu, IMOE_ERR_INDEX_RANGE, "offsets[0] = -1");
  set_offsets(&g, 0, 0, INT32_MIN);
  GEMM_EXPECT("offsets INT32_MIN last", a, w, offs, out, &cpu, IMOE_ERR_INDEX_RANGE, "offsets[2] = -2147483648");
  set_offsets(&g, 0, 0, INT32_MAX);
  GEMM_EXPECT("offsets INT32_MAX last", a, w, offs, out, &cpu, IMOE_ERR_INDEX_RANGE, "offsets[2] = 2147483647");
  const imoe_exec serial = {IMOE_DEVICE_CPU, 0, 1, NULL};
  set_offsets(&g, 4, 3, 5);
  GEMM_EXPECT("offsets decreasing, one thread", a, w, offs, out, &serial, IMOE_ERR_INDEX_RANGE, "offsets[1]");

  /* the world still computes once its offsets are valid */
  set_offsets(&g, 2, 2, 5);
  imoe_error err;
  memset(&err, 0, sizeof err);
  CHECK(imoe_grouped_gemm(a, w, offs, out, &cpu, &err) == IMOE_OK, "argument world: valid call failed: %s",
        err.message);
  CHECK(!tensor_same(&g.t[G_OUT], g.snap[G_OUT]), "argument world: the valid call wrote nothing");
  gemm_world_free(&g);
}

void test_moe_gemm_all(void) {
  test_order_matters();
  test_named_shapes();
  test_k_zero();
  test_random_cases(0x5eed0003, 360);
  test_argument_errors();
}
