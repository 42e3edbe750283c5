/*
 * call.c: what every function of the binding does per call: the stream and
 * thread count, the imports, the buffers, the plan workspace and the one
 * device the call runs on. Whether arguments overlap is the C core's to
 * judge (csrc/alias.c). Every import is released on every path by
 * imoe_py_call_free.
 */
#include "binding.h"

#include <string.h>

imoe_py_call *imoe_py_call_new(PyObject *stream, PyObject *threads) {
  int64_t num_threads = 0; /* None: the default */
  if (threads != Py_None && imoe_py_as_int64(threads, "num_threads", &num_threads) < 0)
    return NULL;
  if (num_threads > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "num_threads must be at most %d, got %lld", INT32_MAX,
                 (long long)num_threads);
    return NULL;
  }
  if (imoe_py_check_stream(stream) < 0) return NULL;
  imoe_py_call *c = PyMem_Malloc(sizeof *c);
  if (c == NULL) return (imoe_py_call *)PyErr_NoMemory();
  /* Records are zeroed one by one as they are used: most calls use a few. */
  c->imports.count = 0;
  c->imports.stream = stream;
  c->imports.current = imoe_py_is_current_stream(stream);
  c->imports.has_current = 0;
  c->imports.current_handle = NULL;
  c->num_buffers = 0;
  for (int i = 0; i < 3; ++i) c->held[i] = NULL;
  c->workspace = NULL;
  c->workspace_elems = 0;
  c->threads = num_threads < 0 ? 0 : (int32_t)num_threads; /* <= 0: the OpenMP default */
  return c;
}

void imoe_py_call_free(imoe_py_call *c) {
  if (c == NULL) return;
  imoe_py_release_imports(&c->imports);
  for (int i = 0; i < 3; ++i) Py_XDECREF(c->held[i]);
  PyMem_Free(c);
}

imoe_import *imoe_py_call_import(imoe_py_call *c, PyObject *obj, const char *name, int written) {
  imoe_import *im = imoe_py_import_array(&c->imports, obj, name, written);
  return im;
}

int imoe_py_call_import_typed(imoe_py_call *c, PyObject *obj, const char *name, int written,
                              unsigned accepted, const char *accepted_names, imoe_view *view) {
  imoe_import *im = imoe_py_call_import(c, obj, name, written);
  if (im == NULL) return -1;
  return imoe_py_typed_view(im, accepted, accepted_names, view);
}

PyObject *imoe_py_call_hold(imoe_py_call *c, int slot, PyObject *obj, const char *name,
                            const char *of) {
  if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of %s, got %.200s", name, of,
                 Py_TYPE(obj)->tp_name);
    return NULL;
  }
  c->held[slot] = PySequence_Tuple(obj);
  return c->held[slot];
}

