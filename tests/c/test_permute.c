/* test_permute.c: the permutation engine (imoe_permute, the ordered apply /
 * restore, imoe_group_by_expert) against the reference of perm_parity.c,
 * and ordered compaction (imoe_compact_ordered, imoe_build_map_ordered)
 * against ref_select + a sort. Fixed seeds. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "idempotent_moe.h"
#include "perm_parity.h"
#include "ref.h"
#include "tensor.h"

static void shuffle(uint64_t *rng, int64_t *a, int64_t n) {
  for (int64_t i = n - 1; i > 0; i--) {
    const int64_t j = rng_range(rng, 0, i);
    const int64_t t = a[i];
    a[i] = a[j];
    a[j] = t;
  }
}

/* A structured or random permutation of [0, n) into p. */
static void random_perm(uint64_t *rng, int64_t n, int64_t *p) {
  const int kind = (int)(rng_next(rng) % 5);
  const int64_t shift = n > 0 ? rng_range(rng, 0, n - 1) : 0;
  for (int64_t i = 0; i < n; i++) {
    switch (kind) {
      case 0: p[i] = i; break;                   /* identity */
      case 1: p[i] = (i + shift) % n; break;     /* rotation: one long cycle */
      case 2: p[i] = n - 1 - i; break;           /* reversal: 2-cycles */
      default: p[i] = i; break;
    }
  }
  if (kind >= 3) shuffle(rng, p, n);
}

/* Breaks one entry of a row sometimes: out of range or a repeat. */
static void maybe_corrupt(uint64_t *rng, int64_t *vals, int64_t k, int64_t n, int rate) {
  if (k == 0 || (int)(rng_next(rng) % 100) >= rate) return;
  const int64_t at = rng_range(rng, 0, k - 1);
  switch (rng_next(rng) % 5) {
    case 0: vals[at] = -1; break;
    case 1: vals[at] = n; break;
    case 2: vals[at] = (int64_t)1 << 33; break; /* an I32 map reads 0 */
    case 3: vals[at] = INT64_MIN; break;
    default: vals[at] = vals[rng_range(rng, 0, k - 1)]; break; /* maybe a repeat */
  }
}

static const int64_t row_sizes[] = {1, 2, 3, 4, 8, 16, 24, 32, 64, 100, 128, 1000, 4100, 9000};

static void random_engine_case(uint64_t *rng, perm_case *c, int64_t **values) {
  memset(c, 0, sizeof *c);
  c->kind = (int)(rng_next(rng) % 4);
  c->lead_ndim = (int32_t)(rng_next(rng) % 3);
  int64_t rows = 1;
  for (int32_t d = 0; d < c->lead_ndim; d++) {
    c->lead_shape[d] = rng_range(rng, 0, 3);
    if (rng_next(rng) % 8 != 0 && c->lead_shape[d] == 0) c->lead_shape[d] = 2;
    rows *= c->lead_shape[d];
  }
  switch (rng_next(rng) % 6) {
    case 0: c->n = rng_range(rng, 0, 2); break;
    case 1: c->n = rng_range(rng, 200, 1500); break;
    default: c->n = rng_range(rng, 3, 40); break;
  }
  c->shared = c->kind != PC_GROUP && rng_next(rng) % 3 == 0;
  c->map_dtype = rng_next(rng) % 2 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
  c->out_dtype = rng_next(rng) % 2 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
  c->inverse = (int)(rng_next(rng) % 2);
  c->mode = rng_next(rng) % 2 ? IMOE_MODE_MOVE : IMOE_MODE_SWAP;
  c->experts = rng_range(rng, 0, 9);
  c->with_perm = (int)(rng_next(rng) % 2);
  c->map_n = c->kind == PC_PERMUTE || c->kind == PC_GROUP ? c->n : rng_range(rng, 0, c->n);
  c->num_buffers = (int32_t)rng_range(rng, 1, PERM_MAX_BUFFERS);
  for (int32_t b = 0; b < c->num_buffers; b++) {
    c->row_bytes[b] = row_sizes[rng_next(rng) % (sizeof row_sizes / sizeof row_sizes[0])];
    if (c->n > 300 && c->row_bytes[b] > 128) c->row_bytes[b] = 24;
    c->layout[b] = (unsigned)(rng_next(rng) % 16);
  }
  c->map_layout = (unsigned)(rng_next(rng) % 16);
  c->workspace = (int)(rng_next(rng) % 4 == 0 ? 2 : rng_next(rng) % 2);
  if (c->workspace == 2 && rng_next(rng) % 2) c->workspace = 1;
  c->threads = (int)rng_range(rng, -1, 4);
  c->seed = rng_next(rng);
  const int64_t mrows = c->shared ? 1 : rows;
  int64_t *vals = malloc(sizeof *vals * (size_t)(mrows * c->map_n + c->n + 1));
  int64_t *p = malloc(sizeof *p * (size_t)(c->n + 1));
  for (int64_t r = 0; r < mrows; r++) {
    int64_t *row = vals + r * c->map_n;
    if (c->kind == PC_GROUP) {
      for (int64_t t = 0; t < c->n; t++) row[t] = c->experts ? rng_range(rng, 0, c->experts - 1) : 0;
      if (c->experts > 2 && rng_next(rng) % 2) { /* skewed: most tokens to one expert */
        for (int64_t t = 0; t < c->n; t++) row[t] = rng_next(rng) % 4 ? 1 : row[t];
      }
    } else {
      random_perm(rng, c->n, p);
      memcpy(row, p, sizeof *p * (size_t)c->map_n); /* ordered: the first C' of a permutation */
    }
    /* Errors in the last row, so rows before it must stay untouched. */
    maybe_corrupt(rng, row, c->map_n, c->kind == PC_GROUP ? c->experts : c->n,
                  r == mrows - 1 ? 20 : 3);
  }
  free(p);
  c->values = vals;
  *values = vals;
}

