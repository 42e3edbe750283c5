/*
 * imoe_backend.h: the device backend the C API dispatches to.
 *
 * The public entry points (csrc/) validate every shape, stride, dtype and
 * option on the host, then run on the CPU core or, when exec->device ==
 * IMOE_DEVICE_CUDA, call these launchers. The core defines this interface and
 * the backend implements it, so dependencies point one way: cuda/ includes
 * this header, csrc/ includes nothing from cuda/. A build with nvcc links the
 * launchers of cuda/; a build without it links csrc/backend_none.c, where
 * imoe_backend_has_cuda() is 0 and every launcher answers
 * IMOE_ERR_UNSUPPORTED (never reached: imoe_check_exec refuses CUDA first).
 *
 * The semantics are those of the matching imoe_* function in idempotent_moe.h,
 * bit for bit. This header needs no CUDA header: exec->stream is a
 * cudaStream_t passed as void *.
 *
 * Rules every launcher keeps
 *   - All work is enqueued on exec->stream (NULL: the legacy default stream)
 *     of device exec->device_id. Nothing is allocated, and nothing
 *     synchronises the host, so every call can be captured in a CUDA graph.
 *     Scratch lives in registers and shared memory.
 *   - Data-dependent errors (a NaN score under IMOE_NAN_ERROR, active indices
 *     out of range or repeated, an invalid caller-given map) cannot be
 *     reported synchronously. A read-only kernel checks them before anything
 *     is written; on an error it records the imoe_status code in a device-side
 *     status word (the first error wins) and every later kernel of the same
 *     call writes nothing: buffers and outputs keep their contents. The call
 *     itself returns IMOE_OK. imoe_cuda_read_device_status() returns the word.
 *   - A launch failure returns IMOE_ERR_DEVICE with the CUDA error string in
 *     err->message.
 *
 * Limits: at most 2^32 - 1 rows; N < 2^31.
 */
#ifndef IMOE_BACKEND_H
#define IMOE_BACKEND_H

#include "idempotent_moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when the CUDA launchers are linked into this build, else 0. */
int imoe_backend_has_cuda(void);

/* The CUDA devices the launchers can run on now: visible devices whose
 * compute capability the build has code for. 0 without a driver or a device
 * (no CUDA error is left behind) and in a build without CUDA. Counted once
 * per process; it initialises the driver but creates no context. */
int imoe_backend_device_count(void);

/* imoe_build_map on the device: writes out_indices and/or out_target_map. */
imoe_status imoe_cuda_build_map(const imoe_selection *sel, const imoe_view *out_indices,
                                const imoe_view *out_target_map, const imoe_exec *exec,
                                imoe_error *err);

/* imoe_compact on the device: select, build the map and apply it to every
 * buffer. out_indices is required, out_target_map optional (NULL). */
imoe_status imoe_cuda_compact(const imoe_view *buffers, int32_t num_buffers,
                              const imoe_selection *sel, const imoe_view *out_indices,
                              const imoe_view *out_target_map, imoe_mode mode,
                              const imoe_exec *exec, imoe_error *err);

/* imoe_apply_indices on the device (swap twice restores: imoe_restore). */
imoe_status imoe_cuda_apply_indices(const imoe_view *buffers, int32_t num_buffers,
                                    const imoe_view *indices, imoe_mode mode,
                                    const imoe_exec *exec, imoe_error *err);

/* imoe_apply_target_map on the device. */
imoe_status imoe_cuda_apply_target_map(const imoe_view *buffers, int32_t num_buffers,
                                       const imoe_view *target_map, imoe_mode mode,
                                       const imoe_exec *exec, imoe_error *err);

/* Synchronises exec->stream, then stores into *status_out the device-side
 * status word (IMOE_OK, or the first data error recorded since the last read)
 * and clears it. Returns IMOE_ERR_DEVICE when the runtime fails. */
imoe_status imoe_cuda_read_device_status(const imoe_exec *exec, int32_t *status_out);

