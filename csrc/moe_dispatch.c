/* moe_dispatch.c: imoe_moe_dispatch, the routing of an experts layer into
 * expert-sorted rows (a stable counting sort of the assignments by expert,
 * each expert's lowest-weight overflow dropped under a capacity, and the
 * gather of the kept assignments' tokens). The CPU core here; CUDA in
 * cuda/imoe_moe.cu. Contract: idempotent_moe.h. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#include "floats.h"
#include "imoe_backend.h"
#include "imoe_internal.h"

int64_t imoe_moe_workspace_elems(imoe_device_type device, int64_t assignments, int64_t capacity) {
  if (assignments < 0 || assignments > IMOE_MAX_SLOTS) return -1;
  if (device != IMOE_DEVICE_CUDA) return 0;
  /* With a capacity: the dropless order of the assignments and each one's
   * verdict (kept or not) for the one-block sort; from
   * IMOE_MOE_MULTI_SORT_MIN, the multi-block sort's order [S], counts
   * [B x E] (below), and [4 x E] per expert: S + S / 4 + 1024 + 4096 <=
   * 2 x S. */
  if (capacity >= 0) return 2 * assignments;
  /* Dropless from IMOE_MOE_MULTI_SORT_MIN assignments: the multi-block
   * sort's counts per (block, expert), B x E of them, where B =
   * min(128, ceil(S / 4096)) or fewer and E <= IMOE_MOE_MAX_EXPERTS = 1024:
   * B x E <= 1024 x (S / 4096 + 1) = S / 4 + 1024 <= S for S >= 1366, so S
   * elements always hold them. */
  return assignments >= IMOE_MOE_MULTI_SORT_MIN ? assignments : 0;
}

/* A 1-d typed view [n]: lead_ndim 0. */
static imoe_status check_vector(const imoe_view *v, const char *name, unsigned dtypes, int64_t n,
                                imoe_error *err) {
  imoe_status st = imoe_check_view(v, name, err);
  if (st == IMOE_OK) st = imoe_check_typed(v, name, dtypes, err);
  if (st == IMOE_OK) st = imoe_check_writable(v, name, err);
  if (st == IMOE_OK && (v->lead_ndim != 0 || v->n != n)) {
    st = imoe_fail(err, IMOE_ERR_ARGUMENT, "%s must be [%" PRId64 "], got %d axes of length %" PRId64,
                   name, n, (int)v->lead_ndim + 1, v->n);
  }
  return st;
}

/* Rows of slots of `row_bytes` each: lead_ndim 0, n = rows. */
static imoe_status check_rows(const imoe_view *v, const char *name, int64_t rows, int64_t row_bytes,
                              int written, imoe_error *err) {
  imoe_status st = imoe_check_view(v, name, err);
  if (st == IMOE_OK && written) st = imoe_check_writable(v, name, err);
  if (st != IMOE_OK) return st;
  if (v->lead_ndim != 0 || v->n != rows || (row_bytes >= 0 && v->row_bytes != row_bytes)) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "%s must be %" PRId64 " rows of %" PRId64 " bytes, got %" PRId64
                     " rows of %" PRId64 " bytes",
                     name, rows, row_bytes >= 0 ? row_bytes : v->row_bytes, v->n, v->row_bytes);
  }
  return IMOE_OK;
}

