/* floats.h: F16 and BF16 to and from F32, as the GPU and torch convert
 * (round to nearest even, NaN kept NaN, subnormals kept), and typed loads
 * and stores of the three float dtypes. Internal to the C core. */
#ifndef IMOE_FLOATS_H
#define IMOE_FLOATS_H

#include <stdint.h>
#include <string.h>

#include "idempotent_moe.h"

static inline float imoe_f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint32_t imoe_bits_from_f32(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float imoe_bf16_to_f32(uint16_t h) { return imoe_f32_from_bits((uint32_t)h << 16); }

static inline uint16_t imoe_f32_to_bf16(float f) {
  const uint32_t u = imoe_bits_from_f32(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  /* a select, not a branch: loops over it vectorise */
  return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

static inline float imoe_f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1Fu) return imoe_f32_from_bits(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return imoe_f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
  /* zero or subnormal: man x 2^-24, exact in F32 */
  const float mag = (float)man * 5.9604644775390625e-8f;
  return sign ? -mag : mag;
}

static inline uint16_t imoe_f32_to_f16(float f) {
  const uint32_t u = imoe_bits_from_f32(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to >= 2^16: infinity */
  if (a < 0x38800000u) {                                   /* below 2^-14: subnormal or zero */
    const uint32_t shift = 126u - (a >> 23);               /* 14 .. 126 */
    if (shift > 24u) return sign;
    const uint32_t man = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t q = man >> shift, rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return (uint16_t)(sign | (q + (rem > half || (rem == half && (q & 1u)))));
  }
  const uint32_t r = a - 0x38000000u; /* rebias 127 -> 15 */
  return (uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
}

/* Element i of a float array of dtype F32/F16/BF16. */
static inline float imoe_load_float(const char *p, imoe_dtype dtype) {
  if (dtype == IMOE_DTYPE_F32) {
    float v;
    memcpy(&v, p, sizeof v);
    return v;
  }
  uint16_t h;
  memcpy(&h, p, sizeof h);
  return dtype == IMOE_DTYPE_F16 ? imoe_f16_to_f32(h) : imoe_bf16_to_f32(h);
}

/* v rounded to dtype (F32: unchanged), back in F32. */
static inline float imoe_round_to(float v, imoe_dtype dtype) {
  if (dtype == IMOE_DTYPE_F16) return imoe_f16_to_f32(imoe_f32_to_f16(v));
  if (dtype == IMOE_DTYPE_BF16) return imoe_bf16_to_f32(imoe_f32_to_bf16(v));
  return v;
}

static inline void imoe_store_float(char *p, imoe_dtype dtype, float v) {
  if (dtype == IMOE_DTYPE_F32) {
    memcpy(p, &v, sizeof v);
    return;
  }
  const uint16_t h = dtype == IMOE_DTYPE_F16 ? imoe_f32_to_f16(v) : imoe_f32_to_bf16(v);
  memcpy(p, &h, sizeof h);
}

/* F16 loops with the x86 F16C conversions (f16c.c): call them only where
 * imoe_have_f16c() says so; they give the bits of the portable loops.
 *   imoe_f16c_accumulate  acc[h] += v[h] x w (round_term: the product
 *                         rounded to F16 first), h < n
 *   imoe_f16c_store       out[h] = acc[h] rounded to F16, h < n */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define IMOE_F16C 1
int imoe_have_f16c(void);
void imoe_f16c_accumulate(float *acc, const uint16_t *v, float w, int64_t n, int round_term);
void imoe_f16c_store(uint16_t *out, const float *acc, int64_t n);
#else
#define IMOE_F16C 0
static inline int imoe_have_f16c(void) { return 0; }
static inline void imoe_f16c_accumulate(float *acc, const uint16_t *v, float w, int64_t n, int round_term) {
  (void)acc, (void)v, (void)w, (void)n, (void)round_term;
}
static inline void imoe_f16c_store(uint16_t *out, const float *acc, int64_t n) { (void)out, (void)acc, (void)n; }
#endif

#endif /* IMOE_FLOATS_H */
