/*
 * idempotent_moe.h: the whole C API of idempotent-moe.
 *
 * In-place token compaction with idempotent maps. Every buffer is seen as
 * [lead..., N, row]: any number of lead axes (experts; batch x heads) that
 * together name R independent rows, N slots along the compaction axis, and
 * `row` contiguous bytes per slot. For each row a kept set of size
 * C' = min(C, N) is chosen (top-C by score, or explicit active indices) and
 * moved into slots [0, C'):
 *
 *   - a kept slot already below C' stays where it is (a fixed point);
 *   - the j-th hole (dropped slot below C', ascending) takes the j-th kept
 *     tail slot (kept slot at or beyond C', ascending).
 *
 * The map is an involution made of fixed points and disjoint 2-cycles, so
 * every move is independent of every other and applying the same swap map
 * twice restores the buffer bit for bit. Data moves as bytes: every dtype
 * works and results are bit-exact.
 *
 * Conventions
 *   - Every function returns an imoe_status; IMOE_OK is 0. Nothing exits.
 *   - Every function validates all of its arguments and all the data it
 *     reads (NaN scores, index ranges, duplicate indices, map validity)
 *     before it writes any byte of any output or buffer: a call that fails
 *     leaves all memory exactly as it was.
 *   - When `err` is not NULL, a failing call writes a one-line message into
 *     err->message naming the argument and the position at fault.
 *   - Views carry byte strides, which may be negative. Sizes are int64.
 *   - Device memory (IMOE_DEVICE_CUDA) is accepted only by a build with the
 *     CUDA launchers; otherwise IMOE_ERR_UNSUPPORTED.
 */
#ifndef IDEMPOTENT_MOE_H
#define IDEMPOTENT_MOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define IMOE_VERSION_MAJOR 0
#define IMOE_VERSION_MINOR 2
#define IMOE_VERSION_PATCH 0

/* Most lead axes a view may have. */
#define IMOE_MAX_LEAD_DIMS 8
/* Most buffers one call moves. */
#define IMOE_MAX_BUFFERS 64

typedef enum imoe_status {
  IMOE_OK = 0,
  IMOE_ERR_ARGUMENT = 1,        /* a shape, stride, size or option is invalid */
  IMOE_ERR_DTYPE = 2,           /* a view has a dtype the operation does not take */
  IMOE_ERR_NAN = 3,             /* a score is NaN and the NaN policy is IMOE_NAN_ERROR */
  IMOE_ERR_INDEX_RANGE = 4,     /* an index lies outside [0, N) */
  IMOE_ERR_INDEX_DUPLICATE = 5, /* an index appears twice in one row */
  IMOE_ERR_BAD_MAP = 6,         /* indices / target_map is not an idempotent map */
  IMOE_ERR_NO_MEMORY = 7,       /* host workspace could not be allocated */
  IMOE_ERR_DEVICE = 8,          /* the device runtime reported an error */
  IMOE_ERR_UNSUPPORTED = 9      /* not built into this library (e.g. CUDA) */
} imoe_status;

typedef enum imoe_dtype {
  IMOE_DTYPE_BYTES = 0, /* opaque data moved as bytes (buffers) */
  IMOE_DTYPE_F32 = 1,
  IMOE_DTYPE_F16 = 2,
  IMOE_DTYPE_BF16 = 3,
  IMOE_DTYPE_I32 = 4,
  IMOE_DTYPE_I64 = 5
} imoe_dtype;

/* A set of dtypes as a bit mask. */
#define IMOE_DTYPE_BIT(d) (1u << (unsigned)(d))

typedef enum imoe_device_type {
  IMOE_DEVICE_CPU = 0,
  IMOE_DEVICE_CUDA = 1
} imoe_device_type;

typedef enum imoe_mode {
  IMOE_MODE_SWAP = 0, /* a permutation: dropped tokens end in [C', N); reversible */
  IMOE_MODE_MOVE = 1  /* kept tail tokens are copied into holes; half the traffic */
} imoe_mode;

/*
 * Order of the kept slots in [0, C') after a compaction.
 *   INPLACE  the idempotent map (default): a kept slot below C' stays where it
 *            is; the only order with a target-map form and with no workspace.
 *   STABLE   the kept slots in ascending original slot order (what a
 *            recency-ordered KV cache wants).
 *   SCORE    by descending score, ties to the lower slot: the order of
 *            torch.topk(..., sorted=True) + gather (with that tie rule). Every
 *            kept slot ranks by its own score, protected ones included; NaN
 *            (IMOE_NAN_LOWEST) ranks last. Needs scores.
 * For STABLE and SCORE the compaction is the permutation
 *   P = [indices[0], ..., indices[C'-1]] ++ [the dropped slots, ascending],
 * new slot i holding old slot P[i]: swap mode applies all of P (dropped
 * tokens end in [C', N) in their original order); move mode writes only
 * [0, C') and leaves [C', N) unspecified (on CUDA it applies all of P). P
 * depends on indices alone, so indices suffice to apply it again
 * (imoe_apply_indices with the order) or to undo it (imoe_restore).
 * STABLE and SCORE need an int32 plan workspace (imoe_plan_workspace_elems,
 * IMOE_PLAN_ORDERED); INPLACE needs none.
 */
typedef enum imoe_order {
  IMOE_ORDER_INPLACE = 0,
  IMOE_ORDER_STABLE = 1,
  IMOE_ORDER_SCORE = 2
} imoe_order;

typedef enum imoe_nan_policy {
  IMOE_NAN_ERROR = 0, /* a NaN score is an error (IMOE_ERR_NAN) */
  IMOE_NAN_LOWEST = 1 /* NaN ranks below every number, -inf included */
} imoe_nan_policy;

/*
 * A strided view [lead..., n, row].
 *   data       address of element [0, ..., 0] (any byte offset applied)
 *   lead_ndim  number of lead axes, 0..IMOE_MAX_LEAD_DIMS; R = prod(lead_shape)
 *              (R = 1 when lead_ndim is 0)
 *   lead_stride, n_stride   in bytes
 *   row_bytes  bytes of one slot; contiguous. For typed views (scores,
 *              indices, maps) it equals the element size of dtype.
 * Row r (0 <= r < R) is the row-major flattening of the lead coordinates.
 */
