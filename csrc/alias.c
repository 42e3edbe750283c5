/* alias.c: which bytes a view reaches, and the aliasing rules of a call.
 *
 * A view reaches row_bytes contiguous bytes at every (lead..., slot)
 * coordinate. Two tests follow from that, both sufficient (they may refuse a
 * layout that happens not to overlap, never accept one that does):
 *   - a written view must not reach a byte twice (imoe_check_writable), the
 *     NumPy test: with the axes sorted by |stride|, each stride spans at
 *     least every byte the faster axes reach;
 *   - two views share no byte when their extents are disjoint, or when every
 *     byte of each is `lo + k * period + [0, block)` for a common period
 *     and the blocks fall into disjoint residues (K and V as the halves of
 *     one fused tensor).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "imoe_internal.h"

/* One argument of a call, with its byte extent [lo, hi) once computed. */
typedef struct imoe_alias_arg {
  const imoe_view *view;
  const char *name;
  int index; /* >= 0: the message says name[index] */
  int written;
  int is_buffer;
  int may_be_a_buffer;
  int empty;
  int64_t lo, hi;
} imoe_alias_arg;

typedef struct axis {
  int64_t shape, stride; /* stride as |stride| */
} axis;

static int64_t abs64(int64_t x) {
  return x < 0 ? -x : x;
}

