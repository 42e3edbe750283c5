/*
 * views.c: imoe_view from an import, and the checks that need only views.
 *
 * Only metadata is read here, never an element: the C API validates data.
 */
#include "binding.h"

#include <stdio.h>
#include <string.h>

static int64_t abs64(int64_t x) {
  return x < 0 ? -x : x;
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
    PyErr_Format(PyExc_TypeError, "%s must have dtype %s, got %s", im->name, accepted_names,
                 im->dtype_name);
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

/*
 * A sufficient test, NumPy's fast one: with the axes sorted by |stride|, each
 * stride spans at least everything the smaller axes reach. It catches zero
 * strides (broadcast, expand) and as_strided views whose slots overlap.
 */
int imoe_py_check_no_self_overlap(const imoe_import *im) {
  int axis[IMOE_MAX_NDIM], count = 0;
  if (is_empty(im)) return 0;
  for (int i = 0; i < im->ndim; ++i) {
    if (im->shape[i] <= 1) continue;
    int j = count++;
    while (j > 0 && abs64(im->strides[axis[j - 1]]) > abs64(im->strides[i])) {
      axis[j] = axis[j - 1];
      --j;
    }
    axis[j] = i;
  }
  int64_t span = im->itemsize; /* bytes reached by the axes taken so far */
  for (int j = 0; j < count; ++j) {
    int i = axis[j];
    int64_t stride = abs64(im->strides[i]);
    if (stride == 0) {
      PyErr_Format(PyExc_ValueError,
                   "%s has a zero stride on axis %d of size %lld (broadcast or expanded "
                   "memory); writing it would alias",
                   im->name, i, (long long)im->shape[i]);
      return -1;
    }
    if (stride < span) {
      PyErr_Format(PyExc_ValueError,
                   "%s has overlapping elements (axis %d's stride of %lld bytes is inside the "
                   "%lld bytes its faster axes span); writing it would alias",
                   im->name, i, (long long)stride, (long long)span);
      return -1;
    }
    if (im->shape[i] - 1 > (INT64_MAX - span) / stride) {
      PyErr_Format(PyExc_ValueError, "%s spans more than 2**63 bytes", im->name);
      return -1;
    }
    span += stride * (im->shape[i] - 1);
  }
  return 0;
}

static int64_t gcd64(int64_t a, int64_t b) {
  while (b != 0) {
    int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

/* First and one-past-last byte an import reaches (it is not empty). */
static void byte_extent(const imoe_import *im, int64_t *lo, int64_t *hi) {
  int64_t low = 0, high = im->itemsize;
  for (int i = 0; i < im->ndim; ++i) {
    int64_t reach = im->strides[i] * (im->shape[i] - 1);
    if (reach < 0) low += reach;
    else high += reach;
  }
  *lo = (int64_t)(intptr_t)im->data + low;
  *hi = (int64_t)(intptr_t)im->data + high;
}

/*
 * Every byte of an import is data + (a multiple of `period`) + [0, block):
 * block is its innermost C-contiguous run, period the gcd of the strides of
 * the other axes (0 when there are none).
 */
static void block_and_period(const imoe_import *im, int64_t *block, int64_t *period) {
  int i = im->ndim - 1;
  int64_t run = im->itemsize, g = 0;
  for (; i >= 0; --i) {
    if (im->shape[i] == 1) continue;
    if (im->strides[i] != run) break;
    run *= im->shape[i];
  }
  for (; i >= 0; --i)
    if (im->shape[i] > 1) g = gcd64(g, abs64(im->strides[i]));
  *block = run;
  *period = g;
}

/*
 * A sufficient test that two written arrays share no byte: disjoint byte
 * extents, or blocks that fall into disjoint residues modulo the common
 * period (K and V as interleaved halves of one fused tensor pass).
 */
static int may_overlap(const imoe_import *a, const imoe_import *b) {
  int64_t a_lo, a_hi, b_lo, b_hi, a_block, b_block, a_period, b_period;
  byte_extent(a, &a_lo, &a_hi);
  byte_extent(b, &b_lo, &b_hi);
  if (a_hi <= b_lo || b_hi <= a_lo) return 0;
  block_and_period(a, &a_block, &a_period);
  block_and_period(b, &b_block, &b_period);
  int64_t period = gcd64(a_period, b_period);
  if (period == 0) return 1;
  int64_t shift = ((int64_t)(intptr_t)b->data - (int64_t)(intptr_t)a->data) % period;
  if (shift < 0) shift += period;
  return !(shift >= a_block && shift + b_block <= period);
}

int imoe_py_check_distinct_outputs(const imoe_import *const *written, int count) {
  for (int a = 0; a < count; ++a) {
    for (int b = 0; b < a; ++b) {
      if (is_empty(written[a]) || is_empty(written[b]) || !may_overlap(written[a], written[b]))
        continue;
      PyErr_Format(PyExc_ValueError,
                   "%s and %s overlap in memory; writing both in place would alias",
                   written[b]->name, written[a]->name);
      return -1;
    }
  }
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

int imoe_py_check_stream(PyObject *obj) {
  if (obj == Py_None) return 0;
  if (PyBool_Check(obj) || !PyLong_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "stream must be None or an int (a DLPack stream), got %.200s",
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
      if (e.device == IMOE_DEVICE_CUDA) exec->stream = imoe_py_stream_handle(set->stream);
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
