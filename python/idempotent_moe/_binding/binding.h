/*
 * binding.h: what the files of the CPython binding share.
 *
 *   import.c  array objects (NumPy, __dlpack__, DLPack capsules) in, and
 *             released again exactly once
 *   views.c   imoe_view from an import, and the checks that need only views
 *   errors.c  imoe_status and export failures to Python exceptions
 *   call.c    the per-call state: stream, threads, imports, buffers, workspace
 *   parse.c   keyword arguments and scalar conversions (the named seam)
 *   ops.c     one function per C API operation: convert, import, call
 *   paged.c   the paged operation
 *   module.c  the method table, the exported constants, module init
 *
 * Every function that can fail returns -1 (or NULL) with a Python exception
 * set, and 0 (or a pointer) on success. Every one runs with the GIL held.
 */
#ifndef IMOE_BINDING_H
#define IMOE_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "dlpack_abi.h"
#include "idempotent_moe.h"

/* Most imports of one call: the buffers plus the selection or map views, up
 * to two outputs and a workspace. */
#define IMOE_MAX_IMPORTS (IMOE_MAX_BUFFERS + 4)

/* The typed dtypes the entry points take, and their names for messages. */
#define FLOAT_DTYPES                                                 \
  (IMOE_DTYPE_BIT(IMOE_DTYPE_F32) | IMOE_DTYPE_BIT(IMOE_DTYPE_F16) | \
   IMOE_DTYPE_BIT(IMOE_DTYPE_BF16))
#define FLOAT_NAMES "float32, float16 or bfloat16"
#define INDEX_DTYPES (IMOE_DTYPE_BIT(IMOE_DTYPE_I32) | IMOE_DTYPE_BIT(IMOE_DTYPE_I64))
#define INDEX_NAMES "int32 or int64"

/* Most axes an imported array may have: IMOE_MAX_LEAD_DIMS lead axes, the slot
 * axis, and room for a row split over many axes. */
#define IMOE_MAX_NDIM 32

/* One imported array, normalised: byte strides, byte offset applied. */
typedef struct imoe_import {
  char name[32];         /* the Python argument: "scores", "buffers[1]" */
  int32_t dtype_code;    /* DLPack's dtype code and bits, and whether a NumPy */
  int32_t dtype_swapped; /* array's bytes are swapped: imoe_py_dtype_name */
  int64_t dtype_bits;    /* names them for messages */
  char *data;
  int32_t ndim;
  int64_t shape[IMOE_MAX_NDIM];
  int64_t strides[IMOE_MAX_NDIM]; /* bytes */
  int64_t itemsize;               /* bytes */
  imoe_dtype dtype;               /* a typed dtype, or BYTES for any other */
  DLDevice device;                /* NumPy arrays are kDLCPU */

  /* What release gives back; at most one is set. */
  PyObject *ref;                       /* a reference: a NumPy array, or a tensor
                                        * whose DLTensor was borrowed */
  DLManagedTensor *legacy;             /* owned: its deleter runs once */
  DLManagedTensorVersioned *versioned; /* owned: its deleter runs once */
} imoe_import;

/* The imports of one call; zero it before the first import. */
typedef struct imoe_imports {
  int count;
  /* Borrowed: the consumer's stream, passed to every __dlpack__(stream=...):
   * None for host memory, else the DLPack stream value of the stream the
   * call is launched on (1: legacy default, 2: per-thread, > 2: a handle),
   * or "current": the arrays' framework's current stream on their device,
   * read through its DLPack exchange table by the first CUDA array. */
  PyObject *stream;
  int current;          /* stream is "current" */
  int has_current;      /* ... and a CUDA array has named it: */
  void *current_handle; /* the cudaStream_t (1: the legacy default) */
  imoe_import item[IMOE_MAX_IMPORTS];
} imoe_imports;

/* ---- import.c ---- */

/*
 * Imports obj as set's next record, named `name`. `written`: the call writes
 * the array, so read-only and copied exports are refused (BufferError). On
 * failure the record may already own something: imoe_py_release_imports frees it.
 */
imoe_import *imoe_py_import_array(imoe_imports *set, PyObject *obj, const char *name, int written);

/* Releases every import of set exactly once; keeps any pending exception. */
void imoe_py_release_imports(imoe_imports *set);

/* Whether tensors of `type` are borrowed through a DLPack C exchange table
 * (case 3 of import.c), which also names their framework's current stream. */
int imoe_py_type_exchanges(PyTypeObject *type);

/* The dtype of im for a message ("float32", "uint8", "bfloat16", "float8_e4m3fn",
 * with " (byte-swapped)" for a swapped NumPy array), written into out. Named
 * only when a message needs it: a call that succeeds formats nothing. */
void imoe_py_dtype_name(const imoe_import *im, char *out, size_t size);

/* ---- views.c ---- */

