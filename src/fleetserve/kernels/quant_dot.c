/* The dot layout (quant_dot.h): repacking GGUF rows into it, decoding it back to floats,
 * quantizing rows of x to int8 blocks, and the decode-sized GEMM's driver. The per-panel
 * integer kernels are in quant_dot_simd.c. */
#include <math.h>
#include <stdlib.h>

#include "quant_common.h"
#include "quant_dot.h"

#define PR 16 /* rows per panel */

static int64_t gguf_block_bytes(int qtype) {
    switch (qtype) {
    case Q8_0: return 34;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    default: return 18; /* Q4_0 */
    }
}

/* Bytes of a panel block before the 4-byte groups of quants: the scales d (and m), and for
 * Q5_0 / Q5_1 each row's 32 fifth bits (quant_dot.h). */
static int64_t head_bytes(int qtype) {
    switch (qtype) {
    case Q4_1: return 64;
    case Q5_0: return 96;
    case Q5_1: return 128;
    default: return 32;
    }
}

static int has_min(int qtype) { return qtype == Q4_1 || qtype == Q5_1; }

/* GGUF's qh (bit i: the fifth bit of input i) as the dot layout keeps it: bit 8j + g the
 * fifth bit of input 4g + j, bit 8j + 4 + g that of input 16 + 4g + j (g < 4, j < 4), so
 * one shift and mask put group g's bits at bit 4 of each byte of its lane. */
static uint32_t spread_qh(uint32_t qh) {
    uint32_t out = 0;
    for (int g = 0; g < 4; g++)
        for (int j = 0; j < 4; j++) {
            out |= ((qh >> (4 * g + j)) & 1u) << (8 * j + g);
            out |= ((qh >> (16 + 4 * g + j)) & 1u) << (8 * j + 4 + g);
        }
    return out;
}

/* The fifth bit of row-lane byte j of group g: low nibble (hi = 0) or high (hi = 1). */
static inline int fifth_bit(uint32_t qh_spread, int g, int j, int hi) {
    return (int)((qh_spread >> (8 * j + 4 * hi + g)) & 1u);
}

/* rows: n rows of row_bytes in GGUF order; out: ceil(n / 16) panels, zero rows past n. */
void quant_dot_repack(int fmt, const uint8_t *rows, int64_t n, int64_t row_bytes, uint8_t *out,
                      int threads) {
    const int qtype = qdot_qtype(fmt);
    const int64_t bb = gguf_block_bytes(qtype), nb = row_bytes / bb, head = head_bytes(qtype);
    const int64_t groups = (bb - head / 16) / 4; /* 4-byte groups of quants per block */
    const int64_t panels = (n + PR - 1) / PR;
    const int mins = has_min(qtype), five = qtype == Q5_0 || qtype == Q5_1;
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
                if (mins) memcpy(pb + 32 + 2 * r, blk + 2, 2); /* m */
                if (five) {
                    uint32_t qh;
                    memcpy(&qh, blk + 2 + 2 * mins, 4);
                    qh = spread_qh(qh);
                    memcpy(pb + 32 + 32 * mins + 4 * r, &qh, 4);
                }
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
#if defined(__AVX512F__) && defined(__AVX512BW__)
            /* The same arithmetic in two vectors (vcvtps2dq rounds as lrintf does, in the
             * CPU's mode): ~8x fewer instructions than GCC's scalar loop. */
            const __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
            const __m512 sign = _mm512_set1_ps(-0.f);
            const float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
            const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)o->q, _mm512_cvtepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(o->q + 16), _mm512_cvtepi32_epi8(qhi));
            qdot_xblock_sums(o, d, _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
#else
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
            const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            int32_t s = 0;
            for (int i = 0; i < 32; i++) {
                const int32_t q = (int32_t)lrintf(v[i] * id);
                o->q[i] = (int8_t)q;
                s += q;
            }
            qdot_xblock_sums(o, d, s);
#endif
        }
    }
}

