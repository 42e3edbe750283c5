/* parity.c: see parity.h. Expected results are whole-allocation images:
 * the snapshot before the call with the expected rows written in, so a
 * single memcmp also proves that no byte outside the views moved. */
#include "parity.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"
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

static int64_t dtype_bytes(imoe_dtype dtype) {
  switch (dtype) {
    case IMOE_DTYPE_F16:
    case IMOE_DTYPE_BF16:
      return 2;
    case IMOE_DTYPE_F32:
    case IMOE_DTYPE_I32:
      return 4;
    case IMOE_DTYPE_I64:
      return 8;
    default:
      return 1;
  }
}

/* Rows of t, contiguous [rows][n][row_bytes], read from live memory. */
static unsigned char *gather(const tensor *t) {
  const int64_t rows = tensor_rows(t), n = t->view.n, rb = t->view.row_bytes;
  unsigned char *out = malloc((size_t)(rows * n * rb) + 1);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t s = 0; s < n; s++) memcpy(out + (r * n + s) * rb, tensor_at(t, r, s), (size_t)rb);
  }
  return out;
}

/* image: a copy of t's allocation; rows are written where the view puts them. */
static void scatter(const tensor *t, unsigned char *image, const unsigned char *rows_data) {
  const int64_t rows = tensor_rows(t), n = t->view.n, rb = t->view.row_bytes;
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t s = 0; s < n; s++) {
      memcpy(image + (tensor_at(t, r, s) - t->alloc), rows_data + (r * n + s) * rb, (size_t)rb);
    }
  }
}

/* Image of an index tensor holding values [rows][n]. */
static unsigned char *index_image(const tensor *t, const unsigned char *snapshot,
                                  const int64_t *values) {
  const int64_t rows = tensor_rows(t), n = t->view.n;
  unsigned char *image = malloc(t->bytes);
  memcpy(image, snapshot, t->bytes);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t s = 0; s < n; s++) {
      tensor_put_index(image + (tensor_at(t, r, s) - t->alloc), t->view.dtype, values[r * n + s]);
    }
  }
  return image;
}

typedef struct expected {
  imoe_status status;
  int64_t kept;
  int64_t *indices; /* [rows][kept] */
  int64_t *target;  /* [rows][n] */
} expected;

static imoe_status expected_status(const parity_case *c, const tensor *scores, const tensor *active,
                                   int64_t rows) {
  const int64_t n = c->n;
  if (!c->use_active) {
    if (c->nan_policy != IMOE_NAN_ERROR) return IMOE_OK;
    for (int64_t r = 0; r < rows; r++) {
      for (int64_t s = 0; s < n; s++) {
        if (isnan(ref_score(tensor_at(scores, r, s), c->score_dtype))) return IMOE_ERR_NAN;
      }
    }
    return IMOE_OK;
  }
  const int64_t k = c->capacity, active_rows = c->shared_active ? 1 : rows;
  int64_t *entries = malloc(sizeof *entries * (size_t)(k + 1));
  imoe_status st = IMOE_OK;
  for (int64_t r = 0; r < active_rows && st == IMOE_OK; r++) {
    for (int64_t j = 0; j < k; j++)
      entries[j] = tensor_get_index(tensor_at(active, r, j), c->active_dtype);
    st = ref_active_status(entries, k, n);
  }
  free(entries);
  return st;
}

static void expect(const parity_case *c, const tensor *scores, const tensor *active, int64_t rows,
                   expected *e) {
  const int64_t n = c->n, k = c->capacity;
  e->kept = k < n ? k : n;
  e->indices = calloc((size_t)(rows * e->kept + 1), sizeof *e->indices);
  e->target = calloc((size_t)(rows * n + 1), sizeof *e->target);
  e->status = expected_status(c, scores, active, rows);
  if (e->status != IMOE_OK) return;
  double *values = malloc(sizeof *values * (size_t)(n + 1));
  uint8_t *kept = malloc((size_t)n + 1);
  for (int64_t r = 0; r < rows; r++) {
    if (!c->use_active) {
      for (int64_t s = 0; s < n; s++)
        values[s] = ref_score(tensor_at(scores, r, s), c->score_dtype);
      ref_select(values, n, k, c->prefix, c->window, kept);
    } else {
      memset(kept, 0, (size_t)n);
      const int64_t ar = c->shared_active ? 0 : r;
      for (int64_t j = 0; j < k; j++)
        kept[tensor_get_index(tensor_at(active, ar, j), c->active_dtype)] = 1;
    }
    ref_pairing(kept, n, e->kept, e->indices + r * e->kept, e->target + r * n);
  }
  free(values);
  free(kept);
}