static void test_engine_parity(uint64_t seed, int cases) {
  uint64_t rng = seed;
  int failures = 0;
  for (int i = 0; i < cases; i++) {
    perm_case c;
    int64_t *values;
    random_engine_case(&rng, &c, &values);
    char why[256] = "";
    const int bad = perm_parity_run(&c, why, sizeof why);
    if (bad && failures++ < 10) {
      CHECK(0, "engine case %d (kind %d, n %lld, map_n %lld, shared %d, inverse %d): %s", i,
            c.kind, (long long)c.n, (long long)c.map_n, c.shared, c.inverse, why);
    } else if (!bad) {
      CHECK(1, "engine case");
    }
    free(values);
  }
}

/* ---- plans -------------------------------------------------------------- */

static void test_plan_checks(void) {
  /* A permutation passes; a repeat does not, wherever it is. */
  const int64_t good[] = {3, 0, 4, 1, 2, 5};
  const int64_t dup[][4] = {{0, 0, 1, 2}, {1, 2, 3, 3}, {1, 1, 1, 1}, {3, 3, 0, 1}};
  int64_t p[6];
  memcpy(p, good, sizeof good);
  perm_case c;
  memset(&c, 0, sizeof c);
  c.kind = PC_PERMUTE;
  c.n = c.map_n = 6;
  c.values = p;
  c.map_dtype = IMOE_DTYPE_I64;
  c.num_buffers = 1;
  c.row_bytes[0] = 5;
  c.threads = 1;
  char why[256] = "";
  CHECK(perm_parity_run(&c, why, sizeof why) == 0, "good perm: %s", why);
  c.n = c.map_n = 4;
  for (int k = 0; k < 4; k++) {
    c.values = dup[k];
    CHECK(perm_ref_status(&c) == IMOE_ERR_BAD_MAP, "reference sees the repeat %d", k);
    CHECK(perm_parity_run(&c, why, sizeof why) == 0, "repeat %d: %s", k, why);
  }
}

