/* parity.h: one end-to-end case run through the library and the reference
 * (ref.c), compared byte for byte. Shared by test_core.c and the fuzzer. */
#ifndef IMOE_TEST_PARITY_H
#define IMOE_TEST_PARITY_H

#include <stddef.h>
#include <stdint.h>

#include "idempotent_moe.h"

#define PARITY_MAX_BUFFERS 4

typedef struct parity_case {
  int32_t lead_ndim;
  int64_t lead_shape[3];
  int64_t n;
  /* Selection: scores (use_active 0) or active indices. */
  int use_active;
  imoe_dtype score_dtype;
  const uint8_t *score_bytes; /* element bits, used cyclically; NULL: zeros */
  size_t score_bytes_len;
  uint64_t score_noise; /* nonzero: seeds random low halves of the elements */
  int shared_active;
  imoe_dtype active_dtype;
  const int64_t *active_values; /* [rows or 1][capacity] */
  int64_t capacity, prefix, window;
  imoe_nan_policy nan_policy;
  imoe_mode mode;
  int32_t num_buffers;
  int64_t row_bytes[PARITY_MAX_BUFFERS];
  unsigned buffer_layout[PARITY_MAX_BUFFERS];
  unsigned score_layout, output_layout;
  imoe_dtype index_dtype;
  int with_target;
  int threads; /* < 0: exec NULL */
  uint64_t seed;
} parity_case;

/* A caller-given map applied to buffers (imoe_apply_indices, or
 * imoe_apply_target_map when is_target), valid or not. */
typedef struct map_case {
  int32_t lead_ndim;
  int64_t lead_shape[3];
  int64_t n;
  int64_t map_n; /* C' for indices, n for a target map */
  int is_target;
  imoe_dtype map_dtype;
  const int64_t *values; /* [rows][map_n] */
  imoe_mode mode;
  int64_t row_bytes;
  unsigned layout;
  int threads;
  uint64_t seed;
} map_case;

/* Both return the number of mismatches; the first is described in why. */
int parity_run(const parity_case *c, char *why, size_t why_size);
int parity_map_run(const map_case *c, char *why, size_t why_size);

#endif
