/* moe_combine.c: imoe_moe_combine (the weighted sum of each token's expert
 * rows back in token order) and imoe_gated_act (act(gate) x up over the
 * rows of a gate-up projection). The CPU core here; CUDA in
 * cuda/imoe_moe.cu. Contract: idempotent_moe.h. Built with
 * -ffp-contract=off: every product is rounded before it is added. */
#include <inttypes.h>
#include <math.h>

#include "floats.h"
#include "imoe_backend.h"
#include "imoe_internal.h"

/* torch's type promotion of two float dtypes (F16 with BF16 gives F32). */
static imoe_dtype promote(imoe_dtype a, imoe_dtype b) { return a == b ? a : IMOE_DTYPE_F32; }

typedef struct combine_ctx {
  const imoe_view *rows, *dest, *weights, *out;
  imoe_dtype term;
} combine_ctx;

/* acc[h] += (y[h] * w rounded to `term`) for one row y of `yd`: the
 * conversions hoisted out of the loop, one loop per dtype, so the compiler
 * can vectorise each. */
static void accumulate_row(float *acc, const char *y, imoe_dtype yd, float w, imoe_dtype term,
                           int64_t h_n) {
  if (yd == IMOE_DTYPE_F32) {
    const float *v = (const float *)(const void *)y;
    if (term == IMOE_DTYPE_F32)
      for (int64_t h = 0; h < h_n; h++) acc[h] += v[h] * w;
    else
      for (int64_t h = 0; h < h_n; h++) acc[h] += imoe_round_to(v[h] * w, term);
    return;
  }
  const uint16_t *v = (const uint16_t *)(const void *)y;
  if (yd == IMOE_DTYPE_BF16 && term == IMOE_DTYPE_BF16) {
    for (int64_t h = 0; h < h_n; h++)
      acc[h] += imoe_bf16_to_f32(imoe_f32_to_bf16(imoe_bf16_to_f32(v[h]) * w));
  } else if (yd == IMOE_DTYPE_BF16) {
    for (int64_t h = 0; h < h_n; h++) acc[h] += imoe_bf16_to_f32(v[h]) * w;
  } else if (imoe_have_f16c()) {
    imoe_f16c_accumulate(acc, v, w, h_n, term == IMOE_DTYPE_F16);
  } else if (term == IMOE_DTYPE_F16) {
    for (int64_t h = 0; h < h_n; h++)
      acc[h] += imoe_f16_to_f32(imoe_f32_to_f16(imoe_f16_to_f32(v[h]) * w));
  } else {
    for (int64_t h = 0; h < h_n; h++) acc[h] += imoe_f16_to_f32(v[h]) * w;
  }
}

static imoe_status combine_token(const void *vctx, int64_t t, unsigned char *mem, imoe_error *err) {
  const combine_ctx *c = vctx;
  (void)err;
  const int64_t k = c->dest->n, h_n = c->out->n;
  float *acc = (float *)(void *)mem; /* [H], zeroed per token */
  memset(acc, 0, (size_t)h_n * sizeof *acc);
  const char *dest = imoe_row_base(c->dest, t), *w = imoe_row_base(c->weights, t);
  for (int64_t j = 0; j < k; j++) {
    const int64_t d = imoe_load_index(dest + j * c->dest->n_stride, c->dest->dtype);
    if (d < 0) continue;
    const float wj = imoe_load_float(w + j * c->weights->n_stride, c->weights->dtype);
    accumulate_row(acc, imoe_row_base(c->rows, d), c->rows->dtype, wj, c->term, h_n);
  }
  char *out = imoe_row_base(c->out, t);
  const imoe_dtype od = c->out->dtype;
  if (od == IMOE_DTYPE_F32) memcpy(out, acc, (size_t)h_n * sizeof *acc);
  else if (od == IMOE_DTYPE_F16 && imoe_have_f16c())
    imoe_f16c_store((uint16_t *)(void *)out, acc, h_n); /* out is dense */
  else if (od == IMOE_DTYPE_BF16)
    for (int64_t h = 0; h < h_n; h++) ((uint16_t *)(void *)out)[h] = imoe_f32_to_bf16(acc[h]);
  else
    for (int64_t h = 0; h < h_n; h++) imoe_store_float(out + h * c->out->row_bytes, od, acc[h]);
  return IMOE_OK;
}

imoe_status imoe_moe_combine_shape(const imoe_view *rows, const imoe_view *dest,
                                   const imoe_view *weights, int64_t out_shape[2], imoe_error *err) {
  imoe_status st = imoe_check_matrix(rows, "rows", IMOE_SCORE_DTYPES, -1, -1, 0, 1, err);
  if (st == IMOE_OK) st = imoe_check_matrix(dest, "dest", IMOE_INDEX_DTYPES, -1, -1, 0, 0, err);
  if (st != IMOE_OK) return st;
  st = imoe_check_matrix(weights, "weights", IMOE_SCORE_DTYPES, dest->lead_shape[0], dest->n, 0, 0, err);
  if (st == IMOE_OK && out_shape != NULL) {
    out_shape[0] = dest->lead_shape[0];
    out_shape[1] = rows->n;
  }
  return st;
}

