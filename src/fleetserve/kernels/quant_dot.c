/* The dot layout (quant_dot.h): repacking GGUF rows into it, decoding it back to floats,
 * quantizing rows of x to int8 blocks, and the decode-sized GEMM's driver. The per-panel
 * integer kernels are in quant_dot_simd.c. */
#include <math.h>

#include "quant_common.h"
#include "quant_dot.h"

#define PR 16 /* rows per panel */

static int64_t gguf_block_bytes(int qtype) { return qtype == Q8_0 ? 34 : qtype == Q4_1 ? 20 : 18; }
static int64_t head_bytes(int qtype) { return qtype == Q4_1 ? 64 : 32; }

/* rows: n rows of row_bytes in GGUF order; out: ceil(n / 16) panels, zero rows past n. */
void quant_dot_repack(int fmt, const uint8_t *rows, int64_t n, int64_t row_bytes, uint8_t *out,
                      int threads) {
    const int qtype = fmt & ~QDOT;
    const int64_t bb = gguf_block_bytes(qtype), nb = row_bytes / bb, head = head_bytes(qtype);
    const int64_t groups = (bb - head / 16) / 4; /* 4-byte groups of quants per block */
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
                for (int64_t g = 0; g < groups; g++)
                    memcpy(pb + head + g * 4 * PR + 4 * r, qs + 4 * g, 4);
            }
        }
    }
}

/* Per block of 32: d = max|x| / 127, q = x / d rounded to nearest (ties to even, the
 * CPU's default mode), so |q| <= 127 and d * q is within d / 2 of x. */
void quant_dot_quantize_x(const float *x, int64_t ldx, int64_t m, int64_t k, qdot_xblock *xb) {
    const int64_t nb = k / 32;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * ldx + b * 32;
            qdot_xblock *o = xb + r * nb + b;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
            const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            int32_t s = 0;
            for (int i = 0; i < 32; i++) {
                const int32_t q = (int32_t)lrintf(v[i] * id);
                o->q[i] = (int8_t)q;
                s += q;
            }
            o->d = d;
            o->s = s;
        }
    }
}

/* Panels [p0, p1) of W times the m quantized rows of x: one thread's share. */
void quant_dot_panels(int fmt, const qdot_xblock *xb, int64_t m, int64_t nb, const uint8_t *w,
                      int64_t row_bytes, float *out, int64_t ldo, int64_t n, int64_t p0,
                      int64_t p1) {
    const int qtype = fmt & ~QDOT, step = quant_dot_rows_per_call();
    for (int64_t p = p0; p < p1; p++) {
        const int cols = (int)(n - p * PR < PR ? n - p * PR : PR);
        for (int64_t r0 = 0; r0 < m; r0 += step) {
            const int rows = (int)(m - r0 < step ? m - r0 : step);
            quant_dot_panel(qtype, w + p * PR * row_bytes, nb, xb + r0 * nb, nb, rows,
                            out + r0 * ldo + p * PR, ldo, cols);
        }
    }
}

void quant_dot_share(int fmt, const qdot_xblock *xb, const uint8_t *w, int64_t row_bytes,
                     float *out, int64_t ldo, int64_t m, int64_t n, int64_t k) {
    const int64_t nb = k / 32, panels = (n + PR - 1) / PR;
    /* ~16 KB of weights per unit of work, as quant_panel_share: a thread slowed by a
     * neighbour on its core leaves the rest of the matrix to the others. */
    int64_t chunk = 16384 / (PR * row_bytes);
    if (chunk < 1) chunk = 1;
    const int64_t chunks = (panels + chunk - 1) / chunk;
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t p1 = (c + 1) * chunk < panels ? (c + 1) * chunk : panels;
        quant_dot_panels(fmt, xb, m, nb, w, row_bytes, out, ldo, n, c * chunk, p1);
    }
}

/* quant_dot_quantize_x over the team: rows split (an orphaned `omp for`, ending in the
 * team's barrier), each row quantized by the same code as a whole call's. */
