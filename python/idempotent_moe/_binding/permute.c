/*
 * permute.c: the binding of the permutation engine: permute, apply_ordered,
 * compact_ordered, build_map_ordered and group_by_expert.
 *
 * Same shape as module.c: parse, import every array (the written ones
 * checked for self-overlap and against each other), build the views, call
 * the C API with the GIL released, release every import on every path. The
 * per-call helpers are call.c's.
 */
#include "permute.h"

#include <string.h>

#define FLOAT_DTYPES                                                 \
  (IMOE_DTYPE_BIT(IMOE_DTYPE_F32) | IMOE_DTYPE_BIT(IMOE_DTYPE_F16) | \
   IMOE_DTYPE_BIT(IMOE_DTYPE_BF16))
#define FLOAT_NAMES "float32, float16 or bfloat16"
#define INDEX_DTYPES (IMOE_DTYPE_BIT(IMOE_DTYPE_I32) | IMOE_DTYPE_BIT(IMOE_DTYPE_I64))
#define INDEX_NAMES "int32 or int64"

/* A status to an exception: what the CUDA path does not take (grouping with
 * more than 1024 experts) is NotImplementedError. */
static PyObject *done_with(imoe_status status, const imoe_error *err) {
  if (status == IMOE_ERR_UNSUPPORTED) {
    PyErr_SetString(PyExc_NotImplementedError,
                    err->message[0] ? err->message : imoe_status_string(status));
    return NULL;
  }
  if (status != IMOE_OK) return imoe_py_raise_status(status, err);
  Py_RETURN_NONE;
}

static int import_selection(imoe_py_call *c, PyObject *scores, PyObject *active, long long capacity,
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
    return imoe_py_call_import_typed(c, scores, "scores", 0, FLOAT_DTYPES, FLOAT_NAMES, view);
  }
  sel->active = view;
  return imoe_py_call_import_typed(c, active, "active_indices", 0, INDEX_DTYPES, INDEX_NAMES, view);
}

/* Buffers, one index map over their slots and the plan workspace: the
 * arguments of permute and apply_ordered, imported and checked. */
static int import_buffers_and_map(imoe_py_call *c, PyObject *buffers, PyObject *dims,
                                  PyObject *row_ndims, PyObject *map_obj, const char *map_name,
                                  PyObject *workspace, imoe_view *map) {
  if (imoe_py_call_import_buffers(c, buffers, dims, row_ndims) < 0 ||
      imoe_py_call_import_typed(c, map_obj, map_name, 0, INDEX_DTYPES, INDEX_NAMES, map) < 0 ||
      imoe_py_call_import_workspace(c, workspace) < 0)
    return -1;
  return imoe_py_call_finish(c);
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
  imoe_py_call *c = imoe_py_call_new(stream, num_threads);
  if (c == NULL) return NULL;
  imoe_view map;
  if (import_buffers_and_map(c, buffers, dims, row_ndims, perm, "perm", workspace, &map) < 0)
    goto done;
  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  status = imoe_permute(c->buffers, c->num_buffers, &map, inverse, c->workspace,
                        c->workspace_elems, &c->exec, &err);
  Py_END_ALLOW_THREADS
  result = done_with(status, &err);
done:
  imoe_py_call_free(c);
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
  imoe_py_call *c = imoe_py_call_new(stream, num_threads);
  if (c == NULL) return NULL;
  imoe_view map;
  if (import_buffers_and_map(c, buffers, dims, row_ndims, indices, "indices", workspace, &map) < 0)
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
  imoe_py_call_free(c);
  return result;
}

/* The rest of an ordered selection's arguments, after any buffers: the
 * selection, out_indices and the workspace; then the call's checks. */
static int import_ordered_selection(imoe_py_call *c, PyObject *scores, PyObject *active,
                                    long long capacity, long long prefix, long long window,
                                    int nan_lowest, PyObject *out_indices, PyObject *workspace,
                                    imoe_view *sel_view, imoe_selection *sel, imoe_view *idx) {
  if (import_selection(c, scores, active, capacity, prefix, window, nan_lowest, sel_view, sel) < 0 ||
      imoe_py_call_import_typed(c, out_indices, "out_indices", 1, INDEX_DTYPES, INDEX_NAMES, idx) <
          0 ||
      imoe_py_call_import_workspace(c, workspace) < 0 || imoe_py_call_finish(c) < 0)
    return -1;
  return 0;
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
  imoe_py_call *c = imoe_py_call_new(stream, num_threads);
  if (c == NULL) return NULL;
  imoe_view sel_view, idx;
  imoe_selection sel;
  if (imoe_py_call_import_buffers(c, buffers, dims, row_ndims) < 0 ||
      import_ordered_selection(c, scores, active, capacity, prefix, window, nan_lowest,
                               out_indices, workspace, &sel_view, &sel, &idx) < 0)
    goto done;
  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  status = imoe_compact_ordered(c->buffers, c->num_buffers, &sel, (imoe_order)order, &idx, NULL,
                                (imoe_mode)mode, c->workspace, c->workspace_elems, &c->exec, &err);
  Py_END_ALLOW_THREADS
  result = done_with(status, &err);
done:
  imoe_py_call_free(c);
  return result;
}

PyObject *imoe_py_build_map_ordered(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *scores, *active, *out_indices, *workspace, *stream = Py_None;
  long long n, capacity, prefix, window, num_threads;
  int nan_lowest, order;
  if (!PyArg_ParseTuple(args, "OOOLLLLpiOL|O:build_map_ordered", &scores, &active, &out_indices,
                        &n, &capacity, &prefix, &window, &nan_lowest, &order, &workspace,
                        &num_threads, &stream))
    return NULL;
  PyObject *result = NULL;
  imoe_py_call *c = imoe_py_call_new(stream, num_threads);
  if (c == NULL) return NULL;
  imoe_view sel_view, idx;
  imoe_selection sel;
  if (import_ordered_selection(c, scores, active, capacity, prefix, window, nan_lowest,
                               out_indices, workspace, &sel_view, &sel, &idx) < 0)
    goto done;
  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  status = imoe_build_map_ordered(&sel, (imoe_order)order, n, &idx, NULL, c->workspace,
                                  c->workspace_elems, &c->exec, &err);
  Py_END_ALLOW_THREADS
  result = done_with(status, &err);
done:
  imoe_py_call_free(c);
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
  imoe_py_call *c = imoe_py_call_new(stream, num_threads);
  if (c == NULL) return NULL;
  imoe_view ids_view, offsets, perm;
  const int has_perm = out_perm != Py_None;
  if (imoe_py_call_import_buffers(c, buffers, dims, row_ndims) < 0 ||
      imoe_py_call_import_typed(c, ids, "expert_ids", 0, INDEX_DTYPES, INDEX_NAMES,
                                &ids_view) < 0 ||
      imoe_py_call_import_typed(c, out_offsets, "out_offsets", 1, INDEX_DTYPES, INDEX_NAMES,
                                &offsets) < 0 ||
      (has_perm && imoe_py_call_import_typed(c, out_perm, "out_perm", 1, INDEX_DTYPES, INDEX_NAMES,
                                             &perm) < 0) ||
      imoe_py_call_import_workspace(c, workspace) < 0 || imoe_py_call_finish(c) < 0)
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
  imoe_py_call_free(c);
  return result;
}
