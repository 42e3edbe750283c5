/*
 * import.c: array objects in, released exactly once.
 *
 * Four kinds of object are taken:
 *   1. a NumPy array, read through the NumPy C API (a reference is held);
 *   2. a DLPack capsule, consumed (renamed to used_*) and freed by calling its
 *      deleter once, when the call is done;
 *   3. a tensor whose type publishes DLPack's C exchange table
 *      (__dlpack_c_exchange_api__, torch >= 2.10): its DLTensor is borrowed
 *      through the table, with a reference held, when the call runs on the
 *      framework's current stream (no ordering to ask of the producer). No
 *      capsule, no Python call: the fast path of a torch tensor. The stream
 *      "current" is read here, from the table, by the first CUDA array;
 *   4. an object with __dlpack__, asked for a capsule that is then taken as 2.
 * Whatever is imported is normalised into an imoe_import: byte strides (NULL
 * DLPack strides become compact row-major), byte_offset added to data.
 */
#include "binding.h"

#define PY_ARRAY_UNIQUE_SYMBOL IMOE_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

#include <stdio.h>
#include <string.h>

/* The typed dtype of (DLPack code, bits), or BYTES. */
static imoe_dtype typed_dtype(int code, int64_t bits) {
  if (code == kDLFloat && bits == 32) return IMOE_DTYPE_F32;
  if (code == kDLFloat && bits == 16) return IMOE_DTYPE_F16;
  if (code == kDLBfloat && bits == 16) return IMOE_DTYPE_BF16;
  if (code == kDLInt && bits == 32) return IMOE_DTYPE_I32;
  if (code == kDLInt && bits == 64) return IMOE_DTYPE_I64;
  return IMOE_DTYPE_BYTES;
}


/* The type of an import: its typed dtype (or BYTES), kept with DLPack's code
 * and bits for messages. */
static void set_dtype(imoe_import *im, int code, int64_t bits, int swapped) {
  im->dtype = swapped ? IMOE_DTYPE_BYTES : typed_dtype(code, bits);
  im->dtype_code = code;
  im->dtype_bits = bits;
  im->dtype_swapped = swapped;
}

/* The Python argument's name into im->name (at most its size - 1 bytes). */
static void set_name(imoe_import *im, const char *name) {
  size_t len = strlen(name);
  if (len >= sizeof im->name) len = sizeof im->name - 1;
  memcpy(im->name, name, len);
  im->name[len] = '\0';
}

/* ---- NumPy ---- */

static int numpy_code(char kind) {
  switch (kind) {
    case 'i': return kDLInt;
    case 'u': return kDLUInt;
    case 'f': return kDLFloat;
    case 'c': return kDLComplex;
    case 'b': return kDLBool;
    default: return kDLOpaqueHandle;
  }
}

static int import_ndarray(imoe_import *im, PyArrayObject *arr, int written) {
  Py_INCREF(arr);
  im->ref = (PyObject *)arr;

  PyArray_Descr *descr = PyArray_DESCR(arr);
  if (PyDataType_REFCHK(descr)) {
    PyErr_Format(PyExc_TypeError,
                 "%s has a dtype holding Python objects, which cannot be moved as bytes", im->name);
    return -1;
  }
  if (written && !PyArray_ISWRITEABLE(arr)) {
    PyErr_Format(PyExc_BufferError, "%s is read-only", im->name);
    return -1;
  }
  int ndim = PyArray_NDIM(arr);
  if (ndim > IMOE_MAX_NDIM) {
    PyErr_Format(PyExc_ValueError, "%s has %d axes; at most %d are supported", im->name, ndim,
                 IMOE_MAX_NDIM);
    return -1;
  }
  im->itemsize = (int64_t)PyArray_ITEMSIZE(arr);
  if (im->itemsize <= 0) {
    PyErr_Format(PyExc_TypeError, "%s has a dtype of itemsize 0", im->name);
    return -1;
  }
  /* Typed data must be in native byte order; swapped data is only bytes. */
  set_dtype(im, numpy_code(descr->kind), 8 * im->itemsize, PyArray_ISBYTESWAPPED(arr) != 0);
  im->data = PyArray_BYTES(arr);
  im->ndim = ndim;
  for (int i = 0; i < ndim; ++i) {
    im->shape[i] = (int64_t)PyArray_DIM(arr, i);
    im->strides[i] = (int64_t)PyArray_STRIDE(arr, i);
  }
  im->device.device_type = kDLCPU;
  im->device.device_id = 0;
  return 0;
}

/* ---- DLPack ---- */

