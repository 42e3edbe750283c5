/*
 * views.c: imoe_view from an import, and the checks that need only views.
 *
 * Only metadata is read here, never an element: the C API validates data.
 */
#include "binding.h"

#include <stdio.h>
#include <string.h>

/* An import's dtype as messages name it (DLPack's code and bits). */
void imoe_py_dtype_name(const imoe_import *im, char *out, size_t size) {
  static const char *const names[] = {"int",           "uint",
                                      "float",         "opaque",
                                      "bfloat",        "complex",
                                      "bool",          "float8_e3m4",
                                      "float8_e4m3",   "float8_e4m3b11fnuz",
                                      "float8_e4m3fn", "float8_e4m3fnuz",
                                      "float8_e5m2",   "float8_e5m2fnuz",
                                      "float8_e8m0fnu"};
  const int code = im->dtype_code;
  const long long bits = (long long)im->dtype_bits;
  const char *swapped = im->dtype_swapped ? " (byte-swapped)" : "";
  if (code >= kDLFloat8_e3m4 && code <= kDLFloat8_e8m0fnu)
    snprintf(out, size, "%s%s", names[code], swapped);
  else if (code >= 0 && code < (int)(sizeof names / sizeof names[0]))
    snprintf(out, size, "%s%lld%s", names[code], bits, swapped);
  else
    snprintf(out, size, "DLPack code %d (%lld bits)%s", code, bits, swapped);
}

static int is_empty(const imoe_import *im) {
  for (int i = 0; i < im->ndim; ++i)
    if (im->shape[i] == 0) return 1;
  return 0;
}

static int check_lead_ndim(const imoe_import *im, int lead_ndim, const char *which) {
  if (lead_ndim <= IMOE_MAX_LEAD_DIMS) return 0;
  PyErr_Format(PyExc_ValueError, "%s has %d lead axes (%s); at most %d are supported", im->name,
               lead_ndim, which, IMOE_MAX_LEAD_DIMS);
  return -1;
}

int imoe_py_buffer_view(const imoe_import *im, int64_t dim, int64_t row_ndim, imoe_view *view) {
  int ndim = im->ndim, slot = (int)dim, row_start = im->ndim - (int)row_ndim;
  if (check_lead_ndim(im, row_start - 1, "every axis but the slot axis and the row axes") < 0)
    return -1;

  /* The row is one block of bytes: its axes C-contiguous, size-1 axes aside. */
  int64_t row_bytes = im->itemsize;
  int contiguous = 1;
  for (int i = ndim - 1; i >= row_start; --i) {
    if (im->shape[i] != 1 && im->strides[i] != row_bytes) contiguous = 0;
    row_bytes *= im->shape[i];
  }
  if (!contiguous && !is_empty(im)) {
    PyErr_Format(PyExc_ValueError,
                 "%s: its row axes (the last %d) must be C-contiguous together, "
                 "one block of bytes per slot",
                 im->name, (int)row_ndim);
    return -1;
  }

  memset(view, 0, sizeof *view);
  view->data = im->data;
  for (int i = 0; i < row_start; ++i) {
    if (i == slot) continue;
    view->lead_shape[view->lead_ndim] = im->shape[i];
    view->lead_stride[view->lead_ndim] = im->strides[i];
    view->lead_ndim++;
  }
  view->n = im->shape[slot];
  view->n_stride = im->strides[slot];
  view->row_bytes = row_bytes;
  view->dtype = IMOE_DTYPE_BYTES;
  return 0;
}

int imoe_py_typed_view(const imoe_import *im, unsigned accepted, const char *accepted_names,
                       imoe_view *view) {
  if (im->dtype == IMOE_DTYPE_BYTES || !(accepted & IMOE_DTYPE_BIT(im->dtype))) {
    char dtype[64];
    imoe_py_dtype_name(im, dtype, sizeof dtype);
    PyErr_Format(PyExc_TypeError, "%s must have dtype %s, got %s", im->name, accepted_names,
                 dtype);
    return -1;
  }
  int lead_ndim = im->ndim - 1;
  if (check_lead_ndim(im, lead_ndim, "all axes but the last") < 0) return -1;

  /* The C core reads typed elements directly: they must be aligned. */
  int aligned = (uintptr_t)im->data % (uintptr_t)im->itemsize == 0;
  for (int i = 0; i < im->ndim; ++i)
    if (im->shape[i] > 1 && im->strides[i] % im->itemsize != 0) aligned = 0;
  if (!aligned && !is_empty(im)) {
    PyErr_Format(PyExc_ValueError, "%s is not aligned to its %lld-byte elements", im->name,
                 (long long)im->itemsize);
    return -1;
  }

  memset(view, 0, sizeof *view);
  view->data = im->data;
  view->lead_ndim = lead_ndim;
  for (int i = 0; i < lead_ndim; ++i) {
    view->lead_shape[i] = im->shape[i];
    view->lead_stride[i] = im->strides[i];
  }
  view->n = im->shape[lead_ndim];
  view->n_stride = im->strides[lead_ndim];
  view->row_bytes = im->itemsize;
  view->dtype = im->dtype;
  return 0;
}