/* A message names the positions of a repeat. */
static void test_messages(void) {
  char buf[10 * 4];
  int64_t perm[10] = {0, 1, 2, 3, 4, 5, 6, 7, 4, 9};
  imoe_view b;
  memset(&b, 0, sizeof b);
  b.data = buf;
  b.n = 10;
  b.n_stride = 4;
  b.row_bytes = 4;
  imoe_view p = b;
  p.data = perm;
  p.n_stride = 8;
  p.row_bytes = 8;
  p.dtype = IMOE_DTYPE_I64;
  imoe_error err;
  memset(&err, 0, sizeof err);
  for (int inverse = 0; inverse < 2; inverse++) {
    imoe_status st = imoe_permute(&b, 1, &p, inverse, NULL, 0, NULL, &err);
    CHECK(st == IMOE_ERR_BAD_MAP, "repeat: status %d", (int)st);
    CHECK(strstr(err.message, "positions 4 and 8") != NULL, "message: %s", err.message);
  }
  perm[3] = 10;
  imoe_status st = imoe_permute(&b, 1, &p, 0, NULL, 0, NULL, &err);
  CHECK(st == IMOE_ERR_INDEX_RANGE, "range wins over repeat: %d", (int)st);
  CHECK(strstr(err.message, "position 3 holds 10") != NULL, "message: %s", err.message);
  const imoe_exec cuda = {IMOE_DEVICE_CUDA, 0, 0, NULL};
  perm[3] = 3;
  perm[8] = 8;
  st = imoe_permute(&b, 1, &p, 0, NULL, 0, &cuda, &err);
  CHECK(st == IMOE_ERR_UNSUPPORTED, "CUDA: %d", (int)st);
  int32_t small[9];
  st = imoe_permute(&b, 1, &p, 0, small, 9, NULL, &err);
  CHECK(st == IMOE_ERR_ARGUMENT && strstr(err.message, "workspace") != NULL, "short workspace: %s",
        err.message);
}

/* ---- ordered compaction ------------------------------------------------- */

typedef struct scored {
  double score;
  int64_t index;
} scored;

static int by_score(const void *pa, const void *pb) {
  const scored *a = pa, *b = pb;
  const int na = isnan(a->score), nb = isnan(b->score);
  if (na != nb) return na ? 1 : -1;
  if (!na && a->score != b->score) return a->score > b->score ? -1 : 1;
  return a->index < b->index ? -1 : a->index > b->index;
}

/* Expected indices [kept] of one row: ref_select's kept set in order. */
static void ref_order(const double *s, int64_t n, int64_t c, int64_t p, int64_t w,
                      imoe_order order, int64_t *out) {
  uint8_t *kept = malloc((size_t)n + 1);
  scored *list = malloc(sizeof *list * (size_t)(n + 1));
  ref_select(s, n, c, p, w, kept);
  int64_t k = 0;
  for (int64_t x = 0; x < n; x++) {
    if (kept[x]) list[k++] = (scored){s[x], x};
  }
  if (order == IMOE_ORDER_SCORE) qsort(list, (size_t)k, sizeof *list, by_score);
  for (int64_t i = 0; i < k; i++) out[i] = list[i].index;
  free(kept);
  free(list);
}

static const uint16_t tie16[] = {0x0000, 0x8000, 0x3c00, 0x3c00, 0xbc00, 0x4000, 0x7c00, 0xfc00};

static void random_scores(uint64_t *rng, imoe_dtype dtype, tensor *t, int nan) {
  const int64_t rows = tensor_rows(t);
  const int ties = (int)(rng_next(rng) % 2);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t x = 0; x < t->view.n; x++) {
      unsigned char *at = tensor_at(t, r, x);
      if (dtype == IMOE_DTYPE_F32) {
        float v = ties ? (float)(rng_next(rng) % 5) - 2.0f : (float)rng_range(rng, -1000, 1000) / 7;
        if (ties && rng_next(rng) % 9 == 0) v = -0.0f;
        if (nan && rng_next(rng) % 7 == 0) v = NAN;
        memcpy(at, &v, 4);
      } else {
        /* F16 bits of ties; as BF16 they are other, still tied, values. */
        uint16_t h = ties ? tie16[rng_next(rng) % 8] : (uint16_t)(rng_next(rng) & 0x7bff);
        if (nan && rng_next(rng) % 7 == 0) h = 0x7fff;
        memcpy(at, &h, 2);
      }
    }
  }
}

