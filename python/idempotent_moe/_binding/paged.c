/*
 * paged.c: paged_apply_target_map, the binding of imoe_paged_apply_target_map
 * (compaction through block tables; csrc/paged.c). Registered in module.c's
 * method table; the per-call state comes from call.c, views from views.c.
 */
#include "binding.h"

/* The pools as [num_blocks, lead..., block_size, row] views in c->buffers. */
static int import_pools(imoe_py_call *c, PyObject *buffers, PyObject *dims, PyObject *row_ndims) {
  if (imoe_py_call_hold_buffer_args(c, buffers, dims, row_ndims) < 0) return -1;
  PyObject *bufs = c->held[0], *dim_t = c->held[1], *row_t = c->held[2];
  Py_ssize_t count = PyTuple_GET_SIZE(bufs);
  if (count < 1 || count > IMOE_MAX_BUFFERS || PyTuple_GET_SIZE(dim_t) != count ||
      PyTuple_GET_SIZE(row_t) != count) {
    PyErr_Format(PyExc_ValueError,
                 "buffers must hold 1 to %d pools, with one dims and row_ndims entry each",
                 IMOE_MAX_BUFFERS);
    return -1;
  }
  for (Py_ssize_t b = 0; b < count; ++b) {
    const char *name = imoe_buffer_name((int32_t)b);
    int64_t dim, rows;
    if (imoe_py_int_item(dim_t, b, "dims", &dim) < 0 ||
        imoe_py_int_item(row_t, b, "row_ndims", &rows) < 0)
      return -1;
    imoe_import *im = imoe_py_call_import(c, PyTuple_GET_ITEM(bufs, b), name, 1);
    if (im == NULL) return -1;
    /* Axis 0 is the block axis: the slot axis comes after it, the row after that. */
    if (dim < 1 || rows < 0 || dim + rows >= im->ndim) {
      PyErr_Format(PyExc_ValueError,
                   "%s: the slot axis (dims[%zd] = %lld) must lie after the block axis 0 and "
                   "before the last row_ndims[%zd] = %lld row axes of its %d axes",
                   name, b, (long long)dim, b, (long long)rows, (int)im->ndim);
      return -1;
    }
    if (imoe_py_buffer_view(im, dim, rows, &c->buffers[b]) < 0) return -1;
  }
  c->num_buffers = (int32_t)count;
  return 0;
}

static imoe_py_signature paged_sig = {"paged_apply_target_map",
                                      9,
                                      {"buffers", "dims", "row_ndims", "block_tables", "target_map",
                                       "mode", "workspace", "num_threads", "stream"}};

/* paged_apply_target_map(buffers, dims, row_ndims, block_tables, target_map,
 * mode="swap", workspace=None, num_threads, stream=None): workspace is int32,
 * C-contiguous, at least imoe_paged_workspace_elems(...) elements (required
 * on CUDA). */
IMOE_PY_FASTCALL(imoe_py_paged_apply_target_map) {
  (void)self;
  enum { BUFS, DIMS, ROWS, TABLES, MAP, MODE, WS, THREADS, STREAM };
  PyObject *a[9] = {NULL, NULL, NULL, NULL, NULL, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&paged_sig, args, nargs, kwnames, a) < 0) return NULL;
  int mode = IMOE_MODE_SWAP;
  if (a[MODE] != Py_None && imoe_py_as_option(a[MODE], IMOE_OPTION_MODE, "mode", &mode) < 0)
    return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;

  PyObject *result = NULL;
  imoe_view tables, map;
  if (import_pools(c, a[BUFS], a[DIMS], a[ROWS]) < 0 ||
      imoe_py_call_import_typed(c, a[TABLES], "block_tables", 0, INDEX_DTYPES, INDEX_NAMES,
                                &tables) < 0 ||
      imoe_py_call_import_typed(c, a[MAP], "target_map", 0, INDEX_DTYPES, INDEX_NAMES, &map) < 0 ||
      imoe_py_call_import_workspace(c, a[WS]) < 0 || imoe_py_call_finish(c) < 0)
    goto done;

  IMOE_PY_CALL_C(
      c, result,
      imoe_paged_apply_target_map(c->buffers, c->num_buffers, &tables, &map, (imoe_mode)mode,
                                  c->workspace, c->workspace_elems, &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}