/* [lead..., n, row] of a buffer: slot axis `dim`, the last `row_ndim` axes the
 * row. dim and row_ndim are in range (module.c checks them). */
int imoe_py_buffer_view(const imoe_import *im, int64_t dim, int64_t row_ndim, imoe_view *view);

/* [lead..., n] of a typed array: the last axis is the slot axis. `accepted`
 * is a mask of IMOE_DTYPE_BIT(...), `accepted_names` says it in words. */
int imoe_py_typed_view(const imoe_import *im, unsigned accepted, const char *accepted_names,
                       imoe_view *view);

/* Fills exec with the one device of every import (ValueError for mixed
 * devices, an unknown device, or CUDA in a build without it). */
int imoe_py_exec_for(const imoe_imports *set, int32_t num_threads, imoe_exec *exec);

/* ValueError unless obj is None, "current" or a DLPack stream value (-1, 1,
 * 2 or > 2). */
int imoe_py_check_stream(PyObject *obj);

/* Whether obj is the stream "current" (the framework's current stream). */
int imoe_py_is_current_stream(PyObject *obj);

/* The cudaStream_t (as void *) that a DLPack stream value names. */
void *imoe_py_stream_handle(PyObject *obj);

/* ---- errors.c ---- */

/* Raises the exception for a failing status; returns NULL. */
PyObject *imoe_py_raise_status(imoe_status status, const imoe_error *err);

/* Replaces the pending exception by `type` with "<name> <what>: <message>",
 * keeping the original as __cause__. Returns NULL. */
PyObject *imoe_py_reraise_as(PyObject *type, const char *name, const char *what);

/* ---- call.c ---- */

/* Everything one call imports and builds; large, so on the heap. */
typedef struct imoe_py_call {
  imoe_imports imports;
  imoe_view buffers[IMOE_MAX_BUFFERS];
  int32_t num_buffers;
  /* Tuples made from the buffers, dims and row_ndims lists: __dlpack__ runs
   * Python code, which must not be able to free an item under us. */
  PyObject *held[3];
  int32_t *workspace; /* the caller's plan workspace, or NULL */
  int64_t workspace_elems;
  int32_t threads; /* 0: the OpenMP default */
  imoe_exec exec;  /* set by imoe_py_call_finish */
  imoe_error err;  /* the C API's message for this call */
} imoe_py_call;

/* A call on `stream` (None or a DLPack stream value) with num_threads (an
 * int; <= 0: the default; ValueError above INT32_MAX). */
imoe_py_call *imoe_py_call_new(PyObject *stream, PyObject *num_threads);

/* The one cleanup: every import released once, whatever happened. */
void imoe_py_call_free(imoe_py_call *c);

/* Imports obj; a written one is checked for self-overlap and remembered. */
imoe_import *imoe_py_call_import(imoe_py_call *c, PyObject *obj, const char *name, int written);

/* imoe_py_call_import, then the typed view (see imoe_py_typed_view). */
int imoe_py_call_import_typed(imoe_py_call *c, PyObject *obj, const char *name, int written,
                              unsigned accepted, const char *accepted_names, imoe_view *view);

/* A list or tuple argument (TypeError otherwise), held by c as a tuple in
 * held[slot]; `of` says what it holds. Returns the tuple (borrowed). */
PyObject *imoe_py_call_hold(imoe_py_call *c, int slot, PyObject *obj, const char *name,
                            const char *of);

/* buffers, dims and row_ndims held as held[0], held[1] and held[2]. */
int imoe_py_call_hold_buffer_args(imoe_py_call *c, PyObject *buffers, PyObject *dims,
                                  PyObject *row_ndims);

/* tuple[i] as an int (TypeError names it "<name>[i]"). */
int imoe_py_int_item(PyObject *tuple, Py_ssize_t i, const char *name, int64_t *out);

/* buffers[b] as [lead..., N, row_b] views in c->buffers: one lead shape and N
 * for all. */
int imoe_py_call_import_buffers(imoe_py_call *c, PyObject *buffers, PyObject *dims,
                                PyObject *row_ndims);

/* The plan workspace: None, or a C-contiguous int32 array of any shape. */
int imoe_py_call_import_workspace(imoe_py_call *c, PyObject *obj);

/* The checks that span all arrays (distinct outputs), then the one device
 * they share into c->exec. */
int imoe_py_call_finish(imoe_py_call *c);

/* Outputs a call allocates. An operation whose outputs are not given takes
 * `new`, a callable new(like, shape, dtype) -> array (dtype a str, or None
 * for like's dtype; _moe_core.empty): the binding calls it only once the
 * arguments it reads are judged (the C core's *_shape functions), so a call
 * that raises has allocated nothing. */

/* TypeError unless new is callable. */
int imoe_py_check_new(PyObject *new_fn);

/* For an output not given: TypeError unless new is callable ("fname() needs
 * out, or new to make it" for None). */
