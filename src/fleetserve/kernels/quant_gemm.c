/* out = x @ W^T (+ bias) with W kept in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
 * Q5_K, Q6_K), float32 activations and outputs.
 *
 * Why: a decode step streams every weight from memory once. In float32 SmolLM2-135M is
 * 540 MB per token; in its GGUF file (Q4_1 + a Q8_0 embedding) under 100 MB. The
 * weights stay as the file has them, one row of blocks per output feature (blocks run
 * along the input features), and are decoded in registers right before use:
 *
 *   decode-sized (m <= DECODE_ROWS): each thread takes runs of weight rows; per block of
 *     32 inputs it decodes two 16-float vectors and multiplies them into every x row.
 *     Accumulators run along k, so each output ends in one horizontal sum.
 *   prefill-sized: per panel of NR weight rows, a thread decodes the panel once into a
 *     float32 buffer in gemm.c's layout ([k][NR]) and runs the float32 register tile of
 *     gemm_tile.h over a block of up to QMC rows of x: the decode is paid once per
 *     QMC rows, the multiply runs at the float32 kernel's speed.
 *
 * Block layouts (ggml's; d, dmin, m are IEEE half floats, little-endian):
 *   Q8_0  34 B / 32:  d, int8 q[32]                     w = d*q
 *   Q4_0  18 B / 32:  d, u8 qs[16] (lo nibble: 0..15,   w = d*(q - 8)
 *                     hi nibble: 16..31)
 *   Q4_1  20 B / 32:  d, m, u8 qs[16] (as Q4_0)         w = d*q + m
 *   Q5_0  22 B / 32:  d, u32 qh (bit i: 5th bit of     w = d*(q - 16)
 *                     weight i), qs[16] (as Q4_0)
 *   Q5_1  24 B / 32:  d, m, qh, qs[16] (as Q5_0)       w = d*q + m
 *   Q4_K 144 B / 256: d, dmin, scales[12] (6-bit scale and min per sub-block of 32),
 *                     qs[128] (sub-blocks 2i, 2i+1: lo, hi nibbles of qs[32i..32i+31])
 *                                                       w = d*sc*q - dmin*mn
 *   Q5_K 176 B / 256: as Q4_K plus qh[32] (bit j of qh[l]: 5th bit of sub-block j, elem l)
 *   Q6_K 210 B / 256: ql[128], qh[64], int8 scales[16], d   w = d*sc*(q - 32)
 * Vectors are GCC vector extensions of 16 floats: one AVX-512 register, two AVX2
 * registers, or scalar code on other targets; the build's -march=native picks.
 */
#include "quant_common.h"
#include "quant_dot.h"

/* quant_panel.c: Q4_0 / Q4_1 / Q8_0 are multiplied in 16-row panels. */
int quant_panel_layout(int qtype);
int quant_panel_gemm(int qtype, const float *x, int64_t ldx, const uint8_t *w,
                     int64_t row_bytes, float *out, int64_t ldo, int64_t m, int64_t n,
                     int64_t k, int threads);
void quant_panel_decode(int qtype, const uint8_t *w, int64_t row_bytes, int64_t p, int64_t k,
                        float *dst, int64_t ld);
void quant_panel_row(int qtype, const uint8_t *w, int64_t row_bytes, int64_t j, int64_t k,
                     float *dst);
void quant_panel_xsum(const float *x, int64_t ldx, int64_t m, int64_t k, float *xsum);
void quant_panel_share(int qtype, const float *x, int64_t ldx, const float *xsum,
                       const uint8_t *w, int64_t row_bytes, float *out, int64_t ldo,
                       int64_t m, int64_t n, int64_t k);

/* 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block (ggml's packing). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Decode sub-block `sb` (32 weights) of one row into w0 (weights 0..15) and w1 (16..31).
 * Inlined with a constant qtype into each kernel below. */