void quant_dot_quantize_share(const float *x, int64_t ldx, int64_t m, int64_t k,
                              qdot_xblock *xb) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) quant_dot_quantize_x(x + r * ldx, ldx, 1, k, xb + r * (k / 32));
}

/* out[m, n] = x[m, k] @ W^T with x quantized to int8 blocks first (any m). Returns 0, or
 * -1 when the quantized rows could not be allocated. */
int quant_dot_gemm(int fmt, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                   float *out, int64_t ldo, int64_t m, int64_t n, int64_t k, int threads) {
    qdot_xblock *xb = malloc((size_t)(m * (k / 32) + 1) * sizeof(qdot_xblock));
    if (!xb) return -1;
#pragma omp parallel num_threads(threads)
    {
        quant_dot_quantize_share(x, ldx, m, k, xb);
        quant_dot_share(fmt, xb, w, row_bytes, out, ldo, m, n, k);
    }
    free(xb);
    return 0;
}

/* Panel p decoded to floats at dst[kk * ld + j] for its 16 rows j (quant_panel_decode's
 * callers; quant_gemm itself multiplies every row count in integers). A 32-bit lane of a
 * group holds row j's inputs 4g .. 4g + 3, one per byte. */
void quant_dot_decode(int fmt, const uint8_t *w, int64_t row_bytes, int64_t p, int64_t k,
                      float *dst, int64_t ld) {
    const int qtype = fmt & ~QDOT;
    const int64_t bb = PR * gguf_block_bytes(qtype), head = head_bytes(qtype);
    const uint8_t *panel = w + p * PR * row_bytes;
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *pb = panel + b * bb, *qs = pb + head;
        const v16f d = h2f16(pb);
        const v16f m = qtype == Q4_1 ? h2f16(pb + 32) : d * -8.f;
        float *o = dst + b * 32 * ld;
        for (int g = 0; g < (qtype == Q8_0 ? 8 : 4); g++) {
            v16i v;
            memcpy(&v, qs + g * 64, 64);
            for (int j = 0; j < 4; j++) {
                v16f lo, hi;
                if (qtype == Q8_0) {
                    lo = i2f((v << (24 - 8 * j)) >> 24) * d; /* sign-extending byte j */
                    memcpy(o + (4 * g + j) * ld, &lo, 64);
                    continue;
                }
                lo = i2f((v >> (8 * j)) & 15) * d + m;
                hi = i2f((v >> (8 * j + 4)) & 15) * d + m;
                memcpy(o + (4 * g + j) * ld, &lo, 64);
                memcpy(o + (16 + 4 * g + j) * ld, &hi, 64);
            }
        }
    }
}

/* Row j of a matrix in the dot layout as k floats (embedding lookups, references). */
void quant_dot_row(int fmt, const uint8_t *w, int64_t row_bytes, int64_t j, int64_t k,
                   float *dst) {
    const int qtype = fmt & ~QDOT;
    const int64_t bb = PR * gguf_block_bytes(qtype), head = head_bytes(qtype);
    const int r = (int)(j % PR);
    const uint8_t *panel = w + (j / PR) * PR * row_bytes;
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *pb = panel + b * bb, *qs = pb + head;
        const float d = h2f(pb + 2 * r);
        float *o = dst + b * 32;
        if (qtype == Q8_0) {
            for (int i = 0; i < 32; i++) o[i] = d * (float)(int8_t)qs[(i / 4) * 64 + 4 * r + i % 4];
            continue;
        }
        const float m = qtype == Q4_1 ? h2f(pb + 32 + 2 * r) : -8.f * d;
        for (int i = 0; i < 16; i++) {
            const uint8_t q = qs[(i / 4) * 64 + 4 * r + i % 4];
            o[i] = (float)(q & 15) * d + m;
            o[i + 16] = (float)(q >> 4) * d + m;
        }
    }
}