typedef struct imoe_view {
  void *data;
  int32_t lead_ndim;
  int64_t lead_shape[IMOE_MAX_LEAD_DIMS];
  int64_t lead_stride[IMOE_MAX_LEAD_DIMS];
  int64_t n;
  int64_t n_stride;
  int64_t row_bytes;
  imoe_dtype dtype;
} imoe_view;

/*
 * Where and how the work runs. Every view passed to one call lives on
 * `device`. On the CPU, num_threads <= 0 takes the OpenMP default. On CUDA,
 * `stream` is a cudaStream_t (NULL: the legacy default stream).
 */
typedef struct imoe_exec {
  imoe_device_type device;
  int32_t device_id;
  int32_t num_threads;
  void *stream;
} imoe_exec;

/*
 * Which slots each row keeps. Exactly one of `scores` and `active` is set.
 *
 * scores   [lead..., N], F32/F16/BF16. Per row, the protected prefix [0, P)
 *          and the recent window [N - W, N) are always kept; the other
 *          C - P - W kept slots are the highest scores of [P, N - W), ties
 *          to the lower index (-0.0 and +0.0 tie). Requires P + W <= C.
 *          C >= N keeps every slot (nothing moves).
 * active   [K] shared by all rows (lead_ndim 0) or [lead..., K] per row,
 *          I32/I64, each row's entries distinct and in [0, N). The kept set
 *          is exactly the listed slots, in any order; capacity must equal K
 *          and P and W must be 0.
 * order    the order of the kept slots in [0, C') (imoe_order; a zeroed
 *          struct is INPLACE). SCORE needs scores.
 * num_slots  N where no view of the call gives it: imoe_build_map with
 *          active indices and no out_target_map. Elsewhere 0, or equal to
 *          the N that the scores, the buffers or out_target_map give.
 */
typedef struct imoe_selection {
  const imoe_view *scores;
  const imoe_view *active;
  int64_t capacity;
  int64_t protected_prefix;
  int64_t recent_window;
  imoe_nan_policy nan_policy;
  imoe_order order;
  int64_t num_slots;
} imoe_selection;

typedef struct imoe_error {
  char message[256];
} imoe_error;

/* A static, human-readable name for a status ("IMOE_ERR_NAN: ..."). */
const char *imoe_status_string(imoe_status status);

/* 1 when this library was built with the CUDA launchers, else 0. */
int imoe_cuda_compiled(void);

/* The CUDA devices this build can run its kernels on now: visible devices
 * whose compute capability the build has machine code or PTX for. 0 in a
 * build without CUDA, without a driver, or without such a device; never an
 * error, and no CUDA error is left pending. Counted on the first call
 * (which initialises the driver, as any CUDA call does, but creates no
 * context), then cached for the process. */
int imoe_cuda_device_count(void);

/*
 * The options' names, one table for every layer above the C API (the Python
 * API takes mode="swap", order="stable", nan="lowest", ...):
 *   IMOE_OPTION_MODE   imoe_mode         "swap", "move"
 *   IMOE_OPTION_ORDER  imoe_order        "inplace", "stable", "score"
 *   IMOE_OPTION_NAN    imoe_nan_policy   "raise", "lowest"
 *   IMOE_OPTION_PLAN   imoe_plan_kind    "permute", "ordered", "group"
 *   IMOE_OPTION_ACT    imoe_act          "silu", "gelu", "gelu_tanh", "relu"
 *   IMOE_OPTION_LAYOUT imoe_moe_layout   "grouped", "padded"
 *   IMOE_OPTION_FLOAT  imoe_dtype         "float32", "float16", "bfloat16"
 *                      (value i: IMOE_DTYPE_F32 + i; an output's dtype)
 *   IMOE_OPTION_INDEX  imoe_dtype         "int32", "int64" (value i:
 *                      IMOE_DTYPE_I32 + i; an output's index dtype)
 * imoe_option_name: the name of a value, NULL outside the enum (also for a
 * value past the last: iterate from 0 until NULL).
 * imoe_option_from_name: the value of a name, or IMOE_ERR_ARGUMENT with a
 * message naming the option and every accepted name.
 */
typedef enum imoe_option {
  IMOE_OPTION_MODE = 0,
  IMOE_OPTION_ORDER = 1,
  IMOE_OPTION_NAN = 2,
  IMOE_OPTION_PLAN = 3,
  IMOE_OPTION_ACT = 4,
  IMOE_OPTION_LAYOUT = 5,
  IMOE_OPTION_FLOAT = 6,
  IMOE_OPTION_INDEX = 7
} imoe_option;

const char *imoe_option_name(imoe_option option, int value);
imoe_status imoe_option_from_name(imoe_option option, const char *name, int *value,
                                  imoe_error *err);

/* "buffers[b]", the name messages give buffer b of a call, for 0 <= b <
 * IMOE_MAX_BUFFERS (NULL outside): a constant string, so naming a buffer
 * costs nothing on a call that succeeds. */
const char *imoe_buffer_name(int32_t b);

/*
 * Plan workspaces. Orders STABLE and SCORE, imoe_permute and
 * imoe_group_by_expert apply a general permutation in place; they take an
 * int32 workspace of imoe_plan_workspace_elems(...) elements (see the
 * permutation section below). `workspace` NULL with `workspace_elems` 0:
 * the CPU allocates it inside the call; CUDA requires it (device memory;
 * nothing is allocated on the device). Calls that need none ignore both.
 */

/*
 * Select the kept set of every row and write the map, in either or both
 * forms (at least one output must be given):
 *   out_indices     [lead..., C'] I32/I64: the original slot held by each of
 *                   the first C' slots after compaction, in sel->order.
 *   out_target_map  [lead..., N] I32: the involution; target_map[x] is the
 *                   slot x is exchanged with (x itself for a fixed point).
 *                   INPLACE order only.
 * The lead shape is that of the outputs; the selection's views must match
 * it (a shared [K] active view matches any lead shape). Reads the
 * selection, writes only the outputs. N is the scores' n; with active
 * indices, out_target_map's n or sel->num_slots (on CUDA, INPLACE order
 * with active indices takes N from out_target_map, which is then required).
 * Workspace: CUDA with STABLE or SCORE (IMOE_PLAN_ORDERED, rows of the
 * outputs); there a NaN under IMOE_NAN_ERROR or bad active indices is a
 * recorded data error and out_indices keeps its contents.
 */
