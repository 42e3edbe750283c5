/* fuzz_compact.c: libFuzzer target. Decodes a compaction case (shapes,
 * options, raw score bits, active indices), a caller-given map, or a case of
 * the permutation engine (a permutation, ordered indices or expert ids) from
 * the input, runs it through the library and the naive reference (parity.c,
 * perm_parity.c), and aborts on any mismatch of status, output or buffer
 * byte. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "parity.h"
#include "perm_parity.h"

typedef struct reader {
  const uint8_t *p;
  size_t left;
} reader;

/* Past the end every byte reads as 0, so any input decodes. */
static unsigned take(reader *r) {
  if (r->left == 0) return 0;
  r->left--;
  return *r->p++;
}

static int64_t take_n(reader *r) {
  const unsigned b = take(r);
  if (!(b & 0x80)) return (int64_t)(b % 65);
  const unsigned high = take(r);
  return (int64_t)((high << 8 | take(r)) % 3000);
}

static int32_t take_lead(reader *r, int64_t *shape, int64_t *rows) {
  const int32_t ndim = (int32_t)(take(r) % 4);
  *rows = 1;
  for (int32_t d = 0; d < ndim; d++) {
    const unsigned b = take(r);
    shape[d] = b == 0xff ? 0 : 1 + b % 3;
    *rows *= shape[d];
  }
  return ndim;
}

/* k distinct slots of [0, n) chosen by the input, then maybe one broken. */
static void take_subset(reader *r, int64_t n, int64_t k, int64_t *out) {
  int64_t *perm = malloc(sizeof *perm * (size_t)(n + 1));
  for (int64_t i = 0; i < n; i++) perm[i] = i;
  for (int64_t j = 0; j < k && j < n; j++) {
    const int64_t at = j + (int64_t)(take(r) % (unsigned)(n - j));
    const int64_t t = perm[j];
    perm[j] = perm[at];
    perm[at] = t;
    out[j] = perm[j];
  }
  for (int64_t j = n; j < k; j++) out[j] = j; /* k > n: out of range */
  const unsigned corrupt = take(r);
  if (k > 0 && corrupt >= 0xf0) {
    const int64_t at = (int64_t)(take(r) % (unsigned)k);
    const int64_t bad[] = {-1, n, out[(int64_t)(take(r) % (unsigned)k)], INT32_MAX,
                           (int64_t)1 << 33};
    out[at] = bad[corrupt % 5];
  }
  free(perm);
}

static void fail(const char *what, const char *why) {
  fprintf(stderr, "fuzz_compact: %s mismatch: %s\n", what, why);
  abort();
}

static void run_compaction(reader *r) {
  parity_case c;
  memset(&c, 0, sizeof c);
  int64_t rows;
  c.lead_ndim = take_lead(r, c.lead_shape, &rows);
  c.n = take_n(r);
  if (rows * c.n > 6000) c.n = 6000 / rows;
  const unsigned opts = take(r);
  c.use_active = (opts & 3) == 0;
  c.shared_active = (opts >> 2) & 1;
  c.nan_policy = (opts >> 3) & 1 ? IMOE_NAN_LOWEST : IMOE_NAN_ERROR;
  c.mode = (opts >> 4) & 1 ? IMOE_MODE_MOVE : IMOE_MODE_SWAP;
  c.index_dtype = (opts >> 5) & 1 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
  c.with_target = (opts >> 6) & 1;
  c.active_dtype = (opts >> 7) & 1 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
  const imoe_dtype score_dtypes[] = {IMOE_DTYPE_F32, IMOE_DTYPE_F16, IMOE_DTYPE_BF16};
  c.score_dtype = score_dtypes[take(r) % 3];
  c.capacity = (int64_t)(take(r) % (unsigned)(c.n + 3));
  if (!c.use_active) {
    c.prefix = (int64_t)(take(r) % (unsigned)(c.capacity + 1));
    c.window = (int64_t)(take(r) % (unsigned)(c.capacity - c.prefix + 1));
  }
  c.num_buffers = (int32_t)(1 + take(r) % 3);
  for (int32_t b = 0; b < c.num_buffers; b++) {
    const unsigned rb = take(r);
    c.row_bytes[b] = rb == 0xff ? 4099 : 1 + rb % 24;
    c.buffer_layout[b] = take(r) % 16;
  }
  c.score_layout = take(r) % 16;
  c.output_layout = take(r) % 16;
  c.threads = (int)(take(r) % 4) - 1;
  c.seed = take(r);
  const unsigned noise = take(r);
  c.score_noise = noise & 1 ? 0 : noise + 1;

  int64_t *active = NULL;
  if (c.use_active) {
    const int64_t arows = c.shared_active ? 1 : rows, k = c.capacity;
    active = malloc(sizeof *active * (size_t)(arows * k + 1));
    for (int64_t row = 0; row < arows; row++) take_subset(r, c.n, k, active + row * k);
    c.active_values = active;
  } else {
    c.score_bytes = r->p; /* the rest of the input: raw element bits */
    c.score_bytes_len = r->left;
  }
  char why[256] = "";
  if (parity_run(&c, why, sizeof why) != 0) fail("compaction", why);
  free(active);
}