static imoe_status check_routing(const imoe_moe_routing *r, int64_t *rows_out, imoe_error *err) {
  if (r == NULL) return imoe_fail(err, IMOE_ERR_ARGUMENT, "routing is NULL");
  imoe_status st = imoe_check_matrix(r->top_k_index, "top_k_index", IMOE_INDEX_DTYPES, -1, -1, 0, 0,
                                     err);
  if (st != IMOE_OK) return st;
  const int64_t t = r->top_k_index->lead_shape[0], k = r->top_k_index->n;
  if (k != 0 && t > IMOE_MAX_SLOTS / k) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "top_k_index: T x k = %" PRId64 " x %" PRId64 " assignments exceed %" PRId64, t,
                     k, (int64_t)IMOE_MAX_SLOTS);
  }
  if (r->num_experts < 1 || r->num_experts > IMOE_MOE_MAX_EXPERTS) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "num_experts = %" PRId64 " is outside [1, %d]",
                     r->num_experts, IMOE_MOE_MAX_EXPERTS);
  }
  if (r->capacity < -1 || r->capacity > IMOE_MAX_SLOTS) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "capacity = %" PRId64 " is outside [0, %" PRId64 "] (or -1: dropless)",
                     r->capacity, (int64_t)IMOE_MAX_SLOTS);
  }
  if (imoe_option_name(IMOE_OPTION_LAYOUT, (int)r->layout) == NULL) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "layout: %d is not an imoe_moe_layout", (int)r->layout);
  }
  if (r->layout == IMOE_MOE_PADDED && r->capacity < 0) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "layout='padded' needs a capacity");
  }
  if (r->distinct != 0 && r->distinct != 1) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "distinct must be 0 or 1, got %d", (int)r->distinct);
  }
  if (r->capacity >= 0 && r->top_k_weights == NULL) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "top_k_weights is required with a capacity: they choose what is kept");
  }
  if (r->top_k_weights != NULL) { /* judged whenever given; read with a capacity only */
    st = imoe_check_matrix(r->top_k_weights, "top_k_weights", IMOE_SCORE_DTYPES, t, k, 0, 0, err);
    if (st != IMOE_OK) return st;
  }
  if (r->layout == IMOE_MOE_PADDED) {
    if (r->capacity > IMOE_MAX_SLOTS / r->num_experts) {
      return imoe_fail(err, IMOE_ERR_ARGUMENT,
                       "num_experts x capacity = %" PRId64 " x %" PRId64 " rows exceed %" PRId64,
                       r->num_experts, r->capacity, (int64_t)IMOE_MAX_SLOTS);
    }
    *rows_out = r->num_experts * r->capacity;
  } else {
    *rows_out = t * k;
  }
  return IMOE_OK;
}

/* ---- the CPU core ---- */

typedef struct ranked {
  float weight;
  int nan;
  int64_t i;
} ranked;

/* Higher weight first, NaN lowest, ties to the lower assignment. */
static int by_weight(const void *pa, const void *pb) {
  const ranked *a = pa, *b = pb;
  if (a->nan != b->nan) return a->nan - b->nan;
  if (!a->nan && a->weight != b->weight) return a->weight > b->weight ? -1 : 1;
  return a->i < b->i ? -1 : (a->i > b->i);
}

typedef struct dispatch_plan {
  int64_t *count; /* [E] assignments per expert */
  int64_t *start; /* [E] first row */
  int64_t *next;  /* [E] */
  unsigned char *keep; /* [S] or NULL (dropless) */
  int64_t *order;      /* [S] scratch of the capacity choice */
  ranked *rank;        /* [S] */
} dispatch_plan;

static void free_plan(dispatch_plan *p) {
  free(p->count);
  free(p->start);
  free(p->next);
  free(p->keep);
  free(p->order);
  free(p->rank);
}

static int64_t index_at(const imoe_view *v, int64_t t, int64_t j) {
  return imoe_load_index(imoe_row_base(v, t) + j * v->n_stride, v->dtype);
}

/* The counts per expert, after every id is checked (nothing written).
 * `seen` [E], zeroed: with r->distinct, 1 + the last token that named each
 * expert (by an assignment of nonzero weight, where weights are given), so a
 * token naming a local expert twice is found in one pass. */
static imoe_status count_experts(const imoe_moe_routing *r, int64_t *count, int64_t *seen,
                                 imoe_error *err) {
  const imoe_view *ids = r->top_k_index, *w = r->top_k_weights;
  const int64_t t_n = ids->lead_shape[0], k = ids->n, e_n = r->num_experts;
  for (int64_t t = 0; t < t_n; t++) {
    for (int64_t j = 0; j < k; j++) {
      const int64_t e = index_at(ids, t, j);
      if (e < 0 || (e >= e_n && !r->skip_foreign)) {
        return imoe_fail(err, IMOE_ERR_INDEX_RANGE,
                         "top_k_index[%" PRId64 ", %" PRId64 "] = %" PRId64
                         " is outside [0, num_experts = %" PRId64 ")%s",
                         t, j, e, e_n, e >= e_n ? " (skip_foreign=True drops such ids)" : "");
      }
      if (e >= e_n) continue;
      /* An assignment of weight 0 adds nothing: it may repeat an expert
       * (LongCat-Flash's zero experts are such assignments to real ones). */
      if (r->distinct &&
          (w == NULL || imoe_load_float(imoe_row_base(w, t) + j * w->n_stride, w->dtype) != 0.0f)) {
        if (seen[e] == t + 1) {
          return imoe_fail(err, IMOE_ERR_INDEX_DUPLICATE,
                           "top_k_index[%" PRId64 ", %" PRId64 "] = %" PRId64
                           " repeats an expert of token %" PRId64
                           ": each token's experts must be distinct (as torch.topk gives them)",
                           t, j, e, t);
        }
        seen[e] = t + 1;
      }
      count[e]++;
    }
  }
  return IMOE_OK;
}