static int read_dltensor(imoe_import *im, const DLTensor *t) {
  if (t->ndim > IMOE_MAX_NDIM || t->ndim < 0) {
    PyErr_Format(PyExc_ValueError, "%s has %d axes; at most %d are supported", im->name,
                 (int)t->ndim, IMOE_MAX_NDIM);
    return -1;
  }
  if (t->ndim > 0 && t->shape == NULL) {
    PyErr_Format(PyExc_ValueError, "%s is a malformed DLPack tensor (no shape)", im->name);
    return -1;
  }
  if (t->dtype.lanes != 1) {
    PyErr_Format(PyExc_TypeError, "%s has a vector dtype (%d lanes); only 1 lane is supported",
                 im->name, (int)t->dtype.lanes);
    return -1;
  }
  if (t->dtype.bits == 0 || t->dtype.bits % 8 != 0) {
    PyErr_Format(PyExc_TypeError,
                 "%s has a dtype of %d bits; only whole bytes per element are supported", im->name,
                 (int)t->dtype.bits);
    return -1;
  }
  im->itemsize = t->dtype.bits / 8;
  set_dtype(im, t->dtype.code, t->dtype.bits, 0);
  im->ndim = t->ndim;
  int empty = 0;
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] < 0) {
      PyErr_Format(PyExc_ValueError, "%s has a negative extent on axis %d", im->name, i);
      return -1;
    }
    im->shape[i] = t->shape[i];
    empty |= t->shape[i] == 0;
  }
  /* DLPack strides count elements; NULL means compact row-major. */
  int64_t compact = im->itemsize;
  for (int i = t->ndim - 1; i >= 0; --i) {
    if (t->strides == NULL) {
      im->strides[i] = compact;
      compact *= im->shape[i];
    } else if (t->strides[i] > INT64_MAX / im->itemsize ||
               t->strides[i] < -INT64_MAX / im->itemsize) {
      PyErr_Format(PyExc_ValueError, "%s has a stride too large for 64 bits on axis %d", im->name,
                   i);
      return -1;
    } else {
      im->strides[i] = t->strides[i] * im->itemsize;
    }
  }
  if (t->data == NULL && !empty) {
    PyErr_Format(PyExc_ValueError, "%s is a malformed DLPack tensor (no data)", im->name);
    return -1;
  }
  im->data = t->data == NULL ? NULL : (char *)t->data + t->byte_offset;
  im->device = t->device;
  return 0;
}

/*
 * Takes ownership of a DLPack capsule: its tensor is stored in im (so release
 * frees it) and the capsule is renamed, so that its own destructor frees
 * nothing. Then checks the version, the flags and the tensor.
 */
static int consume_capsule(imoe_import *im, PyObject *capsule, int written) {
  const char *cname = PyCapsule_GetName(capsule);
  if (cname == NULL && PyErr_Occurred()) return -1;
  if (cname != NULL && strcmp(cname, IMOE_DLPACK_VERSIONED_CAPSULE) == 0) {
    DLManagedTensorVersioned *mt = PyCapsule_GetPointer(capsule, cname);
    if (mt == NULL) return -1;
    if (PyCapsule_SetName(capsule, IMOE_DLPACK_VERSIONED_CAPSULE_USED) < 0) return -1;
    im->versioned = mt;
    /* Only version and deleter are readable before the version is known. */
    if (mt->version.major != IMOE_DLPACK_MAJOR) {
      PyErr_Format(PyExc_BufferError,
                   "%s is a DLPack %u.%u tensor; idempotent_moe supports DLPack %d.x", im->name,
                   (unsigned)mt->version.major, (unsigned)mt->version.minor, IMOE_DLPACK_MAJOR);
      return -1;
    }
    if (written && (mt->flags & IMOE_DLPACK_FLAG_READ_ONLY)) {
      PyErr_Format(PyExc_BufferError, "%s is read-only", im->name);
      return -1;
    }
    if (written && (mt->flags & IMOE_DLPACK_FLAG_IS_COPIED)) {
      PyErr_Format(PyExc_BufferError,
                   "%s is a copy made by its producer; writing it in place would change nothing",
                   im->name);
      return -1;
    }
    return read_dltensor(im, &mt->dl_tensor);
  }
  if (cname != NULL && strcmp(cname, IMOE_DLPACK_CAPSULE) == 0) {
    DLManagedTensor *mt = PyCapsule_GetPointer(capsule, cname);
    if (mt == NULL) return -1;
    if (PyCapsule_SetName(capsule, IMOE_DLPACK_CAPSULE_USED) < 0) return -1;
    im->legacy = mt;
    return read_dltensor(im, &mt->dl_tensor);
  }
  if (cname != NULL && (strcmp(cname, IMOE_DLPACK_VERSIONED_CAPSULE_USED) == 0 ||
                        strcmp(cname, IMOE_DLPACK_CAPSULE_USED) == 0)) {
    PyErr_Format(PyExc_BufferError, "%s: capsule was already consumed", im->name);
    return -1;
  }
  PyErr_Format(PyExc_TypeError, "%s is a capsule named %s%s%s, not a DLPack capsule", im->name,
               cname ? "'" : "", cname ? cname : "NULL", cname ? "'" : "");
  return -1;
}

