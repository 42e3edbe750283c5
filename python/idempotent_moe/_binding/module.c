/*
 * module.c: the extension module idempotent_moe._C.
 *
 * Each function parses its positional arguments, imports every array,
 * builds and checks the views (messages name the Python argument), then calls
 * the C API with the GIL released. Every import is released on every path by
 * imoe_py_call_free (call.c).
 */
#include "binding.h"
#include "permute.h"

#define PY_ARRAY_UNIQUE_SYMBOL IMOE_ARRAY_API
#include <numpy/arrayobject.h>

#include <stdio.h>
#include <string.h>

#define FLOAT_DTYPES                                                 \
  (IMOE_DTYPE_BIT(IMOE_DTYPE_F32) | IMOE_DTYPE_BIT(IMOE_DTYPE_F16) | \
   IMOE_DTYPE_BIT(IMOE_DTYPE_BF16))
#define FLOAT_NAMES "float32, float16 or bfloat16"
#define INDEX_DTYPES (IMOE_DTYPE_BIT(IMOE_DTYPE_I32) | IMOE_DTYPE_BIT(IMOE_DTYPE_I64))
#define INDEX_NAMES "int32 or int64"

/* ---- scalar arguments ---- */

static int check_mode(int mode) {
  if (mode == IMOE_MODE_SWAP || mode == IMOE_MODE_MOVE) return 0;
  PyErr_Format(PyExc_ValueError, "mode must be 0 (swap) or 1 (move), got %d", mode);
  return -1;
}

typedef struct selection_args {
  PyObject *scores, *active;
  long long capacity, prefix, window;
  int nan_lowest;
} selection_args;

/* The checks that need no array: done before any capsule is consumed. */
static int check_selection_args(const selection_args *a) {
  if ((a->scores == Py_None) == (a->active == Py_None)) {
    PyErr_SetString(PyExc_ValueError, "exactly one of scores and active_indices must be given");
    return -1;
  }
  if (a->capacity < 0) {
    PyErr_Format(PyExc_ValueError, "capacity must be >= 0, got %lld", a->capacity);
    return -1;
  }
  if (a->prefix < 0 || a->window < 0) {
    PyErr_Format(PyExc_ValueError, "%s must be >= 0, got %lld",
                 a->prefix < 0 ? "protected_prefix" : "recent_window",
                 a->prefix < 0 ? a->prefix : a->window);
    return -1;
  }
  if (a->scores != Py_None && a->prefix > a->capacity - a->window) {
    PyErr_Format(PyExc_ValueError,
                 "protected_prefix (%lld) + recent_window (%lld) must not exceed capacity (%lld)",
                 a->prefix, a->window, a->capacity);
    return -1;
  }
  if (a->active != Py_None && (a->prefix != 0 || a->window != 0)) {
    PyErr_Format(PyExc_ValueError,
                 "protected_prefix and recent_window must be 0 with active_indices, got %lld "
                 "and %lld",
                 a->prefix, a->window);
    return -1;
  }
  return 0;
}

/* ---- arrays ---- */

/* scores or active_indices into sel (view holds the imoe_view it points to). */
static int import_selection(imoe_py_call *c, const selection_args *a, imoe_view *view,
                            imoe_selection *sel) {
  memset(sel, 0, sizeof *sel);
  sel->capacity = a->capacity;
  sel->protected_prefix = a->prefix;
  sel->recent_window = a->window;
  sel->nan_policy = a->nan_lowest ? IMOE_NAN_LOWEST : IMOE_NAN_ERROR;
  if (a->scores != Py_None) {
    sel->scores = view;
    return imoe_py_call_import_typed(c, a->scores, "scores", 0, FLOAT_DTYPES, FLOAT_NAMES, view);
  }
  sel->active = view;
  if (imoe_py_call_import_typed(c, a->active, "active_indices", 0, INDEX_DTYPES, INDEX_NAMES,
                                view) < 0)
    return -1;
  if (view->n != a->capacity) {
    PyErr_Format(PyExc_ValueError,
                 "capacity (%lld) must equal the number of active_indices per row (%lld)",
                 a->capacity, (long long)view->n);
    return -1;
  }
  return 0;
}