/* keep[i] for every assignment: each overloaded expert's C of highest
 * weight. */
static void choose_kept(const imoe_moe_routing *r, dispatch_plan *p) {
  const imoe_view *ids = r->top_k_index, *w = r->top_k_weights;
  const int64_t k = ids->n, s = ids->lead_shape[0] * k, e_n = r->num_experts, c = r->capacity;
  /* order: the assignments by expert, each expert's in token order */
  for (int64_t e = 0, at = 0; e < e_n; e++) {
    p->next[e] = at;
    at += p->count[e];
  }
  for (int64_t i = 0; i < s; i++) {
    const int64_t e = index_at(ids, i / k, i % k);
    p->keep[i] = e < e_n;
    if (e < e_n) p->order[p->next[e]++] = i;
  }
  for (int64_t e = 0, at = 0; e < e_n; at += p->count[e], e++) {
    if (p->count[e] <= c) continue;
    for (int64_t q = 0; q < p->count[e]; q++) {
      const int64_t i = p->order[at + q];
      const float v = imoe_load_float(imoe_row_base(w, i / k) + (i % k) * w->n_stride, w->dtype);
      p->rank[q] = (ranked){v, isnan(v) ? 1 : 0, i};
    }
    qsort(p->rank, (size_t)p->count[e], sizeof *p->rank, by_weight);
    for (int64_t q = c; q < p->count[e]; q++) p->keep[p->rank[q].i] = 0;
  }
}

typedef struct gather_ctx {
  const imoe_view *hidden, *rows, *src;
} gather_ctx;

static imoe_status gather_row(const void *vctx, int64_t r, unsigned char *mem, imoe_error *err) {
  const gather_ctx *g = vctx;
  (void)mem;
  (void)err;
  char *to = (char *)g->rows->data + r * g->rows->n_stride;
  const int64_t s = imoe_load_index((const char *)g->src->data + r * g->src->n_stride, g->src->dtype);
  if (s < 0) memset(to, 0, (size_t)g->rows->row_bytes);
  else memcpy(to, (const char *)g->hidden->data + s * g->hidden->n_stride, (size_t)g->rows->row_bytes);
  return IMOE_OK;
}

static imoe_status dispatch_cpu(const imoe_moe_routing *r, const imoe_view *hidden, int64_t rows,
                                const imoe_view *out_rows, const imoe_view *out_offsets,
                                const imoe_view *out_dest, const imoe_view *out_src,
                                const imoe_view *out_dropped, const imoe_exec *exec,
                                imoe_error *err) {
  const imoe_view *ids = r->top_k_index;
  const int64_t t_n = ids->lead_shape[0], k = ids->n, s = t_n * k, e_n = r->num_experts;
  const int64_t c = r->capacity;
  const size_t ecount = (size_t)e_n;
  dispatch_plan p = {calloc(ecount, sizeof(int64_t)), calloc(ecount, sizeof(int64_t)),
                     calloc(ecount, sizeof(int64_t)), NULL, NULL, NULL};
  const size_t scount = s > 0 ? (size_t)s : 1;
  if (c >= 0) {
    p.keep = malloc(scount);
    p.order = malloc(scount * sizeof *p.order);
    p.rank = malloc(scount * sizeof *p.rank);
  }
  if (!p.count || !p.start || !p.next || (c >= 0 && (!p.keep || !p.order || !p.rank))) {
    free_plan(&p);
    return imoe_fail(err, IMOE_ERR_NO_MEMORY, "moe_dispatch: no memory for the plan of %" PRId64
                     " assignments", s);
  }
  /* p.start is zero until the layout below fills it: count_experts' marks. */
  imoe_status st = count_experts(r, p.count, p.start, err);
  if (st != IMOE_OK) {
    free_plan(&p);
    return st;
  }
  /* Everything is checked: from here on the call writes. */
  if (c >= 0) choose_kept(r, &p);
  int64_t dropped = 0;
  for (int64_t e = 0, at = 0; e < e_n; e++) {
    const int64_t kept = c >= 0 && p.count[e] > c ? c : p.count[e];
    dropped += p.count[e] - kept;
    p.start[e] = r->layout == IMOE_MOE_PADDED ? e * c : at;
    p.next[e] = p.start[e];
    at += kept;
    const int64_t end = r->layout == IMOE_MOE_PADDED ? (e + 1) * c : at;
    imoe_store_index((char *)out_offsets->data + e * out_offsets->n_stride, out_offsets->dtype, end);
  }
  for (int64_t row = 0; row < rows; row++)
    imoe_store_index((char *)out_src->data + row * out_src->n_stride, out_src->dtype, -1);
  for (int64_t i = 0; i < s; i++) {
    const int64_t t = i / k, j = i % k, e = index_at(ids, t, j);
    int64_t row = -1;
    if (e < e_n && (p.keep == NULL || p.keep[i])) {
      row = p.next[e]++;
      imoe_store_index((char *)out_src->data + row * out_src->n_stride, out_src->dtype, t);
    }
    imoe_store_index(imoe_row_base(out_dest, t) + j * out_dest->n_stride, out_dest->dtype, row);
  }
  if (out_dropped != NULL) imoe_store_index((char *)out_dropped->data, out_dropped->dtype, dropped);
  free_plan(&p);

  const gather_ctx g = {hidden, out_rows, out_src};
  const imoe_stage stage = {gather_row, &g, rows};
  return imoe_run_stages(&stage, 1, 0, imoe_thread_count(exec, rows * out_rows->row_bytes, rows),
                         err);
}