imoe_status imoe_build_map(const imoe_selection *sel, const imoe_view *out_indices,
                           const imoe_view *out_target_map, int32_t *workspace,
                           int64_t workspace_elems, const imoe_exec *exec, imoe_error *err);

/*
 * Select, build the map and apply it to every buffer: the fused entry point.
 *   buffers[b]      [lead..., N, row_b] BYTES, written in place; all buffers
 *                   share lead shape and N, row_b may differ.
 *   out_indices     [lead..., C'] I32/I64, required: the kept slots in
 *                   sel->order.
 *   out_target_map  [lead..., N] I32, optional (NULL); INPLACE order only.
 * CPU: O(N) bytes per thread, allocated here. STABLE and SCORE apply the
 * permutation P (see imoe_order) with the plan workspace
 * (IMOE_PLAN_ORDERED, rows of the buffers: R x N int32 on the CPU, 7 x R x
 * N on CUDA). On CUDA a NaN under IMOE_NAN_ERROR or bad active indices is a
 * recorded data error that leaves out_indices and every buffer as they were.
 */
imoe_status imoe_compact(const imoe_view *buffers, int32_t num_buffers,
                         const imoe_selection *sel, const imoe_view *out_indices,
                         const imoe_view *out_target_map, imoe_mode mode, int32_t *workspace,
                         int64_t workspace_elems, const imoe_exec *exec, imoe_error *err);

/*
 * Apply the map of an earlier compaction, given its indices, to every buffer.
 *   indices [C'] shared by every row (orders STABLE and SCORE only) or
 *   [lead..., C'], I32/I64, C' <= N.
 *   order INPLACE: for each slot i < C', indices[i] == i or indices[i] >=
 *     C', and the entries >= C' are distinct and < N (IMOE_ERR_BAD_MAP
 *     otherwise). Swap mode with the same indices a second time restores the
 *     buffers (imoe_restore).
 *   order STABLE or SCORE (alike here): each row's entries distinct
 *     (IMOE_ERR_BAD_MAP) and in [0, N) (IMOE_ERR_INDEX_RANGE), in any order;
 *     the permutation P of imoe_order is applied (move mode writes [0, C')
 *     only; on CUDA it applies all of P), with the plan workspace
 *     (IMOE_PLAN_ORDERED, rows of indices).
 */
imoe_status imoe_apply_indices(const imoe_view *buffers, int32_t num_buffers,
                               const imoe_view *indices, imoe_order order, imoe_mode mode,
                               int32_t *workspace, int64_t workspace_elems,
                               const imoe_exec *exec, imoe_error *err);

/*
 *   target_map [lead..., N] I32/I64: an involution (target_map[target_map[x]]
 *   == x, every entry in [0, N)). Swap mode exchanges each 2-cycle; move
 *   mode copies the higher slot of each 2-cycle into the lower one.
 */
imoe_status imoe_apply_target_map(const imoe_view *buffers, int32_t num_buffers,
                                  const imoe_view *target_map, imoe_mode mode,
                                  const imoe_exec *exec, imoe_error *err);

/* Undo a swap compaction of that order, given its indices: the buffers
 * come back bit for bit. INPLACE: imoe_apply_indices in swap mode (an
 * involution); STABLE and SCORE: P^-1, with the plan workspace as for
 * imoe_apply_indices. */
imoe_status imoe_restore(const imoe_view *buffers, int32_t num_buffers,
                         const imoe_view *indices, imoe_order order, int32_t *workspace,
                         int64_t workspace_elems, const imoe_exec *exec, imoe_error *err);

/* ---- permutations ------------------------------------------------------
 *
 * The functions below apply a general permutation of the N slots of every
 * row in place, so nothing of size O(N x row) is allocated. They need an
 * int32 plan workspace whose size imoe_plan_workspace_elems gives (rows: the
 * rows of the permutation, 1 when it is shared by every row); its contents
 * are undefined afterwards:
 *   workspace        CPU: NULL allocates it here; CUDA: required (device
 *                    memory; nothing is allocated on the device). Else at
 *                    least imoe_plan_workspace_elems(...) int32 elements,
 *                    not overlapping any view of the call.
 * CPU: cycle following; each cycle is rotated through a fixed stack tile (at
 * most 4 KiB of one slot's bytes at a time); the plan is each row's
 * permutation with its cycles marked, rows x N elements.
 * CUDA: cycle leaders and positions by pointer jumping over the workspace;
 * one pass rotates every cycle inside chunks of 16 positions, then two
 * all-parallel swap passes fix the chunk seams (each row is read and written
 * about 1.125 times for a random permutation); 6 x rows x N elements
 * (7 x rows x N when the permutation itself is computed on the device:
 * grouping, ordered compaction).
 * The plan is built and checked for every row before any buffer byte moves
 * (CUDA: a bad permutation is a recorded data error, see
 * imoe_take_device_status).
 */

typedef enum imoe_plan_kind {
  IMOE_PLAN_PERMUTE = 0, /* imoe_permute: rows = rows of perm */
  IMOE_PLAN_ORDERED = 1, /* orders STABLE and SCORE: imoe_apply_indices / imoe_restore
                            (rows of indices), imoe_compact (rows of the buffers),
                            imoe_build_map on CUDA (rows of out_indices) */
  IMOE_PLAN_GROUP = 2    /* imoe_group_by_expert: rows of the buffers, n = T */
} imoe_plan_kind;

/* The int32 workspace elements a permutation call needs for `rows` rows of
 * `n` slots on `device`; -1 when the count overflows int64 or an argument is
 * negative. */
int64_t imoe_plan_workspace_elems(imoe_plan_kind kind, imoe_device_type device, int64_t rows,
                                  int64_t n);

/*
 * Permute the slots of every buffer in place: new slot i of row r holds what
 * old slot perm[r, i] held (the gather convention of torch.index_select /
 * x[perm]); with `inverse` nonzero, old slot i goes to new slot perm[r, i]
 * instead (x[perm] = x.clone()), which undoes the forward permutation.
 *   buffers  [lead..., N, row_b] BYTES, as for imoe_compact.
 *   perm     [N] I32/I64 shared by every row, or [lead..., N]; every row must
 *            hold each value of [0, N) exactly once: IMOE_ERR_INDEX_RANGE for
 *            a value outside it, IMOE_ERR_BAD_MAP for a repeated value.
 * Workspace: imoe_plan_workspace_elems(IMOE_PLAN_PERMUTE, rows(perm), N).
 */
