/* build.c: imoe_build_map and imoe_compact, the entry points that select. */
#include <inttypes.h>
#include <stdlib.h>

#include "imoe_internal.h"

#include "imoe_backend.h"

typedef struct select_ctx {
  const imoe_selection *sel;
  int64_t n;    /* slots per row */
  int64_t kept; /* C' */
  const imoe_view *indices;
  const imoe_view *target_map;
} select_ctx;

static imoe_status check_row(const void *vctx, int64_t row, unsigned char *mem, imoe_error *err) {
  const select_ctx *ctx = vctx;
  if (ctx->sel->scores != NULL) return imoe_check_scores_row(ctx->sel->scores, row, err);
  const imoe_row_workspace ws = imoe_row_workspace_at(mem, ctx->n, 1);
  return imoe_check_active_row(ctx->sel->active, row, ctx->n, ws.flags, err);
}

/* The row's workspace in mem, its flags set to the kept slots of the row. */
static imoe_row_workspace select_flags(const select_ctx *ctx, int64_t row, unsigned char *mem) {
  const imoe_row_workspace ws = imoe_row_workspace_at(mem, ctx->n, 1);
  if (ctx->sel->scores != NULL) {
    imoe_select_scores_row(ctx->sel, row, ctx->n, ws);
  } else {
    imoe_select_active_row(ctx->sel->active, row, ctx->n, ws.flags);
  }
  return ws;
}

static imoe_status select_row(const void *vctx, int64_t row, unsigned char *mem, imoe_error *err) {
  const select_ctx *ctx = vctx;
  const imoe_row_workspace ws = select_flags(ctx, row, mem);
  (void)err;
  imoe_write_map_row(ws.flags, ctx->n, ctx->kept, ws.list, ctx->indices, ctx->target_map, row);
  return IMOE_OK;
}

/* Rows whose data must be checked before anything is written: NaN scores
 * (only under IMOE_NAN_ERROR), or active indices, once when shared. */
static int64_t rows_to_check(const imoe_selection *sel, int64_t rows) {
  if (sel->scores != NULL) return sel->nan_policy == IMOE_NAN_ERROR ? rows : 0;
  return sel->active->lead_ndim == 0 ? 1 : rows;
}

/* ---- ordered compaction: kept slots in STABLE or SCORE order ------------- */

typedef struct ordered_ctx {
  select_ctx sel; /* first: check_row and select_row take it */
  imoe_order order;
  int32_t *plans; /* [rows, n]: P of every row, or NULL (map only) */
} ordered_ctx;

static imoe_status select_ordered_row(const void *vctx, int64_t row, unsigned char *mem,
                                      imoe_error *err) {
  const ordered_ctx *ctx = vctx;
  const select_ctx *s = &ctx->sel;
  const imoe_row_workspace ws = select_flags(s, row, mem);
  (void)err;
  /* The candidate list of the selection is free again: it takes the order. */
  imoe_kept_in_order(s->sel, row, s->n, s->kept, ctx->order, ws,
                     mem + imoe_row_workspace_bytes(s->n, 1), ws.list);
  char *idx = imoe_row_base(s->indices, row);
  const int64_t stride = s->indices->n_stride;
  for (int64_t i = 0; i < s->kept; i++) {
    imoe_store_index(idx + i * stride, s->indices->dtype, ws.list[i]);
  }
  if (ctx->plans != NULL) {
    int32_t *plan = ctx->plans + row * s->n;
    imoe_plan_from_kept(ws.list, s->kept, ws.flags, s->n, plan);
    imoe_plan_encode(plan, s->n);
  }
  return IMOE_OK;
}

static size_t ordered_workspace_bytes(int64_t n, imoe_order order) {
  return imoe_row_workspace_bytes(n, 1) + imoe_order_extra_bytes(n, order);
}

/* N of a build_map call: the scores', else out_target_map's, else the
 * caller's num_slots (active indices alone do not say it). */
static int64_t build_map_slots(const imoe_selection *sel, const imoe_view *out_target_map) {
  if (sel->scores != NULL) return sel->scores->n;
  return out_target_map != NULL ? out_target_map->n : sel->num_slots;
}