/* Calls one __dlpack__ signature; kwargs may be NULL. */
static PyObject *call_dlpack(PyObject *method, PyObject *kwargs) {
  PyObject *args = PyTuple_New(0);
  if (args == NULL) return NULL;
  PyObject *capsule = PyObject_Call(method, args, kwargs);
  Py_DECREF(args);
  return capsule;
}

/*
 * obj.__dlpack__(stream=S, max_version=(1, 1), copy=False); on TypeError
 * (an older producer) obj.__dlpack__(stream=S), then obj.__dlpack__(). S is
 * the stream the call runs on: the producer orders its pending work before it.
 * A refusal to export (RuntimeError, BufferError: torch for a meta tensor)
 * becomes a BufferError naming the argument; a tensor that requires grad was
 * refused before (refuse_grad: TypeError).
 */
static PyObject *export_capsule(const imoe_import *im, PyObject *method, PyObject *stream) {
  PyObject *full = Py_BuildValue("{s:O,s:(ii),s:O}", "stream", stream, "max_version",
                                 IMOE_DLPACK_MAJOR, IMOE_DLPACK_MINOR, "copy", Py_False);
  PyObject *stream_only = Py_BuildValue("{s:O}", "stream", stream);
  PyObject *capsule = NULL;
  if (full == NULL || stream_only == NULL) goto cleanup;

  capsule = call_dlpack(method, full);
  if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
    PyErr_Clear();
    capsule = call_dlpack(method, stream_only);
  }
  if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
    PyErr_Clear();
    capsule = call_dlpack(method, NULL);
  }
  if (capsule == NULL &&
      (PyErr_ExceptionMatches(PyExc_RuntimeError) || PyErr_ExceptionMatches(PyExc_BufferError)))
    imoe_py_reraise_as(PyExc_BufferError, im->name, "cannot be exported through DLPack");

cleanup:
  Py_XDECREF(full);
  Py_XDECREF(stream_only);
  return capsule;
}

static int import_dlpack_object(imoe_import *im, PyObject *method, PyObject *stream,
                                int written) {
  PyObject *capsule = export_capsule(im, method, stream);
  if (capsule == NULL) return -1;
  int rc;
  if (PyCapsule_CheckExact(capsule)) {
    rc = consume_capsule(im, capsule, written);
  } else {
    PyErr_Format(PyExc_TypeError, "%s.__dlpack__() returned %.200s, not a DLPack capsule", im->name,
                 Py_TYPE(capsule)->tp_name);
    rc = -1;
  }
  Py_DECREF(capsule);
  return rc;
}

/* ---- DLPack C exchange table ---- */

/* Per type: its usable exchange table, or NULL. A few types at most (torch.Tensor,
 * nn.Parameter, ...); each cached type is kept alive, so its address is never
 * reused. Only touched with the GIL held. */
#define EXCHANGE_CACHE 16
static struct {
  PyTypeObject *type;
  const DLPackExchangeAPI *api;
} exchange_cache[EXCHANGE_CACHE];

static const DLPackExchangeAPI *lookup_exchange_api(PyTypeObject *type) {
  PyObject *capsule = PyObject_GetAttrString((PyObject *)type, "__dlpack_c_exchange_api__");
  if (capsule == NULL) {
    PyErr_Clear();
    return NULL;
  }
  const DLPackExchangeAPI *api = NULL;
  if (PyCapsule_IsValid(capsule, IMOE_DLPACK_EXCHANGE_CAPSULE))
    api = PyCapsule_GetPointer(capsule, IMOE_DLPACK_EXCHANGE_CAPSULE);
  Py_DECREF(capsule);
  /* The table lives as long as the process (dlpack.h); use it only where its
   * major version is ours and the two functions needed are there. */
  if (api == NULL || api->header.version.major != IMOE_DLPACK_MAJOR ||
      api->header.version.minor < 3 || api->dltensor_from_py_object_no_sync == NULL ||
      api->current_work_stream == NULL)
    api = NULL;
  PyErr_Clear();
  return api;
}

