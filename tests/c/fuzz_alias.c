/* fuzz_alias.c: libFuzzer target for aliased arguments.
 *
 * Every view of a call is carved out of ONE arena at offsets and strides the
 * input chooses, so arguments may share bytes in any way: a map inside a
 * buffer, an output over the scores, two buffers interleaved or stacked, a
 * workspace over anything. The arena's bytes are random too (scores, maps,
 * indices: valid or not). Properties checked, for compaction, map building,
 * applying a map, permuting, the MoE dispatch, combine and gated activation,
 * the small-M grouped GEMM and the router:
 *   - no crash and no out-of-bounds access (ASan, UBSan);
 *   - a failing call leaves every byte of the arena as it was;
 *   - a call whose written argument truly shares a byte with another
 *     argument fails with IMOE_ERR_ARGUMENT (the one allowed overlap: scores
 *     that are a buffer slot for slot);
 *   - a call that succeeds writes no byte outside the views it writes.
 * The byte sets are computed exactly here (a bitmap per view), independently
 * of the library's own test. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idempotent_moe.h"

#define ARENA 4096
#define MAX_VIEWS 8

/* The input reader of fuzz_compact.c, repeated on purpose: each fuzz target
 * is one file that libFuzzer links alone. */
typedef struct reader {
  const uint8_t *p;
  size_t left;
} reader;

static unsigned take(reader *r) {
  if (r->left == 0) return 0;
  r->left--;
  return *r->p++;
}

static void fail(const char *what) {
  fprintf(stderr, "fuzz_alias: %s\n", what);
  abort();
}

/* A view inside the arena: [lead0, n, row] with the input's offset and
 * strides, clamped so every byte it reaches lies inside the arena. */
static int take_view(reader *r, unsigned char *arena, int64_t lead0, int64_t n, int64_t row,
                     imoe_dtype dtype, imoe_view *v) {
  memset(v, 0, sizeof *v);
  v->lead_ndim = lead0 > 0 ? 1 : 0;
  v->lead_shape[0] = lead0;
  v->n = n;
  v->row_bytes = row;
  v->dtype = dtype;
  /* Typed elements are read in place: keep them aligned. */
  const int64_t align = dtype == IMOE_DTYPE_BYTES ? 1 : dtype == IMOE_DTYPE_I32 ? 4 : row;
  v->n_stride = (int64_t)(take(r) % 4) * row + (take(r) % 2 ? row : 0);
  if (take(r) % 8 == 0) v->n_stride = -v->n_stride;
  v->lead_stride[0] = (int64_t)(take(r) % 8) * row * (n > 0 ? n : 1) / 2 / align * align;
  int64_t lo = 0, hi = row;
  const int64_t reach_n = v->n_stride * (n > 0 ? n - 1 : 0);
  const int64_t reach_l = v->lead_stride[0] * (lead0 > 0 ? lead0 - 1 : 0);
  if (reach_n < 0) lo += reach_n; else hi += reach_n;
  hi += reach_l;
  const int64_t span = hi - lo;
  if (span > ARENA) return 0;
  int64_t offset = (int64_t)((take(r) << 8 | take(r)) % (unsigned)(ARENA - span + 1));
  offset = (offset - lo) / align * align;
  if (offset + lo < 0) offset += align * ((-offset - lo + align - 1) / align);
  if (offset + hi > ARENA) return 0;
  v->data = arena + offset;
  return 1;
}

/* bytes[i] |= bit for every byte of v. */
static void mark(const imoe_view *v, const unsigned char *arena, unsigned char *bytes,
                 unsigned bit) {
  const int64_t rows = v->lead_ndim ? v->lead_shape[0] : 1;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t s = 0; s < v->n; s++) {
      const unsigned char *p =
          (const unsigned char *)v->data + r * v->lead_stride[0] + s * v->n_stride;
      for (int64_t b = 0; b < v->row_bytes; b++) bytes[p - arena + b] |= (unsigned char)bit;
    }
}

static int same_slots(const imoe_view *a, const imoe_view *b) {
  return a->data == b->data && a->n == b->n && a->n_stride == b->n_stride &&
         a->row_bytes == b->row_bytes && a->lead_ndim == b->lead_ndim &&
         (a->lead_ndim == 0 ||
          (a->lead_shape[0] == b->lead_shape[0] && a->lead_stride[0] == b->lead_stride[0]));
}

