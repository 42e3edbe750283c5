/* moe_backward.c: the backward kernels of the MoE layer (contract in
 * idempotent_moe.h, "MoE backward"): imoe_gated_act_backward,
 * imoe_moe_gather_rows (the combine's d(rows): a gather of token rows
 * to their assignments' rows, scaled by the routing weight) and
 * imoe_moe_weight_grad (d(top_k_weights): one dot product per kept
 * assignment). The CPU core here; CUDA in cuda/imoe_moe_backward.cu.
 * Built with -ffp-contract=off: every product is rounded before it is added,
 * so the dot products' order below is the CUDA kernel's bit for bit. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#include "floats.h"
#include "imoe_backend.h"
#include "imoe_internal.h"

/* ---- shared checks ---- */

/* dest [T, k] each in [-1, rows): IMOE_ERR_INDEX_RANGE naming the entry. */
static imoe_status check_dest(const imoe_view *dest, int64_t rows, imoe_error *err) {
  const int64_t t_n = dest->lead_shape[0], k = dest->n;
  for (int64_t t = 0; t < t_n; t++) {
    const char *d = imoe_row_base(dest, t);
    for (int64_t j = 0; j < k; j++) {
      const int64_t v = imoe_load_index(d + j * dest->n_stride, dest->dtype);
      if (v < -1 || v >= rows) {
        return imoe_fail(err, IMOE_ERR_INDEX_RANGE,
                         "dest[%" PRId64 ", %" PRId64 "] = %" PRId64 " is outside [-1, rows = %" PRId64 ")",
                         t, j, v, rows);
      }
    }
  }
  return IMOE_OK;
}

/* The rows below limit[E - 1], clamped to [0, rows]; all rows without a limit. */
static int64_t limit_rows(const imoe_view *limit, int64_t rows) {
  if (limit == NULL) return rows;
  const int64_t end = imoe_load_index((const char *)limit->data + (limit->n - 1) * limit->n_stride,
                                      limit->dtype);
  return end < 0 ? 0 : end < rows ? end : rows;
}

/* ---- the gated activation's backward ---- */

/* act(x) and act'(x) in F32, as the forward's `activate` computes act. */
static float act_and_slope(float x, imoe_act act, float *slope) {
  switch (act) {
    case IMOE_ACT_SILU: {
      const float s = 1.0f / (1.0f + expf(-x));
      *slope = s * (1.0f + x * (1.0f - s));
      return x * s;
    }
    case IMOE_ACT_GELU: {
      const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752440f));
      const float pdf = 0.39894228040143267794f * expf(-0.5f * x * x);
      *slope = cdf + x * pdf;
      return x * cdf;
    }
    case IMOE_ACT_GELU_TANH: {
      const float beta = 0.7978845608028654f, kappa = 0.044715f;
      const float x2 = x * x;
      const float t = tanhf(beta * (x + kappa * x2 * x));
      *slope = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * beta * (1.0f + 3.0f * kappa * x2);
      return 0.5f * x * (1.0f + t);
    }
    case IMOE_ACT_RELU:
      *slope = x > 0.0f ? 1.0f : 0.0f;
      return x > 0.0f ? x : 0.0f;
  }
  *slope = 1.0f;
  return x;
}

typedef struct act_bwd_ctx {
  const imoe_view *in, *grad, *scale, *out, *act_out, *dot;
  int64_t rows; /* rows below the limit; the others are zeroed */
  imoe_act act;
} act_bwd_ctx;

static void act_bwd_zero_row(const act_bwd_ctx *a, int64_t r) {
  const int64_t inter = a->grad->n, size = a->in->row_bytes;
  const imoe_dtype dt = a->in->dtype;
  char *out = imoe_row_base(a->out, r);
  for (int64_t i = 0; i < 2 * inter; i++) imoe_store_float(out + i * size, dt, 0.0f);
  if (a->act_out != NULL) {
    char *ao = imoe_row_base(a->act_out, r);
    for (int64_t i = 0; i < inter; i++) imoe_store_float(ao + i * a->act_out->row_bytes, dt, 0.0f);
  }
  if (a->dot != NULL) imoe_store_float(imoe_row_base(a->dot, r), IMOE_DTYPE_F32, 0.0f);
}