/* Expected images of the buffers after applying the expected map. */
static unsigned char **expected_buffers(const parity_case *c, const tensor *buf,
                                        unsigned char *const *snap, const expected *e,
                                        int64_t rows) {
  unsigned char **images = calloc((size_t)c->num_buffers, sizeof *images);
  for (int32_t b = 0; b < c->num_buffers; b++) {
    const int64_t rb = c->row_bytes[b];
    unsigned char *data = gather(&buf[b]);
    for (int64_t r = 0; r < rows; r++) {
      ref_apply_indices(data + r * c->n * rb, rb, e->indices + r * e->kept, e->kept, c->mode);
    }
    images[b] = malloc(buf[b].bytes);
    memcpy(images[b], snap[b], buf[b].bytes);
    scatter(&buf[b], images[b], data);
    free(data);
  }
  return images;
}

static void check_buffers(mismatch *m, const char *what, const tensor *buf, int32_t count,
                          unsigned char *const *images) {
  for (int32_t b = 0; b < count; b++) {
    if (memcmp(buf[b].alloc, images[b], buf[b].bytes) != 0) {
      note(m, "%s: buffers[%d] differs from the reference", what, (int)b);
    }
  }
}

static void reset_buffers(tensor *buf, int32_t count, unsigned char *const *snap) {
  for (int32_t b = 0; b < count; b++) memcpy(buf[b].alloc, snap[b], buf[b].bytes);
}

static void fill_scores(const parity_case *c, tensor *scores, int64_t rows) {
  const int64_t size = dtype_bytes(c->score_dtype);
  uint64_t noise = c->score_noise;
  size_t at = 0;
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t s = 0; s < c->n; s++) {
      unsigned char *p = tensor_at(scores, r, s);
      for (int64_t i = 0; i < size; i++) {
        p[i] = c->score_bytes && c->score_bytes_len ? c->score_bytes[at++ % c->score_bytes_len] : 0;
      }
      /* Sign and exponent stay as given; the low (little-endian) half of
       * the bits varies, so that short inputs still spread over the finer
       * radix digits. */
      if (c->score_noise) {
        for (int64_t i = 0; i < size / 2; i++) p[i] ^= (unsigned char)rng_next(&noise);
      }
    }
  }
}

static void fill_active(const parity_case *c, tensor *active) {
  const int64_t rows = tensor_rows(active), k = c->capacity;
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t j = 0; j < k; j++) {
      tensor_put_index(tensor_at(active, r, j), c->active_dtype, c->active_values[r * k + j]);
    }
  }
}

/* The second half of a passing case: build_map and the apply entry points
 * must agree with what compact did. */
