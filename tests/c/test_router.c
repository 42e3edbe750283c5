/* test_router.c: imoe_topk_softmax in the C core: probabilities against
 * double precision, equal values in torch's CUDA topk order (gatherTopK's
 * write order, then SmallBitonicSort's network; the expected experts are
 * those of the Python transcription in tests/moe/test_moe_router.py), NaN rows,
 * the renormalising sum, threads, and every argument error leaving the
 * outputs unchanged. */
#include <math.h>
#include <string.h>

#include "check.h"
#include "idempotent_moe.h"

/* A [rows, cols] row-major view. */
static imoe_view mat(void *data, int64_t rows, int64_t cols, imoe_dtype dtype, int64_t elem) {
  imoe_view v;
  memset(&v, 0, sizeof v);
  v.data = data;
  v.lead_ndim = 1;
  v.lead_shape[0] = rows;
  v.lead_stride[0] = cols * elem;
  v.n = cols;
  v.n_stride = elem;
  v.row_bytes = elem;
  v.dtype = dtype;
  return v;
}

static imoe_status route(float *logits, int64_t t, int64_t e, int64_t k, int renorm, float *w,
                         int64_t *idx, int threads) {
  imoe_view l = mat(logits, t, e, IMOE_DTYPE_F32, 4), wv = mat(w, t, k, IMOE_DTYPE_F32, 4);
  imoe_view iv = mat(idx, t, k, IMOE_DTYPE_I64, 8);
  imoe_exec exec = {IMOE_DEVICE_CPU, 0, threads, NULL};
  imoe_error err;
  return imoe_topk_softmax(&l, k, renorm, &wv, &iv, &exec, &err);
}

static void test_probabilities_against_double(void) {
  static float logits[64 * 40];
  static float w[64 * 32];
  static int64_t idx[64 * 32];
  uint32_t s = 12345;
  for (int i = 0; i < 64 * 40; i++) {
    s = s * 1664525u + 1013904223u;
    logits[i] = (float)((int)(s >> 8) % 20001 - 10000) / 1000.0f;
  }
  for (int64_t e = 1; e <= 40; e += 13) {
    const int64_t k = e < 32 ? e : 32;
    CHECK(route(logits, 64, e, k, 0, w, idx, 1) == IMOE_OK, "route E=%d", (int)e);
    for (int64_t t = 0; t < 64; t++) {
      const float *x = logits + t * e;
      double m = x[0], sum = 0.0;
      for (int64_t j = 1; j < e; j++) m = x[j] > m ? x[j] : m;
      for (int64_t j = 0; j < e; j++) sum += exp((double)x[j] - m);
      for (int64_t r = 0; r < k; r++) {
        const int64_t j = idx[t * k + r];
        const double p = exp((double)x[j] - m) / sum;
        /* x - max is rounded to F32 before exp, as in torch: |x - max| x 2^-24 relative */
        const double tol = p * (4e-7 + fabs((double)x[j] - m) * 1.2e-7) + 1e-30;
        CHECK(fabs(w[t * k + r] - p) <= tol, "E=%d t=%d r=%d: %g vs %g", (int)e, (int)t,
              (int)r, w[t * k + r], p);
        if (r > 0) CHECK(w[t * k + r] <= w[t * k + r - 1], "descending");
      }
    }
  }
}

static void test_ties_nan_and_renormalisation(void) {
  float logits[4 * 5] = {1, 3, 3, 2, 3, 0, 0, 0, 0, 0, 1, NAN, 2, 0, 0, 1, 2, -INFINITY, 0.5f, 0};
  float w[4 * 3];
  int64_t idx[4 * 3];
  CHECK(route(logits, 4, 5, 3, 1, w, idx, 1) == IMOE_OK, "route");
  /* ties and the NaN row: gathered 1 2 4 / 0 1 2 / 0 1 2, the network reverses three equal values */
  const int64_t want[4][3] = {{4, 2, 1}, {2, 1, 0}, {2, 1, 0}, {1, 0, 3}};
  for (int t = 0; t < 4; t++)
    for (int r = 0; r < 3; r++) CHECK(idx[t * 3 + r] == want[t][r], "t=%d r=%d: %d", t, r, (int)idx[t * 3 + r]);
  for (int r = 0; r < 3; r++) CHECK(isnan(w[2 * 3 + r]), "NaN row");
  /* k = 3: B = 2, the sum is (v0 + v2) + v1 */
  float plain[3];
  int64_t pi[3];
  CHECK(route(logits + 15, 1, 5, 3, 0, plain, pi, 1) == IMOE_OK, "plain");
  const float sum = (plain[0] + plain[2]) + plain[1];
  for (int r = 0; r < 3; r++) CHECK(w[9 + r] == plain[r] / sum, "renormalised r=%d", r);
  float one[4];
  int64_t oi[4];
  CHECK(route(logits, 4, 5, 1, 1, one, oi, 1) == IMOE_OK && one[0] == 1.0f && one[3] == 1.0f, "k = 1");
}