static const DLPackExchangeAPI *exchange_api(PyTypeObject *type) {
  for (int i = 0; i < EXCHANGE_CACHE && exchange_cache[i].type != NULL; ++i)
    if (exchange_cache[i].type == type) return exchange_cache[i].api;
  const DLPackExchangeAPI *api = lookup_exchange_api(type);
  for (int i = 0; i < EXCHANGE_CACHE; ++i) {
    if (exchange_cache[i].type == NULL) {
      Py_INCREF(type);
      exchange_cache[i].type = type;
      exchange_cache[i].api = api;
      break;
    }
  }
  return api;
}

int imoe_py_type_exchanges(PyTypeObject *type) { return exchange_api(type) != NULL; }

/* The framework's current stream on CUDA device `device_id`, through its
 * exchange table, as a handle: 0, or -1 (no exception set) when the table
 * cannot say. DLPack names the legacy default stream 1, which a framework
 * may report as NULL. */
static int current_stream_of(const DLPackExchangeAPI *api, int32_t device_id, void **out) {
  void *current = NULL;
  if (api->current_work_stream(kDLCUDA, device_id, &current) != 0) {
    PyErr_Clear();
    return -1;
  }
  *out = current != NULL ? current : (void *)(uintptr_t)1;
  return 0;
}

/* The first CUDA array of a call on stream "current" names the stream. */
static void name_current(imoe_imports *set, void *handle) {
  if (!set->has_current) {
    set->current_handle = handle;
    set->has_current = 1;
  }
}

/*
 * Case 3 above. Returns 1 when obj was imported (or failed: -1, exception
 * set), 0 when the exchange table does not apply (no table, or the call runs
 * on another stream than the framework's current one, so the producer must
 * order its work through __dlpack__(stream=...)).
 */
static int import_exchanged(imoe_import *im, PyObject *obj, imoe_imports *set) {
  const DLPackExchangeAPI *api = exchange_api(Py_TYPE(obj));
  if (api == NULL) return 0;
  /* The table exports what __dlpack__ refuses (a torch tensor that requires
   * grad): refuse_grad has refused such objects before. */
  DLTensor t;
  memset(&t, 0, sizeof t);
  if (api->dltensor_from_py_object_no_sync(obj, &t) != 0) {
    if (PyErr_ExceptionMatches(PyExc_RuntimeError) || PyErr_ExceptionMatches(PyExc_BufferError))
      imoe_py_reraise_as(PyExc_BufferError, im->name, "cannot be exported through DLPack");
    return -1;
  }
  if (t.device.device_type != kDLCPU) {
    PyObject *stream = set->stream;
    void *current;
    if (t.device.device_type != kDLCUDA || stream == NULL || stream == Py_None) return 0;
    if (current_stream_of(api, t.device.device_id, &current) < 0) return 0;
    /* "current" takes the first CUDA array's (arrays on another device are
     * refused later, with the device named); -1 asks for no ordering;
     * otherwise the call's stream must be the current one. */
    if (set->current) {
      name_current(set, current);
    } else if (PyLong_AsLongLong(stream) != -1) {
      if (imoe_py_stream_handle(stream) != current) return 0;
    }
    PyErr_Clear();
  }
  Py_INCREF(obj);
  im->ref = obj;
  return read_dltensor(im, &t) == 0 ? 1 : -1;
}

static PyObject *new_ref(PyObject *obj) {
  Py_INCREF(obj);
  return obj;
}

/*
 * The DLPack stream value that "current" names for obj, an array that takes
 * case 4: the stream an earlier CUDA array of the call named, else the
 * current stream of obj's framework on obj's CUDA device, through its type's
 * exchange table; None for host memory.
 * A CUDA array of a framework without the table cannot say it: ValueError.
 */
static PyObject *current_stream_value(imoe_imports *set, PyObject *obj, const char *name) {
  if (set->has_current) return PyLong_FromVoidPtr(set->current_handle);
  PyObject *device = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
  if (device == NULL) {
    PyErr_Clear();
    return new_ref(Py_None); /* a producer too old to say: as for host memory */
  }
  int kind = 0, index = 0;
  const int parsed = PyArg_ParseTuple(device, "ii", &kind, &index);
  Py_DECREF(device);
  if (!parsed) return NULL;
  if (kind == kDLCPU) return new_ref(Py_None);
  const DLPackExchangeAPI *api = exchange_api(Py_TYPE(obj));
  void *current;
  if ((kind != kDLCUDA && kind != kDLCUDAManaged) || api == NULL ||
      current_stream_of(api, index, &current) < 0) {
    PyErr_Format(PyExc_ValueError,
                 "%s: stream 'current' is read from DLPack's C exchange table, which %.200s "
                 "does not publish; pass the stream's value",
                 name, Py_TYPE(obj)->tp_name);
    return NULL;
  }
  name_current(set, current);
  return PyLong_FromVoidPtr(set->current_handle);
}