static void round_trips(const parity_case *c, mismatch *m, const imoe_selection *sel,
                        const imoe_exec *exec, tensor *buf, unsigned char *const *snap,
                        unsigned char *const *want, const tensor *idx, const expected *e,
                        uint64_t *seed) {
  imoe_error err;
  tensor idx2 = tensor_make(c->lead_ndim, c->lead_shape, e->kept, 8, IMOE_DTYPE_I64, T_PAD, seed);
  tensor tm2 = tensor_make(c->lead_ndim, c->lead_shape, c->n, 4, IMOE_DTYPE_I32,
                           c->output_layout ^ T_NEG_SLOTS, seed);
  unsigned char *idx2_snap = tensor_snapshot(&idx2), *tm2_snap = tensor_snapshot(&tm2);
  unsigned char *idx2_want = index_image(&idx2, idx2_snap, e->indices);
  unsigned char *tm2_want = index_image(&tm2, tm2_snap, e->target);
  imoe_status st = imoe_build_map(sel, &idx2.view, &tm2.view, NULL, 0, exec, &err);
  if (st != IMOE_OK) note(m, "build_map: status %d (%s)", (int)st, err.message);
  if (!tensor_same(&idx2, idx2_want)) note(m, "build_map: out_indices differs");
  if (!tensor_same(&tm2, tm2_want)) note(m, "build_map: out_target_map differs");
  if (sel->active != NULL) {
    /* Active indices with N given as num_slots: the same indices, no map. */
    imoe_selection with_n = *sel;
    with_n.num_slots = c->n;
    memcpy(idx2.alloc, idx2_snap, idx2.bytes);
    st = imoe_build_map(&with_n, &idx2.view, NULL, NULL, 0, exec, &err);
    if (st != IMOE_OK) note(m, "build_map with num_slots: status %d (%s)", (int)st, err.message);
    if (!tensor_same(&idx2, idx2_want)) note(m, "build_map with num_slots: out_indices differs");
  }

  if (c->mode == IMOE_MODE_SWAP) {
    imoe_view views[PARITY_MAX_BUFFERS];
    for (int32_t b = 0; b < c->num_buffers; b++) views[b] = buf[b].view;
    st = imoe_restore(views, c->num_buffers, &idx->view, IMOE_ORDER_INPLACE, NULL, 0, exec, &err);
    if (st != IMOE_OK) note(m, "restore: status %d (%s)", (int)st, err.message);
    check_buffers(m, "restore", buf, c->num_buffers, snap);
    st = imoe_apply_target_map(views, c->num_buffers, &tm2.view, IMOE_MODE_SWAP, exec, &err);
    if (st != IMOE_OK) note(m, "apply_target_map swap: status %d (%s)", (int)st, err.message);
    check_buffers(m, "apply_target_map swap", buf, c->num_buffers, want);
    st = imoe_apply_target_map(views, c->num_buffers, &tm2.view, IMOE_MODE_SWAP, exec, &err);
    if (st != IMOE_OK) note(m, "apply_target_map swap twice: status %d", (int)st);
    check_buffers(m, "apply_target_map swap twice", buf, c->num_buffers, snap);
    st = imoe_apply_indices(views, c->num_buffers, &idx2.view, IMOE_ORDER_INPLACE, IMOE_MODE_SWAP, NULL, 0, exec, &err);
    if (st != IMOE_OK) note(m, "apply_indices swap: status %d (%s)", (int)st, err.message);
    check_buffers(m, "apply_indices swap", buf, c->num_buffers, want);
  } else {
    imoe_view views[PARITY_MAX_BUFFERS];
    for (int32_t b = 0; b < c->num_buffers; b++) views[b] = buf[b].view;
    reset_buffers(buf, c->num_buffers, snap);
    st = imoe_apply_target_map(views, c->num_buffers, &tm2.view, IMOE_MODE_MOVE, exec, &err);
    if (st != IMOE_OK) note(m, "apply_target_map move: status %d (%s)", (int)st, err.message);
    check_buffers(m, "apply_target_map move", buf, c->num_buffers, want);
    reset_buffers(buf, c->num_buffers, snap);
    st = imoe_apply_indices(views, c->num_buffers, &idx2.view, IMOE_ORDER_INPLACE, IMOE_MODE_MOVE, NULL, 0, exec, &err);
    if (st != IMOE_OK) note(m, "apply_indices move: status %d (%s)", (int)st, err.message);
    check_buffers(m, "apply_indices move", buf, c->num_buffers, want);
  }
  free(idx2_snap);
  free(tm2_snap);
  free(idx2_want);
  free(tm2_want);
  tensor_free(&idx2);
  tensor_free(&tm2);
}

