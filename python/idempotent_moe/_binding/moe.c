/*
 * moe.c: the MoE dispatch, combine, gated activation and grouped GEMM of
 * the C API (imoe_moe_dispatch, imoe_moe_combine, imoe_gated_act,
 * imoe_grouped_gemm). As in ops.c, the
 * arguments are converted and imported here and judged by the C core.
 */
#include "binding.h"


/* An array of rows: [n, row...] with the row axes as one block of bytes. */
static int import_rows(imoe_py_call *c, PyObject *obj, const char *name, int written,
                       imoe_view *view) {
  imoe_import *im = imoe_py_call_import(c, obj, name, written);
  if (im == NULL) return -1;
  if (im->ndim < 1) {
    PyErr_Format(PyExc_ValueError, "%s must have at least one axis", name);
    return -1;
  }
  return imoe_py_buffer_view(im, 0, im->ndim - 1, view);
}

static int import_typed(imoe_py_call *c, PyObject *obj, const char *name, int written,
                        unsigned dtypes, const char *names, imoe_view *view) {
  return imoe_py_call_import_typed(c, obj, name, written, dtypes, names, view);
}

static imoe_py_signature dispatch_sig = {
    "moe_dispatch",
    15,
    {"hidden", "top_k_index", "top_k_weights", "num_experts", "capacity", "layout", "skip_foreign",
     "out_rows", "out_offsets", "out_dest", "out_src", "out_dropped", "workspace", "num_threads",
     "stream"}};

