/* Integer dot products for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights (quant_dot.c, quant_dot_simd.c):
 * each row of x is quantized per block of 32 to int8 with a float scale (as llama.cpp's
 * Q8_0 / Q8_1), and a block's 32 products are summed in int32 (AVX-512 VNNI vpdpbusd,
 * AVX2 vpmaddubsw, plain C elsewhere).
 *
 * The weights are stored in their own layout, the "dot layout": panels of 16 output rows
 * like quant_panel.c's, but each row's bytes grouped by four consecutive inputs, so one
 * 32-bit lane holds 4 products' worth of one row, the unit vpdpbusd / vpmaddubsw+vpmaddwd
 * sum. Per panel, per block b of 32 inputs:
 *   Q8_0 (544 B): d[16] half | qs[8][16][4]    qs[g][r][j] = row r's int8 4g + j
 *   Q4_0 (288 B): d[16]      | qs[4][16][4]    qs[g][r][j] = row r's GGUF byte 4g + j
 *   Q4_1 (320 B): d[16] | m[16] | qs[4][16][4]   (low nibble: input 4g + j, high: 16 + 4g + j)
 *   Q5_0 (352 B): d[16] | qh[16] | qs[4][16][4]  (qh: row r's 32 fifth bits, u32, bit
 *                 8j + g for input 4g + j, bit 8j + 4 + g for input 16 + 4g + j)
 *   Q5_1 (384 B): d[16] | m[16] | qh[16] | qs[4][16][4]
 * Same bytes as GGUF's blocks, reordered (Q5's qh bits too). Its storage format ids are the GGML type id
 * plus QDOT; quant_gemm() and the decode step send every row count of such a weight
 * here: decode rows, verification rows and prefill chunks alike (at 16-512 rows the
 * integer panels ran 1.5-2.3x the float32 prefill tile on this Xeon: docs/benchmarks.md).
 */
#ifndef FLEETSERVE_QUANT_DOT_H
#define FLEETSERVE_QUANT_DOT_H
#include <stdint.h>

#define QDOT 0x100
/* With QDOT on a Q4_0 / Q4_1 / Q5_0 / Q5_1 weight: its buffer holds, after the ceil(n / 16)
 * panels, the same panels' quants unpacked to one byte each (quant_dot_amx_copy), so
 * AMX-INT8 loads them as B tiles without unpacking nibbles per block and tile of x. Per
 * panel block, 576 bytes: d[16] half | m[16] half (Q4_1 / Q5_1; else not read) |
 * q[8][16][4] bytes 0..15 (0..31 for Q5), rows 0-3 the low nibbles of groups 0-3, rows 4-7
 * the high ones (the B tile's order).
 * Only wide steps read it (whole tiles of 16 rows of x, partial tiles from
 * amx_min_rows()); narrower ones keep reading the packed panels. */
#define QDOT_AMX 0x200
/* One block of 32 inputs of one row of x: x ~= d * q, s = sum(q) (for the weights'
 * offsets: Q4_0's -8, Q5_0's -16, Q4_1's m, and the +128 that makes Q8_0 unsigned for
 * vpdpbusd). The products the kernels' scale step needs are made once here, when x is
 * quantized, not per weight panel: ds = d * (float)s (Q4_1 / Q5_1's min term) and
 * o8 / o16 / o128 = 8 / 16 / 128 * s (the offsets, in integers), so each is one
 * memory-broadcast operand in the kernels' loops. 64 bytes: one cache line. */
typedef struct {
    int8_t q[32];
    float d;
    float ds;
    int32_t s;
    int32_t o8, o16, o128;
    int32_t pad[2];
} qdot_xblock;

/* x's block fields from its quants and scale (every quantizer of x ends here). */
static inline void qdot_xblock_sums(qdot_xblock *o, float d, int32_t s) {
    o->d = d;
    o->s = s;
    o->ds = d * (float)s;
    o->o8 = 8 * s;
    o->o16 = 16 * s;
    o->o128 = 128 * s;
    o->pad[0] = o->pad[1] = 0;
}

/* The block's off * s for a quants' offset off (8, 16 or 128: a constant where inlined). */
static inline const int32_t *qdot_off_s(const qdot_xblock *x, int32_t off) {
    return off == 8 ? &x->o8 : off == 16 ? &x->o16 : &x->o128;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* One block's int32 sums (16 weight rows, one row x of x) scaled into acc: the quants'
 * offset `off` per unit of sum(q_x) comes off in integers, then one fmadd by d_w * d_x
 * and, for Q4_1 / Q5_1 (`min`), one by m * d_x * sum(q_x). The VNNI and AMX kernels both
 * call this, in this order, so a row's result does not depend on which kernel took it.
 * Every x operand is a broadcast from x's block (vpsubd / vmulps / vfmadd231ps with
 * {1to16}): no scalar work per row and block. */
