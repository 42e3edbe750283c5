/*
 * ops.c: one function per operation of the C API. Each converts its keyword
 * arguments (parse.c), imports every array (call.c), builds the views and
 * calls the C API with the GIL released. The C core is the one judge of
 * every value, shape and option; what it refuses comes back as a status and
 * becomes the exception here. Every import is released on every path by
 * imoe_py_call_free.
 */
#include "binding.h"

#include <string.h>



/* An optional typed array: None leaves *view unused and returns 0 with
 * *present = 0. */
static int import_optional(imoe_py_call *c, PyObject *obj, const char *name, int written,
                           unsigned dtypes, const char *names, imoe_view *view, int *present) {
  *present = obj != Py_None;
  if (!*present) return 0;
  return imoe_py_call_import_typed(c, obj, name, written, dtypes, names, view);
}

/* ---- the selection: scores or active indices, and their options ---- */

enum { S_SCORES, S_ACTIVE, S_CAPACITY, S_PREFIX, S_WINDOW, S_NAN, S_ORDER, S_COUNT };
#define SELECTION_NAMES \
  "scores", "active_indices", "capacity", "protected_prefix", "recent_window", "nan", "order"
#define SELECTION_DEFAULTS(a, at)                      \
  do {                                                 \
    a[(at) + S_SCORES] = a[(at) + S_ACTIVE] = Py_None; \
    a[(at) + S_CAPACITY] = NULL;                       \
    a[(at) + S_PREFIX] = a[(at) + S_WINDOW] = Py_None; \
    a[(at) + S_NAN] = a[(at) + S_ORDER] = Py_None;     \
  } while (0)

/* s[S_*]: the selection's arguments (None: the option's default); view[0]
 * holds scores, view[1] active indices. */
static int read_selection(imoe_py_call *c, PyObject **s, imoe_view *view, imoe_selection *sel) {
  memset(sel, 0, sizeof *sel);
  int nan = IMOE_NAN_ERROR, order = IMOE_ORDER_INPLACE;
  if (imoe_py_as_int64(s[S_CAPACITY], "capacity", &sel->capacity) < 0 ||
      (s[S_PREFIX] != Py_None &&
       imoe_py_as_int64(s[S_PREFIX], "protected_prefix", &sel->protected_prefix) < 0) ||
      (s[S_WINDOW] != Py_None &&
       imoe_py_as_int64(s[S_WINDOW], "recent_window", &sel->recent_window) < 0) ||
      (s[S_NAN] != Py_None && imoe_py_as_option(s[S_NAN], IMOE_OPTION_NAN, "nan", &nan) < 0) ||
      (s[S_ORDER] != Py_None &&
       imoe_py_as_option(s[S_ORDER], IMOE_OPTION_ORDER, "order", &order) < 0))
    return -1;
  sel->nan_policy = (imoe_nan_policy)nan;
  sel->order = (imoe_order)order;
  /* Both are imported when both are given: the core refuses that. */
  int present;
  if (import_optional(c, s[S_SCORES], "scores", 0, FLOAT_DTYPES, FLOAT_NAMES, &view[0], &present) <
      0)
    return -1;
  if (present) sel->scores = &view[0];
  if (import_optional(c, s[S_ACTIVE], "active_indices", 0, INDEX_DTYPES, INDEX_NAMES, &view[1],
                      &present) < 0)
    return -1;
  if (present) sel->active = &view[1];
  return 0;
}

/* buffers, dims, row_ndims: the first three arguments of the functions that
 * move data. */
#define BUFFER_NAMES "buffers", "dims", "row_ndims"

static int read_workspace_and_finish(imoe_py_call *c, PyObject *workspace) {
  if (imoe_py_call_import_workspace(c, workspace) < 0) return -1;
  return imoe_py_call_finish(c);
}

/* ---- compact and build_map ---- */

/* The arguments into a (defaults on entry) and a call on a[stream] with a[threads]; NULL with
 * an exception set. */
static imoe_py_call *parse_call(imoe_py_signature *sig, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames, PyObject **a, int stream, int threads) {
  if (imoe_py_parse(sig, args, nargs, kwnames, a) < 0) return NULL;
  return imoe_py_call_new(a[stream], a[threads]);
}

