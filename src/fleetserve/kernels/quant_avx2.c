/* The float32-activation panel kernel of quant_panel.c (Q4_0 / Q4_1 / Q8_0, panels of 16
 * rows) written for AVX2's 8-float registers, used when the target has AVX2 but not
 * AVX-512. Why: quant_panel.c's 16-float vectors become register pairs there, and its 4
 * partial sums per row (8 registers a row) spill at 2 rows: Q8_0 ran at ~7 GFLOP/s.
 * Here a panel is two halves of 8 rows; per x row and half, two partial sums (even and
 * odd inputs for Q8_0, low and high nibbles for Q4): 8 accumulators at 2 rows, 16 ymm
 * registers in all. Same arithmetic as quant_panel.c: quants times x in float32, block
 * scales applied once per block. */
#include "quant_common.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
#define PR 16
#define ROWS 2
#define PREFETCH 4096

static inline __attribute__((always_inline)) void dot2(int qtype, const uint8_t *panel,
                                                       int64_t nb, const float *x, int64_t ldx,
                                                       const float *xsum, int rows, float *out,
                                                       int64_t ldo, int cols) {
    const int64_t bb = PR * (qtype == Q8_0 ? 34 : qtype == Q4_1 ? 20 : 18);
    const int64_t head = qtype == Q4_1 ? 64 : 32;
    const __m256i m4 = _mm256_set1_epi32(15);
    __m256 acc[ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = panel + b * bb, *qs = pb + head;
        PREFETCH_WEIGHTS(pb, bb, PREFETCH);
        for (int h = 0; h < 2; h++) {
            __m256 t[ROWS][2];
            for (int r = 0; r < rows; r++) t[r][0] = t[r][1] = _mm256_setzero_ps();
            if (qtype == Q8_0) {
                for (int g = 0; g < 32; g += 2) {
                    for (int u = 0; u < 2; u++) {
                        const __m128i raw = _mm_loadl_epi64((const __m128i *)(qs + (g + u) * PR + 8 * h));
                        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
                        for (int r = 0; r < rows; r++)
                            t[r][u] = _mm256_fmadd_ps(
                                q, _mm256_broadcast_ss(x + r * ldx + b * 32 + g + u), t[r][u]);
                    }
                }
            } else {
                for (int g = 0; g < 16; g++) {
                    const __m128i raw = _mm_loadl_epi64((const __m128i *)(qs + g * PR + 8 * h));
                    const __m256i v = _mm256_cvtepu8_epi32(raw);
                    const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, m4));
                    const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
                    for (int r = 0; r < rows; r++) {
                        const float *xr = x + r * ldx + b * 32;
                        t[r][0] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(xr + g), t[r][0]);
                        t[r][1] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(xr + g + 16), t[r][1]);
                    }
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 16 * h)));
            for (int r = 0; r < rows; r++) {
                const float s = xsum[r * nb + b];
                acc[r][h] = _mm256_fmadd_ps(d, _mm256_add_ps(t[r][0], t[r][1]), acc[r][h]);
                if (qtype == Q4_1) {
                    const __m256 m =
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 32 + 16 * h)));
                    acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(s), acc[r][h]);
                }
                if (qtype == Q4_0)
                    acc[r][h] = _mm256_fnmadd_ps(d, _mm256_set1_ps(8.f * s), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float tmp[PR];
        _mm256_storeu_ps(tmp, acc[r][0]);
        _mm256_storeu_ps(tmp + 8, acc[r][1]);
        memcpy(out + r * ldo, tmp, (size_t)cols * sizeof(float));
    }
}

#define CASES(QT)                                                                       \
    if (rows == 1) dot2(QT, panel, nb, x, ldx, xsum, 1, out, ldo, cols);                \
    else dot2(QT, panel, nb, x, ldx, xsum, 2, out, ldo, cols);

/* One panel times `rows` (1 or 2) rows of x: out[r][0..cols). */
void quant_avx2_panel_dot(int qtype, const uint8_t *panel, int64_t nb, const float *x,
                          int64_t ldx, const float *xsum, int rows, float *out, int64_t ldo,
                          int cols) {
    switch (qtype) {
    case Q8_0: CASES(Q8_0) break;
    case Q4_0: CASES(Q4_0) break;
    case Q4_1: CASES(Q4_1) break;
    }
}
#endif
