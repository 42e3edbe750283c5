/* ref.h: a naive reference of idempotent-moe, written to be obviously right
 * rather than fast (full sorts, O(N^2) is fine). Shared by test_core.c and
 * fuzz_compact.c. */
#ifndef IMOE_TEST_REF_H
#define IMOE_TEST_REF_H

#include <stdint.h>

#include "idempotent_moe.h"

/* Exact widening of IEEE binary16 and bfloat16, by hand (no _Float16). */
float ref_half_to_float(uint16_t h);
float ref_bf16_to_float(uint16_t h);
/* The score at p (F32/F16/BF16) as a double; NaN stays NaN. */
double ref_score(const void *p, imoe_dtype dtype);

/* kept[0, n) for one row: prefix [0, p) and window [n - w, n) always; the
 * rest of c from [p, n - w) by full sort on (score desc, index asc), NaN
 * below everything, -0 == +0. c >= n keeps all. */
void ref_select(const double *scores, int64_t n, int64_t c, int64_t p, int64_t w, uint8_t *kept);

/* The pairing from kept flags (exactly min(c, n) set): indices [kept_count]
 * and target [n]. */
void ref_pairing(const uint8_t *kept, int64_t n, int64_t kept_count, int64_t *indices,
                 int64_t *target);

/* Validity of data, as the library must judge it (IMOE_OK or the status). */
imoe_status ref_active_status(const int64_t *active, int64_t k, int64_t n);
imoe_status ref_indices_status(const int64_t *indices, int64_t kept_count, int64_t n);
imoe_status ref_target_status(const int64_t *target, int64_t n);

/* Swap mode exchanges slot i with indices[i]; move mode copies indices[i]
 * into i. rows: n slots of row_bytes, contiguous. */
void ref_apply_indices(unsigned char *rows, int64_t row_bytes, const int64_t *indices,
                       int64_t kept_count, imoe_mode mode);

/* Swap mode exchanges each 2-cycle x < target[x]; move mode copies
 * target[x] into x. */
void ref_apply_target(unsigned char *rows, int64_t row_bytes, const int64_t *target, int64_t n,
                      imoe_mode mode);

#endif
