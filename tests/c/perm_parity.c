/* perm_parity.c: see perm_parity.h. The reference builds each row's
 * permutation P (new slot i takes old slot P[i]) the obvious way and copies
 * slot by slot through a second image of the allocation. */
#include "perm_parity.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor.h"

typedef struct mismatch {
  int count;
  char *why;
  size_t size;
} mismatch;

static void note(mismatch *m, const char *fmt, ...) {
  if (m->count++ == 0 && m->why != NULL && m->size > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->why, m->size, fmt, ap);
    va_end(ap);
  }
}

static int64_t case_rows(const perm_case *c) {
  int64_t rows = 1;
  for (int32_t d = 0; d < c->lead_ndim; d++) rows *= c->lead_shape[d];
  return rows;
}

static int64_t map_rows(const perm_case *c) { return c->shared ? 1 : case_rows(c); }

/* The value as the library reads it: I32 maps hold the low 32 bits. */
static int64_t stored(const perm_case *c, int64_t v) {
  return c->map_dtype == IMOE_DTYPE_I32 ? (int64_t)(int32_t)v : v;
}

static imoe_status row_status(const perm_case *c, const int64_t *vals) {
  const int64_t n = c->n, k = c->map_n;
  if (c->kind == PC_GROUP) {
    for (int64_t t = 0; t < k; t++) {
      const int64_t e = stored(c, vals[t]);
      if (e < 0 || e >= c->experts) return IMOE_ERR_INDEX_RANGE;
    }
    return IMOE_OK;
  }
  if (c->kind == PC_PERMUTE) { /* any range error first, then repeats */
    for (int64_t i = 0; i < k; i++) {
      const int64_t v = stored(c, vals[i]);
      if (v < 0 || v >= n) return IMOE_ERR_INDEX_RANGE;
    }
  }
  for (int64_t i = 0; i < k; i++) { /* ordered indices: in scan order */
    const int64_t v = stored(c, vals[i]);
    if (v < 0 || v >= n) return IMOE_ERR_INDEX_RANGE;
    for (int64_t j = 0; j < i; j++) {
      if (stored(c, vals[j]) == v) return IMOE_ERR_BAD_MAP;
    }
  }
  return IMOE_OK;
}

imoe_status perm_ref_status(const perm_case *c) {
  if (c->kind == PC_GROUP && (c->experts < 0 || c->experts >= INT32_MAX)) return IMOE_ERR_ARGUMENT;
  if (c->kind != PC_GROUP && c->kind != PC_APPLY_ORDERED && c->kind != PC_RESTORE_ORDERED &&
      c->kind != PC_PERMUTE) {
    return IMOE_ERR_ARGUMENT;
  }
  if (c->workspace == 2 && map_rows(c) * c->n > 0) return IMOE_ERR_ARGUMENT;
  for (int64_t r = 0; r < map_rows(c); r++) {
    const imoe_status st = row_status(c, c->values + r * c->map_n);
    if (st != IMOE_OK) return st;
  }
  return IMOE_OK;
}

/* P of one valid map row into p[0, n); for groups also the offsets (each
 * expert's end). */
static void ref_row_perm(const perm_case *c, const int64_t *vals, int64_t *p, int64_t *offsets) {
  const int64_t n = c->n, k = c->map_n;
  if (c->kind == PC_PERMUTE) {
    for (int64_t i = 0; i < n; i++) {
      const int64_t v = stored(c, vals[i]);
      if (c->inverse) {
        p[v] = i;
      } else {
        p[i] = v;
      }
    }
    return;
  }
  if (c->kind == PC_GROUP) {
    int64_t m = 0;
    for (int64_t e = 0; e < c->experts; e++) {
      for (int64_t t = 0; t < n; t++) {
        if (stored(c, vals[t]) == e) p[m++] = t;
      }
      offsets[e] = m;
    }
    return;
  }
  int64_t *fwd = malloc(sizeof *fwd * (size_t)(n + 1));
  for (int64_t i = 0; i < k; i++) fwd[i] = stored(c, vals[i]);
  int64_t m = k;
  for (int64_t x = 0; x < n; x++) {
    int listed = 0;
    for (int64_t i = 0; i < k; i++) listed |= fwd[i] == x;
    if (!listed) fwd[m++] = x;
  }
  for (int64_t i = 0; i < n; i++) {
    if (c->kind == PC_RESTORE_ORDERED) {
      p[fwd[i]] = i;
    } else {
      p[i] = fwd[i];
    }
  }
  free(fwd);
}