imoe_status imoe_permute(const imoe_view *buffers, int32_t num_buffers, const imoe_view *perm,
                         int32_t inverse, int32_t *workspace, int64_t workspace_elems,
                         const imoe_exec *exec, imoe_error *err);

/*
 * Dropless grouping: per row, move the T slots of every buffer so that the
 * slots of expert 0 come first, then those of expert 1, ..., each expert's
 * slots in their original order (a stable counting sort).
 *   buffers      [lead..., T, row_b] BYTES.
 *   expert_ids   [lead..., T] I32/I64, each in [0, num_experts)
 *                (IMOE_ERR_INDEX_RANGE).
 *   num_experts  E >= 0 (E < 2^31 - 1).
 *   out_offsets  [lead..., E] I32/I64, required: expert e's slots end at
 *                offsets[e] (the inclusive cumulative sum of the experts'
 *                counts, as imoe_grouped_gemm and grouped_mm take it): they
 *                are [offsets[e - 1], offsets[e]), from 0 for expert 0;
 *                offsets[E - 1] = T when E > 0.
 *   out_perm     [lead..., T] I32/I64 or NULL: the permutation applied, in
 *                imoe_permute's convention (new slot i holds old slot
 *                perm[i]); imoe_permute(..., inverse = 1) with it ungroups.
 * Workspace: imoe_plan_workspace_elems(IMOE_PLAN_GROUP, ...). On the CPU,
 * per thread, (E + 1) x 8 bytes are allocated here. On CUDA, out_perm and
 * out_offsets are written on the device; E <= 1024 there
 * (IMOE_ERR_UNSUPPORTED beyond).
 */
imoe_status imoe_group_by_expert(const imoe_view *buffers, int32_t num_buffers,
                                 const imoe_view *expert_ids, int64_t num_experts,
                                 const imoe_view *out_offsets, const imoe_view *out_perm,
                                 int32_t *workspace, int64_t workspace_elems,
                                 const imoe_exec *exec, imoe_error *err);

/*
 * MoE dispatch and combine: the routing of an experts layer in and out of
 * the expert-sorted rows that grouped GEMMs take (csrc/moe_dispatch.c,
 * csrc/moe_combine.c; cuda/imoe_moe.cu). T tokens, k experts per token,
 * S = T x k assignments (t, j) in token order i = t x k + j, E experts,
 * H features per row.
 *
 * imoe_moe_dispatch: a stable counting sort of the assignments by expert
 * (each expert's assignments in token order) and the gather of their
 * tokens' rows.
 *   top_k_index    [T, k] I32/I64: assignment (t, j) goes to expert
 *                  top_k_index[t, j] in [0, E). With skip_foreign, values
 *                  >= E (another rank's experts, as expert parallelism
 *                  passes them) are assignments of no local expert: they
 *                  are neither computed nor counted as dropped. Otherwise
 *                  they are IMOE_ERR_INDEX_RANGE, as negative values always
 *                  are. A token may name an expert twice (two assignments),
 *                  unless `distinct` is set: then a token naming a local
 *                  expert twice is IMOE_ERR_INDEX_DUPLICATE on the CPU (not
 *                  checked on CUDA), and nothing is written; where
 *                  top_k_weights are given, an assignment of weight 0 (it
 *                  adds nothing) may repeat an expert.
 *   top_k_weights  [T, k] F32/F16/BF16, or NULL when dropless; judged
 *                  whenever given, read only with a capacity: each
 *                  expert keeps its C assignments of highest weight, ties
 *                  to the lower i, NaN lowest; the others are dropped.
 *   num_experts    E in [1, IMOE_MOE_MAX_EXPERTS].
 *   capacity       -1: dropless (every assignment kept); else C >= 0.
 *   layout         GROUPED: expert e's kept rows follow expert e - 1's,
 *                  rows R = S (rows past the last kept one hold no
 *                  assignment). PADDED (needs a capacity): expert e owns
 *                  rows [e x C, e x C + C), R = E x C, its kept rows first.
 *   hidden         [T, H] any dtype (moved as bytes), rows contiguous.
 *   out_rows       [R, H], hidden's dtype: row r holds hidden[token of r],
 *                  zeros where r holds no assignment.
 *   out_offsets    [E] I32/I64: expert e's rows end at offsets[e] (the
 *                  inclusive cumulative sum grouped_mm takes; PADDED:
 *                  (e + 1) x C).
 *   out_dest       [T, k] I32/I64: the row of assignment (t, j), or -1
 *                  when it was dropped or names no local expert.
 *   out_src        [R] I32/I64: the token of row r, -1 for a row that holds
 *                  no assignment.
 *   out_dropped    [1] I64 or NULL: how many assignments the capacity
 *                  dropped (written on the device on CUDA: no host sync).
 *   workspace      int32, its contents undefined afterwards. CUDA with a
 *                  capacity: required, imoe_moe_workspace_elems(S)
 *                  elements. CUDA dropless: optional; with at least
 *                  imoe_moe_workspace_elems(S) elements (nonzero from
 *                  S = IMOE_MOE_MULTI_SORT_MIN) the sort runs in several
 *                  blocks, else (NULL, or fewer elements) in one: the
 *                  same results, slower for a large S. CPU: unused (pass
 *                  NULL, 0).
 * On CUDA, at most IMOE_MOE_MAX_EXPERTS experts and S < 2^31; the sort (one
 * block; or, from S = IMOE_MOE_MULTI_SORT_MIN with the workspace, kernels
 * of several blocks: count, scan, place, with a capacity after the kept
 * assignments are chosen; the same results) and the gather, no host
 * synchronisation; an id out of range is a recorded data error
 * (imoe_take_device_status) and nothing is written.
 *
 * imoe_moe_combine: out[t] = sum over j with dest[t, j] >= 0, in j order,
 * of term(t, j) = rows[dest[t, j]] x weights[t, j], each term rounded to
 * the promoted dtype of rows and weights (F16 and BF16 promote to F32) and
 * summed in F32 from +0.0, rounded once into out's dtype (round to nearest
 * even): the arithmetic of torch's `out.add_(y[dest[:, j]] * w[:, j, None])`
 * in an F32 `out`. Terms are formed without fused multiply-add.
 *   rows     [R, H] F32/F16/BF16, rows contiguous.
 *   dest     [T, k] I32/I64, each in [-1, R) (IMOE_ERR_INDEX_RANGE).
 *   weights  [T, k] F32/F16/BF16.
 *   out      [T, H] F32/F16/BF16, rows contiguous, written whole.
 *
 * imoe_gated_act: out[r, i] = act(gate_up[r, i]) x gate_up[r, I + i] for
 * i < I (transformers' default gate: the first half of the features is
 * the gate, the second half up), both factors rounded to gate_up's dtype
 * as torch's `act(gate) * up` rounds them (act evaluated in F32).
 *   gate_up  [R, 2I] F32/F16/BF16, rows contiguous.
 *   out      [R, I], gate_up's dtype.
 *   act      imoe_act.
 *   limit    [E] I32/I64 or NULL: the offsets of imoe_moe_dispatch; only
 *            rows below limit[E - 1] (clamped to [0, R]) are computed and
 *            written, the others keep their bytes.
 */