static void run_map(reader *r) {
  map_case c;
  memset(&c, 0, sizeof c);
  int64_t rows;
  c.lead_ndim = take_lead(r, c.lead_shape, &rows);
  c.n = take_n(r) % 80;
  const int64_t kept = (int64_t)(take(r) % (unsigned)(c.n + 1));
  const unsigned opts = take(r);
  c.is_target = opts & 1;
  c.map_n = c.is_target ? c.n : kept;
  c.map_dtype = (opts >> 1) & 1 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
  c.mode = (opts >> 2) & 1 ? IMOE_MODE_MOVE : IMOE_MODE_SWAP;
  const int raw = (opts >> 3) & 1;
  c.row_bytes = 1 + take(r) % 20;
  c.layout = take(r) % 16;
  c.threads = (int)(take(r) % 4) - 1;
  c.seed = take(r);
  int64_t *values = malloc(sizeof *values * (size_t)(rows * c.map_n + 1));
  int64_t *chosen = malloc(sizeof *chosen * (size_t)(c.n + 1));
  uint8_t *flags = malloc((size_t)c.n + 1);
  int64_t *indices = malloc(sizeof *indices * (size_t)(c.n + 1));
  int64_t *target = malloc(sizeof *target * (size_t)(c.n + 1));
  for (int64_t row = 0; row < rows; row++) {
    if (raw) {
      /* Arbitrary entries: mostly invalid maps. */
      for (int64_t j = 0; j < c.map_n; j++) values[row * c.map_n + j] = (int8_t)take(r);
      continue;
    }
    take_subset(r, c.n, kept, chosen);
    memset(flags, 0, (size_t)c.n);
    int valid = 1;
    for (int64_t j = 0; j < kept; j++) {
      if (chosen[j] < 0 || chosen[j] >= c.n || flags[chosen[j]])
        valid = 0;
      else
        flags[chosen[j]] = 1;
    }
    if (!valid) {
      for (int64_t j = 0; j < c.map_n; j++)
        values[row * c.map_n + j] = chosen[j % (kept ? kept : 1)];
      continue;
    }
    /* The reference pairing, for a valid map to start from. */
    int64_t t = kept;
    for (int64_t x = 0; x < c.n; x++) target[x] = x;
    for (int64_t h = 0; h < kept; h++) {
      indices[h] = h;
      if (flags[h]) continue;
      while (!flags[t]) t++;
      indices[h] = t;
      target[h] = t;
      target[t] = h;
      t++;
    }
    memcpy(values + row * c.map_n, c.is_target ? target : indices,
           sizeof *values * (size_t)c.map_n);
  }
  c.values = values;
  char why[256] = "";
  if (parity_map_run(&c, why, sizeof why) != 0) fail("map", why);
  free(values);
  free(chosen);
  free(flags);
  free(indices);
  free(target);
}

static void run_perm(reader *r) {
  perm_case c;
  memset(&c, 0, sizeof c);
  int64_t rows;
  c.kind = (int)(take(r) % 4);
  c.lead_ndim = take_lead(r, c.lead_shape, &rows);
  c.n = take_n(r) % 160; /* the ordered reference is O(N^2) */
  if (rows * c.n > 3000) c.n = 3000 / rows;
  const unsigned opts = take(r);
  c.shared = c.kind != PC_GROUP && (opts & 1);
  c.map_dtype = (opts >> 1) & 1 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
  c.out_dtype = (opts >> 2) & 1 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
  c.inverse = (opts >> 3) & 1;
  c.mode = (opts >> 4) & 1 ? IMOE_MODE_MOVE : IMOE_MODE_SWAP;
  c.with_perm = (opts >> 5) & 1;
  c.workspace = (int)((opts >> 6) % 3);
  c.experts = (int64_t)(take(r) % 10);
  c.map_n = c.kind == PC_PERMUTE || c.kind == PC_GROUP ? c.n
                                                       : (int64_t)(take(r) % (unsigned)(c.n + 1));
  c.num_buffers = (int32_t)(1 + take(r) % 3);
  for (int32_t b = 0; b < c.num_buffers; b++) {
    const unsigned rb = take(r);
    c.row_bytes[b] = rb == 0xff ? 4099 : 1 + rb % 24;
    c.layout[b] = take(r) % 16;
  }
  c.map_layout = take(r) % 16;
  c.threads = (int)(take(r) % 4) - 1;
  c.seed = take(r);
  const int64_t mrows = c.shared ? 1 : rows;
  int64_t *values = malloc(sizeof *values * (size_t)(mrows * c.map_n + 1));
  for (int64_t row = 0; row < mrows; row++) {
    int64_t *v = values + row * c.map_n;
    if (c.kind == PC_GROUP) {
      /* experts itself (out of range) now and then */
      for (int64_t t = 0; t < c.n; t++) v[t] = (int64_t)(take(r) % (unsigned)(c.experts + 1));
    } else {
      take_subset(r, c.n, c.map_n, v); /* a permutation's prefix, maybe broken */
    }
  }
  c.values = values;
  char why[256] = "";
  if (perm_parity_run(&c, why, sizeof why) != 0) fail("permutation engine", why);
  free(values);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  reader r = {data, size};
  const unsigned which = take(&r) % 8;
  if (which < 2) {
    run_map(&r);
  } else if (which < 4) {
    run_perm(&r);
  } else {
    run_compaction(&r);
  }
  return 0;
}
