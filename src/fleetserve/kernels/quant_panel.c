/* Q4_0, Q4_1 and Q8_0 weights re-interleaved at load into panels of 16 output rows: the
 * same bytes as the GGUF blocks (same quants, same half-float scales), in the order a
 * 16-lane vector wants them.
 *
 * Why: in GGUF's row order a vector runs along k, so every block of 32 weights pays for
 * its scales (a half-float convert and a broadcast, for d and again for m) and every
 * output ends in a horizontal sum. With lanes running across 16 output rows, one k step
 * is one widen + convert + FMA for 16 outputs, the scales of 16 rows convert in one
 * instruction per block, and no horizontal sums remain: ~2x fewer instructions per
 * weight on the decode path, which is instruction bound on 2 cores.
 *
 * Layout, per panel of 16 rows (rows past n are zero blocks), per block b of 32 inputs:
 *   Q4_0 (288 B): d[16] half | qs[16][16]   qs[g][r] = row r's byte g of block b
 *   Q4_1 (320 B): d[16] | m[16] | qs[16][16]    (low nibble: input g, high: g + 16)
 *   Q8_0 (544 B): d[16] | qs[32][16]        qs[g][r] = row r's int8 g of block b
 * A panel is 16 * row_bytes long; panel p starts at p * 16 * row_bytes.
 */
#include "quant_common.h"
#include "quant_dot.h"

#define PR 16 /* rows per panel */
/* quant_gemm() sends the dot layout to quant_dot_gemm() at every row count, so the
 * decode path below never sees it. */
#define PREFETCH 4096
/* Rows one pass of panel_dot takes (AVX-512: 6 x 4 partial sums + 6 accumulators fit
 * its 32 vector registers beside the decoded weights). A row's arithmetic does not
 * depend on how many rows share its pass. */
#define ONE_PASS_ROWS 6

/* The dot layout (quant_dot.h) is panelled too: prefill decodes it here, by its own code. */
int quant_panel_layout(int qtype) {
    return qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 || quant_dot_layout(qtype);
}

static int64_t head_bytes(int qtype) { return qtype == Q4_1 ? 64 : 32; }

/* rows: n rows of row_bytes in GGUF order; out: ceil(n / 16) panels. */
void quant_repack(int qtype, const uint8_t *rows, int64_t n, int64_t row_bytes, uint8_t *out,
                  int threads) {
    const int64_t bb = qtype == Q8_0 ? 34 : qtype == Q4_1 ? 20 : 18; /* GGUF block bytes */
    const int64_t nb = row_bytes / bb, head = head_bytes(qtype), nq = bb - head / 16;
    const int64_t panels = (n + PR - 1) / PR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        uint8_t *dst = out + p * PR * row_bytes;
        memset(dst, 0, PR * row_bytes);
        for (int r = 0; r < PR && p * PR + r < n; r++) {
            const uint8_t *src = rows + (p * PR + r) * row_bytes;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = src + b * bb;
                uint8_t *pb = dst + b * PR * bb;
                memcpy(pb + 2 * r, blk, 2); /* d */
                if (qtype == Q4_1) memcpy(pb + 32 + 2 * r, blk + 2, 2); /* m */
                const uint8_t *qs = blk + head / 16;
                for (int64_t g = 0; g < nq; g++) pb[head + g * PR + r] = qs[g];
            }
        }
    }
}

/* One panel times `rows` rows of x: out[r][0..cols). xsum[r * nb + b]: the sum of x row
 * r over block b (the m / -8 terms). Four partial sums per row break the FMA chain. */
