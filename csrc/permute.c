/* permute.c: the permutation engine, and imoe_permute, imoe_apply_ordered,
 * imoe_restore_ordered.
 *
 * A general permutation p of the N slots of a row (new slot i takes old slot
 * p[i]) is applied in place by cycle following. Each row's plan lives in an
 * int32 workspace row [N]: the first stage of a call fills it (from the
 * caller's permutation, checking it, or from an ordered compaction's
 * indices) and marks the cycles; the second stage moves the bytes.
 *
 * Why a workspace rather than no memory at all: without one, a slot is a
 * cycle leader iff it is the minimum of its cycle, which a walk along the
 * cycle decides; that costs O(N log N) index steps for a random permutation
 * and O(N^2) for a rotation (from slot i the walk visits i + 1, ..., N - 1
 * before it meets a smaller slot), and a permutation must be checked before
 * any byte moves, which needs O(N) memory anyway (a "seen" mark per value).
 * With the marks of the plan, finding the leaders is one O(N) pass, and the
 * move stage reads one contiguous int32 array instead of the caller's
 * strided int64 one. 4 bytes per slot: 0.8% of the data for 512-byte rows.
 *
 * Moving: the cycle x -> p[x] -> ... is rotated through a stack tile, one
 * byte range of the slots at a time (slot[j] = slot[p[j]] along the cycle,
 * the leader's bytes saved in the tile and written last). Byte ranges of one
 * row are independent of each other, so a row splits into items of
 * (buffer, byte chunk of at most the tile), and one long row still spreads
 * over every thread even when its permutation is a single cycle. */
#include <inttypes.h>
#include <stdlib.h>

#include "imoe_internal.h"

#include "imoe_backend.h"

#if defined(__GNUC__)
#define IMOE_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define IMOE_ALWAYS_INLINE inline
#endif

/* Bytes of one slot rotated at a time; a chunk of work is never larger. */
#define CYCLE_TILE 4096
/* Chunks are cache lines or more: smaller ones would share lines between
 * threads and pay the index walk for too few bytes. */
#define CYCLE_MIN_CHUNK 64

/* ---- plans -------------------------------------------------------------- */

void imoe_plan_encode(int32_t *plan, int64_t n) {
  /* Scanning down, the first slot of a cycle met is its largest: every
   * larger slot was scanned already and would have marked it. */
  for (int64_t x = n - 1; x >= 0; x--) {
    const int32_t next = plan[x];
    if (next < 0 || next == x) continue; /* marked, or a fixed point */
    int32_t j = next;
    while (j != x) {
      const int32_t s = plan[j];
      plan[j] = ~s;
      j = s;
    }
  }
}

int64_t imoe_plan_encode_checked(int32_t *plan, int64_t n) {
  /* As imoe_plan_encode, but a walk that meets a marked slot has found a
   * slot with two predecessors: not a permutation. A walk that meets a
   * leader of an earlier cycle (unmarked) marks it and meets that cycle's
   * marked successor (or, for a fixed point, itself) one step later, and
   * every step marks a slot, so this terminates and always detects. When no
   * walk fails, every slot lies on exactly one closed cycle: a bijection. */
  for (int64_t x = n - 1; x >= 0; x--) {
    const int32_t next = plan[x];
    if (next < 0 || next == x) continue;
    int32_t j = next;
    while (j != x) {
      const int32_t s = plan[j];
      if (s < 0) return j;
      plan[j] = ~s;
      j = s;
    }
  }
  return -1;
}

imoe_status imoe_check_plan_workspace(const int32_t *given, int64_t given_elems, int64_t need,
                                      imoe_error *err) {
  if (given != NULL && given_elems < need) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "workspace: %" PRId64 " int32 elements, the call needs %" PRId64, given_elems,
                     need);
  }
  return IMOE_OK;
}

