/* test_status.c: every failure path returns its status, names the argument
 * in the message, and leaves every byte of every view as it was. The
 * data errors sit in the last row, so a call that wrote rows before
 * checking them all would be caught. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "idempotent_moe.h"
#include "tensor.h"

enum { W_BUF0, W_BUF1, W_SCORES, W_ACTIVE, W_IDX, W_TM, W_IDX_IN, W_TM_IN, W_COUNT };

typedef struct world {
  tensor t[W_COUNT];
  unsigned char *snap[W_COUNT];
  imoe_view buffers[2];
  imoe_selection sel;    /* scores, C = 4, P = 1, W = 1 */
  imoe_selection active; /* active, C = 4 */
  imoe_exec exec;        /* CPU, 2 threads */
} world;

static const int64_t lead[2] = {2, 3};
#define N 10
#define C 4
#define LAST_ROW 5

static void put64(tensor *t, int64_t row, int64_t slot, int64_t v) {
  if (t->view.dtype == IMOE_DTYPE_I32) {
    const int32_t x = (int32_t)v;
    memcpy(tensor_at(t, row, slot), &x, 4);
  } else {
    memcpy(tensor_at(t, row, slot), &v, 8);
  }
}

static int64_t get64(const tensor *t, int64_t row, int64_t slot) {
  if (t->view.dtype == IMOE_DTYPE_I32) {
    int32_t x;
    memcpy(&x, tensor_at(t, row, slot), 4);
    return x;
  }
  int64_t v;
  memcpy(&v, tensor_at(t, row, slot), 8);
  return v;
}

/* Changes one entry of a world tensor and takes that as its new state. */
static void set_entry(world *w, int which, int64_t row, int64_t slot, int64_t v) {
  put64(&w->t[which], row, slot, v);
  free(w->snap[which]);
  w->snap[which] = tensor_snapshot(&w->t[which]);
}

static void set_score(world *w, int64_t row, int64_t slot, float v) {
  memcpy(tensor_at(&w->t[W_SCORES], row, slot), &v, 4);
  free(w->snap[W_SCORES]);
  w->snap[W_SCORES] = tensor_snapshot(&w->t[W_SCORES]);
}

static void world_init(world *w) {
  uint64_t seed = 99;
  memset(w, 0, sizeof *w);
  w->t[W_BUF0] = tensor_make(2, lead, N, 6, IMOE_DTYPE_BYTES, T_PAD, &seed);
  w->t[W_BUF1] = tensor_make(2, lead, N, 3, IMOE_DTYPE_BYTES, T_NEG_SLOTS, &seed);
  w->t[W_SCORES] = tensor_make(2, lead, N, 4, IMOE_DTYPE_F32, 0, &seed);
  w->t[W_ACTIVE] = tensor_make(2, lead, C, 8, IMOE_DTYPE_I64, 0, &seed);
  w->t[W_IDX] = tensor_make(2, lead, C, 4, IMOE_DTYPE_I32, 0, &seed);
  w->t[W_TM] = tensor_make(2, lead, N, 4, IMOE_DTYPE_I32, T_NEG_LEAD, &seed);
  w->t[W_IDX_IN] = tensor_make(2, lead, C, 8, IMOE_DTYPE_I64, 0, &seed);
  w->t[W_TM_IN] = tensor_make(2, lead, N, 4, IMOE_DTYPE_I32, 0, &seed);
  for (int64_t r = 0; r < 6; r++) {
    for (int64_t s = 0; s < N; s++) {
      const float v = (float)((r * 7 + s * 3) % 11);
      memcpy(tensor_at(&w->t[W_SCORES], r, s), &v, 4);
    }
    for (int64_t j = 0; j < C; j++) put64(&w->t[W_ACTIVE], r, j, (r + 3 * j) % N);
  }
  w->buffers[0] = w->t[W_BUF0].view;
  w->buffers[1] = w->t[W_BUF1].view;
  w->sel = (imoe_selection){&w->t[W_SCORES].view, NULL, C, 1, 1, IMOE_NAN_ERROR};
  w->active = (imoe_selection){NULL, &w->t[W_ACTIVE].view, C, 0, 0, IMOE_NAN_ERROR};
  w->exec = (imoe_exec){IMOE_DEVICE_CPU, 0, 2, NULL};
  /* Valid caller maps to break one entry at a time. */
  imoe_status st = imoe_build_map(&w->sel, &w->t[W_IDX_IN].view, &w->t[W_TM_IN].view, NULL, 0, NULL, NULL);
  CHECK(st == IMOE_OK, "world: build_map of the valid maps");
  for (int i = 0; i < W_COUNT; i++) w->snap[i] = tensor_snapshot(&w->t[i]);
}

