/*
 * moe.c: the MoE dispatch, combine, gated activation and grouped GEMM of
 * the C API (imoe_moe_dispatch, imoe_moe_combine, imoe_gated_act,
 * imoe_grouped_gemm, imoe_experts_gemm). As in ops.c, the arguments are converted and imported
 * here and judged by the C core. Outputs not given are made by the caller's
 * `new` (binding.h) once the core has judged what the call reads; each
 * function returns its output(s): the ones given, or the ones made.
 */
#include "binding.h"

/* An array of rows: [n, row...] with the row axes as one block of bytes. */
static imoe_import *import_rows(imoe_py_call *c, PyObject *obj, const char *name, int written,
                                imoe_view *view) {
  imoe_import *im = imoe_py_call_import(c, obj, name, written);
  if (im == NULL) return NULL;
  if (im->ndim < 1) {
    PyErr_Format(PyExc_ValueError, "%s must have at least one axis", name);
    return NULL;
  }
  return imoe_py_buffer_view(im, 0, im->ndim - 1, view) < 0 ? NULL : im;
}

static int import_typed(imoe_py_call *c, PyObject *obj, const char *name, int written,
                        unsigned dtypes, const char *names, imoe_view *view) {
  return imoe_py_call_import_typed(c, obj, name, written, dtypes, names, view);
}

/* Hidden rows are moved as bytes, so the core sees their size only: the rows
 * written must be of hidden's dtype too. */
static int check_same_dtype(const imoe_import *hidden, const imoe_import *rows) {
  if (hidden->dtype_code == rows->dtype_code && hidden->dtype_bits == rows->dtype_bits &&
      hidden->dtype_swapped == rows->dtype_swapped)
    return 0;
  char want[64], got[64];
  imoe_py_dtype_name(hidden, want, sizeof want);
  imoe_py_dtype_name(rows, got, sizeof got);
  PyErr_Format(PyExc_TypeError, "out_rows must have hidden's dtype %s, got %s", want, got);
  return -1;
}

static imoe_py_signature dispatch_sig = {
    "moe_dispatch",
    18,
    {"hidden", "top_k_index", "top_k_weights", "num_experts", "capacity", "layout", "skip_foreign",
     "distinct", "out_rows", "out_offsets", "out_dest", "out_src", "out_dropped", "workspace",
     "new_outputs", "new", "num_threads", "stream"}};

static const char *const dispatch_fields[5] = {"out_rows", "out_offsets", "out_dest", "out_src",
                                               "out_dropped"};