imoe_status imoe_plan_workspace(int32_t *given, int64_t given_elems, int64_t need, int32_t **plan,
                                int32_t **owned, imoe_error *err) {
  *owned = NULL;
  *plan = given;
  if (given != NULL) return imoe_check_plan_workspace(given, given_elems, need, err);
  if (need == 0) return IMOE_OK;
  if ((uint64_t)need > SIZE_MAX / sizeof(int32_t)) {
    return imoe_fail(err, IMOE_ERR_NO_MEMORY, "workspace: %" PRId64 " int32 elements is too many",
                     need);
  }
  *owned = malloc((size_t)need * sizeof(int32_t));
  if (*owned == NULL) {
    return imoe_fail(err, IMOE_ERR_NO_MEMORY,
                     "could not allocate the %" PRId64 "-element int32 plan workspace", need);
  }
  *plan = *owned;
  return IMOE_OK;
}

/* ---- moving ------------------------------------------------------------- */

void imoe_cycle_mover_init(imoe_cycle_mover *m, const imoe_view *buffers, int32_t num_buffers,
                           const int32_t *plans, int64_t plan_rows, int64_t limit,
                           int num_threads) {
  m->buffers = buffers;
  m->num_buffers = num_buffers;
  m->plans = plans;
  m->plan_rows = plan_rows;
  m->n = buffers[0].n;
  m->limit = limit;
  m->rows = imoe_view_rows(&buffers[0]);
  m->chunk = CYCLE_TILE;
  m->per_row = 0;
  m->first[0] = 0;
  if (m->rows == 0 || m->n < 2) return; /* nothing can move */
  int64_t total = 0;
  for (int32_t b = 0; b < num_buffers; b++) {
    total = buffers[b].row_bytes > INT64_MAX - total ? INT64_MAX : total + buffers[b].row_bytes;
  }
  /* Rows are split into byte chunks only as much as there are fewer rows
   * than threads: the chunks of one row cost the same (each walks the whole
   * plan row, moving its share of bytes), so one per thread balances them,
   * and every extra chunk would pay for one more walk of the plan. */
  const int64_t split = ((int64_t)num_threads + m->rows - 1) / m->rows;
  int64_t chunk = total / split + (total % split != 0);
  chunk = (chunk + CYCLE_MIN_CHUNK - 1) / CYCLE_MIN_CHUNK * CYCLE_MIN_CHUNK;
  if (chunk > CYCLE_TILE) chunk = CYCLE_TILE;
  m->chunk = chunk;
  for (int32_t b = 0; b < num_buffers; b++) {
    const int64_t rb = buffers[b].row_bytes;
    m->first[b + 1] = m->first[b] + rb / chunk + (rb % chunk != 0);
  }
  m->per_row = m->first[num_buffers];
}

/* Rotates every cycle of a plan row over `len` bytes at `base` of each slot.
 * Inlined with constant lengths, the copies become plain moves. */
/* The slot `ahead` steps further along a cycle is prefetched: the walk is a
 * chain of dependent random reads, and the plan (cache-resident) says where
 * the next ones are long before the data arrives. */
#define CYCLE_PREFETCH_AHEAD 8

static IMOE_ALWAYS_INLINE void prefetch_slot(const char *p, size_t len) {
#if defined(__GNUC__)
  for (size_t o = 0; o < len; o += 64) __builtin_prefetch(p + o, 0, 0);
#else
  (void)p;
  (void)len;
#endif
}