static int64_t lead_rows(int32_t lead_ndim, const int64_t *shape) {
  int64_t rows = 1;
  for (int32_t d = 0; d < lead_ndim; d++) rows *= shape[d];
  return rows;
}

int parity_run(const parity_case *c, char *why, size_t why_size) {
  mismatch m = {0, why, why_size};
  uint64_t seed = c->seed;
  const int64_t rows = lead_rows(c->lead_ndim, c->lead_shape), n = c->n;
  const int64_t kept = c->capacity < n ? c->capacity : n;

  tensor buf[PARITY_MAX_BUFFERS];
  imoe_view views[PARITY_MAX_BUFFERS];
  unsigned char *snap[PARITY_MAX_BUFFERS];
  for (int32_t b = 0; b < c->num_buffers; b++) {
    buf[b] = tensor_make(c->lead_ndim, c->lead_shape, n, c->row_bytes[b], IMOE_DTYPE_BYTES,
                         c->buffer_layout[b], &seed);
    views[b] = buf[b].view;
    snap[b] = tensor_snapshot(&buf[b]);
  }
  tensor scores = {0}, active = {0};
  if (c->use_active) {
    active = tensor_make(c->shared_active ? 0 : c->lead_ndim, c->lead_shape, c->capacity,
                         dtype_bytes(c->active_dtype), c->active_dtype, c->score_layout, &seed);
    fill_active(c, &active);
  } else {
    scores = tensor_make(c->lead_ndim, c->lead_shape, n, dtype_bytes(c->score_dtype),
                         c->score_dtype, c->score_layout, &seed);
    fill_scores(c, &scores, rows);
  }
  tensor idx = tensor_make(c->lead_ndim, c->lead_shape, kept, dtype_bytes(c->index_dtype),
                           c->index_dtype, c->output_layout, &seed);
  tensor tm = {0};
  if (c->with_target) {
    tm = tensor_make(c->lead_ndim, c->lead_shape, n, 4, IMOE_DTYPE_I32, c->output_layout, &seed);
  }
  unsigned char *sel_snap = tensor_snapshot(c->use_active ? &active : &scores);
  unsigned char *idx_snap = tensor_snapshot(&idx);
  unsigned char *tm_snap = c->with_target ? tensor_snapshot(&tm) : NULL;

  expected e;
  expect(c, &scores, &active, rows, &e);
  unsigned char **want = NULL;
  if (e.status == IMOE_OK) want = expected_buffers(c, buf, snap, &e, rows);

  imoe_selection sel = {c->use_active ? NULL : &scores.view,
                        c->use_active ? &active.view : NULL,
                        c->capacity,
                        c->prefix,
                        c->window,
                        c->nan_policy};
  imoe_exec exec = {IMOE_DEVICE_CPU, 0, c->threads, NULL};
  const imoe_exec *ex = c->threads < 0 ? NULL : &exec;
  imoe_error err;
  err.message[0] = '\0';
  const imoe_status st = imoe_compact(views, c->num_buffers, &sel, &idx.view, c->with_target ? &tm.view : NULL, c->mode, NULL, 0, ex, &err);
  if (st != e.status) {
    note(&m, "compact: status %d, expected %d (%s)", (int)st, (int)e.status, err.message);
  }
  if (!tensor_same(c->use_active ? &active : &scores, sel_snap))
    note(&m, "compact wrote the selection");
  if (e.status != IMOE_OK) {
    if (err.message[0] == '\0') note(&m, "compact: status %d with an empty message", (int)st);
    check_buffers(&m, "failed compact", buf, c->num_buffers, snap);
    if (!tensor_same(&idx, idx_snap)) note(&m, "failed compact wrote out_indices");
    if (c->with_target && !tensor_same(&tm, tm_snap))
      note(&m, "failed compact wrote out_target_map");
  } else if (st == IMOE_OK) {
    unsigned char *idx_want = index_image(&idx, idx_snap, e.indices);
    if (!tensor_same(&idx, idx_want)) note(&m, "compact: out_indices differs");
    free(idx_want);
    if (c->with_target) {
      unsigned char *tm_want = index_image(&tm, tm_snap, e.target);
      if (!tensor_same(&tm, tm_want)) note(&m, "compact: out_target_map differs");
      free(tm_want);
    }
    check_buffers(&m, "compact", buf, c->num_buffers, want);
    round_trips(c, &m, &sel, ex, buf, snap, want, &idx, &e, &seed);
  }

  for (int32_t b = 0; b < c->num_buffers; b++) {
    if (want) free(want[b]);
    free(snap[b]);
    tensor_free(&buf[b]);
  }
  free(want);
  free(sel_snap);
  free(idx_snap);
  free(tm_snap);
  free(e.indices);
  free(e.target);
  tensor_free(&scores);
  tensor_free(&active);
  tensor_free(&idx);
  tensor_free(&tm);
  return m.count;
}

