/*
 * permute.c: the binding of the permutation engine: permute, apply_ordered,
 * compact_ordered, build_map_ordered and group_by_expert.
 *
 * Same shape as module.c: parse, import every array (the written ones
 * checked for self-overlap and against each other), build the views, call
 * the C API with the GIL released, release every import on every path. The
 * small call helpers mirror module.c's, which are static there.
 */
#include "permute.h"

#include <stdio.h>
#include <string.h>

#define FLOAT_DTYPES                                                 \
  (IMOE_DTYPE_BIT(IMOE_DTYPE_F32) | IMOE_DTYPE_BIT(IMOE_DTYPE_F16) | \
   IMOE_DTYPE_BIT(IMOE_DTYPE_BF16))
#define FLOAT_NAMES "float32, float16 or bfloat16"
#define INDEX_DTYPES (IMOE_DTYPE_BIT(IMOE_DTYPE_I32) | IMOE_DTYPE_BIT(IMOE_DTYPE_I64))
#define INDEX_NAMES "int32 or int64"

typedef struct pcall {
  imoe_imports imports;
  imoe_view buffers[IMOE_MAX_BUFFERS];
  int32_t num_buffers;
  const imoe_import *written[IMOE_MAX_IMPORTS];
  int num_written;
  PyObject *sequences[3];
  int32_t *workspace; /* the caller's plan workspace, or NULL */
  int64_t workspace_elems;
  int32_t threads;
  imoe_exec exec;
} pcall;

static pcall *pcall_new(PyObject *stream) {
  pcall *c = PyMem_Malloc(sizeof *c);
  if (c == NULL) return (pcall *)PyErr_NoMemory();
  c->imports.count = 0;
  c->imports.stream = Py_None;
  c->num_buffers = 0;
  c->num_written = 0;
  c->workspace = NULL;
  c->workspace_elems = 0;
  c->threads = 0;
  for (int i = 0; i < 3; ++i) c->sequences[i] = NULL;
  if (imoe_py_check_stream(stream) < 0) {
    PyMem_Free(c);
    return NULL;
  }
  c->imports.stream = stream;
  return c;
}

static void pcall_free(pcall *c) {
  if (c == NULL) return;
  imoe_py_release_imports(&c->imports);
  for (int i = 0; i < 3; ++i) Py_XDECREF(c->sequences[i]);
  PyMem_Free(c);
}

static int set_threads(pcall *c, long long num_threads) {
  if (num_threads > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "num_threads must be at most %d, got %lld", INT32_MAX,
                 num_threads);
    return -1;
  }
  c->threads = num_threads < 0 ? 0 : (int32_t)num_threads;
  return 0;
}

static imoe_import *import_one(pcall *c, PyObject *obj, const char *name, int written) {
  imoe_import *im = imoe_py_import_array(&c->imports, obj, name, written);
  if (im == NULL) return NULL;
  if (written) {
    if (imoe_py_check_no_self_overlap(im) < 0) return NULL;
    c->written[c->num_written++] = im;
  }
  return im;
}

static int import_typed(pcall *c, PyObject *obj, const char *name, int written, unsigned accepted,
                        const char *accepted_names, imoe_view *view) {
  imoe_import *im = import_one(c, obj, name, written);
  if (im == NULL) return -1;
  return imoe_py_typed_view(im, accepted, accepted_names, view);
}

static PyObject *hold_sequence(pcall *c, int slot, PyObject *obj, const char *name,
                               const char *of) {
  if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of %s, got %.200s", name, of,
                 Py_TYPE(obj)->tp_name);
    return NULL;
  }
  c->sequences[slot] = PySequence_Tuple(obj);
  return c->sequences[slot];
}

static int int_item(PyObject *tuple, Py_ssize_t i, const char *name, int64_t *out) {
  PyObject *item = PyTuple_GET_ITEM(tuple, i);
  if (!PyIndex_Check(item)) {
    PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int, got %.200s", name, i,
                 Py_TYPE(item)->tp_name);
    return -1;
  }
  Py_ssize_t value = PyNumber_AsSsize_t(item, PyExc_OverflowError);
  if (value == -1 && PyErr_Occurred()) return -1;
  *out = (int64_t)value;
  return 0;
}