int perm_parity_run(const perm_case *c, char *why, size_t why_size) {
  mismatch m = {0, why, why_size};
  uint64_t seed = c->seed;
  const int64_t rows = case_rows(c), mrows = map_rows(c), n = c->n;
  tensor bufs[PERM_MAX_BUFFERS];
  imoe_view views[PERM_MAX_BUFFERS];
  unsigned char *before[PERM_MAX_BUFFERS];
  for (int32_t b = 0; b < c->num_buffers; b++) {
    bufs[b] = tensor_make(c->lead_ndim, c->lead_shape, n, c->row_bytes[b], IMOE_DTYPE_BYTES,
                          c->layout[b], &seed);
    views[b] = bufs[b].view;
    before[b] = tensor_snapshot(&bufs[b]);
  }
  const int64_t elem = c->map_dtype == IMOE_DTYPE_I32 ? 4 : 8;
  tensor map = tensor_make(c->shared ? 0 : c->lead_ndim, c->lead_shape, c->map_n, elem,
                           c->map_dtype, c->map_layout, &seed);
  for (int64_t r = 0; r < mrows; r++) {
    for (int64_t i = 0; i < c->map_n; i++) {
      tensor_put_index(tensor_at(&map, r, i), c->map_dtype, c->values[r * c->map_n + i]);
    }
  }
  const unsigned char *map_before = tensor_snapshot(&map);
  tensor offsets = {0}, perm_out = {0};
  unsigned char *offsets_before = NULL, *perm_before = NULL;
  const int64_t out_elem = c->out_dtype == IMOE_DTYPE_I32 ? 4 : 8;
  if (c->kind == PC_GROUP) {
    offsets = tensor_make(c->lead_ndim, c->lead_shape, c->experts, out_elem, c->out_dtype,
                          c->map_layout, &seed);
    perm_out = tensor_make(c->lead_ndim, c->lead_shape, n, out_elem, c->out_dtype, 0, &seed);
    offsets_before = tensor_snapshot(&offsets);
    perm_before = tensor_snapshot(&perm_out);
  }
  const int64_t need = mrows * n;
  int32_t *ws = NULL;
  int64_t ws_elems = 0;
  if (c->workspace) {
    ws_elems = c->workspace == 2 && need > 0 ? need - 1 : need;
    ws = malloc(sizeof *ws * (size_t)(need + 1));
  }
  imoe_exec exec = {IMOE_DEVICE_CPU, 0, c->threads, NULL};
  const imoe_exec *ex = c->threads < 0 ? NULL : &exec;
  imoe_error err;
  memset(&err, 0, sizeof err);
  imoe_status got;
  switch (c->kind) {
    case PC_PERMUTE:
      got = imoe_permute(views, c->num_buffers, &map.view, c->inverse, ws, ws_elems, ex, &err);
      break;
    case PC_APPLY_ORDERED:
      got = imoe_apply_indices(views, c->num_buffers, &map.view, IMOE_ORDER_STABLE, c->mode, ws, ws_elems, ex, &err);
      break;
    case PC_RESTORE_ORDERED:
      got = imoe_restore(views, c->num_buffers, &map.view, IMOE_ORDER_STABLE, ws, ws_elems, ex, &err);
      break;
    default:
      got = imoe_group_by_expert(views, c->num_buffers, &map.view, c->experts, &offsets.view,
                                 c->with_perm ? &perm_out.view : NULL, ws, ws_elems, ex, &err);
      break;
  }
  const imoe_status want = perm_ref_status(c);
  if (got != want) note(&m, "status %d, expected %d (%s)", (int)got, (int)want, err.message);
  if (!tensor_same(&map, map_before)) note(&m, "the map was written");

  int64_t *p = malloc(sizeof *p * (size_t)(n + 1));
  int64_t *offs = malloc(sizeof *offs * (size_t)(c->experts > 0 ? c->experts + 2 : 2));
  for (int32_t b = 0; b < c->num_buffers; b++) {
    unsigned char *expect = tensor_snapshot(&bufs[b]); /* same layout, filled below */
    memcpy(expect, before[b], bufs[b].bytes);
    if (got == IMOE_OK && want == IMOE_OK) {
      /* Expected rows: slot i of the result holds slot P[i] of the input. */
      const imoe_view *v = &bufs[b].view;
      for (int64_t r = 0; r < rows; r++) {
        ref_row_perm(c, c->values + (c->shared ? 0 : r) * c->map_n, p, offs);
        const int64_t limit =
            c->kind == PC_APPLY_ORDERED && c->mode == IMOE_MODE_MOVE ? c->map_n : n;
        for (int64_t i = 0; i < n; i++) {
          const int64_t dst = tensor_at(&bufs[b], r, i) - bufs[b].alloc;
          if (i >= limit) { /* move mode: the tail is unspecified */
            memcpy(expect + dst, bufs[b].alloc + dst, (size_t)v->row_bytes);
            continue;
          }
          const int64_t src = tensor_at(&bufs[b], r, p[i]) - bufs[b].alloc;
          memcpy(expect + dst, before[b] + src, (size_t)v->row_bytes);
        }
      }
    }
    if (memcmp(expect, bufs[b].alloc, bufs[b].bytes) != 0) {
      note(&m, "buffer %d differs from the reference (status %d)", (int)b, (int)got);
    }
    free(expect);
  }
  if (c->kind == PC_GROUP) {
    if (got != IMOE_OK) {
      if (!tensor_same(&offsets, offsets_before)) note(&m, "offsets written on failure");
      if (!tensor_same(&perm_out, perm_before)) note(&m, "perm written on failure");
    } else {
      for (int64_t r = 0; r < rows; r++) {
        ref_row_perm(c, c->values + r * c->map_n, p, offs);
        for (int64_t e = 0; e < c->experts; e++) {
          const int64_t o = tensor_get_index(tensor_at(&offsets, r, e), c->out_dtype);
          if (o != offs[e]) note(&m, "row %lld offsets[%lld] = %lld, expected %lld", (long long)r,
                                 (long long)e, (long long)o, (long long)offs[e]);
        }
        for (int64_t i = 0; i < n; i++) {
          const int64_t q = tensor_get_index(tensor_at(&perm_out, r, i), c->out_dtype);
          const unsigned char *old = perm_before + (tensor_at(&perm_out, r, i) - perm_out.alloc);
          const int64_t want_q = c->with_perm ? p[i] : tensor_get_index(old, c->out_dtype);
          if (q != want_q) note(&m, "row %lld perm[%lld] = %lld, expected %lld", (long long)r,
                                (long long)i, (long long)q, (long long)want_q);
        }
      }
    }
    tensor_free(&offsets);
    tensor_free(&perm_out);
    free(offsets_before);
    free(perm_before);
  }
  free(p);
  free(offs);
  free(ws);
  for (int32_t b = 0; b < c->num_buffers; b++) {
    tensor_free(&bufs[b]);
    free(before[b]);
  }
  tensor_free(&map);
  free((void *)map_before);
  return m.count;
}
