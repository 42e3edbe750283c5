/* args.c: argument checks shared by the entry points. They read only the
 * structs the caller passed, never the data behind them. */
#include <inttypes.h>
#include <stdio.h>

#include "imoe_backend.h"
#include "imoe_internal.h"

imoe_status imoe_check_exec(const imoe_exec *exec, imoe_error *err) {
  if (exec == NULL || exec->device == IMOE_DEVICE_CPU) return IMOE_OK;
  if (exec->device == IMOE_DEVICE_CUDA) {
    if (imoe_backend_has_cuda()) return IMOE_OK;
    return imoe_fail(err, IMOE_ERR_UNSUPPORTED,
                     "exec: this build of idempotent_moe has no CUDA support");
  }
  return imoe_fail(err, IMOE_ERR_ARGUMENT, "exec: device %d is not an imoe_device_type",
                   (int)exec->device);
}

imoe_status imoe_check_mode(imoe_mode mode, imoe_error *err) {
  if (mode == IMOE_MODE_SWAP || mode == IMOE_MODE_MOVE) return IMOE_OK;
  return imoe_fail(err, IMOE_ERR_ARGUMENT, "mode: %d is not an imoe_mode", (int)mode);
}

imoe_status imoe_check_order(imoe_order order, int has_scores, imoe_error *err) {
  if (imoe_option_name(IMOE_OPTION_ORDER, (int)order) == NULL) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "order: %d is not an imoe_order", (int)order);
  }
  if (order == IMOE_ORDER_SCORE && !has_scores) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "order='score' needs scores; with active_indices use 'stable' or 'inplace'");
  }
  return IMOE_OK;
}

imoe_status imoe_check_buffers(const imoe_view *buffers, int32_t num_buffers, imoe_error *err) {
  if (buffers == NULL) return imoe_fail(err, IMOE_ERR_ARGUMENT, "buffers is NULL");
  if (num_buffers < 1 || num_buffers > IMOE_MAX_BUFFERS) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "num_buffers %d is outside [1, %d]", (int)num_buffers,
                     IMOE_MAX_BUFFERS);
  }
  for (int32_t b = 0; b < num_buffers; b++) {
    const imoe_view *v = &buffers[b];
    const char *name = imoe_buffer_name(b);
    imoe_status st = imoe_check_view(v, name, err);
    if (st == IMOE_OK) st = imoe_check_writable(v, name, err);
    if (st == IMOE_OK && b > 0) st = imoe_check_same_lead(v, name, &buffers[0], "buffers[0]", err);
    if (st != IMOE_OK) return st;
    if (v->n != buffers[0].n) {
      return imoe_fail(err, IMOE_ERR_ARGUMENT,
                       "%s: n = %" PRId64 " differs from buffers[0] n = %" PRId64, name, v->n,
                       buffers[0].n);
    }
  }
  return IMOE_OK;
}

static imoe_status check_options(const imoe_selection *sel, imoe_error *err) {
  const int64_t c = sel->capacity, p = sel->protected_prefix, w = sel->recent_window;
  if (c < 0) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "capacity is negative (%" PRId64 ")", c);
  }
  if (p < 0) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "protected_prefix is negative (%" PRId64 ")", p);
  }
  if (w < 0) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "recent_window is negative (%" PRId64 ")", w);
  }
  if (p > c || w > c - p) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "protected_prefix %" PRId64 " + recent_window %" PRId64
                     " exceeds capacity %" PRId64,
                     p, w, c);
  }
  if (imoe_option_name(IMOE_OPTION_NAN, (int)sel->nan_policy) == NULL) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "nan_policy %d is not an imoe_nan_policy",
                     (int)sel->nan_policy);
  }
  return imoe_check_order(sel->order, sel->scores != NULL, err);
}

static imoe_status check_scores(const imoe_view *scores, const imoe_view *ref, const char *ref_name,
                                int64_t n, imoe_error *err) {
  imoe_status st = imoe_check_view(scores, "scores", err);
  if (st == IMOE_OK) st = imoe_check_typed(scores, "scores", IMOE_SCORE_DTYPES, err);
  if (st == IMOE_OK) st = imoe_check_same_lead(scores, "scores", ref, ref_name, err);
  if (st == IMOE_OK && scores->n != n) {
    st = imoe_fail(err, IMOE_ERR_ARGUMENT, "scores: n = %" PRId64 " differs from N = %" PRId64,
                   scores->n, n);
  }
  return st;
}