#define IMOE_MOE_MAX_EXPERTS 1024
/* The fewest assignments a CUDA dispatch sorts in several blocks (given
 * imoe_moe_workspace_elems' workspace; dropless and grouped, or with a
 * capacity); fewer sort in one block. */
#define IMOE_MOE_MULTI_SORT_MIN 32768

typedef enum imoe_moe_layout { IMOE_MOE_GROUPED = 0, IMOE_MOE_PADDED = 1 } imoe_moe_layout;

typedef enum imoe_act {
  IMOE_ACT_SILU = 0,      /* x / (1 + exp(-x)) */
  IMOE_ACT_GELU = 1,      /* 0.5 x (1 + erf(x / sqrt(2))) */
  IMOE_ACT_GELU_TANH = 2, /* 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) */
  IMOE_ACT_RELU = 3
} imoe_act;

typedef struct imoe_moe_routing {
  const imoe_view *top_k_index;
  const imoe_view *top_k_weights; /* NULL when dropless */
  int64_t num_experts;
  int64_t capacity; /* -1: dropless */
  imoe_moe_layout layout;
  int32_t skip_foreign;
  int32_t distinct; /* 1: each token's local experts of nonzero weight distinct (CPU) */
} imoe_moe_routing;

/* The int32 workspace imoe_moe_dispatch takes on CUDA for S assignments:
 * 2 x S with a capacity (required); S dropless from S =
 * IMOE_MOE_MULTI_SORT_MIN (optional: it lets the sort run in several
 * blocks); 0 elsewhere (none is needed);
 * -1 for S < 0 or beyond the limits. */
int64_t imoe_moe_workspace_elems(imoe_device_type device, int64_t assignments, int64_t capacity);

/*
 * Output shapes. Each *_shape (and imoe_moe_dispatch_rows) makes every check
 * its operation makes of the arguments it reads (views and scalars; no
 * element is read, no device is touched) and gives the shape of what the
 * operation writes: a caller that allocates the outputs judges the call
 * first and allocates only for a call the operation will take. The
 * operations run the same checks, so the two never disagree.
 *   imoe_moe_dispatch_rows        R, the rows of out_rows and out_src.
 *   imoe_moe_combine_shape        out [T, H].
 *   imoe_gated_act_shape          out [R, I].
 *   imoe_gated_act_backward_shape grad_gate_up [R, 2I] (act_out and row_dot,
 *                                 outputs a caller gave, judged with the
 *                                 rest).
 *   imoe_moe_gather_rows_shape    out [num_rows, H]; num_rows in
 *                                 [0, 2^31 - 1].
 *   imoe_moe_weight_grad_shape    out [T, k].
 *   imoe_grouped_gemm_shape       out [R, N].
 *   imoe_topk_softmax_shape       out_weights and out_indices [T, k].
 * `rows` / `out_shape` may be NULL (the checks alone).
 */
imoe_status imoe_moe_dispatch_rows(const imoe_moe_routing *routing, const imoe_view *hidden,
                                   int64_t *rows, imoe_error *err);
imoe_status imoe_moe_combine_shape(const imoe_view *rows, const imoe_view *dest,
                                   const imoe_view *weights, int64_t out_shape[2], imoe_error *err);
imoe_status imoe_gated_act_shape(const imoe_view *gate_up, imoe_act act, const imoe_view *limit,
                                 int64_t out_shape[2], imoe_error *err);

imoe_status imoe_moe_dispatch(const imoe_moe_routing *routing, const imoe_view *hidden,
                              const imoe_view *out_rows, const imoe_view *out_offsets,
                              const imoe_view *out_dest, const imoe_view *out_src,
                              const imoe_view *out_dropped, int32_t *workspace,
                              int64_t workspace_elems, const imoe_exec *exec, imoe_error *err);

imoe_status imoe_moe_combine(const imoe_view *rows, const imoe_view *dest,
                             const imoe_view *weights, const imoe_view *out,
                             const imoe_exec *exec, imoe_error *err);

imoe_status imoe_gated_act(const imoe_view *gate_up, const imoe_view *out, imoe_act act,
                           const imoe_view *limit, const imoe_exec *exec, imoe_error *err);