int parity_map_run(const map_case *c, char *why, size_t why_size) {
  mismatch m = {0, why, why_size};
  uint64_t seed = c->seed;
  const int64_t rows = lead_rows(c->lead_ndim, c->lead_shape), n = c->n, k = c->map_n;
  tensor buf =
      tensor_make(c->lead_ndim, c->lead_shape, n, c->row_bytes, IMOE_DTYPE_BYTES, c->layout, &seed);
  tensor map = tensor_make(c->lead_ndim, c->lead_shape, k, dtype_bytes(c->map_dtype), c->map_dtype,
                           c->layout ^ T_PAD, &seed);
  int64_t *values = malloc(sizeof *values * (size_t)(rows * k + 1));
  imoe_status want_status = IMOE_OK;
  for (int64_t r = 0; r < rows; r++) {
    /* What the library will read back: an I32 map truncates the values. */
    for (int64_t j = 0; j < k; j++) {
      tensor_put_index(tensor_at(&map, r, j), c->map_dtype, c->values[r * k + j]);
      values[r * k + j] = tensor_get_index(tensor_at(&map, r, j), c->map_dtype);
    }
    if (want_status == IMOE_OK) {
      want_status = c->is_target ? ref_target_status(values + r * k, n)
                                 : ref_indices_status(values + r * k, k, n);
    }
  }
  unsigned char *snap = tensor_snapshot(&buf), *map_snap = tensor_snapshot(&map);
  unsigned char *want = malloc(buf.bytes);
  memcpy(want, snap, buf.bytes);
  if (want_status == IMOE_OK) {
    unsigned char *data = gather(&buf);
    for (int64_t r = 0; r < rows; r++) {
      unsigned char *row = data + r * n * c->row_bytes;
      if (c->is_target) {
        ref_apply_target(row, c->row_bytes, values + r * k, n, c->mode);
      } else {
        ref_apply_indices(row, c->row_bytes, values + r * k, k, c->mode);
      }
    }
    scatter(&buf, want, data);
    free(data);
  }
  imoe_exec exec = {IMOE_DEVICE_CPU, 0, c->threads, NULL};
  const imoe_exec *ex = c->threads < 0 ? NULL : &exec;
  imoe_error err;
  err.message[0] = '\0';
  const imoe_status st = c->is_target
                             ? imoe_apply_target_map(&buf.view, 1, &map.view, c->mode, ex, &err)
                             : imoe_apply_indices(&buf.view, 1, &map.view, IMOE_ORDER_INPLACE, c->mode, NULL, 0, ex, &err);
  if (st != want_status) {
    note(&m, "apply %s: status %d, expected %d (%s)", c->is_target ? "target_map" : "indices",
         (int)st, (int)want_status, err.message);
  }
  if (st != IMOE_OK && err.message[0] == '\0') note(&m, "apply: status %d, empty message", (int)st);
  if (!tensor_same(&buf, want)) note(&m, "apply: buffer differs from the reference");
  if (!tensor_same(&map, map_snap)) note(&m, "apply wrote the map");
  free(values);
  free(snap);
  free(map_snap);
  free(want);
  tensor_free(&buf);
  tensor_free(&map);
  return m.count;
}
