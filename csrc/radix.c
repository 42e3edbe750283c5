/* radix.c: top-k of uint32 keys by radix select, O(M) per call, no sort.
 *
 * Pass 1 histograms the top digit of every key and walks the bins from the
 * top to find the bin holding the k-th largest key: keys in higher bins are
 * kept, keys in lower bins dropped. Only the keys of that one bin (the
 * candidates, gathered in index order) go through the finer passes, which
 * narrow the threshold to one key value T; then keys above T are kept and,
 * of the keys equal to T, as many as still needed in index order: ties go
 * to the lower index. Short rows (RANK_MAX_KEYS_*) are ranked by comparison
 * instead (the same result). */
#include "imoe_internal.h"

typedef struct digit {
  int shift;
  int width;
} digit;

/* 11 + 11 + 10 bits: three passes over 32-bit keys with at most 2048 bins
 * (8 KiB, in L1). 16-bit keys take two 8-bit passes. */
static const digit plan32[] = {{21, 11}, {10, 11}, {0, 10}};
static const digit plan16[] = {{8, 8}, {0, 8}};

/* Scores cluster (probabilities share a handful of exponents), so many
 * keys fall in the same bin, and back-to-back increments of one counter
 * wait on each other. Four interleaved copies of the histogram break that
 * chain; they pay for their zeroing only on longer rows. */
#define HIST_COPIES 4
#define HIST_COPIES_MIN_KEYS IMOE_HIST_COPIES_MIN_KEYS

static void histogram_top(const uint32_t *keys, int64_t lo, int64_t hi, digit d, uint32_t *hist) {
  const uint32_t bins = 1u << d.width;
  const int sh = d.shift;
  if (hi - lo < HIST_COPIES_MIN_KEYS) {
    memset(hist, 0, bins * sizeof *hist);
    for (int64_t i = lo; i < hi; i++) hist[keys[i] >> sh]++;
    return;
  }
  memset(hist, 0, HIST_COPIES * bins * sizeof *hist);
  uint32_t *h1 = hist + bins, *h2 = h1 + bins, *h3 = h2 + bins;
  int64_t i = lo;
  for (; i + 4 <= hi; i += 4) {
    hist[keys[i] >> sh]++;
    h1[keys[i + 1] >> sh]++;
    h2[keys[i + 2] >> sh]++;
    h3[keys[i + 3] >> sh]++;
  }
  for (; i < hi; i++) hist[keys[i] >> sh]++;
  for (uint32_t b = 0; b < bins; b++) hist[b] += h1[b] + h2[b] + h3[b];
}

/* The bin, from the top, that holds the need-th largest counted key; need
 * becomes the number still to keep from that bin. */
static uint32_t find_bin(const uint32_t *hist, uint32_t bins, uint32_t *need) {
  uint32_t b = bins - 1;
  while (hist[b] < *need) *need -= hist[b--];
  return b;
}

/* Rows this short rank every key against the others: a radix pass zeroes
 * and walks its bins (2048 for 32-bit keys, 256 for 16-bit), more work than
 * n * n comparisons up to about these lengths (measured on x86-64). */
#define RANK_MAX_KEYS_32 IMOE_RANK_MAX_KEYS_32
#define RANK_MAX_KEYS_16 IMOE_RANK_MAX_KEYS_16
/* A row without bins (imoe_radix_hist_entries) is ranked for either key width. */
_Static_assert(RANK_MAX_KEYS_32 >= RANK_MAX_KEYS_16, "short 16-bit rows are short 32-bit rows");

/* kept[i] = 1 when fewer than k keys outrank keys[i] (larger, or equal at a
 * lower index): the radix select's result, by counting. */
static void mark_by_rank(const uint32_t *keys, int64_t lo, int64_t hi, int64_t k, uint8_t *kept) {
  for (int64_t i = lo; i < hi; i++) {
    const uint32_t key = keys[i];
    int64_t above = 0;
    for (int64_t j = lo; j < i; j++) above += keys[j] >= key;
    for (int64_t j = i + 1; j < hi; j++) above += keys[j] > key;
    kept[i] = above < k;
  }
}

void imoe_mark_top_k(const uint32_t *keys, int64_t lo, int64_t hi, int64_t k, int key_bits,
                     uint32_t *hist, uint32_t *cand, uint8_t *kept) {
  if (hi - lo <= (key_bits == 32 ? RANK_MAX_KEYS_32 : RANK_MAX_KEYS_16)) {
    mark_by_rank(keys, lo, hi, k, kept);
    return;
  }
  const digit *plan = key_bits == 32 ? plan32 : plan16;
  const int passes = key_bits == 32 ? 3 : 2;
  uint32_t need = (uint32_t)k;

  histogram_top(keys, lo, hi, plan[0], hist);
  const uint32_t top_bins = 1u << plan[0].width;
  const uint32_t top = find_bin(hist, top_bins, &need);
  const uint32_t in_top = hist[top];
  const int top_shift = plan[0].shift;

  /* Decided by the top digit alone; the candidates are gathered without a
   * branch, in index order. */
  int64_t count = 0;
  for (int64_t i = lo; i < hi; i++) {
    const uint32_t d = keys[i] >> top_shift;
    kept[i] = d > top;
    cand[count] = (uint32_t)i;
    count += d == top;
  }
  if (in_top == need) {
    for (int64_t j = 0; j < count; j++) kept[cand[j]] = 1;
    return;
  }

  uint32_t prefix = top;
  int shift = top_shift;
  for (int p = 1; p < passes; p++) {
    const uint32_t bins = 1u << plan[p].width, mask = bins - 1;
    const int sh = plan[p].shift;
    memset(hist, 0, bins * sizeof *hist);
    for (int64_t j = 0; j < count; j++) {
      const uint32_t key = keys[cand[j]];
      if ((key >> shift) == prefix) hist[(key >> sh) & mask]++;
    }
    const uint32_t b = find_bin(hist, bins, &need);
    prefix = (prefix << plan[p].width) | b;
    shift = sh;
    if (hist[b] == need) break; /* the whole bin is kept: no finer digit needed */
  }

  for (int64_t j = 0; j < count; j++) {
    const uint32_t d = keys[cand[j]] >> shift;
    if (d > prefix) {
      kept[cand[j]] = 1;
    } else if (d == prefix && need > 0) {
      kept[cand[j]] = 1;
      need--;
    }
  }
}