static void test_compact_ordered(uint64_t seed, int cases) {
  uint64_t rng = seed;
  int failures = 0;
  for (int i = 0; i < cases; i++) {
    const int32_t lead_ndim = (int32_t)(rng_next(&rng) % 3);
    int64_t lead[2] = {rng_range(&rng, 1, 3), rng_range(&rng, 1, 2)};
    const int64_t n = rng_next(&rng) % 5 == 0 ? rng_range(&rng, 300, 900) : rng_range(&rng, 0, 40);
    const imoe_dtype dtypes[] = {IMOE_DTYPE_F32, IMOE_DTYPE_F16, IMOE_DTYPE_BF16};
    const imoe_dtype sd = dtypes[rng_next(&rng) % 3];
    const imoe_order order = rng_next(&rng) % 2 ? IMOE_ORDER_SCORE : IMOE_ORDER_STABLE;
    const imoe_mode mode = rng_next(&rng) % 2 ? IMOE_MODE_MOVE : IMOE_MODE_SWAP;
    const int nan = rng_next(&rng) % 3 == 0;
    const imoe_nan_policy policy = rng_next(&rng) % 2 ? IMOE_NAN_LOWEST : IMOE_NAN_ERROR;
    const int64_t cap = rng_range(&rng, 0, n + 2), kept = cap < n ? cap : n;
    const int64_t pre = rng_range(&rng, 0, cap), win = rng_range(&rng, 0, cap - pre);
    const int64_t rb = row_sizes[rng_next(&rng) % 10];
    const imoe_dtype idt = rng_next(&rng) % 2 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
    const int64_t ielem = idt == IMOE_DTYPE_I32 ? 4 : 8, selem = sd == IMOE_DTYPE_F32 ? 4 : 2;
    uint64_t tseed = rng_next(&rng);
    tensor buf = tensor_make(lead_ndim, lead, n, rb, IMOE_DTYPE_BYTES,
                             (unsigned)(rng_next(&rng) % 16), &tseed);
    tensor sc = tensor_make(lead_ndim, lead, n, selem, sd, (unsigned)(rng_next(&rng) % 16), &tseed);
    tensor idx = tensor_make(lead_ndim, lead, kept, ielem, idt, (unsigned)(rng_next(&rng) % 16),
                             &tseed);
    tensor idx2 = tensor_make(lead_ndim, lead, kept, ielem, idt, 0, &tseed);
    random_scores(&rng, sd, &sc, nan);
    unsigned char *before = tensor_snapshot(&buf), *idx_before = tensor_snapshot(&idx);
    const imoe_selection sel = {&sc.view, NULL, cap, pre, win, policy};
    const imoe_exec exec = {IMOE_DEVICE_CPU, 0, (int32_t)rng_range(&rng, 1, 4), NULL};
    imoe_error err;
    memset(&err, 0, sizeof err);
    const imoe_status st = imoe_compact(&buf.view, 1, test_in_order(&sel, order, 0), &idx.view, NULL, mode, NULL, 0, &exec, &err);
    const int64_t rows = tensor_rows(&buf);
    double *s = malloc(sizeof *s * (size_t)(n + 1));
    int64_t *want = malloc(sizeof *want * (size_t)(n + 1));
    uint8_t *listed = malloc((size_t)n + 1);
    int any_nan = 0;
    for (int64_t r = 0; r < rows; r++) {
      for (int64_t x = 0; x < n; x++) any_nan |= isnan(ref_score(tensor_at(&sc, r, x), sd));
    }
    const imoe_status want_st = any_nan && policy == IMOE_NAN_ERROR ? IMOE_ERR_NAN : IMOE_OK;
    int bad = st != want_st;
    if (st != IMOE_OK) {
      bad |= !tensor_same(&buf, before) || !tensor_same(&idx, idx_before);
    } else {
      for (int64_t r = 0; r < rows && !bad; r++) {
        for (int64_t x = 0; x < n; x++) s[x] = ref_score(tensor_at(&sc, r, x), sd);
        ref_order(s, n, cap, pre, win, order, want);
        memset(listed, 0, (size_t)n + 1);
        for (int64_t j = 0; j < kept; j++) {
          int64_t got;
          if (idt == IMOE_DTYPE_I32) {
            int32_t v;
            memcpy(&v, tensor_at(&idx, r, j), 4);
            got = v;
          } else {
            memcpy(&got, tensor_at(&idx, r, j), 8);
          }
          bad |= got != want[j];
          listed[want[j]] = 1;
        }
        /* P = want ++ the dropped slots ascending. */
        int64_t m = kept;
        for (int64_t x = 0; x < n; x++) {
          if (!listed[x]) want[m++] = x;
        }
        const int64_t limit = mode == IMOE_MODE_MOVE ? kept : n;
        for (int64_t j = 0; j < limit; j++) {
          const unsigned char *src = before + (tensor_at(&buf, r, want[j]) - buf.alloc);
          bad |= memcmp(tensor_at(&buf, r, j), src, (size_t)rb) != 0;
        }
      }
      /* build_map_ordered writes the same indices. */
      imoe_status st2 =
          imoe_build_map(test_in_order(&sel, order, n), &idx2.view, NULL, NULL, 0, &exec, &err);
      bad |= st2 != IMOE_OK;
      for (int64_t r = 0; r < rows && st2 == IMOE_OK; r++) {
        for (int64_t j = 0; j < kept; j++) {
          bad |= memcmp(tensor_at(&idx, r, j), tensor_at(&idx2, r, j), (size_t)ielem) != 0;
        }
      }
      if (mode == IMOE_MODE_SWAP) {
        /* apply_ordered on the original gives the same, restore undoes it. */
        unsigned char *after = tensor_snapshot(&buf);
        memcpy(buf.alloc, before, buf.bytes);
        st2 = imoe_apply_indices(&buf.view, 1, &idx.view, IMOE_ORDER_STABLE, IMOE_MODE_SWAP, NULL, 0, &exec, &err);
        bad |= st2 != IMOE_OK || !tensor_same(&buf, after);
        st2 = imoe_restore(&buf.view, 1, &idx.view, IMOE_ORDER_STABLE, NULL, 0, &exec, &err);
        bad |= st2 != IMOE_OK || !tensor_same(&buf, before);
        free(after);
      }
    }
    if (bad && failures++ < 10) {
      CHECK(0, "ordered case %d: n %lld C %lld P %lld W %lld order %d mode %d dtype %d: status %d "
            "(%s)", i, (long long)n, (long long)cap, (long long)pre, (long long)win, (int)order,
            (int)mode, (int)sd, (int)st, err.message);
    } else if (!bad) {
      CHECK(1, "ordered case");
    }
    free(s);
    free(want);
    free(listed);
    free(before);
    free(idx_before);
    tensor_free(&buf);
    tensor_free(&sc);
    tensor_free(&idx);
    tensor_free(&idx2);
  }
}