/* buffers[b] as [lead..., N, row_b] views sharing lead shape and N. */
static int import_buffers(pcall *c, PyObject *buffers, PyObject *dims, PyObject *row_ndims) {
  PyObject *bufs = hold_sequence(c, 0, buffers, "buffers", "arrays");
  if (bufs == NULL) return -1;
  PyObject *dim_tuple = hold_sequence(c, 1, dims, "dims", "ints");
  if (dim_tuple == NULL) return -1;
  PyObject *row_tuple = hold_sequence(c, 2, row_ndims, "row_ndims", "ints");
  if (row_tuple == NULL) return -1;
  Py_ssize_t count = PyTuple_GET_SIZE(bufs);
  if (count < 1 || count > IMOE_MAX_BUFFERS) {
    PyErr_Format(PyExc_ValueError, "buffers must hold 1 to %d arrays, got %zd", IMOE_MAX_BUFFERS,
                 count);
    return -1;
  }
  if (PyTuple_GET_SIZE(dim_tuple) != count || PyTuple_GET_SIZE(row_tuple) != count) {
    PyErr_Format(PyExc_ValueError,
                 "dims and row_ndims must have one entry per buffer (%zd), got %zd and %zd", count,
                 PyTuple_GET_SIZE(dim_tuple), PyTuple_GET_SIZE(row_tuple));
    return -1;
  }
  for (Py_ssize_t b = 0; b < count; ++b) {
    int64_t dim, rows;
    if (int_item(dim_tuple, b, "dims", &dim) < 0 || int_item(row_tuple, b, "row_ndims", &rows) < 0)
      return -1;
    char name[32];
    snprintf(name, sizeof name, "buffers[%zd]", b);
    imoe_import *im = import_one(c, PyTuple_GET_ITEM(bufs, b), name, 1);
    if (im == NULL) return -1;
    if (rows < 0 || dim < 0 || dim + rows >= im->ndim) {
      PyErr_Format(PyExc_ValueError,
                   "%s: the slot axis dims[%zd] = %lld must come before its row axes, the last "
                   "row_ndims[%zd] = %lld of its %d axes",
                   name, b, (long long)dim, b, (long long)rows, (int)im->ndim);
      return -1;
    }
    if (imoe_py_buffer_view(im, dim, rows, &c->buffers[b]) < 0) return -1;
    if (b > 0 && imoe_py_expect_same_rows(&c->buffers[b], name, &c->buffers[0], "buffers[0]") < 0)
      return -1;
  }
  c->num_buffers = (int32_t)count;
  return 0;
}

/* The plan workspace: None, or a C-contiguous int32 array of any shape. */
static int import_workspace(pcall *c, PyObject *obj) {
  if (obj == Py_None) return 0;
  imoe_import *im = import_one(c, obj, "workspace", 1);
  if (im == NULL) return -1;
  if (im->dtype != IMOE_DTYPE_I32) {
    PyErr_Format(PyExc_TypeError, "workspace must have dtype int32, got %s", im->dtype_name);
    return -1;
  }
  int64_t expected = im->itemsize, elems = 1;
  for (int i = im->ndim - 1; i >= 0; --i) {
    if (im->shape[i] != 1 && im->strides[i] != expected) {
      PyErr_SetString(PyExc_ValueError, "workspace must be C-contiguous");
      return -1;
    }
    expected *= im->shape[i];
    elems *= im->shape[i];
  }
  if ((uintptr_t)im->data % 4 != 0) {
    PyErr_SetString(PyExc_ValueError, "workspace is not aligned to its 4-byte elements");
    return -1;
  }
  c->workspace = (int32_t *)(void *)im->data;
  c->workspace_elems = elems;
  if (elems == 0 && c->workspace == NULL) c->workspace = (int32_t *)(void *)&c->workspace_elems;
  return 0;
}

static int finish(pcall *c) {
  if (imoe_py_check_distinct_outputs(c->written, c->num_written) < 0) return -1;
  return imoe_py_exec_for(&c->imports, c->threads, &c->exec);
}

/* A status to an exception: not built on CUDA yet is NotImplementedError. */
static PyObject *done_with(imoe_status status, const imoe_error *err) {
  if (status == IMOE_ERR_UNSUPPORTED) {
    PyErr_SetString(PyExc_NotImplementedError,
                    err->message[0] ? err->message : imoe_status_string(status));
    return NULL;
  }
  if (status != IMOE_OK) return imoe_py_raise_status(status, err);
  Py_RETURN_NONE;
}