static inline __attribute__((always_inline)) void deq32(int qtype, const uint8_t *row,
                                                        int64_t sb, v16f *w0, v16f *w1) {
    switch (qtype) {
    case Q8_0: {
        const uint8_t *p = row + sb * 34;
        const v16f d = splat(h2f(p));
        *w0 = i2f((ld16(p + 2) ^ 128) - 128) * d;
        *w1 = i2f((ld16(p + 18) ^ 128) - 128) * d;
        return;
    }
    case Q4_0: {
        const uint8_t *p = row + sb * 18;
        const v16f d = splat(h2f(p));
        const v16i q = ld16(p + 2);
        *w0 = i2f((q & 15) - 8) * d;
        *w1 = i2f((q >> 4) - 8) * d;
        return;
    }
    case Q4_1: {
        const uint8_t *p = row + sb * 20;
        const v16f d = splat(h2f(p)), m = splat(h2f(p + 2));
        const v16i q = ld16(p + 4);
        *w0 = i2f(q & 15) * d + m;
        *w1 = i2f(q >> 4) * d + m;
        return;
    }
    case Q5_0:
    case Q5_1: {
        /* The 5th bit of weight i is bit i of qh (a little-endian uint32). */
        const int has_m = qtype == Q5_1;
        const uint8_t *p = row + sb * (has_m ? 24 : 22);
        const v16f d = splat(h2f(p));
        uint32_t qh;
        memcpy(&qh, p + 2 + 2 * has_m, 4);
        const v16i lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const v16i h = (v16i){0} + (int32_t)qh;
        const v16i q = ld16(p + 6 + 2 * has_m);
        const v16i a = (q & 15) | (((h >> lanes) & 1) << 4);
        const v16i b = (q >> 4) | (((h >> (lanes + 16)) & 1) << 4);
        if (has_m) {
            const v16f m = splat(h2f(p + 2));
            *w0 = i2f(a) * d + m;
            *w1 = i2f(b) * d + m;
        } else {
            *w0 = i2f(a - 16) * d;
            *w1 = i2f(b - 16) * d;
        }
        return;
    }
    case Q4_K:
    case Q5_K: {
        const int j = (int)(sb & 7);
        const uint8_t *p = row + (sb >> 3) * (qtype == Q4_K ? 144 : 176);
        int sc, mn;
        scale_min_k4(j, p + 4, &sc, &mn);
        const v16f d = splat(h2f(p) * sc), dm = splat(h2f(p + 2) * mn);
        const uint8_t *qs = p + (qtype == Q4_K ? 16 : 48) + (j >> 1) * 32;
        const int shift = (j & 1) * 4;
        v16i a = (ld16(qs) >> shift) & 15, b = (ld16(qs + 16) >> shift) & 15;
        if (qtype == Q5_K) {
            const uint8_t *qh = p + 16;
            a |= ((ld16(qh) >> j) & 1) << 4;
            b |= ((ld16(qh + 16) >> j) & 1) << 4;
        }
        *w0 = i2f(a) * d - dm;
        *w1 = i2f(b) * d - dm;
        return;
    }
    case Q6_K: {
        const int j = (int)(sb & 7), s = j & 3;
        const uint8_t *p = row + (sb >> 3) * 210;
        const uint8_t *ql = p + (j >> 2) * 64 + (s & 1) * 32;
        const uint8_t *qh = p + 128 + (j >> 2) * 32;
        const int8_t *scales = (const int8_t *)(p + 192) + (j >> 2) * 8 + 2 * s;
        const float d = h2f(p + 208);
        const int lo_shift = (s >> 1) * 4, hi_shift = 2 * s;
        const v16i a = ((ld16(ql) >> lo_shift) & 15) | (((ld16(qh) >> hi_shift) & 3) << 4);
        const v16i b =
            ((ld16(ql + 16) >> lo_shift) & 15) | (((ld16(qh + 16) >> hi_shift) & 3) << 4);
        *w0 = i2f(a - 32) * splat(d * scales[0]);
        *w1 = i2f(b - 32) * splat(d * scales[1]);
        return;
    }
    }
}

static inline float hsum(v16f v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* out[r][j] for r < rows and j in [j0, j1): the decode-sized kernel. NJ weight rows at
 * a time share each load of x, and their rows*NJ accumulators are independent chains:
 * with one chain the FMA latency, not the decoding, set the pace (2x slower at m=1). */
static inline __attribute__((always_inline)) void dot_rows(int qtype, const float *x,
                                                           int64_t ldx, const uint8_t *w,
                                                           int64_t row_bytes, int64_t j0,
                                                           int64_t j1, int64_t k, float *out,
                                                           int64_t ldo, int rows) {
    const int64_t nsb = k / 32;
    for (int64_t j = j0; j < j1; j += NJ) {
        const int nj = j1 - j < NJ ? (int)(j1 - j) : NJ;
        v16f acc[DECODE_ROWS][NJ];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < NJ; c++) acc[r][c] = (v16f){0};
        for (int64_t sb = 0; sb < nsb; sb++) {
            v16f xa[DECODE_ROWS], xb[DECODE_ROWS];
            for (int r = 0; r < rows; r++) {
                xa[r] = ldf(x + r * ldx + sb * 32);
                xb[r] = ldf(x + r * ldx + sb * 32 + 16);
            }
            for (int c = 0; c < NJ; c++) {
                /* A short last group repeats its final row: no branch in the loop. */
                const int64_t jj = j + (c < nj ? c : nj - 1);
                v16f w0, w1;
                deq32(qtype, w + jj * row_bytes, sb, &w0, &w1);
                for (int r = 0; r < rows; r++) acc[r][c] += xa[r] * w0 + xb[r] * w1;
            }
        }
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < nj; c++) out[r * ldo + j + c] = hsum(acc[r][c]);
    }
}