static imoe_py_signature compact_sig = {
    "compact",
    16,
    {BUFFER_NAMES, SELECTION_NAMES, "out_indices", "out_target_map", "mode", "workspace",
     "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_compact) {
  (void)self;
  enum { BUFS, DIMS, ROWS, SEL, OUT_IDX = SEL + S_COUNT, OUT_MAP, MODE, WS, THREADS, STREAM };
  PyObject *a[16] = {NULL, NULL, NULL};
  SELECTION_DEFAULTS(a, SEL);
  a[OUT_IDX] = NULL;
  a[OUT_MAP] = a[WS] = a[STREAM] = a[MODE] = Py_None;
  a[THREADS] = Py_None;
  imoe_py_call *c = parse_call(&compact_sig, args, nargs, kwnames, a, STREAM, THREADS);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view sel_view[2], idx, map;
  imoe_selection sel;
  int mode = IMOE_MODE_SWAP, has_map;
  if ((a[MODE] != Py_None && imoe_py_as_option(a[MODE], IMOE_OPTION_MODE, "mode", &mode) < 0) ||
      imoe_py_call_import_buffers(c, a[BUFS], a[DIMS], a[ROWS]) < 0 ||
      read_selection(c, a + SEL, sel_view, &sel) < 0 ||
      imoe_py_call_import_typed(c, a[OUT_IDX], "out_indices", 1, INDEX_DTYPES, INDEX_NAMES, &idx) <
          0 ||
      import_optional(c, a[OUT_MAP], "out_target_map", 1, IMOE_DTYPE_BIT(IMOE_DTYPE_I32), "int32",
                      &map, &has_map) < 0 ||
      read_workspace_and_finish(c, a[WS]) < 0)
    goto done;
  IMOE_PY_CALL_C(
      c, result,
      imoe_compact(c->buffers, c->num_buffers, &sel, &idx, has_map ? &map : NULL, (imoe_mode)mode,
                   c->workspace, c->workspace_elems, &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}

static imoe_py_signature build_map_sig = {"build_map",
                                          13,
                                          {SELECTION_NAMES, "num_slots", "out_indices",
                                           "out_target_map", "workspace", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_build_map) {
  (void)self;
  enum { SEL, SLOTS = S_COUNT, OUT_IDX, OUT_MAP, WS, THREADS, STREAM };
  PyObject *a[13];
  SELECTION_DEFAULTS(a, SEL);
  a[OUT_IDX] = a[OUT_MAP] = a[WS] = a[STREAM] = a[SLOTS] = a[THREADS] = Py_None;
  imoe_py_call *c = parse_call(&build_map_sig, args, nargs, kwnames, a, STREAM, THREADS);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view sel_view[2], idx, map;
  imoe_selection sel;
  int has_idx, has_map;
  int64_t num_slots = 0;
  if (read_selection(c, a + SEL, sel_view, &sel) < 0 ||
      (a[SLOTS] != Py_None && imoe_py_as_int64(a[SLOTS], "num_slots", &num_slots) < 0) ||
      import_optional(c, a[OUT_IDX], "out_indices", 1, INDEX_DTYPES, INDEX_NAMES, &idx, &has_idx) <
          0 ||
      import_optional(c, a[OUT_MAP], "out_target_map", 1, IMOE_DTYPE_BIT(IMOE_DTYPE_I32), "int32",
                      &map, &has_map) < 0 ||
      read_workspace_and_finish(c, a[WS]) < 0)
    goto done;
  sel.num_slots = num_slots;
  IMOE_PY_CALL_C(c, result,
                 imoe_build_map(&sel, has_idx ? &idx : NULL, has_map ? &map : NULL, c->workspace,
                                c->workspace_elems, &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}

/* ---- applying a map: indices (any order), a target map, restore ---- */

enum { M_BUFS, M_DIMS, M_ROWS, M_MAP, M_ORDER, M_MODE, M_WS, M_THREADS, M_STREAM, M_COUNT };

static imoe_py_signature apply_indices_sig = {
    "apply_indices",
    M_COUNT,
    {BUFFER_NAMES, "indices", "order", "mode", "workspace", "num_threads", "stream"}};
static imoe_py_signature restore_sig = {
    "restore",
    M_COUNT,
    {BUFFER_NAMES, "indices", "order", "mode", "workspace", "num_threads", "stream"}};
static imoe_py_signature apply_target_map_sig = {
    "apply_target_map",
    M_COUNT,
    {BUFFER_NAMES, "target_map", "order", "mode", "workspace", "num_threads", "stream"}};

enum apply_kind { APPLY_INDICES, APPLY_TARGET_MAP, RESTORE };

static PyObject *apply(enum apply_kind kind, imoe_py_signature *sig, PyObject *const *args,
                       Py_ssize_t nargs, PyObject *kwnames) {
  PyObject *a[M_COUNT] = {NULL, NULL, NULL, NULL, Py_None, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(sig, args, nargs, kwnames, a) < 0) return NULL;
  int order = IMOE_ORDER_INPLACE, mode = IMOE_MODE_SWAP;
  if ((a[M_ORDER] != Py_None &&
       imoe_py_as_option(a[M_ORDER], IMOE_OPTION_ORDER, "order", &order) < 0) ||
      (a[M_MODE] != Py_None && imoe_py_as_option(a[M_MODE], IMOE_OPTION_MODE, "mode", &mode) < 0))
    return NULL;
  if (kind == APPLY_TARGET_MAP && order != IMOE_ORDER_INPLACE) {
    PyErr_SetString(PyExc_ValueError,
                    "order: a target_map is the map of order 'inplace'; an ordered compaction "
                    "is applied from its indices");
    return NULL;
  }
  imoe_py_call *c = imoe_py_call_new(a[M_STREAM], a[M_THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view map;
  if (imoe_py_call_import_buffers(c, a[M_BUFS], a[M_DIMS], a[M_ROWS]) < 0 ||
      imoe_py_call_import_typed(c, a[M_MAP], sig->names[M_MAP], 0, INDEX_DTYPES, INDEX_NAMES,
                                &map) < 0 ||
      read_workspace_and_finish(c, a[M_WS]) < 0)
    goto done;
  const imoe_order ord = (imoe_order)order;
  switch (kind) {
    case APPLY_INDICES:
      IMOE_PY_CALL_C(c, result,
                     imoe_apply_indices(c->buffers, c->num_buffers, &map, ord, (imoe_mode)mode,
                                        c->workspace, c->workspace_elems, &c->exec, &c->err));
      break;
    case APPLY_TARGET_MAP:
      IMOE_PY_CALL_C(c, result,
                     imoe_apply_target_map(c->buffers, c->num_buffers, &map, (imoe_mode)mode,
                                           &c->exec, &c->err));
      break;
    default:
      IMOE_PY_CALL_C(c, result,
                     imoe_restore(c->buffers, c->num_buffers, &map, ord, c->workspace,
                                  c->workspace_elems, &c->exec, &c->err));
      break;
  }
done:
  imoe_py_call_free(c);
  return result;
}

IMOE_PY_FASTCALL(imoe_py_apply_indices) {
  (void)self;
  return apply(APPLY_INDICES, &apply_indices_sig, args, nargs, kwnames);
}

IMOE_PY_FASTCALL(imoe_py_apply_target_map) {
  (void)self;
  return apply(APPLY_TARGET_MAP, &apply_target_map_sig, args, nargs, kwnames);
}

IMOE_PY_FASTCALL(imoe_py_restore) {
  (void)self;
  return apply(RESTORE, &restore_sig, args, nargs, kwnames);
}

/* ---- permutations and grouping ---- */

static imoe_py_signature permute_sig = {
    "permute", 8, {BUFFER_NAMES, "perm", "inverse", "workspace", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_permute) {
  (void)self;
  enum { BUFS, DIMS, ROWS, PERM, INVERSE, WS, THREADS, STREAM };
  PyObject *a[8] = {NULL, NULL, NULL, NULL, Py_False, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&permute_sig, args, nargs, kwnames, a) < 0) return NULL;
  const int inverse = PyObject_IsTrue(a[INVERSE]);
  if (inverse < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view perm;
  if (imoe_py_call_import_buffers(c, a[BUFS], a[DIMS], a[ROWS]) < 0 ||
      imoe_py_call_import_typed(c, a[PERM], "perm", 0, INDEX_DTYPES, INDEX_NAMES, &perm) < 0 ||
      read_workspace_and_finish(c, a[WS]) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result,
                 imoe_permute(c->buffers, c->num_buffers, &perm, inverse, c->workspace,
                              c->workspace_elems, &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}

static imoe_py_signature group_sig = {"group_by_expert",
                                      10,
                                      {BUFFER_NAMES, "expert_ids", "num_experts", "out_offsets",
                                       "out_perm", "workspace", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_group_by_expert) {
  (void)self;
  enum { BUFS, DIMS, ROWS, IDS, EXPERTS, OFFSETS, PERM, WS, THREADS, STREAM };
  PyObject *a[10] = {NULL, NULL, NULL, NULL, NULL, NULL, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&group_sig, args, nargs, kwnames, a) < 0) return NULL;
  int64_t num_experts;
  if (imoe_py_as_int64(a[EXPERTS], "num_experts", &num_experts) < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view ids, offsets, perm;
  int has_perm;
  if (imoe_py_call_import_buffers(c, a[BUFS], a[DIMS], a[ROWS]) < 0 ||
      imoe_py_call_import_typed(c, a[IDS], "expert_ids", 0, INDEX_DTYPES, INDEX_NAMES, &ids) < 0 ||
      imoe_py_call_import_typed(c, a[OFFSETS], "out_offsets", 1, INDEX_DTYPES, INDEX_NAMES,
                                &offsets) < 0 ||
      import_optional(c, a[PERM], "out_perm", 1, INDEX_DTYPES, INDEX_NAMES, &perm, &has_perm) < 0 ||
      read_workspace_and_finish(c, a[WS]) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result,
                 imoe_group_by_expert(c->buffers, c->num_buffers, &ids, num_experts, &offsets,
                                      has_perm ? &perm : NULL, c->workspace, c->workspace_elems,
                                      &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}