static void world_free(world *w) {
  for (int i = 0; i < W_COUNT; i++) {
    tensor_free(&w->t[i]);
    free(w->snap[i]);
  }
}

static int expect_line;

static void expect(const world *w, const char *label, imoe_status got, imoe_status want,
                   const imoe_error *err, const char *mention) {
  CHECK(got == want, "line %d, %s: status %d, expected %d (%s)", expect_line, label, (int)got,
        (int)want, err->message);
  if (mention != NULL) {
    CHECK(strstr(err->message, mention) != NULL, "line %d, %s: message \"%s\" lacks \"%s\"",
          expect_line, label, err->message, mention);
  }
  for (int i = 0; i < W_COUNT; i++) {
    CHECK(tensor_same(&w->t[i], w->snap[i]), "line %d, %s: view %d changed", expect_line, label, i);
  }
}

#define EXPECT(label, call, want, mention)       \
  do {                                           \
    imoe_error err_;                             \
    memset(&err_, 0, sizeof err_);               \
    expect_line = __LINE__;                      \
    imoe_error *err = &err_;                     \
    const imoe_status got_ = (call);             \
    expect(&w, label, got_, want, err, mention); \
  } while (0)

static void build_map_paths(void) {
  world w;
  world_init(&w);
  imoe_view *idx = &w.t[W_IDX].view, *tm = &w.t[W_TM].view;
  imoe_selection sel;
  imoe_view v, v2;
  imoe_exec ex;

  EXPECT("sel NULL", imoe_build_map(NULL, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT, "sel");
  sel = w.sel, sel.active = w.active.active;
  EXPECT("both selections", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "exactly one");
  sel = w.sel, sel.scores = NULL;
  EXPECT("no selection", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "exactly one");
  EXPECT("no outputs", imoe_build_map(&w.sel, NULL, NULL, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "out_indices");
  EXPECT("active without target map or num_slots",
         imoe_build_map(&w.active, idx, NULL, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT, "num_slots");
  sel = w.active, sel.num_slots = 7;
  EXPECT("num_slots against the target map", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "num_slots");
  sel = w.sel, sel.capacity = -1;
  EXPECT("negative capacity", imoe_build_map(&sel, NULL, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "capacity");
  sel = w.sel, sel.protected_prefix = -1;
  EXPECT("negative prefix", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "protected_prefix");
  sel = w.sel, sel.recent_window = -2;
  EXPECT("negative window", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "recent_window");
  sel = w.sel, sel.protected_prefix = 2, sel.recent_window = 3;
  EXPECT("P + W > C", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT, "capacity");
  sel = w.sel, sel.nan_policy = (imoe_nan_policy)5;
  EXPECT("bad nan policy", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "nan_policy");

  sel = w.sel, v = *w.sel.scores, sel.scores = &v;
  v.dtype = IMOE_DTYPE_I32;
  EXPECT("I32 scores", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_DTYPE, "scores");
  v = *w.sel.scores, v.dtype = IMOE_DTYPE_BYTES, v.row_bytes = 1, v.n_stride = 1;
  EXPECT("BYTES scores", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_DTYPE, "scores");
  v = *w.sel.scores, v.dtype = (imoe_dtype)42;
  EXPECT("dtype 42", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_DTYPE, "scores");
  v = *w.sel.scores, v.row_bytes = 2;
  EXPECT("row_bytes != element size", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "scores");
  v = *w.sel.scores, v.row_bytes = 0;
  EXPECT("row_bytes 0", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT, "scores");
  v = *w.sel.scores, v.lead_shape[1] = 4;
  EXPECT("scores lead shape", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "scores");
  v = *w.sel.scores, v.lead_ndim = 9;
  EXPECT("lead_ndim 9", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT, "lead_ndim");
  v = *w.sel.scores, v.lead_ndim = -1;
  EXPECT("lead_ndim -1", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT, "lead_ndim");
  v = *w.sel.scores, v.lead_shape[0] = -2;
  EXPECT("negative lead shape", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "lead_shape");
  v = *w.sel.scores, v.n = -1;
  EXPECT("negative n", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "n is negative");
  v = *w.sel.scores, v.n = 11;
  EXPECT("scores n vs target map", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "out_target_map");
  v = *w.sel.scores, v.n = (int64_t)INT32_MAX + 1;
  EXPECT("n above the slot limit", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "exceeds");
  v = *w.sel.scores, v.data = NULL;
  EXPECT("NULL data", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT, "NULL");
  v = *w.sel.scores, v.n_stride = INT64_MAX / 4;
  EXPECT("stride overflow", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "overflow");
  v = *w.sel.scores, v.lead_stride[0] = INT64_MIN;
  EXPECT("INT64_MIN stride", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "overflow");

  v = *idx, v.dtype = IMOE_DTYPE_F32;
  EXPECT("F32 out_indices", imoe_build_map(&w.sel, &v, tm, NULL, 0, NULL, err), IMOE_ERR_DTYPE,
         "out_indices");
  v = *idx, v.n = 5;
  EXPECT("out_indices n != C'", imoe_build_map(&w.sel, &v, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "out_indices");
  v = *idx, v.lead_shape[0] = 3, v.lead_shape[1] = 2;
  EXPECT("out_indices lead shape", imoe_build_map(&w.sel, &v, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "lead shape");
  v = *idx, v.n_stride = 0;
  EXPECT("overlapping out_indices", imoe_build_map(&w.sel, &v, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "overlap");
  v = *idx, v.lead_stride[1] = 0;
  EXPECT("broadcast out_indices", imoe_build_map(&w.sel, &v, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "broadcast");
  v2 = *tm, v2.dtype = IMOE_DTYPE_I64, v2.row_bytes = 8, v2.n_stride = 8;
  EXPECT("I64 target map output", imoe_build_map(&w.sel, idx, &v2, NULL, 0, NULL, err), IMOE_ERR_DTYPE,
         "out_target_map");
  v2 = *tm, v2.n = 9;
  EXPECT("target map n != N", imoe_build_map(&w.sel, idx, &v2, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "out_target_map");

  if (!imoe_cuda_compiled()) {
    ex = w.exec, ex.device = IMOE_DEVICE_CUDA;
    EXPECT("CUDA exec", imoe_build_map(&w.sel, idx, tm, NULL, 0, &ex, err), IMOE_ERR_UNSUPPORTED,
           "no CUDA support");
  }
  ex = w.exec, ex.device = (imoe_device_type)7;
  EXPECT("bad device", imoe_build_map(&w.sel, idx, tm, NULL, 0, &ex, err), IMOE_ERR_ARGUMENT, "exec");

  /* Data errors in the last row. */
  float saved;
  memcpy(&saved, tensor_at(&w.t[W_SCORES], LAST_ROW, 9), 4);
  set_score(&w, LAST_ROW, 9, NAN);
  EXPECT("NaN, last row", imoe_build_map(&w.sel, idx, tm, NULL, 0, &w.exec, err), IMOE_ERR_NAN,
         "row 5, slot 9");
  EXPECT("NaN, one thread", imoe_build_map(&w.sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_NAN,
         "row 5, slot 9");
  set_score(&w, LAST_ROW, 9, saved);

  tensor *act = &w.t[W_ACTIVE];
  const int64_t keep = get64(act, LAST_ROW, 2);
  set_entry(&w, W_ACTIVE, LAST_ROW, 2, N);
  EXPECT("active out of range", imoe_build_map(&w.active, idx, tm, NULL, 0, &w.exec, err),
         IMOE_ERR_INDEX_RANGE, "row 5, position 2");
  set_entry(&w, W_ACTIVE, LAST_ROW, 2, -1);
  EXPECT("active negative", imoe_build_map(&w.active, idx, tm, NULL, 0, &w.exec, err), IMOE_ERR_INDEX_RANGE,
         "row 5");
  set_entry(&w, W_ACTIVE, LAST_ROW, 2, get64(act, LAST_ROW, 0));
  EXPECT("active duplicate", imoe_build_map(&w.active, idx, tm, NULL, 0, &w.exec, err),
         IMOE_ERR_INDEX_DUPLICATE, "row 5, position 2");
  set_entry(&w, W_ACTIVE, LAST_ROW, 2, keep);

  sel = w.active, sel.capacity = 3;
  v = *idx, v.n = 3;
  EXPECT("K != capacity", imoe_build_map(&sel, &v, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT, "active");
  sel = w.active, sel.protected_prefix = 1;
  EXPECT("active with P", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT, "active");
  sel = w.active, v = *w.active.active, sel.active = &v;
  v.dtype = IMOE_DTYPE_F32, v.row_bytes = 4;
  EXPECT("F32 active", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_DTYPE, "active");
  v = *w.active.active, v.lead_shape[1] = 2;
  EXPECT("active lead shape", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "active");
  /* Shared [K] form: row 0 of the active tensor read as a 1-D view. */
  v = *w.active.active, v.lead_ndim = 0, v.data = tensor_at(act, LAST_ROW, 0);
  set_entry(&w, W_ACTIVE, LAST_ROW, 1, 77);
  EXPECT("shared active out of range", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err),
         IMOE_ERR_INDEX_RANGE, "row 0, position 1");
  set_entry(&w, W_ACTIVE, LAST_ROW, 1, get64(act, LAST_ROW, 3));
  EXPECT("shared active duplicate", imoe_build_map(&sel, idx, tm, NULL, 0, NULL, err),
         IMOE_ERR_INDEX_DUPLICATE, "position 3");
  set_entry(&w, W_ACTIVE, LAST_ROW, 1, 8); /* back to (5 + 3) % 10 */

  /* The fixture itself is valid. */
  imoe_error e;
  CHECK(imoe_build_map(&w.sel, idx, tm, NULL, 0, &w.exec, &e) == IMOE_OK, "valid build_map: %s", e.message);
  CHECK(imoe_build_map(&w.active, NULL, tm, NULL, 0, &w.exec, &e) == IMOE_OK, "valid active: %s", e.message);
  CHECK(imoe_build_map(&sel, idx, tm, NULL, 0, NULL, &e) == IMOE_OK, "valid shared active: %s", e.message);
  world_free(&w);
}

static void compact_paths(void) {
  world w;
  world_init(&w);
  imoe_view *idx = &w.t[W_IDX].view, *tm = &w.t[W_TM].view;
  imoe_view b[65];
  imoe_view v;
  imoe_selection sel;
  for (int i = 0; i < 65; i++) b[i] = w.buffers[i % 2];

  EXPECT("buffers NULL", imoe_compact(NULL, 2, &w.sel, idx, tm, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "buffers");
  EXPECT("0 buffers", imoe_compact(w.buffers, 0, &w.sel, idx, tm, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "num_buffers");
  EXPECT("-1 buffers", imoe_compact(w.buffers, -1, &w.sel, idx, tm, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "num_buffers");
  EXPECT("65 buffers", imoe_compact(b, 65, &w.sel, idx, tm, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "num_buffers");
  b[0] = w.buffers[0], b[1] = w.buffers[1], b[1].row_bytes = 0;
  EXPECT("buffer row_bytes 0", imoe_compact(b, 2, &w.sel, idx, tm, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "buffers[1]");
  b[1] = w.buffers[1], b[1].n = 9;
  EXPECT("buffer n", imoe_compact(b, 2, &w.sel, idx, tm, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "buffers[1]");
  b[1] = w.buffers[1], b[1].lead_shape[1] = 1;
  EXPECT("buffer lead", imoe_compact(b, 2, &w.sel, idx, tm, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "buffers[1]");
  b[1] = w.buffers[1], b[1].dtype = (imoe_dtype)42;
  EXPECT("buffer dtype 42", imoe_compact(b, 2, &w.sel, idx, tm, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_DTYPE, "buffers[1]");
  b[1] = w.buffers[1], b[1].n_stride = -2;
  EXPECT("overlapping slots", imoe_compact(b, 2, &w.sel, idx, tm, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "buffers[1]");
  EXPECT("out_indices NULL",
         imoe_compact(w.buffers, 2, &w.sel, NULL, tm, IMOE_MODE_SWAP, NULL, 0, NULL, err), IMOE_ERR_ARGUMENT,
         "out_indices");
  EXPECT("bad mode", imoe_compact(w.buffers, 2, &w.sel, idx, tm, (imoe_mode)2, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "mode");
  sel = w.sel, v = *w.sel.scores, sel.scores = &v, v.n = 9;
  EXPECT("scores n != N", imoe_compact(w.buffers, 2, &sel, idx, tm, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "scores");
  if (!imoe_cuda_compiled()) {
    imoe_exec ex = w.exec;
    ex.device = IMOE_DEVICE_CUDA;
    EXPECT("CUDA compact", imoe_compact(w.buffers, 2, &w.sel, idx, tm, IMOE_MODE_SWAP, NULL, 0, &ex, err),
           IMOE_ERR_UNSUPPORTED, "CUDA");
  }
  CHECK(imoe_compact(w.buffers, 2, &w.sel, NULL, NULL, IMOE_MODE_SWAP, NULL, 0, NULL, NULL) ==
            IMOE_ERR_ARGUMENT,
        "err NULL");

  float saved;
  memcpy(&saved, tensor_at(&w.t[W_SCORES], LAST_ROW, 0), 4);
  set_score(&w, LAST_ROW, 0, NAN);
  for (int mode = 0; mode < 2; mode++) {
    EXPECT("NaN in compact",
           imoe_compact(w.buffers, 2, &w.sel, idx, tm, (imoe_mode)mode, NULL, 0, &w.exec, err), IMOE_ERR_NAN,
           "row 5, slot 0");
  }
  set_score(&w, LAST_ROW, 0, saved);

  tensor *act = &w.t[W_ACTIVE];
  const int64_t keep = get64(act, LAST_ROW, 3);
  set_entry(&w, W_ACTIVE, LAST_ROW, 3, get64(act, LAST_ROW, 1));
  EXPECT("duplicate in compact",
         imoe_compact(w.buffers, 2, &w.active, idx, tm, IMOE_MODE_SWAP, NULL, 0, &w.exec, err),
         IMOE_ERR_INDEX_DUPLICATE, "row 5, position 3");
  set_entry(&w, W_ACTIVE, LAST_ROW, 3, keep);
  world_free(&w);
}

static void apply_paths(void) {
  world w;
  world_init(&w);
  tensor *idx_in = &w.t[W_IDX_IN], *tm_in = &w.t[W_TM_IN];
  imoe_view v;

  /* A hole of the last row (an entry != its position) and a fixed point. */
  int64_t hole = -1, fixed = -1;
  for (int64_t i = 0; i < C; i++) {
    if (get64(idx_in, LAST_ROW, i) != i && hole < 0) hole = i;
    if (get64(idx_in, LAST_ROW, i) == i && fixed < 0) fixed = i;
  }
  CHECK(hole >= 0 && fixed >= 0, "fixture: the last row needs a hole and a fixed point");
  if (hole < 0 || fixed < 0) {
    world_free(&w);
    return;
  }
  const int64_t was = get64(idx_in, LAST_ROW, hole);
  set_entry(&w, W_IDX_IN, LAST_ROW, hole, N);
  EXPECT("indices out of range",
         imoe_apply_indices(w.buffers, 2, &idx_in->view, IMOE_ORDER_INPLACE, IMOE_MODE_SWAP, NULL, 0, &w.exec, err),
         IMOE_ERR_INDEX_RANGE, "indices: row 5");
  set_entry(&w, W_IDX_IN, LAST_ROW, hole, -3);
  EXPECT("indices negative",
         imoe_apply_indices(w.buffers, 2, &idx_in->view, IMOE_ORDER_INPLACE, IMOE_MODE_MOVE, NULL, 0, &w.exec, err),
         IMOE_ERR_INDEX_RANGE, "row 5");
  set_entry(&w, W_IDX_IN, LAST_ROW, hole, fixed);
  EXPECT("indices below C'",
         imoe_apply_indices(w.buffers, 2, &idx_in->view, IMOE_ORDER_INPLACE, IMOE_MODE_SWAP, NULL, 0, &w.exec, err),
         IMOE_ERR_BAD_MAP, "row 5");
  set_entry(&w, W_IDX_IN, LAST_ROW, hole, was);
  set_entry(&w, W_IDX_IN, LAST_ROW, fixed, was);
  EXPECT("indices duplicate tail", imoe_restore(w.buffers, 2, &idx_in->view, IMOE_ORDER_INPLACE, NULL, 0, &w.exec, err),
         IMOE_ERR_BAD_MAP, "row 5");
  set_entry(&w, W_IDX_IN, LAST_ROW, fixed, fixed);

  v = idx_in->view, v.n = N + 1;
  EXPECT("indices n > N", imoe_apply_indices(w.buffers, 2, &v, IMOE_ORDER_INPLACE, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "indices");
  v = idx_in->view, v.dtype = IMOE_DTYPE_F32, v.row_bytes = 4;
  EXPECT("F32 indices", imoe_apply_indices(w.buffers, 2, &v, IMOE_ORDER_INPLACE, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_DTYPE, "indices");
  v = idx_in->view, v.lead_ndim = 1;
  EXPECT("indices lead", imoe_apply_indices(w.buffers, 2, &v, IMOE_ORDER_INPLACE, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "indices");
  EXPECT("indices NULL", imoe_apply_indices(w.buffers, 2, NULL, IMOE_ORDER_INPLACE, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "indices");
  EXPECT("apply mode", imoe_apply_indices(w.buffers, 2, &idx_in->view, IMOE_ORDER_INPLACE, (imoe_mode)-1, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "mode");
  EXPECT("apply 0 buffers",
         imoe_apply_indices(w.buffers, 0, &idx_in->view, IMOE_ORDER_INPLACE, IMOE_MODE_SWAP, NULL, 0, NULL, err),
         IMOE_ERR_ARGUMENT, "num_buffers");
  if (!imoe_cuda_compiled()) {
    imoe_exec ex = w.exec;
    ex.device = IMOE_DEVICE_CUDA;
    EXPECT("CUDA restore", imoe_restore(w.buffers, 2, &idx_in->view, IMOE_ORDER_INPLACE, NULL, 0, &ex, err), IMOE_ERR_UNSUPPORTED,
           "CUDA");
  }

  /* Target maps: a 2-cycle of the last row, broken one way or another. */
  int64_t x = 0;
  while (x < N && get64(tm_in, LAST_ROW, x) == x) x++;
  CHECK(x < N, "fixture: the last row needs a 2-cycle");
  const int64_t t = x < N ? get64(tm_in, LAST_ROW, x) : 0;
  if (x < N) {
    set_entry(&w, W_TM_IN, LAST_ROW, x, N + 5);
    EXPECT("target out of range",
           imoe_apply_target_map(w.buffers, 2, &tm_in->view, IMOE_MODE_SWAP, &w.exec, err),
           IMOE_ERR_INDEX_RANGE, "target_map: row 5");
    set_entry(&w, W_TM_IN, LAST_ROW, x, x);
    EXPECT("target not an involution",
           imoe_apply_target_map(w.buffers, 2, &tm_in->view, IMOE_MODE_MOVE, &w.exec, err),
           IMOE_ERR_BAD_MAP, "involution");
    set_entry(&w, W_TM_IN, LAST_ROW, x, t);
  }
  v = tm_in->view, v.n = N - 1;
  EXPECT("target n != N", imoe_apply_target_map(w.buffers, 2, &v, IMOE_MODE_SWAP, NULL, err),
         IMOE_ERR_ARGUMENT, "target_map");
  v = tm_in->view, v.dtype = IMOE_DTYPE_BF16, v.row_bytes = 2;
  EXPECT("BF16 target", imoe_apply_target_map(w.buffers, 2, &v, IMOE_MODE_SWAP, NULL, err),
         IMOE_ERR_DTYPE, "target_map");
  world_free(&w);
}

/* The messages' names of buffers: "buffers[b]" for every b a call may take,
 * NULL outside. */
static void buffer_names(void) {
  for (int32_t b = 0; b < IMOE_MAX_BUFFERS; b++) {
    char expected[32];
    snprintf(expected, sizeof expected, "buffers[%d]", (int)b);
    const char *name = imoe_buffer_name(b);
    CHECK(name != NULL && strcmp(name, expected) == 0, "imoe_buffer_name(%d) = %s", (int)b,
          name ? name : "NULL");
  }
  CHECK(imoe_buffer_name(-1) == NULL, "imoe_buffer_name(-1) is not NULL");
  CHECK(imoe_buffer_name(IMOE_MAX_BUFFERS) == NULL, "imoe_buffer_name(%d) is not NULL",
        IMOE_MAX_BUFFERS);
}

void test_status_paths(void) {
  build_map_paths();
  compact_paths();
  apply_paths();
  buffer_names();
}
