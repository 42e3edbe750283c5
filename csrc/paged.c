/* paged.c: imoe_paged_apply_target_map, the compaction of sequences whose
 * slots live in the blocks of a paged pool (vLLM's KV cache layout) rather
 * than along one strided axis. The map is built by imoe_build_map as for any
 * other buffer; only the address of a slot differs: logical slot x of
 * sequence s lives in block block_tables[s, x / block_size], at offset
 * x % block_size. */
#include <inttypes.h>
#include <stdlib.h>

#include "imoe_internal.h"
#include "imoe_backend.h"

typedef struct paged_plan {
  const imoe_view *pools; /* [num_blocks, lead..., block_size, row] */
  int32_t num_pools;
  imoe_view inner[IMOE_MAX_BUFFERS]; /* each pool less its block axis: row offsets */
  const imoe_view *tables;           /* [S, max_blocks] */
  const imoe_view *map;              /* [S, lead..., N] */
  imoe_mode mode;
  int64_t num_blocks, block_size, per_seq; /* per_seq: rows of one sequence (R) */
  int block_shift;                         /* log2(block_size) for a power of two, else -1 */
  int64_t rows, slots, parts;              /* apply items: sequences x parts */
  uint8_t *touched;                        /* [S x max_blocks]: entries that hold a moved slot */
  uint8_t *seen;                           /* [num_blocks]: blocks named by a touched entry */
} paged_plan;

static int64_t table_entry(const paged_plan *p, int64_t seq, int64_t j) {
  const imoe_view *t = p->tables;
  return imoe_load_index(imoe_row_base(t, seq) + j * t->n_stride, t->dtype);
}

/* Stage 1, per sequence: each of its rows an involution over [0, N), and
 * every moved slot in a block of the pool. Marks the touched table entries
 * (this sequence's part of `touched` only: no two items share a byte). */
static imoe_status check_sequence(const void *ctx, int64_t seq, unsigned char *ws,
                                  imoe_error *err) {
  const paged_plan *p = ctx;
  const imoe_view *map = p->map;
  uint8_t *touched = p->touched + seq * p->tables->n;
  (void)ws;
  for (int64_t r = seq * p->per_seq; r < (seq + 1) * p->per_seq; r++) {
    const imoe_status st = imoe_check_target_map_row(map, r, err);
    if (st != IMOE_OK) return st;
    const char *base = imoe_row_base(map, r);
    for (int64_t x = 0; x < map->n; x++) {
      if (imoe_load_index(base + x * map->n_stride, map->dtype) == x) continue;
      const int64_t j = x / p->block_size;
      if (touched[j]) continue;
      const int64_t block = table_entry(p, seq, j);
      if (block < 0 || block >= p->num_blocks) {
        return imoe_fail(err, IMOE_ERR_INDEX_RANGE,
                         "block_tables: sequence %" PRId64 ", entry %" PRId64
                         " names block %" PRId64 " (slot %" PRId64 " moves), outside [0, %" PRId64
                         ")",
                         seq, j, block, x, p->num_blocks);
      }
      touched[j] = 1;
    }
  }
  return IMOE_OK;
}

/* Stage 2, one item: no block is written through two table entries. Two
 * entries naming one block would make two rows write the same slots. */
