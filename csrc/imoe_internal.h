/*
 * imoe_internal.h: what the files of the C core share. Not installed, not
 * part of the API; idempotent_moe.h is the contract.
 *
 * A call runs in three steps, always in this order:
 *   1. argument checks (view.c, args.c): only the view structs are read;
 *   2. data checks (select.c, active.c, mapcheck.c): every byte the call
 *      will rely on is read and judged; nothing is written;
 *   3. writes (select.c + map.c, then move.c): cannot fail.
 * Steps 2 and 3 run as stages of one parallel region (parallel.c), so a
 * failed check or a failed workspace allocation happens before any write.
 */
#ifndef IMOE_INTERNAL_H
#define IMOE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "idempotent_moe.h"

/* OpenMP is optional: without -fopenmp these vanish (no -Wunknown-pragmas)
 * and every parallel loop runs on the calling thread. */
#ifdef _OPENMP
#define IMOE_DO_PRAGMA(...) _Pragma(#__VA_ARGS__)
#define IMOE_OMP(...) IMOE_DO_PRAGMA(omp __VA_ARGS__)
#else
#define IMOE_OMP(...)
#endif

#if defined(__GNUC__)
#define IMOE_PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define IMOE_PRINTF(fmt, args)
#endif

/* Slot indices travel through int32 maps and uint32 histograms. */
#define IMOE_MAX_SLOTS INT32_MAX

#define IMOE_SCORE_DTYPES                                            \
  (IMOE_DTYPE_BIT(IMOE_DTYPE_F32) | IMOE_DTYPE_BIT(IMOE_DTYPE_F16) | \
   IMOE_DTYPE_BIT(IMOE_DTYPE_BF16))
#define IMOE_INDEX_DTYPES (IMOE_DTYPE_BIT(IMOE_DTYPE_I32) | IMOE_DTYPE_BIT(IMOE_DTYPE_I64))

/* ---- errors (view.c) ---------------------------------------------------- */

/* Writes the message into err (when not NULL) and returns status. */
imoe_status imoe_fail(imoe_error *err, imoe_status status, const char *fmt, ...) IMOE_PRINTF(3, 4);
/* IMOE_ERR_INDEX_RANGE: entry pos of row `row` of `name` holds value, outside [0, n). */
imoe_status imoe_fail_range(imoe_error *err, const char *name, int64_t row, int64_t pos,
                            int64_t value, int64_t n);
/* status: entry pos of row `row` of `name` names a slot an earlier entry named. */
imoe_status imoe_fail_repeat(imoe_error *err, imoe_status status, const char *name, int64_t row,
                             int64_t pos, int64_t slot);

/* ---- views (view.c) ----------------------------------------------------- */

/* Structure of one view: lead_ndim, shapes, row_bytes, dtype, the N limit,
 * int64 overflow of its byte extent, and data != NULL when not empty. */
imoe_status imoe_check_view(const imoe_view *v, const char *name, imoe_error *err);
/* dtype within mask (IMOE_ERR_DTYPE) and row_bytes == its element size. */
imoe_status imoe_check_typed(const imoe_view *v, const char *name, unsigned dtype_mask,
                             imoe_error *err);
/* A view written in place: no byte reached twice (alias.c). */
imoe_status imoe_check_writable(const imoe_view *v, const char *name, imoe_error *err);
/* Same lead_ndim and lead shape as ref. */
imoe_status imoe_check_same_lead(const imoe_view *v, const char *name, const imoe_view *ref,
                                 const char *ref_name, imoe_error *err);

/* R: the number of rows (1 for lead_ndim 0). The view must have passed
 * imoe_check_view, so the product does not overflow. */
int64_t imoe_view_rows(const imoe_view *v);
/* Byte offset of row r, r being the row-major flattening of the lead axes. */
int64_t imoe_row_offset(const imoe_view *v, int64_t r);

static inline char *imoe_row_base(const imoe_view *v, int64_t r) {
  return (char *)v->data + imoe_row_offset(v, r);
}

/* Element access for I32/I64 views; memcpy so any alignment is fine. The
 * branch is on a dtype constant for a whole loop and predicts perfectly. */
static inline int64_t imoe_load_index(const char *p, imoe_dtype dtype) {
  if (dtype == IMOE_DTYPE_I32) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
  }
  int64_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void imoe_store_index(char *p, imoe_dtype dtype, int64_t value) {
  if (dtype == IMOE_DTYPE_I32) {
    int32_t v = (int32_t)value;
    memcpy(p, &v, sizeof v);
  } else {
    memcpy(p, &value, sizeof value);
  }
}

