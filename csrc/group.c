/* group.c: imoe_group_by_expert, dropless grouping of the slots of each row
 * by expert: a stable counting sort of expert ids gives the offsets (each
 * expert's end, as grouped GEMMs take them) and the permutation, which the
 * permutation engine (permute.c) then applies in place. */
#include <inttypes.h>
#include <stdlib.h>

#include "imoe_internal.h"

#include "imoe_backend.h"

typedef struct group_ctx {
  const imoe_view *ids;
  int64_t n; /* T */
  int64_t experts;
  const imoe_view *offsets;
  const imoe_view *perm; /* or NULL */
  int32_t *plans;
} group_ctx;

static imoe_status check_ids_row(const void *vctx, int64_t row, unsigned char *mem,
                                 imoe_error *err) {
  const group_ctx *ctx = vctx;
  const char *base = imoe_row_base(ctx->ids, row);
  const int64_t stride = ctx->ids->n_stride;
  (void)mem;
  for (int64_t t = 0; t < ctx->n; t++) {
    const int64_t e = imoe_load_index(base + t * stride, ctx->ids->dtype);
    if (e < 0 || e >= ctx->experts) {
      return imoe_fail(err, IMOE_ERR_INDEX_RANGE,
                       "expert_ids: row %" PRId64 ", position %" PRId64 " holds %" PRId64
                       ", outside [0, num_experts = %" PRId64 ")",
                       row, t, e, ctx->experts);
    }
  }
  return IMOE_OK;
}

static imoe_status plan_group_row(const void *vctx, int64_t row, unsigned char *mem,
                                  imoe_error *err) {
  const group_ctx *ctx = vctx;
  const char *ids = imoe_row_base(ctx->ids, row);
  const int64_t n = ctx->n, experts = ctx->experts, stride = ctx->ids->n_stride;
  const imoe_dtype dtype = ctx->ids->dtype;
  int64_t *next = (int64_t *)(void *)mem; /* [E + 1] */
  int32_t *plan = n > 0 ? ctx->plans + row * n : NULL; /* no plan when T = 0 */
  (void)err;
  memset(next, 0, (size_t)(experts + 1) * sizeof *next);
  for (int64_t t = 0; t < n; t++) next[imoe_load_index(ids + t * stride, dtype) + 1]++;
  char *off = imoe_row_base(ctx->offsets, row);
  const int64_t off_stride = ctx->offsets->n_stride;
  for (int64_t e = 0; e < experts; e++) {
    next[e + 1] += next[e];
    imoe_store_index(off + e * off_stride, ctx->offsets->dtype, next[e + 1]); /* expert e's end */
  }
  /* next[e] is now the first slot of expert e; slots in ascending order keep
   * each expert's tokens in their original order. */
  for (int64_t t = 0; t < n; t++) plan[next[imoe_load_index(ids + t * stride, dtype)]++] = (int32_t)t;
  if (ctx->perm != NULL) {
    char *p = imoe_row_base(ctx->perm, row);
    const int64_t p_stride = ctx->perm->n_stride;
    for (int64_t i = 0; i < n; i++) imoe_store_index(p + i * p_stride, ctx->perm->dtype, plan[i]);
  }
  imoe_plan_encode(plan, n);
  return IMOE_OK;
}

static imoe_status check_output(const imoe_view *v, const char *name, const imoe_view *ref,
                                int64_t n, imoe_error *err) {
  imoe_status st = imoe_check_view(v, name, err);
  if (st == IMOE_OK) st = imoe_check_typed(v, name, IMOE_INDEX_DTYPES, err);
  if (st == IMOE_OK) st = imoe_check_writable(v, name, err);
  if (st == IMOE_OK) st = imoe_check_same_lead(v, name, ref, "buffers[0]", err);
  if (st == IMOE_OK && v->n != n) {
    st = imoe_fail(err, IMOE_ERR_ARGUMENT, "%s: n = %" PRId64 " must be %" PRId64, name, v->n, n);
  }
  return st;
}

imoe_status imoe_group_by_expert(const imoe_view *buffers, int32_t num_buffers,
                                 const imoe_view *expert_ids, int64_t num_experts,
                                 const imoe_view *out_offsets, const imoe_view *out_perm,
                                 int32_t *workspace, int64_t workspace_elems,
                                 const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_check_buffers(buffers, num_buffers, err);
  if (st != IMOE_OK) return st;
  const int64_t n = buffers[0].n;
  if (num_experts < 0 || num_experts >= IMOE_MAX_SLOTS) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "num_experts %" PRId64 " is outside [0, %" PRId64 ")",
                     num_experts, (int64_t)IMOE_MAX_SLOTS);
  }
  st = imoe_check_view(expert_ids, "expert_ids", err);
  if (st == IMOE_OK) st = imoe_check_typed(expert_ids, "expert_ids", IMOE_INDEX_DTYPES, err);
  if (st == IMOE_OK) st = imoe_check_same_lead(expert_ids, "expert_ids", &buffers[0], "buffers[0]", err);
  if (st == IMOE_OK && expert_ids->n != n) {
    st = imoe_fail(err, IMOE_ERR_ARGUMENT,
                   "expert_ids: n = %" PRId64 " must equal the buffers' T = %" PRId64,
                   expert_ids->n, n);
  }
  if (st == IMOE_OK && out_offsets == NULL) {
    st = imoe_fail(err, IMOE_ERR_ARGUMENT, "out_offsets is NULL: it is required");
  }
  if (st == IMOE_OK) st = check_output(out_offsets, "out_offsets", &buffers[0], num_experts, err);
  if (st == IMOE_OK && out_perm != NULL) st = check_output(out_perm, "out_perm", &buffers[0], n, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  const imoe_call_args call = {buffers, num_buffers, NULL, {expert_ids}, {"expert_ids"},
                               {out_offsets, out_perm}, {"out_offsets", "out_perm"},
                               workspace, workspace_elems};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK || empty) return st;
  if (imoe_on_cuda(exec)) {
    st = imoe_check_cuda_workspace(workspace, workspace_elems, IMOE_PLAN_GROUP,
                                   imoe_view_rows(&buffers[0]), n, err);
    if (st != IMOE_OK) return st;
    return imoe_cuda_group_by_expert(buffers, num_buffers, expert_ids, num_experts, out_offsets,
                                     out_perm, workspace, workspace_elems, exec, err);
  }

  const int64_t rows = imoe_view_rows(&buffers[0]);
  group_ctx ctx = {expert_ids, n, num_experts, out_offsets, out_perm, NULL};
  int32_t *owned;
  st = imoe_plan_workspace(workspace, workspace_elems, rows * n, &ctx.plans, &owned, err);
  if (st != IMOE_OK) return st;
  const int threads = imoe_thread_count(exec, imoe_buffers_bytes(buffers, num_buffers),
                                        rows * (n > 1 ? n : 1));
  imoe_cycle_mover mover;
  imoe_cycle_mover_init(&mover, buffers, num_buffers, ctx.plans, rows, n, threads);
  const imoe_stage stages[] = {
      {check_ids_row, &ctx, rows},
      {plan_group_row, &ctx, rows},
      {imoe_cycle_move_item, &mover, imoe_cycle_mover_items(&mover)},
  };
  st = imoe_run_stages(stages, 3, (size_t)(num_experts + 1) * sizeof(int64_t), threads, err);
  free(owned);
  return st;
}
