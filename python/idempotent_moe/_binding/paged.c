/*
 * paged.c: paged_apply_target_map, the binding of imoe_paged_apply_target_map
 * (compaction through block tables; csrc/paged.c). Registered in module.c's
 * method table; imports and views come from import.c and views.c.
 */
#include "binding.h"

#include <stdio.h>
#include <string.h>

#define INDEX_DTYPES (IMOE_DTYPE_BIT(IMOE_DTYPE_I32) | IMOE_DTYPE_BIT(IMOE_DTYPE_I64))
#define INDEX_NAMES "int32 or int64"

typedef struct paged_call {
  imoe_imports imports;
  imoe_view pools[IMOE_MAX_BUFFERS];
  const imoe_import *written[IMOE_MAX_BUFFERS];
  PyObject *held[3]; /* tuples of buffers, dims and row_ndims */
} paged_call;

static PyObject *as_tuple(paged_call *c, int slot, PyObject *obj, const char *name) {
  if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s must be a list or tuple, got %.200s", name,
                 Py_TYPE(obj)->tp_name);
    return NULL;
  }
  c->held[slot] = PySequence_Tuple(obj);
  return c->held[slot];
}

static int int_at(PyObject *tuple, Py_ssize_t i, const char *name, int64_t *out) {
  Py_ssize_t value = PyNumber_AsSsize_t(PyTuple_GET_ITEM(tuple, i), PyExc_OverflowError);
  if (value == -1 && PyErr_Occurred()) {
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int", name, i);
    }
    return -1;
  }
  *out = (int64_t)value;
  return 0;
}

/* The pools as [num_blocks, lead..., block_size, row] views. */
static int import_pools(paged_call *c, PyObject *buffers, PyObject *dims, PyObject *row_ndims,
                        int32_t *count_out) {
  PyObject *bufs = as_tuple(c, 0, buffers, "buffers");
  PyObject *dim_t = bufs ? as_tuple(c, 1, dims, "dims") : NULL;
  PyObject *row_t = dim_t ? as_tuple(c, 2, row_ndims, "row_ndims") : NULL;
  if (row_t == NULL) return -1;
  Py_ssize_t count = PyTuple_GET_SIZE(bufs);
  if (count < 1 || count > IMOE_MAX_BUFFERS || PyTuple_GET_SIZE(dim_t) != count ||
      PyTuple_GET_SIZE(row_t) != count) {
    PyErr_Format(PyExc_ValueError,
                 "buffers must hold 1 to %d pools, with one dims and row_ndims entry each",
                 IMOE_MAX_BUFFERS);
    return -1;
  }
  for (Py_ssize_t b = 0; b < count; ++b) {
    char name[32];
    int64_t dim, rows;
    snprintf(name, sizeof name, "buffers[%zd]", b);
    if (int_at(dim_t, b, "dims", &dim) < 0 || int_at(row_t, b, "row_ndims", &rows) < 0) return -1;
    imoe_import *im = imoe_py_import_array(&c->imports, PyTuple_GET_ITEM(bufs, b), name, 1);
    if (im == NULL || imoe_py_check_no_self_overlap(im) < 0) return -1;
    c->written[b] = im;
    /* Axis 0 is the block axis: the slot axis comes after it, the row after that. */
    if (dim < 1 || rows < 0 || dim + rows >= im->ndim) {
      PyErr_Format(PyExc_ValueError,
                   "%s: the slot axis (dims[%zd] = %lld) must lie after the block axis 0 and "
                   "before the last row_ndims[%zd] = %lld row axes of its %d axes",
                   name, b, (long long)dim, b, (long long)rows, (int)im->ndim);
      return -1;
    }
    if (imoe_py_buffer_view(im, dim, rows, &c->pools[b]) < 0) return -1;
    if (b > 0 && imoe_py_expect_same_rows(&c->pools[b], name, &c->pools[0], "buffers[0]") < 0)
      return -1;
  }
  *count_out = (int32_t)count;
  return 0;
}

/* paged_apply_target_map(buffers, dims, row_ndims, block_tables, target_map, mode,
 *                        num_threads, stream=None) -> None */
PyObject *imoe_py_paged_apply_target_map(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *buffers, *dims, *row_ndims, *tables_obj, *map_obj;
  int mode;
  long long num_threads;
  PyObject *stream = Py_None;
  if (!PyArg_ParseTuple(args, "OOOOOiL|O:paged_apply_target_map", &buffers, &dims, &row_ndims,
                        &tables_obj, &map_obj, &mode, &num_threads, &stream))
    return NULL;
  if (mode != IMOE_MODE_SWAP && mode != IMOE_MODE_MOVE) {
    PyErr_Format(PyExc_ValueError, "mode must be 0 (swap) or 1 (move), got %d", mode);
    return NULL;
  }
  if (num_threads > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "num_threads must be at most %d", INT32_MAX);
    return NULL;
  }
  if (imoe_py_check_stream(stream) < 0) return NULL;

  paged_call *c = PyMem_Malloc(sizeof *c);
  if (c == NULL) return PyErr_NoMemory();
  c->imports.count = 0;
  c->imports.stream = stream;
  for (int i = 0; i < 3; ++i) c->held[i] = NULL;

  PyObject *result = NULL;
  int32_t num_pools = 0;
  imoe_view tables, map;
  imoe_exec exec;
  imoe_import *im;
  if (import_pools(c, buffers, dims, row_ndims, &num_pools) < 0) goto done;
  im = imoe_py_import_array(&c->imports, tables_obj, "block_tables", 0);
  if (im == NULL || imoe_py_typed_view(im, INDEX_DTYPES, INDEX_NAMES, &tables) < 0) goto done;
  im = imoe_py_import_array(&c->imports, map_obj, "target_map", 0);
  if (im == NULL || imoe_py_typed_view(im, INDEX_DTYPES, INDEX_NAMES, &map) < 0) goto done;
  if (imoe_py_check_distinct_outputs(c->written, num_pools) < 0 ||
      imoe_py_exec_for(&c->imports, num_threads < 0 ? 0 : (int32_t)num_threads, &exec) < 0)
    goto done;

  imoe_error err = {{0}};
  imoe_status status;
  Py_BEGIN_ALLOW_THREADS
  status = imoe_paged_apply_target_map(c->pools, num_pools, &tables, &map, (imoe_mode)mode, &exec,
                                       &err);
  Py_END_ALLOW_THREADS
  if (status != IMOE_OK) {
    imoe_py_raise_status(status, &err);
    goto done;
  }
  result = Py_None;
  Py_INCREF(result);
done:
  imoe_py_release_imports(&c->imports);
  for (int i = 0; i < 3; ++i) Py_XDECREF(c->held[i]);
  PyMem_Free(c);
  return result;
}