/* ---- argument checks shared by the entry points (args.c) ---------------- */

/* exec NULL or CPU: IMOE_OK. CUDA: IMOE_OK when the CUDA backend is linked
 * (imoe_backend.h), else IMOE_ERR_UNSUPPORTED. Any other device: IMOE_ERR_ARGUMENT. */
imoe_status imoe_check_exec(const imoe_exec *exec, imoe_error *err);

/* After the argument checks, a CUDA call goes to the backend (imoe_backend.h); the data
 * checks and the writes then happen on the device. */
static inline int imoe_on_cuda(const imoe_exec *exec) {
  return exec != NULL && exec->device == IMOE_DEVICE_CUDA;
}
imoe_status imoe_check_mode(imoe_mode mode, imoe_error *err);
/* order is an imoe_order; SCORE only when has_scores. */
imoe_status imoe_check_order(imoe_order order, int has_scores, imoe_error *err);
/* 1 <= num_buffers <= IMOE_MAX_BUFFERS; every buffer a writable view with
 * the lead shape and n of buffers[0]. */
imoe_status imoe_check_buffers(const imoe_view *buffers, int32_t num_buffers, imoe_error *err);
/* The selection against the lead shape of ref and n slots per row (its
 * options, order and num_slots included); sets *kept = C' = min(C, n). */
imoe_status imoe_check_selection(const imoe_selection *sel, const imoe_view *ref,
                                 const char *ref_name, int64_t n, int64_t *kept, imoe_error *err);
/* Optional map outputs (NULL skips the view): indices [lead..., kept]
 * I32/I64 and target_map [lead..., n] I32, both with ref's lead shape. */
imoe_status imoe_check_map_outputs(const imoe_view *indices, const imoe_view *target_map,
                                   const imoe_view *ref, const char *ref_name, int64_t n,
                                   int64_t kept, imoe_error *err);

/* A typed 2-d view [rows, cols] (lead_ndim 1; -1 takes any extent): dtype in
 * dtypes, writable when `written`, the last axis contiguous when `dense`. */
imoe_status imoe_check_matrix(const imoe_view *v, const char *name, unsigned dtypes, int64_t rows,
                              int64_t cols, int written, int dense, imoe_error *err);

/* ---- aliasing (alias.c) ------------------------------------------------- */

/* The arguments of one call, for the aliasing rules: every argument the call
 * writes (buffers, outputs, workspace) must share no byte with any other
 * argument, read or written. The one exception is scores that are one of
 * the buffers slot for slot: the selection is read in full before anything
 * moves. Absent arguments are NULL. */
#define IMOE_CALL_READS 4
#define IMOE_CALL_OUTS 5
typedef struct imoe_call_args {
  const imoe_view *buffers;
  int32_t num_buffers;
  const imoe_selection *sel; /* read */
  const imoe_view *read[IMOE_CALL_READS];
  const char *read_name[IMOE_CALL_READS];
  const imoe_view *out[IMOE_CALL_OUTS]; /* written */
  const char *out_name[IMOE_CALL_OUTS];
  const int32_t *workspace; /* written */
  int64_t workspace_elems;
} imoe_call_args;

/* IMOE_ERR_ARGUMENT naming both arguments when two of them may share a byte
 * against the rules above (the views must have passed imoe_check_view).
 * *empty = 1 when no argument but the workspace has an element: such a call
 * reads and writes nothing and returns at once, whatever its lead shape. */
imoe_status imoe_check_call(const imoe_call_args *call, int *empty, imoe_error *err);
/* The `limit` of imoe_gated_act and imoe_gated_act_backward: NULL, or the
 * [E] I32/I64 offsets of imoe_moe_dispatch (moe_combine.c). */
imoe_status imoe_check_moe_limit(const imoe_view *limit, imoe_error *err);
/* What the experts' GEMMs share (moe_gemm.c): offsets[e]; the first e with
 * offsets[e] > r (offsets checked, r < offsets[E - 1]); w [E, K, N] of a's
 * dtype; the [E] I32 offsets view; its data non-decreasing in [0, R]
 * (IMOE_ERR_INDEX_RANGE; reads the data: after the argument checks). */