static imoe_status check_active(const imoe_selection *sel, const imoe_view *ref,
                                const char *ref_name, imoe_error *err) {
  const imoe_view *active = sel->active;
  imoe_status st = imoe_check_view(active, "active_indices", err);
  if (st == IMOE_OK) st = imoe_check_typed(active, "active_indices", IMOE_INDEX_DTYPES, err);
  /* lead_ndim 0 is the shared [K] form, valid for any lead shape. */
  if (st == IMOE_OK && active->lead_ndim != 0) {
    st = imoe_check_same_lead(active, "active_indices", ref, ref_name, err);
  }
  if (st != IMOE_OK) return st;
  if (active->n != sel->capacity) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "capacity (%" PRId64 ") must equal the number of active_indices per row (%" PRId64
                     ")",
                     sel->capacity, active->n);
  }
  if (sel->protected_prefix != 0 || sel->recent_window != 0) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "protected_prefix and recent_window must be 0 with active_indices");
  }
  return IMOE_OK;
}

imoe_status imoe_check_selection(const imoe_selection *sel, const imoe_view *ref,
                                 const char *ref_name, int64_t n, int64_t *kept, imoe_error *err) {
  if (sel == NULL) return imoe_fail(err, IMOE_ERR_ARGUMENT, "sel is NULL");
  if ((sel->scores == NULL) == (sel->active == NULL)) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "give exactly one of scores and active_indices");
  }
  imoe_status st = check_options(sel, err);
  if (st != IMOE_OK) return st;
  if (sel->num_slots != 0 && sel->num_slots != n) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "num_slots = %" PRId64 " differs from N = %" PRId64 " of %s", sel->num_slots,
                     n, sel->scores ? "scores" : ref_name);
  }
  st = sel->scores ? check_scores(sel->scores, ref, ref_name, n, err)
                   : check_active(sel, ref, ref_name, err);
  if (st != IMOE_OK) return st;
  *kept = sel->capacity < n ? sel->capacity : n;
  return IMOE_OK;
}

static imoe_status check_output(const imoe_view *v, const char *name, unsigned dtypes,
                                const imoe_view *ref, const char *ref_name, int64_t n,
                                imoe_error *err) {
  imoe_status st = imoe_check_view(v, name, err);
  if (st == IMOE_OK) st = imoe_check_typed(v, name, dtypes, err);
  if (st == IMOE_OK) st = imoe_check_writable(v, name, err);
  if (st == IMOE_OK) st = imoe_check_same_lead(v, name, ref, ref_name, err);
  if (st == IMOE_OK && v->n != n) {
    st = imoe_fail(err, IMOE_ERR_ARGUMENT, "%s: n = %" PRId64 " must be %" PRId64, name, v->n, n);
  }
  return st;
}

imoe_status imoe_check_map_outputs(const imoe_view *indices, const imoe_view *target_map,
                                   const imoe_view *ref, const char *ref_name, int64_t n,
                                   int64_t kept, imoe_error *err) {
  imoe_status st = IMOE_OK;
  if (indices != NULL) {
    st = check_output(indices, "out_indices", IMOE_INDEX_DTYPES, ref, ref_name, kept, err);
  }
  if (st == IMOE_OK && target_map != NULL) {
    st = check_output(target_map, "out_target_map", IMOE_DTYPE_BIT(IMOE_DTYPE_I32), ref, ref_name,
                      n, err);
  }
  return st;
}

imoe_status imoe_check_matrix(const imoe_view *v, const char *name, unsigned dtypes, int64_t rows,
                              int64_t cols, int written, int dense, imoe_error *err) {
  imoe_status st = imoe_check_view(v, name, err);
  if (st == IMOE_OK) st = imoe_check_typed(v, name, dtypes, err);
  if (st == IMOE_OK && written) st = imoe_check_writable(v, name, err);
  if (st != IMOE_OK) return st;
  const int64_t got_rows = v->lead_ndim == 1 ? v->lead_shape[0] : -1;
  if (v->lead_ndim != 1 || (rows >= 0 && got_rows != rows) || (cols >= 0 && v->n != cols)) {
    char r_text[24] = "rows", c_text[24] = "cols";
    if (rows >= 0) snprintf(r_text, sizeof r_text, "%" PRId64, rows);
    if (cols >= 0) snprintf(c_text, sizeof c_text, "%" PRId64, cols);
    if (v->lead_ndim != 1)
      return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s must be [%s, %s], got %d axes", name, r_text,
                       c_text, (int)v->lead_ndim + 1);
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "%s must be [%s, %s], got [%" PRId64 ", %" PRId64 "]", name, r_text, c_text,
                     got_rows, v->n);
  }
  /* An empty matrix has no layout to refuse (NumPy gives it zero strides). */
  if (dense && v->n > 1 && v->lead_shape[0] > 0 && v->n_stride != v->row_bytes) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s: the last axis must be contiguous", name);
  }
  return IMOE_OK;
}