imoe_status imoe_moe_combine(const imoe_view *rows, const imoe_view *dest,
                             const imoe_view *weights, const imoe_view *out,
                             const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_moe_combine_shape(rows, dest, weights, NULL, err);
  if (st != IMOE_OK) return st;
  const int64_t r_n = rows->lead_shape[0], h_n = rows->n, t_n = dest->lead_shape[0], k = dest->n;
  st = imoe_check_matrix(out, "out", IMOE_SCORE_DTYPES, t_n, h_n, 1, 1, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  const imoe_call_args call = {NULL, 0, NULL, {rows, dest, weights}, {"rows", "dest", "weights"},
                               {out}, {"out"}, NULL, 0};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK || t_n == 0 || h_n == 0) return st;
  if (imoe_on_cuda(exec)) return imoe_cuda_moe_combine(rows, dest, weights, out, exec, err);
  for (int64_t t = 0; t < t_n; t++) {
    const char *d = imoe_row_base(dest, t);
    for (int64_t j = 0; j < k; j++) {
      const int64_t v = imoe_load_index(d + j * dest->n_stride, dest->dtype);
      if (v < -1 || v >= r_n) {
        return imoe_fail(err, IMOE_ERR_INDEX_RANGE,
                         "dest[%" PRId64 ", %" PRId64 "] = %" PRId64 " is outside [-1, rows = %" PRId64
                         ")",
                         t, j, v, r_n);
      }
    }
  }
  const combine_ctx c = {rows, dest, weights, out, promote(rows->dtype, weights->dtype)};
  const imoe_stage stage = {combine_token, &c, t_n};
  return imoe_run_stages(&stage, 1, (size_t)h_n * sizeof(float),
                         imoe_thread_count(exec, t_n * k * h_n * 4, t_n), err);
}

/* ---- gated activation ---- */

imoe_status imoe_check_moe_limit(const imoe_view *limit, imoe_error *err) {
  if (limit == NULL) return IMOE_OK;
  imoe_status st = imoe_check_view(limit, "limit", err);
  if (st == IMOE_OK) st = imoe_check_typed(limit, "limit", IMOE_INDEX_DTYPES, err);
  if (st == IMOE_OK && (limit->lead_ndim != 0 || limit->n < 1)) {
    st = imoe_fail(err, IMOE_ERR_ARGUMENT, "limit must be the [E] offsets of moe_dispatch");
  }
  return st;
}

float imoe_activate(float x, imoe_act act) {
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

float imoe_gated(float gate, float up, imoe_act act, imoe_dtype dt) {
  return imoe_round_to(imoe_activate(gate, act), dt) * up;
}

typedef struct act_ctx {
  const imoe_view *in, *out;
  imoe_act act;
} act_ctx;

static imoe_status act_row(const void *vctx, int64_t r, unsigned char *mem, imoe_error *err) {
  const act_ctx *a = vctx;
  (void)mem;
  (void)err;
  const int64_t inter = a->out->n, size = a->in->row_bytes;
  const imoe_dtype dt = a->in->dtype;
  const char *in = imoe_row_base(a->in, r);
  char *out = imoe_row_base(a->out, r);
  for (int64_t i = 0; i < inter; i++) {
    const float gate = imoe_load_float(in + i * size, dt), up = imoe_load_float(in + (inter + i) * size, dt);
    imoe_store_float(out + i * size, dt, imoe_gated(gate, up, a->act, dt));
  }
  return IMOE_OK;
}

imoe_status imoe_gated_act_shape(const imoe_view *gate_up, imoe_act act, const imoe_view *limit,
                                 int64_t out_shape[2], imoe_error *err) {
  imoe_status st = imoe_check_matrix(gate_up, "gate_up", IMOE_SCORE_DTYPES, -1, -1, 0, 1, err);
  if (st != IMOE_OK) return st;
  if (gate_up->n % 2 != 0) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "gate_up: %" PRId64 " features; gate and up need an even count", gate_up->n);
  }
  if (imoe_option_name(IMOE_OPTION_ACT, (int)act) == NULL) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "act: %d is not an imoe_act", (int)act);
  }
  st = imoe_check_moe_limit(limit, err);
  if (st == IMOE_OK && out_shape != NULL) {
    out_shape[0] = gate_up->lead_shape[0];
    out_shape[1] = gate_up->n / 2;
  }
  return st;
}

imoe_status imoe_gated_act(const imoe_view *gate_up, const imoe_view *out, imoe_act act,
                           const imoe_view *limit, const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_gated_act_shape(gate_up, act, limit, NULL, err);
  if (st != IMOE_OK) return st;
  const int64_t r_n = gate_up->lead_shape[0];
  st = imoe_check_matrix(out, "out", IMOE_DTYPE_BIT(gate_up->dtype), r_n, gate_up->n / 2, 1, 1, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  const imoe_call_args call = {NULL, 0, NULL, {gate_up, limit}, {"gate_up", "limit"},
                               {out}, {"out"}, NULL, 0};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK || empty) return st;
  if (imoe_on_cuda(exec)) return imoe_cuda_gated_act(gate_up, out, act, limit, exec, err);
  int64_t rows = r_n;
  if (limit != NULL) {
    const int64_t end = imoe_load_index((const char *)limit->data + (limit->n - 1) * limit->n_stride,
                                        limit->dtype);
    rows = end < 0 ? 0 : end < r_n ? end : r_n;
  }
  const act_ctx a = {gate_up, out, act};
  const imoe_stage stage = {act_row, &a, rows};
  return imoe_run_stages(&stage, 1, 0, imoe_thread_count(exec, rows * gate_up->n * 4, rows), err);
}