/* One row. Each grad element is loaded before act_out's element of the same
 * index is stored (act_out may be grad itself), and gate[i] and up[i] before
 * out's elements i and I + i (out may be gate_up itself). */
static imoe_status act_bwd_row(const void *vctx, int64_t r, unsigned char *mem, imoe_error *err) {
  const act_bwd_ctx *a = vctx;
  (void)mem;
  (void)err;
  if (r >= a->rows) {
    act_bwd_zero_row(a, r);
    return IMOE_OK;
  }
  const int64_t inter = a->grad->n;
  const imoe_dtype dt = a->in->dtype, gd = a->grad->dtype;
  const int64_t size = a->in->row_bytes, gsize = a->grad->row_bytes;
  const float w = a->scale != NULL ? imoe_load_float(imoe_row_base(a->scale, r), a->scale->dtype) : 1.0f;
  char *out = imoe_row_base(a->out, r), *ao = a->act_out != NULL ? imoe_row_base(a->act_out, r) : NULL;
  const char *in = imoe_row_base(a->in, r), *grad = imoe_row_base(a->grad, r);
  float p[32] = {0};
  for (int64_t i = 0; i < inter; i++) {
    const float g = imoe_load_float(in + i * size, dt), u = imoe_load_float(in + (inter + i) * size, dt);
    const float d = imoe_load_float(grad + i * gsize, gd), ds = a->scale != NULL ? d * w : d;
    float slope;
    const float act = act_and_slope(g, a->act, &slope);
    if (ao != NULL || a->dot != NULL) {
      const float fwd = imoe_round_to(imoe_gated(g, u, a->act, dt), dt);
      p[(i >> 3) & 31] += d * fwd;
      if (ao != NULL) imoe_store_float(ao + i * a->act_out->row_bytes, dt, a->scale != NULL ? fwd * w : fwd);
    }
    imoe_store_float(out + i * size, dt, ds * u * slope);
    imoe_store_float(out + (inter + i) * size, dt, ds * act);
  }
  if (a->dot != NULL) {
    for (int s = 16; s >= 1; s >>= 1)
      for (int l = 0; l < s; l++) p[l] += p[l + s];
    imoe_store_float(imoe_row_base(a->dot, r), IMOE_DTYPE_F32, p[0]);
  }
  return IMOE_OK;
}

/* An output given as an input itself (act_out as grad_act, out as gate_up):
 * the same bytes, element for element. */
static int same_view(const imoe_view *a, const imoe_view *b) {
  return a->data == b->data && a->dtype == b->dtype && a->n == b->n && a->n_stride == b->n_stride &&
         a->lead_ndim == b->lead_ndim && a->lead_shape[0] == b->lead_shape[0] &&
         a->lead_stride[0] == b->lead_stride[0];
}

/* Every check of the call but exec's; out (grad_gate_up) may be NULL (the
 * shape function: the outputs a caller gave are judged before it allocates
 * the others). *empty as imoe_check_call's. */
static imoe_status check_act_bwd(const imoe_view *gate_up, const imoe_view *grad_act, imoe_act act,
                                 const imoe_view *limit, const imoe_view *row_scale, const imoe_view *out,
                                 const imoe_view *act_out, const imoe_view *row_dot, int *empty,
                                 imoe_error *err) {
  imoe_status st = imoe_gated_act_shape(gate_up, act, limit, NULL, err);
  if (st != IMOE_OK) return st;
  const int64_t r_n = gate_up->lead_shape[0], inter = gate_up->n / 2;
  const unsigned own = IMOE_DTYPE_BIT(gate_up->dtype);
  st = imoe_check_matrix(grad_act, "grad_act", IMOE_SCORE_DTYPES, r_n, inter, 0, 1, err);
  if (st == IMOE_OK && row_scale != NULL)
    st = imoe_check_matrix(row_scale, "row_scale", IMOE_SCORE_DTYPES, r_n, 1, 0, 0, err);
  /* Named as the Python API names them. */
  if (st == IMOE_OK && out != NULL) st = imoe_check_matrix(out, "out", own, r_n, gate_up->n, 1, 1, err);
  if (st == IMOE_OK && act_out != NULL) st = imoe_check_matrix(act_out, "act_out", own, r_n, inter, 1, 1, err);
  if (st == IMOE_OK && row_dot != NULL)
    st = imoe_check_matrix(row_dot, "row_dot", IMOE_DTYPE_BIT(IMOE_DTYPE_F32), r_n, 1, 1, 0, err);
  if (st != IMOE_OK) return st;
  /* act_out in place of grad_act (checked above as act_out) stands for
   * both, and so does out in place of gate_up (checked as out): each must
   * share no byte with any other argument. */
  const int in_place = act_out != NULL && same_view(act_out, grad_act);
  const int over_input = out != NULL && same_view(out, gate_up);
  const imoe_call_args call = {NULL, 0, NULL,
                               {over_input ? NULL : gate_up, in_place ? NULL : grad_act, limit, row_scale},
                               {"gate_up", "grad_act", "limit", "row_scale"},
                               {out, act_out, row_dot},
                               {over_input ? "gate_up" : "out", in_place ? "grad_act" : "act_out", "row_dot"},
                               NULL, 0};
  return imoe_check_call(&call, empty, err);
}

