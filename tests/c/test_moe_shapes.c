/* test_moe_shapes.c: the MoE operations' output-shape functions (each
 * judges what its operation reads, as the operation does, and gives the
 * output's shape), the dispatch's `distinct` check (a token naming a local
 * expert twice: IMOE_ERR_INDEX_DUPLICATE on the CPU, nothing written), and
 * top_k_weights judged whenever given. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "idempotent_moe.h"

enum { T = 4, K = 2, E = 4, H = 3 };

/* [rows, n] dense, of a typed dtype of `size` bytes. */
static imoe_view matrix(void *data, int64_t rows, int64_t n, imoe_dtype dt, int64_t size) {
  imoe_view v;
  memset(&v, 0, sizeof v);
  v.data = data;
  v.lead_ndim = 1;
  v.lead_shape[0] = rows;
  v.lead_stride[0] = n * size;
  v.n = n;
  v.n_stride = size;
  v.row_bytes = size;
  v.dtype = dt;
  return v;
}

/* [n] dense: a vector of a typed dtype, or n rows of `size` bytes (BYTES). */
static imoe_view vector(void *data, int64_t n, imoe_dtype dt, int64_t size) {
  imoe_view v;
  memset(&v, 0, sizeof v);
  v.data = data;
  v.n = n;
  v.n_stride = size;
  v.row_bytes = size;
  v.dtype = dt;
  return v;
}

static void test_dispatch_distinct(void) {
  float hidden[T * H], rows[T * K * H], weights[T * K] = {0};
  int32_t ids[T * K] = {0, 1, 2, 3, 1, 1, 3, 0}; /* token 2 names expert 1 twice */
  int32_t offsets[E], dest[T * K], src[T * K];
  int64_t dropped = -7;
  for (int i = 0; i < T * H; i++) hidden[i] = (float)i;
  memset(rows, 0xA5, sizeof rows);
  memset(offsets, 0xA5, sizeof offsets);
  memset(dest, 0xA5, sizeof dest);
  memset(src, 0xA5, sizeof src);
  imoe_view vh = vector(hidden, T, IMOE_DTYPE_BYTES, H * 4), vi = matrix(ids, T, K, IMOE_DTYPE_I32, 4);
  imoe_view vw = matrix(weights, T, K, IMOE_DTYPE_F32, 4), vr = vector(rows, T * K, IMOE_DTYPE_BYTES, H * 4);
  imoe_view vo = vector(offsets, E, IMOE_DTYPE_I32, 4), vd = matrix(dest, T, K, IMOE_DTYPE_I32, 4);
  imoe_view vs = vector(src, T * K, IMOE_DTYPE_I32, 4), vdr = vector(&dropped, 1, IMOE_DTYPE_I64, 8);
  imoe_exec exec = {IMOE_DEVICE_CPU, 0, 1, NULL};
  imoe_error err = {{0}};
  imoe_moe_routing r = {&vi, NULL, E, -1, IMOE_MOE_GROUPED, 0, 1};
  imoe_status st = imoe_moe_dispatch(&r, &vh, &vr, &vo, &vd, &vs, &vdr, NULL, 0, &exec, &err);
  CHECK(st == IMOE_ERR_INDEX_DUPLICATE, "distinct: status %d", (int)st);
  CHECK(strstr(err.message, "top_k_index[2, 1]") != NULL && strstr(err.message, "distinct") != NULL,
        "distinct: message '%s'", err.message);
  unsigned char sentinel[T * K * H * 4];
  memset(sentinel, 0xA5, sizeof sentinel);
  CHECK(memcmp(rows, sentinel, sizeof rows) == 0 && memcmp(dest, sentinel, sizeof dest) == 0 &&
            memcmp(src, sentinel, sizeof src) == 0 && memcmp(offsets, sentinel, sizeof offsets) == 0 &&
            dropped == -7,
        "distinct: a refused call wrote");
  /* With weights, a repeat of weight 0 (it adds nothing) is accepted; of
   * nonzero weight, refused. */
  for (int i = 0; i < T * K; i++) weights[i] = 0.5f;
  weights[5] = 0.0f;
  r.top_k_weights = &vw;
  st = imoe_moe_dispatch(&r, &vh, &vr, &vo, &vd, &vs, &vdr, NULL, 0, &exec, &err);
  CHECK(st == IMOE_OK && offsets[1] == 5, "a zero-weight repeat: %d (%s)", (int)st, err.message);
  weights[5] = 0.5f;
  st = imoe_moe_dispatch(&r, &vh, &vr, &vo, &vd, &vs, &vdr, NULL, 0, &exec, &err);
  CHECK(st == IMOE_ERR_INDEX_DUPLICATE, "a weighted repeat: %d", (int)st);
  r.top_k_weights = NULL;
  r.distinct = 0; /* two assignments */
  st = imoe_moe_dispatch(&r, &vh, &vr, &vo, &vd, &vs, &vdr, NULL, 0, &exec, &err);
  CHECK(st == IMOE_OK && offsets[1] == 5 && dest[4] != dest[5], "repeat as two assignments: %d", (int)st);
  /* With skip_foreign, repeated ids of other ranks' experts are not local. */
  int32_t foreign[T * K] = {0, 5, 5, 5, 1, 2, 3, 6};
  imoe_view vf = matrix(foreign, T, K, IMOE_DTYPE_I32, 4);
  imoe_moe_routing rf = {&vf, NULL, E, -1, IMOE_MOE_GROUPED, 1, 1};
  st = imoe_moe_dispatch(&rf, &vh, &vr, &vo, &vd, &vs, &vdr, NULL, 0, &exec, &err);
  CHECK(st == IMOE_OK, "distinct with foreign repeats: %d (%s)", (int)st, err.message);
  rf.distinct = 2;
  st = imoe_moe_dispatch_rows(&rf, &vh, NULL, &err);
  CHECK(st == IMOE_ERR_ARGUMENT && strstr(err.message, "distinct") != NULL, "distinct = 2: %d", (int)st);
  /* top_k_weights are judged when given, dropless too. */
  imoe_view short_w = matrix(weights, T - 1, K, IMOE_DTYPE_F32, 4);
  imoe_moe_routing rw = {&vi, &short_w, E, -1, IMOE_MOE_GROUPED, 0, 0};
  st = imoe_moe_dispatch_rows(&rw, &vh, NULL, &err);
  CHECK(st == IMOE_ERR_ARGUMENT && strstr(err.message, "top_k_weights") != NULL, "short weights: %d",
        (int)st);
}