static inline __attribute__((always_inline)) void panel_dot(int qtype, const uint8_t *panel,
                                                            int64_t nb, const float *x,
                                                            int64_t ldx, const float *xsum,
                                                            int rows, float *out, int64_t ldo,
                                                            int cols) {
    const int64_t bb = PR * (qtype == Q8_0 ? 34 : qtype == Q4_1 ? 20 : 18);
    const int64_t head = head_bytes(qtype);
    v16f acc[ONE_PASS_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = (v16f){0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = panel + b * bb;
        const uint8_t *qs = pb + head;
        /* Weights stream from memory once per step: ask for them PREFETCH bytes ahead
         * (past the panel's end is the next panel; a prefetch never faults). */
        PREFETCH_WEIGHTS(pb, bb, PREFETCH);
        v16f t[ONE_PASS_ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 4; c++) t[r][c] = (v16f){0};
        /* Partial sums indexed by constants only: an index computed from g (g & 1) made
         * GCC keep them on the stack. */
        if (qtype == Q8_0) {
            for (int g = 0; g < 32; g += 4) {
                for (int u = 0; u < 4; u++) {
                    const v16f q = i2f(ld16s(qs + (g + u) * PR));
                    for (int r = 0; r < rows; r++) t[r][u] += q * x[r * ldx + b * 32 + g + u];
                }
            }
        } else {
            for (int g = 0; g < 16; g += 2) {
                for (int u = 0; u < 2; u++) {
                    v16f lo, hi;
                    nibbles(ld16(qs + (g + u) * PR), &lo, &hi);
                    for (int r = 0; r < rows; r++) {
                        const float *xr = x + r * ldx + b * 32;
                        t[r][u] += lo * xr[g + u];
                        t[r][2 + u] += hi * xr[g + u + 16];
                    }
                }
            }
        }
        const v16f d = h2f16(pb);
        for (int r = 0; r < rows; r++) {
            acc[r] += d * ((t[r][0] + t[r][1]) + (t[r][2] + t[r][3]));
            if (qtype == Q4_1) acc[r] += h2f16(pb + 32) * xsum[r * nb + b];
            if (qtype == Q4_0) acc[r] -= d * (8.f * xsum[r * nb + b]);
        }
    }
    for (int r = 0; r < rows; r++) {
        if (cols == PR) {
            memcpy(out + r * ldo, &acc[r], 64);
        } else {
            for (int c = 0; c < cols; c++) out[r * ldo + c] = acc[r][c];
        }
    }
}

#define PANEL_CASES(QT)                                                                 \
    switch (rows) {                                                                     \
    case 1: panel_dot(QT, panel, nb, x, ldx, xsum, 1, out, ldo, cols); break;           \
    case 2: panel_dot(QT, panel, nb, x, ldx, xsum, 2, out, ldo, cols); break;           \
    case 3: panel_dot(QT, panel, nb, x, ldx, xsum, 3, out, ldo, cols); break;           \
    case 4: panel_dot(QT, panel, nb, x, ldx, xsum, 4, out, ldo, cols); break;           \
    case 5: panel_dot(QT, panel, nb, x, ldx, xsum, 5, out, ldo, cols); break;           \
    default: panel_dot(QT, panel, nb, x, ldx, xsum, 6, out, ldo, cols); break;          \
    }

#if defined(__AVX2__) && !defined(__AVX512F__)
/* quant_avx2.c: this kernel in 8-float registers (DECODE_ROWS is 2 there). */
void quant_avx2_panel_dot(int qtype, const uint8_t *panel, int64_t nb, const float *x,
                          int64_t ldx, const float *xsum, int rows, float *out, int64_t ldo,
                          int cols);
#endif

static void panel_dot_any(int qtype, const uint8_t *panel, int64_t nb, const float *x,
                          int64_t ldx, const float *xsum, int rows, float *out, int64_t ldo,
                          int cols) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    quant_avx2_panel_dot(qtype, panel, nb, x, ldx, xsum, rows, out, ldo, cols);
    return;
#endif
    switch (qtype) {
    case Q8_0: PANEL_CASES(Q8_0) break;
    case Q4_0: PANEL_CASES(Q4_0) break;
    case Q4_1: PANEL_CASES(Q4_1) break;
    }
}

/* xsum[r * (k / 32) + b]: the sum of x row r over block b (the m / -8 terms). */
__attribute__((noinline)) void quant_panel_xsum(const float *x, int64_t ldx, int64_t m, int64_t k, float *xsum) {
    const int64_t nb = k / 32;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            float s = 0.f;
            for (int i = 0; i < 32; i++) s += x[r * ldx + b * 32 + i];
            xsum[r * nb + b] = s;
        }
}

/* The calling thread's share of the decode-sized GEMM on panels (m rows of x, any m; 4
 * at a time): an orphaned `omp for`, so inside a parallel region the team splits the
 * work (ending in its barrier) and outside one the caller does all of it. */