imoe_status imoe_gated_act_backward_shape(const imoe_view *gate_up, const imoe_view *grad_act,
                                          imoe_act act, const imoe_view *limit, const imoe_view *row_scale,
                                          const imoe_view *act_out, const imoe_view *row_dot,
                                          int64_t out_shape[2], imoe_error *err) {
  int empty;
  const imoe_status st =
      check_act_bwd(gate_up, grad_act, act, limit, row_scale, NULL, act_out, row_dot, &empty, err);
  if (st == IMOE_OK && out_shape != NULL) {
    out_shape[0] = gate_up->lead_shape[0];
    out_shape[1] = gate_up->n;
  }
  return st;
}

imoe_status imoe_gated_act_backward(const imoe_view *gate_up, const imoe_view *grad_act, imoe_act act,
                                    const imoe_view *limit, const imoe_view *row_scale,
                                    const imoe_view *grad_gate_up, const imoe_view *act_out,
                                    const imoe_view *row_dot, const imoe_exec *exec, imoe_error *err) {
  int empty;
  imoe_status st =
      check_act_bwd(gate_up, grad_act, act, limit, row_scale, grad_gate_up, act_out, row_dot, &empty, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK || empty) return st;
  if (imoe_on_cuda(exec))
    return imoe_cuda_gated_act_backward(gate_up, grad_act, act, limit, row_scale, grad_gate_up, act_out,
                                        row_dot, exec, err);
  const int64_t r_n = gate_up->lead_shape[0];
  const act_bwd_ctx a = {gate_up, grad_act, row_scale, grad_gate_up, act_out, row_dot,
                         limit_rows(limit, r_n), act};
  const imoe_stage stage = {act_bwd_row, &a, r_n};
  return imoe_run_stages(&stage, 1, 0, imoe_thread_count(exec, r_n * gate_up->n * 6, r_n), err);
}

/* ---- the gather of token rows to assignment rows ---- */

typedef struct gather_ctx {
  const imoe_view *src, *dest, *weights, *out;
} gather_ctx;

static imoe_status gather_token(const void *vctx, int64_t t, unsigned char *mem, imoe_error *err) {
  const gather_ctx *g = vctx;
  (void)mem;
  (void)err;
  const int64_t k = g->dest->n, h_n = g->out->n;
  const imoe_dtype sd = g->src->dtype, od = g->out->dtype;
  const int64_t ss = g->src->row_bytes, os = g->out->row_bytes;
  const char *dest = imoe_row_base(g->dest, t), *src = imoe_row_base(g->src, t);
  for (int64_t j = 0; j < k; j++) {
    const int64_t d = imoe_load_index(dest + j * g->dest->n_stride, g->dest->dtype);
    if (d < 0) continue;
    char *out = imoe_row_base(g->out, d);
    if (g->weights == NULL) {
      for (int64_t h = 0; h < h_n; h++) imoe_store_float(out + h * os, od, imoe_load_float(src + h * ss, sd));
      continue;
    }
    const float w = imoe_load_float(imoe_row_base(g->weights, t) + j * g->weights->n_stride,
                                    g->weights->dtype);
    for (int64_t h = 0; h < h_n; h++) imoe_store_float(out + h * os, od, w * imoe_load_float(src + h * ss, sd));
  }
  return IMOE_OK;
}

