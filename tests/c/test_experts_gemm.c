/* test_experts_gemm.c: imoe_experts_gemm on the CPU. Every byte of out is
 * checked bit for bit against the header's definition, written here from
 * it: for each row r below offsets[E - 1] and e(r) its expert, the input
 * row x[src[r]] (or x[r] without src), each dot product in F32 from +0.0
 * in increasing k with fmaf, rounded once into out's dtype; gated, the
 * gate g = y[r, i] and up u = y[r, N / 2 + i] each rounded into the dtype,
 * then out = round(round(act(g)) x u) with act as imoe_activate computes
 * it (x rows of -0.0 tell a sum from +0.0 from one from -0.0). Rows at
 * or past offsets[E - 1], padding and guards keep their sentinel; the rows
 * of src at or past offsets[E - 1] hold values that may not be read (-1,
 * T, INT32_MIN/MAX). Weights come N-contiguous, K
 * contiguous (transformers' weights transposed) and generally strided; x,
 * src, offsets and out in several view layouts; threads 1, 4 and exec NULL.
 * Every argument error returns its status, names the argument and leaves
 * every byte as it was; bad offsets or src are IMOE_ERR_INDEX_RANGE with
 * nothing written. Fixed seeds. */
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

static const char *act_name(imoe_act act) {
  return act == IMOE_ACT_SILU ? "silu" : act == IMOE_ACT_GELU ? "gelu" : act == IMOE_ACT_GELU_TANH ? "gelu_tanh"
                                                                                                    : "relu";
}

/* The activations as imoe_activate (csrc/moe_combine.c) evaluates them in
 * F32, rewritten from the header's formulas. */
static float ref_act(float x, imoe_act act) {
  switch (act) {
    case IMOE_ACT_SILU: return x / (1.0f + expf(-x));
    case IMOE_ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
    case IMOE_ACT_GELU_TANH: {
      const float beta = 0.7978845608028654f, kappa = 0.044715f;
      const float cube = x * x * x;
      return 0.5f * x * (1.0f + tanhf(beta * (x + kappa * cube)));
    }
    case IMOE_ACT_RELU: return x < 0.0f ? 0.0f : x;
  }
  return x;
}

/* ---- the definition ------------------------------------------------------ */

/* y = sum over k of a[k] w[e, k, n] in F32 from +0.0, increasing k, fmaf. */
static float ref_dot(const float *a, const tensor *w, int64_t k_n, int64_t e, int64_t n) {
  float acc = 0.0f;
  for (int64_t k = 0; k < k_n; k++) acc = fmaf(a[k], gemm_load_at(w, e * k_n + k, n), acc);
  return acc;
}

/* The bytes out must hold after the call: a copy of out's allocation (the
 * sentinel) with every row below offsets[E - 1] written from the
 * definition. src NULL: row r reads x[r]. */
static unsigned char *expected_bytes(const tensor *x, const tensor *src, const tensor *w, const int32_t *offsets,
                                     int64_t e_n, int32_t gated, imoe_act act, const tensor *out) {
  const imoe_dtype dt = (imoe_dtype)x->view.dtype;
  const int64_t k_n = x->view.n, n_out = out->view.n, end = offsets[e_n - 1];
  unsigned char *want = tensor_snapshot(out);
  float *arow = malloc((size_t)(k_n > 0 ? k_n : 1) * sizeof(float));
  for (int64_t r = 0, e = 0; r < end; r++) {
    while (offsets[e] <= r) e++;
    const int64_t token = src ? tensor_get_index(tensor_at(src, 0, r), IMOE_DTYPE_I32) : r;
    for (int64_t k = 0; k < k_n; k++) arow[k] = gemm_load_at(x, token, k);
    for (int64_t n = 0; n < n_out; n++) {
      float v;
      if (gated) {
        const float g = imoe_round_to(ref_dot(arow, w, k_n, e, n), dt);
        const float u = imoe_round_to(ref_dot(arow, w, k_n, e, n_out + n), dt);
        v = imoe_round_to(ref_act(g, act), dt) * u;
      } else {
        v = ref_dot(arow, w, k_n, e, n);
      }
      imoe_store_float((char *)want + ((unsigned char *)tensor_at(out, r, n) - out->alloc), dt, v);
    }
  }
  free(arow);
  return want;
}

static int64_t first_difference(const tensor *t, const unsigned char *want) {
  for (size_t i = 0; i < t->bytes; i++)
    if (t->alloc[i] != want[i]) return (int64_t)i;
  return -1;
}

/* ---- one case ------------------------------------------------------------- */

typedef struct xg_case {
  imoe_dtype dtype;
  int64_t t, r, k, n, e; /* t: x's rows with src (unused without) */
  int32_t offsets[16];
  int with_src, neg_zero_rows; /* neg_zero_rows: x rows 1, 4, 7, ... all -0.0 */
  int32_t gated;
  imoe_act act;
  unsigned x_layout, src_layout, out_layout, offsets_layout;
  int w_layout;
} xg_case;

/* A value of src that may not be read (rows at or past offsets[E - 1]). */
static int32_t unread_src(uint64_t *rng, int64_t t_n) {
  switch (rng_next(rng) % 5) {
    case 0: return -1;
    case 1: return (int32_t)t_n;
    case 2: return INT32_MIN;
    case 3: return INT32_MAX;
    default: return (int32_t)rng_range(rng, -1000, 1000);
  }
}