#if DECODE_ROWS == 4
#define DOT_CASES(QT)                                                                   \
    switch (rows) {                                                                     \
    case 1: dot_rows(QT, x, ldx, w, row_bytes, j0, j1, k, out, ldo, 1); break;          \
    case 2: dot_rows(QT, x, ldx, w, row_bytes, j0, j1, k, out, ldo, 2); break;          \
    case 3: dot_rows(QT, x, ldx, w, row_bytes, j0, j1, k, out, ldo, 3); break;          \
    default: dot_rows(QT, x, ldx, w, row_bytes, j0, j1, k, out, ldo, 4); break;         \
    }
#else
#define DOT_CASES(QT)                                                                   \
    switch (rows) {                                                                     \
    case 1: dot_rows(QT, x, ldx, w, row_bytes, j0, j1, k, out, ldo, 1); break;          \
    default: dot_rows(QT, x, ldx, w, row_bytes, j0, j1, k, out, ldo, 2); break;         \
    }
#endif

static void dot_block(int qtype, const float *x, int64_t ldx, const uint8_t *w,
                      int64_t row_bytes, int64_t j0, int64_t j1, int64_t k, float *out,
                      int64_t ldo, int rows) {
    switch (qtype) {
    case Q8_0: DOT_CASES(Q8_0) break;
    case Q4_0: DOT_CASES(Q4_0) break;
    case Q4_1: DOT_CASES(Q4_1) break;
    case Q5_0: DOT_CASES(Q5_0) break;
    case Q5_1: DOT_CASES(Q5_1) break;
    case Q4_K: DOT_CASES(Q4_K) break;
    case Q5_K: DOT_CASES(Q5_K) break;
    case Q6_K: DOT_CASES(Q6_K) break;
    }
}

/* Rows [j0, j0 + cnt) of W decoded into dst (cnt rows of k floats, row stride ldd). */
static inline __attribute__((always_inline)) void deq_rows_t(int qtype, const uint8_t *w,
                                                             int64_t row_bytes, int64_t j,
                                                             int64_t k, float *dst) {
    const uint8_t *row = w + j * row_bytes;
    for (int64_t sb = 0; sb < k / 32; sb++) {
        v16f w0, w1;
        deq32(qtype, row, sb, &w0, &w1);
        memcpy(dst + sb * 32, &w0, 64);
        memcpy(dst + sb * 32 + 16, &w1, 64);
    }
}

static void deq_row(int qtype, const uint8_t *w, int64_t row_bytes, int64_t j, int64_t k,
                    float *dst) {
    switch (qtype) {
    case Q8_0: deq_rows_t(Q8_0, w, row_bytes, j, k, dst); break;
    case Q4_0: deq_rows_t(Q4_0, w, row_bytes, j, k, dst); break;
    case Q4_1: deq_rows_t(Q4_1, w, row_bytes, j, k, dst); break;
    case Q5_0: deq_rows_t(Q5_0, w, row_bytes, j, k, dst); break;
    case Q5_1: deq_rows_t(Q5_1, w, row_bytes, j, k, dst); break;
    case Q4_K: deq_rows_t(Q4_K, w, row_bytes, j, k, dst); break;
    case Q5_K: deq_rows_t(Q5_K, w, row_bytes, j, k, dst); break;
    case Q6_K: deq_rows_t(Q6_K, w, row_bytes, j, k, dst); break;
    }
}

/* Elements per block of each supported type, 0 for anything else. */
int quant_block_size(int qtype) {
    switch (qtype & ~QDOT_AMX) {
    case Q8_0: case Q4_0: case Q4_1: case Q5_0: case Q5_1: return 32;
    case Q8_0 | QDOT: case Q4_0 | QDOT: case Q4_1 | QDOT: case Q5_0 | QDOT: case Q5_1 | QDOT:
        return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
    }
}