imoe_status imoe_moe_gather_rows_shape(const imoe_view *src, const imoe_view *dest,
                                       const imoe_view *weights, int64_t num_rows, int64_t out_shape[2],
                                       imoe_error *err) {
  imoe_status st = imoe_check_matrix(dest, "dest", IMOE_INDEX_DTYPES, -1, -1, 0, 0, err);
  if (st != IMOE_OK) return st;
  const int64_t t_n = dest->lead_shape[0], k = dest->n;
  st = imoe_check_matrix(src, "src", IMOE_SCORE_DTYPES, t_n, -1, 0, 1, err);
  if (st == IMOE_OK && weights != NULL)
    st = imoe_check_matrix(weights, "weights", IMOE_SCORE_DTYPES, t_n, k, 0, 0, err);
  if (st == IMOE_OK && (num_rows < 0 || num_rows > IMOE_MAX_SLOTS)) {
    st = imoe_fail(err, IMOE_ERR_ARGUMENT, "num_rows = %" PRId64 " is outside [0, %" PRId64 "]", num_rows,
                   (int64_t)IMOE_MAX_SLOTS);
  }
  if (st == IMOE_OK && out_shape != NULL) {
    out_shape[0] = num_rows;
    out_shape[1] = src->n;
  }
  return st;
}

imoe_status imoe_moe_gather_rows(const imoe_view *src, const imoe_view *dest, const imoe_view *weights,
                                 const imoe_view *out, const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_moe_gather_rows_shape(src, dest, weights, 0, NULL, err);
  if (st != IMOE_OK) return st;
  const int64_t t_n = dest->lead_shape[0], k = dest->n;
  st = imoe_check_matrix(out, "out", IMOE_SCORE_DTYPES, -1, src->n, 1, 1, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  const int64_t r_n = out->lead_shape[0], h_n = out->n;
  int empty;
  const imoe_call_args call = {NULL, 0, NULL, {src, dest, weights}, {"src", "dest", "weights"},
                               {out}, {"out"}, NULL, 0};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK || t_n * k + r_n * h_n == 0) return st;
  if (imoe_on_cuda(exec)) return imoe_cuda_moe_gather_rows(src, dest, weights, out, exec, err);
  st = check_dest(dest, r_n, err);
  if (st != IMOE_OK || r_n == 0 || h_n == 0) return st;
  /* Each kept dest entry names a row of its own: a repeat would make the
   * result depend on the order of the writes. */
  unsigned char *seen = calloc((size_t)r_n, 1);
  if (seen == NULL) return imoe_fail(err, IMOE_ERR_NO_MEMORY, "moe_gather_rows: %" PRId64 " bytes", r_n);
  for (int64_t t = 0; t < t_n && st == IMOE_OK; t++) {
    const char *d = imoe_row_base(dest, t);
    for (int64_t j = 0; j < k; j++) {
      const int64_t v = imoe_load_index(d + j * dest->n_stride, dest->dtype);
      if (v < 0) continue;
      if (seen[v]) {
        st = imoe_fail(err, IMOE_ERR_INDEX_DUPLICATE,
                       "dest[%" PRId64 ", %" PRId64 "] = %" PRId64 " names a row an earlier entry named",
                       t, j, v);
        break;
      }
      seen[v] = 1;
    }
  }
  if (st == IMOE_OK) {
    /* Rows no assignment names are zero (+0.0). */
    for (int64_t r = 0; r < r_n; r++) {
      if (seen[r]) continue;
      char *row = imoe_row_base(out, r);
      for (int64_t h = 0; h < h_n; h++) imoe_store_float(row + h * out->row_bytes, out->dtype, 0.0f);
    }
  }
  free(seen);
  if (st != IMOE_OK) return st;
  const gather_ctx g = {src, dest, weights, out};
  const imoe_stage stage = {gather_token, &g, t_n};
  return imoe_run_stages(&stage, 1, 0, imoe_thread_count(exec, t_n * k * h_n * 4, t_n), err);
}

/* ---- d(top_k_weights): one dot product per kept assignment ---- */