static void run_case(const xg_case *c, uint64_t *rng, const char *label) {
  const imoe_dtype dt = c->dtype;
  const int64_t size = gemm_elem_size(dt), x_rows = c->with_src ? c->t : c->r;
  const int64_t n_out = c->gated ? c->n / 2 : c->n, end = c->offsets[c->e - 1];
  tensor x = tensor_make(1, &x_rows, c->k, size, dt, c->x_layout, rng);
  tensor w = gemm_weights_make(c->e, c->k, c->n, dt, c->w_layout, rng);
  tensor offs = tensor_make(0, NULL, c->e, 4, IMOE_DTYPE_I32, c->offsets_layout, rng);
  tensor out = tensor_make(1, &c->r, n_out, size, dt, c->out_layout, rng);
  tensor src;
  memset(&src, 0, sizeof src);
  if (c->with_src) {
    src = tensor_make(0, NULL, c->r, 4, IMOE_DTYPE_I32, c->src_layout, rng);
    for (int64_t r = 0; r < c->r; r++)
      tensor_put_index(tensor_at(&src, 0, r), IMOE_DTYPE_I32,
                       r < end ? rng_range(rng, 0, c->t - 1) : unread_src(rng, c->t));
  }
  gemm_fill_values(&x, x_rows, c->k, rng);
  for (int64_t t = 1; c->neg_zero_rows && t < x_rows; t += 3) /* each sum +0.0 only when it starts from +0.0 */
    for (int64_t k = 0; k < c->k; k++) imoe_store_float((char *)tensor_at(&x, t, k), dt, -0.0f);
  gemm_fill_values(&w, c->e * c->k, c->n, rng);
  for (int64_t e = 0; e < c->e; e++) tensor_put_index(tensor_at(&offs, 0, e), IMOE_DTYPE_I32, c->offsets[e]);
  memset(out.alloc, GEMM_SENTINEL, out.bytes);
  unsigned char *snap_x = tensor_snapshot(&x), *snap_w = tensor_snapshot(&w);
  unsigned char *snap_offs = tensor_snapshot(&offs), *sentinel = tensor_snapshot(&out);
  unsigned char *snap_src = c->with_src ? tensor_snapshot(&src) : NULL;
  unsigned char *want = expected_bytes(&x, c->with_src ? &src : NULL, &w, c->offsets, c->e, c->gated, c->act, &out);
  const imoe_view *srcv = c->with_src ? &src.view : NULL;

  int64_t shape[2] = {-1, -1};
  imoe_error err;
  memset(&err, 0, sizeof err);
  const imoe_status sst = imoe_experts_gemm_shape(&x.view, srcv, &w.view, &offs.view, c->gated, c->act, shape, &err);
  CHECK(sst == IMOE_OK && shape[0] == c->r && shape[1] == n_out, "%s: shape status %d [%lld, %lld], want [%lld, %lld] (%s)",
        label, (int)sst, (long long)shape[0], (long long)shape[1], (long long)c->r, (long long)n_out, err.message);

  /* threads 1, then 4, then exec NULL: each from the sentinel, each the expected bytes. */
  const imoe_exec execs[2] = {{IMOE_DEVICE_CPU, 0, 1, NULL}, {IMOE_DEVICE_CPU, 0, 4, NULL}};
  for (int run = 0; run < 3; run++) {
    memcpy(out.alloc, sentinel, out.bytes);
    memset(&err, 0, sizeof err);
    const imoe_status st = imoe_experts_gemm(&x.view, srcv, &w.view, &offs.view, c->gated, c->act, &out.view,
                                             run < 2 ? &execs[run] : NULL, &err);
    CHECK(st == IMOE_OK, "%s: status %d (%s)", label, (int)st, err.message);
    const int64_t first = first_difference(&out, want);
    CHECK(first < 0,
          "%s (%s, %s, T %lld R %lld K %lld N %lld E %lld end %lld, w %s, gated %d %s, run %d): out differs "
          "from the definition at byte %lld",
          label, gemm_dtype_name(dt), c->with_src ? "src" : "no src", (long long)c->t, (long long)c->r,
          (long long)c->k, (long long)c->n, (long long)c->e, (long long)end, gemm_w_layout_name[c->w_layout],
          (int)c->gated, act_name(c->act), run, (long long)first);
    CHECK(tensor_same(&x, snap_x) && tensor_same(&w, snap_w) && tensor_same(&offs, snap_offs) &&
              (!c->with_src || tensor_same(&src, snap_src)),
          "%s: an input changed", label);
  }
  free(want);
  free(sentinel);
  free(snap_x);
  free(snap_w);
  free(snap_offs);
  free(snap_src);
  tensor_free(&x);
  tensor_free(&w);
  tensor_free(&offs);
  tensor_free(&out);
  if (c->with_src) tensor_free(&src);
}

static const int64_t k_sizes[] = {0, 1, 2, 3, 5, 7, 8, 9, 16, 17, 33, 64, 100};
static const int64_t n_sizes[] = {1, 2, 3, 4, 7, 8, 63, 64, 65, 66, 128, 130, 200};

static void test_random_cases(uint64_t seed, int cases) {
  uint64_t rng = seed;
  char label[64];
  for (int i = 0; i < cases; i++) {
    xg_case c;
    memset(&c, 0, sizeof c);
    c.dtype = gemm_dtypes[i % 3];
    c.w_layout = (i / 3) % W_LAYOUTS;
    c.gated = (i / 9) % 2;
    c.act = (imoe_act)(IMOE_ACT_SILU + (int)(rng_next(&rng) % 4));
    c.with_src = rng_next(&rng) % 4 != 0;
    c.neg_zero_rows = rng_next(&rng) % 4 == 0;
    c.k = k_sizes[rng_next(&rng) % (sizeof k_sizes / sizeof k_sizes[0])];
    c.n = n_sizes[rng_next(&rng) % (sizeof n_sizes / sizeof n_sizes[0])];
    if (c.gated && c.n % 2) c.n++;
    c.r = rng_range(&rng, 0, 40);
    c.t = rng_range(&rng, 0, 30);
    c.e = rng_range(&rng, 1, 12);
    int64_t end = rng_next(&rng) % 2 ? c.r : rng_range(&rng, 0, c.r);
    if (c.with_src && c.t == 0) end = 0; /* no token to point at */
    gemm_random_offsets(&rng, c.offsets, c.e, end);
    c.x_layout = gemm_view_layouts[rng_next(&rng) % 5];
    c.out_layout = gemm_view_layouts[rng_next(&rng) % 5];
    c.src_layout = gemm_view_layouts[rng_next(&rng) % 3];
    c.offsets_layout = gemm_view_layouts[rng_next(&rng) % 3];
    snprintf(label, sizeof label, "random case %d", i);
    run_case(&c, &rng, label);
  }
}