static inline __attribute__((always_inline)) __m512 qdot_scale(__m512i is, int32_t off, int min,
                                                               const qdot_xblock *x, __m512 d,
                                                               __m512 m, __m512 acc) {
    if (off) is = _mm512_sub_epi32(is, _mm512_set1_epi32(*qdot_off_s(x, off)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(d, _mm512_set1_ps(x->d)), acc);
    if (min) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(x->ds), acc);
    return acc;
}
#endif

/* The GGML type of a dot-layout format id (QDOT and QDOT_AMX off). */
static inline int qdot_qtype(int fmt) { return fmt & ~(QDOT | QDOT_AMX); }

static inline int quant_dot_layout(int fmt) {
    const int base = qdot_qtype(fmt);
    /* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 */
    return (fmt & QDOT) && (base == 2 || base == 3 || base == 6 || base == 7 || base == 8);
}

void quant_dot_repack(int fmt, const uint8_t *rows, int64_t n, int64_t row_bytes, uint8_t *out,
                      int threads);
void quant_dot_quantize_x(const float *x, int64_t ldx, int64_t m, int64_t k, qdot_xblock *xb);
void quant_dot_quantize_share(const float *x, int64_t ldx, int64_t m, int64_t k,
                              qdot_xblock *xb);
/* This thread's share of out[m, n] = x @ W^T from x's quantized rows xb (m * k / 32
 * blocks): an orphaned `omp for` over chunks of panels, ending in the team's barrier
 * inside a parallel region (the decode step; quant_dot_gemm), all of it outside one. */
void quant_dot_share(int fmt, const qdot_xblock *xb, const uint8_t *w, int64_t row_bytes,
                     float *out, int64_t ldo, int64_t m, int64_t n, int64_t k);
void quant_dot_panels(int fmt, const qdot_xblock *xb, int64_t m, int64_t nb, const uint8_t *w,
                      int64_t row_bytes, float *out, int64_t ldo, int64_t n, int64_t p0,
                      int64_t p1);
/* Bytes of the unpacked copy of n rows of k inputs in format fmt (QDOT_AMX's), or 0 where
 * there is none to make: not asked for (FLEETSERVE_AMX_COPY=1 asks: 1.8x the packed
 * bytes again, for 2-6% on 16-row steps: docs/benchmarks.md), Q8_0 (its quants are bytes
 * already), no AMX-INT8 in the build or the process (FLEETSERVE_AMX=0). */
int64_t quant_dot_amx_copy_bytes(int fmt, int64_t n, int64_t k);
/* The copy of ceil(n / 16) panels w (the dot layout) into out. */
void quant_dot_amx_copy(int fmt, const uint8_t *w, int64_t n, int64_t row_bytes, uint8_t *out,
                        int threads);
int quant_dot_gemm(int fmt, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                   float *out, int64_t ldo, int64_t m, int64_t n, int64_t k, int threads);
void quant_dot_decode(int fmt, const uint8_t *w, int64_t row_bytes, int64_t p, int64_t k,
                      float *dst, int64_t ld);
void quant_dot_row(int fmt, const uint8_t *w, int64_t row_bytes, int64_t j, int64_t k,
                   float *dst);
/* quant_dot_simd.c: one panel times `rows` (<= quant_dot_pass_rows(rows)) rows of x. */
int quant_dot_pass_rows(int64_t rows);
int quant_dot_kind(void);
/* quant_dot_amx.c: tiles of `rows` (<= 16) rows of x on AMX-INT8; begin configures the
 * thread's tiles for that row count (0: no AMX here). */
int quant_dot_amx_begin(int rows);
void quant_dot_amx_end(void);
/* copy: the panel's unpacked copy (QDOT_AMX), or NULL: its nibbles unpacked here. */
void quant_dot_amx_panel(int qtype, const uint8_t *panel, const uint8_t *copy, int64_t nb,
                         const qdot_xblock *xb, int64_t ldxb, int64_t tiles, int rows,
                         float *out, int64_t ldo, int cols);
int64_t quant_dot_amx_copy_block(int qtype);
void quant_dot_amx_unpack_panel(int qtype, const uint8_t *panel, int64_t nb, uint8_t *copy);
void quant_dot_panel(int qtype, const uint8_t *panel, int64_t nb, const qdot_xblock *xb,
                     int64_t ldxb, int rows, float *out, int64_t ldo, int cols);

#endif
