/* view.c: structural checks of imoe_view, row addressing, error messages. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>

#include "imoe_internal.h"

imoe_status imoe_fail(imoe_error *err, imoe_status status, const char *fmt, ...) {
  if (err != NULL) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
  }
  return status;
}

imoe_status imoe_fail_range(imoe_error *err, const char *name, int64_t row, int64_t pos,
                            int64_t value, int64_t n) {
  return imoe_fail(err, IMOE_ERR_INDEX_RANGE,
                   "%s: row %" PRId64 ", position %" PRId64 " holds %" PRId64
                   ", outside [0, %" PRId64 ")",
                   name, row, pos, value, n);
}

imoe_status imoe_fail_repeat(imoe_error *err, imoe_status status, const char *name, int64_t row,
                             int64_t pos, int64_t slot) {
  return imoe_fail(err, status, "%s: row %" PRId64 ", position %" PRId64 " repeats slot %" PRId64,
                   name, row, pos, slot);
}

static int64_t dtype_size(imoe_dtype dtype) {
  switch (dtype) {
    case IMOE_DTYPE_BYTES:
      return 1;
    case IMOE_DTYPE_F16:
    case IMOE_DTYPE_BF16:
      return 2;
    case IMOE_DTYPE_F32:
    case IMOE_DTYPE_I32:
      return 4;
    case IMOE_DTYPE_I64:
      return 8;
  }
  return 0;
}

static const char *dtype_name(imoe_dtype dtype) {
  switch (dtype) {
    case IMOE_DTYPE_BYTES:
      return "BYTES";
    case IMOE_DTYPE_F32:
      return "F32";
    case IMOE_DTYPE_F16:
      return "F16";
    case IMOE_DTYPE_BF16:
      return "BF16";
    case IMOE_DTYPE_I32:
      return "I32";
    case IMOE_DTYPE_I64:
      return "I64";
  }
  return "?";
}

/* a * b + c for non-negative operands; 0 on int64 overflow. Keeps every
 * later address computation (offset of row r, slot i) free of overflow. */
static int checked_mul_add(int64_t a, int64_t b, int64_t c, int64_t *out) {
  if (a != 0 && b > (INT64_MAX - c) / a) return 0;
  *out = a * b + c;
  return 1;
}

static int checked_abs(int64_t x, int64_t *out) {
  if (x == INT64_MIN) return 0;
  *out = x < 0 ? -x : x;
  return 1;
}

/* Elements and byte extent must fit in int64; an empty view has neither. */
static imoe_status check_extent(const imoe_view *v, const char *name, imoe_error *err) {
  int64_t rows = 1;
  int64_t extent = v->row_bytes;
  int empty = v->n == 0;
  for (int32_t d = 0; d < v->lead_ndim; d++) {
    if (v->lead_shape[d] == 0) empty = 1;
  }
  if (empty) return IMOE_OK;
  for (int32_t d = 0; d < v->lead_ndim; d++) {
    int64_t stride;
    if (!checked_mul_add(rows, v->lead_shape[d], 0, &rows) ||
        !checked_abs(v->lead_stride[d], &stride) ||
        !checked_mul_add(stride, v->lead_shape[d] - 1, extent, &extent)) {
      return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s: lead axis %d overflows int64 bytes", name,
                       (int)d);
    }
  }
  int64_t stride, elements;
  if (!checked_abs(v->n_stride, &stride) || !checked_mul_add(stride, v->n - 1, extent, &extent) ||
      !checked_mul_add(rows, v->n, 0, &elements)) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s: n axis overflows int64 bytes", name);
  }
  if (v->data == NULL) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "%s: data is NULL but the view has %" PRId64 " elements", name, elements);
  }
  return IMOE_OK;
}