/* ---- named shapes --------------------------------------------------------- */

static void named(imoe_dtype dt, int w_layout, int with_src, int32_t gated, imoe_act act, int64_t t, int64_t r,
                  int64_t k, int64_t n, int64_t e, const int32_t *offsets, const char *label) {
  xg_case c;
  memset(&c, 0, sizeof c);
  c.dtype = dt;
  c.w_layout = w_layout;
  c.with_src = with_src;
  c.gated = gated;
  c.act = act;
  c.t = t;
  c.r = r;
  c.k = k;
  c.n = n;
  c.e = e;
  memcpy(c.offsets, offsets, (size_t)e * sizeof(int32_t));
  c.out_layout = T_PAD;
  c.src_layout = T_NEG_SLOTS;
  c.neg_zero_rows = 1;
  uint64_t rng = 0x9e12u + (uint64_t)k * 31u + (uint64_t)n + (uint64_t)gated * 7u;
  run_case(&c, &rng, label);
}

static void test_named_shapes(void) {
  for (int d = 0; d < 3; d++) {
    const imoe_dtype dt = gemm_dtypes[d];
    for (int wl = 0; wl < W_LAYOUTS; wl++) {
      for (int s = 0; s < 2; s++) {
        for (int32_t gated = 0; gated < 2; gated++) {
          const imoe_act act = (imoe_act)((d + wl + s) % 4);
          const int32_t one[1] = {9}, one_short[1] = {4};
          named(dt, wl, s, gated, act, 5, 9, 13, 6, 1, one, "E = 1");
          named(dt, wl, s, gated, act, 5, 9, 13, 6, 1, one_short, "E = 1, rows past offsets[0]");
          const int32_t empty_experts[7] = {0, 0, 3, 3, 3, 7, 7};
          named(dt, wl, s, gated, act, 4, 7, 40, 10, 7, empty_experts, "empty experts");
          const int32_t in_first[4] = {11, 11, 11, 11}, in_last[4] = {0, 0, 0, 11};
          named(dt, wl, s, gated, act, 3, 11, 20, 132, 4, in_first, "all rows in expert 0, two column blocks");
          named(dt, wl, s, gated, act, 3, 11, 20, 132, 4, in_last, "all rows in the last expert");
          const int32_t none[2] = {0, 0};
          named(dt, wl, s, gated, act, 4, 10, 24, 4, 2, none, "offsets[E - 1] = 0: nothing written");
          const int32_t zero_rows[3] = {0, 0, 0};
          named(dt, wl, s, gated, act, 4, 0, 16, 4, 3, zero_rows, "R = 0");
          named(dt, wl, s, gated, act, 4, 7, 0, 8, 7, empty_experts, "K = 0");
          const int32_t many[3] = {10, 20, 37};
          named(dt, wl, s, gated, act, 2, 40, 9, 2, 3, many, "T = 2 < R = 40, N = 2");
        }
      }
    }
  }
}

/* K = 0: x and w have no element and their data is NULL; rows below
 * offsets[E - 1] become +0.0 (gated: +0.0 as well, act(+0) x +0), the
 * others keep their bytes. */
static void test_k_zero(void) {
  for (int d = 0; d < 3; d++) {
    for (int s = 0; s < 2; s++) {
      for (int32_t gated = 0; gated < 2; gated++) {
        for (int a = IMOE_ACT_SILU; a <= IMOE_ACT_RELU; a++) {
          if (!gated && a > IMOE_ACT_SILU) continue;
          const imoe_dtype dt = gemm_dtypes[d];
          const int64_t size = gemm_elem_size(dt), t_n = 3, r_n = 5, n_n = 6, n_out = gated ? 3 : 6, e_n = 2;
          const int64_t lead[2] = {e_n, 0}, x_rows = s ? t_n : r_n;
          uint64_t rng = 5;
          tensor x = tensor_make(1, &x_rows, 0, size, dt, 0, &rng);
          tensor w = tensor_make(2, lead, n_n, size, dt, 0, &rng);
          tensor offs = tensor_make(0, NULL, e_n, 4, IMOE_DTYPE_I32, 0, &rng);
          tensor src = tensor_make(0, NULL, r_n, 4, IMOE_DTYPE_I32, 0, &rng);
          tensor out = tensor_make(1, &r_n, n_out, size, dt, T_PAD, &rng);
          const int32_t tokens[5] = {2, 0, 2, 1, -1};
          for (int64_t r = 0; r < r_n; r++) tensor_put_index(tensor_at(&src, 0, r), IMOE_DTYPE_I32, tokens[r]);
          tensor_put_index(tensor_at(&offs, 0, 0), IMOE_DTYPE_I32, 1);
          tensor_put_index(tensor_at(&offs, 0, 1), IMOE_DTYPE_I32, 4);
          x.view.data = NULL;
          w.view.data = NULL;
          memset(out.alloc, GEMM_SENTINEL, out.bytes);
          unsigned char *want = tensor_snapshot(&out);
          for (int64_t r = 0; r < 4; r++)
            for (int64_t n = 0; n < n_out; n++) memset(want + (tensor_at(&out, r, n) - out.alloc), 0, (size_t)size);
          imoe_error err;
          memset(&err, 0, sizeof err);
          const imoe_exec exec = {IMOE_DEVICE_CPU, 0, 2, NULL};
          const imoe_status st =
              imoe_experts_gemm(&x.view, s ? &src.view : NULL, &w.view, &offs.view, gated, (imoe_act)a, &out.view,
                                &exec, &err);
          CHECK(st == IMOE_OK, "K = 0 %s src %d gated %d: status %d (%s)", gemm_dtype_name(dt), s, (int)gated,
                (int)st, err.message);
          CHECK(tensor_same(&out, want),
                "K = 0 %s src %d gated %d act %d: out is not +0.0 below offsets[E - 1] and untouched past it",
                gemm_dtype_name(dt), s, (int)gated, a);
          free(want);
          tensor_free(&x);
          tensor_free(&w);
          tensor_free(&offs);
          tensor_free(&src);
          tensor_free(&out);
        }
      }
    }
  }
}

