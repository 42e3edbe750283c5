/* ref.c: see ref.h. */
#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

float ref_half_to_float(uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float value;
  if (exponent == 0) {
    value = ldexpf((float)mantissa, -24); /* subnormal (and zero) */
  } else if (exponent == 31) {
    value = mantissa ? NAN : INFINITY;
  } else {
    value = ldexpf((float)(mantissa | 0x400), exponent - 25);
  }
  return sign ? -value : value;
}

float ref_bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

double ref_score(const void *p, imoe_dtype dtype) {
  uint16_t h;
  float f;
  switch (dtype) {
    case IMOE_DTYPE_F32:
      memcpy(&f, p, sizeof f);
      return f;
    case IMOE_DTYPE_F16:
      memcpy(&h, p, sizeof h);
      return ref_half_to_float(h);
    case IMOE_DTYPE_BF16:
      memcpy(&h, p, sizeof h);
      return ref_bf16_to_float(h);
    default:
      abort();
  }
}

typedef struct ranked {
  double score;
  int64_t index;
} ranked;

static int by_score_desc(const void *pa, const void *pb) {
  const ranked *a = pa, *b = pb;
  const int na = isnan(a->score), nb = isnan(b->score);
  if (na != nb) return na ? 1 : -1; /* NaN ranks lowest */
  if (!na && a->score != b->score) return a->score > b->score ? -1 : 1;
  return a->index < b->index ? -1 : a->index > b->index;
}

void ref_select(const double *scores, int64_t n, int64_t c, int64_t p, int64_t w, uint8_t *kept) {
  if (c >= n) {
    memset(kept, 1, (size_t)n);
    return;
  }
  memset(kept, 0, (size_t)n);
  for (int64_t i = 0; i < p; i++) kept[i] = 1;
  for (int64_t i = n - w; i < n; i++) kept[i] = 1;
  const int64_t m = n - p - w;
  ranked *order = malloc(sizeof *order * (size_t)(m + 1));
  for (int64_t i = 0; i < m; i++) order[i] = (ranked){scores[p + i], p + i};
  qsort(order, (size_t)m, sizeof *order, by_score_desc);
  for (int64_t j = 0; j < c - p - w; j++) kept[order[j].index] = 1;
  free(order);
}

void ref_pairing(const uint8_t *kept, int64_t n, int64_t kept_count, int64_t *indices,
                 int64_t *target) {
  int64_t *holes = malloc(sizeof *holes * (size_t)(n + 1));
  int64_t *tails = malloc(sizeof *tails * (size_t)(n + 1));
  int64_t num_holes = 0, num_tails = 0;
  for (int64_t i = 0; i < kept_count; i++) {
    if (!kept[i]) holes[num_holes++] = i;
  }
  for (int64_t i = kept_count; i < n; i++) {
    if (kept[i]) tails[num_tails++] = i;
  }
  if (num_holes != num_tails) abort();
  for (int64_t i = 0; i < n; i++) target[i] = i;
  for (int64_t i = 0; i < kept_count; i++) indices[i] = i;
  for (int64_t j = 0; j < num_holes; j++) {
    indices[holes[j]] = tails[j];
    target[holes[j]] = tails[j];
    target[tails[j]] = holes[j];
  }
  free(holes);
  free(tails);
}

imoe_status ref_active_status(const int64_t *active, int64_t k, int64_t n) {
  for (int64_t j = 0; j < k; j++) {
    if (active[j] < 0 || active[j] >= n) return IMOE_ERR_INDEX_RANGE;
    for (int64_t i = 0; i < j; i++) {
      if (active[i] == active[j]) return IMOE_ERR_INDEX_DUPLICATE;
    }
  }
  return IMOE_OK;
}

imoe_status ref_indices_status(const int64_t *indices, int64_t kept_count, int64_t n) {
  for (int64_t i = 0; i < kept_count; i++) {
    const int64_t e = indices[i];
    if (e == i) continue;
    if (e < 0 || e >= n) return IMOE_ERR_INDEX_RANGE;
    if (e < kept_count) return IMOE_ERR_BAD_MAP;
    for (int64_t j = 0; j < i; j++) {
      if (indices[j] == e) return IMOE_ERR_BAD_MAP;
    }
  }
  return IMOE_OK;
}

imoe_status ref_target_status(const int64_t *target, int64_t n) {
  for (int64_t x = 0; x < n; x++) {
    if (target[x] < 0 || target[x] >= n) return IMOE_ERR_INDEX_RANGE;
  }
  for (int64_t x = 0; x < n; x++) {
    if (target[target[x]] != x) return IMOE_ERR_BAD_MAP;
  }
  return IMOE_OK;
}

void ref_apply_indices(unsigned char *rows, int64_t row_bytes, const int64_t *indices,
                       int64_t kept_count, imoe_mode mode) {
  unsigned char *tmp = malloc((size_t)row_bytes);
  for (int64_t i = 0; i < kept_count; i++) {
    const int64_t s = indices[i];
    if (s == i) continue;
    unsigned char *a = rows + i * row_bytes, *b = rows + s * row_bytes;
    memcpy(tmp, a, (size_t)row_bytes);
    memcpy(a, b, (size_t)row_bytes);
    if (mode == IMOE_MODE_SWAP) memcpy(b, tmp, (size_t)row_bytes);
  }
  free(tmp);
}

void ref_apply_target(unsigned char *rows, int64_t row_bytes, const int64_t *target, int64_t n,
                      imoe_mode mode) {
  unsigned char *tmp = malloc((size_t)row_bytes);
  for (int64_t x = 0; x < n; x++) {
    const int64_t t = target[x];
    if (t <= x) continue;
    unsigned char *a = rows + x * row_bytes, *b = rows + t * row_bytes;
    memcpy(tmp, a, (size_t)row_bytes);
    memcpy(a, b, (size_t)row_bytes);
    if (mode == IMOE_MODE_SWAP) memcpy(b, tmp, (size_t)row_bytes);
  }
  free(tmp);
}