static imoe_status check_blocks_distinct(const void *ctx, int64_t item, unsigned char *ws,
                                         imoe_error *err) {
  const paged_plan *p = ctx;
  const int64_t seqs = imoe_view_rows(p->tables), entries = p->tables->n;
  (void)item;
  (void)ws;
  for (int64_t s = 0; s < seqs; s++) {
    for (int64_t j = 0; j < entries; j++) {
      if (!p->touched[s * entries + j]) continue;
      const int64_t block = table_entry(p, s, j);
      if (!p->seen[block]) {
        p->seen[block] = 1;
        continue;
      }
      int64_t s0 = 0, j0 = 0; /* the earlier entry, for the message */
      for (int64_t k = 0; k < s * entries + j; k++) {
        if (p->touched[k] && table_entry(p, k / entries, k % entries) == block) {
          s0 = k / entries;
          j0 = k % entries;
          break;
        }
      }
      return imoe_fail(err, IMOE_ERR_INDEX_DUPLICATE,
                       "block_tables: block %" PRId64 " is written through sequence %" PRId64
                       ", entry %" PRId64 " and sequence %" PRId64 ", entry %" PRId64
                       ": a block that moves data must belong to one table entry",
                       block, s0, j0, s, j);
    }
  }
  return IMOE_OK;
}

/* Block and offset of logical slot x (x < 2^31: 32-bit division suffices). */
static void split_slot(const paged_plan *p, const char *table, int64_t x, int64_t *block,
                       int64_t *offset) {
  const uint32_t ux = (uint32_t)x, bs = (uint32_t)p->block_size;
  const uint32_t j = p->block_shift >= 0 ? ux >> p->block_shift : ux / bs;
  *offset = (int64_t)(ux - j * bs);
  *block = imoe_load_index(table + (int64_t)j * p->tables->n_stride, p->tables->dtype);
}

/* Stage 3, per (sequence, part): each 2-cycle once, from its lower slot.
 * Slot-major, rows (heads) inner: the rows of one slot share its block, so
 * consecutive moves stay in the same pages of the pool. The workspace holds
 * the byte offset of each row in the map and in every pool. */
static imoe_status apply_item(const void *ctx, int64_t item, unsigned char *ws, imoe_error *err) {
  const paged_plan *p = ctx;
  const imoe_view *map = p->map;
  const int64_t seq = item / p->parts, part = item % p->parts, rows = p->per_seq;
  int64_t *map_off = (int64_t *)(void *)ws, *pool_off = map_off + rows;
  const char *table = imoe_row_base(p->tables, seq);
  (void)err;
  for (int64_t r = 0; r < rows; r++) {
    map_off[r] = imoe_row_offset(map, seq * rows + r);
    for (int32_t b = 0; b < p->num_pools; b++) {
      pool_off[b * rows + r] = imoe_row_offset(&p->inner[b], r);
    }
  }
  /* Logical blocks part, part + parts, ...: the holes (all below C) spread
   * evenly over the items, and one block's slots stay together. */
  for (int64_t j = part; j * p->block_size < p->slots; j += p->parts) {
    const int64_t lo = j * p->block_size;
    const int64_t hi = lo + p->block_size < p->slots ? lo + p->block_size : p->slots;
    for (int64_t x = lo; x < hi; x++) {
      int64_t xb = -1, xo = 0;
      for (int64_t r = 0; r < rows; r++) {
        const char *entry = (const char *)map->data + map_off[r] + x * map->n_stride;
        const int64_t t = imoe_load_index(entry, map->dtype);
        if (x >= t) continue;
        int64_t tb, to;
        if (xb < 0) split_slot(p, table, x, &xb, &xo);
        split_slot(p, table, t, &tb, &to);
        for (int32_t b = 0; b < p->num_pools; b++) {
          const imoe_view *pool = &p->pools[b];
          char *row_base = (char *)pool->data + pool_off[b * rows + r];
          char *dst = row_base + xb * pool->lead_stride[0] + xo * pool->n_stride;
          char *src = row_base + tb * pool->lead_stride[0] + to * pool->n_stride;
          if (p->mode == IMOE_MODE_SWAP) {
            imoe_swap_bytes(dst, src, (size_t)pool->row_bytes);
          } else {
            memcpy(dst, src, (size_t)pool->row_bytes);
          }
        }
      }
    }
  }
  return IMOE_OK;
}