/* One row of e logits, k experts wanted in the order given. */
static void check_order(const char *what, const float *x, int64_t e, int64_t k, const int64_t *want) {
  static float w[32], plain[32];
  static int64_t idx[32], idx2[32];
  float *row = (float *)x;
  CHECK(route(row, 1, e, k, 1, w, idx, 1) == IMOE_OK, "%s: route", what);
  CHECK(route(row, 1, e, k, 0, plain, idx2, 1) == IMOE_OK, "%s: route plain", what);
  for (int64_t r = 0; r < k; r++) {
    CHECK(idx[r] == want[r] && idx2[r] == want[r], "%s: r=%d: %d, want %d", what, (int)r, (int)idx[r],
          (int)want[r]);
    if (r > 0 && !isnan(plain[r])) CHECK(plain[r] <= plain[r - 1], "%s: descending", what);
  }
}

static void test_ties_in_torchs_cuda_order(void) {
  static float x[1024];
  /* two equal top values at experts 6 and 7 of 8: torch's CUDA topk gives 7, 6 */
  for (int j = 0; j < 8; j++) x[j] = j >= 6 ? 1.0f : 0.0f;
  check_order("E=8 k=2", x, 8, 2, (const int64_t[]){7, 6});
  for (int j = 0; j < 64; j++) x[j] = 0.5f;
  check_order("E=64 k=8 all equal", x, 64, 8, (const int64_t[]){7, 6, 4, 5, 1, 0, 2, 3});
  check_order("E=64 k=32 all equal", x, 64, 32,
              (const int64_t[]){31, 30, 28, 29, 25, 24, 26, 27, 19, 18, 16, 17, 21, 20, 22, 23,
                                7,  6,  4,  5,  1,  0,  2,  3,  11, 10, 8,  9,  13, 12, 14, 15});
  check_order("E=3 k=2 all equal", x, 3, 2, (const int64_t[]){1, 0});
  check_order("E=3 k=1 all equal", x, 3, 1, (const int64_t[]){0});
  /* one above, then equal values at the k-th place: 50 | 1 4 7 gathered */
  for (int j = 0; j < 60; j++) x[j] = j % 3 == 1 ? 1.0f : 0.0f;
  x[50] = 2.0f;
  check_order("E=60 k=4", x, 60, 4, (const int64_t[]){50, 7, 1, 4});
  /* three equal above, then 120 .. 124 of eight equal */
  for (int j = 0; j < 128; j++) x[j] = j >= 120 ? 1.0f : (j == 5 || j == 17 || j == 100) ? 2.0f : 0.0f;
  check_order("E=128 k=8", x, 128, 8, (const int64_t[]){100, 17, 5, 120, 122, 123, 121, 124});
  /* 28 equal above (every 37th expert), then 1 .. 4 of the equal rest */
  for (int j = 0; j < 1024; j++) x[j] = j % 37 == 0 ? 1.0f : 0.0f;
  check_order("E=1024 k=32", x, 1024, 32,
              (const int64_t[]){925, 888, 962, 999, 777, 740, 814, 851, 703, 666, 592, 629, 481, 444, 518, 555,
                                259, 222, 148, 185, 37,  0,   74,  111, 407, 370, 296, 333, 4,   3,   1,   2});
  check_order("E=1024 k=5", x, 1024, 5, (const int64_t[]){37, 0, 74, 148, 111});
  /* a NaN row: every probability NaN, ranked as equal values */
  x[500] = NAN;
  check_order("E=1024 NaN k=8", x, 1024, 8, (const int64_t[]){7, 6, 4, 5, 1, 0, 2, 3});
  float w[8];
  int64_t idx[8];
  CHECK(route(x, 1, 1024, 8, 1, w, idx, 1) == IMOE_OK && isnan(w[0]) && isnan(w[7]), "NaN weights");
}