/* R = 0: src and out have no element and their data is NULL, x may have
 * rows (with src) or none; nothing is read or written. Offsets past R = 0
 * are still refused. */
static void test_r_zero(void) {
  for (int s = 0; s < 2; s++) {
    uint64_t rng = 9;
    const int64_t t_n = s ? 4 : 0, r_n = 0, lead[2] = {2, 8};
    tensor x = tensor_make(1, &t_n, 8, 4, IMOE_DTYPE_F32, 0, &rng);
    tensor w = tensor_make(2, lead, 6, 4, IMOE_DTYPE_F32, 0, &rng);
    tensor offs = tensor_make(0, NULL, 2, 4, IMOE_DTYPE_I32, 0, &rng);
    tensor src = tensor_make(0, NULL, r_n, 4, IMOE_DTYPE_I32, 0, &rng);
    tensor out = tensor_make(1, &r_n, 6, 4, IMOE_DTYPE_F32, 0, &rng);
    tensor_put_index(tensor_at(&offs, 0, 0), IMOE_DTYPE_I32, 0);
    tensor_put_index(tensor_at(&offs, 0, 1), IMOE_DTYPE_I32, 0);
    if (!s) x.view.data = NULL;
    src.view.data = NULL;
    out.view.data = NULL;
    unsigned char *snap_x = tensor_snapshot(&x), *snap_w = tensor_snapshot(&w);
    for (int32_t gated = 0; gated < 2; gated++) {
      out.view.n = gated ? 3 : 6;
      imoe_error err;
      memset(&err, 0, sizeof err);
      int64_t shape[2] = {-1, -1};
      imoe_status st = imoe_experts_gemm_shape(&x.view, s ? &src.view : NULL, &w.view, &offs.view, gated,
                                               IMOE_ACT_GELU, shape, &err);
      CHECK(st == IMOE_OK && shape[0] == 0 && shape[1] == out.view.n, "R = 0 src %d gated %d: shape %d [%lld, %lld]",
            s, (int)gated, (int)st, (long long)shape[0], (long long)shape[1]);
      st = imoe_experts_gemm(&x.view, s ? &src.view : NULL, &w.view, &offs.view, gated, IMOE_ACT_GELU, &out.view,
                             NULL, &err);
      CHECK(st == IMOE_OK, "R = 0 src %d gated %d: status %d (%s)", s, (int)gated, (int)st, err.message);
      tensor_put_index(tensor_at(&offs, 0, 1), IMOE_DTYPE_I32, 1);
      memset(&err, 0, sizeof err);
      st = imoe_experts_gemm(&x.view, s ? &src.view : NULL, &w.view, &offs.view, gated, IMOE_ACT_GELU, &out.view,
                             NULL, &err);
      CHECK(st == IMOE_ERR_INDEX_RANGE && strstr(err.message, "offsets[1] = 1") != NULL,
            "R = 0 src %d gated %d, offsets[1] = 1: status %d (%s)", s, (int)gated, (int)st, err.message);
      tensor_put_index(tensor_at(&offs, 0, 1), IMOE_DTYPE_I32, 0);
    }
    CHECK(tensor_same(&x, snap_x) && tensor_same(&w, snap_w), "R = 0 src %d: an input changed", s);
    free(snap_x);
    free(snap_w);
    tensor_free(&x);
    tensor_free(&w);
    tensor_free(&offs);
    tensor_free(&src);
    tensor_free(&out);
  }
}

/* ---- argument and data errors --------------------------------------------- */

enum { G_X, G_SRC, G_W, G_OFFS, G_OUT, G_OUT_GATED, G_COUNT };

typedef struct xg_world {
  tensor t[G_COUNT];
  unsigned char *snap[G_COUNT];
} xg_world;

#define GT 4 /* x's tokens */
#define GR 6 /* rows: src's length, more than T */
#define GK 10
#define GN 6
#define GE 3

static void world_snapshot(xg_world *g, int i) {
  free(g->snap[i]);
  g->snap[i] = tensor_snapshot(&g->t[i]);
}

static void set_offsets(xg_world *g, int32_t o0, int32_t o1, int32_t o2) {
  const int32_t offsets[GE] = {o0, o1, o2};
  for (int e = 0; e < GE; e++) tensor_put_index(tensor_at(&g->t[G_OFFS], 0, e), IMOE_DTYPE_I32, offsets[e]);
  world_snapshot(g, G_OFFS);
}

/* src: rows below 5 in [0, T); row 5 (at offsets[E - 1]) -1, never read. */
static void set_src(xg_world *g, int64_t row, int32_t value) {
  const int32_t base[GR] = {3, 0, 2, 3, 1, -1};
  for (int64_t r = 0; r < GR; r++)
    tensor_put_index(tensor_at(&g->t[G_SRC], 0, r), IMOE_DTYPE_I32, r == row ? value : base[r]);
  world_snapshot(g, G_SRC);
}

