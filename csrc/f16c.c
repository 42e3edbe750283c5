/* f16c.c: the CPU core's F16 loops with the x86 F16C conversions (eight
 * lanes at a time, AVX), chosen at run time where the processor and the OS
 * have them (imoe_have_f16c); elsewhere the portable loops of floats.h run.
 * The bits are the same either way: both convert by IEEE round to nearest
 * even (NaN kept NaN, subnormals kept), and every product is rounded before
 * it is added (no FMA here; the core is built with -ffp-contract=off). */
#include "floats.h"

#if IMOE_F16C
#include <cpuid.h>
#include <immintrin.h>

/* F16C and AVX on the processor, and the AVX state saved by the OS. */
static int detect(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const unsigned osxsave = 1u << 27, avx = 1u << 28, f16c = 1u << 29;
  if ((c & (osxsave | avx | f16c)) != (osxsave | avx | f16c)) return 0;
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 6u) == 6u; /* XMM and YMM state */
}

int imoe_have_f16c(void) {
  static int have = -1; /* every thread computes the same value */
  int h = __atomic_load_n(&have, __ATOMIC_RELAXED);
  if (h < 0) {
    h = detect();
    __atomic_store_n(&have, h, __ATOMIC_RELAXED);
  }
  return h;
}

#define IMOE_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

__attribute__((target("avx,f16c"))) void imoe_f16c_accumulate(float *acc, const uint16_t *v, float w,
                                                              int64_t n, int round_term) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t h = 0;
  for (; h + 8 <= n; h += 8) {
    __m256 p = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(v + h))), wv);
    if (round_term) p = _mm256_cvtph_ps(_mm256_cvtps_ph(p, IMOE_RNE));
    _mm256_storeu_ps(acc + h, _mm256_add_ps(_mm256_loadu_ps(acc + h), p));
  }
  for (; h < n; h++) {
    const float p = imoe_f16_to_f32(v[h]) * w;
    acc[h] += round_term ? imoe_f16_to_f32(imoe_f32_to_f16(p)) : p;
  }
}

__attribute__((target("avx,f16c"))) void imoe_f16c_store(uint16_t *out, const float *acc, int64_t n) {
  int64_t h = 0;
  for (; h + 8 <= n; h += 8)
    _mm_storeu_si128((__m128i *)(void *)(out + h), _mm256_cvtps_ph(_mm256_loadu_ps(acc + h), IMOE_RNE));
  for (; h < n; h++) out[h] = imoe_f32_to_f16(acc[h]);
}

#else
typedef int imoe_f16c_unused; /* ISO C wants a declaration in every unit */
#endif