/* TypeError for an object whose `requires_grad` is true (a torch tensor that
 * autograd records): no call of the library records a gradient through its
 * arguments, and torch's exports refuse such tensors. Returns 1 when
 * refused, 0 when not, -1 on another error. */
static int refuse_grad(PyObject *obj, const char *name) {
  static PyObject *requires_grad;
  if (requires_grad == NULL && (requires_grad = PyUnicode_InternFromString("requires_grad")) == NULL)
    return -1;
  PyObject *grad = NULL;
#if PY_VERSION_HEX >= 0x030D0000
  if (PyObject_GetOptionalAttr(obj, requires_grad, &grad) < 0) PyErr_Clear();
#else
  if (_PyObject_LookupAttr(obj, requires_grad, &grad) < 0) PyErr_Clear();
#endif
  if (grad == NULL) return 0;
  const int truth = PyObject_IsTrue(grad);
  Py_DECREF(grad);
  if (truth <= 0) {
    PyErr_Clear();
    return 0;
  }
  PyErr_Format(PyExc_TypeError,
               "%s requires grad, and this call records no gradient (an in-place or out= call, "
               "torch.no_grad(), or an operation without a backward): pass %s.detach()",
               name, name);
  return 1;
}

imoe_import *imoe_py_import_array(imoe_imports *set, PyObject *obj, const char *name, int written) {
  if (set->count >= IMOE_MAX_IMPORTS) {
    PyErr_SetString(PyExc_RuntimeError, "idempotent_moe: too many arrays in one call");
    return NULL;
  }
  /* Counted before anything is owned, so release sees every record. */
  imoe_import *im = &set->item[set->count++];
  memset(im, 0, sizeof *im);
  set_name(im, name);

  int rc;
  PyObject *method = NULL;
  if (PyArray_Check(obj)) {
    rc = import_ndarray(im, (PyArrayObject *)obj, written);
  } else if (PyCapsule_CheckExact(obj)) {
    rc = consume_capsule(im, obj, written);
  } else if (refuse_grad(obj, name) != 0) {
    rc = -1;
  } else if ((rc = import_exchanged(im, obj, set)) != 0) {
    rc = rc > 0 ? 0 : -1;
  } else if ((method = PyObject_GetAttrString(obj, "__dlpack__")) != NULL) {
    PyObject *stream = set->current ? current_stream_value(set, obj, name)
                                    : new_ref(set->stream ? set->stream : Py_None);
    rc = stream == NULL ? -1 : import_dlpack_object(im, method, stream, written);
    Py_XDECREF(stream);
    Py_DECREF(method);
  } else if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError,
                 "%s must be an array with __dlpack__ (torch, NumPy, CuPy) or a DLPack capsule, "
                 "got %.200s",
                 name, Py_TYPE(obj)->tp_name);
    rc = -1;
  } else {
    rc = -1;
  }
  if (rc == 0 && im->ndim == 0) {
    PyErr_Format(PyExc_ValueError, "%s is 0-dimensional; it needs at least one axis", name);
    rc = -1;
  }
  return rc == 0 ? im : NULL;
}

/* Frees what one record owns; idempotent. */
static void release_one(imoe_import *im) {
  DLManagedTensorVersioned *versioned = im->versioned;
  DLManagedTensor *legacy = im->legacy;
  PyObject *ref = im->ref;
  im->versioned = NULL;
  im->legacy = NULL;
  im->ref = NULL;
  if (versioned != NULL && versioned->deleter != NULL) versioned->deleter(versioned);
  if (legacy != NULL && legacy->deleter != NULL) legacy->deleter(legacy);
  Py_XDECREF(ref);
}

void imoe_py_release_imports(imoe_imports *set) {
  /* Deleters and __del__ may run Python code: not with an exception pending. */
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *pending = PyErr_GetRaisedException();
#else
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
#endif
  for (int i = set->count - 1; i >= 0; --i) release_one(&set->item[i]);
  set->count = 0;
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(pending);
#else
  PyErr_Restore(type, value, traceback);
#endif
}