int imoe_py_check_new_output(PyObject *new_fn, const char *fname, const char *out);

/* The output given (a new reference), or NULL (None: to be made). */
PyObject *imoe_py_given(PyObject *out);

/* The C core's verdict on what a call reads (a *_shape function): 0, or -1
 * with its exception set (status taken from c->err). */
int imoe_py_judged(imoe_py_call *c, imoe_status status);

/* ValueError when an output given has another dtype than `dtype` (the name
 * imoe_py_as_dtype gave for argument `arg`; NULL: none asked). */
int imoe_py_check_out_dtype(const imoe_view *out, const char *out_name, imoe_option option,
                            const char *dtype, const char *arg);

/* result (the None of IMOE_PY_CALL_C, or NULL) replaced by *out, which it
 * takes over: the output a function returns. */
PyObject *imoe_py_returning(PyObject *result, PyObject **out);

/* The call's judgement so far (the device of every import) and new(like,
 * shape, dtype): a new reference, or NULL with an exception set. */
PyObject *imoe_py_call_new_array(imoe_py_call *c, PyObject *new_fn, PyObject *like,
                                 const int64_t *shape, int ndim, const char *dtype);

/* ---- parse.c ---- */

/* The names a function takes, in positional order; interned on first use. */
#define IMOE_PY_MAX_PARAMS 20
typedef struct imoe_py_signature {
  const char *fname;
  int count;
  const char *names[IMOE_PY_MAX_PARAMS];
  PyObject *interned[IMOE_PY_MAX_PARAMS];
} imoe_py_signature;

/* Fills out[0..sig->count) from a METH_FASTCALL | METH_KEYWORDS call; out[i]
 * holds the default on entry (NULL: required). The results are borrowed. */
int imoe_py_parse(imoe_py_signature *sig, PyObject *const *args, Py_ssize_t nargs,
                  PyObject *kwnames, PyObject **out);

/* An int (or __index__) into *out: TypeError for other types (a float is
 * never truncated), ValueError beyond 64 bits. */
int imoe_py_as_int64(PyObject *obj, const char *name, int64_t *out);

/* A str naming a value of `option` (TypeError for other types; the C core's
 * ValueError for a name it does not know). */
int imoe_py_as_option(PyObject *obj, imoe_option option, const char *name, int *out);

/* An output dtype named by obj: NULL for None, else the name (a value of
 * IMOE_OPTION_FLOAT or IMOE_OPTION_INDEX: TypeError for a non-str, the C
 * core's ValueError for another name). The name lives as long as obj. */
int imoe_py_as_dtype(PyObject *obj, imoe_option option, const char *name, const char **out);

/* The names of an option's values, as a tuple of str. */
PyObject *imoe_py_option_names(imoe_option option);

/* ---- ops.c and paged.c: the functions of the module ---- */

#define IMOE_PY_FASTCALL(name) \
  PyObject *name(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
IMOE_PY_FASTCALL(imoe_py_compact);
IMOE_PY_FASTCALL(imoe_py_build_map);
IMOE_PY_FASTCALL(imoe_py_apply_indices);
IMOE_PY_FASTCALL(imoe_py_apply_target_map);
IMOE_PY_FASTCALL(imoe_py_restore);
IMOE_PY_FASTCALL(imoe_py_permute);
IMOE_PY_FASTCALL(imoe_py_group_by_expert);
IMOE_PY_FASTCALL(imoe_py_paged_apply_target_map);
IMOE_PY_FASTCALL(imoe_py_moe_dispatch);
IMOE_PY_FASTCALL(imoe_py_moe_combine);
IMOE_PY_FASTCALL(imoe_py_gated_act);
IMOE_PY_FASTCALL(imoe_py_grouped_gemm);
IMOE_PY_FASTCALL(imoe_py_experts_gemm);
/* moe_backward.c */
IMOE_PY_FASTCALL(imoe_py_gated_act_backward);
IMOE_PY_FASTCALL(imoe_py_moe_gather_rows);
IMOE_PY_FASTCALL(imoe_py_moe_weight_grad);
IMOE_PY_FASTCALL(imoe_py_topk_softmax);

/* The result of a C API call: None, or the exception of its status. */
PyObject *imoe_py_done(imoe_status status, const imoe_error *err);

/* Runs `expr`, a C API call that reports into &c->err, with the GIL
 * released, and sets result to None or the exception of its status. */
#define IMOE_PY_CALL_C(c, result, expr) \
  do {                                   \
    imoe_status status_;                 \
    (c)->err.message[0] = '\0';          \
    Py_BEGIN_ALLOW_THREADS               \
    status_ = (expr);                    \
    Py_END_ALLOW_THREADS                 \
    (result) = imoe_py_done(status_, &(c)->err); \
  } while (0)

#endif /* IMOE_BINDING_H */