static void world_init(xg_world *g) {
  memset(g, 0, sizeof *g);
  uint64_t seed = 78;
  const int64_t t_n = GT, r_n = GR, w_lead[2] = {GE, GK};
  g->t[G_X] = tensor_make(1, &t_n, GK, 4, IMOE_DTYPE_F32, T_PAD, &seed);
  g->t[G_SRC] = tensor_make(0, NULL, GR, 4, IMOE_DTYPE_I32, 0, &seed);
  g->t[G_W] = tensor_make(2, w_lead, GN, 4, IMOE_DTYPE_F32, 0, &seed);
  g->t[G_OFFS] = tensor_make(0, NULL, GE, 4, IMOE_DTYPE_I32, 0, &seed);
  g->t[G_OUT] = tensor_make(1, &r_n, GN, 4, IMOE_DTYPE_F32, T_NEG_SLOTS, &seed);
  g->t[G_OUT_GATED] = tensor_make(1, &r_n, GN / 2, 4, IMOE_DTYPE_F32, T_PAD, &seed);
  gemm_fill_values(&g->t[G_X], GT, GK, &seed);
  gemm_fill_values(&g->t[G_W], GE * GK, GN, &seed);
  memset(g->t[G_OUT].alloc, GEMM_SENTINEL, g->t[G_OUT].bytes);
  memset(g->t[G_OUT_GATED].alloc, GEMM_SENTINEL, g->t[G_OUT_GATED].bytes);
  for (int i = 0; i < G_COUNT; i++) g->snap[i] = tensor_snapshot(&g->t[i]);
  set_offsets(g, 2, 2, 5);
  set_src(g, -1, 0);
}

static void world_free(xg_world *g) {
  for (int i = 0; i < G_COUNT; i++) {
    tensor_free(&g->t[i]);
    free(g->snap[i]);
  }
}

static int expect_line;

static void world_expect(const xg_world *g, const char *label, imoe_status got, imoe_status want,
                         const imoe_error *err, const char *mention) {
  CHECK(got == want, "line %d, %s: status %d, expected %d (%s)", expect_line, label, (int)got, (int)want,
        err->message);
  CHECK(strstr(err->message, mention) != NULL, "line %d, %s: message \"%s\" lacks \"%s\"", expect_line, label,
        err->message, mention);
  for (int i = 0; i < G_COUNT; i++)
    CHECK(tensor_same(&g->t[i], g->snap[i]), "line %d, %s: view %d changed", expect_line, label, i);
}

#define XG_EXPECT(label, x_, src_, w_, offs_, gated_, act_, out_, exec_, want, mention)                       \
  do {                                                                                                       \
    imoe_error err_;                                                                                         \
    memset(&err_, 0, sizeof err_);                                                                           \
    expect_line = __LINE__;                                                                                  \
    const imoe_status got_ = imoe_experts_gemm(x_, src_, w_, offs_, gated_, act_, out_, exec_, &err_);        \
    world_expect(&g, label, got_, want, &err_, mention);                                                     \
    const imoe_status quiet_ = imoe_experts_gemm(x_, src_, w_, offs_, gated_, act_, out_, exec_, NULL);       \
    CHECK(quiet_ == want, "line %d, %s with err NULL: status %d", __LINE__, label, (int)quiet_);              \
    for (int i_ = 0; i_ < G_COUNT; i_++)                                                                     \
      CHECK(tensor_same(&g.t[i_], g.snap[i_]), "line %d, %s with err NULL: view %d changed", __LINE__, label, \
            i_);                                                                                             \
  } while (0)

/* An error the shape function sees too: the same status and argument. */
#define SHAPE_EXPECT(label, x_, src_, w_, offs_, gated_, act_, want, mention)                                   \
  do {                                                                                                         \
    imoe_error err_;                                                                                           \
    memset(&err_, 0, sizeof err_);                                                                             \
    int64_t shape_[2] = {-7, -7};                                                                              \
    const imoe_status got_ = imoe_experts_gemm_shape(x_, src_, w_, offs_, gated_, act_, shape_, &err_);         \
    CHECK(got_ == want && strstr(err_.message, mention) != NULL,                                               \
          "line %d, %s (shape): status %d, expected %d, message \"%s\" (wants \"%s\")", __LINE__, label,       \
          (int)got_, (int)want, err_.message, mention);                                                        \
  } while (0)