imoe_status imoe_build_map(const imoe_selection *sel, const imoe_view *out_indices,
                           const imoe_view *out_target_map, int32_t *workspace,
                           int64_t workspace_elems, const imoe_exec *exec, imoe_error *err) {
  if (sel == NULL) return imoe_fail(err, IMOE_ERR_ARGUMENT, "sel is NULL");
  if (out_indices == NULL && out_target_map == NULL) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "out_indices and out_target_map are both missing: give at least one");
  }
  if (sel->order != IMOE_ORDER_INPLACE && out_target_map != NULL) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "out_target_map: only order='inplace' has a target-map form");
  }
  const imoe_view *ref = out_indices ? out_indices : out_target_map;
  const char *ref_name = out_indices ? "out_indices" : "out_target_map";
  imoe_status st = imoe_check_view(ref, ref_name, err);
  if (st != IMOE_OK) return st;
  const int64_t n = build_map_slots(sel, out_target_map);
  if (sel->scores == NULL && out_target_map == NULL) {
    /* With rows to fill, K > 0 active indices cannot lie in [0, 0): N was
     * left out (a call with no rows is valid with any N). */
    if (sel->active != NULL && sel->active->n > 0 && n == 0 && imoe_view_rows(ref) > 0) {
      return imoe_fail(err, IMOE_ERR_ARGUMENT,
                       "num_slots: active_indices do not say N; give num_slots (or out_target_map)");
    }
    if (n < 0 || n > IMOE_MAX_SLOTS) {
      return imoe_fail(err, IMOE_ERR_ARGUMENT,
                       "num_slots = %" PRId64 " is outside [0, %" PRId64 "]", n,
                       (int64_t)IMOE_MAX_SLOTS);
    }
  }
  ordered_ctx ctx = {{sel, n, 0, out_indices, out_target_map}, sel->order, NULL};
  st = imoe_check_selection(sel, ref, ref_name, n, &ctx.sel.kept, err);
  if (st == IMOE_OK) {
    st = imoe_check_map_outputs(out_indices, out_target_map, ref, ref_name, n, ctx.sel.kept, err);
  }
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  const imoe_call_args call = {NULL, 0, sel, {NULL}, {NULL}, {out_indices, out_target_map},
                               {"out_indices", "out_target_map"}, workspace, workspace_elems};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK || empty) return st;
  if (imoe_on_cuda(exec)) {
    if (sel->order != IMOE_ORDER_INPLACE) {
      return imoe_cuda_build_map_ordered(sel, sel->order, n, out_indices, workspace,
                                         workspace_elems, exec, err);
    }
    if (sel->active != NULL && out_target_map == NULL) {
      return imoe_fail(err, IMOE_ERR_ARGUMENT,
                       "out_target_map: on CUDA, active_indices with order='inplace' take N from "
                       "it; pass one");
    }
    return imoe_cuda_build_map(sel, out_indices, out_target_map, exec, err);
  }

  const int64_t rows = imoe_view_rows(ref);
  const imoe_stage stages[] = {
      {check_row, &ctx.sel, rows_to_check(sel, rows)},
      sel->order == IMOE_ORDER_INPLACE ? (imoe_stage){select_row, &ctx.sel, rows}
                                       : (imoe_stage){select_ordered_row, &ctx, rows},
  };
  const int64_t elements = rows * n; /* fits: checked with the output views */
  const int threads =
      imoe_thread_count(exec, elements > INT64_MAX / 8 ? INT64_MAX : elements * 8, rows);
  return imoe_run_stages(stages, 2, ordered_workspace_bytes(n, sel->order), threads, err);
}

/* The CPU compaction in order STABLE or SCORE: select and order each row,
 * plan its permutation P, then move every buffer through the plans. */