int64_t imoe_gemm_offset(const imoe_view *offsets, int64_t e);
int64_t imoe_gemm_expert_of_row(const imoe_view *offsets, int64_t r);
imoe_status imoe_gemm_check_weights(const imoe_view *w, const imoe_view *a, int64_t e_n, int64_t k_n,
                                    imoe_error *err);
imoe_status imoe_gemm_check_offsets_view(const imoe_view *offsets, imoe_error *err);
imoe_status imoe_gemm_check_offsets(const imoe_view *offsets, int64_t r_n, imoe_error *err);
/* act(x) in F32, the gated activation's (moe_combine.c). */
float imoe_activate(float x, imoe_act act);
/* The gated activation's value before its one rounding into dtype dt:
 * act(gate) rounded to dt, times up, in F32 (moe_combine.c). Every kernel
 * that writes or recomputes it (gated_act, the experts GEMM's epilogue, the
 * fused layer's backward) takes it from here. */
float imoe_gated(float gate, float up, imoe_act act, imoe_dtype dt);
/* A view with no element (some axis of extent 0). */
int imoe_view_is_empty(const imoe_view *v);

/* ---- parallel stages (parallel.c) --------------------------------------- */

/* One unit of work. A stage that checks data returns the status of its item
 * and writes nothing; a stage that writes must not fail. */
typedef imoe_status (*imoe_item_fn)(const void *ctx, int64_t item, unsigned char *workspace,
                                    imoe_error *err);

typedef struct imoe_stage {
  imoe_item_fn fn;
  const void *ctx;
  int64_t items;
} imoe_stage;

/* Threads for one call: exec->num_threads when > 0 (honoured as given, so
 * tests can force parallel paths), else the OpenMP default when
 * work_bytes is large enough to pay for a parallel region, else 1. Never
 * more than max_items. */
int imoe_thread_count(const imoe_exec *exec, int64_t work_bytes, int64_t max_items);

/* Runs the stages in order, items of one stage in parallel. Each thread gets
 * workspace_bytes of its own, zeroed, allocated before the first stage
 * (IMOE_ERR_NO_MEMORY, nothing run, when any allocation fails). When an item
 * fails, the stage finishes, the run stops, and the failure of the lowest
 * failing item is returned: the reported error does not depend on threads. */
imoe_status imoe_run_stages(const imoe_stage *stages, int num_stages, size_t workspace_bytes,
                            int num_threads, imoe_error *err);

/* ---- per-row workspace (workspace.c) ------------------------------------ */

typedef struct imoe_row_workspace {
  uint32_t *hist; /* radix histograms: imoe_radix_hist_entries(n) entries */
  uint32_t *keys; /* [n] order-preserving score keys */
  uint32_t *list; /* [n] slot lists: radix candidates, then holes and tails */
  uint8_t *flags; /* [n] kept flags, or a seen-bitmap for checks */
} imoe_row_workspace;

/* 4 interleaved copies of 2048 bins (radix.c). */
#define IMOE_RADIX_HIST (4 * 2048)
/* imoe_mark_top_k's rules (radix.c): rows of at most these many keys are
 * ranked by comparison (32-bit keys, 16-bit keys), and rows of this many
 * keys or more histogram into all four copies. */
#define IMOE_RANK_MAX_KEYS_32 32
#define IMOE_RANK_MAX_KEYS_16 12
#define IMOE_HIST_COPIES_MIN_KEYS 1024

/* Histogram entries a row of n slots needs: none when every selection in it
 * is ranked (n <= IMOE_RANK_MAX_KEYS_16, and a score sort of fewer than 48
 * keys sorts by insertion), one copy of 2048 bins below
 * IMOE_HIST_COPIES_MIN_KEYS, IMOE_RADIX_HIST from there on. The workspace
 * is zeroed per call: a short row should not pay for 32 KiB of bins. */
int64_t imoe_radix_hist_entries(int64_t n);

/* Bytes for a workspace with everything a selection needs (full), or only
 * the flags (checks of caller data). */
size_t imoe_row_workspace_bytes(int64_t n, int full);
imoe_row_workspace imoe_row_workspace_at(unsigned char *mem, int64_t n, int full);

/* ---- selection (select.c, radix.c, active.c) ---------------------------- */

/* IMOE_ERR_NAN naming the first NaN of the row, else IMOE_OK. */
imoe_status imoe_check_scores_row(const imoe_view *scores, int64_t row, imoe_error *err);
/* Sets ws.flags[0, n) to the kept set of the row from scores. Under
 * IMOE_NAN_ERROR the row must already have passed imoe_check_scores_row. */