static IMOE_ALWAYS_INLINE void rotate_cycles(const int32_t *plan, int64_t n, int64_t limit,
                                             char *base, int64_t stride, size_t len,
                                             unsigned char *tile) {
  for (int64_t x = 0; x < n; x++) {
    const int32_t first = plan[x];
    if (first < 0 || first == x) continue; /* not a leader */
    /* Slot `ahead` is read (as the source of its predecessor `behind`) only
     * when behind is written: below limit. Move mode skips the tail. */
    const int32_t leader = (int32_t)x;
    int32_t behind = leader, ahead = first;
    for (int d = 0; d < CYCLE_PREFETCH_AHEAD && ahead != leader; d++) {
      if (behind < limit) prefetch_slot(base + ahead * stride, len);
      behind = ahead;
      ahead = ~plan[ahead];
    }
    memcpy(tile, base + x * stride, len);
    int64_t j = x, k = first;
    while (k != x) {
      /* slot j takes slot k; slot k is read before it is written, one step
       * later. Move mode writes no tail slot: those keep the values that
       * later steps read. */
      if (ahead != leader) {
        if (behind < limit) prefetch_slot(base + ahead * stride, len);
        behind = ahead;
        ahead = ~plan[ahead];
      }
      if (j < limit) memcpy(base + j * stride, base + k * stride, len);
      j = k;
      k = ~plan[k];
    }
    if (j < limit) memcpy(base + j * stride, tile, len);
  }
}

imoe_status imoe_cycle_move_item(const void *ctx, int64_t item, unsigned char *workspace,
                                 imoe_error *err) {
  const imoe_cycle_mover *m = ctx;
  (void)workspace;
  (void)err;
  const int64_t row = item / m->per_row;
  const int64_t part = item % m->per_row;
  int32_t b = 0;
  while (part >= m->first[b + 1]) b++;
  const imoe_view *v = &m->buffers[b];
  const int64_t offset = (part - m->first[b]) * m->chunk;
  const int64_t left = v->row_bytes - offset;
  const size_t len = (size_t)(left < m->chunk ? left : m->chunk);
  char *base = imoe_row_base(v, row) + offset;
  const int32_t *plan = m->plans + (m->plan_rows == 1 ? 0 : row) * m->n;
  const int64_t n = m->n, limit = m->limit, stride = v->n_stride;
  unsigned char tile[CYCLE_TILE];
  switch (len) {
    case 1: rotate_cycles(plan, n, limit, base, stride, 1, tile); break;
    case 2: rotate_cycles(plan, n, limit, base, stride, 2, tile); break;
    case 4: rotate_cycles(plan, n, limit, base, stride, 4, tile); break;
    case 8: rotate_cycles(plan, n, limit, base, stride, 8, tile); break;
    case 16: rotate_cycles(plan, n, limit, base, stride, 16, tile); break;
    case 32: rotate_cycles(plan, n, limit, base, stride, 32, tile); break;
    case 64: rotate_cycles(plan, n, limit, base, stride, 64, tile); break;
    case 128: rotate_cycles(plan, n, limit, base, stride, 128, tile); break;
    default: rotate_cycles(plan, n, limit, base, stride, len, tile); break;
  }
  return IMOE_OK;
}

/* ---- plan stages -------------------------------------------------------- */

typedef struct plan_ctx {
  const imoe_view *map; /* perm [.., N] or ordered indices [.., C'] */
  const char *name;
  int64_t n;
  int32_t *plans;
  int inverse; /* permute: the inverse; ordered: restore */
} plan_ctx;

static imoe_status range_error(const plan_ctx *ctx, int64_t row, int64_t pos, int64_t value,
                               imoe_error *err) {
  return imoe_fail_range(err, ctx->name, row, pos, value, ctx->n);
}

static imoe_status repeat_error(const plan_ctx *ctx, int64_t row, int64_t first, int64_t second,
                                int64_t value, imoe_error *err) {
  return imoe_fail(err, IMOE_ERR_BAD_MAP,
                   "%s: row %" PRId64 ", positions %" PRId64 " and %" PRId64
                   " both hold %" PRId64 ": not a permutation",
                   ctx->name, row, first, second, value);
}

/* A permutation row that failed the checked encode: name two positions that
 * hold the same value (all values are in range). The plan is scratch now. */