static imoe_status compact_in_order(const imoe_view *buffers, int32_t num_buffers,
                                    ordered_ctx *ctx, imoe_mode mode, int32_t *workspace,
                                    int64_t workspace_elems, const imoe_exec *exec,
                                    imoe_error *err) {
  const int64_t rows = imoe_view_rows(&buffers[0]), n = ctx->sel.n;
  int32_t *owned;
  imoe_status st =
      imoe_plan_workspace(workspace, workspace_elems, rows * n, &ctx->plans, &owned, err);
  if (st != IMOE_OK) return st;
  const int threads = imoe_thread_count(exec, imoe_buffers_bytes(buffers, num_buffers),
                                        rows * (n > 1 ? n : 1));
  imoe_cycle_mover mover;
  imoe_cycle_mover_init(&mover, buffers, num_buffers, ctx->plans, rows,
                        mode == IMOE_MODE_MOVE ? ctx->sel.kept : n, threads);
  const imoe_stage stages[] = {
      {check_row, &ctx->sel, rows_to_check(ctx->sel.sel, rows)},
      {select_ordered_row, ctx, rows},
      {imoe_cycle_move_item, &mover, imoe_cycle_mover_items(&mover)},
  };
  st = imoe_run_stages(stages, 3, ordered_workspace_bytes(n, ctx->order), threads, err);
  free(owned);
  return st;
}

imoe_status imoe_compact(const imoe_view *buffers, int32_t num_buffers, const imoe_selection *sel,
                         const imoe_view *out_indices, const imoe_view *out_target_map,
                         imoe_mode mode, int32_t *workspace, int64_t workspace_elems,
                         const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_check_buffers(buffers, num_buffers, err);
  if (st != IMOE_OK) return st;
  if (sel == NULL) return imoe_fail(err, IMOE_ERR_ARGUMENT, "sel is NULL");
  ordered_ctx ctx = {{sel, buffers[0].n, 0, out_indices, out_target_map}, sel->order, NULL};
  st = imoe_check_selection(sel, &buffers[0], "buffers[0]", ctx.sel.n, &ctx.sel.kept, err);
  if (st == IMOE_OK && out_indices == NULL) {
    st = imoe_fail(err, IMOE_ERR_ARGUMENT, "out_indices is missing: a compaction writes it");
  }
  if (st == IMOE_OK && sel->order != IMOE_ORDER_INPLACE && out_target_map != NULL) {
    st = imoe_fail(err, IMOE_ERR_ARGUMENT,
                   "out_target_map: only order='inplace' has a target-map form");
  }
  if (st == IMOE_OK) {
    st = imoe_check_map_outputs(out_indices, out_target_map, &buffers[0], "buffers[0]", ctx.sel.n,
                                ctx.sel.kept, err);
  }
  if (st == IMOE_OK) st = imoe_check_mode(mode, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  const imoe_call_args call = {buffers, num_buffers, sel, {NULL}, {NULL},
                               {out_indices, out_target_map}, {"out_indices", "out_target_map"},
                               workspace, workspace_elems};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK || empty) return st;
  if (imoe_on_cuda(exec)) {
    if (sel->order != IMOE_ORDER_INPLACE) {
      return imoe_cuda_compact_ordered(buffers, num_buffers, sel, sel->order, mode, out_indices,
                                       workspace, workspace_elems, exec, err);
    }
    return imoe_cuda_compact(buffers, num_buffers, sel, out_indices, out_target_map, mode, exec,
                             err);
  }
  if (sel->order != IMOE_ORDER_INPLACE) {
    return compact_in_order(buffers, num_buffers, &ctx, mode, workspace, workspace_elems, exec,
                            err);
  }

  const int64_t rows = imoe_view_rows(&buffers[0]);
  const int threads = imoe_thread_count(exec, imoe_buffers_bytes(buffers, num_buffers),
                                        rows * (ctx.sel.kept > 1 ? ctx.sel.kept : 1));
  /* The apply stage reads back the indices the select stage wrote. */
  imoe_apply_plan plan;
  imoe_apply_plan_init(&plan, buffers, num_buffers, out_indices, mode, threads);
  const imoe_stage stages[] = {
      {check_row, &ctx.sel, rows_to_check(sel, rows)},
      {select_row, &ctx.sel, rows},
      {imoe_apply_indices_item, &plan, imoe_apply_plan_items(&plan)},
  };
  return imoe_run_stages(stages, 3, imoe_row_workspace_bytes(ctx.sel.n, 1), threads, err);
}