static void test_ordered_arguments(void) {
  uint64_t seed = 5;
  const int64_t lead[1] = {2};
  tensor buf = tensor_make(1, lead, 8, 4, IMOE_DTYPE_BYTES, 0, &seed);
  tensor sc = tensor_make(1, lead, 8, 4, IMOE_DTYPE_F32, 0, &seed);
  tensor idx = tensor_make(1, lead, 3, 8, IMOE_DTYPE_I64, 0, &seed);
  tensor tm = tensor_make(1, lead, 8, 4, IMOE_DTYPE_I32, 0, &seed);
  tensor act = tensor_make(0, lead, 3, 8, IMOE_DTYPE_I64, 0, &seed);
  for (int64_t r = 0; r < 2; r++) {
    for (int64_t x = 0; x < 8; x++) {
      const float v = (float)((x * 5 + r) % 8);
      memcpy(tensor_at(&sc, r, x), &v, 4);
    }
  }
  const int64_t active_values[3] = {6, 1, 4};
  memcpy(act.view.data, active_values, sizeof active_values);
  unsigned char *snap = tensor_snapshot(&buf);
  const imoe_selection sel = {&sc.view, NULL, 3, 0, 0, IMOE_NAN_ERROR};
  const imoe_selection asel = {NULL, &act.view, 3, 0, 0, IMOE_NAN_ERROR};
  imoe_error err;
  imoe_status st = imoe_compact(&buf.view, 1, test_in_order(&asel, IMOE_ORDER_SCORE, 0), &idx.view, NULL, IMOE_MODE_SWAP, NULL, 0, NULL, &err);
  CHECK(st == IMOE_ERR_ARGUMENT && strstr(err.message, "'score'") != NULL, "score + active: %s",
        err.message);
  st = imoe_compact(&buf.view, 1, test_in_order(&sel, IMOE_ORDER_STABLE, 0), &idx.view, &tm.view, IMOE_MODE_SWAP, NULL, 0, NULL, &err);
  CHECK(st == IMOE_ERR_ARGUMENT && strstr(err.message, "target") != NULL, "stable + map: %s",
        err.message);
  st = imoe_compact(&buf.view, 1, test_in_order(&sel, (imoe_order)7, 0), &idx.view, NULL, IMOE_MODE_SWAP, NULL, 0, NULL, &err);
  CHECK(st == IMOE_ERR_ARGUMENT, "order 7: %d", (int)st);
  int32_t ws[15];
  st = imoe_compact(&buf.view, 1, test_in_order(&sel, IMOE_ORDER_STABLE, 0), &idx.view, NULL, IMOE_MODE_SWAP, ws, 15, NULL, &err);
  CHECK(st == IMOE_ERR_ARGUMENT, "short workspace: %d", (int)st);
  const imoe_exec cuda = {IMOE_DEVICE_CUDA, 0, 0, NULL};
  st = imoe_compact(&buf.view, 1, test_in_order(&sel, IMOE_ORDER_SCORE, 0), &idx.view, NULL, IMOE_MODE_SWAP, NULL, 0, &cuda, &err);
  CHECK(st == IMOE_ERR_UNSUPPORTED, "CUDA: %d", (int)st);
  CHECK(tensor_same(&buf, snap), "failed calls leave the buffer");
  /* Active indices, stable: the listed slots ascending; caller workspace. */
  int32_t ws16[16];
  st = imoe_compact(&buf.view, 1, test_in_order(&asel, IMOE_ORDER_STABLE, 0), &idx.view, NULL, IMOE_MODE_SWAP, ws16, 16, NULL, &err);
  CHECK(st == IMOE_OK, "active stable: %s", err.message);
  for (int64_t r = 0; r < 2; r++) {
    int64_t got[3];
    for (int j = 0; j < 3; j++) memcpy(&got[j], tensor_at(&idx, r, j), 8);
    CHECK(got[0] == 1 && got[1] == 4 && got[2] == 6, "active stable row %lld", (long long)r);
  }
  /* build_map_ordered with active indices needs only n. */
  st = imoe_build_map(test_in_order(&asel, IMOE_ORDER_STABLE, 8), &idx.view, NULL, NULL, 0, NULL, &err);
  CHECK(st == IMOE_OK, "build_map_ordered active: %s", err.message);
  st = imoe_build_map(test_in_order(&asel, IMOE_ORDER_STABLE, 5), &idx.view, NULL, NULL, 0, NULL, &err);
  CHECK(st == IMOE_ERR_INDEX_RANGE, "active index 6 with n 5: %d", (int)st);
  st = imoe_build_map(test_in_order(&sel, IMOE_ORDER_SCORE, 9), &idx.view, NULL, NULL, 0, NULL, &err);
  CHECK(st == IMOE_ERR_ARGUMENT, "n differs from the scores: %d", (int)st);
  st = imoe_build_map(test_in_order(&sel, IMOE_ORDER_INPLACE, 8), &idx.view, &tm.view, NULL, 0, NULL, &err);
  CHECK(st == IMOE_OK, "build_map_ordered inplace: %s", err.message);
  free(snap);
  tensor_free(&buf);
  tensor_free(&sc);
  tensor_free(&idx);
  tensor_free(&tm);
  tensor_free(&act);
}