static imoe_status find_repeat(const plan_ctx *ctx, int64_t row, int32_t *plan, imoe_error *err) {
  const char *base = imoe_row_base(ctx->map, row);
  const int64_t stride = ctx->map->n_stride;
  for (int64_t x = 0; x < ctx->n; x++) plan[x] = -1;
  for (int64_t i = 0; i < ctx->n; i++) {
    const int64_t v = imoe_load_index(base + i * stride, ctx->map->dtype);
    if (plan[v] >= 0) return repeat_error(ctx, row, plan[v], i, v, err);
    plan[v] = (int32_t)i;
  }
  return imoe_fail(err, IMOE_ERR_BAD_MAP, "%s: row %" PRId64 " is not a permutation", ctx->name,
                   row);
}

static imoe_status plan_perm_row(const void *vctx, int64_t row, unsigned char *mem,
                                 imoe_error *err) {
  const plan_ctx *ctx = vctx;
  const char *base = imoe_row_base(ctx->map, row);
  const int64_t n = ctx->n, stride = ctx->map->n_stride;
  const imoe_dtype dtype = ctx->map->dtype;
  int32_t *plan = ctx->plans + row * n;
  (void)mem;
  /* A value out of range is reported before a repeated one, in both
   * directions: IMOE_ERR_INDEX_RANGE wins over IMOE_ERR_BAD_MAP in a row. */
  for (int64_t i = 0; i < n; i++) {
    const int64_t v = imoe_load_index(base + i * stride, dtype);
    if (v < 0 || v >= n) return range_error(ctx, row, i, v, err);
    plan[i] = (int32_t)v;
  }
  if (!ctx->inverse) {
    if (imoe_plan_encode_checked(plan, n) < 0) return IMOE_OK;
    return find_repeat(ctx, row, plan, err);
  }
  /* The inverse, q[perm[i]] = i, checked as it is scattered (the plan held
   * a copy of perm only for the range pass). */
  for (int64_t x = 0; x < n; x++) plan[x] = -1;
  for (int64_t i = 0; i < n; i++) {
    const int64_t v = imoe_load_index(base + i * stride, dtype);
    if (plan[v] >= 0) return repeat_error(ctx, row, plan[v], i, v, err);
    plan[v] = (int32_t)i;
  }
  imoe_plan_encode(plan, n);
  return IMOE_OK;
}

/* P = indices ++ (the other slots, ascending), or its inverse (restore). */
static imoe_status plan_ordered_row(const void *vctx, int64_t row, unsigned char *mem,
                                    imoe_error *err) {
  const plan_ctx *ctx = vctx;
  const char *base = imoe_row_base(ctx->map, row);
  const int64_t n = ctx->n, kept = ctx->map->n, stride = ctx->map->n_stride;
  const imoe_dtype dtype = ctx->map->dtype;
  int32_t *plan = ctx->plans + row * n;
  uint8_t *seen = imoe_row_workspace_at(mem, n, 0).flags; /* zeroed; handed back zeroed */
  imoe_status st = IMOE_OK;
  int64_t i = 0;
  for (; i < kept; i++) {
    const int64_t v = imoe_load_index(base + i * stride, dtype);
    if (v < 0 || v >= n) {
      st = range_error(ctx, row, i, v, err);
      break;
    }
    if (seen[v]) {
      int64_t first = 0;
      while (imoe_load_index(base + first * stride, dtype) != v) first++;
      st = repeat_error(ctx, row, first, i, v, err);
      break;
    }
    seen[v] = 1;
    if (ctx->inverse) {
      plan[v] = (int32_t)i;
    } else {
      plan[i] = (int32_t)v;
    }
  }
  if (st != IMOE_OK) {
    for (int64_t j = 0; j < i; j++) seen[imoe_load_index(base + j * stride, dtype)] = 0;
    return st;
  }
  int64_t m = kept;
  for (int64_t x = 0; x < n; x++) {
    if (seen[x]) {
      seen[x] = 0;
      continue;
    }
    if (ctx->inverse) {
      plan[x] = (int32_t)m;
    } else {
      plan[m] = (int32_t)x;
    }
    m++;
  }
  imoe_plan_encode(plan, n);
  return IMOE_OK;
}