static void test_threads_agree(void) {
  static float logits[300 * 64], w1[300 * 8], w4[300 * 8];
  static int64_t i1[300 * 8], i4[300 * 8];
  for (int i = 0; i < 300 * 64; i++) logits[i] = sinf((float)i * 0.37f) * 4.0f;
  CHECK(route(logits, 300, 64, 8, 1, w1, i1, 1) == IMOE_OK, "1 thread");
  CHECK(route(logits, 300, 64, 8, 1, w4, i4, 4) == IMOE_OK, "4 threads");
  CHECK(memcmp(w1, w4, sizeof w1) == 0 && memcmp(i1, i4, sizeof i1) == 0, "threads agree");
}

static void test_argument_errors(void) {
  float logits[2 * 40] = {0}, w[2 * 33];
  int64_t idx[2 * 33];
  const struct {
    int64_t e, k, w_rows, w_cols, i_cols;
    imoe_dtype w_dt, i_dt;
    imoe_status want;
  } cases[] = {
      {8, 0, 2, 0, 0, IMOE_DTYPE_F32, IMOE_DTYPE_I64, IMOE_ERR_ARGUMENT},  /* k = 0 */
      {8, 9, 2, 9, 9, IMOE_DTYPE_F32, IMOE_DTYPE_I64, IMOE_ERR_ARGUMENT},  /* k > E */
      {40, 33, 2, 33, 33, IMOE_DTYPE_F32, IMOE_DTYPE_I64, IMOE_ERR_ARGUMENT}, /* k > 32 */
      {0, 1, 2, 1, 1, IMOE_DTYPE_F32, IMOE_DTYPE_I64, IMOE_ERR_ARGUMENT},  /* no experts */
      {8, 2, 1, 2, 2, IMOE_DTYPE_F32, IMOE_DTYPE_I64, IMOE_ERR_ARGUMENT},  /* weights rows */
      {8, 2, 2, 3, 2, IMOE_DTYPE_F32, IMOE_DTYPE_I64, IMOE_ERR_ARGUMENT},  /* weights cols */
      {8, 2, 2, 2, 3, IMOE_DTYPE_F32, IMOE_DTYPE_I64, IMOE_ERR_ARGUMENT},  /* indices cols */
      {8, 2, 2, 2, 2, IMOE_DTYPE_I32, IMOE_DTYPE_I64, IMOE_ERR_DTYPE},     /* weights int */
      {8, 2, 2, 2, 2, IMOE_DTYPE_F32, IMOE_DTYPE_F32, IMOE_ERR_DTYPE},     /* indices float */
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    memset(w, 0x5A, sizeof w);
    memset(idx, 0x5A, sizeof idx);
    const int64_t ws = cases[c].w_dt == IMOE_DTYPE_I32 || cases[c].w_dt == IMOE_DTYPE_F32 ? 4 : 2;
    const int64_t is = cases[c].i_dt == IMOE_DTYPE_I64 ? 8 : 4;
    imoe_view l = mat(logits, 2, cases[c].e, IMOE_DTYPE_F32, 4);
    imoe_view wv = mat(w, cases[c].w_rows, cases[c].w_cols, cases[c].w_dt, ws);
    imoe_view iv = mat(idx, 2, cases[c].i_cols, cases[c].i_dt, is);
    imoe_error err;
    const imoe_status st = imoe_topk_softmax(&l, cases[c].k, 1, &wv, &iv, NULL, &err);
    CHECK(st == cases[c].want, "case %d: status %d, want %d", (int)c, (int)st, (int)cases[c].want);
    int same = 1;
    for (size_t b = 0; b < sizeof w; b++) same &= ((unsigned char *)w)[b] == 0x5A;
    for (size_t b = 0; b < sizeof idx; b++) same &= ((unsigned char *)idx)[b] == 0x5A;
    CHECK(same, "case %d: outputs unchanged", (int)c);
  }
  /* outputs that overlap */
  imoe_view l = mat(logits, 2, 8, IMOE_DTYPE_F32, 4), wv = mat(w, 2, 2, IMOE_DTYPE_F32, 4);
  imoe_view iv = mat(w, 2, 2, IMOE_DTYPE_I32, 4);
  imoe_error err;
  CHECK(imoe_topk_softmax(&l, 2, 1, &wv, &iv, NULL, &err) == IMOE_ERR_ARGUMENT, "overlap");
}

void test_router_all(void) {
  test_probabilities_against_double();
  test_ties_nan_and_renormalisation();
  test_ties_in_torchs_cuda_order();
  test_threads_agree();
  test_argument_errors();
}