static int import_selection(pcall *c, PyObject *scores, PyObject *active, long long capacity,
                            long long prefix, long long window, int nan_lowest, imoe_view *view,
                            imoe_selection *sel) {
  if ((scores == Py_None) == (active == Py_None)) {
    PyErr_SetString(PyExc_ValueError, "exactly one of scores and active_indices must be given");
    return -1;
  }
  if (capacity < 0 || prefix < 0 || window < 0) {
    PyErr_Format(PyExc_ValueError,
                 "capacity, protected_prefix and recent_window must be >= 0, got %lld, %lld and "
                 "%lld",
                 capacity, prefix, window);
    return -1;
  }
  memset(sel, 0, sizeof *sel);
  sel->capacity = capacity;
  sel->protected_prefix = prefix;
  sel->recent_window = window;
  sel->nan_policy = nan_lowest ? IMOE_NAN_LOWEST : IMOE_NAN_ERROR;
  if (scores != Py_None) {
    sel->scores = view;
    return import_typed(c, scores, "scores", 0, FLOAT_DTYPES, FLOAT_NAMES, view);
  }
  sel->active = view;
  return import_typed(c, active, "active_indices", 0, INDEX_DTYPES, INDEX_NAMES, view);
}

/* ---- the functions ---- */

PyObject *imoe_py_permute(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *buffers, *dims, *row_ndims, *perm, *workspace, *stream = Py_None;
  int inverse;
  long long num_threads;
  if (!PyArg_ParseTuple(args, "OOOOpOL|O:permute", &buffers, &dims, &row_ndims, &perm, &inverse,
                        &workspace, &num_threads, &stream))
    return NULL;
  PyObject *result = NULL;
  pcall *c = pcall_new(stream);
  if (c == NULL) return NULL;
  imoe_view map;
  if (set_threads(c, num_threads) < 0 || import_buffers(c, buffers, dims, row_ndims) < 0 ||
      import_typed(c, perm, "perm", 0, INDEX_DTYPES, INDEX_NAMES, &map) < 0 ||
      import_workspace(c, workspace) < 0 || finish(c) < 0)
    goto done;
  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  status = imoe_permute(c->buffers, c->num_buffers, &map, inverse, c->workspace,
                        c->workspace_elems, &c->exec, &err);
  Py_END_ALLOW_THREADS
  result = done_with(status, &err);
done:
  pcall_free(c);
  return result;
}

PyObject *imoe_py_apply_ordered(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *buffers, *dims, *row_ndims, *indices, *workspace, *stream = Py_None;
  int mode, restore;
  long long num_threads;
  if (!PyArg_ParseTuple(args, "OOOOipOL|O:apply_ordered", &buffers, &dims, &row_ndims, &indices,
                        &mode, &restore, &workspace, &num_threads, &stream))
    return NULL;
  PyObject *result = NULL;
  pcall *c = pcall_new(stream);
  if (c == NULL) return NULL;
  imoe_view map;
  if (set_threads(c, num_threads) < 0 || import_buffers(c, buffers, dims, row_ndims) < 0 ||
      import_typed(c, indices, "indices", 0, INDEX_DTYPES, INDEX_NAMES, &map) < 0 ||
      import_workspace(c, workspace) < 0 || finish(c) < 0)
    goto done;
  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  if (restore) {
    status = imoe_restore_ordered(c->buffers, c->num_buffers, &map, c->workspace,
                                  c->workspace_elems, &c->exec, &err);
  } else {
    status = imoe_apply_ordered(c->buffers, c->num_buffers, &map, (imoe_mode)mode, c->workspace,
                                c->workspace_elems, &c->exec, &err);
  }
  Py_END_ALLOW_THREADS
  result = done_with(status, &err);
done:
  pcall_free(c);
  return result;
}

