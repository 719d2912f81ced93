/* Block-format helpers shared by quant_gemm.c and quant_panel.c: 16-float vectors (GCC
 * vector extensions: one AVX-512 register, two AVX2 ones, scalar code elsewhere), half
 * floats, and 16 bytes widened to 16 int32 lanes. */
#ifndef FLEETSERVE_QUANT_COMMON_H
#define FLEETSERVE_QUANT_COMMON_H
#include <string.h>

#include "gemm_tile.h"

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* Rows of x (DECODE_ROWS) times rows of W (NJ) per register tile on the decode path:
 * 16 + 8 of AVX-512's 32 vector registers; narrower targets hold a v16f in two or more
 * registers, so they take 2 x 2. */
#if defined(__AVX512F__)
#define DECODE_ROWS 4
#define NJ 4
#else
#define DECODE_ROWS 2
#define NJ 2
#endif
#define QMC (18 * MR)  /* rows of x per panel decode on the prefill path */

/* Prefetch of streamed weights, `dist` bytes ahead of [p, p + bytes): into L1 (prefetcht0).
 * The non-temporal hint (prefetchnta) it replaced kept the lines out of L2 and, on the
 * Xeon here, starved the L2 streamer: one thread read Q4_1 panels at 6 GB/s and a Q8_0
 * LM head at 9 GB/s, against 13-18 and 27 GB/s with T0 (docs/benchmarks.md, issue 25). */
#define PREFETCH_WEIGHTS(p, bytes, dist)                                                  \
    for (int64_t pf_ = 0; pf_ < (bytes); pf_ += 64)                                       \
    __builtin_prefetch((const char *)(p) + (dist) + pf_, 0, 3)

/* The same into L2 (prefetcht1): the dot kernels' second, farther stream where a block's
 * compute is short for its bytes (quant_dot_simd.c's prefetch_block). */
#define PREFETCH_WEIGHTS_L2(p, bytes, dist)                                               \
    for (int64_t pf_ = 0; pf_ < (bytes); pf_ += 64)                                       \
    __builtin_prefetch((const char *)(p) + (dist) + pf_, 0, 2)

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* 16 bytes widened to 16 int32 lanes. Bit fields are cut out after widening: x86 has
 * no byte-wide shifts. (GCC 12 turns a generic u8 -> i32 __builtin_convertvector into
 * scalar code, hence the intrinsics.) */
static inline v16i ld16(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    v16i r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    v16i r;
    for (int i = 0; i < 16; i++) r[i] = p[i];
    return r;
#endif
}

static inline v16f i2f(v16i v) { return __builtin_convertvector(v, v16f); }

static inline v16f ldf(const float *p) {
    v16f v;
    memcpy(&v, p, 64);
    return v;
}

static inline v16f splat(float f) { return (v16f){0} + f; }

/* 16 half floats -> 16 floats. */
static inline v16f h2f16(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
    v16f r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    v16f r;
    for (int i = 0; i < 16; i++) r[i] = h2f(p + 2 * i);
    return r;
#endif
}

/* 16 signed bytes widened to 16 int32 lanes. */
static inline v16i ld16s(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m256i lo = _mm256_cvtepi8_epi32(b), hi = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
    v16i r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    return (ld16(p) ^ 128) - 128;
#endif
}

/* The two 4-bit fields of bytes widened to int32 lanes (0..255), as floats. AVX-512
 * looks each nibble up in a 16-float table (vpermps reads only an index's low 4 bits):
 * one shuffle instead of mask + convert, and the shuffle runs on the port the FMAs
 * leave free. */
static inline void nibbles(v16i v, v16f *lo, v16f *hi) {
#if defined(__AVX512F__)
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    *lo = (v16f)_mm512_permutexvar_ps((__m512i)v, table);
    *hi = (v16f)_mm512_permutexvar_ps(_mm512_srli_epi32((__m512i)v, 4), table);
#else
    *lo = i2f(v & 15);
    *hi = i2f(v >> 4);
#endif
}

#endif