static void test_dispatch_rows(void) {
  float hidden[T * H] = {0}, weights[T * K] = {0};
  int32_t ids[T * K] = {0};
  imoe_view vh = vector(hidden, T, IMOE_DTYPE_BYTES, H * 4), vi = matrix(ids, T, K, IMOE_DTYPE_I32, 4);
  imoe_view vw = matrix(weights, T, K, IMOE_DTYPE_F32, 4);
  imoe_error err = {{0}};
  int64_t rows = -1;
  imoe_moe_routing r = {&vi, NULL, E, -1, IMOE_MOE_GROUPED, 0, 0};
  CHECK(imoe_moe_dispatch_rows(&r, &vh, &rows, &err) == IMOE_OK && rows == T * K, "grouped rows %lld",
        (long long)rows);
  imoe_moe_routing padded = {&vi, &vw, E, 3, IMOE_MOE_PADDED, 0, 0};
  CHECK(imoe_moe_dispatch_rows(&padded, &vh, &rows, &err) == IMOE_OK && rows == E * 3, "padded rows %lld",
        (long long)rows);
  const struct {
    int64_t experts, capacity;
    const char *word;
  } bad[] = {{0, -1, "num_experts"}, {-3, -1, "num_experts"}, {IMOE_MOE_MAX_EXPERTS + 1, -1, "num_experts"},
             {E, -2, "capacity"}, {E, (int64_t)1 << 40, "capacity"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    imoe_moe_routing b = {&vi, &vw, bad[i].experts, bad[i].capacity, IMOE_MOE_GROUPED, 0, 0};
    rows = -1;
    const imoe_status st = imoe_moe_dispatch_rows(&b, &vh, &rows, &err);
    CHECK(st == IMOE_ERR_ARGUMENT && strstr(err.message, bad[i].word) != NULL && rows == -1,
          "bad routing %zu: %d '%s'", i, (int)st, err.message);
  }
  imoe_moe_routing huge = {&vi, &vw, IMOE_MOE_MAX_EXPERTS, (int64_t)1 << 30, IMOE_MOE_PADDED, 0, 0};
  CHECK(imoe_moe_dispatch_rows(&huge, &vh, &rows, &err) == IMOE_ERR_ARGUMENT, "E x C beyond the slots");
  imoe_view short_h = vector(hidden, T - 1, IMOE_DTYPE_BYTES, H * 4);
  CHECK(imoe_moe_dispatch_rows(&r, &short_h, &rows, &err) == IMOE_ERR_ARGUMENT &&
            strstr(err.message, "hidden") != NULL,
        "hidden of another T");
}

static void test_output_shapes(void) {
  float rows[T * K * H] = {0}, weights[T * K] = {0}, gate_up[T * 2 * H] = {0}, w[E * H * 5] = {0};
  int32_t dest[T * K] = {0}, offsets[E] = {0};
  imoe_view vr = matrix(rows, T * K, H, IMOE_DTYPE_F32, 4), vd = matrix(dest, T, K, IMOE_DTYPE_I32, 4);
  imoe_view vw = matrix(weights, T, K, IMOE_DTYPE_F32, 4), vg = matrix(gate_up, T, 2 * H, IMOE_DTYPE_F32, 4);
  imoe_view vo = vector(offsets, E, IMOE_DTYPE_I32, 4);
  imoe_error err = {{0}};
  int64_t shape[2] = {-1, -1};
  CHECK(imoe_moe_combine_shape(&vr, &vd, &vw, shape, &err) == IMOE_OK && shape[0] == T && shape[1] == H,
        "combine shape");
  imoe_view short_w = matrix(weights, T, K - 1, IMOE_DTYPE_F32, 4);
  CHECK(imoe_moe_combine_shape(&vr, &vd, &short_w, shape, &err) == IMOE_ERR_ARGUMENT &&
            strstr(err.message, "weights") != NULL,
        "combine: weights of another k");
  CHECK(imoe_gated_act_shape(&vg, IMOE_ACT_GELU, &vo, shape, &err) == IMOE_OK && shape[0] == T &&
            shape[1] == H,
        "gated_act shape");
  CHECK(imoe_gated_act_shape(&vg, (imoe_act)9, NULL, shape, &err) == IMOE_ERR_ARGUMENT, "bad act");
  imoe_view odd = matrix(gate_up, T, 2 * H - 1, IMOE_DTYPE_F32, 4);
  CHECK(imoe_gated_act_shape(&odd, IMOE_ACT_SILU, NULL, shape, &err) == IMOE_ERR_ARGUMENT, "odd gate_up");
  imoe_view grad = matrix(rows, T, H, IMOE_DTYPE_F32, 4);
  CHECK(imoe_gated_act_backward_shape(&vg, &grad, IMOE_ACT_SILU, NULL, NULL, NULL, NULL, shape, &err) ==
                IMOE_OK &&
            shape[0] == T && shape[1] == 2 * H,
        "gated_act_backward shape");
  imoe_view src = matrix(rows, T, H, IMOE_DTYPE_F32, 4);
  CHECK(imoe_moe_gather_rows_shape(&src, &vd, &vw, 7, shape, &err) == IMOE_OK && shape[0] == 7 &&
            shape[1] == H,
        "gather_rows shape");
  CHECK(imoe_moe_gather_rows_shape(&src, &vd, NULL, -1, shape, &err) == IMOE_ERR_ARGUMENT &&
            strstr(err.message, "num_rows") != NULL,
        "negative num_rows");
  CHECK(imoe_moe_gather_rows_shape(&src, &vd, NULL, (int64_t)1 << 40, shape, &err) == IMOE_ERR_ARGUMENT,
        "huge num_rows");
  CHECK(imoe_moe_weight_grad_shape(&src, 0, &vr, &vd, shape, &err) == IMOE_OK && shape[0] == T &&
            shape[1] == K,
        "weight_grad shape");
  imoe_view a = matrix(gate_up, T, H, IMOE_DTYPE_F32, 4);
  imoe_view wv;
  memset(&wv, 0, sizeof wv);
  wv.data = w;
  wv.lead_ndim = 2;
  wv.lead_shape[0] = E;
  wv.lead_shape[1] = H;
  wv.lead_stride[0] = H * 5 * 4;
  wv.lead_stride[1] = 5 * 4;
  wv.n = 5;
  wv.n_stride = 4;
  wv.row_bytes = 4;
  wv.dtype = IMOE_DTYPE_F32;
  CHECK(imoe_grouped_gemm_shape(&a, &wv, &vo, shape, &err) == IMOE_OK && shape[0] == T && shape[1] == 5,
        "grouped_gemm shape");
  imoe_view logits = matrix(gate_up, T, E, IMOE_DTYPE_F32, 4);
  CHECK(imoe_topk_softmax_shape(&logits, 2, shape, &err) == IMOE_OK && shape[0] == T && shape[1] == 2,
        "topk shape");
  CHECK(imoe_topk_softmax_shape(&logits, E + 1, shape, &err) == IMOE_ERR_ARGUMENT &&
            strstr(err.message, "k = ") != NULL,
        "k beyond E");
}

void test_moe_shapes_all(void) {
  test_dispatch_distinct();
  test_dispatch_rows();
  test_output_shapes();
}