/* Fewest rows of x that go to AMX-INT8 as a partial tile (the rows past whole tiles of
 * 16, or all of a narrow step's) rather than to the vector kernel. A tile block costs
 * about the same at 1 row as at 16 (measured: AMX GFLOP/s grow linearly with the rows),
 * so a partial tile pays only where the vector kernel's passes cost more: Q8_0 from 10
 * rows (at 8 even on the projections, behind on the 49152-row LM head: 140-145 vs
 * 157-188 GFLOP/s; at 12-15 ahead on all, 310-370 vs 270-300 on gate_up); Q4 / Q5 never
 * when their nibbles are unpacked per block (VNNI's two passes stayed ahead up to 15
 * rows), from `copied` rows when the weight has its unpacked copy (QDOT_AMX: B tiles
 * loaded as Q8_0's are). docs/benchmarks.md has the tables; FLEETSERVE_AMX_MIN_ROWS
 * overrides (measurement). */
static int amx_min_rows(int qtype, int copied) {
    static int v; /* 0: not read yet, -1: no override */
    int r = __atomic_load_n(&v, __ATOMIC_ACQUIRE);
    if (r == 0) {
        const char *env = getenv("FLEETSERVE_AMX_MIN_ROWS");
        r = env && atoi(env) > 0 ? atoi(env) : -1;
        __atomic_store_n(&v, r, __ATOMIC_RELEASE);
    }
    return r > 0 ? r : qtype == Q8_0 ? 10 : copied ? 15 : 16;
}

int64_t quant_dot_amx_copy_bytes(int fmt, int64_t n, int64_t k) {
    const int qtype = qdot_qtype(fmt);
    const char *env = getenv("FLEETSERVE_AMX_COPY");
    if (qtype == Q8_0 || !quant_dot_layout(fmt | QDOT) || !env || env[0] != '1') return 0;
    if (!quant_dot_amx_begin(16)) return 0;
    quant_dot_amx_end();
    return (n + PR - 1) / PR * (k / 32) * quant_dot_amx_copy_block(qtype);
}

void quant_dot_amx_copy(int fmt, const uint8_t *w, int64_t n, int64_t row_bytes, uint8_t *out,
                        int threads) {
    const int qtype = qdot_qtype(fmt);
    const int64_t panels = (n + PR - 1) / PR, nb = row_bytes / gguf_block_bytes(qtype);
    const int64_t cb = nb * quant_dot_amx_copy_block(qtype);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++)
        quant_dot_amx_unpack_panel(qtype, w + p * PR * row_bytes, nb, out + p * cb);
}

