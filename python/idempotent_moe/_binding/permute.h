/*
 * permute.h: the binding's functions of the permutation engine (permute.c):
 * permute, apply_ordered, compact_ordered, build_map_ordered,
 * group_by_expert. module.c lists them in its method table through
 * IMOE_PERMUTE_METHODS.
 */
#ifndef IMOE_BINDING_PERMUTE_H
#define IMOE_BINDING_PERMUTE_H

#include "binding.h"

PyObject *imoe_py_permute(PyObject *self, PyObject *args);
PyObject *imoe_py_apply_ordered(PyObject *self, PyObject *args);
PyObject *imoe_py_compact_ordered(PyObject *self, PyObject *args);
PyObject *imoe_py_build_map_ordered(PyObject *self, PyObject *args);
PyObject *imoe_py_group_by_expert(PyObject *self, PyObject *args);

#define IMOE_PERMUTE_METHODS                                                                     \
  {"permute", imoe_py_permute, METH_VARARGS,                                                     \
   "permute(buffers, dims, row_ndims, perm, inverse, workspace, num_threads, stream=None) "      \
   "-> None\n\nPermute the slots of every buffer in place (new slot i takes old slot "           \
   "perm[i]; inverse: old slot i goes to perm[i])."},                                            \
      {"apply_ordered", imoe_py_apply_ordered, METH_VARARGS,                                     \
       "apply_ordered(buffers, dims, row_ndims, indices, mode, restore, workspace, num_threads, " \
       "stream=None) -> None\n\nApply (or, with restore, undo) the permutation of an ordered "   \
       "compaction: indices ++ the other slots ascending."},                                     \
      {"compact_ordered", imoe_py_compact_ordered, METH_VARARGS,                                 \
       "compact_ordered(buffers, dims, row_ndims, scores, active, out_indices, capacity, "        \
       "protected_prefix, recent_window, nan_lowest, mode, order, workspace, num_threads, "      \
       "stream=None) -> None\n\nCompact with the kept slots in order 1 (stable) or 2 (score)."}, \
      {"build_map_ordered", imoe_py_build_map_ordered, METH_VARARGS,                             \
       "build_map_ordered(scores, active, out_indices, n, capacity, protected_prefix, "          \
       "recent_window, nan_lowest, order, workspace, num_threads, stream=None) -> None\n\nThe "  \
       "kept slots of every row in order into out_indices."},                                    \
      {"group_by_expert", imoe_py_group_by_expert, METH_VARARGS,                                 \
       "group_by_expert(buffers, dims, row_ndims, expert_ids, num_experts, out_offsets, "        \
       "out_perm, workspace, num_threads, stream=None) -> None\n\nGroup the slots of every "     \
       "buffer by expert in place (stable counting sort)."},

#endif /* IMOE_BINDING_PERMUTE_H */