static imoe_status check_args(const imoe_view *pools, int32_t num_pools, const imoe_view *tables,
                              const imoe_view *map, imoe_mode mode, const imoe_exec *exec,
                              imoe_error *err) {
  imoe_status st = imoe_check_buffers(pools, num_pools, err);
  if (st != IMOE_OK) return st;
  if (pools[0].lead_ndim < 1) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "buffers[0]: a pool needs its block axis as the first lead axis");
  }
  st = imoe_check_view(tables, "block_tables", err);
  if (st == IMOE_OK) st = imoe_check_typed(tables, "block_tables", IMOE_INDEX_DTYPES, err);
  if (st == IMOE_OK) st = imoe_check_view(map, "target_map", err);
  if (st == IMOE_OK) st = imoe_check_typed(map, "target_map", IMOE_INDEX_DTYPES, err);
  if (st != IMOE_OK) return st;
  if (tables->lead_ndim != 1) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "block_tables must be [S, max_blocks], got %d lead axes",
                     (int)tables->lead_ndim);
  }
  /* map [S, lead..., N] against pools [num_blocks, lead..., block_size]. */
  int same = map->lead_ndim == pools[0].lead_ndim && map->lead_shape[0] == tables->lead_shape[0];
  for (int32_t d = 1; same && d < map->lead_ndim; d++) {
    same = map->lead_shape[d] == pools[0].lead_shape[d];
  }
  if (!same) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "target_map must be [S, lead..., N]: S from block_tables (%" PRId64
                     "), lead from the pools after their block axis",
                     tables->lead_shape[0]);
  }
  /* Both factors are at most IMOE_MAX_SLOTS: the product fits. */
  if (map->n > tables->n * pools[0].n) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "target_map: N = %" PRId64 " exceeds max_blocks %" PRId64
                     " x block_size %" PRId64,
                     map->n, tables->n, pools[0].n);
  }
  st = imoe_check_mode(mode, err);
  if (st == IMOE_OK) st = imoe_check_exec(exec, err);
  return st;
}

/* The workspace against what the call needs (imoe_paged_workspace_elems):
 * required on CUDA, optional on the CPU. */
static imoe_status check_workspace(const imoe_view *pools, const imoe_view *tables,
                                   const int32_t *workspace, int64_t workspace_elems,
                                   const imoe_exec *exec, imoe_error *err) {
  /* The views passed imoe_check_view: their shapes fit in int64 elements. */
  const int64_t need = imoe_paged_workspace_elems(pools[0].lead_shape[0], tables->lead_shape[0],
                                                  tables->n);
  if (workspace == NULL) {
    if (!imoe_on_cuda(exec)) return IMOE_OK;
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "workspace: a CUDA call needs an int32 device workspace of %" PRId64
                     " elements (num_blocks + S x max_blocks + %d)",
                     need, IMOE_PAGED_WORKSPACE_EXTRA);
  }
  if (workspace_elems < need) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT,
                     "workspace: %" PRId64 " int32 elements, the call needs %" PRId64
                     " (num_blocks + S x max_blocks + %d)",
                     workspace_elems, need, IMOE_PAGED_WORKSPACE_EXTRA);
  }
  return IMOE_OK;
}

int64_t imoe_paged_workspace_elems(int64_t num_blocks, int64_t num_seqs, int64_t max_blocks) {
  if (num_blocks < 0 || num_seqs < 0 || max_blocks < 0) return -1;
  if (max_blocks != 0 && num_seqs > (INT64_MAX - IMOE_PAGED_WORKSPACE_EXTRA - num_blocks) / max_blocks)
    return -1;
  return num_blocks + num_seqs * max_blocks + IMOE_PAGED_WORKSPACE_EXTRA;
}