static void test_argument_errors(void) {
  xg_world g;
  world_init(&g);
  const imoe_view *x = &g.t[G_X].view, *src = &g.t[G_SRC].view, *w = &g.t[G_W].view, *offs = &g.t[G_OFFS].view,
                  *out = &g.t[G_OUT].view, *outg = &g.t[G_OUT_GATED].view;
  const imoe_exec cpu = {IMOE_DEVICE_CPU, 0, 2, NULL};
  const imoe_act silu = IMOE_ACT_SILU;
  imoe_view v;

  /* NULL views: all but src are required; src NULL makes x [R, K]. */
  XG_EXPECT("x NULL", NULL, src, w, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "x is NULL");
  XG_EXPECT("w NULL", x, src, NULL, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "w is NULL");
  XG_EXPECT("offsets NULL", x, src, w, NULL, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "offsets is NULL");
  XG_EXPECT("out NULL", x, src, w, offs, 0, silu, NULL, &cpu, IMOE_ERR_ARGUMENT, "out is NULL");
  XG_EXPECT("out NULL, gated", x, src, w, offs, 1, silu, NULL, &cpu, IMOE_ERR_ARGUMENT, "out is NULL");
  SHAPE_EXPECT("x NULL", NULL, src, w, offs, 0, silu, IMOE_ERR_ARGUMENT, "x is NULL");
  SHAPE_EXPECT("w NULL", x, src, NULL, offs, 0, silu, IMOE_ERR_ARGUMENT, "w is NULL");
  SHAPE_EXPECT("offsets NULL", x, src, w, NULL, 0, silu, IMOE_ERR_ARGUMENT, "offsets is NULL");
  XG_EXPECT("src NULL: R = T rows, out has src's R", x, NULL, w, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT,
            "out must be [4, 6]");
  v = *x, v.data = NULL;
  XG_EXPECT("x data NULL", &v, src, w, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "x: data is NULL");
  v = *src, v.data = NULL;
  XG_EXPECT("src data NULL", x, &v, w, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "src: data is NULL");
  v = *w, v.data = NULL;
  XG_EXPECT("w data NULL", x, src, &v, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "w: data is NULL");
  v = *offs, v.data = NULL;
  XG_EXPECT("offsets data NULL", x, src, w, &v, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "offsets: data is NULL");
  v = *out, v.data = NULL;
  XG_EXPECT("out data NULL", x, src, w, offs, 0, silu, &v, &cpu, IMOE_ERR_ARGUMENT, "out: data is NULL");

  /* dtypes */
  v = *x, v.dtype = IMOE_DTYPE_I32;
  XG_EXPECT("x I32", &v, src, w, offs, 0, silu, out, &cpu, IMOE_ERR_DTYPE, "x: dtype I32");
  SHAPE_EXPECT("x I32", &v, src, w, offs, 0, silu, IMOE_ERR_DTYPE, "x: dtype I32");
  v = *x, v.dtype = IMOE_DTYPE_BYTES;
  XG_EXPECT("x BYTES", &v, src, w, offs, 0, silu, out, &cpu, IMOE_ERR_DTYPE, "x: dtype BYTES");
  v = *w, v.dtype = IMOE_DTYPE_F16, v.row_bytes = 2;
  XG_EXPECT("w F16 with x F32", x, src, &v, offs, 0, silu, out, &cpu, IMOE_ERR_DTYPE, "w: dtype F16");
  SHAPE_EXPECT("w F16 with x F32", x, src, &v, offs, 0, silu, IMOE_ERR_DTYPE, "w: dtype F16");
  v = *w, v.dtype = IMOE_DTYPE_BF16, v.row_bytes = 2;
  XG_EXPECT("w BF16 with x F32", x, src, &v, offs, 1, silu, outg, &cpu, IMOE_ERR_DTYPE, "w: dtype BF16");
  v = *w, v.dtype = IMOE_DTYPE_I32;
  XG_EXPECT("w I32", x, src, &v, offs, 0, silu, out, &cpu, IMOE_ERR_DTYPE, "w: dtype I32");
  v = *out, v.dtype = IMOE_DTYPE_BF16, v.row_bytes = 2;
  XG_EXPECT("out BF16 with x F32", x, src, w, offs, 0, silu, &v, &cpu, IMOE_ERR_DTYPE, "out: dtype BF16");
  v = *outg, v.dtype = IMOE_DTYPE_F16, v.row_bytes = 2;
  XG_EXPECT("out F16 with x F32, gated", x, src, w, offs, 1, silu, &v, &cpu, IMOE_ERR_DTYPE, "out: dtype F16");
  v = *out, v.dtype = IMOE_DTYPE_I32;
  XG_EXPECT("out I32", x, src, w, offs, 0, silu, &v, &cpu, IMOE_ERR_DTYPE, "out: dtype I32");
  v = *offs, v.dtype = IMOE_DTYPE_I64, v.row_bytes = 8, v.n_stride = 8;
  XG_EXPECT("offsets I64", x, src, w, &v, 0, silu, out, &cpu, IMOE_ERR_DTYPE, "offsets: dtype I64");
  SHAPE_EXPECT("offsets I64", x, src, w, &v, 0, silu, IMOE_ERR_DTYPE, "offsets: dtype I64");
  v = *offs, v.dtype = IMOE_DTYPE_F32;
  XG_EXPECT("offsets F32", x, src, w, &v, 0, silu, out, &cpu, IMOE_ERR_DTYPE, "offsets: dtype F32");
  v = *src, v.dtype = IMOE_DTYPE_I64, v.row_bytes = 8, v.n_stride = 8;
  XG_EXPECT("src I64", x, &v, w, offs, 0, silu, out, &cpu, IMOE_ERR_DTYPE, "src: dtype I64");
  SHAPE_EXPECT("src I64", x, &v, w, offs, 0, silu, IMOE_ERR_DTYPE, "src: dtype I64");
  v = *src, v.dtype = IMOE_DTYPE_F32;
  XG_EXPECT("src F32", x, &v, w, offs, 0, silu, out, &cpu, IMOE_ERR_DTYPE, "src: dtype F32");
  v = *x, v.row_bytes = 8;
  XG_EXPECT("x row_bytes", &v, src, w, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "x: row_bytes");

  /* shapes */
  v = *src, v.lead_ndim = 1, v.lead_shape[0] = 1, v.lead_stride[0] = GR * 4;
  XG_EXPECT("src with 2 axes", x, &v, w, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "src must be [R]");
  SHAPE_EXPECT("src with 2 axes", x, &v, w, offs, 0, silu, IMOE_ERR_ARGUMENT, "src must be [R]");
  v = *x, v.lead_ndim = 2, v.lead_shape[1] = 1, v.lead_stride[1] = 0;
  XG_EXPECT("x with two lead axes", &v, src, w, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "x must be");
  v = *x, v.lead_ndim = 0;
  XG_EXPECT("x without rows", &v, src, w, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "x must be");
  v = *w, v.lead_ndim = 1;
  XG_EXPECT("w [E, N]", x, src, &v, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "w must be");
  v = *w, v.lead_shape[0] = GE - 1;
  XG_EXPECT("w E against offsets", x, src, &v, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "w must be [E = 3");
  SHAPE_EXPECT("w E against offsets", x, src, &v, offs, 0, silu, IMOE_ERR_ARGUMENT, "w must be [E = 3");
  v = *w, v.lead_shape[1] = GK - 1;
  XG_EXPECT("w K against x", x, src, &v, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "w must be [E = 3, K = 10");
  v = *offs, v.n = 0;
  XG_EXPECT("E = 0", x, src, w, &v, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "offsets must be [E] with E >= 1");
  v = *offs, v.lead_ndim = 1, v.lead_shape[0] = 1, v.lead_stride[0] = 12;
  XG_EXPECT("offsets [1, E]", x, src, w, &v, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "offsets must be [E]");
  v = *out, v.lead_shape[0] = GR - 1;
  XG_EXPECT("out rows against src", x, src, w, offs, 0, silu, &v, &cpu, IMOE_ERR_ARGUMENT, "out must be [6, 6]");
  v = *out, v.lead_shape[0] = GT;
  XG_EXPECT("out with x's T rows instead of src's R", x, src, w, offs, 0, silu, &v, &cpu, IMOE_ERR_ARGUMENT,
            "out must be [6, 6]");
  v = *out, v.n = GN / 2;
  XG_EXPECT("out [R, N / 2], not gated", x, src, w, offs, 0, silu, &v, &cpu, IMOE_ERR_ARGUMENT, "out must be [6, 6]");
  XG_EXPECT("out [R, N], gated", x, src, w, offs, 1, silu, out, &cpu, IMOE_ERR_ARGUMENT, "out must be [6, 3]");
  v = *outg, v.n = GN / 2 - 1;
  XG_EXPECT("out [R, N / 2 - 1], gated", x, src, w, offs, 1, silu, &v, &cpu, IMOE_ERR_ARGUMENT, "out must be [6, 3]");
  v = *out, v.lead_ndim = 2, v.lead_shape[1] = 1, v.lead_stride[1] = 0;
  XG_EXPECT("out with two lead axes", x, src, w, offs, 0, silu, &v, &cpu, IMOE_ERR_ARGUMENT, "out must be");
  v = *x, v.n = -1;
  XG_EXPECT("x negative K", &v, src, w, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "x: n is negative");

  /* gated and act */
  XG_EXPECT("gated 2", x, src, w, offs, 2, silu, outg, &cpu, IMOE_ERR_ARGUMENT, "gated must be 0 or 1, got 2");
  XG_EXPECT("gated -1", x, src, w, offs, -1, silu, out, &cpu, IMOE_ERR_ARGUMENT, "gated must be 0 or 1, got -1");
  SHAPE_EXPECT("gated 2", x, src, w, offs, 2, silu, IMOE_ERR_ARGUMENT, "gated must be 0 or 1");
  v = *w, v.n = GN - 1;
  XG_EXPECT("gated with odd N", x, src, &v, offs, 1, silu, outg, &cpu, IMOE_ERR_ARGUMENT, "w: gated, its N = 5");
  SHAPE_EXPECT("gated with odd N", x, src, &v, offs, 1, silu, IMOE_ERR_ARGUMENT, "w: gated, its N = 5");
  XG_EXPECT("act 4", x, src, w, offs, 1, (imoe_act)(IMOE_ACT_RELU + 1), outg, &cpu, IMOE_ERR_ARGUMENT,
            "act 4 is not");
  XG_EXPECT("act -1", x, src, w, offs, 1, (imoe_act)-1, outg, &cpu, IMOE_ERR_ARGUMENT, "act -1 is not");
  SHAPE_EXPECT("act 4", x, src, w, offs, 1, (imoe_act)4, IMOE_ERR_ARGUMENT, "act 4");

  /* out must be writable and share no byte with an input */
  v = *out, v.lead_stride[0] = 0;
  XG_EXPECT("out rows overlapping", x, src, w, offs, 0, silu, &v, &cpu, IMOE_ERR_ARGUMENT, "out has a zero stride");
  v = *out, v.data = g.t[G_X].view.data, v.lead_stride[0] = GN * 4, v.n_stride = 4;
  XG_EXPECT("out inside x", x, src, w, offs, 0, silu, &v, &cpu, IMOE_ERR_ARGUMENT, "x shares memory with out");
  v = *src, v.data = g.t[G_OUT].view.data;
  XG_EXPECT("src inside out", x, &v, w, offs, 0, silu, out, &cpu, IMOE_ERR_ARGUMENT, "src shares memory with out");
  v = *offs, v.data = g.t[G_OUT_GATED].view.data;
  XG_EXPECT("offsets inside out", x, src, w, &v, 1, silu, outg, &cpu, IMOE_ERR_ARGUMENT,
            "offsets shares memory with out");
  v = *w, v.lead_ndim = 1, v.lead_shape[0] = GR, v.lead_stride[0] = GN * 4, v.n = GN;
  XG_EXPECT("out inside w", x, src, w, offs, 0, silu, &v, &cpu, IMOE_ERR_ARGUMENT, "w shares memory with out");

  /* exec */
  const imoe_exec bad_device = {(imoe_device_type)7, 0, 1, NULL};
  XG_EXPECT("exec device 7", x, src, w, offs, 0, silu, out, &bad_device, IMOE_ERR_ARGUMENT, "exec");
  const imoe_exec cuda = {IMOE_DEVICE_CUDA, 0, 0, NULL};
  XG_EXPECT("exec CUDA without the backend", x, src, w, offs, 0, silu, out, &cuda, IMOE_ERR_UNSUPPORTED, "exec");

  /* offsets' data: non-decreasing, in [0, R] (R = src's rows, not x's T) */
  const imoe_exec serial = {IMOE_DEVICE_CPU, 0, 1, NULL};
  for (int32_t gated = 0; gated < 2; gated++) {
    const imoe_view *o = gated ? outg : out;
    set_offsets(&g, 3, 2, 5);
    XG_EXPECT("offsets decreasing", x, src, w, offs, gated, silu, o, &cpu, IMOE_ERR_INDEX_RANGE, "offsets[1] = 2");
    set_offsets(&g, 2, 2, 1);
    XG_EXPECT("offsets decreasing at the end", x, src, w, offs, gated, silu, o, &serial, IMOE_ERR_INDEX_RANGE,
              "offsets[2] = 1");
    set_offsets(&g, 2, 2, GR + 1);
    XG_EXPECT("offsets past R", x, src, w, offs, gated, silu, o, &cpu, IMOE_ERR_INDEX_RANGE, "offsets[2] = 7");
    set_offsets(&g, 2, GR + 5, GR + 5);
    XG_EXPECT("offsets past R in the middle", x, src, w, offs, gated, silu, o, NULL, IMOE_ERR_INDEX_RANGE,
              "offsets[1] = 11");
    set_offsets(&g, -1, 2, 5);
    XG_EXPECT("offsets negative", x, src, w, offs, gated, silu, o, &cpu, IMOE_ERR_INDEX_RANGE, "offsets[0] = -1");
    set_offsets(&g, 0, 0, INT32_MAX);
    XG_EXPECT("offsets INT32_MAX last", x, src, w, offs, gated, silu, o, &cpu, IMOE_ERR_INDEX_RANGE,
              "offsets[2] = 2147483647");
    set_offsets(&g, 2, 2, 5);

    /* src below offsets[E - 1] = 5 in [0, T = 4) */
    set_src(&g, 1, GT);
    XG_EXPECT("src = T", x, src, w, offs, gated, silu, o, &cpu, IMOE_ERR_INDEX_RANGE, "src[1] = 4");
    set_src(&g, 0, -1);
    XG_EXPECT("src = -1", x, src, w, offs, gated, silu, o, &serial, IMOE_ERR_INDEX_RANGE, "src[0] = -1");
    set_src(&g, 4, INT32_MAX);
    XG_EXPECT("src INT32_MAX, last row read", x, src, w, offs, gated, silu, o, NULL, IMOE_ERR_INDEX_RANGE,
              "src[4] = 2147483647");
    set_src(&g, 2, INT32_MIN);
    XG_EXPECT("src INT32_MIN", x, src, w, offs, gated, silu, o, &cpu, IMOE_ERR_INDEX_RANGE, "src[2] = -2147483648");
    /* offsets past x's T but within src's R: valid, so src is what fails */
    set_offsets(&g, 2, 2, GR);
    set_src(&g, -1, 0); /* row 5 = -1 is now read */
    XG_EXPECT("src[5] read once offsets[E - 1] = R", x, src, w, offs, gated, silu, o, &cpu, IMOE_ERR_INDEX_RANGE,
              "src[5] = -1");
    set_offsets(&g, 2, 2, 5);
  }

  /* The world computes once its data is valid: src[5] = -1 is not read;
   * gated and not, against the definition; then with offsets[E - 1] = R
   * (past x's T rows) once src[5] is a token. */
  const int32_t offsets_a[GE] = {2, 2, 5}, offsets_b[GE] = {0, 3, GR};
  for (int pass = 0; pass < 2; pass++) {
    const int32_t *o = pass ? offsets_b : offsets_a;
    set_offsets(&g, o[0], o[1], o[2]);
    set_src(&g, pass ? GR - 1 : -1, 2);
    for (int32_t gated = 0; gated < 2; gated++) {
      tensor *ot = &g.t[gated ? G_OUT_GATED : G_OUT];
      unsigned char *want =
          expected_bytes(&g.t[G_X], &g.t[G_SRC], &g.t[G_W], o, GE, gated, IMOE_ACT_GELU_TANH, ot);
      imoe_error err;
      memset(&err, 0, sizeof err);
      CHECK(imoe_experts_gemm(x, src, w, offs, gated, IMOE_ACT_GELU_TANH, &ot->view, &cpu, &err) == IMOE_OK,
            "argument world pass %d gated %d: valid call failed: %s", pass, (int)gated, err.message);
      CHECK(first_difference(ot, want) < 0, "argument world pass %d gated %d: out is not the definition", pass,
            (int)gated);
      CHECK(!tensor_same(ot, g.snap[gated ? G_OUT_GATED : G_OUT]), "argument world: the valid call wrote nothing");
      memcpy(ot->alloc, g.snap[gated ? G_OUT_GATED : G_OUT], ot->bytes);
      free(want);
    }
  }
  world_free(&g);
}