/* The selection against rows (the reference lead shape) and N (< 0: unknown). */
static int check_selection_rows(const imoe_selection *sel, const imoe_view *rows, int64_t n,
                                const char *rows_name) {
  char rule[128];
  if (sel->scores != NULL) {
    snprintf(rule, sizeof rule, "the lead shape of %s + (N,)", rows_name);
    return imoe_py_expect_shape(sel->scores, "scores", rows, n, rule);
  }
  const imoe_view *active = sel->active;
  snprintf(rule, sizeof rule, "(K,) shared by all rows, or the lead shape of %s + (K,)", rows_name);
  if (active->lead_ndim > 0 &&
      imoe_py_expect_shape(active, "active_indices", rows, active->n, rule) < 0)
    return -1;
  if (n >= 0 && active->n > n) {
    PyErr_Format(PyExc_ValueError, "active_indices has %lld entries per row, more than N = %lld",
                 (long long)active->n, (long long)n);
    return -1;
  }
  return 0;
}

static int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

static PyObject *done_with(imoe_status status, const imoe_error *err) {
  if (status != IMOE_OK) return imoe_py_raise_status(status, err);
  Py_RETURN_NONE;
}

/* ---- the functions ---- */

static PyObject *py_compact(PyObject *self, PyObject *args) {
  (void)self;
  selection_args sa;
  PyObject *buffers, *dims, *row_ndims, *out_indices, *out_target_map;
  int mode;
  long long num_threads;
  PyObject *stream = Py_None;
  if (!PyArg_ParseTuple(args, "OOOOOOOLLLpiL|O:compact", &buffers, &dims, &row_ndims, &sa.scores,
                        &sa.active, &out_indices, &out_target_map, &sa.capacity, &sa.prefix,
                        &sa.window, &sa.nan_lowest, &mode, &num_threads, &stream))
    return NULL;
  if (check_mode(mode) < 0 || check_selection_args(&sa) < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(stream, num_threads);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view sel_view, idx, map;
  imoe_selection sel;
  int has_map = out_target_map != Py_None;
  if (imoe_py_call_import_buffers(c, buffers, dims, row_ndims) < 0 ||
      import_selection(c, &sa, &sel_view, &sel) < 0 ||
      imoe_py_call_import_typed(c, out_indices, "out_indices", 1, INDEX_DTYPES, INDEX_NAMES,
                                &idx) < 0 ||
      (has_map && imoe_py_call_import_typed(c, out_target_map, "out_target_map", 1,
                                            IMOE_DTYPE_BIT(IMOE_DTYPE_I32), "int32", &map) < 0))
    goto done;
  if (imoe_py_call_finish(c) < 0) goto done;

  const imoe_view *rows = &c->buffers[0];
  if (check_selection_rows(&sel, rows, rows->n, "the buffers") < 0 ||
      imoe_py_expect_shape(&idx, "out_indices", rows, min64(sa.capacity, rows->n),
                           "the lead shape of the buffers + (min(capacity, N),)") < 0 ||
      (has_map && imoe_py_expect_shape(&map, "out_target_map", rows, rows->n,
                                       "the lead shape of the buffers + (N,)") < 0))
    goto done;

  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  status = imoe_compact(c->buffers, c->num_buffers, &sel, &idx, has_map ? &map : NULL,
                        (imoe_mode)mode, &c->exec, &err);
  Py_END_ALLOW_THREADS
  result = done_with(status, &err);
done:
  imoe_py_call_free(c);
  return result;
}

static PyObject *py_build_map(PyObject *self, PyObject *args) {
  (void)self;
  selection_args sa;
  PyObject *out_indices, *out_target_map;
  long long num_threads;
  PyObject *stream = Py_None;
  if (!PyArg_ParseTuple(args, "OOOOLLLpL|O:build_map", &sa.scores, &sa.active, &out_indices,
                        &out_target_map, &sa.capacity, &sa.prefix, &sa.window, &sa.nan_lowest,
                        &num_threads, &stream))
    return NULL;
  if (check_selection_args(&sa) < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(stream, num_threads);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view sel_view, idx, map;
  imoe_selection sel;
  int has_idx = out_indices != Py_None, has_map = out_target_map != Py_None;
  if (!has_idx && !has_map) {
    PyErr_SetString(PyExc_ValueError, "out_indices, out_target_map or both must be given");
    goto done;
  }
  if (import_selection(c, &sa, &sel_view, &sel) < 0 ||
      (has_idx && imoe_py_call_import_typed(c, out_indices, "out_indices", 1, INDEX_DTYPES,
                                            INDEX_NAMES, &idx) < 0) ||
      (has_map && imoe_py_call_import_typed(c, out_target_map, "out_target_map", 1,
                                            IMOE_DTYPE_BIT(IMOE_DTYPE_I32), "int32", &map) < 0))
    goto done;
  if (imoe_py_call_finish(c) < 0) goto done;

  /* The lead shape comes from the selection, or from the outputs when
   * active_indices is one [K] shared by all rows; N from scores or the map. */
  const imoe_view *rows;
  const char *rows_name;
  int64_t n = -1;
  if (sel.scores != NULL || sel.active->lead_ndim > 0) {
    rows = &sel_view;
    rows_name = sel.scores != NULL ? "scores" : "active_indices";
  } else {
    rows = has_idx ? &idx : &map;
    rows_name = has_idx ? "out_indices" : "out_target_map";
  }
  if (sel.scores != NULL)
    n = sel_view.n;
  else if (has_map)
    n = map.n;

  char rule[128];
  if (check_selection_rows(&sel, rows, n, rows_name) < 0) goto done;
  if (has_idx) {
    int64_t kept = sel.scores != NULL ? min64(sa.capacity, n) : sa.capacity;
    snprintf(rule, sizeof rule, "the lead shape of %s + (%s,)", rows_name,
             sel.scores != NULL ? "min(capacity, N)" : "capacity");
    if (imoe_py_expect_shape(&idx, "out_indices", rows, kept, rule) < 0) goto done;
  }
  if (has_map) {
    snprintf(rule, sizeof rule, "the lead shape of %s + (N,)", rows_name);
    if (imoe_py_expect_shape(&map, "out_target_map", rows, n, rule) < 0) goto done;
  }

  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  status = imoe_build_map(&sel, has_idx ? &idx : NULL, has_map ? &map : NULL, &c->exec, &err);
  Py_END_ALLOW_THREADS
  result = done_with(status, &err);
done:
  imoe_py_call_free(c);
  return result;
}

enum apply_kind { APPLY_INDICES, APPLY_TARGET_MAP, RESTORE };

/* apply_indices, apply_target_map and restore: buffers and one map. */
static PyObject *apply(enum apply_kind kind, PyObject *buffers, PyObject *dims, PyObject *row_ndims,
                       PyObject *map_obj, int mode, long long num_threads, PyObject *stream) {
  if (check_mode(mode) < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(stream, num_threads);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  const char *map_name = kind == APPLY_TARGET_MAP ? "target_map" : "indices";
  imoe_view map;
  if (imoe_py_call_import_buffers(c, buffers, dims, row_ndims) < 0 ||
      imoe_py_call_import_typed(c, map_obj, map_name, 0, INDEX_DTYPES, INDEX_NAMES, &map) < 0)
    goto done;
  if (imoe_py_call_finish(c) < 0) goto done;

  const imoe_view *rows = &c->buffers[0];
  if (kind == APPLY_TARGET_MAP) {
    if (imoe_py_expect_shape(&map, map_name, rows, rows->n,
                             "the lead shape of the buffers + (N,)") < 0)
      goto done;
  } else {
    if (imoe_py_expect_shape(&map, map_name, rows, map.n, "the lead shape of the buffers + (C',)") <
        0)
      goto done;
    if (map.n > rows->n) {
      PyErr_Format(PyExc_ValueError,
                   "indices has %lld entries per row, more than the N = %lld of the buffers",
                   (long long)map.n, (long long)rows->n);
      goto done;
    }
  }

  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  switch (kind) {
    case APPLY_INDICES:
      status =
          imoe_apply_indices(c->buffers, c->num_buffers, &map, (imoe_mode)mode, &c->exec, &err);
      break;
    case APPLY_TARGET_MAP:
      status =
          imoe_apply_target_map(c->buffers, c->num_buffers, &map, (imoe_mode)mode, &c->exec, &err);
      break;
    default: status = imoe_restore(c->buffers, c->num_buffers, &map, &c->exec, &err); break;
  }
  Py_END_ALLOW_THREADS
  result = done_with(status, &err);
done:
  imoe_py_call_free(c);
  return result;
}

static PyObject *py_apply_indices(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *buffers, *dims, *row_ndims, *indices;
  int mode;
  long long num_threads;
  PyObject *stream = Py_None;
  if (!PyArg_ParseTuple(args, "OOOOiL|O:apply_indices", &buffers, &dims, &row_ndims, &indices,
                        &mode, &num_threads, &stream))
    return NULL;
  return apply(APPLY_INDICES, buffers, dims, row_ndims, indices, mode, num_threads, stream);
}

static PyObject *py_apply_target_map(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *buffers, *dims, *row_ndims, *target_map;
  int mode;
  long long num_threads;
  PyObject *stream = Py_None;
  if (!PyArg_ParseTuple(args, "OOOOiL|O:apply_target_map", &buffers, &dims, &row_ndims,
                        &target_map, &mode, &num_threads, &stream))
    return NULL;
  return apply(APPLY_TARGET_MAP, buffers, dims, row_ndims, target_map, mode, num_threads, stream);
}

static PyObject *py_restore(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *buffers, *dims, *row_ndims, *indices;
  long long num_threads;
  PyObject *stream = Py_None;
  if (!PyArg_ParseTuple(args, "OOOOL|O:restore", &buffers, &dims, &row_ndims, &indices,
                        &num_threads, &stream))
    return NULL;
  return apply(RESTORE, buffers, dims, row_ndims, indices, IMOE_MODE_SWAP, num_threads, stream);
}

/* take_device_status(device_id, stream) -> int: the recorded imoe_status. */
static PyObject *py_take_device_status(PyObject *self, PyObject *args) {
  (void)self;
  int device_id;
  PyObject *stream = Py_None;
  if (!PyArg_ParseTuple(args, "i|O:take_device_status", &device_id, &stream)) return NULL;
  if (imoe_py_check_stream(stream) < 0) return NULL;
  imoe_exec exec = {IMOE_DEVICE_CUDA, device_id, 0, imoe_py_stream_handle(stream)};
  imoe_error err = {{0}};
  imoe_status recorded = IMOE_OK, status;
  Py_BEGIN_ALLOW_THREADS
  status = imoe_take_device_status(&exec, &recorded, &err);
  Py_END_ALLOW_THREADS
  if (status != IMOE_OK) return imoe_py_raise_status(status, &err);
  return PyLong_FromLong((long)recorded);
}

/* status_message(code) -> str: the library's description of a status code. */
static PyObject *py_status_message(PyObject *self, PyObject *args) {
  (void)self;
  int code;
  if (!PyArg_ParseTuple(args, "i:status_message", &code)) return NULL;
  return PyUnicode_FromString(imoe_status_string((imoe_status)code));
}

static PyObject *py_plan_workspace_elems(PyObject *self, PyObject *args) {
  (void)self;
  int kind, cuda;
  long long rows, n;
  if (!PyArg_ParseTuple(args, "iiLL:plan_workspace_elems", &kind, &cuda, &rows, &n)) return NULL;
  if (kind < IMOE_PLAN_PERMUTE || kind > IMOE_PLAN_GROUP) {
    PyErr_Format(PyExc_ValueError, "plan kind %d is not 0 (permute), 1 (ordered) or 2 (group)", kind);
    return NULL;
  }
  const int64_t elems = imoe_plan_workspace_elems(
      (imoe_plan_kind)kind, cuda ? IMOE_DEVICE_CUDA : IMOE_DEVICE_CPU, (int64_t)rows, (int64_t)n);
  if (elems < 0) {
    PyErr_Format(PyExc_ValueError, "a plan workspace for %lld rows of %lld slots is too large", rows, n);
    return NULL;
  }
  return PyLong_FromLongLong((long long)elems);
}

static PyObject *py_cuda_compiled(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyBool_FromLong(imoe_cuda_compiled());
}

/* ---- the module ---- */

static PyMethodDef methods[] = {
    {"compact", py_compact, METH_VARARGS,
     "compact(buffers, dims, row_ndims, scores, active, out_indices, out_target_map, capacity, "
     "protected_prefix, recent_window, nan_lowest, mode, num_threads, stream=None) -> None\n\n"
     "Select, build the map into out_indices (and out_target_map) and apply it to every "
     "buffer in place."},
    {"build_map", py_build_map, METH_VARARGS,
     "build_map(scores, active, out_indices, out_target_map, capacity, protected_prefix, "
     "recent_window, nan_lowest, num_threads, stream=None) -> None\n\n"
     "Select and write the idempotent map; no buffer is touched."},
    {"apply_indices", py_apply_indices, METH_VARARGS,
     "apply_indices(buffers, dims, row_ndims, indices, mode, num_threads, stream=None) -> None\n\n"
     "Apply an [lead..., C'] index map to every buffer in place."},
    {"apply_target_map", py_apply_target_map, METH_VARARGS,
     "apply_target_map(buffers, dims, row_ndims, target_map, mode, num_threads, stream=None) -> None\n\n"
     "Apply an [lead..., N] involution to every buffer in place."},
    {"restore", py_restore, METH_VARARGS,
     "restore(buffers, dims, row_ndims, indices, num_threads, stream=None) -> None\n\n"
     "Undo a swap compaction in place."},
    {"paged_apply_target_map", imoe_py_paged_apply_target_map, METH_VARARGS,
     "paged_apply_target_map(buffers, dims, row_ndims, block_tables, target_map, mode, "
     "num_threads, stream=None, workspace=None) -> None\n\nApply per-sequence involutions to "
     "paged pools through their block tables, in place (binding in paged.c). workspace: int32, "
     "at least num_blocks + S x max_blocks + 512 elements, required on CUDA."},
    {"take_device_status", py_take_device_status, METH_VARARGS,
     "take_device_status(device_id, stream=None) -> int\n\n"
     "Synchronise the stream and return (and clear) the status of a data error that an "
     "earlier CUDA call recorded on the device (0: none)."},
    {"status_message", py_status_message, METH_VARARGS,
     "status_message(code) -> str\n\nThe description of an imoe_status code."},
    {"plan_workspace_elems", py_plan_workspace_elems, METH_VARARGS,
     "plan_workspace_elems(kind, cuda, rows, n) -> int\n\n"
     "The int32 elements of the plan workspace of a permutation call (kind 0 permute, "
     "1 ordered, 2 group) for rows x n slots on CUDA (cuda true) or the CPU."},
    {"cuda_compiled", py_cuda_compiled, METH_NOARGS,
     "cuda_compiled() -> bool\n\nWhether this build has the CUDA launchers."},
    IMOE_PERMUTE_METHODS
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "idempotent_moe._C",
    .m_doc = "The CPython binding of idempotent-moe: DLPack and NumPy arrays in, the C API out.",
    .m_size = -1,
    .m_methods = methods,
};

#define IMOE_STR_(x) #x
#define IMOE_STR(x) IMOE_STR_(x)
#define IMOE_VERSION_STRING \
  IMOE_STR(IMOE_VERSION_MAJOR) "." IMOE_STR(IMOE_VERSION_MINOR) "." IMOE_STR(IMOE_VERSION_PATCH)

PyMODINIT_FUNC PyInit__C(void) {
  import_array();
  PyObject *module = PyModule_Create(&module_def);
  if (module == NULL) return NULL;
  if (PyModule_AddStringConstant(module, "__version__", IMOE_VERSION_STRING) < 0) {
    Py_DECREF(module);
    return NULL;
  }
  return module;
}