/* out[i] = row ids[i] of W (n_ids rows of k floats): an embedding lookup on the blocks. */
void quant_dequantize_rows(int qtype, const uint8_t *w, int64_t row_bytes, const int64_t *ids,
                           int64_t n_ids, int64_t k, float *out, int threads) {
    const int panel = quant_panel_layout(qtype);
#pragma omp parallel for num_threads(threads) schedule(static) if (n_ids > 64)
    for (int64_t i = 0; i < n_ids; i++) {
        if (panel) {
            quant_panel_row(qtype, w, row_bytes, ids[i], k, out + i * k);
        } else {
            deq_row(qtype, w, row_bytes, ids[i], k, out + i * k);
        }
    }
}

/* Rows of W per unit of work on the decode path: ~16 KB of weights, small enough that a
 * thread slowed by a neighbour on its core hands the rest of its share to the other. */
static int64_t decode_chunk(int64_t row_bytes) {
    const int64_t c = 16384 / (row_bytes > 0 ? row_bytes : 1) / NJ * NJ;
    return c < NJ ? NJ : c;
}

/* The calling thread's share of the decode-sized GEMM in row order (an orphaned `omp
 * for`, as quant_panel_share). */
__attribute__((noinline)) static void gemm_decode_share(int qtype, const float *x, int64_t ldx, const uint8_t *w,
                              int64_t row_bytes, float *out, int64_t ldo, int64_t m, int64_t n,
                              int64_t k) {
    const int64_t chunk = decode_chunk(row_bytes);
    const int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t j0 = c * chunk, j1 = j0 + chunk < n ? j0 + chunk : n;
        for (int64_t r0 = 0; r0 < m; r0 += DECODE_ROWS) {
            const int rows = (int)(m - r0 < DECODE_ROWS ? m - r0 : DECODE_ROWS);
            dot_block(qtype, x + r0 * ldx, ldx, w, row_bytes, j0, j1, k, out + r0 * ldo, ldo,
                      rows);
        }
    }
}

/* The decode step's entry (decode_step.c): this thread's share of out = x @ W^T for
 * m <= quant_share_max_rows() rows, the same arithmetic as quant_gemm. xsum: the block
 * sums of x, xq: x's rows quantized to int8 blocks (quant_prepare_x), each for the
 * formats that read it (panels; the dot layout, which the step sends here at any m). */
void quant_gemm_share(int qtype, const float *x, int64_t ldx, const float *xsum,
                      const void *xq, const uint8_t *w, int64_t row_bytes, float *out,
                      int64_t ldo, int64_t m, int64_t n, int64_t k) {
    if (quant_dot_layout(qtype)) {
        quant_dot_share(qtype, xq, w, row_bytes, out, ldo, m, n, k);
    } else if (quant_panel_layout(qtype)) {
        quant_panel_share(qtype, x, ldx, xsum, w, row_bytes, out, ldo, m, n, k);
    } else {
        gemm_decode_share(qtype, x, ldx, w, row_bytes, out, ldo, m, n, k);
    }
}

/* What quant_gemm_share reads besides x, for m rows of k: the block sums into xsum
 * (m * k / 32 floats), and with xq (m * k / 32 qdot_xblocks; NULL: not wanted) the
 * rows quantized to int8 blocks, as quant_dot_gemm quantizes them. */
void quant_prepare_x(const float *x, int64_t ldx, int64_t m, int64_t k, float *xsum,
                     void *xq) {
    quant_panel_xsum(x, ldx, m, k, xsum);
    if (xq) quant_dot_quantize_x(x, ldx, m, k, xq);
}

int quant_share_max_rows(void) { return 2 * DECODE_ROWS; }

static void gemm_decode(int qtype, const float *x, int64_t ldx, const uint8_t *w,
                        int64_t row_bytes, float *out, int64_t ldo, int64_t m, int64_t n,
                        int64_t k, int threads) {
#pragma omp parallel num_threads(threads)
    gemm_decode_share(qtype, x, ldx, w, row_bytes, out, ldo, m, n, k);
}

/* This thread's share of the prefill-sized GEMM, inside a parallel region: per block of
 * QMC rows the team packs x's tiles into the shared xp (quant_prefill_x_floats(k)
 * floats), then splits the panels, each decoded into this thread's `panel` ([k][NR])
 * through its `row` (k floats) and run against the block. A thread whose buffers are
 * NULL (out of memory) skips its panels. Each block ends in the team's barrier. */