int imoe_py_int_item(PyObject *tuple, Py_ssize_t i, const char *name, int64_t *out) {
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

int imoe_py_call_hold_buffer_args(imoe_py_call *c, PyObject *buffers, PyObject *dims,
                                  PyObject *row_ndims) {
  if (imoe_py_call_hold(c, 0, buffers, "buffers", "arrays") == NULL ||
      imoe_py_call_hold(c, 1, dims, "dims", "ints") == NULL ||
      imoe_py_call_hold(c, 2, row_ndims, "row_ndims", "ints") == NULL)
    return -1;
  return 0;
}

/* The checks of dims[b] and row_ndims[b] against buffers[b] with ndim axes. */
static int check_axes(const char *name, Py_ssize_t b, int64_t dim, int64_t rows, int ndim) {
  if (dim < 0 || dim >= ndim) {
    PyErr_Format(PyExc_ValueError, "dims[%zd] = %lld is out of range for %s with %d axes", b,
                 (long long)dim, name, ndim);
    return -1;
  }
  if (dim + rows >= ndim) {
    PyErr_Format(PyExc_ValueError,
                 "%s: the slot axis dims[%zd] = %lld must come before its row axes, the last "
                 "row_ndims[%zd] = %lld of its %d axes",
                 name, b, (long long)dim, b, (long long)rows, ndim);
    return -1;
  }
  return 0;
}

int imoe_py_call_import_buffers(imoe_py_call *c, PyObject *buffers, PyObject *dims,
                                PyObject *row_ndims) {
  if (imoe_py_call_hold_buffer_args(c, buffers, dims, row_ndims) < 0) return -1;
  PyObject *bufs = c->held[0], *dim_tuple = c->held[1], *row_tuple = c->held[2];
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
  int64_t dim[IMOE_MAX_BUFFERS], rows[IMOE_MAX_BUFFERS];
  for (Py_ssize_t b = 0; b < count; ++b) {
    if (imoe_py_int_item(dim_tuple, b, "dims", &dim[b]) < 0) return -1;
    if (imoe_py_int_item(row_tuple, b, "row_ndims", &rows[b]) < 0) return -1;
    if (rows[b] < 0) {
      PyErr_Format(PyExc_ValueError, "row_ndims[%zd] must be >= 0, got %lld", b,
                   (long long)rows[b]);
      return -1;
    }
  }

  for (Py_ssize_t b = 0; b < count; ++b) {
    const char *name = imoe_buffer_name((int32_t)b);
    imoe_import *im = imoe_py_call_import(c, PyTuple_GET_ITEM(bufs, b), name, 1);
    if (im == NULL || check_axes(name, b, dim[b], rows[b], (int)im->ndim) < 0) return -1;
    if (imoe_py_buffer_view(im, dim[b], rows[b], &c->buffers[b]) < 0) return -1;
  }
  c->num_buffers = (int32_t)count;
  return 0;
}

int imoe_py_call_import_workspace(imoe_py_call *c, PyObject *obj) {
  if (obj == Py_None) return 0;
  imoe_import *im = imoe_py_call_import(c, obj, "workspace", 1);
  if (im == NULL) return -1;
  if (im->dtype != IMOE_DTYPE_I32) {
    char dtype[64];
    imoe_py_dtype_name(im, dtype, sizeof dtype);
    PyErr_Format(PyExc_TypeError, "workspace must have dtype int32, got %s", dtype);
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

int imoe_py_call_finish(imoe_py_call *c) {
  return imoe_py_exec_for(&c->imports, c->threads, &c->exec);
}

int imoe_py_check_new(PyObject *new_fn) {
  if (PyCallable_Check(new_fn)) return 0;
  PyErr_Format(PyExc_TypeError, "new must be callable (new(like, shape, dtype) -> array), got %.200s",
               Py_TYPE(new_fn)->tp_name);
  return -1;
}

PyObject *imoe_py_call_new_array(imoe_py_call *c, PyObject *new_fn, PyObject *like,
                                 const int64_t *shape, int ndim, const char *dtype) {
  /* The imports so far must share a device before anything is made beside them. */
  if (imoe_py_call_finish(c) < 0) return NULL;
  PyObject *dims = PyTuple_New(ndim);
  if (dims == NULL) return NULL;
  for (int i = 0; i < ndim; ++i) {
    PyObject *d = PyLong_FromLongLong((long long)shape[i]);
    if (d == NULL) {
      Py_DECREF(dims);
      return NULL;
    }
    PyTuple_SET_ITEM(dims, i, d);
  }
  PyObject *name = dtype == NULL ? (Py_INCREF(Py_None), Py_None) : PyUnicode_FromString(dtype);
  PyObject *made = name == NULL ? NULL : PyObject_CallFunctionObjArgs(new_fn, like, dims, name, NULL);
  Py_DECREF(dims);
  Py_XDECREF(name);
  return made;
}

int imoe_py_check_new_output(PyObject *new_fn, const char *fname, const char *out) {
  if (new_fn == Py_None) {
    PyErr_Format(PyExc_TypeError, "%s() needs %s, or new to make it", fname, out);
    return -1;
  }
  return imoe_py_check_new(new_fn);
}

PyObject *imoe_py_given(PyObject *out) {
  if (out == Py_None) return NULL;
  Py_INCREF(out);
  return out;
}

int imoe_py_judged(imoe_py_call *c, imoe_status status) {
  if (status == IMOE_OK) return 0;
  imoe_py_done(status, &c->err); /* sets the exception */
  return -1;
}

PyObject *imoe_py_returning(PyObject *result, PyObject **out) {
  if (result == NULL) return NULL;
  Py_DECREF(result);
  result = *out;
  *out = NULL;
  return result;
}

int imoe_py_check_out_dtype(const imoe_view *out, const char *out_name, imoe_option option,
                            const char *dtype, const char *arg) {
  if (dtype == NULL) return 0;
  const imoe_dtype base = option == IMOE_OPTION_FLOAT ? IMOE_DTYPE_F32 : IMOE_DTYPE_I32;
  const char *have = imoe_option_name(option, (int)out->dtype - (int)base);
  if (have != NULL && strcmp(have, dtype) == 0) return 0;
  PyErr_Format(PyExc_ValueError, "%s = '%s' differs from the dtype of the %s given (%s)", arg, dtype,
               out_name, have != NULL ? have : "another");
  return -1;
}