/* Group, then the inverse permutation of out_perm: the identity. */
static void test_group_roundtrip(void) {
  uint64_t seed = 17;
  const int64_t t = 1000, e = 7;
  tensor buf = tensor_make(0, NULL, t, 40, IMOE_DTYPE_BYTES, T_PAD, &seed);
  tensor ids = tensor_make(0, NULL, t, 4, IMOE_DTYPE_I32, 0, &seed);
  tensor off = tensor_make(0, NULL, e, 8, IMOE_DTYPE_I64, 0, &seed);
  tensor perm = tensor_make(0, NULL, t, 8, IMOE_DTYPE_I64, 0, &seed);
  for (int64_t i = 0; i < t; i++) {
    const int32_t v = (int32_t)(rng_next(&seed) % (uint64_t)e);
    memcpy(tensor_at(&ids, 0, i), &v, 4);
  }
  unsigned char *snap = tensor_snapshot(&buf);
  const imoe_exec exec = {IMOE_DEVICE_CPU, 0, 3, NULL};
  imoe_error err;
  imoe_status st = imoe_group_by_expert(&buf.view, 1, &ids.view, e, &off.view, &perm.view, NULL,
                                        0, &exec, &err);
  CHECK(st == IMOE_OK, "group: %s", err.message);
  int64_t last;
  memcpy(&last, tensor_at(&off, 0, e - 1), 8);
  CHECK(last == t, "offsets end at T");
  st = imoe_permute(&buf.view, 1, &perm.view, 1, NULL, 0, &exec, &err);
  CHECK(st == IMOE_OK && tensor_same(&buf, snap), "ungroup restores: %s", err.message);
  free(snap);
  tensor_free(&buf);
  tensor_free(&ids);
  tensor_free(&off);
  tensor_free(&perm);
}

void test_permute_all(void) {
  test_plan_checks();
  test_messages();
  test_ordered_arguments();
  test_group_roundtrip();
  test_engine_parity(0x9e1u, 1500);
  test_compact_ordered(0x0bd3u, 600);
}