imoe_status imoe_check_view(const imoe_view *v, const char *name, imoe_error *err) {
  if (v == NULL) return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s is NULL", name);
  if (v->lead_ndim < 0 || v->lead_ndim > IMOE_MAX_LEAD_DIMS) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s: lead_ndim %d is outside [0, %d]", name,
                     (int)v->lead_ndim, IMOE_MAX_LEAD_DIMS);
  }
  for (int32_t d = 0; d < v->lead_ndim; d++) {
    if (v->lead_shape[d] < 0) {
      return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s: lead_shape[%d] is negative (%" PRId64 ")", name,
                       (int)d, v->lead_shape[d]);
    }
  }
  if (v->n < 0) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s: n is negative (%" PRId64 ")", name, v->n);
  }
  if (v->n > IMOE_MAX_SLOTS) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s: n = %" PRId64 " exceeds %" PRId64 " slots", name,
                     v->n, (int64_t)IMOE_MAX_SLOTS);
  }
  if (v->row_bytes <= 0) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s: row_bytes must be > 0 (got %" PRId64 ")", name,
                     v->row_bytes);
  }
  if (dtype_size(v->dtype) == 0) {
    return imoe_fail(err, IMOE_ERR_DTYPE, "%s: dtype %d is not an imoe_dtype", name, (int)v->dtype);
  }
  return check_extent(v, name, err);
}

imoe_status imoe_check_typed(const imoe_view *v, const char *name, unsigned dtype_mask,
                             imoe_error *err) {
  if ((dtype_mask & IMOE_DTYPE_BIT(v->dtype)) == 0) {
    char allowed[64] = "";
    size_t used = 0;
    for (int d = IMOE_DTYPE_BYTES; d <= IMOE_DTYPE_I64; d++) {
      if (dtype_mask & IMOE_DTYPE_BIT(d)) {
        used += (size_t)snprintf(allowed + used, sizeof allowed - used, "%s%s", used ? "/" : "",
                                 dtype_name((imoe_dtype)d));
      }
    }
    return imoe_fail(err, IMOE_ERR_DTYPE, "%s: dtype %s is not accepted here (takes %s)", name,
                     dtype_name(v->dtype), allowed);
  }
  if (v->row_bytes != dtype_size(v->dtype)) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "%s: row_bytes %" PRId64 " must equal the %s element size %" PRId64, name,
                     v->row_bytes, dtype_name(v->dtype), dtype_size(v->dtype));
  }
  return IMOE_OK;
}

static void format_lead(const imoe_view *v, char *out, size_t size) {
  size_t used = (size_t)snprintf(out, size, "[");
  for (int32_t d = 0; d < v->lead_ndim && used < size; d++) {
    used +=
        (size_t)snprintf(out + used, size - used, "%s%" PRId64, d ? ", " : "", v->lead_shape[d]);
  }
  if (used < size) snprintf(out + used, size - used, "]");
}

imoe_status imoe_check_same_lead(const imoe_view *v, const char *name, const imoe_view *ref,
                                 const char *ref_name, imoe_error *err) {
  int same = v->lead_ndim == ref->lead_ndim;
  for (int32_t d = 0; same && d < v->lead_ndim; d++) same = v->lead_shape[d] == ref->lead_shape[d];
  if (same) return IMOE_OK;
  char a[96], b[96];
  format_lead(v, a, sizeof a);
  format_lead(ref, b, sizeof b);
  return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s: lead shape %s does not match %s lead shape %s",
                   name, a, ref_name, b);
}

int64_t imoe_view_rows(const imoe_view *v) {
  /* A zero extent first: the product of the others may not fit in int64. */
  for (int32_t d = 0; d < v->lead_ndim; d++)
    if (v->lead_shape[d] == 0) return 0;
  int64_t rows = 1;
  for (int32_t d = 0; d < v->lead_ndim; d++) rows *= v->lead_shape[d];
  return rows;
}

int64_t imoe_row_offset(const imoe_view *v, int64_t r) {
  int64_t offset = 0;
  for (int32_t d = v->lead_ndim - 1; d >= 0; d--) {
    const int64_t extent = v->lead_shape[d];
    offset += (r % extent) * v->lead_stride[d];
    r /= extent;
  }
  return offset;
}