__attribute__((noinline)) void quant_panel_share(
    int qtype, const float *x, int64_t ldx, const float *xsum, const uint8_t *w, int64_t row_bytes, float *out, int64_t ldo,
                       int64_t m, int64_t n, int64_t k) {
    const int64_t nb = k / 32, panels = (n + PR - 1) / PR;
    /* ~16 KB of weights per unit of work: a thread slowed by a neighbour on its core
     * leaves the rest of the matrix to the others. */
    int64_t chunk = 16384 / (PR * row_bytes);
    if (chunk < 1) chunk = 1;
    const int64_t chunks = (panels + chunk - 1) / chunk;
    /* Up to ONE_PASS_ROWS rows in one pass over each panel (each decoded once);
     * more in passes of 4 (past 6 rows the partial sums spill: 2x slower at 8). */
    const int rows4 = DECODE_ROWS < 4 ? DECODE_ROWS : m <= ONE_PASS_ROWS ? (int)m : 4;
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t p1 = (c + 1) * chunk < panels ? (c + 1) * chunk : panels;
        for (int64_t p = c * chunk; p < p1; p++) {
            const int cols = (int)(n - p * PR < PR ? n - p * PR : PR);
            for (int64_t r0 = 0; r0 < m; r0 += rows4) {
                const int rows = (int)(m - r0 < rows4 ? m - r0 : rows4);
                panel_dot_any(qtype, w + p * PR * row_bytes, nb, x + r0 * ldx, ldx,
                              xsum + r0 * nb, rows, out + r0 * ldo + p * PR, ldo, cols);
            }
        }
    }
}

/* The decode-sized GEMM on panels. Returns 0, or -1 when the block sums could not be
 * allocated. */
int quant_panel_gemm(int qtype, const float *x, int64_t ldx, const uint8_t *w,
                     int64_t row_bytes, float *out, int64_t ldo, int64_t m, int64_t n,
                     int64_t k, int threads) {
    float *xsum = malloc((size_t)(m * (k / 32) + 1) * sizeof(float));
    if (!xsum) return -1;
    quant_panel_xsum(x, ldx, m, k, xsum);
#pragma omp parallel num_threads(threads)
    quant_panel_share(qtype, x, ldx, xsum, w, row_bytes, out, ldo, m, n, k);
    free(xsum);
    return 0;
}

/* Panel p decoded to floats at dst[kk * ld + j] for its 16 rows j (the prefill path's
 * [k][NR] buffer takes NR / 16 panels side by side). */
void quant_panel_decode(int qtype, const uint8_t *w, int64_t row_bytes, int64_t p, int64_t k,
                        float *dst, int64_t ld) {
    if (quant_dot_layout(qtype)) {
        quant_dot_decode(qtype, w, row_bytes, p, k, dst, ld);
        return;
    }
    const int64_t bb = PR * (qtype == Q8_0 ? 34 : qtype == Q4_1 ? 20 : 18);
    const int64_t head = head_bytes(qtype);
    const uint8_t *panel = w + p * PR * row_bytes;
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *pb = panel + b * bb, *qs = pb + head;
        const v16f d = h2f16(pb);
        float *o = dst + b * 32 * ld;
        if (qtype == Q8_0) {
            for (int g = 0; g < 32; g++) {
                const v16f v = i2f(ld16s(qs + g * PR)) * d;
                memcpy(o + g * ld, &v, 64);
            }
            continue;
        }
        const v16f m = qtype == Q4_1 ? h2f16(pb + 32) : d * -8.f;
        for (int g = 0; g < 16; g++) {
            const v16i v = ld16(qs + g * PR);
            const v16f lo = i2f(v & 15) * d + m, hi = i2f(v >> 4) * d + m;
            memcpy(o + g * ld, &lo, 64);
            memcpy(o + (g + 16) * ld, &hi, 64);
        }
    }
}

/* Row j of a panelled matrix as k floats (embedding lookups, references). */
void quant_panel_row(int qtype, const uint8_t *w, int64_t row_bytes, int64_t j, int64_t k,
                     float *dst) {
    if (quant_dot_layout(qtype)) {
        quant_dot_row(qtype, w, row_bytes, j, k, dst);
        return;
    }
    const int64_t bb = PR * (qtype == Q8_0 ? 34 : qtype == Q4_1 ? 20 : 18);
    const int64_t head = head_bytes(qtype);
    const int r = (int)(j % PR);
    const uint8_t *panel = w + (j / PR) * PR * row_bytes;
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *pb = panel + b * bb, *qs = pb + head;
        const float d = h2f(pb + 2 * r);
        float *o = dst + b * 32;
        if (qtype == Q8_0) {
            for (int g = 0; g < 32; g++) o[g] = d * (float)(int8_t)qs[g * PR + r];
            continue;
        }
        const float m = qtype == Q4_1 ? h2f(pb + 32 + 2 * r) : -8.f * d;
        for (int g = 0; g < 16; g++) {
            const uint8_t q = qs[g * PR + r];
            o[g] = (float)(q & 15) * d + m;
            o[g + 16] = (float)(q >> 4) * d + m;
        }
    }
}
