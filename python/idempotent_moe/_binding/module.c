/*
 * module.c: the extension module idempotent_moe._C.
 *
 * The method table, the constants the C API exports (option names, limits),
 * and the small functions that move no data. The operations are in ops.c and
 * paged.c; every function takes keyword arguments named as in the Python API.
 */
#include "binding.h"

#define PY_ARRAY_UNIQUE_SYMBOL IMOE_ARRAY_API
#include <numpy/arrayobject.h>

#include <stdio.h>
#include <string.h>

/* take_device_status(device_id, stream) -> int: the recorded imoe_status. */
static PyObject *py_take_device_status(PyObject *self, PyObject *args) {
  (void)self;
  int device_id;
  PyObject *stream = Py_None;
  if (!PyArg_ParseTuple(args, "i|O:take_device_status", &device_id, &stream)) return NULL;
  if (imoe_py_check_stream(stream) < 0) return NULL;
  if (imoe_py_is_current_stream(stream)) {
    PyErr_SetString(PyExc_ValueError, "take_device_status needs the stream's value, not 'current'");
    return NULL;
  }
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

static imoe_py_signature plan_sig = {"plan_workspace_elems", 4, {"kind", "rows", "n", "cuda"}};

/* plan_workspace_elems(kind, rows, n, cuda) -> int: imoe_plan_workspace_elems. */
static IMOE_PY_FASTCALL(py_plan_workspace_elems) {
  (void)self;
  PyObject *a[4] = {NULL, NULL, NULL, NULL};
  if (imoe_py_parse(&plan_sig, args, nargs, kwnames, a) < 0) return NULL;
  int kind;
  int64_t rows, n;
  const int cuda = PyObject_IsTrue(a[3]);
  if (cuda < 0 || imoe_py_as_option(a[0], IMOE_OPTION_PLAN, "kind", &kind) < 0 ||
      imoe_py_as_int64(a[1], "rows", &rows) < 0 || imoe_py_as_int64(a[2], "n", &n) < 0)
    return NULL;
  const int64_t elems = imoe_plan_workspace_elems(
      (imoe_plan_kind)kind, cuda ? IMOE_DEVICE_CUDA : IMOE_DEVICE_CPU, rows, n);
  if (elems < 0) {
    PyErr_Format(PyExc_ValueError, "a plan workspace for %lld rows of %lld slots is too large",
                 (long long)rows, (long long)n);
    return NULL;
  }
  return PyLong_FromLongLong((long long)elems);
}

static imoe_py_signature paged_ws_sig = {
    "paged_workspace_elems", 3, {"num_blocks", "num_seqs", "max_blocks"}};

/* paged_workspace_elems(num_blocks, num_seqs, max_blocks) -> int. */
static IMOE_PY_FASTCALL(py_paged_workspace_elems) {
  (void)self;
  PyObject *a[3] = {NULL, NULL, NULL};
  int64_t v[3];
  if (imoe_py_parse(&paged_ws_sig, args, nargs, kwnames, a) < 0) return NULL;
  for (int i = 0; i < 3; ++i)
    if (imoe_py_as_int64(a[i], paged_ws_sig.names[i], &v[i]) < 0) return NULL;
  const int64_t elems = imoe_paged_workspace_elems(v[0], v[1], v[2]);
  if (elems < 0) {
    PyErr_Format(PyExc_ValueError, "a paged workspace for %lld blocks and %lld x %lld table "
                 "entries is too large", (long long)v[0], (long long)v[1], (long long)v[2]);
    return NULL;
  }
  return PyLong_FromLongLong((long long)elems);
}

static imoe_py_signature moe_ws_sig = {"moe_workspace_elems", 3,
                                       {"assignments", "capacity", "cuda"}};

/* moe_workspace_elems(assignments, capacity, cuda) -> int (capacity None: dropless). */
static IMOE_PY_FASTCALL(py_moe_workspace_elems) {
  (void)self;
  PyObject *a[3] = {NULL, NULL, NULL};
  int64_t assignments, capacity = -1;
  if (imoe_py_parse(&moe_ws_sig, args, nargs, kwnames, a) < 0 ||
      imoe_py_as_int64(a[0], "assignments", &assignments) < 0 ||
      (a[1] != Py_None && imoe_py_as_int64(a[1], "capacity", &capacity) < 0))
    return NULL;
  const int cuda = PyObject_IsTrue(a[2]);
  if (cuda < 0) return NULL;
  const int64_t elems = imoe_moe_workspace_elems(cuda ? IMOE_DEVICE_CUDA : IMOE_DEVICE_CPU,
                                                 assignments, capacity);
  if (elems < 0) {
    PyErr_Format(PyExc_ValueError, "moe_workspace_elems: %lld assignments are outside [0, 2^31 - 1]",
                 (long long)assignments);
    return NULL;
  }
  return PyLong_FromLongLong((long long)elems);
}

static PyObject *py_cuda_compiled(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyBool_FromLong(imoe_cuda_compiled());
}

static PyObject *py_cuda_device_count(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  int count;
  Py_BEGIN_ALLOW_THREADS
  count = imoe_cuda_device_count();
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(count);
}

/* exchanges(type) -> bool: see imoe_py_type_exchanges. */
static PyObject *py_exchanges(PyObject *self, PyObject *type) {
  (void)self;
  if (!PyType_Check(type)) {
    PyErr_Format(PyExc_TypeError, "exchanges() takes a type, got %.200s", Py_TYPE(type)->tp_name);
    return NULL;
  }
  return PyBool_FromLong(imoe_py_type_exchanges((PyTypeObject *)type));
}

/* ---- the module ---- */

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL | METH_KEYWORDS

static PyMethodDef methods[] = {
    {"compact", FASTCALL(imoe_py_compact),
     "compact(buffers, dims, row_ndims, *, scores=None, active_indices=None, capacity, "
     "protected_prefix=0, recent_window=0, nan='raise', order='inplace', out_indices, "
     "out_target_map=None, mode='swap', workspace=None, num_threads, stream=None) -> None\n\n"
     "imoe_compact: select, write the map into out_indices (and out_target_map) and apply it "
     "to every buffer in place."},
    {"build_map", FASTCALL(imoe_py_build_map),
     "build_map(*, scores=None, active_indices=None, capacity, protected_prefix=0, "
     "recent_window=0, nan='raise', order='inplace', num_slots=None, out_indices=None, "
     "out_target_map=None, workspace=None, num_threads, stream=None) -> None\n\n"
     "imoe_build_map: select and write the map; no buffer is touched."},
    {"apply_indices", FASTCALL(imoe_py_apply_indices),
     "apply_indices(buffers, dims, row_ndims, *, indices, order='inplace', mode='swap', "
     "workspace=None, num_threads, stream=None) -> None\n\n"
     "imoe_apply_indices: apply the map of an earlier compaction to every buffer in place."},
    {"apply_target_map", FASTCALL(imoe_py_apply_target_map),
     "apply_target_map(buffers, dims, row_ndims, *, target_map, mode='swap', num_threads, "
     "stream=None) -> None\n\nimoe_apply_target_map: apply an [lead..., N] involution."},
    {"restore", FASTCALL(imoe_py_restore),
     "restore(buffers, dims, row_ndims, *, indices, order='inplace', workspace=None, "
     "num_threads, stream=None) -> None\n\nimoe_restore: undo a swap compaction in place."},
    {"permute", FASTCALL(imoe_py_permute),
     "permute(buffers, dims, row_ndims, *, perm, inverse=False, workspace=None, num_threads, "
     "stream=None) -> None\n\nimoe_permute: new slot i takes old slot perm[i] (inverse: old "
     "slot i goes to perm[i])."},
    {"group_by_expert", FASTCALL(imoe_py_group_by_expert),
     "group_by_expert(buffers, dims, row_ndims, *, expert_ids, num_experts, out_offsets, "
     "out_perm=None, workspace=None, num_threads, stream=None) -> None\n\n"
     "imoe_group_by_expert: a stable counting sort of the slots by expert, in place."},
    {"paged_apply_target_map", FASTCALL(imoe_py_paged_apply_target_map),
     "paged_apply_target_map(buffers, dims, row_ndims, *, block_tables, target_map, "
     "mode='swap', workspace=None, num_threads, stream=None) -> None\n\n"
     "imoe_paged_apply_target_map: per-sequence involutions through block tables."},
    {"moe_dispatch", FASTCALL(imoe_py_moe_dispatch),
     "moe_dispatch(*, hidden, top_k_index, top_k_weights=None, num_experts, capacity=None, "
     "layout='grouped', skip_foreign=False, distinct=False, out_rows=None, out_offsets=None, "
     "out_dest=None, out_src=None, out_dropped=None, workspace=None, new_outputs=None, new=None, "
     "num_threads, stream=None) -> outputs or None\n\n"
     "imoe_moe_dispatch: the assignments sorted by expert (capacity: each expert's "
     "lowest-weight overflow dropped) and their tokens' rows gathered. Without out_*, "
     "new_outputs(hidden, num_experts, T, k, R) makes them once the reads are judged, and is "
     "returned; new(hidden, shape, dtype) makes the CUDA workspace (moe_workspace_elems: a "
     "capacity's, or a large dropless call's) when none is given."},
    {"moe_combine", FASTCALL(imoe_py_moe_combine),
     "moe_combine(*, rows, dest, weights, out=None, out_dtype=None, new=None, num_threads, "
     "stream=None) -> out\n\n"
     "imoe_moe_combine: out[t] = sum_j weights[t, j] * rows[dest[t, j]] (dest -1: nothing). "
     "Without out, new(rows, (T, H), out_dtype) makes it once the reads are judged."},
    {"gated_act", FASTCALL(imoe_py_gated_act),
     "gated_act(*, gate_up, out=None, act='silu', limit=None, new=None, num_threads, stream=None) "
     "-> out\n\nimoe_gated_act: out = act(gate_up[:, :I]) * gate_up[:, I:]."},
    {"grouped_gemm", FASTCALL(imoe_py_grouped_gemm),
     "grouped_gemm(*, a, w, offsets, out=None, new=None, num_threads, stream=None) -> out\n\n"
     "imoe_grouped_gemm: out[r] = a[r] @ w[e(r)] for r < offsets[-1] (e(r): the first e with "
     "offsets[e] > r)."},
    {"experts_gemm", FASTCALL(imoe_py_experts_gemm),
     "experts_gemm(*, x, w, offsets, src=None, act=None, out=None, new=None, num_threads, stream=None) "
     "-> out\n\n"
     "imoe_experts_gemm: y[r] = x[src[r]] @ w[e(r)] (x[r] without src) for r < offsets[-1]; out = y, "
     "or with act the gated activation of y: act(y[:, :N/2]) * y[:, N/2:]."},
    {"topk_softmax", FASTCALL(imoe_py_topk_softmax),
     "topk_softmax(*, logits, k, renormalize=True, out_weights=None, out_indices=None, "
     "out_dtype=None, index_dtype=None, new=None, num_threads, stream=None) -> (weights, indices)\n\n"
     "imoe_topk_softmax: per row of logits [T, E], softmax in fp32, the k largest (equal values "
     "in torch's CUDA topk order), divided by their sum when renormalize; torch's CUDA "
     "arithmetic."},
    {"gated_act_backward", FASTCALL(imoe_py_gated_act_backward),
     "gated_act_backward(*, gate_up, grad_act, out=None, act='silu', limit=None, row_scale=None, "
     "act_out=None, row_dot=None, new=None, num_threads, stream=None) -> out\n\n"
     "imoe_gated_act_backward: d(gate_up) of out = act(gate) * up (grad_act scaled per row by "
     "row_scale); act_out = out * row_scale and row_dot = <grad_act, out> per row when given."},
    {"moe_gather_rows", FASTCALL(imoe_py_moe_gather_rows),
     "moe_gather_rows(*, src, dest, weights=None, out=None, num_rows=None, out_dtype=None, "
     "new=None, num_threads, stream=None) -> out\n\n"
     "imoe_moe_gather_rows: out[dest[t, j]] = weights[t, j] * src[t], other rows zero."},
    {"moe_weight_grad", FASTCALL(imoe_py_moe_weight_grad),
     "moe_weight_grad(*, a, b, dest, out=None, a_by_row=False, out_dtype=None, new=None, "
     "num_threads, stream=None) -> out\n\n"
     "imoe_moe_weight_grad: out[t, j] = <a[t or dest[t, j]], b[dest[t, j]]>, 0 where dropped."},
    {"moe_workspace_elems", FASTCALL(py_moe_workspace_elems),
     "moe_workspace_elems(assignments, capacity, cuda) -> int\n\n"
     "imoe_moe_workspace_elems: int32 elements of moe_dispatch's workspace."},
    {"take_device_status", py_take_device_status, METH_VARARGS,
     "take_device_status(device_id, stream=None) -> int\n\n"
     "Synchronise the stream and return (and clear) the status of a data error that an "
     "earlier CUDA call recorded on the device (0: none)."},
    {"status_message", py_status_message, METH_VARARGS,
     "status_message(code) -> str\n\nThe description of an imoe_status code."},
    {"plan_workspace_elems", FASTCALL(py_plan_workspace_elems),
     "plan_workspace_elems(kind, rows, n, cuda) -> int\n\n"
     "imoe_plan_workspace_elems: int32 elements of a plan workspace (kind in PLAN_KINDS)."},
    {"paged_workspace_elems", FASTCALL(py_paged_workspace_elems),
     "paged_workspace_elems(num_blocks, num_seqs, max_blocks) -> int\n\n"
     "imoe_paged_workspace_elems: int32 elements of the paged workspace."},
    {"exchanges", py_exchanges, METH_O,
     "exchanges(type) -> bool\n\nWhether arrays of `type` are borrowed through DLPack's C "
     "exchange table (torch >= 2.10), which also gives their framework's current stream: a call "
     "on such arrays may pass stream='current'."},
    {"cuda_compiled", py_cuda_compiled, METH_NOARGS,
     "cuda_compiled() -> bool\n\nWhether this build has the CUDA launchers."},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> int\n\nimoe_cuda_device_count: the CUDA devices this build can run its "
     "kernels on now (0 without CUDA, a driver or such a device)."},
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

/* The names of an option's values, from the C API's one table. */
static int add_names(PyObject *module, const char *name, imoe_option option) {
  PyObject *names = imoe_py_option_names(option);
  if (names == NULL) return -1;
  if (PyModule_AddObject(module, name, names) < 0) {
    Py_DECREF(names);
    return -1;
  }
  return 0;
}

PyMODINIT_FUNC PyInit__C(void) {
  import_array();
  PyObject *module = PyModule_Create(&module_def);
  if (module == NULL) return NULL;
  if (PyModule_AddStringConstant(module, "__version__", IMOE_VERSION_STRING) < 0 ||
      PyModule_AddIntConstant(module, "MAX_LEAD_DIMS", IMOE_MAX_LEAD_DIMS) < 0 ||
      PyModule_AddIntConstant(module, "MAX_BUFFERS", IMOE_MAX_BUFFERS) < 0 ||
      add_names(module, "MODES", IMOE_OPTION_MODE) < 0 ||
      add_names(module, "ORDERS", IMOE_OPTION_ORDER) < 0 ||
      add_names(module, "NAN_POLICIES", IMOE_OPTION_NAN) < 0 ||
      add_names(module, "PLAN_KINDS", IMOE_OPTION_PLAN) < 0 ||
      add_names(module, "ACTS", IMOE_OPTION_ACT) < 0 ||
      add_names(module, "MOE_LAYOUTS", IMOE_OPTION_LAYOUT) < 0 ||
      add_names(module, "FLOAT_DTYPES", IMOE_OPTION_FLOAT) < 0 ||
      add_names(module, "INDEX_DTYPES", IMOE_OPTION_INDEX) < 0 ||
      PyModule_AddIntConstant(module, "MOE_MAX_EXPERTS", IMOE_MOE_MAX_EXPERTS) < 0 ||
      /* The most slots (N) a view may hold: the core's IMOE_MAX_SLOTS. */
      PyModule_AddIntConstant(module, "MAX_SLOTS", INT32_MAX) < 0 ||
      PyModule_AddIntConstant(module, "ROUTER_MAX_K", IMOE_ROUTER_MAX_K) < 0) {
    Py_DECREF(module);
    return NULL;
  }
  return module;
}