void quant_prefill_share(int qtype, const float *x, int64_t ldx, const uint8_t *w,
                         int64_t row_bytes, float *xp, float *panel, float *row, float *out,
                         int64_t ldo, int64_t m, int64_t n, int64_t k) {
    const int64_t panels = (n + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < m; m0 += QMC) {
        const int64_t mc = m - m0 < QMC ? m - m0 : QMC;
        const int64_t tiles = (mc + MR - 1) / MR;
        pack_x_tiles(x, ldx, m0, mc, m, k, xp);
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < panels; p++) {
            if (!panel || !row) continue;
            const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
            if (quant_panel_layout(qtype)) {
                /* NR / 16 stored panels side by side; past the last, zeros. */
                for (int s = 0; s < NR / 16; s++) {
                    if (p * NR + s * 16 < n) {
                        quant_panel_decode(qtype, w, row_bytes, p * (NR / 16) + s, k,
                                           panel + s * 16, NR);
                    } else {
                        for (int64_t kk = 0; kk < k; kk++)
                            memset(panel + kk * NR + s * 16, 0, 16 * sizeof(float));
                    }
                }
            } else {
                for (int j = 0; j < NR; j++) {
                    if (j < cols) {
                        deq_row(qtype, w, row_bytes, p * NR + j, k, row);
                        for (int64_t kk = 0; kk < k; kk++) panel[kk * NR + j] = row[kk];
                    } else {
                        for (int64_t kk = 0; kk < k; kk++) panel[kk * NR + j] = 0.f;
                    }
                }
            }
            for (int64_t t = 0; t < tiles; t++) {
                const int rows = (int)(mc - t * MR < MR ? mc - t * MR : MR);
                tile_rows(xp + t * k * MR, panel, k, NULL, NULL,
                          out + (m0 + t * MR) * ldo + p * NR, ldo, rows, cols);
            }
        }
    }
}

int64_t quant_prefill_x_floats(int64_t k) { return (int64_t)QMC * k; }
int64_t quant_prefill_panel_floats(int64_t k) { return k * NR; }

/* Returns 0, or -1 when a buffer could not be allocated. */
static int gemm_prefill(int qtype, const float *x, int64_t ldx, const uint8_t *w,
                        int64_t row_bytes, float *out, int64_t ldo, int64_t m, int64_t n,
                        int64_t k, int threads) {
    const size_t xbytes = ((size_t)quant_prefill_x_floats(k) * sizeof(float) + 63) / 64 * 64;
    float *xp = aligned_alloc(64, xbytes);
    if (!xp) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* This thread's decoded panel [k][NR] and one decoded row. */
        const size_t pbytes = ((size_t)k * NR * sizeof(float) + 63) / 64 * 64;
        float *panel = aligned_alloc(64, pbytes);
        float *row = aligned_alloc(64, ((size_t)k * sizeof(float) + 63) / 64 * 64);
        if (!panel || !row) {
#pragma omp atomic write
            failed = 1;
        }
        quant_prefill_share(qtype, x, ldx, w, row_bytes, xp, panel, row, out, ldo, m, n, k);
        free(panel);
        free(row);
    }
    free(xp);
    return failed ? -1 : 0;
}

/* out[m, n] (row stride ldo) = x[m, k] (row stride ldx) @ W^T + bias, W given as n rows
 * of row_bytes bytes of qtype blocks. Returns 0; -1: out of memory; -2: qtype or k not
 * supported. */
int quant_gemm(int qtype, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
               const float *bias, float *out, int64_t ldo, int64_t m, int64_t n, int64_t k,
               int threads) {
    const int bs = quant_block_size(qtype);
    if (bs == 0 || k % bs) return -2;
    int rc = 0;
    if (quant_dot_layout(qtype)) {
        rc = quant_dot_gemm(qtype, x, ldx, w, row_bytes, out, ldo, m, n, k, threads);
    } else if (m <= 2 * DECODE_ROWS && quant_panel_layout(qtype)) {
        rc = quant_panel_gemm(qtype, x, ldx, w, row_bytes, out, ldo, m, n, k, threads);
    } else if (m <= 2 * DECODE_ROWS) {
        gemm_decode(qtype, x, ldx, w, row_bytes, out, ldo, m, n, k, threads);
    } else {
        rc = gemm_prefill(qtype, x, ldx, w, row_bytes, out, ldo, m, n, k, threads);
    }
    if (rc == 0 && bias) {
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++) out[r * ldo + j] += bias[j];
    }
    return rc;
}
