/* tensor.h: strided test tensors [lead..., n, row] over one allocation,
 * with layouts that exercise the view contract (padding, negative strides,
 * lead axes stored in reverse order). Shared by the tests and the fuzzer. */
#ifndef IMOE_TEST_TENSOR_H
#define IMOE_TEST_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "idempotent_moe.h"

enum {
  T_PAD = 1,          /* gaps between slots and between rows */
  T_NEG_SLOTS = 2,    /* negative n_stride */
  T_NEG_LEAD = 4,     /* negative stride on lead axis 0 */
  T_LEAD_REVERSED = 8 /* lead axis 0 innermost in memory */
};

typedef struct tensor {
  unsigned char *alloc; /* every byte the view may reach, plus guards */
  size_t bytes;
  imoe_view view;
} tensor;

/* Fills every byte (view and gaps) from *seed, so untouched bytes can be
 * compared afterwards. */
tensor tensor_make(int32_t lead_ndim, const int64_t *lead_shape, int64_t n, int64_t row_bytes,
                   imoe_dtype dtype, unsigned layout, uint64_t *seed);
void tensor_free(tensor *t);
int64_t tensor_rows(const tensor *t);
unsigned char *tensor_at(const tensor *t, int64_t row, int64_t slot);
/* A copy of the whole allocation, to compare with memcmp. */
unsigned char *tensor_snapshot(const tensor *t);
int tensor_same(const tensor *t, const unsigned char *snapshot);
/* An index element (I32 or I64) at p, written or read. */
void tensor_put_index(unsigned char *p, imoe_dtype dtype, int64_t value);
int64_t tensor_get_index(const unsigned char *p, imoe_dtype dtype);

uint64_t rng_next(uint64_t *state);
/* Uniform in [lo, hi]. */
int64_t rng_range(uint64_t *state, int64_t lo, int64_t hi);

#endif