/*
 * MoE backward (csrc/moe_backward.c, cuda/imoe_moe_backward.cu). F32 math,
 * products rounded before they are added. The gather and the dot products
 * are the same bits on the CPU and CUDA; the activation's backward uses each
 * device's expf / erff / tanhf (a few ulp apart).
 *
 * imoe_gated_act_backward: for rows r below limit[E - 1] (clamped to
 * [0, R]; all rows without a limit), with g = gate_up[r, i], u =
 * gate_up[r, I + i], d = grad_act[r, i]: grad_gate_up[r, i] = d x u x
 * act'(g) and grad_gate_up[r, I + i] = d x act(g) (act and act' in F32,
 * unrounded; relu' is 1 for g > 0, else 0), each rounded once into
 * gate_up's dtype. Rows at or past the limit are written +0.0.
 *   gate_up       [R, 2I] F32/F16/BF16, rows contiguous.
 *   grad_act      [R, I] F32/F16/BF16, rows contiguous.
 *   row_scale     [R, 1] F32/F16/BF16 or NULL: d = grad_act[r, i] x
 *                 row_scale[r] in F32, unrounded (the fused experts
 *                 layer's routing weight per row).
 *   grad_gate_up  [R, 2I], gate_up's dtype, rows contiguous. It may be
 *                 gate_up itself (the same view): gate[i] and up[i] are read
 *                 before grad_gate_up's elements i and I + i are written.
 *   act_out       [R, I], gate_up's dtype, rows contiguous, or NULL: the
 *                 forward's value a = imoe_gated_act's (act(g) rounded, x u,
 *                 rounded) x row_scale[r] (1 without), rounded once. It may
 *                 be grad_act itself (the same view): each element is read
 *                 before it is written.
 *   row_dot       [R, 1] F32 or NULL: <grad_act[r], a> unscaled, in F32: 32
 *                 lane sums, element i added to lane (i / 8) mod 32 in
 *                 increasing i, then p[l] += p[l + s] for l < s, s = 16, 8,
 *                 4, 2, 1 (the fused layer's d(top_k_weights) per row).
 *                 act_out and row_dot are +0.0 past the limit.
 * One pass over gate_up and grad_act writes all three, so the fused layer's
 * backward neither recomputes the activation nor scales its operands apart.
 *
 * imoe_moe_gather_rows: out[dest[t, j]] = weights[t, j] x src[t] (weights
 * NULL: src[t]) for every dest[t, j] >= 0, rounded once into out's dtype;
 * every other row of out is +0.0. The combine's d(rows) (src its output's
 * gradient), and the dispatch's gather of a [T, H] array to a dispatch's
 * rows (weights NULL).
 *   src      [T, H] F32/F16/BF16, rows contiguous.
 *   dest     [T, k] I32/I64, each in [-1, R) (IMOE_ERR_INDEX_RANGE); the
 *            entries >= 0 distinct (IMOE_ERR_INDEX_DUPLICATE on the CPU; a
 *            repeat is not checked on CUDA, and out's rows are then
 *            unspecified), as imoe_moe_dispatch writes them. R kept entries
 *            name every row: CUDA then writes each row once, with no
 *            zeroing pass (a dropless dispatch's rows).
 *   weights  [T, k] F32/F16/BF16 or NULL.
 *   out      [R, H] F32/F16/BF16, rows contiguous, written whole.
 *
 * imoe_moe_weight_grad: out[t, j] = <a[i], b[dest[t, j]]> (i = dest[t, j]
 * when a_by_row, else t), 0 where dest[t, j] = -1: the combine's
 * d(top_k_weights) (a its output's gradient [T, H], b its rows), or the
 * fused layer's (a = b' = rows of one width). In F32: 32 lane sums, element
 * h added to lane h mod 32 in increasing h, then p[l] += p[l + s] for l < s,
 * s = 16, 8, 4, 2, 1; rounded once into out's dtype.
 *   a     [T, H] (or [R, H] when a_by_row) F32/F16/BF16, rows contiguous.
 *   b     [R, H] F32/F16/BF16, rows contiguous.
 *   dest  [T, k] I32/I64, each in [-1, R).
 *   out   [T, k] F32/F16/BF16.
 * On CUDA, on the stream, no host synchronisation: the activation's backward
 * one kernel (a warp per row); the gather and the dot products a one-block check of dest,
 * then their kernel (the gather: zeros, then rows). dest out of range is a
 * recorded data error (imoe_take_device_status) and nothing is written.
 */
imoe_status imoe_gated_act_backward_shape(const imoe_view *gate_up, const imoe_view *grad_act,
                                          imoe_act act, const imoe_view *limit, const imoe_view *row_scale,
                                          const imoe_view *act_out, const imoe_view *row_dot,
                                          int64_t out_shape[2], imoe_error *err);
imoe_status imoe_moe_gather_rows_shape(const imoe_view *src, const imoe_view *dest,
                                       const imoe_view *weights, int64_t num_rows, int64_t out_shape[2],
                                       imoe_error *err);
imoe_status imoe_moe_weight_grad_shape(const imoe_view *a, int32_t a_by_row, const imoe_view *b,
                                       const imoe_view *dest, int64_t out_shape[2], imoe_error *err);
imoe_status imoe_gated_act_backward(const imoe_view *gate_up, const imoe_view *grad_act, imoe_act act,
                                    const imoe_view *limit, const imoe_view *row_scale,
                                    const imoe_view *grad_gate_up, const imoe_view *act_out,
                                    const imoe_view *row_dot, const imoe_exec *exec, imoe_error *err);
imoe_status imoe_moe_gather_rows(const imoe_view *src, const imoe_view *dest, const imoe_view *weights,
                                 const imoe_view *out, const imoe_exec *exec, imoe_error *err);
imoe_status imoe_moe_weight_grad(const imoe_view *a, int32_t a_by_row, const imoe_view *b,
                                 const imoe_view *dest, const imoe_view *out, const imoe_exec *exec,
                                 imoe_error *err);

/*
 * imoe_grouped_gemm: the small-M grouped GEMM of an experts layer (CPU core
 * csrc/moe_gemm.c, CUDA cuda/imoe_moe_gemm.cu). With E experts over the
 * expert-sorted rows of a dispatch, out[r] = a[r] @ w[e(r)] for every row
 * r < offsets[E - 1], e(r) the first e with offsets[e] > r; rows at or past
 * offsets[E - 1] keep their bytes.
 *   a        [R, K] F32/F16/BF16.
 *   w        [E, K, N], a's dtype, any strides (a view: transformers'
 *            gate_up_proj [E, 2I, H] transposed is [E, H, 2I] with K
 *            contiguous).
 *   offsets  [E] I32, non-decreasing, each in [0, R] (IMOE_ERR_INDEX_RANGE).
 *   out      [R, N], a's dtype, written for rows < offsets[E - 1].
 * Arithmetic (the same on every device, bit for bit): in F32, 32 partial
 * sums p[0..31] from +0.0; element k of the dot product goes to
 * p[(k / V) mod 32], V = 16 / element size (8 for F16/BF16, 4 for F32), in
 * increasing k, as p = fmaf(a[r, k], w[e, k, n], p); then the butterfly
 * p[l] += p[l + h] for l < h, h = 16, 8, 4, 2, 1; p[0] is rounded once into
 * out's dtype (round to nearest even). NaN payloads may differ by device.
 * On CUDA: a's rows contiguous (its last axis stride one element), w's K
 * axis contiguous, w's base and its E and N strides multiples of 16 bytes,
 * K x element size a multiple of 16, E <= IMOE_MOE_MAX_EXPERTS and R < 2^31
 * (IMOE_ERR_UNSUPPORTED otherwise); one kernel, no host synchronisation;
 * offsets that break the rule above are a recorded data error
 * (imoe_take_device_status) and nothing is written.
 */