/* ---- entry points ------------------------------------------------------- */

imoe_status imoe_check_cuda_workspace(const int32_t *workspace, int64_t workspace_elems,
                                      imoe_plan_kind kind, int64_t rows, int64_t n,
                                      imoe_error *err) {
  const int64_t need = imoe_plan_workspace_elems(kind, IMOE_DEVICE_CUDA, rows, n);
  if (need < 0) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "workspace: %" PRId64 " rows x %" PRId64
                     " slots is too many", rows, n);
  }
  if (need > 0 && workspace == NULL) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "workspace: on CUDA the caller passes it (device memory of %" PRId64
                     " int32 elements, imoe_plan_workspace_elems): nothing is allocated here",
                     need);
  }
  if (need > 0 && workspace_elems < need) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "workspace: %" PRId64 " int32 elements, the call needs %" PRId64,
                     workspace_elems, need);
  }
  return IMOE_OK;
}

/* perm [N] or [lead..., N] (is_perm), or indices [C'] / [lead..., C'] with
 * C' <= N, against the buffers. */
static imoe_status check_plan_source(const imoe_view *map, const char *name,
                                     const imoe_view *buffers, int is_perm, imoe_error *err) {
  imoe_status st = imoe_check_view(map, name, err);
  if (st == IMOE_OK) st = imoe_check_typed(map, name, IMOE_INDEX_DTYPES, err);
  if (st == IMOE_OK && map->lead_ndim != 0) {
    st = imoe_check_same_lead(map, name, &buffers[0], "buffers[0]", err);
  }
  if (st != IMOE_OK) return st;
  const int64_t n = buffers[0].n;
  if (is_perm && map->n != n) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "%s: n = %" PRId64 " must equal the buffers' N = %" PRId64, name, map->n, n);
  }
  if (!is_perm && map->n > n) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "%s: C' = %" PRId64 " exceeds the buffers' N = %" PRId64, name, map->n, n);
  }
  return IMOE_OK;
}

/* Upper bound of the move items: every buffer split into minimal chunks. */
static int64_t max_move_items(const imoe_view *buffers, int32_t num_buffers) {
  int64_t per_row = 0;
  for (int32_t b = 0; b < num_buffers; b++) {
    per_row += buffers[b].row_bytes / CYCLE_MIN_CHUNK + 1;
  }
  const int64_t rows = imoe_view_rows(&buffers[0]);
  return rows > INT64_MAX / per_row ? INT64_MAX : rows * per_row;
}

/* The two stages every planned call runs: plan (and check) each row of
 * `map`, then move. */
static imoe_status run_planned(const imoe_view *buffers, int32_t num_buffers, plan_ctx *ctx,
                               imoe_item_fn plan_fn, size_t thread_bytes, int64_t limit,
                               int32_t *workspace, int64_t workspace_elems,
                               const imoe_exec *exec, imoe_error *err) {
  const int64_t plan_rows = imoe_view_rows(ctx->map);
  ctx->n = buffers[0].n;
  int32_t *owned;
  imoe_status st = imoe_plan_workspace(workspace, workspace_elems, plan_rows * ctx->n,
                                       &ctx->plans, &owned, err);
  if (st != IMOE_OK) return st;
  const int64_t most = max_move_items(buffers, num_buffers);
  const int threads = imoe_thread_count(exec, imoe_buffers_bytes(buffers, num_buffers),
                                        most > plan_rows ? most : plan_rows);
  imoe_cycle_mover mover;
  imoe_cycle_mover_init(&mover, buffers, num_buffers, ctx->plans, plan_rows, limit, threads);
  const imoe_stage stages[] = {
      {plan_fn, ctx, ctx->n > 0 ? plan_rows : 0}, /* N = 0: nothing to check or plan */
      {imoe_cycle_move_item, &mover, imoe_cycle_mover_items(&mover)},
  };
  st = imoe_run_stages(stages, 2, thread_bytes, threads, err);
  free(owned);
  return st;
}