static void format_device(char *out, size_t size, const imoe_exec *e) {
  if (e->device == IMOE_DEVICE_CUDA)
    snprintf(out, size, "cuda:%d", (int)e->device_id);
  else
    snprintf(out, size, "cpu");
}

static int device_of(const imoe_import *im, imoe_exec *e) {
  switch (im->device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: /* pinned host memory */
      e->device = IMOE_DEVICE_CPU;
      e->device_id = 0;
      return 0;
    case kDLCUDA:
    case kDLCUDAManaged:
      if (!imoe_cuda_compiled()) {
        PyErr_Format(PyExc_ValueError,
                     "%s is on cuda:%d, but this build of idempotent_moe has no CUDA support",
                     im->name, (int)im->device.device_id);
        return -1;
      }
      e->device = IMOE_DEVICE_CUDA;
      e->device_id = im->device.device_id;
      return 0;
    default:
      PyErr_Format(PyExc_ValueError,
                   "%s is on DLPack device type %d, which idempotent_moe does not support",
                   im->name, (int)im->device.device_type);
      return -1;
  }
}

int imoe_py_is_current_stream(PyObject *obj) {
  static PyObject *current; /* interned, as the literal of a Python call site is */
  if (current == NULL && (current = PyUnicode_InternFromString("current")) == NULL)
    PyErr_Clear(); /* then compared by value below */
  if (obj == current) return 1;
  return PyUnicode_Check(obj) && PyUnicode_CompareWithASCIIString(obj, "current") == 0;
}

int imoe_py_check_stream(PyObject *obj) {
  if (obj == Py_None || imoe_py_is_current_stream(obj)) return 0;
  if (PyBool_Check(obj) || !PyLong_Check(obj)) {
    PyErr_Format(PyExc_TypeError,
                 "stream must be None, 'current' or an int (a DLPack stream), got %.200s",
                 Py_TYPE(obj)->tp_name);
    return -1;
  }
  int overflow = 0;
  long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (value == -1 && PyErr_Occurred()) return -1;
  if (overflow > 0 || (overflow == 0 && (value == -1 || value >= 1))) return 0;
  PyErr_Format(PyExc_ValueError,
               "stream must be -1, 1 (legacy default), 2 (per-thread default) or a stream "
               "handle; got %S (0 is not a DLPack stream: pass 1 for the default stream)",
               obj);
  return -1;
}

void *imoe_py_stream_handle(PyObject *obj) {
  if (obj == NULL || obj == Py_None) return NULL;
  unsigned long long value = PyLong_AsUnsignedLongLongMask(obj);
  /* -1 asks for no ordering at all: the legacy default stream then runs it.
   * 1 and 2 are also the values of cudaStreamLegacy and cudaStreamPerThread. */
  if (value == (unsigned long long)-1) return NULL;
  return (void *)(uintptr_t)value;
}

int imoe_py_exec_for(const imoe_imports *set, int32_t num_threads, imoe_exec *exec) {
  memset(exec, 0, sizeof *exec);
  exec->num_threads = num_threads;
  for (int i = 0; i < set->count; ++i) {
    imoe_exec e = *exec;
    if (device_of(&set->item[i], &e) < 0) return -1;
    if (i == 0) {
      *exec = e;
      if (e.device == IMOE_DEVICE_CUDA && set->current && !set->has_current) {
        /* Only an array read through its framework's exchange table (or one
         * asked through __dlpack__) names the stream; a capsule cannot. */
        PyErr_Format(PyExc_ValueError,
                     "%s: stream 'current' is named by a CUDA array of a framework that publishes "
                     "DLPack's C exchange table, and no array of this call did; pass the stream's value",
                     set->item[0].name);
        return -1;
      }
      if (e.device == IMOE_DEVICE_CUDA)
        exec->stream = set->current ? set->current_handle : imoe_py_stream_handle(set->stream);
    } else if (e.device != exec->device || e.device_id != exec->device_id) {
      char here[32], there[32];
      format_device(here, sizeof here, &e);
      format_device(there, sizeof there, exec);
      PyErr_Format(PyExc_ValueError,
                   "%s is on %s, but %s is on %s; the arrays of one call must share a device",
                   set->item[i].name, here, set->item[0].name, there);
      return -1;
    }
  }
  return 0;
}