imoe_status imoe_moe_dispatch_rows(const imoe_moe_routing *routing, const imoe_view *hidden,
                                   int64_t *rows, imoe_error *err) {
  int64_t r = 0;
  imoe_status st = check_routing(routing, &r, err);
  if (st == IMOE_OK) st = check_rows(hidden, "hidden", routing->top_k_index->lead_shape[0], -1, 0, err);
  if (st == IMOE_OK && rows != NULL) *rows = r;
  return st;
}

imoe_status imoe_moe_dispatch(const imoe_moe_routing *routing, const imoe_view *hidden,
                              const imoe_view *out_rows, const imoe_view *out_offsets,
                              const imoe_view *out_dest, const imoe_view *out_src,
                              const imoe_view *out_dropped, int32_t *workspace,
                              int64_t workspace_elems, const imoe_exec *exec, imoe_error *err) {
  int64_t rows = 0;
  imoe_status st = imoe_moe_dispatch_rows(routing, hidden, &rows, err);
  if (st != IMOE_OK) return st;
  const int64_t t = routing->top_k_index->lead_shape[0], k = routing->top_k_index->n;
  st = check_rows(out_rows, "out_rows", rows, hidden->row_bytes, 1, err);
  if (st == IMOE_OK)
    st = check_vector(out_offsets, "out_offsets", IMOE_INDEX_DTYPES, routing->num_experts, err);
  if (st == IMOE_OK) st = imoe_check_matrix(out_dest, "out_dest", IMOE_INDEX_DTYPES, t, k, 1, 0, err);
  if (st == IMOE_OK) st = check_vector(out_src, "out_src", IMOE_INDEX_DTYPES, rows, err);
  if (st == IMOE_OK && out_dropped != NULL)
    st = check_vector(out_dropped, "out_dropped", IMOE_DTYPE_BIT(IMOE_DTYPE_I64), 1, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  if (st != IMOE_OK) return st;
  const imoe_view *weights = routing->capacity >= 0 ? routing->top_k_weights : NULL;
  int empty;
  const imoe_call_args call = {NULL, 0, NULL,
                               {routing->top_k_index, weights, hidden},
                               {"top_k_index", "top_k_weights", "hidden"},
                               {out_rows, out_offsets, out_dest, out_src, out_dropped},
                               {"out_rows", "out_offsets", "out_dest", "out_src", "out_dropped"},
                               workspace, workspace_elems};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK) return st;
  if (imoe_on_cuda(exec)) {
    /* A capacity needs its workspace. Dropless, one is optional: the launcher
     * sorts in several blocks where it holds their counts, else in one. */
    const int64_t need = imoe_moe_workspace_elems(IMOE_DEVICE_CUDA, t * k, routing->capacity);
    if (routing->capacity >= 0 && need > 0 && (workspace == NULL || workspace_elems < need)) {
      return imoe_fail(err, IMOE_ERR_ARGUMENT,
                       "workspace: a capacity on CUDA needs %" PRId64 " int32 elements, got %" PRId64,
                       need, workspace == NULL ? 0 : workspace_elems);
    }
    return imoe_cuda_moe_dispatch(routing, hidden, rows, out_rows, out_offsets, out_dest, out_src,
                                  out_dropped, workspace, workspace == NULL ? 0 : workspace_elems, exec,
                                  err);
  }
  return dispatch_cpu(routing, hidden, rows, out_rows, out_offsets, out_dest, out_src, out_dropped,
                      exec, err);
}