imoe_status imoe_grouped_gemm_shape(const imoe_view *a, const imoe_view *w, const imoe_view *offsets,
                                    int64_t out_shape[2], imoe_error *err);
imoe_status imoe_grouped_gemm(const imoe_view *a, const imoe_view *w, const imoe_view *offsets,
                              const imoe_view *out, const imoe_exec *exec, imoe_error *err);

/*
 * imoe_experts_gemm: the experts' grouped GEMM on tensor cores, each row's
 * input read where it lies (CPU core csrc/experts_gemm.c, CUDA
 * cuda/imoe_experts_gemm.cu). With E experts over the expert-sorted rows of
 * a dispatch, for every row r < offsets[E - 1] (e(r) the first e with
 * offsets[e] > r):
 *   y[r] = x[src[r]] @ w[e(r)]   with src (x in token order: no gathered
 *                                copy of the rows is made),
 *   y[r] = x[r] @ w[e(r)]        without (x already in row order),
 * written as out[r] = y[r] when not gated, else as the gated activation of
 * that GEMM's output: out[r, i] = act(g) x u with g = y[r, i] and u =
 * y[r, N / 2 + i] each rounded once into out's dtype, then computed as
 * imoe_gated_act computes it (transformers' gate_up_proj: the gate first).
 * Rows at or past offsets[E - 1] keep their bytes.
 *   x        [T, K] (with src) or [R, K] F32/F16/BF16.
 *   src      [R] I32 or NULL: the token of each row (imoe_moe_dispatch's
 *            out_src); below offsets[E - 1] each in [0, T)
 *            (IMOE_ERR_INDEX_RANGE).
 *   w        [E, K, N], x's dtype, any strides (transformers' [E, N, K]
 *            weights transposed: K contiguous).
 *   offsets  [E] I32, non-decreasing, each in [0, R] (IMOE_ERR_INDEX_RANGE).
 *   gated    0: out [R, N]; 1: out [R, N / 2] with act (N even).
 *   out      [R, N] or [R, N / 2], x's dtype.
 * Arithmetic: each dot product summed in F32 (on the CPU from +0.0 in
 * increasing k with fmaf; on CUDA in the tensor cores' order), rounded once
 * into out's dtype: grouped_mm's rounding class, not bit-identical to it or
 * across devices. On CUDA: F16/BF16 only, x's rows and out's rows
 * contiguous, x's base and row stride, w's base and its E and N strides
 * multiples of 16 bytes, K a multiple of 8, out's base and row stride
 * multiples of 4 bytes, E <= IMOE_MOE_MAX_EXPERTS, R and T < 2^31
 * (IMOE_ERR_UNSUPPORTED otherwise); mma.sync tiles fed by cp.async from a
 * tile plan of (rows per expert, N) (docs/cuda-design.md), one kernel (and a
 * one-block check of src before it when src is given), no host
 * synchronisation; bad offsets or src are a recorded data error
 * (imoe_take_device_status) and nothing is written.
 */
imoe_status imoe_experts_gemm_shape(const imoe_view *x, const imoe_view *src, const imoe_view *w,
                                    const imoe_view *offsets, int32_t gated, imoe_act act,
                                    int64_t out_shape[2], imoe_error *err);
imoe_status imoe_experts_gemm(const imoe_view *x, const imoe_view *src, const imoe_view *w,
                              const imoe_view *offsets, int32_t gated, imoe_act act, const imoe_view *out,
                              const imoe_exec *exec, imoe_error *err);

/*
 * The router of a sparse-MoE block after its linear (csrc/moe_router.c,
 * cuda/imoe_router.cu): per token, p = softmax(logits[t]) in F32, the k
 * largest p in descending order, equal values in the order torch's CUDA
 * topk gives them (below), optionally divided by their sum, written in
 * out_weights' dtype. The arithmetic is torch's CUDA routing (transformers'
 * Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE routers):
 *   - softmax as torch's softmax_warp_forward: W = min(next_pow2(E), 32)
 *     lanes, lane l holding experts l + i x W (i < next_pow2(E) / W; slots
 *     past E are -inf); the lane's max in i order, then an xor butterfly
 *     (offsets W/2 .. 1, max(a, b) = a < b ? b : a); e = exp(x - max) kept,
 *     the lane's sum of e from +0.0 in i order, an xor butterfly of sums;
 *     p = e / sum (a correctly rounded division). Logits are read in their
 *     dtype and converted exactly to F32 (torch's .float() / dtype=float).
 *   - top-k as torch.topk(p, k) on CUDA (aten/src/ATen/native/cuda:
 *     TensorTopK.cu, TensorTopK.cpp, SortingRadixSelect.cuh, Sort.cu /
 *     SortImpl.cuh, SortUtils.cuh, SortingCommon.cuh, as on pytorch's main
 *     branch in 2025/26; the network of step 3 is older, torch 1.x's Sort.cu
 *     already sorted k <= 32 so), which fixes the order of equal values:
 *       1. key(p): the order-preserving bits (sign set: all bits flipped,
 *          else the sign bit set); every NaN the largest key, 0xFFFFFFFF
 *          (TopKTypeConfig<float>::convert). kth = the k-th largest key,
 *          repeats counted (radixSelect).
 *       2. gathered, in this order (gatherTopK): the experts whose key is
 *          above kth, ascending; then the experts whose key equals kth,
 *          ascending, until k are gathered (so among equal values at the
 *          k-th place the lower experts are chosen).
 *       3. k = 1: that is the result. k >= 2: SmallBitonicSort (topk calls
 *          sortKeyValueInplace(values, indices, dim, largest), stable
 *          false, k <= 32): the k gathered (value, expert) pairs in slots
 *          0 .. k-1 of 32, slots k .. 31 invalid, then bitonicSortKVInPlace
 *          with 16 threads: for size = 2, 4, 8, 16, 32 and stride = size/2
 *          .. 1, each pair (a, b = a + stride), a = 2t - (t & (stride - 1))
 *          for t < 16, exchanges when swap == dir, where dir = (a & size)
 *          != 0 (false when size = 32) and swap = (gt(v_a, v_b) && valid_a)
 *          || !valid_b, gt(x, y) = (isnan(x) && !isnan(y)) || x > y
 *          (GTOp<float, true>). Equal values are exchanged whenever the
 *          stage's direction is false: with every p equal the experts come
 *          out 1 0 (k = 2), 1 0 2 3 (k = 4), 7 6 4 5 1 0 2 3 (k = 8).
 *     For T rows of E <= 1024 torch takes its multi-block path (mbtopk,
 *     should_use_multiblock) when 800 <= T <= 4000 and E >= 800, or T >
 *     4000 and E >= 400: its radix select finds the same kth and its
 *     gatherTopK writes in the order of step 2, so the result is the same.
 *     Its other path, a full sort (should_use_sort: T <= 10 rows of E >=
 *     100000), is out of reach here. torch built for ROCm (warptopk, a
 *     stable merge sort for E <= 256) orders equal values otherwise; that
 *     is not emulated.
 *   - renormalisation as torch's sum over the last axis of the [T, k]
 *     values: with B = the largest power of two <= k, partial l < B is
 *     v[l] + v[l + B] (v[l] alone when l + B >= k), then partial l +=
 *     partial l + o for o = B/2 .. 1; each weight = v / partial 0.
 * exp: on CUDA, expf (libdevice, the hardware's ex2.approx inside, as
 * torch's kernel calls it); on the CPU the same range reduction with a
 * correctly rounded 2^f in place of ex2.approx, so CPU and CUDA
 * probabilities may differ in their last bits (the ex2.approx error).
 * Equal logits give equal probabilities on both, so the order of equal
 * values is the same on both.
 * NaN: a row with a NaN or +inf logit, or only -inf logits, has NaN
 * probabilities throughout, as torch's softmax gives; its weights are then
 * NaN and its experts 0 .. k-1 in the order step 3 gives equal values (NaN
 * ranks above every number and all NaN rank equal, in step 1 and in gt).
 *   logits       [T, E] F32/F16/BF16, 1 <= E <= IMOE_MOE_MAX_EXPERTS.
 *   k            1 <= k <= min(E, IMOE_ROUTER_MAX_K).
 *   renormalize  nonzero: divide the k values by their sum.
 *   out_weights  [T, k] F32/F16/BF16 (rounded to nearest even).
 *   out_indices  [T, k] I32/I64: the experts, in descending weight.
 * On CUDA: one launch, one warp per row (W-lane groups of a warp for
 * E <= 16), 1 KiB of static shared memory a block, no allocation, no host
 * synchronisation.
 */
