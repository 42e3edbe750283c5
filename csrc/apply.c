/* apply.c: imoe_apply_indices, imoe_apply_target_map, imoe_restore: apply a
 * caller-given map, after checking every row of it. Orders STABLE and SCORE
 * go to the permutation engine (permute.c). */
#include <inttypes.h>

#include "imoe_internal.h"

#include "imoe_backend.h"

typedef struct map_ctx {
  const imoe_view *map;
  int64_t n;
} map_ctx;

static imoe_status check_indices_row(const void *vctx, int64_t row, unsigned char *mem,
                                     imoe_error *err) {
  const map_ctx *ctx = vctx;
  const imoe_row_workspace ws = imoe_row_workspace_at(mem, ctx->n, 0);
  return imoe_check_indices_row(ctx->map, row, ctx->n, ws.flags, err);
}

static imoe_status check_target_map_row(const void *vctx, int64_t row, unsigned char *mem,
                                        imoe_error *err) {
  const map_ctx *ctx = vctx;
  (void)mem;
  return imoe_check_target_map_row(ctx->map, row, err);
}

static imoe_status check_map_args(const imoe_view *buffers, int32_t num_buffers,
                                  const imoe_view *map, const char *name, int is_indices,
                                  imoe_mode mode, const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_check_buffers(buffers, num_buffers, err);
  if (st == IMOE_OK) st = imoe_check_view(map, name, err);
  if (st == IMOE_OK) st = imoe_check_typed(map, name, IMOE_INDEX_DTYPES, err);
  if (st == IMOE_OK) st = imoe_check_same_lead(map, name, &buffers[0], "buffers[0]", err);
  if (st != IMOE_OK) return st;
  const int64_t n = buffers[0].n;
  if (is_indices && map->n > n) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "%s: C' = %" PRId64 " exceeds the buffers' N = %" PRId64, name, map->n, n);
  }
  if (!is_indices && map->n != n) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "%s: n = %" PRId64 " must equal the buffers' N = %" PRId64, name, map->n, n);
  }
  st = imoe_check_mode(mode, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  const imoe_call_args call = {buffers, num_buffers, NULL, {map}, {name}, {NULL}, {NULL}, NULL, 0};
  return imoe_check_call(&call, &empty, err);
}

static imoe_status apply_map(const imoe_view *buffers, int32_t num_buffers, const imoe_view *map,
                             int is_indices, imoe_mode mode, const imoe_exec *exec,
                             imoe_error *err) {
  const char *name = is_indices ? "indices" : "target_map";
  const imoe_status st =
      check_map_args(buffers, num_buffers, map, name, is_indices, mode, exec, err);
  if (st != IMOE_OK) return st;
  /* An empty map (no row, or C' = 0) has nothing to check and moves nothing. */
  if (imoe_view_is_empty(map)) return IMOE_OK;
  if (imoe_on_cuda(exec)) {
    return is_indices ? imoe_cuda_apply_indices(buffers, num_buffers, map, mode, exec, err)
                      : imoe_cuda_apply_target_map(buffers, num_buffers, map, mode, exec, err);
  }

  const map_ctx ctx = {map, buffers[0].n};
  const int64_t rows = imoe_view_rows(map);
  const int threads = imoe_thread_count(exec, imoe_buffers_bytes(buffers, num_buffers),
                                        rows * (map->n > 1 ? map->n : 1));
  imoe_apply_plan plan;
  imoe_apply_plan_init(&plan, buffers, num_buffers, map, mode, threads);
  const imoe_stage stages[] = {
      {is_indices ? check_indices_row : check_target_map_row, &ctx, rows},
      {is_indices ? imoe_apply_indices_item : imoe_apply_target_map_item, &plan,
       imoe_apply_plan_items(&plan)},
  };
  const size_t workspace = is_indices ? imoe_row_workspace_bytes(ctx.n, 0) : 0;
  return imoe_run_stages(stages, 2, workspace, threads, err);
}

/* The map of an earlier compaction (indices, in `order`), applied or, restore: undone. */
static imoe_status apply_indices(const imoe_view *buffers, int32_t num_buffers,
                                 const imoe_view *indices, imoe_order order, imoe_mode mode,
                                 int restore, int32_t *workspace, int64_t workspace_elems,
                                 const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_check_order(order, 1, err);
  if (st != IMOE_OK) return st;
  if (order != IMOE_ORDER_INPLACE) {
    return imoe_apply_kept_order(buffers, num_buffers, indices, mode, restore, workspace,
                                 workspace_elems, exec, err);
  }
  return apply_map(buffers, num_buffers, indices, 1, mode, exec, err);
}

imoe_status imoe_apply_indices(const imoe_view *buffers, int32_t num_buffers,
                               const imoe_view *indices, imoe_order order, imoe_mode mode,
                               int32_t *workspace, int64_t workspace_elems, const imoe_exec *exec,
                               imoe_error *err) {
  return apply_indices(buffers, num_buffers, indices, order, mode, 0, workspace, workspace_elems,
                       exec, err);
}

imoe_status imoe_apply_target_map(const imoe_view *buffers, int32_t num_buffers,
                                  const imoe_view *target_map, imoe_mode mode,
                                  const imoe_exec *exec, imoe_error *err) {
  return apply_map(buffers, num_buffers, target_map, 0, mode, exec, err);
}

imoe_status imoe_restore(const imoe_view *buffers, int32_t num_buffers, const imoe_view *indices,
                         imoe_order order, int32_t *workspace, int64_t workspace_elems,
                         const imoe_exec *exec, imoe_error *err) {
  return apply_indices(buffers, num_buffers, indices, order, IMOE_MODE_SWAP, 1, workspace,
                       workspace_elems, exec, err);
}
