/* backend_none.c: the device backend of a build without CUDA.
 *
 * Linked instead of cuda/ when the package is built without nvcc.
 * imoe_check_exec refuses CUDA views before any launcher could be reached,
 * so these only keep the link complete; each answers IMOE_ERR_UNSUPPORTED. */
#include "imoe_backend.h"

/* Every launcher ignores its arguments. */
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wunused-parameter"
#endif

int imoe_backend_has_cuda(void) { return 0; }

int imoe_backend_device_count(void) { return 0; }

imoe_status imoe_cuda_build_map(const imoe_selection *sel, const imoe_view *out_indices,
                                const imoe_view *out_target_map, const imoe_exec *exec,
                                imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_compact(const imoe_view *buffers, int32_t num_buffers,
                              const imoe_selection *sel, const imoe_view *out_indices,
                              const imoe_view *out_target_map, imoe_mode mode,
                              const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_apply_indices(const imoe_view *buffers, int32_t num_buffers,
                                    const imoe_view *indices, imoe_mode mode, const imoe_exec *exec,
                                    imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_apply_target_map(const imoe_view *buffers, int32_t num_buffers,
                                       const imoe_view *target_map, imoe_mode mode,
                                       const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_read_device_status(const imoe_exec *exec, int32_t *status_out) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_paged_apply_target_map(const imoe_view *buffers, int32_t num_buffers,
                                             const imoe_view *block_tables,
                                             const imoe_view *target_map, imoe_mode mode,
                                             int32_t *workspace, int64_t workspace_elems,
                                             const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_permute(const imoe_view *buffers, int32_t num_buffers, const imoe_view *perm,
                              int32_t inverse, int32_t *workspace, int64_t workspace_elems,
                              const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_apply_ordered(const imoe_view *buffers, int32_t num_buffers,
                                    const imoe_view *indices, int32_t restore, int32_t *workspace,
                                    int64_t workspace_elems, const imoe_exec *exec,
                                    imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_compact_ordered(const imoe_view *buffers, int32_t num_buffers,
                                      const imoe_selection *sel, imoe_order order, imoe_mode mode,
                                      const imoe_view *out_indices, int32_t *workspace,
                                      int64_t workspace_elems, const imoe_exec *exec,
                                      imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_build_map_ordered(const imoe_selection *sel, imoe_order order, int64_t n,
                                        const imoe_view *out_indices, int32_t *workspace,
                                        int64_t workspace_elems, const imoe_exec *exec,
                                        imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_group_by_expert(const imoe_view *buffers, int32_t num_buffers,
                                      const imoe_view *expert_ids, int64_t num_experts,
                                      const imoe_view *out_offsets, const imoe_view *out_perm,
                                      int32_t *workspace, int64_t workspace_elems,
                                      const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_moe_dispatch(const imoe_moe_routing *routing, const imoe_view *hidden,
                                   int64_t rows, const imoe_view *out_rows,
                                   const imoe_view *out_offsets, const imoe_view *out_dest,
                                   const imoe_view *out_src, const imoe_view *out_dropped,
                                   int32_t *workspace, int64_t workspace_elems,
                                   const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_moe_combine(const imoe_view *rows, const imoe_view *dest,
                                  const imoe_view *weights, const imoe_view *out,
                                  const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_gated_act(const imoe_view *gate_up, const imoe_view *out, imoe_act act,
                                const imoe_view *limit, const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_grouped_gemm(const imoe_view *a, const imoe_view *w, const imoe_view *offsets,
                                   const imoe_view *out, const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_experts_gemm(const imoe_view *x, const imoe_view *src, const imoe_view *w,
                                   const imoe_view *offsets, int32_t gated, imoe_act act, const imoe_view *out,
                                   const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_topk_softmax(const imoe_view *logits, int64_t k, int32_t renormalize,
                                   const imoe_view *out_weights, const imoe_view *out_indices,
                                   const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_gated_act_backward(const imoe_view *gate_up, const imoe_view *grad_act, imoe_act act,
                                         const imoe_view *limit, const imoe_view *row_scale,
                                         const imoe_view *grad_gate_up, const imoe_view *act_out,
                                         const imoe_view *row_dot, const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_moe_gather_rows(const imoe_view *src, const imoe_view *dest, const imoe_view *weights,
                                      const imoe_view *out, const imoe_exec *exec, imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}

imoe_status imoe_cuda_moe_weight_grad(const imoe_view *a, int32_t a_by_row, const imoe_view *b,
                                      const imoe_view *dest, const imoe_view *out, const imoe_exec *exec,
                                      imoe_error *err) {
  return IMOE_ERR_UNSUPPORTED;
}