static int64_t gcd64(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

int imoe_view_is_empty(const imoe_view *v) {
  if (v->n == 0) return 1;
  for (int32_t d = 0; d < v->lead_ndim; d++)
    if (v->lead_shape[d] == 0) return 1;
  return 0;
}

/* The axes of extent > 1, sorted by |stride| (insertion sort: at most 9). */
static int sorted_axes(const imoe_view *v, axis *out) {
  int count = 0;
  for (int32_t d = -1; d < v->lead_ndim; d++) {
    const int64_t shape = d < 0 ? v->n : v->lead_shape[d];
    const int64_t stride = abs64(d < 0 ? v->n_stride : v->lead_stride[d]);
    if (shape <= 1) continue;
    int j = count++;
    while (j > 0 && out[j - 1].stride > stride) {
      out[j] = out[j - 1];
      j--;
    }
    out[j] = (axis){shape, stride};
  }
  return count;
}

imoe_status imoe_check_writable(const imoe_view *v, const char *name, imoe_error *err) {
  if (imoe_view_is_empty(v)) return IMOE_OK; /* nothing is written */
  axis axes[IMOE_MAX_LEAD_DIMS + 1];
  const int count = sorted_axes(v, axes);
  int64_t span = v->row_bytes; /* bytes reached by the axes taken so far */
  for (int i = 0; i < count; i++) {
    if (axes[i].stride == 0) {
      return imoe_fail(err, IMOE_ERR_ARGUMENT,
                       "%s has a zero stride on an axis of size %" PRId64
                       " (broadcast or expanded memory): its elements overlap, so it cannot be "
                       "written in place",
                       name, axes[i].shape);
    }
    if (axes[i].stride < span) {
      return imoe_fail(err, IMOE_ERR_ARGUMENT,
                       "%s has overlapping elements (a stride of %" PRId64
                       " bytes inside the %" PRId64
                       " bytes its faster axes span); writing it in place would alias",
                       name, axes[i].stride, span);
    }
    span += axes[i].stride * (axes[i].shape - 1); /* fits: checked by imoe_check_view */
  }
  return IMOE_OK;
}

/* First and one-past-last byte of a non-empty view. */
static void extent(const imoe_view *v, int64_t *lo, int64_t *hi) {
  int64_t low = 0, high = v->row_bytes;
  for (int32_t d = -1; d < v->lead_ndim; d++) {
    const int64_t shape = d < 0 ? v->n : v->lead_shape[d];
    const int64_t reach = (d < 0 ? v->n_stride : v->lead_stride[d]) * (shape - 1);
    if (reach < 0) low += reach;
    else high += reach;
  }
  *lo = (int64_t)(intptr_t)v->data + low;
  *hi = (int64_t)(intptr_t)v->data + high;
}

/* Every byte of v is data + k * period + [0, block): block is the innermost
 * contiguous run, period the gcd of the other strides (0: none). */
static void block_and_period(const imoe_view *v, int64_t *block, int64_t *period) {
  axis axes[IMOE_MAX_LEAD_DIMS + 1];
  const int count = sorted_axes(v, axes);
  int64_t run = v->row_bytes, g = 0;
  int i = 0;
  for (; i < count && axes[i].stride == run; i++) run *= axes[i].shape;
  for (; i < count; i++) g = gcd64(g, axes[i].stride);
  *block = run;
  *period = g;
}

static int may_overlap(const imoe_alias_arg *a, const imoe_alias_arg *b) {
  if (a->hi <= b->lo || b->hi <= a->lo) return 0;
  int64_t a_block, b_block, a_period, b_period;
  block_and_period(a->view, &a_block, &a_period);
  block_and_period(b->view, &b_block, &b_period);
  const int64_t period = gcd64(a_period, b_period);
  if (period == 0) return 1;
  /* From the lowest byte: with |strides|, every byte is lo + sum(j * |s|). */
  int64_t shift = (b->lo - a->lo) % period;
  if (shift < 0) shift += period;
  return !(shift >= a_block && shift + b_block <= period);
}

/* Scores that are one of the buffers, slot for slot: the selection is read
 * in full before anything moves, so "tokens and their scores" compacted
 * together is well defined. */
static int same_slots(const imoe_view *a, const imoe_view *b) {
  if (a->data != b->data || a->n != b->n || a->n_stride != b->n_stride ||
      a->row_bytes != b->row_bytes || a->lead_ndim != b->lead_ndim)
    return 0;
  for (int32_t d = 0; d < a->lead_ndim; d++)
    if (a->lead_shape[d] != b->lead_shape[d] || a->lead_stride[d] != b->lead_stride[d]) return 0;
  return 1;
}

static void arg_name(const imoe_alias_arg *a, char *out, size_t size) {
  if (a->index >= 0) snprintf(out, size, "%s[%d]", a->name, a->index);
  else snprintf(out, size, "%s", a->name);
}

static imoe_status check_aliasing(imoe_alias_arg *args, int count, imoe_error *err) {
  for (int i = 0; i < count; i++) {
    imoe_alias_arg *a = &args[i];
    a->empty = a->view == NULL || imoe_view_is_empty(a->view);
    if (!a->empty) extent(a->view, &a->lo, &a->hi);
  }
  for (int i = 0; i < count; i++) {
    const imoe_alias_arg *a = &args[i];
    if (a->empty) continue;
    for (int j = 0; j < i; j++) {
      const imoe_alias_arg *b = &args[j];
      if (b->empty || (!a->written && !b->written)) continue;
      if (!may_overlap(a, b)) continue;
      const imoe_alias_arg *read = a->written ? b : a, *written = a->written ? a : b;
      if (!read->written && read->may_be_a_buffer && written->is_buffer &&
          same_slots(read->view, written->view))
        continue;
      char first[48], second[48];
      if (a->written && b->written) {
        arg_name(b, first, sizeof first);
        arg_name(a, second, sizeof second);
        return imoe_fail(err, IMOE_ERR_ARGUMENT,
                         "%s and %s overlap in memory; the call writes both, so they must not "
                         "share a byte",
                         first, second);
      }
      arg_name(read, first, sizeof first);
      arg_name(written, second, sizeof second);
      return imoe_fail(err, IMOE_ERR_ARGUMENT,
                       "%s shares memory with %s, which the call writes; pass a copy of %s",
                       first, second, first);
    }
  }
  return IMOE_OK;
}

static int add(imoe_alias_arg *args, int count, const imoe_view *view, const char *name, int index,
               int written, int is_buffer, int may_be_a_buffer) {
  if (view == NULL) return count;
  args[count] = (imoe_alias_arg){view, name, index, written, is_buffer, may_be_a_buffer, 0, 0, 0};
  return count + 1;
}

imoe_status imoe_check_call(const imoe_call_args *call, int *empty, imoe_error *err) {
  imoe_alias_arg args[IMOE_MAX_BUFFERS + 2 + IMOE_CALL_READS + IMOE_CALL_OUTS];
  int count = 0;
  for (int32_t b = 0; b < call->num_buffers; b++)
    count = add(args, count, &call->buffers[b], "buffers", (int)b, 1, 1, 0);
  if (call->sel != NULL) {
    count = call->sel->scores != NULL
                ? add(args, count, call->sel->scores, "scores", -1, 0, 0, 1)
                : add(args, count, call->sel->active, "active_indices", -1, 0, 0, 0);
  }
  for (int i = 0; i < IMOE_CALL_READS; i++)
    count = add(args, count, call->read[i], call->read_name[i], -1, 0, 0, 0);
  for (int i = 0; i < IMOE_CALL_OUTS; i++)
    count = add(args, count, call->out[i], call->out_name[i], -1, 1, 0, 0);
  /* The caller's int32 workspace as one slot of bytes. */
  imoe_view ws;
  memset(&ws, 0, sizeof ws);
  ws.data = (void *)(uintptr_t)call->workspace;
  ws.n = call->workspace != NULL && call->workspace_elems > 0 ? 1 : 0;
  ws.row_bytes = call->workspace_elems > 0 ? call->workspace_elems * (int64_t)sizeof(int32_t) : 1;
  ws.dtype = IMOE_DTYPE_BYTES;
  const int data_args = count;
  count = add(args, count, &ws, "workspace", -1, 1, 0, 0);
  const imoe_status st = check_aliasing(args, count, err);
  *empty = 1;
  for (int i = 0; i < data_args; i++)
    if (!args[i].empty) *empty = 0;
  return st;
}