IMOE_PY_FASTCALL(imoe_py_moe_dispatch) {
  (void)self;
  enum { HIDDEN, IDS, WEIGHTS, EXPERTS, CAP, LAYOUT, FOREIGN, DISTINCT, ROWS, OFFS, DEST, SRC,
         DROPPED, WS, NEW_OUTS, NEW, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL,    NULL,    Py_None, NULL,    Py_None, Py_None, Py_False,
                        Py_False, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None,
                        Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&dispatch_sig, args, nargs, kwnames, a) < 0) return NULL;
  imoe_moe_routing routing = {NULL, NULL, 0, -1, IMOE_MOE_GROUPED, 0, 0};
  int layout = IMOE_MOE_GROUPED;
  if (imoe_py_as_int64(a[EXPERTS], "num_experts", &routing.num_experts) < 0 ||
      (a[CAP] != Py_None && imoe_py_as_int64(a[CAP], "capacity", &routing.capacity) < 0) ||
      (a[LAYOUT] != Py_None && imoe_py_as_option(a[LAYOUT], IMOE_OPTION_LAYOUT, "layout", &layout) < 0))
    return NULL;
  /* -1 is the C API's dropless; the Python API says None. */
  if (a[CAP] != Py_None && routing.capacity < 0) {
    PyErr_Format(PyExc_ValueError, "capacity must be None (dropless) or >= 0, got %lld",
                 (long long)routing.capacity);
    return NULL;
  }
  routing.layout = (imoe_moe_layout)layout;
  const int foreign = PyObject_IsTrue(a[FOREIGN]), distinct = PyObject_IsTrue(a[DISTINCT]);
  if (foreign < 0 || distinct < 0) return NULL;
  routing.skip_foreign = foreign;
  routing.distinct = distinct;
  const int making = a[NEW_OUTS] != Py_None;
  if (making) {
    if (imoe_py_check_new(a[NEW_OUTS]) < 0) return NULL;
    for (int f = 0; f < 5; ++f) {
      if (a[ROWS + f] != Py_None) {
        PyErr_Format(PyExc_TypeError, "moe_dispatch() takes new_outputs or %s, not both",
                     dispatch_fields[f]);
        return NULL;
      }
    }
  } else {
    for (int f = 0; f < 4; ++f)
      if (a[ROWS + f] == Py_None && imoe_py_check_new_output(Py_None, "moe_dispatch", dispatch_fields[f]) < 0)
        return NULL;
  }
  if (a[NEW] != Py_None && imoe_py_check_new(a[NEW]) < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL, *made = NULL, *ws = NULL;
  imoe_view hidden, ids, weights, rows, offsets, dest, src, dropped;
  const int has_weights = a[WEIGHTS] != Py_None;
  imoe_import *hidden_im = import_rows(c, a[HIDDEN], "hidden", 0, &hidden);
  if (hidden_im == NULL ||
      import_typed(c, a[IDS], "top_k_index", 0, INDEX_DTYPES, INDEX_NAMES, &ids) < 0 ||
      (has_weights &&
       import_typed(c, a[WEIGHTS], "top_k_weights", 0, FLOAT_DTYPES, FLOAT_NAMES, &weights) < 0))
    goto done;
  routing.top_k_index = &ids;
  routing.top_k_weights = has_weights ? &weights : NULL;
  PyObject *out[5] = {a[ROWS], a[OFFS], a[DEST], a[SRC], a[DROPPED]};
  int64_t num_rows = 0;
  if (making || (a[WS] == Py_None && a[NEW] != Py_None)) {
    /* Everything the call reads, judged before anything is made. */
    c->err.message[0] = '\0';
    if (imoe_py_judged(c, imoe_moe_dispatch_rows(&routing, &hidden, &num_rows, &c->err)) < 0 ||
        imoe_py_call_finish(c) < 0)
      goto done;
  }
  if (making) {
    made = PyObject_CallFunction(a[NEW_OUTS], "OLLLL", a[HIDDEN], (long long)routing.num_experts,
                                 (long long)ids.lead_shape[0], (long long)ids.n, (long long)num_rows);
    if (made == NULL) goto done;
    if (!PyTuple_Check(made) || PyTuple_GET_SIZE(made) != 5) {
      PyErr_Format(PyExc_TypeError, "new_outputs must return (rows, offsets, dest, src, dropped), "
                                    "got %.200s", Py_TYPE(made)->tp_name);
      goto done;
    }
    for (int f = 0; f < 5; ++f) out[f] = PyTuple_GET_ITEM(made, f);
  }
  const int has_dropped = out[4] != Py_None;
  imoe_import *rows_im = import_rows(c, out[0], "out_rows", 1, &rows);
  if (rows_im == NULL || check_same_dtype(hidden_im, rows_im) < 0 ||
      import_typed(c, out[1], "out_offsets", 1, INDEX_DTYPES, INDEX_NAMES, &offsets) < 0 ||
      import_typed(c, out[2], "out_dest", 1, INDEX_DTYPES, INDEX_NAMES, &dest) < 0 ||
      import_typed(c, out[3], "out_src", 1, INDEX_DTYPES, INDEX_NAMES, &src) < 0 ||
      (has_dropped &&
       import_typed(c, out[4], "out_dropped", 1, INDEX_DTYPES, INDEX_NAMES, &dropped) < 0) ||
      imoe_py_call_finish(c) < 0)
    goto done;
  PyObject *workspace = a[WS];
  if (workspace == Py_None && a[NEW] != Py_None && c->exec.device == IMOE_DEVICE_CUDA) {
    const int64_t elems =
        imoe_moe_workspace_elems(IMOE_DEVICE_CUDA, ids.lead_shape[0] * ids.n, routing.capacity);
    if (elems > 0) {
      ws = imoe_py_call_new_array(c, a[NEW], a[HIDDEN], &elems, 1, "int32");
      if (ws == NULL) goto done;
      workspace = ws;
    }
  }
  if (imoe_py_call_import_workspace(c, workspace) < 0 || imoe_py_call_finish(c) < 0) goto done;
  IMOE_PY_CALL_C(c, result,
                 imoe_moe_dispatch(&routing, &hidden, &rows, &offsets, &dest, &src,
                                   has_dropped ? &dropped : NULL, c->workspace, c->workspace_elems,
                                   &c->exec, &c->err));
  if (result != NULL && made != NULL) {
    Py_DECREF(result);
    result = made;
    made = NULL;
  }
done:
  imoe_py_call_free(c);
  Py_XDECREF(made);
  Py_XDECREF(ws);
  return result;
}