/* The checks of a planned call after its arguments' own: aliasing (imoe_check_call), then the
 * workspace of a `kind` plan on CUDA, or on the CPU when the call is empty (a shared map still
 * plans one row: its workspace is checked). *empty: nothing to move. */
static imoe_status check_planned_call(const imoe_view *buffers, int32_t num_buffers,
                                      const imoe_view *map, const char *name, imoe_plan_kind kind,
                                      int32_t *workspace, int64_t workspace_elems,
                                      const imoe_exec *exec, int *empty, imoe_error *err) {
  const imoe_call_args call = {buffers, num_buffers, NULL,      {map},          {name},
                               {NULL},  {NULL},      workspace, workspace_elems};
  imoe_status st = imoe_check_call(&call, empty, err);
  if (st != IMOE_OK) return st;
  if (imoe_on_cuda(exec)) {
    return imoe_check_cuda_workspace(workspace, workspace_elems, kind, imoe_view_rows(map),
                                     buffers[0].n, err);
  }
  if (*empty) {
    return imoe_check_plan_workspace(workspace, workspace_elems, imoe_view_rows(map) * buffers[0].n,
                                     err);
  }
  return IMOE_OK;
}

imoe_status imoe_permute(const imoe_view *buffers, int32_t num_buffers, const imoe_view *perm,
                         int32_t inverse, int32_t *workspace, int64_t workspace_elems,
                         const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_check_buffers(buffers, num_buffers, err);
  if (st == IMOE_OK) st = check_plan_source(perm, "perm", buffers, 1, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  st = check_planned_call(buffers, num_buffers, perm, "perm", IMOE_PLAN_PERMUTE, workspace,
                          workspace_elems, exec, &empty, err);
  if (st != IMOE_OK || empty) return st;
  if (imoe_on_cuda(exec)) {
    return imoe_cuda_permute(buffers, num_buffers, perm, inverse, workspace, workspace_elems, exec,
                             err);
  }
  plan_ctx ctx = {perm, "perm", 0, NULL, inverse != 0};
  return run_planned(buffers, num_buffers, &ctx, plan_perm_row, 0, buffers[0].n, workspace,
                     workspace_elems, exec, err);
}

imoe_status imoe_apply_kept_order(const imoe_view *buffers, int32_t num_buffers,
                                  const imoe_view *indices, imoe_mode mode, int restore,
                                  int32_t *workspace, int64_t workspace_elems,
                                  const imoe_exec *exec, imoe_error *err) {
  imoe_status st = imoe_check_buffers(buffers, num_buffers, err);
  if (st == IMOE_OK) st = check_plan_source(indices, "indices", buffers, 0, err);
  if (st == IMOE_OK) st = imoe_check_mode(mode, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  int empty;
  st = check_planned_call(buffers, num_buffers, indices, "indices", IMOE_PLAN_ORDERED, workspace,
                          workspace_elems, exec, &empty, err);
  if (st != IMOE_OK || empty) return st;
  if (imoe_on_cuda(exec)) {
    return imoe_cuda_apply_ordered(buffers, num_buffers, indices, restore, workspace,
                                   workspace_elems, exec, err);
  }
  plan_ctx ctx = {indices, "indices", 0, NULL, restore};
  const int64_t limit = mode == IMOE_MODE_MOVE ? indices->n : buffers[0].n;
  return run_planned(buffers, num_buffers, &ctx, plan_ordered_row,
                     imoe_row_workspace_bytes(buffers[0].n, 0), limit, workspace,
                     workspace_elems, exec, err);
}
