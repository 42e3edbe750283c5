/* names.c: the options' names (imoe_option_name / imoe_option_from_name), the
 * one table every layer above the C API converts through, and the buffers'
 * names in messages (imoe_buffer_name). */
#include <stdio.h>
#include <string.h>

#include "imoe_internal.h"

typedef struct option_table {
  const char *what; /* the option, as the Python API names it */
  const char *names[4];
  int count;
} option_table;

/* Indexed by imoe_option; names[i] is the value i of the enum. */
static const option_table kTables[] = {
    {"mode", {"swap", "move"}, 2},
    {"order", {"inplace", "stable", "score"}, 3},
    {"nan", {"raise", "lowest"}, 2},
    {"kind", {"permute", "ordered", "group"}, 3},
    {"act", {"silu", "gelu", "gelu_tanh", "relu"}, 4},
    {"layout", {"grouped", "padded"}, 2},
    {"out_dtype", {"float32", "float16", "bfloat16"}, 3},
    {"index_dtype", {"int32", "int64"}, 2},
};

static const option_table *table_of(imoe_option option) {
  if ((int)option < 0 || (size_t)option >= sizeof kTables / sizeof kTables[0]) return NULL;
  return &kTables[option];
}

const char *imoe_option_name(imoe_option option, int value) {
  const option_table *t = table_of(option);
  if (t == NULL || value < 0 || value >= t->count) return NULL;
  return t->names[value];
}

imoe_status imoe_option_from_name(imoe_option option, const char *name, int *value,
                                  imoe_error *err) {
  const option_table *t = table_of(option);
  if (t == NULL) return imoe_fail(err, IMOE_ERR_ARGUMENT, "option %d is not an imoe_option", option);
  for (int i = 0; name != NULL && i < t->count; i++) {
    if (strcmp(name, t->names[i]) == 0) {
      *value = i;
      return IMOE_OK;
    }
  }
  char accepted[96] = "";
  size_t used = 0;
  for (int i = 0; i < t->count && used < sizeof accepted; i++) {
    used += (size_t)snprintf(accepted + used, sizeof accepted - used, "%s'%s'", i ? ", " : "",
                             t->names[i]);
  }
  return imoe_fail(err, IMOE_ERR_ARGUMENT, "%s must be one of %s, got '%.64s'", t->what, accepted,
                   name ? name : "(null)");
}

#define BUFFER_NAME(i) "buffers[" #i "]"
#define BUFFER_NAMES_OF(t)                                                              \
  BUFFER_NAME(t##0), BUFFER_NAME(t##1), BUFFER_NAME(t##2), BUFFER_NAME(t##3),           \
      BUFFER_NAME(t##4), BUFFER_NAME(t##5), BUFFER_NAME(t##6), BUFFER_NAME(t##7),       \
      BUFFER_NAME(t##8), BUFFER_NAME(t##9)

static const char *const kBufferNames[] = {
    BUFFER_NAME(0),     BUFFER_NAME(1),     BUFFER_NAME(2),     BUFFER_NAME(3),
    BUFFER_NAME(4),     BUFFER_NAME(5),     BUFFER_NAME(6),     BUFFER_NAME(7),
    BUFFER_NAME(8),     BUFFER_NAME(9),     BUFFER_NAMES_OF(1), BUFFER_NAMES_OF(2),
    BUFFER_NAMES_OF(3), BUFFER_NAMES_OF(4), BUFFER_NAMES_OF(5), BUFFER_NAME(60),
    BUFFER_NAME(61),    BUFFER_NAME(62),    BUFFER_NAME(63)};

_Static_assert(sizeof kBufferNames / sizeof kBufferNames[0] == IMOE_MAX_BUFFERS,
               "one name per buffer a call may take");

const char *imoe_buffer_name(int32_t b) {
  return b >= 0 && b < IMOE_MAX_BUFFERS ? kBufferNames[b] : NULL;
}