/* <a, b> over n elements in F32: 32 lane sums, element h to lane h mod 32 in
 * increasing h (product rounded, then added), then p[l] += p[l + s] for
 * l < s, s = 16, 8, 4, 2, 1 (the CUDA kernel's warp reduction). */
static float dot32(const char *a, imoe_dtype ad, int64_t as, const char *b, imoe_dtype bd, int64_t bs,
                   int64_t n) {
  float p[32] = {0};
  for (int64_t h = 0; h < n; h++) p[h & 31] += imoe_load_float(a + h * as, ad) * imoe_load_float(b + h * bs, bd);
  for (int s = 16; s >= 1; s >>= 1)
    for (int l = 0; l < s; l++) p[l] += p[l + s];
  return p[0];
}

typedef struct wgrad_ctx {
  const imoe_view *a, *b, *dest, *out;
  int32_t a_by_row;
} wgrad_ctx;

static imoe_status wgrad_token(const void *vctx, int64_t t, unsigned char *mem, imoe_error *err) {
  const wgrad_ctx *c = vctx;
  (void)mem;
  (void)err;
  const int64_t k = c->dest->n, n = c->b->n;
  const char *dest = imoe_row_base(c->dest, t);
  char *out = imoe_row_base(c->out, t);
  for (int64_t j = 0; j < k; j++) {
    const int64_t d = imoe_load_index(dest + j * c->dest->n_stride, c->dest->dtype);
    float v = 0.0f;
    if (d >= 0) {
      const char *a = imoe_row_base(c->a, c->a_by_row ? d : t);
      v = dot32(a, c->a->dtype, c->a->row_bytes, imoe_row_base(c->b, d), c->b->dtype, c->b->row_bytes, n);
    }
    imoe_store_float(out + j * c->out->n_stride, c->out->dtype, v);
  }
  return IMOE_OK;
}

imoe_status imoe_moe_weight_grad_shape(const imoe_view *a, int32_t a_by_row, const imoe_view *b,
                                       const imoe_view *dest, int64_t out_shape[2], imoe_error *err) {
  imoe_status st = imoe_check_matrix(dest, "dest", IMOE_INDEX_DTYPES, -1, -1, 0, 0, err);
  if (st == IMOE_OK) st = imoe_check_matrix(b, "b", IMOE_SCORE_DTYPES, -1, -1, 0, 1, err);
  if (st != IMOE_OK) return st;
  if (a_by_row != 0 && a_by_row != 1)
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "a_by_row must be 0 or 1, got %d", (int)a_by_row);
  st = imoe_check_matrix(a, "a", IMOE_SCORE_DTYPES, a_by_row ? b->lead_shape[0] : dest->lead_shape[0],
                         b->n, 0, 1, err);
  if (st == IMOE_OK && out_shape != NULL) {
    out_shape[0] = dest->lead_shape[0];
    out_shape[1] = dest->n;
  }
  return st;
}

imoe_status imoe_moe_weight_grad(const imoe_view *a, int32_t a_by_row, const imoe_view *b,
                                 const imoe_view *dest, const imoe_view *out, const imoe_exec *exec,
                                 imoe_error *err) {
  imoe_status st = imoe_moe_weight_grad_shape(a, a_by_row, b, dest, NULL, err);
  if (st != IMOE_OK) return st;
  const int64_t t_n = dest->lead_shape[0], k = dest->n, r_n = b->lead_shape[0];
  st = imoe_check_matrix(out, "out", IMOE_SCORE_DTYPES, t_n, k, 1, 0, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  const imoe_call_args call = {NULL, 0, NULL, {a, b, dest}, {"a", "b", "dest"}, {out}, {"out"}, NULL, 0};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK || t_n == 0 || k == 0) return st;
  if (imoe_on_cuda(exec)) return imoe_cuda_moe_weight_grad(a, a_by_row, b, dest, out, exec, err);
  st = check_dest(dest, r_n, err);
  if (st != IMOE_OK) return st;
  const wgrad_ctx c = {a, b, dest, out, a_by_row};
  const imoe_stage stage = {wgrad_token, &c, t_n};
  return imoe_run_stages(&stage, 1, 0, imoe_thread_count(exec, t_n * k * b->n * 4, t_n), err);
}
