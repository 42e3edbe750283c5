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
#define IMOE_VERSION_MINOR 1
#define IMOE_VERSION_PATCH 0

/* Most lead axes a view may have. */
#define IMOE_MAX_LEAD_DIMS 8

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

typedef enum imoe_device_type {
  IMOE_DEVICE_CPU = 0,
  IMOE_DEVICE_CUDA = 1
} imoe_device_type;

typedef enum imoe_mode {
  IMOE_MODE_SWAP = 0, /* a permutation: dropped tokens end in [C', N); reversible */
  IMOE_MODE_MOVE = 1  /* kept tail tokens are copied into holes; half the traffic */
} imoe_mode;

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
 */
typedef struct imoe_selection {
  const imoe_view *scores;
  const imoe_view *active;
  int64_t capacity;
  int64_t protected_prefix;
  int64_t recent_window;
  imoe_nan_policy nan_policy;
} imoe_selection;

typedef struct imoe_error {
  char message[256];
} imoe_error;

/* A static, human-readable name for a status ("IMOE_ERR_NAN: ..."). */
const char *imoe_status_string(imoe_status status);

/* 1 when this library was built with the CUDA launchers, else 0. */
int imoe_cuda_compiled(void);

/*
 * Select the kept set of every row and write the idempotent map, in either
 * or both forms (at least one output must be given):
 *   out_indices     [lead..., C'] I32/I64: the original slot held by each of
 *                   the first C' slots after compaction.
 *   out_target_map  [lead..., N] I32: the involution; target_map[x] is the
 *                   slot x is exchanged with (x itself for a fixed point).
 * The lead shape is that of the outputs; the selection's views must match
 * it (a shared [K] active view matches any lead shape). Reads the
 * selection, writes only the outputs. N is scores' n; with `active`, N is
 * out_target_map's n, so out_target_map is then required
 * (IMOE_ERR_ARGUMENT without it).
 */
imoe_status imoe_build_map(const imoe_selection *sel, const imoe_view *out_indices,
                           const imoe_view *out_target_map, const imoe_exec *exec,
                           imoe_error *err);

/*
 * Select, build the map and apply it to every buffer: the fused entry point.
 *   buffers[b]      [lead..., N, row_b] BYTES, written in place; all buffers
 *                   share lead shape and N, row_b may differ.
 *   out_indices     [lead..., C'] I32/I64, required.
 *   out_target_map  [lead..., N] I32, optional (NULL).
 * CPU workspace: O(N) bytes per thread, allocated here.
 */
imoe_status imoe_compact(const imoe_view *buffers, int32_t num_buffers,
                         const imoe_selection *sel, const imoe_view *out_indices,
                         const imoe_view *out_target_map, imoe_mode mode,
                         const imoe_exec *exec, imoe_error *err);

/*
 * Apply a map built by imoe_build_map / imoe_compact to every buffer.
 *   indices [lead..., C'] I32/I64: for each slot i < C', indices[i] == i or
 *   indices[i] >= C', and the entries >= C' are distinct and < N. Swap mode
 *   with the same indices a second time restores the buffers (imoe_restore).
 */
imoe_status imoe_apply_indices(const imoe_view *buffers, int32_t num_buffers,
                               const imoe_view *indices, imoe_mode mode,
                               const imoe_exec *exec, imoe_error *err);

/*
 *   target_map [lead..., N] I32/I64: an involution (target_map[target_map[x]]
 *   == x, every entry in [0, N)). Swap mode exchanges each 2-cycle; move
 *   mode copies the higher slot of each 2-cycle into the lower one.
 */
imoe_status imoe_apply_target_map(const imoe_view *buffers, int32_t num_buffers,
                                  const imoe_view *target_map, imoe_mode mode,
                                  const imoe_exec *exec, imoe_error *err);

/* Undo a swap compaction: imoe_apply_indices in swap mode. */
imoe_status imoe_restore(const imoe_view *buffers, int32_t num_buffers,
                         const imoe_view *indices, const imoe_exec *exec, imoe_error *err);

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

#ifdef __cplusplus
}
#endif

#endif /* IDEMPOTENT_MOE_H */