void imoe_select_scores_row(const imoe_selection *sel, int64_t row, int64_t n,
                            imoe_row_workspace ws);

/* keys[lo, hi): sets kept[i] = 1 for the k largest keys (ties to the lower
 * index), 0 for the rest; 0 < k < hi - lo. key_bits is 32 or 16. O(hi - lo)
 * (a short row, up to 32 keys of 32 bits or 12 of 16: O((hi - lo)^2)
 * comparisons, fewer operations there).
 * hist: imoe_radix_hist_entries(hi - lo) entries; cand: hi - lo entries of
 * scratch. */
void imoe_mark_top_k(const uint32_t *keys, int64_t lo, int64_t hi, int64_t k, int key_bits,
                     uint32_t *hist, uint32_t *cand, uint8_t *kept);

/* Range and duplicate check of one row of active indices; seen is a zeroed
 * [n] scratch, left zeroed on return. */
imoe_status imoe_check_active_row(const imoe_view *active, int64_t row, int64_t n, uint8_t *seen,
                                  imoe_error *err);
/* flags[0, n) = the row's active set. The row must have passed the check. */
void imoe_select_active_row(const imoe_view *active, int64_t row, int64_t n, uint8_t *flags);

/* ---- map (map.c) -------------------------------------------------------- */

/* From kept flags with exactly `kept` ones set, writes row `row` of indices
 * [kept] and/or target_map [n] (either may be NULL). list: [n] scratch. */
void imoe_write_map_row(const uint8_t *flags, int64_t n, int64_t kept, uint32_t *list,
                        const imoe_view *indices, const imoe_view *target_map, int64_t row);

/* ---- caller-given maps (mapcheck.c) ------------------------------------- */

/* indices row: entries in [0, n); entry != i implies entry >= C' (=
 * indices->n); entries >= C' distinct. seen: zeroed [n] scratch. */
imoe_status imoe_check_indices_row(const imoe_view *indices, int64_t row, int64_t n, uint8_t *seen,
                                   imoe_error *err);
/* target_map row: entries in [0, n) and t[t[x]] == x. */
imoe_status imoe_check_target_map_row(const imoe_view *target_map, int64_t row, imoe_error *err);

/* ---- moving rows (move.c) ----------------------------------------------- */

/* Apply a valid map to every buffer, split into items of (row, slot range)
 * so that one long row still spreads over every thread. */
typedef struct imoe_apply_plan {
  const imoe_view *buffers;
  int32_t num_buffers;
  const imoe_view *map; /* indices [lead..., C'] or target_map [lead..., N] */
  imoe_mode mode;
  int64_t rows;
  int64_t slots;   /* map->n */
  int64_t chunk;   /* slots per item */
  int64_t per_row; /* items per row */
} imoe_apply_plan;

void imoe_apply_plan_init(imoe_apply_plan *plan, const imoe_view *buffers, int32_t num_buffers,
                          const imoe_view *map, imoe_mode mode, int num_threads);
static inline int64_t imoe_apply_plan_items(const imoe_apply_plan *plan) {
  return plan->rows * plan->per_row;
}
imoe_status imoe_apply_indices_item(const void *plan, int64_t item, unsigned char *workspace,
                                    imoe_error *err);
imoe_status imoe_apply_target_map_item(const void *plan, int64_t item, unsigned char *workspace,
                                       imoe_error *err);
/* Total bytes of the buffers (saturating): a bound on what an apply moves,
 * to size the thread count. */
int64_t imoe_buffers_bytes(const imoe_view *buffers, int32_t num_buffers);

/* Exchanges n bytes between two non-overlapping slots. */
void imoe_swap_bytes(char *a, char *b, size_t n);

/* ---- cycle plans and the permutation engine (permute.c) ----------------- */

/* A plan row is a permutation of [0, n) (new slot i takes old slot p[i])
 * with its cycles marked for the move stage: in each cycle of length >= 2
 * the largest slot, the leader, holds its successor p[x] (>= 0); every other
 * slot of the cycle holds ~p[x] (< 0). Fixed points hold themselves.
 * The leader is the largest slot so that in move mode (writes limited to
 * [0, C')) a cycle that reaches the tail starts there and needs no tile. */

