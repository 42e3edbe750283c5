/* check.h: the few macros the C tests need; no framework. */
#ifndef IMOE_TEST_CHECK_H
#define IMOE_TEST_CHECK_H

#include <stdio.h>

extern int checks_passed, checks_failed;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (cond) {                                            \
      checks_passed++;                                     \
    } else {                                               \
      checks_failed++;                                     \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fputc('\n', stderr);                                 \
    }                                                      \
  } while (0)

/* A copy of *sel with the given order and num_slots, for one call: the
 * copies rotate through a few static slots, so a statement may hold several. */
#include "idempotent_moe.h"
static inline const imoe_selection *test_in_order(const imoe_selection *sel, imoe_order order,
                                                  int64_t num_slots) {
  static imoe_selection copies[4];
  static int next;
  imoe_selection *c = &copies[next++ % 4];
  *c = *sel;
  c->order = order;
  c->num_slots = num_slots;
  return c;
}

void test_status_paths(void);
void test_permute_all(void);
void test_moe_gemm_all(void);
void test_router_all(void);
void test_moe_shapes_all(void);
void test_experts_gemm_all(void);

#endif