static imoe_py_signature combine_sig = {
    "moe_combine", 8, {"rows", "dest", "weights", "out", "out_dtype", "new", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_moe_combine) {
  (void)self;
  enum { ROWS, DEST, WEIGHTS, OUT, DTYPE, NEW, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, NULL, Py_None, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&combine_sig, args, nargs, kwnames, a) < 0) return NULL;
  const char *dtype;
  if (imoe_py_as_dtype(a[DTYPE], IMOE_OPTION_FLOAT, "out_dtype", &dtype) < 0) return NULL;
  if (a[OUT] == Py_None && imoe_py_check_new_output(a[NEW], "moe_combine", "out") < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL, *out = imoe_py_given(a[OUT]);
  imoe_view rows, dest, weights, outv;
  if (import_typed(c, a[ROWS], "rows", 0, FLOAT_DTYPES, FLOAT_NAMES, &rows) < 0 ||
      import_typed(c, a[DEST], "dest", 0, INDEX_DTYPES, INDEX_NAMES, &dest) < 0 ||
      import_typed(c, a[WEIGHTS], "weights", 0, FLOAT_DTYPES, FLOAT_NAMES, &weights) < 0)
    goto done;
  if (out == NULL) {
    int64_t shape[2];
    c->err.message[0] = '\0';
    if (imoe_py_judged(c, imoe_moe_combine_shape(&rows, &dest, &weights, shape, &c->err)) < 0 ||
        (out = imoe_py_call_new_array(c, a[NEW], a[ROWS], shape, 2, dtype)) == NULL)
      goto done;
  }
  if (import_typed(c, out, "out", 1, FLOAT_DTYPES, FLOAT_NAMES, &outv) < 0 ||
      imoe_py_check_out_dtype(&outv, "out", IMOE_OPTION_FLOAT, dtype, "out_dtype") < 0 ||
      imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result, imoe_moe_combine(&rows, &dest, &weights, &outv, &c->exec, &c->err));
  result = imoe_py_returning(result, &out);
done:
  imoe_py_call_free(c);
  Py_XDECREF(out);
  return result;
}

static imoe_py_signature act_sig = {
    "gated_act", 7, {"gate_up", "out", "act", "limit", "new", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_gated_act) {
  (void)self;
  enum { IN, OUT, ACT, LIMIT, NEW, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&act_sig, args, nargs, kwnames, a) < 0) return NULL;
  int act = IMOE_ACT_SILU;
  if (a[ACT] != Py_None && imoe_py_as_option(a[ACT], IMOE_OPTION_ACT, "act", &act) < 0) return NULL;
  if (a[OUT] == Py_None && imoe_py_check_new_output(a[NEW], "gated_act", "out") < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL, *out = imoe_py_given(a[OUT]);
  imoe_view in, outv, limit;
  const int has_limit = a[LIMIT] != Py_None;
  if (import_typed(c, a[IN], "gate_up", 0, FLOAT_DTYPES, FLOAT_NAMES, &in) < 0 ||
      (has_limit && import_typed(c, a[LIMIT], "limit", 0, INDEX_DTYPES, INDEX_NAMES, &limit) < 0))
    goto done;
  if (out == NULL) {
    int64_t shape[2];
    c->err.message[0] = '\0';
    if (imoe_py_judged(c, imoe_gated_act_shape(&in, (imoe_act)act, has_limit ? &limit : NULL, shape,
                                       &c->err)) < 0 ||
        (out = imoe_py_call_new_array(c, a[NEW], a[IN], shape, 2, NULL)) == NULL)
      goto done;
  }
  if (import_typed(c, out, "out", 1, FLOAT_DTYPES, FLOAT_NAMES, &outv) < 0 ||
      imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result,
                 imoe_gated_act(&in, &outv, (imoe_act)act, has_limit ? &limit : NULL, &c->exec,
                                &c->err));
  result = imoe_py_returning(result, &out);
done:
  imoe_py_call_free(c);
  Py_XDECREF(out);
  return result;
}

static imoe_py_signature gemm_sig = {
    "grouped_gemm", 7, {"a", "w", "offsets", "out", "new", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_grouped_gemm) {
  (void)self;
  enum { A, W, OFFS, OUT, NEW, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, NULL, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&gemm_sig, args, nargs, kwnames, a) < 0) return NULL;
  if (a[OUT] == Py_None && imoe_py_check_new_output(a[NEW], "grouped_gemm", "out") < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL, *out = imoe_py_given(a[OUT]);
  imoe_view x, w, offsets, outv;
  if (import_typed(c, a[A], "a", 0, FLOAT_DTYPES, FLOAT_NAMES, &x) < 0 ||
      import_typed(c, a[W], "w", 0, FLOAT_DTYPES, FLOAT_NAMES, &w) < 0 ||
      import_typed(c, a[OFFS], "offsets", 0, INDEX_DTYPES, INDEX_NAMES, &offsets) < 0)
    goto done;
  if (out == NULL) {
    int64_t shape[2];
    c->err.message[0] = '\0';
    if (imoe_py_judged(c, imoe_grouped_gemm_shape(&x, &w, &offsets, shape, &c->err)) < 0 ||
        (out = imoe_py_call_new_array(c, a[NEW], a[A], shape, 2, NULL)) == NULL)
      goto done;
  }
  if (import_typed(c, out, "out", 1, FLOAT_DTYPES, FLOAT_NAMES, &outv) < 0 ||
      imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result, imoe_grouped_gemm(&x, &w, &offsets, &outv, &c->exec, &c->err));
  result = imoe_py_returning(result, &out);
done:
  imoe_py_call_free(c);
  Py_XDECREF(out);
  return result;
}

static imoe_py_signature experts_gemm_sig = {
    "experts_gemm", 9, {"x", "w", "offsets", "src", "act", "out", "new", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_experts_gemm) {
  (void)self;
  enum { X, W, OFFS, SRC, ACT, OUT, NEW, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, NULL, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&experts_gemm_sig, args, nargs, kwnames, a) < 0) return NULL;
  int act = IMOE_ACT_SILU;
  const int gated = a[ACT] != Py_None;
  if (gated && imoe_py_as_option(a[ACT], IMOE_OPTION_ACT, "act", &act) < 0) return NULL;
  if (a[OUT] == Py_None && imoe_py_check_new_output(a[NEW], "experts_gemm", "out") < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL, *out = imoe_py_given(a[OUT]);
  imoe_view x, w, offsets, src, outv;
  const int has_src = a[SRC] != Py_None;
  if (import_typed(c, a[X], "x", 0, FLOAT_DTYPES, FLOAT_NAMES, &x) < 0 ||
      import_typed(c, a[W], "w", 0, FLOAT_DTYPES, FLOAT_NAMES, &w) < 0 ||
      import_typed(c, a[OFFS], "offsets", 0, INDEX_DTYPES, INDEX_NAMES, &offsets) < 0 ||
      (has_src && import_typed(c, a[SRC], "src", 0, INDEX_DTYPES, INDEX_NAMES, &src) < 0))
    goto done;
  if (out == NULL) {
    int64_t shape[2];
    c->err.message[0] = '\0';
    if (imoe_py_judged(c, imoe_experts_gemm_shape(&x, has_src ? &src : NULL, &w, &offsets, gated,
                                                  (imoe_act)act, shape, &c->err)) < 0 ||
        (out = imoe_py_call_new_array(c, a[NEW], a[X], shape, 2, NULL)) == NULL)
      goto done;
  }
  if (import_typed(c, out, "out", 1, FLOAT_DTYPES, FLOAT_NAMES, &outv) < 0 ||
      imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result,
                 imoe_experts_gemm(&x, has_src ? &src : NULL, &w, &offsets, gated, (imoe_act)act, &outv,
                                   &c->exec, &c->err));
  result = imoe_py_returning(result, &out);
done:
  imoe_py_call_free(c);
  Py_XDECREF(out);
  return result;
}
