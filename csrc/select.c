/* select.c: the kept set of one row from its scores. Scores become
 * order-preserving uint32 keys; a radix select (radix.c) then finds the top
 * k in O(N), with no sort. */
#include <inttypes.h>

#include "imoe_internal.h"

/* Keys compare as unsigned integers in the order of the scores:
 *   - a sign-magnitude float becomes monotonic by flipping all bits of a
 *     negative value and setting the sign bit of a positive one;
 *   - -0.0 is made +0.0 first, so the two tie;
 *   - NaN gets 0, below -inf (whose key is 0x007fffff, or 0x03ff / 0x007f
 *     for the 16-bit formats): this is IMOE_NAN_LOWEST, and under
 *     IMOE_NAN_ERROR no NaN reaches this point.
 * F16 and BF16 keep 16-bit keys straight from their bits: widening to float
 * is exact and monotonic, so it would give the same order, at a cost. */
static inline uint32_t key_f32(uint32_t bits) {
  bits = bits == 0x80000000u ? 0 : bits;
  /* Written without branches so the contiguous loop vectorizes. */
  const uint32_t flip = (uint32_t)-(int32_t)(bits >> 31) | 0x80000000u;
  return (bits & 0x7fffffffu) > 0x7f800000u ? 0 : bits ^ flip;
}

static inline uint32_t key_16(uint32_t bits, uint32_t inf_bits) {
  bits = bits == 0x8000u ? 0 : bits;
  const uint32_t flip = ((uint32_t)-(int32_t)(bits >> 15) & 0xffffu) | 0x8000u;
  return (bits & 0x7fffu) > inf_bits ? 0 : bits ^ flip;
}

#define F16_INF 0x7c00u
#define BF16_INF 0x7f80u

static inline uint32_t load_u16(const char *p) {
  uint16_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline uint32_t load_u32(const char *p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* One loop per dtype, and a contiguous one apart, so that the conversion
 * inlines into a tight loop the compiler can vectorize. */
#define KEY_LOOP(size, load, key)                                              \
  do {                                                                         \
    if (stride == (size)) {                                                    \
      for (int64_t i = lo; i < hi; i++) keys[i] = key(load(row + i * (size))); \
    } else {                                                                   \
      for (int64_t i = lo; i < hi; i++) keys[i] = key(load(row + i * stride)); \
    }                                                                          \
  } while (0)

static inline uint32_t key_f16(uint32_t bits) { return key_16(bits, F16_INF); }
static inline uint32_t key_bf16(uint32_t bits) { return key_16(bits, BF16_INF); }

static void compute_keys(const imoe_view *scores, const char *row, int64_t lo, int64_t hi,
                         uint32_t *keys) {
  const int64_t stride = scores->n_stride;
  switch (scores->dtype) {
    case IMOE_DTYPE_F32:
      KEY_LOOP(4, load_u32, key_f32);
      break;
    case IMOE_DTYPE_F16:
      KEY_LOOP(2, load_u16, key_f16);
      break;
    default: /* BF16: the only other score dtype args.c lets through */
      KEY_LOOP(2, load_u16, key_bf16);
      break;
  }
}

/* First NaN in [0, n), or -1. */
static int64_t find_nan(const imoe_view *scores, const char *row) {
  const int64_t n = scores->n, stride = scores->n_stride;
  switch (scores->dtype) {
    case IMOE_DTYPE_F32:
      for (int64_t i = 0; i < n; i++) {
        if ((load_u32(row + i * stride) & 0x7fffffffu) > 0x7f800000u) return i;
      }
      return -1;
    case IMOE_DTYPE_F16:
      for (int64_t i = 0; i < n; i++) {
        if ((load_u16(row + i * stride) & 0x7fffu) > F16_INF) return i;
      }
      return -1;
    default:
      for (int64_t i = 0; i < n; i++) {
        if ((load_u16(row + i * stride) & 0x7fffu) > BF16_INF) return i;
      }
      return -1;
  }
}

imoe_status imoe_check_scores_row(const imoe_view *scores, int64_t row, imoe_error *err) {
  const int64_t slot = find_nan(scores, imoe_row_base(scores, row));
  if (slot < 0) return IMOE_OK;
  return imoe_fail(
      err, IMOE_ERR_NAN,
      "scores: row %" PRId64 ", slot %" PRId64 " is NaN (nan='raise'; nan='lowest' ranks NaN last)", row, slot);
}

void imoe_select_scores_row(const imoe_selection *sel, int64_t row, int64_t n,
                            imoe_row_workspace ws) {
  const int64_t c = sel->capacity, p = sel->protected_prefix, w = sel->recent_window;
  if (c >= n) {
    memset(ws.flags, 1, (size_t)n);
    return;
  }
  /* c < n and p + w <= c: prefix, middle and window are disjoint. */
  const int64_t lo = p, hi = n - w, k = c - p - w;
  memset(ws.flags, 1, (size_t)p);
  memset(ws.flags + hi, 1, (size_t)w);
  if (k == 0) {
    memset(ws.flags + lo, 0, (size_t)(hi - lo));
    return;
  }
  compute_keys(sel->scores, imoe_row_base(sel->scores, row), lo, hi, ws.keys);
  const int key_bits = sel->scores->dtype == IMOE_DTYPE_F32 ? 32 : 16;
  imoe_mark_top_k(ws.keys, lo, hi, k, key_bits, ws.hist, ws.list, ws.flags);
}

void imoe_score_keys(const imoe_view *scores, int64_t row, int64_t lo, int64_t hi,
                     uint32_t *keys) {
  compute_keys(scores, imoe_row_base(scores, row), lo, hi, keys);
}