/* Panels [p0, p1) of W times the m quantized rows of x: one thread's share. */
void quant_dot_panels(int fmt, const qdot_xblock *xb, int64_t m, int64_t nb, const uint8_t *w,
                      int64_t row_bytes, float *out, int64_t ldo, int64_t n, int64_t p0,
                      int64_t p1) {
    const int qtype = qdot_qtype(fmt);
    /* The unpacked copy (QDOT_AMX) after the ceil(n / 16) panels: panel p's at copy + p * cb. */
    const uint8_t *copy = fmt & QDOT_AMX ? w + (n + PR - 1) / PR * PR * row_bytes : NULL;
    const int64_t cb = copy ? nb * quant_dot_amx_copy_block(qtype) : 0;
#define CPANEL(p) (copy ? copy + (p) * cb : NULL)
    /* Whole tiles of 16 rows on AMX where there is one (quant_dot_amx.c: the same
     * results), then the rest as one partial tile from amx_min_rows() rows, else (or
     * without AMX) on the vector kernel. */
    const int64_t tiles = m >= 16 && p1 > p0 && quant_dot_amx_begin(16) ? m / 16 : 0;
    int amx = tiles > 0;
    for (int64_t p = p0; p < p1 && tiles; p++) {
        const int cols = (int)(n - p * PR < PR ? n - p * PR : PR);
        quant_dot_amx_panel(qtype, w + p * PR * row_bytes, CPANEL(p), nb, xb, nb, tiles, 16,
                            out + p * PR, ldo, cols);
    }
    int64_t rest = m - 16 * tiles;
    const int64_t r0 = 16 * tiles;
    if (rest >= amx_min_rows(qtype, copy != NULL) && p1 > p0 &&
        quant_dot_amx_begin((int)rest)) {
        amx = 1;
        for (int64_t p = p0; p < p1; p++) {
            const int cols = (int)(n - p * PR < PR ? n - p * PR : PR);
            quant_dot_amx_panel(qtype, w + p * PR * row_bytes, CPANEL(p), nb, xb + r0 * nb, nb,
                                1, (int)rest, out + r0 * ldo + p * PR, ldo, cols);
        }
        rest = 0;
    }
#undef CPANEL
    if (amx) quant_dot_amx_end();
    /* The rest in passes of even size (17 rows: 6 + 6 + 5, not 8 + 8 + 1: a one-row pass
     * unpacks and reads the whole panel again for little work). */
    const int64_t step = rest ? quant_dot_pass_rows(rest) : 1;
    const int64_t passes = (rest + step - 1) / step;
    for (int64_t p = p0; p < p1 && rest; p++) {
        const int cols = (int)(n - p * PR < PR ? n - p * PR : PR);
        for (int64_t i = 0, r = r0; i < passes; i++) {
            const int rows = (int)((rest * (i + 1)) / passes - (rest * i) / passes);
            quant_dot_panel(qtype, w + p * PR * row_bytes, nb, xb + r * nb, nb, rows,
                            out + r * ldo + p * PR, ldo, cols);
            r += rows;
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

/* Row r's 32 weights of one panel block pb, as floats. A 32-bit lane of a group holds row
 * r's inputs 4g .. 4g + 3, one per byte (Q4 / Q5: and 16 + 4g .. in the high nibbles). */
static void quant_dot_block(int qtype, const uint8_t *pb, int64_t head, int r, float *o) {
    const uint8_t *qs = pb + head;
    const float d = h2f(pb + 2 * r);
    if (qtype == Q8_0) {
        for (int i = 0; i < 32; i++) o[i] = d * (float)(int8_t)qs[(i / 4) * 64 + 4 * r + i % 4];
        return;
    }
    const int five = qtype == Q5_0 || qtype == Q5_1;
    uint32_t qh = 0;
    if (five) memcpy(&qh, pb + head - 64 + 4 * r, 4);
    const float off = qtype == Q4_0 ? -8.f : -16.f;
    const float m = has_min(qtype) ? h2f(pb + 32 + 2 * r) : off * d;
    for (int i = 0; i < 16; i++) {
        const int g = i / 4, j = i % 4;
        const uint8_t q = qs[g * 64 + 4 * r + j];
        const int lo = (q & 15) | (five ? fifth_bit(qh, g, j, 0) << 4 : 0);
        const int hi = (q >> 4) | (five ? fifth_bit(qh, g, j, 1) << 4 : 0);
        o[i] = (float)lo * d + m;
        o[i + 16] = (float)hi * d + m;
    }
}

/* Panel p decoded to floats at dst[kk * ld + j] for its 16 rows j (quant_panel_decode's
 * callers; quant_gemm itself multiplies every row count in integers). A 32-bit lane of a
 * group holds row j's inputs 4g .. 4g + 3, one per byte. */
void quant_dot_decode(int fmt, const uint8_t *w, int64_t row_bytes, int64_t p, int64_t k,
                      float *dst, int64_t ld) {
    const int qtype = qdot_qtype(fmt);
    const int64_t bb = PR * gguf_block_bytes(qtype), head = head_bytes(qtype);
    const uint8_t *panel = w + p * PR * row_bytes;
    float row[32];
    for (int r = 0; r < PR; r++) {
        for (int64_t b = 0; b < k / 32; b++) {
            quant_dot_block(qtype, panel + b * bb, head, r, row);
            for (int i = 0; i < 32; i++) dst[(b * 32 + i) * ld + r] = row[i];
        }
    }
}

/* Row j of a matrix in the dot layout as k floats (embedding lookups, references). */
void quant_dot_row(int fmt, const uint8_t *w, int64_t row_bytes, int64_t j, int64_t k,
                   float *dst) {
    const int qtype = qdot_qtype(fmt);
    const int64_t bb = PR * gguf_block_bytes(qtype), head = head_bytes(qtype);
    const uint8_t *panel = w + (j / PR) * PR * row_bytes;
    for (int64_t b = 0; b < k / 32; b++)
        quant_dot_block(qtype, panel + b * bb, head, (int)(j % PR), dst + b * 32);
}
