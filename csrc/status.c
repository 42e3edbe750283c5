/* status.c: names of the status codes, and what this build contains. */
#include "imoe_internal.h"

#include "imoe_backend.h"

const char *imoe_status_string(imoe_status status) {
  switch (status) {
    case IMOE_OK:
      return "IMOE_OK: success";
    case IMOE_ERR_ARGUMENT:
      return "IMOE_ERR_ARGUMENT: a shape, stride, size or option is invalid";
    case IMOE_ERR_DTYPE:
      return "IMOE_ERR_DTYPE: a view has a dtype the operation does not take";
    case IMOE_ERR_NAN:
      return "IMOE_ERR_NAN: a score is NaN and NaN scores are an error (nan='raise')";
    case IMOE_ERR_INDEX_RANGE:
      return "IMOE_ERR_INDEX_RANGE: an index lies outside [0, N)";
    case IMOE_ERR_INDEX_DUPLICATE:
      return "IMOE_ERR_INDEX_DUPLICATE: an index appears twice in one row";
    case IMOE_ERR_BAD_MAP:
      return "IMOE_ERR_BAD_MAP: indices / target_map is not an idempotent map";
    case IMOE_ERR_NO_MEMORY:
      return "IMOE_ERR_NO_MEMORY: host workspace could not be allocated";
    case IMOE_ERR_DEVICE:
      return "IMOE_ERR_DEVICE: the device runtime reported an error";
    case IMOE_ERR_UNSUPPORTED:
      return "IMOE_ERR_UNSUPPORTED: not built into this library";
  }
  return "IMOE_ERR_UNKNOWN: not an imoe_status value";
}

int imoe_cuda_compiled(void) {
  return imoe_backend_has_cuda();
}

int imoe_cuda_device_count(void) {
  return imoe_backend_device_count();
}

imoe_status imoe_take_device_status(const imoe_exec *exec, imoe_status *recorded,
                                    imoe_error *err) {
  if (recorded == NULL) return imoe_fail(err, IMOE_ERR_ARGUMENT, "recorded is NULL");
  *recorded = IMOE_OK;
  imoe_status status = imoe_check_exec(exec, err);
  if (status != IMOE_OK || exec == NULL || !imoe_on_cuda(exec)) return status;
  int32_t word = IMOE_OK;
  status = imoe_cuda_read_device_status(exec, &word);
  if (status != IMOE_OK) return imoe_fail(err, status, "reading the device status failed");
  *recorded = (imoe_status)word;
  return IMOE_OK;
}
