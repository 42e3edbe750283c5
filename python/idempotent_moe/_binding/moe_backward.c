/*
 * moe_backward.c: the MoE backward kernels of the C API
 * (imoe_gated_act_backward, imoe_moe_gather_rows, imoe_moe_weight_grad).
 * As in moe.c, the arguments are converted and imported here and judged by
 * the C core.
 */
#include "binding.h"

static int import_float(imoe_py_call *c, PyObject *obj, const char *name, int written, imoe_view *view) {
  return imoe_py_call_import_typed(c, obj, name, written, FLOAT_DTYPES, FLOAT_NAMES, view);
}

static int import_index(imoe_py_call *c, PyObject *obj, const char *name, imoe_view *view) {
  return imoe_py_call_import_typed(c, obj, name, 0, INDEX_DTYPES, INDEX_NAMES, view);
}

static imoe_py_signature act_bwd_sig = {
    "gated_act_backward", 7, {"gate_up", "grad_act", "out", "act", "limit", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_gated_act_backward) {
  (void)self;
  enum { IN, GRAD, OUT, ACT, LIMIT, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, NULL, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&act_bwd_sig, args, nargs, kwnames, a) < 0) return NULL;
  int act = IMOE_ACT_SILU;
  if (a[ACT] != Py_None && imoe_py_as_option(a[ACT], IMOE_OPTION_ACT, "act", &act) < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view in, grad, out, limit;
  const int has_limit = a[LIMIT] != Py_None;
  if (import_float(c, a[IN], "gate_up", 0, &in) < 0 || import_float(c, a[GRAD], "grad_act", 0, &grad) < 0 ||
      import_float(c, a[OUT], "out", 1, &out) < 0 ||
      (has_limit && import_index(c, a[LIMIT], "limit", &limit) < 0) || imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result,
                 imoe_gated_act_backward(&in, &grad, (imoe_act)act, has_limit ? &limit : NULL, &out,
                                         &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}

static imoe_py_signature gather_sig = {
    "moe_gather_rows", 6, {"src", "dest", "weights", "out", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_moe_gather_rows) {
  (void)self;
  enum { SRC, DEST, WEIGHTS, OUT, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, Py_None, NULL, Py_None, Py_None};
  if (imoe_py_parse(&gather_sig, args, nargs, kwnames, a) < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view src, dest, weights, out;
  const int has_weights = a[WEIGHTS] != Py_None;
  if (import_float(c, a[SRC], "src", 0, &src) < 0 || import_index(c, a[DEST], "dest", &dest) < 0 ||
      (has_weights && import_float(c, a[WEIGHTS], "weights", 0, &weights) < 0) ||
      import_float(c, a[OUT], "out", 1, &out) < 0 || imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result,
                 imoe_moe_gather_rows(&src, &dest, has_weights ? &weights : NULL, &out, &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}

static imoe_py_signature wgrad_sig = {
    "moe_weight_grad", 7, {"a", "b", "dest", "out", "a_by_row", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_moe_weight_grad) {
  (void)self;
  enum { A, B, DEST, OUT, BY_ROW, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, NULL, NULL, Py_False, Py_None, Py_None};
  if (imoe_py_parse(&wgrad_sig, args, nargs, kwnames, a) < 0) return NULL;
  const int by_row = PyObject_IsTrue(a[BY_ROW]);
  if (by_row < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view x, y, dest, out;
  if (import_float(c, a[A], "a", 0, &x) < 0 || import_float(c, a[B], "b", 0, &y) < 0 ||
      import_index(c, a[DEST], "dest", &dest) < 0 || import_float(c, a[OUT], "out", 1, &out) < 0 ||
      imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result, imoe_moe_weight_grad(&x, by_row, &y, &dest, &out, &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}
