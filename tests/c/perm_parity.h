/* perm_parity.h: one permutation-engine case (imoe_permute, the ordered
 * apply / restore, imoe_group_by_expert) run through the library and a naive
 * reference, compared byte for byte: status, outputs, and every byte of the
 * buffers' allocations (unchanged on failure). Shared by test_permute.c and
 * the fuzzer. */
#ifndef IMOE_TEST_PERM_PARITY_H
#define IMOE_TEST_PERM_PARITY_H

#include <stddef.h>
#include <stdint.h>

#include "idempotent_moe.h"

#define PERM_MAX_BUFFERS 4

enum { PC_PERMUTE, PC_APPLY_ORDERED, PC_RESTORE_ORDERED, PC_GROUP };

typedef struct perm_case {
  int kind;
  int32_t lead_ndim;
  int64_t lead_shape[3];
  int64_t n;
  int shared; /* the map is one row for every row (not PC_GROUP) */
  imoe_dtype map_dtype;
  int64_t map_n;         /* N (perm, expert ids) or C' (ordered indices) */
  const int64_t *values; /* [shared ? 1 : rows][map_n], valid or not */
  int inverse;           /* PC_PERMUTE */
  imoe_mode mode;        /* PC_APPLY_ORDERED */
  int64_t experts;       /* PC_GROUP */
  imoe_dtype out_dtype;  /* PC_GROUP: offsets and perm */
  int with_perm;         /* PC_GROUP: out_perm given */
  int32_t num_buffers;
  int64_t row_bytes[PERM_MAX_BUFFERS];
  unsigned layout[PERM_MAX_BUFFERS];
  unsigned map_layout;
  int workspace; /* 0: NULL, 1: exactly the size needed, 2: one element short */
  int threads;   /* < 0: exec NULL */
  uint64_t seed;
} perm_case;

/* The number of mismatches; the first is described in why. */
int perm_parity_run(const perm_case *c, char *why, size_t why_size);

/* The status the library must return for the case's values. */
imoe_status perm_ref_status(const perm_case *c);

#endif