/* ---- paged pools (cuda/imoe_paged.cu) ----
 * imoe_paged_apply_target_map on the device. workspace: int32 device memory
 * of at least imoe_paged_workspace_elems(num_blocks, S, max_blocks)
 * elements (per-block claims, per-entry flags, the check kernel's error
 * keys); nothing in it needs to be initialised. Errors in the map or the
 * tables are recorded on the device and leave every pool unchanged. */
imoe_status imoe_cuda_paged_apply_target_map(const imoe_view *buffers, int32_t num_buffers,
                                             const imoe_view *block_tables,
                                             const imoe_view *target_map, imoe_mode mode,
                                             int32_t *workspace, int64_t workspace_elems,
                                             const imoe_exec *exec, imoe_error *err);
/* ---- permutations (cuda/imoe_permute.cu) -----------------------------
 * The workspace is device memory of imoe_plan_workspace_elems(kind,
 * IMOE_DEVICE_CUDA, rows, N) int32 elements (IMOE_ERR_ARGUMENT when it is
 * missing or short). A bad perm, bad indices or expert ids out of range are
 * recorded data errors, as above: every buffer and output keeps its bytes. */

/* imoe_permute on the device. */
imoe_status imoe_cuda_permute(const imoe_view *buffers, int32_t num_buffers, const imoe_view *perm,
                              int32_t inverse, int32_t *workspace, int64_t workspace_elems,
                              const imoe_exec *exec, imoe_error *err);

/* imoe_apply_ordered (swap or move: all of P is applied) and, with restore,
 * imoe_restore_ordered on the device. */
imoe_status imoe_cuda_apply_ordered(const imoe_view *buffers, int32_t num_buffers,
                                    const imoe_view *indices, int32_t restore, int32_t *workspace,
                                    int64_t workspace_elems, const imoe_exec *exec,
                                    imoe_error *err);

/* imoe_compact_ordered with STABLE or SCORE on the device (cuda/imoe_ordered.cu):
 * out_indices receives the kept slots in order and P = kept-in-order ++
 * dropped-ascending is applied to every buffer (move mode, like
 * imoe_cuda_apply_ordered, applies all of P). Workspace: IMOE_PLAN_ORDERED,
 * rows of the buffers. A NaN under IMOE_NAN_ERROR or bad active indices is a
 * recorded data error: out_indices and every buffer keep their bytes. */
imoe_status imoe_cuda_compact_ordered(const imoe_view *buffers, int32_t num_buffers,
                                      const imoe_selection *sel, imoe_order order, imoe_mode mode,
                                      const imoe_view *out_indices, int32_t *workspace,
                                      int64_t workspace_elems, const imoe_exec *exec,
                                      imoe_error *err);

/* imoe_build_map_ordered with STABLE or SCORE on the device: out_indices
 * only. Workspace: IMOE_PLAN_ORDERED, rows of out_indices, n. */
imoe_status imoe_cuda_build_map_ordered(const imoe_selection *sel, imoe_order order, int64_t n,
                                        const imoe_view *out_indices, int32_t *workspace,
                                        int64_t workspace_elems, const imoe_exec *exec,
                                        imoe_error *err);

/* imoe_group_by_expert on the device (num_experts <= 1024). */
imoe_status imoe_cuda_group_by_expert(const imoe_view *buffers, int32_t num_buffers,
                                      const imoe_view *expert_ids, int64_t num_experts,
                                      const imoe_view *out_offsets, const imoe_view *out_perm,
                                      int32_t *workspace, int64_t workspace_elems,
                                      const imoe_exec *exec, imoe_error *err);

/* ---- MoE dispatch and combine (cuda/imoe_moe.cu) ----------------------
 * imoe_moe_dispatch on the device, `rows` rows in out_rows: the sort and
 * the gather. The sort is one block (it checks the ids before it writes),
 * except a dropless grouped dispatch of at least IMOE_MOE_MULTI_SORT_MIN
 * assignments given a workspace of imoe_moe_workspace_elems elements: that
 * one sorts in several blocks (a count kernel that checks the ids, a scan,
 * a placing kernel), with the same results. workspace: with a capacity,
 * imoe_moe_workspace_elems(IMOE_DEVICE_CUDA, S, capacity) int32 elements
 * (the core has refused fewer); dropless, NULL or any size: the blocks'
 * counts (B x E <= S elements) decide, the one-block sort running where
 * workspace_elems is short of them. */
