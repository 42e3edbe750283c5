/*
 * moe_backward.c: the MoE backward kernels of the C API
 * (imoe_gated_act_backward, imoe_moe_gather_rows, imoe_moe_weight_grad).
 * As in moe.c, the arguments are converted and imported here and judged by
 * the C core, and an output not given is made by `new` once the core has
 * judged what the call reads; each function returns its output.
 */
#include "binding.h"

static int import_float(imoe_py_call *c, PyObject *obj, const char *name, int written, imoe_view *view) {
  return imoe_py_call_import_typed(c, obj, name, written, FLOAT_DTYPES, FLOAT_NAMES, view);
}

static int import_index(imoe_py_call *c, PyObject *obj, const char *name, imoe_view *view) {
  return imoe_py_call_import_typed(c, obj, name, 0, INDEX_DTYPES, INDEX_NAMES, view);
}

static imoe_py_signature act_bwd_sig = {
    "gated_act_backward",
    11,
    {"gate_up", "grad_act", "out", "act", "limit", "row_scale", "act_out", "row_dot", "new", "num_threads",
     "stream"}};

IMOE_PY_FASTCALL(imoe_py_gated_act_backward) {
  (void)self;
  enum { IN, GRAD, OUT, ACT, LIMIT, SCALE, ACT_OUT, DOT, NEW, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None,
                        Py_None};
  if (imoe_py_parse(&act_bwd_sig, args, nargs, kwnames, a) < 0) return NULL;
  int act = IMOE_ACT_SILU;
  if (a[ACT] != Py_None && imoe_py_as_option(a[ACT], IMOE_OPTION_ACT, "act", &act) < 0) return NULL;
  if (a[OUT] == Py_None && imoe_py_check_new_output(a[NEW], "gated_act_backward", "out") < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL, *out = imoe_py_given(a[OUT]);
  imoe_view in, grad, outv, limit, scale, act_out, dot;
  const int has_limit = a[LIMIT] != Py_None, has_scale = a[SCALE] != Py_None;
  const int has_act_out = a[ACT_OUT] != Py_None, has_dot = a[DOT] != Py_None;
  /* act_out may be grad_act itself (the core tells the two apart). */
  if (import_float(c, a[IN], "gate_up", 0, &in) < 0 || import_float(c, a[GRAD], "grad_act", 0, &grad) < 0 ||
      (has_limit && import_index(c, a[LIMIT], "limit", &limit) < 0) ||
      (has_scale && import_float(c, a[SCALE], "row_scale", 0, &scale) < 0) ||
      (has_act_out && import_float(c, a[ACT_OUT], "act_out", 1, &act_out) < 0) ||
      (has_dot && import_float(c, a[DOT], "row_dot", 1, &dot) < 0))
    goto done;
  if (out == NULL) {
    int64_t shape[2];
    c->err.message[0] = '\0';
    if (imoe_py_judged(c, imoe_gated_act_backward_shape(&in, &grad, (imoe_act)act, has_limit ? &limit : NULL,
                                                        has_scale ? &scale : NULL, has_act_out ? &act_out : NULL,
                                                        has_dot ? &dot : NULL, shape, &c->err)) < 0 ||
        (out = imoe_py_call_new_array(c, a[NEW], a[IN], shape, 2, NULL)) == NULL)
      goto done;
  }
  if (import_float(c, out, "out", 1, &outv) < 0 || imoe_py_call_finish(c) < 0) goto done;
  IMOE_PY_CALL_C(c, result,
                 imoe_gated_act_backward(&in, &grad, (imoe_act)act, has_limit ? &limit : NULL,
                                         has_scale ? &scale : NULL, &outv, has_act_out ? &act_out : NULL,
                                         has_dot ? &dot : NULL, &c->exec, &c->err));
  result = imoe_py_returning(result, &out);
done:
  imoe_py_call_free(c);
  Py_XDECREF(out);
  return result;
}

static imoe_py_signature gather_sig = {
    "moe_gather_rows",
    9,
    {"src", "dest", "weights", "out", "num_rows", "out_dtype", "new", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_moe_gather_rows) {
  (void)self;
  enum { SRC, DEST, WEIGHTS, OUT, ROWS, DTYPE, NEW, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&gather_sig, args, nargs, kwnames, a) < 0) return NULL;
  const char *dtype;
  int64_t num_rows = 0;
  if (imoe_py_as_dtype(a[DTYPE], IMOE_OPTION_FLOAT, "out_dtype", &dtype) < 0) return NULL;
  if (a[OUT] == Py_None) {
    if (imoe_py_check_new_output(a[NEW], "moe_gather_rows", "out") < 0) return NULL;
    if (a[ROWS] == Py_None) {
      PyErr_SetString(PyExc_TypeError, "moe_gather_rows() needs num_rows to make out");
      return NULL;
    }
  }
  if (a[ROWS] != Py_None && imoe_py_as_int64(a[ROWS], "num_rows", &num_rows) < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL, *out = imoe_py_given(a[OUT]);
  imoe_view src, dest, weights, outv;
  const int has_weights = a[WEIGHTS] != Py_None;
  if (import_float(c, a[SRC], "src", 0, &src) < 0 || import_index(c, a[DEST], "dest", &dest) < 0 ||
      (has_weights && import_float(c, a[WEIGHTS], "weights", 0, &weights) < 0))
    goto done;
  int64_t shape[2] = {-1, -1};
  if (a[ROWS] != Py_None) {
    c->err.message[0] = '\0';
    if (imoe_py_judged(c, imoe_moe_gather_rows_shape(&src, &dest, has_weights ? &weights : NULL, num_rows,
                                                     shape, &c->err)) < 0)
      goto done;
  }
  if (out == NULL && (out = imoe_py_call_new_array(c, a[NEW], a[SRC], shape, 2, dtype)) == NULL) goto done;
  if (import_float(c, out, "out", 1, &outv) < 0 ||
      imoe_py_check_out_dtype(&outv, "out", IMOE_OPTION_FLOAT, dtype, "out_dtype") < 0 ||
      imoe_py_call_finish(c) < 0)
    goto done;
  if (a[ROWS] != Py_None && outv.lead_ndim == 1 && outv.lead_shape[0] != num_rows) {
    PyErr_Format(PyExc_ValueError, "out must be [num_rows = %lld, H = %lld], got [%lld, %lld]",
                 (long long)num_rows, (long long)shape[1], (long long)outv.lead_shape[0],
                 (long long)outv.n);
    goto done;
  }
  IMOE_PY_CALL_C(c, result,
                 imoe_moe_gather_rows(&src, &dest, has_weights ? &weights : NULL, &outv, &c->exec, &c->err));
  result = imoe_py_returning(result, &out);
done:
  imoe_py_call_free(c);
  Py_XDECREF(out);
  return result;
}

static imoe_py_signature wgrad_sig = {
    "moe_weight_grad",
    9,
    {"a", "b", "dest", "out", "a_by_row", "out_dtype", "new", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_moe_weight_grad) {
  (void)self;
  enum { A, B, DEST, OUT, BY_ROW, DTYPE, NEW, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, NULL, Py_None, Py_False, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&wgrad_sig, args, nargs, kwnames, a) < 0) return NULL;
  const int by_row = PyObject_IsTrue(a[BY_ROW]);
  if (by_row < 0) return NULL;
  const char *dtype;
  if (imoe_py_as_dtype(a[DTYPE], IMOE_OPTION_FLOAT, "out_dtype", &dtype) < 0) return NULL;
  if (a[OUT] == Py_None && imoe_py_check_new_output(a[NEW], "moe_weight_grad", "out") < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL, *out = imoe_py_given(a[OUT]);
  imoe_view x, y, dest, outv;
  if (import_float(c, a[A], "a", 0, &x) < 0 || import_float(c, a[B], "b", 0, &y) < 0 ||
      import_index(c, a[DEST], "dest", &dest) < 0)
    goto done;
  if (out == NULL) {
    int64_t shape[2];
    c->err.message[0] = '\0';
    if (imoe_py_judged(c, imoe_moe_weight_grad_shape(&x, by_row, &y, &dest, shape, &c->err)) < 0 ||
        (out = imoe_py_call_new_array(c, a[NEW], a[A], shape, 2, dtype)) == NULL)
      goto done;
  }
  if (import_float(c, out, "out", 1, &outv) < 0 ||
      imoe_py_check_out_dtype(&outv, "out", IMOE_OPTION_FLOAT, dtype, "out_dtype") < 0 ||
      imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result, imoe_moe_weight_grad(&x, by_row, &y, &dest, &outv, &c->exec, &c->err));
  result = imoe_py_returning(result, &out);
done:
  imoe_py_call_free(c);
  Py_XDECREF(out);
  return result;
}
