/* order.c: the kept slots of a row in the order of an ordered compaction,
 * and the permutation P = kept-in-order ++ dropped-ascending it applies.
 *
 * STABLE is a scan of the kept flags. SCORE sorts the kept slots by
 * (score descending, slot ascending): each becomes a 64-bit word, the
 * inverted order-preserving key of its score (select.c's keys: -0 == +0,
 * NaN lowest) above the slot, gathered in slot order; a stable LSD radix
 * sort on the key half then leaves ties in slot order. O(C') per row. */
#include "imoe_internal.h"

static size_t align64(size_t x) { return (x + 63) & ~(size_t)63; }

size_t imoe_order_extra_bytes(int64_t n, imoe_order order) {
  return order == IMOE_ORDER_SCORE ? 2 * align64((size_t)n * sizeof(uint64_t)) : 0;
}

/* Below this many words an insertion sort beats the histogram passes. */
#define SMALL_SORT 48
/* A row too short for histogram bins (imoe_radix_hist_entries) never radix-sorts. */
_Static_assert(SMALL_SORT > IMOE_RANK_MAX_KEYS_16, "a row without bins sorts by insertion");

static void insertion_sort(uint64_t *a, int64_t count) {
  for (int64_t i = 1; i < count; i++) {
    const uint64_t x = a[i];
    int64_t j = i;
    while (j > 0 && a[j - 1] > x) {
      a[j] = a[j - 1];
      j--;
    }
    a[j] = x;
  }
}

/* Stable sort of a[0, count) by bits [32, 32 + key_bits); returns the
 * array that holds the result (a or tmp). hist: at least 2048 entries. */
static uint64_t *radix_sort_high(uint64_t *a, uint64_t *tmp, int64_t count, int key_bits,
                                 uint32_t *hist) {
  static const int widths32[] = {11, 11, 10};
  static const int widths16[] = {8, 8};
  const int *widths = key_bits == 32 ? widths32 : widths16;
  const int passes = key_bits == 32 ? 3 : 2;
  int shift = 32;
  for (int p = 0; p < passes; p++) {
    const uint32_t bins = 1u << widths[p], mask = bins - 1;
    memset(hist, 0, bins * sizeof *hist);
    for (int64_t i = 0; i < count; i++) hist[(uint32_t)(a[i] >> shift) & mask]++;
    uint32_t sum = 0, single = 0;
    for (uint32_t b = 0; b < bins; b++) {
      const uint32_t c = hist[b];
      single |= c == (uint32_t)count;
      hist[b] = sum;
      sum += c;
    }
    if (!single) { /* a digit shared by every word leaves the order as it is */
      for (int64_t i = 0; i < count; i++) tmp[hist[(uint32_t)(a[i] >> shift) & mask]++] = a[i];
      uint64_t *t = a;
      a = tmp;
      tmp = t;
    }
    shift += widths[p];
  }
  return a;
}

void imoe_kept_in_order(const imoe_selection *sel, int64_t row, int64_t n, int64_t kept,
                        imoe_order order, imoe_row_workspace ws, unsigned char *extra,
                        uint32_t *out) {
  const uint8_t *flags = ws.flags;
  if (order != IMOE_ORDER_SCORE) {
    int64_t c = 0;
    for (int64_t x = 0; x < n; x++) {
      out[c] = (uint32_t)x; /* c < n: see imoe_write_map_row */
      c += flags[x];
    }
    return;
  }
  imoe_score_keys(sel->scores, row, 0, n, ws.keys);
  const int key_bits = sel->scores->dtype == IMOE_DTYPE_F32 ? 32 : 16;
  const uint32_t mask = key_bits == 32 ? 0xffffffffu : 0xffffu;
  uint64_t *words = (uint64_t *)(void *)extra;
  uint64_t *tmp = (uint64_t *)(void *)(extra + align64((size_t)n * sizeof(uint64_t)));
  int64_t c = 0;
  for (int64_t x = 0; x < n; x++) {
    words[c] = (uint64_t)(~ws.keys[x] & mask) << 32 | (uint64_t)x;
    c += flags[x];
  }
  const uint64_t *sorted = words;
  if (kept < SMALL_SORT) {
    insertion_sort(words, kept);
  } else {
    sorted = radix_sort_high(words, tmp, kept, key_bits, ws.hist);
  }
  for (int64_t i = 0; i < kept; i++) out[i] = (uint32_t)sorted[i];
}

void imoe_plan_from_kept(const uint32_t *order, int64_t kept, const uint8_t *flags, int64_t n,
                         int32_t *plan) {
  for (int64_t i = 0; i < kept; i++) plan[i] = (int32_t)order[i];
  int64_t m = kept;
  for (int64_t x = 0; x < n; x++) {
    if (!flags[x]) plan[m++] = (int32_t)x;
  }
}