PyObject *imoe_py_compact_ordered(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *buffers, *dims, *row_ndims, *scores, *active, *out_indices, *workspace;
  PyObject *stream = Py_None;
  long long capacity, prefix, window, num_threads;
  int nan_lowest, mode, order;
  if (!PyArg_ParseTuple(args, "OOOOOOLLLpiiOL|O:compact_ordered", &buffers, &dims, &row_ndims,
                        &scores, &active, &out_indices, &capacity, &prefix, &window, &nan_lowest,
                        &mode, &order, &workspace, &num_threads, &stream))
    return NULL;
  PyObject *result = NULL;
  pcall *c = pcall_new(stream);
  if (c == NULL) return NULL;
  imoe_view sel_view, idx;
  imoe_selection sel;
  if (set_threads(c, num_threads) < 0 || import_buffers(c, buffers, dims, row_ndims) < 0 ||
      import_selection(c, scores, active, capacity, prefix, window, nan_lowest, &sel_view, &sel) <
          0 ||
      import_typed(c, out_indices, "out_indices", 1, INDEX_DTYPES, INDEX_NAMES, &idx) < 0 ||
      import_workspace(c, workspace) < 0 || finish(c) < 0)
    goto done;
  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  status = imoe_compact_ordered(c->buffers, c->num_buffers, &sel, (imoe_order)order, &idx, NULL,
                                (imoe_mode)mode, c->workspace, c->workspace_elems, &c->exec, &err);
  Py_END_ALLOW_THREADS
  result = done_with(status, &err);
done:
  pcall_free(c);
  return result;
}

PyObject *imoe_py_build_map_ordered(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *scores, *active, *out_indices, *stream = Py_None;
  long long n, capacity, prefix, window, num_threads;
  int nan_lowest, order;
  if (!PyArg_ParseTuple(args, "OOOLLLLpiL|O:build_map_ordered", &scores, &active, &out_indices,
                        &n, &capacity, &prefix, &window, &nan_lowest, &order, &num_threads,
                        &stream))
    return NULL;
  PyObject *result = NULL;
  pcall *c = pcall_new(stream);
  if (c == NULL) return NULL;
  imoe_view sel_view, idx;
  imoe_selection sel;
  if (set_threads(c, num_threads) < 0 ||
      import_selection(c, scores, active, capacity, prefix, window, nan_lowest, &sel_view, &sel) <
          0 ||
      import_typed(c, out_indices, "out_indices", 1, INDEX_DTYPES, INDEX_NAMES, &idx) < 0 ||
      finish(c) < 0)
    goto done;
  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  status = imoe_build_map_ordered(&sel, (imoe_order)order, n, &idx, NULL, &c->exec, &err);
  Py_END_ALLOW_THREADS
  result = done_with(status, &err);
done:
  pcall_free(c);
  return result;
}

PyObject *imoe_py_group_by_expert(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *buffers, *dims, *row_ndims, *ids, *out_offsets, *out_perm, *workspace;
  PyObject *stream = Py_None;
  long long num_experts, num_threads;
  if (!PyArg_ParseTuple(args, "OOOOLOOOL|O:group_by_expert", &buffers, &dims, &row_ndims, &ids,
                        &num_experts, &out_offsets, &out_perm, &workspace, &num_threads, &stream))
    return NULL;
  PyObject *result = NULL;
  pcall *c = pcall_new(stream);
  if (c == NULL) return NULL;
  imoe_view ids_view, offsets, perm;
  const int has_perm = out_perm != Py_None;
  if (set_threads(c, num_threads) < 0 || import_buffers(c, buffers, dims, row_ndims) < 0 ||
      import_typed(c, ids, "expert_ids", 0, INDEX_DTYPES, INDEX_NAMES, &ids_view) < 0 ||
      import_typed(c, out_offsets, "out_offsets", 1, INDEX_DTYPES, INDEX_NAMES, &offsets) < 0 ||
      (has_perm &&
       import_typed(c, out_perm, "out_perm", 1, INDEX_DTYPES, INDEX_NAMES, &perm) < 0) ||
      import_workspace(c, workspace) < 0 || finish(c) < 0)
    goto done;
  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  status = imoe_group_by_expert(c->buffers, c->num_buffers, &ids_view, num_experts, &offsets,
                                has_perm ? &perm : NULL, c->workspace, c->workspace_elems,
                                &c->exec, &err);
  Py_END_ALLOW_THREADS
  result = done_with(status, &err);
done:
  pcall_free(c);
  return result;
}