imoe_status imoe_cuda_moe_dispatch(const imoe_moe_routing *routing, const imoe_view *hidden,
                                   int64_t rows, const imoe_view *out_rows,
                                   const imoe_view *out_offsets, const imoe_view *out_dest,
                                   const imoe_view *out_src, const imoe_view *out_dropped,
                                   int32_t *workspace, int64_t workspace_elems,
                                   const imoe_exec *exec, imoe_error *err);

/* imoe_moe_combine on the device; dest out of range is a recorded data error. */
imoe_status imoe_cuda_moe_combine(const imoe_view *rows, const imoe_view *dest,
                                  const imoe_view *weights, const imoe_view *out,
                                  const imoe_exec *exec, imoe_error *err);

/* imoe_gated_act on the device. */
imoe_status imoe_cuda_gated_act(const imoe_view *gate_up, const imoe_view *out, imoe_act act,
                                const imoe_view *limit, const imoe_exec *exec, imoe_error *err);

/* ---- MoE backward (cuda/imoe_moe_backward.cu): the core has checked
 * shapes and dtypes; data errors are recorded on the device. */
imoe_status imoe_cuda_gated_act_backward(const imoe_view *gate_up, const imoe_view *grad_act, imoe_act act,
                                         const imoe_view *limit, const imoe_view *row_scale,
                                         const imoe_view *grad_gate_up, const imoe_view *act_out,
                                         const imoe_view *row_dot, const imoe_exec *exec, imoe_error *err);
imoe_status imoe_cuda_moe_gather_rows(const imoe_view *src, const imoe_view *dest, const imoe_view *weights,
                                      const imoe_view *out, const imoe_exec *exec, imoe_error *err);
imoe_status imoe_cuda_moe_weight_grad(const imoe_view *a, int32_t a_by_row, const imoe_view *b,
                                      const imoe_view *dest, const imoe_view *out, const imoe_exec *exec,
                                      imoe_error *err);

/* ---- the small-M grouped GEMM (cuda/imoe_moe_gemm.cu) -----------------
 * imoe_grouped_gemm on the device. The core has checked shapes, dtypes and
 * aliasing; the launcher refuses layouts its kernel does not read
 * (IMOE_ERR_UNSUPPORTED). Bad offsets are a recorded data error. */
imoe_status imoe_cuda_grouped_gemm(const imoe_view *a, const imoe_view *w, const imoe_view *offsets,
                                   const imoe_view *out, const imoe_exec *exec, imoe_error *err);

/* ---- the experts' tensor-core GEMM (cuda/imoe_experts_gemm.cu) ---------
 * imoe_experts_gemm on the device. The core has checked shapes, dtypes and
 * aliasing; the launcher refuses layouts its kernel does not read
 * (IMOE_ERR_UNSUPPORTED). Bad offsets or src are a recorded data error. */
imoe_status imoe_cuda_experts_gemm(const imoe_view *x, const imoe_view *src, const imoe_view *w,
                                   const imoe_view *offsets, int32_t gated, imoe_act act, const imoe_view *out,
                                   const imoe_exec *exec, imoe_error *err);

/* ---- the router (cuda/imoe_router.cu) ----------------------------------
 * imoe_topk_softmax on the device: one kernel, no data errors. */
imoe_status imoe_cuda_topk_softmax(const imoe_view *logits, int64_t k, int32_t renormalize,
                                   const imoe_view *out_weights, const imoe_view *out_indices,
                                   const imoe_exec *exec, imoe_error *err);

#ifdef __cplusplus
}
#endif

#endif /* IMOE_BACKEND_H */