#define IMOE_ROUTER_MAX_K 32

imoe_status imoe_topk_softmax_shape(const imoe_view *logits, int64_t k, int64_t out_shape[2],
                                    imoe_error *err);
imoe_status imoe_topk_softmax(const imoe_view *logits, int64_t k, int32_t renormalize,
                              const imoe_view *out_weights, const imoe_view *out_indices,
                              const imoe_exec *exec, imoe_error *err);

/*
 * Data errors found on a device. A CUDA call never synchronises the host, so
 * a data error (a NaN score under IMOE_NAN_ERROR, active indices out of range
 * or repeated, an invalid caller-given map) cannot fail the call itself: the
 * call returns IMOE_OK, changes no byte of any buffer or output, and records
 * the error's status on the device (the first one wins). This function
 * synchronises exec->stream, stores that status into *recorded (IMOE_OK when
 * none) and clears it. On the CPU, where such errors fail the call itself,
 * *recorded is always IMOE_OK.
 */
imoe_status imoe_take_device_status(const imoe_exec *exec, imoe_status *recorded,
                                    imoe_error *err);

/*
 * Paged buffers (vLLM's KV cache): a pool of blocks of block_size slots, and
 * a block table per sequence. Logical slot x of sequence s lives in block
 * block_tables[s, x / block_size] at offset x % block_size.
 *   buffers[b]    pools [num_blocks, lead..., block_size, row_b]: the FIRST
 *                 lead axis is the block axis, n the slot-in-block axis (a
 *                 vLLM cache [num_blocks, block_size, heads, head_dim] is
 *                 lead (num_blocks, heads) with row head_dim, or lead
 *                 (num_blocks) with row heads x head_dim). Written in place;
 *                 all share lead shape and block_size, row_b may differ.
 *   block_tables  [S, max_blocks] I32/I64.
 *   target_map    [S, lead..., N] I32/I64, N <= max_blocks x block_size: for
 *                 each sequence and row, an involution over logical slots as
 *                 imoe_build_map writes it (fixed points beyond a sequence's
 *                 length). Zero strides are fine: one map shared by all rows.
 * Every slot that moves (target_map[x] != x) must name a block in
 * [0, num_blocks) (IMOE_ERR_INDEX_RANGE), and a block written through one
 * table entry must not be named by another entry that moves data
 * (IMOE_ERR_INDEX_DUPLICATE): shared (prefix-cached) blocks must be copied
 * before they are compacted. Swap mode exchanges each 2-cycle; move mode
 * copies the higher logical slot into the lower one. Checked in full before
 * any write, with the precedence of the CPU core: the first sequence with an
 * error, in it the first row whose map is invalid (ranges before the
 * involution) or moves a slot of an out-of-range block, and only then
 * blocks written through two entries.
 *   workspace     int32, at least imoe_paged_workspace_elems(num_blocks, S,
 *                 max_blocks) = num_blocks + S x max_blocks + 512 elements,
 *                 on the device of the call, not overlapping any view; its
 *                 contents are undefined afterwards. Required on CUDA (the
 *                 per-block marks of the duplicate check and the per-entry
 *                 flags live there); on the CPU NULL allocates
 *                 S x max_blocks + num_blocks bytes here.
 * On CUDA, as for every device call, data errors (the three above) are
 * recorded on the device (imoe_take_device_status) and nothing is written.
 */
#define IMOE_PAGED_WORKSPACE_EXTRA 512
/* -1 for a negative argument or a count beyond int64. */
int64_t imoe_paged_workspace_elems(int64_t num_blocks, int64_t num_seqs, int64_t max_blocks);

imoe_status imoe_paged_apply_target_map(const imoe_view *buffers, int32_t num_buffers,
                                        const imoe_view *block_tables,
                                        const imoe_view *target_map, imoe_mode mode,
                                        int32_t *workspace, int64_t workspace_elems,
                                        const imoe_exec *exec, imoe_error *err);

#ifdef __cplusplus
}
#endif

#endif /* IDEMPOTENT_MOE_H */