/* The gated epilogue's roundings matter: computing act(g) x u from the
 * unrounded F32 sums gives other BF16 bits often enough that the exact
 * check would see a missing rounding. */
static void test_rounding_matters(void) {
  uint64_t rng = 43;
  int differ = 0;
  for (int trial = 0; trial < 200; trial++) {
    const float g = (float)((double)(rng_next(&rng) >> 11) * ldexp(1.0, -51) - 2.0);
    const float u = (float)((double)(rng_next(&rng) >> 11) * ldexp(1.0, -51) - 2.0);
    const imoe_dtype dt = IMOE_DTYPE_BF16;
    const float exact =
        imoe_round_to(imoe_round_to(ref_act(imoe_round_to(g, dt), IMOE_ACT_SILU), dt) * imoe_round_to(u, dt), dt);
    const float loose = imoe_round_to(ref_act(g, IMOE_ACT_SILU) * u, dt);
    differ += imoe_bits_from_f32(exact) != imoe_bits_from_f32(loose);
  }
  CHECK(differ > 20, "gated roundings change the BF16 result in only %d of 200 trials", differ);
}

void test_experts_gemm_all(void) {
  test_rounding_matters();
  test_k_zero();
  test_r_zero();
  test_named_shapes();
  test_random_cases(0x5eed0e9a, 450);
  test_argument_errors();
}