/* imoe_apply_indices (restore 0) and imoe_restore (restore 1) with order
 * STABLE or SCORE: the permutation P of the indices, or its inverse. */
imoe_status imoe_apply_kept_order(const imoe_view *buffers, int32_t num_buffers,
                                  const imoe_view *indices, imoe_mode mode, int restore,
                                  int32_t *workspace, int64_t workspace_elems,
                                  const imoe_exec *exec, imoe_error *err);

/* Marks the cycles of a valid permutation held in plan[0, n). O(n). */
void imoe_plan_encode(int32_t *plan, int64_t n);

/* The same for values in [0, n) that may not form a permutation: returns -1
 * when they do (and the plan is encoded), else a slot reached twice (the
 * plan is then garbage). O(n). */
int64_t imoe_plan_encode_checked(int32_t *plan, int64_t n);
/* The CUDA path's workspace: given (device memory) and large enough for
 * imoe_plan_workspace_elems(kind, IMOE_DEVICE_CUDA, rows, n). */
imoe_status imoe_check_cuda_workspace(const int32_t *workspace, int64_t workspace_elems,
                                      imoe_plan_kind kind, int64_t rows, int64_t n,
                                      imoe_error *err);

/* IMOE_ERR_ARGUMENT when a caller's workspace (not NULL) has fewer than need
 * elements. */
imoe_status imoe_check_plan_workspace(const int32_t *given, int64_t given_elems, int64_t need,
                                      imoe_error *err);

/* The plan workspace of a call: the caller's (at least `need` elements, else
 * IMOE_ERR_ARGUMENT) or, when given is NULL, *owned = malloc'ed here
 * (IMOE_ERR_NO_MEMORY). Free *owned after the call. */
imoe_status imoe_plan_workspace(int32_t *given, int64_t given_elems, int64_t need, int32_t **plan,
                                int32_t **owned, imoe_error *err);

/* Moves every buffer by its row's plan, split into items of (row, buffer,
 * byte chunk of the slot) so that one long row still spreads over every
 * thread: byte chunks of one cycle are independent. */
typedef struct imoe_cycle_mover {
  const imoe_view *buffers;
  int32_t num_buffers;
  const int32_t *plans; /* [plan_rows, n] */
  int64_t plan_rows;    /* 1: one plan for every row */
  int64_t n;
  int64_t limit; /* only slots below limit are written (move mode: C') */
  int64_t rows;
  int64_t chunk;   /* bytes per item, at most the stack tile */
  int64_t per_row; /* items per row */
  int64_t first[IMOE_MAX_BUFFERS + 1]; /* first item of each buffer in a row */
} imoe_cycle_mover;

void imoe_cycle_mover_init(imoe_cycle_mover *m, const imoe_view *buffers, int32_t num_buffers,
                           const int32_t *plans, int64_t plan_rows, int64_t limit,
                           int num_threads);
static inline int64_t imoe_cycle_mover_items(const imoe_cycle_mover *m) {
  return m->rows * m->per_row;
}
imoe_status imoe_cycle_move_item(const void *mover, int64_t item, unsigned char *workspace,
                                 imoe_error *err);

/* ---- kept order of ordered compactions (order.c) ------------------------ */

/* Bytes of per-thread workspace an order needs beyond the full row
 * workspace (imoe_row_workspace_bytes(n, 1)). */
size_t imoe_order_extra_bytes(int64_t n, imoe_order order);

/* The kept slots of a row (flags, exactly `kept` set) in `order` (STABLE or
 * SCORE) into out[0, kept); out has room for n entries. SCORE reads the
 * row's scores and uses ws.keys, ws.hist and `extra`. */
void imoe_kept_in_order(const imoe_selection *sel, int64_t row, int64_t n, int64_t kept,
                        imoe_order order, imoe_row_workspace ws, unsigned char *extra,
                        uint32_t *out);

/* plan[0, n) = order[0, kept) ++ the slots whose flag is 0, ascending. */
void imoe_plan_from_kept(const uint32_t *order, int64_t kept, const uint8_t *flags, int64_t n,
                         int32_t *plan);

/* Order-preserving uint32 keys of scores[row, lo:hi) into keys[lo, hi)
 * (select.c): -0 == +0, NaN below -inf. */
void imoe_score_keys(const imoe_view *scores, int64_t row, int64_t lo, int64_t hi,
                     uint32_t *keys);

#endif /* IMOE_INTERNAL_H */
