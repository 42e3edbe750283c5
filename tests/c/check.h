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

void test_status_paths(void);
void test_permute_all(void);

#endif