imoe_status imoe_paged_apply_target_map(const imoe_view *buffers, int32_t num_buffers,
                                        const imoe_view *block_tables, const imoe_view *target_map,
                                        imoe_mode mode, int32_t *workspace,
                                        int64_t workspace_elems, const imoe_exec *exec,
                                        imoe_error *err) {
  imoe_status st = check_args(buffers, num_buffers, block_tables, target_map, mode, exec, err);
  if (st == IMOE_OK) {
    st = check_workspace(buffers, block_tables, workspace, workspace_elems, exec, err);
  }
  if (st != IMOE_OK) return st;
  int empty;
  const imoe_call_args call = {buffers, num_buffers, NULL, {block_tables, target_map},
                               {"block_tables", "target_map"}, {NULL}, {NULL}, workspace,
                               workspace_elems};
  st = imoe_check_call(&call, &empty, err);
  if (st != IMOE_OK || empty) return st;
  if (imoe_on_cuda(exec)) {
    return imoe_cuda_paged_apply_target_map(buffers, num_buffers, block_tables, target_map, mode,
                                            workspace, workspace_elems, exec, err);
  }

  paged_plan p;
  memset(&p, 0, sizeof p);
  p.pools = buffers;
  p.num_pools = num_buffers;
  p.tables = block_tables;
  p.map = target_map;
  p.mode = mode;
  p.num_blocks = buffers[0].lead_shape[0];
  p.block_size = buffers[0].n;
  p.block_shift = -1;
  for (int k = 0; k < 31; k++) {
    if (((int64_t)1 << k) == p.block_size) p.block_shift = k;
  }
  for (int32_t b = 0; b < num_buffers; b++) {
    imoe_view *in = &p.inner[b];
    *in = buffers[b];
    in->lead_ndim = buffers[b].lead_ndim - 1;
    for (int32_t d = 0; d < in->lead_ndim; d++) {
      in->lead_shape[d] = buffers[b].lead_shape[d + 1];
      in->lead_stride[d] = buffers[b].lead_stride[d + 1];
    }
  }
  const int64_t seqs = block_tables->lead_shape[0];
  p.per_seq = imoe_view_rows(&p.inner[0]);
  p.rows = seqs * p.per_seq;
  p.slots = target_map->n;
  if (p.rows == 0 || p.slots == 0) return IMOE_OK;

  const int64_t flags = seqs * block_tables->n; /* fits: the table view was checked */
  /* The flags take flags + num_blocks bytes: a given int32 workspace of
   * num_blocks + flags + EXTRA elements holds them with room to spare. */
  unsigned char *scratch = NULL, *owned = NULL;
  if (workspace != NULL) {
    scratch = (unsigned char *)(void *)workspace;
    memset(scratch, 0, (size_t)(flags + p.num_blocks) + 1);
  } else {
    owned = calloc((size_t)(flags + p.num_blocks) + 1, 1);
    if (owned == NULL) {
      return imoe_fail(err, IMOE_ERR_NO_MEMORY,
                       "could not allocate %" PRId64 " bytes of workspace", flags + p.num_blocks + 1);
    }
    scratch = owned;
  }
  p.touched = scratch;
  p.seen = scratch + flags;

  /* Apply items: each sequence's logical blocks dealt round-robin into
   * `parts` items, as many as it takes to give every thread a few. */
  const int64_t bytes = imoe_buffers_bytes(buffers, num_buffers);
  const int64_t map_blocks = (p.slots + p.block_size - 1) / p.block_size;
  const int threads = imoe_thread_count(exec, bytes, seqs * map_blocks);
  const int64_t want = 4 * (int64_t)threads;
  p.parts = (want + seqs - 1) / seqs;
  if (p.parts > map_blocks) p.parts = map_blocks;

  const imoe_stage stages[] = {
      {check_sequence, &p, seqs},
      {check_blocks_distinct, &p, 1},
      {apply_item, &p, seqs * p.parts},
  };
  const size_t row_workspace = (size_t)p.per_seq * (size_t)(num_buffers + 1) * sizeof(int64_t);
  st = imoe_run_stages(stages, 3, row_workspace, threads, err);
  free(owned);
  return st;
}