/* Valid indices in [lo, lo + span) written into an index view [lead0?, n]
 * where it lands in the arena (some calls reach their work only with them). */
static void write_indices(reader *r, const imoe_view *v, int64_t lo, int64_t span) {
  const int64_t rows = v->lead_ndim ? v->lead_shape[0] : 1;
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < v->n; j++) {
      unsigned char *p = (unsigned char *)v->data + i * v->lead_stride[0] + j * v->n_stride;
      const int64_t x = lo + (int64_t)(take(r) % (unsigned)(span > 0 ? span : 1));
      if (v->dtype == IMOE_DTYPE_I64) {
        memcpy(p, &x, 8);
      } else {
        const int32_t y = (int32_t)x;
        memcpy(p, &y, 4);
      }
    }
}

/* Outcomes, printed at exit when IMOE_FUZZ_STATS is set: that the inputs
 * reach every case (accepted, refused as aliased, refused for other reasons). */
static long outcome[4];
static void print_outcomes(void) {
  fprintf(stderr, "fuzz_alias: accepted %ld, aliased and refused %ld, refused otherwise %ld\n",
          outcome[0], outcome[1], outcome[2]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int registered;
  if (!registered && getenv("IMOE_FUZZ_STATS")) atexit(print_outcomes);
  registered = 1;
  reader r = {data, size};
  static _Alignas(16) unsigned char arena[ARENA];
  static unsigned char before[ARENA], bytes[ARENA];
  /* The arena's bytes from a seed the input picks (scores, maps and indices
   * valid or not): the rest of the input decides shapes and placement. */
  uint64_t x = 0x9e3779b97f4a7c15ull ^ take(&r) ^ (uint64_t)take(&r) << 8;
  for (int i = 0; i < ARENA; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    arena[i] = (unsigned char)(i % 4 == 3 && (x & 3) ? 0 : x >> 24); /* small ints often */
  }
  memcpy(before, arena, ARENA);

  const int op = (int)(take(&r) % 9);
  const int64_t lead0 = (int64_t)(take(&r) % 4);
  const int64_t n = (int64_t)(take(&r) % 12);
  const int64_t row = 1 + (int64_t)(take(&r) % 9);
  const int64_t cap = (int64_t)(take(&r) % (unsigned)(n + 2));
  const int64_t kept = cap < n ? cap : n;
  const imoe_dtype idx_dtype = take(&r) % 2 ? IMOE_DTYPE_I64 : IMOE_DTYPE_I32;
  const int64_t idx_bytes = idx_dtype == IMOE_DTYPE_I64 ? 8 : 4;

  imoe_view views[MAX_VIEWS];
  int written[MAX_VIEWS] = {0};
  int count = 0;
  imoe_view *buf = &views[count];
  written[count] = 1;
  if (!take_view(&r, arena, lead0, n, row, IMOE_DTYPE_BYTES, &views[count++])) return 0;
  imoe_error err;
  imoe_status st;
  int scores_at = -1;

  if (op == 0 || op == 1) { /* compact / build_map with scores */
    scores_at = count;
    if (take(&r) % 4 == 0 && row == 4) {
      views[count] = *buf; /* scores that are the buffer, slot for slot */
      views[count].dtype = IMOE_DTYPE_F32;
      if ((uintptr_t)views[count].data % 4 != 0) return 0;
    } else if (!take_view(&r, arena, lead0, n, 4, IMOE_DTYPE_F32, &views[count])) {
      return 0;
    }
    count++;
    written[count] = 1;
    if (!take_view(&r, arena, lead0, kept, idx_bytes, idx_dtype, &views[count++])) return 0;
    imoe_selection sel;
    memset(&sel, 0, sizeof sel);
    sel.scores = &views[scores_at];
    sel.capacity = cap;
    sel.nan_policy = IMOE_NAN_LOWEST;
    if (op == 0) {
      st = imoe_compact(buf, 1, &sel, &views[2], NULL, IMOE_MODE_SWAP, NULL, 0, NULL, &err);
    } else {
      count = 0; /* no buffer in build_map: shift the views down */
      memmove(&views[0], &views[1], 2 * sizeof views[0]);
      written[0] = 0, written[1] = 1;
      scores_at = 0;
      sel.scores = &views[0];
      count = 2;
      st = imoe_build_map(&sel, &views[1], NULL, NULL, 0, NULL, &err);
    }
  } else if (op == 2) { /* apply_indices */
    if (!take_view(&r, arena, lead0, kept, idx_bytes, idx_dtype, &views[count++])) return 0;
    st = imoe_apply_indices(buf, 1, &views[1], IMOE_ORDER_INPLACE, IMOE_MODE_SWAP, NULL, 0, NULL,
                            &err);
  } else if (op == 4) { /* moe_combine: rows [R, H], dest and weights [T, k], out [T, H] */
    const int64_t t = 1 + lead0, k = 1 + n % 3, h = 1 + row % 4;
    count = 0;
    if (!take_view(&r, arena, n, h, 4, IMOE_DTYPE_F32, &views[count++]) ||
        !take_view(&r, arena, t, k, idx_bytes, idx_dtype, &views[count++]) ||
        !take_view(&r, arena, t, k, 4, IMOE_DTYPE_F32, &views[count++]))
      return 0;
    written[0] = 0;
    if (take(&r) % 2) { /* dest in [-1, R) */
      write_indices(&r, &views[1], -1, n + 1);
      memcpy(before, arena, ARENA);
    }
    written[count] = 1;
    if (!take_view(&r, arena, t, h, 4, IMOE_DTYPE_F32, &views[count++])) return 0;
    st = imoe_moe_combine(&views[0], &views[1], &views[2], &views[3], NULL, &err);
  } else if (op == 5) { /* gated_act: gate_up [R, 2I] into out [R, I] */
    const int64_t h = 1 + row % 4;
    count = 0;
    written[0] = 0;
    if (!take_view(&r, arena, 1 + lead0, 2 * h, 4, IMOE_DTYPE_F32, &views[count++])) return 0;
    written[count] = 1;
    if (!take_view(&r, arena, 1 + lead0, h, 4, IMOE_DTYPE_F32, &views[count++])) return 0;
    st = imoe_gated_act(&views[0], &views[1], IMOE_ACT_SILU, NULL, NULL, &err);
  } else if (op == 7) { /* grouped_gemm: a [R, K], w [E, K, N], offsets [E] (arena bytes), out [R, N] */
    const int64_t rr = 1 + lead0, k = 1 + row % 4, nn = 1 + n % 4, e = 1 + (int64_t)(take(&r) % 3);
    count = 0;
    written[0] = 0;
    if (!take_view(&r, arena, rr, k, 4, IMOE_DTYPE_F32, &views[count++]) ||
        !take_view(&r, arena, e * k, nn, 4, IMOE_DTYPE_F32, &views[count++]) ||
        !take_view(&r, arena, 0, e, 4, IMOE_DTYPE_I32, &views[count++]))
      return 0;
    if (take(&r) % 2) { /* valid offsets (non-decreasing, at most R) */
      int32_t end = 0;
      for (int64_t i = 0; i < e; i++) {
        end += (int32_t)(take(&r) % 3);
        const int32_t v = end < rr ? end : (int32_t)rr;
        memcpy((unsigned char *)views[2].data + i * views[2].n_stride, &v, 4);
      }
      memcpy(before, arena, ARENA);
    }
    written[count] = 1;
    if (!take_view(&r, arena, rr, nn, 4, IMOE_DTYPE_F32, &views[count++])) return 0;
    /* w as [E, K, N]: the bytes of the [E x K, N] view the oracle marks. */
    imoe_view w = views[1];
    w.lead_ndim = 2;
    w.lead_shape[0] = e, w.lead_shape[1] = k;
    w.lead_stride[1] = views[1].lead_stride[0], w.lead_stride[0] = k * views[1].lead_stride[0];
    st = imoe_grouped_gemm(&views[0], &w, &views[2], &views[3], NULL, &err);
  } else if (op == 8) { /* topk_softmax: logits [T, E] into weights and indices [T, k] */
    const int64_t t = 1 + lead0, e = 1 + n % 8, k = 1 + (int64_t)(take(&r) % (unsigned)e);
    const int32_t renormalize = take(&r) % 2;
    count = 0;
    written[0] = 0;
    if (!take_view(&r, arena, t, e, 4, IMOE_DTYPE_F32, &views[count++])) return 0;
    written[count] = 1, written[count + 1] = 1;
    if (!take_view(&r, arena, t, k, 4, IMOE_DTYPE_F32, &views[count++]) ||
        !take_view(&r, arena, t, k, idx_bytes, idx_dtype, &views[count++]))
      return 0;
    st = imoe_topk_softmax(&views[0], k, renormalize, &views[1], &views[2], NULL, &err);
  } else if (op == 6) { /* moe_dispatch, dropless: ids [T, k], hidden [T] rows */
    const int64_t t = 1 + lead0, k = 1 + n % 3, e = 1 + (int64_t)(take(&r) % 4);
    count = 0;
    written[0] = 0;
    if (!take_view(&r, arena, t, k, idx_bytes, idx_dtype, &views[count++]) ||
        !take_view(&r, arena, 0, t, row, IMOE_DTYPE_BYTES, &views[count++]))
      return 0;
    for (int i = 0; i < 4; i++) written[count + i] = 1;
    if (!take_view(&r, arena, 0, t * k, row, IMOE_DTYPE_BYTES, &views[count++]) ||
        !take_view(&r, arena, 0, e, idx_bytes, idx_dtype, &views[count++]) ||
        !take_view(&r, arena, t, k, idx_bytes, idx_dtype, &views[count++]) ||
        !take_view(&r, arena, 0, t * k, idx_bytes, idx_dtype, &views[count++]))
      return 0;
    if (take(&r) % 2) { /* expert ids in [0, E) */
      write_indices(&r, &views[0], 0, e);
      memcpy(before, arena, ARENA);
    }
    const imoe_moe_routing routing = {&views[0], NULL, e, -1, IMOE_MOE_GROUPED, 0};
    st = imoe_moe_dispatch(&routing, &views[1], &views[2], &views[3], &views[4], &views[5], NULL,
                           NULL, 0, NULL, &err);
  } else { /* permute with a workspace inside the arena */
    if (!take_view(&r, arena, lead0, n, idx_bytes, idx_dtype, &views[count++])) return 0;
    const int64_t ws_elems = (lead0 > 0 ? lead0 : 1) * n;
    imoe_view ws; /* int32 elements seen as one slot of bytes */
    if (!take_view(&r, arena, 0, 1, ws_elems > 0 ? ws_elems * 4 : 4, IMOE_DTYPE_I32, &ws))
      return 0;
    ws.dtype = IMOE_DTYPE_BYTES;
    views[count] = ws;
    written[count++] = 1;
    st = imoe_permute(buf, 1, &views[1], 0, (int32_t *)ws.data, ws_elems, NULL, &err);
  }

  /* The oracle: does a written view truly share a byte with another one? */
  int must_refuse = 0;
  for (int a = 0; a < count && !must_refuse; a++) {
    for (int b = 0; b < a && !must_refuse; b++) {
      if (!written[a] && !written[b]) continue;
      if ((a == scores_at || b == scores_at) && same_slots(&views[a], &views[b])) continue;
      memset(bytes, 0, ARENA);
      mark(&views[a], arena, bytes, 1);
      mark(&views[b], arena, bytes, 2);
      for (int i = 0; i < ARENA; i++) {
        if (bytes[i] == 3) {
          must_refuse = 1;
          break;
        }
      }
    }
  }
  if (st != IMOE_OK) {
    if (memcmp(arena, before, ARENA) != 0) fail("a failing call changed the arena");
    outcome[must_refuse ? 1 : 2]++;
    return 0;
  }
  outcome[0]++;
  if (must_refuse) fail("a call with truly aliased arguments was accepted");
  memset(bytes, 0, ARENA);
  for (int a = 0; a < count; a++)
    if (written[a]) mark(&views[a], arena, bytes, 1);
  for (int i = 0; i < ARENA; i++)
    if (!bytes[i] && arena[i] != before[i]) fail("a call wrote outside the views it writes");
  return 0;
}