IMOE_PY_FASTCALL(imoe_py_moe_dispatch) {
  (void)self;
  enum { HIDDEN, IDS, WEIGHTS, EXPERTS, CAP, LAYOUT, FOREIGN, ROWS, OFFS, DEST, SRC, DROPPED, WS,
         THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, Py_None, NULL, Py_None, Py_None, Py_False, NULL,
                        NULL, NULL, NULL,    Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&dispatch_sig, args, nargs, kwnames, a) < 0) return NULL;
  imoe_moe_routing routing = {NULL, NULL, 0, -1, IMOE_MOE_GROUPED, 0};
  int layout = IMOE_MOE_GROUPED;
  if (imoe_py_as_int64(a[EXPERTS], "num_experts", &routing.num_experts) < 0 ||
      (a[CAP] != Py_None && imoe_py_as_int64(a[CAP], "capacity", &routing.capacity) < 0) ||
      (a[LAYOUT] != Py_None && imoe_py_as_option(a[LAYOUT], IMOE_OPTION_LAYOUT, "layout", &layout) < 0))
    return NULL;
  routing.layout = (imoe_moe_layout)layout;
  const int foreign = PyObject_IsTrue(a[FOREIGN]);
  if (foreign < 0) return NULL;
  routing.skip_foreign = foreign;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view hidden, ids, weights, rows, offsets, dest, src, dropped;
  const int has_weights = a[WEIGHTS] != Py_None, has_dropped = a[DROPPED] != Py_None;
  if (import_rows(c, a[HIDDEN], "hidden", 0, &hidden) < 0 ||
      import_typed(c, a[IDS], "top_k_index", 0, INDEX_DTYPES, INDEX_NAMES, &ids) < 0 ||
      (has_weights &&
       import_typed(c, a[WEIGHTS], "top_k_weights", 0, FLOAT_DTYPES, FLOAT_NAMES, &weights) < 0) ||
      import_rows(c, a[ROWS], "out_rows", 1, &rows) < 0 ||
      import_typed(c, a[OFFS], "out_offsets", 1, INDEX_DTYPES, INDEX_NAMES, &offsets) < 0 ||
      import_typed(c, a[DEST], "out_dest", 1, INDEX_DTYPES, INDEX_NAMES, &dest) < 0 ||
      import_typed(c, a[SRC], "out_src", 1, INDEX_DTYPES, INDEX_NAMES, &src) < 0 ||
      (has_dropped &&
       import_typed(c, a[DROPPED], "out_dropped", 1, INDEX_DTYPES, INDEX_NAMES, &dropped) < 0) ||
      imoe_py_call_import_workspace(c, a[WS]) < 0 || imoe_py_call_finish(c) < 0)
    goto done;
  routing.top_k_index = &ids;
  routing.top_k_weights = has_weights ? &weights : NULL;
  IMOE_PY_CALL_C(c, result,
                 imoe_moe_dispatch(&routing, &hidden, &rows, &offsets, &dest, &src,
                                   has_dropped ? &dropped : NULL, c->workspace, c->workspace_elems,
                                   &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}

static imoe_py_signature combine_sig = {
    "moe_combine", 6, {"rows", "dest", "weights", "out", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_moe_combine) {
  (void)self;
  enum { ROWS, DEST, WEIGHTS, OUT, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, NULL, NULL, Py_None, Py_None};
  if (imoe_py_parse(&combine_sig, args, nargs, kwnames, a) < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view rows, dest, weights, out;
  if (import_typed(c, a[ROWS], "rows", 0, FLOAT_DTYPES, FLOAT_NAMES, &rows) < 0 ||
      import_typed(c, a[DEST], "dest", 0, INDEX_DTYPES, INDEX_NAMES, &dest) < 0 ||
      import_typed(c, a[WEIGHTS], "weights", 0, FLOAT_DTYPES, FLOAT_NAMES, &weights) < 0 ||
      import_typed(c, a[OUT], "out", 1, FLOAT_DTYPES, FLOAT_NAMES, &out) < 0 ||
      imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result, imoe_moe_combine(&rows, &dest, &weights, &out, &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}

static imoe_py_signature act_sig = {
    "gated_act", 6, {"gate_up", "out", "act", "limit", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_gated_act) {
  (void)self;
  enum { IN, OUT, ACT, LIMIT, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&act_sig, args, nargs, kwnames, a) < 0) return NULL;
  int act = IMOE_ACT_SILU;
  if (a[ACT] != Py_None && imoe_py_as_option(a[ACT], IMOE_OPTION_ACT, "act", &act) < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view in, out, limit;
  const int has_limit = a[LIMIT] != Py_None;
  if (import_typed(c, a[IN], "gate_up", 0, FLOAT_DTYPES, FLOAT_NAMES, &in) < 0 ||
      import_typed(c, a[OUT], "out", 1, FLOAT_DTYPES, FLOAT_NAMES, &out) < 0 ||
      (has_limit && import_typed(c, a[LIMIT], "limit", 0, INDEX_DTYPES, INDEX_NAMES, &limit) < 0) ||
      imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result,
                 imoe_gated_act(&in, &out, (imoe_act)act, has_limit ? &limit : NULL, &c->exec,
                                &c->err));
done:
  imoe_py_call_free(c);
  return result;
}

static imoe_py_signature gemm_sig = {
    "grouped_gemm", 6, {"a", "w", "offsets", "out", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_grouped_gemm) {
  (void)self;
  enum { A, W, OFFS, OUT, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, NULL, NULL, Py_None, Py_None};
  if (imoe_py_parse(&gemm_sig, args, nargs, kwnames, a) < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view x, w, offsets, out;
  if (import_typed(c, a[A], "a", 0, FLOAT_DTYPES, FLOAT_NAMES, &x) < 0 ||
      import_typed(c, a[W], "w", 0, FLOAT_DTYPES, FLOAT_NAMES, &w) < 0 ||
      import_typed(c, a[OFFS], "offsets", 0, INDEX_DTYPES, INDEX_NAMES, &offsets) < 0 ||
      import_typed(c, a[OUT], "out", 1, FLOAT_DTYPES, FLOAT_NAMES, &out) < 0 ||
      imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result, imoe_grouped_gemm(&x, &w, &offsets, &out, &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}
