/* AMX-INT8 for the dot layout (quant_dot.h): 16 rows of x at a time against one panel.
 *
 * Per block of 32 inputs a tile multiply sums the 16 x 16 block products in int32, as
 * vpdpbusd does in quant_dot_simd.c; the sums are then scaled into float accumulators by
 * the same instructions in the same order (cvt, minus the quants' offset, one fmadd by
 * d_w * d_x, Q4_1 / Q5_1's min), so a row's result does not depend on which kernel took
 * it (integer sums are exact). Tiles: C 16 x 16 int32, A 16 rows of x's 32 int8 (read
 * straight from the quantized blocks, stride one row of blocks), B the panel block as
 * 8 groups of 4 inputs x 16 weight rows, which is the dot layout's own order: Q8_0's
 * quants are loaded as they are (signed x signed: tdpbssd), Q4 / Q5 nibbles (with the
 * fifth bits) are unpacked to bytes first (signed x unsigned: tdpbsud).
 *
 * Used where the build has AMX-INT8 and the kernel may use it: the first use asks Linux
 * for the tile state (arch_prctl); FLEETSERVE_AMX=0 keeps the VNNI kernel. Each call
 * configures the tiles of its thread (other libraries in the process, oneDNN's AMX
 * GEMMs, configure them their own way) and releases them at its end. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include "amx_perm.h"
#include "quant_common.h"
#include "quant_dot.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__) &&             \
    defined(__AVX512BW__)
#define PR 16
#define PREFETCH 4096

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* amx_permitted(): amx_perm.h, shared with gemm_bf16.c. */

/* C: rows x 16 int32 (tiles 0-3: two blocks in flight while the two before them are
 * scaled); A: rows x 32 int8 (4, 6); B: 8 groups x 16 weight rows x 4 bytes (5, 7).
 * Static: GCC 12 drops stores into a local config that only ldtilecfg reads. */
#define CFG(n)                                                                          \
    {.palette = 1, .colsb = {64, 64, 64, 64, 32, 64, 32, 64},                           \
     .rows = {n, n, n, n, n, 8, n, 8}}
static const tile_config configs[17] __attribute__((aligned(64))) = {
    CFG(1),  CFG(1),  CFG(2),  CFG(3),  CFG(4),  CFG(5),  CFG(6),  CFG(7),  CFG(8),
    CFG(9),  CFG(10), CFG(11), CFG(12), CFG(13), CFG(14), CFG(15), CFG(16),
};
#undef CFG

int quant_dot_amx_begin(int rows) {
    if (!amx_permitted()) return 0;
    _tile_loadconfig(&configs[rows < 1 ? 1 : rows > 16 ? 16 : rows]);
    return 1;
}

void quant_dot_amx_end(void) { _tile_release(); }

static inline int64_t block_bytes(int qtype) {
    switch (qtype) {
    case Q8_0: return PR * 34;
    case Q4_1: return PR * 20;
    case Q5_0: return PR * 22;
    case Q5_1: return PR * 24;
    default: return PR * 18;
    }
}

static inline int64_t head_bytes(int qtype) {
    switch (qtype) {
    case Q4_1: return 64;
    case Q5_0: return 96;
    case Q5_1: return 128;
    default: return 32;
    }
}

/* Bytes of a panel block in the unpacked copy (QDOT_AMX): d[16] and m[16] (Q4_0 / Q5_0:
 * bytes not read), 512 quants: 9 cache lines, B tiles on line boundaries. */
static inline int64_t copy_block(int qtype) {
    (void)qtype;
    return 576;
}

int64_t quant_dot_amx_copy_block(int qtype) { return copy_block(qtype); }

/* A Q4 / Q5 panel block's quants as bytes, B's layout: rows 0-3 the low nibbles of groups
 * 0-3 (inputs 4g + j), rows 4-7 the high ones (16 + 4g + j). */
static inline void unpack(int qtype, const uint8_t *qs, uint8_t *dst) {
    const __m512i m4 = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
    const int five = qtype == Q5_0 || qtype == Q5_1;
    const __m512i qh = five ? _mm512_loadu_si512(qs - 64) : _mm512_setzero_si512();
    for (int g = 0; g < 4; g++) {
        const __m512i v = _mm512_loadu_si512(qs + g * 64);
        __m512i lo = _mm512_and_si512(v, m4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (five) {
            lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi32(qh, 4 - g), bit4));
            hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi32(qh, g), bit4));
        }
        _mm512_store_si512(dst + g * 64, lo);
        _mm512_store_si512(dst + (4 + g) * 64, hi);
    }
}

/* Scale block b's int32 sums (in cb, `rows` rows of x x 16 weight rows) into acc, as
 * quant_dot_simd.c's vector kernel does. */
static inline __attribute__((always_inline)) void scale_block(int qtype, const uint8_t *pb,
                                                              const qdot_xblock *xt,
                                                              int64_t ldxb, int64_t b,
                                                              const int32_t *cb, int rows,
                                                              __m512 *acc) {
    const int32_t off = qtype == Q4_0 ? 8 : qtype == Q5_0 ? 16 : 0;
    const int min = qtype == Q4_1 || qtype == Q5_1;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pb));
    const __m512 m = min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pb + 32))) : d;
    for (int r = 0; r < 16; r++)
        if (r < rows)
            acc[r] = qdot_scale(_mm512_load_si512(cb + 16 * r), off, min, xt + r * ldxb + b, d,
                                m, acc[r]);
}

/* Blocks of a panel whose Q4 / Q5 quants are unpacked once for all its tiles of x rows
 * (the stack buffer's 64 KB); longer rows unpack per tile and block. */
#define UNPACKED_BLOCKS 128

/* Block `blk`'s products for x tile xt into C tile C (A tile A, B tile B): Q4 / Q5 quants
 * from the weight's unpacked copy (`pre`: QDOT_AMX), from the panel's copy unpacked for
 * all its tiles of x (`once`), or unpacked now into wb's slot. */
#define MUL_BLOCK(C, A, B, blk, slot)                                                   \
    do {                                                                                \
        _tile_zero(C);                                                                  \
        _tile_loadd(A, xt[blk].q, ldx);                                                 \
        if (q8) {                                                                       \
            _tile_loadd(B, panel + (blk) * bb + head, 64);                              \
            _tile_dpbssd(C, A, B);                                                      \
        } else if (pre) {                                                               \
            _tile_loadd(B, copy + (blk) * cbb + chead, 64);                             \
            _tile_dpbsud(C, A, B);                                                      \
        } else {                                                                        \
            if (!once) unpack(qtype, panel + (blk) * bb + head, wb + (slot) * 512);     \
            _tile_loadd(B, wb + (once ? (blk) : (slot)) * 512, 64);                     \
            _tile_dpbsud(C, A, B);                                                      \
        }                                                                               \
    } while (0)

/* x rows [16t, 16t + rows) for t < tiles against one panel (rows: what the tile
 * configuration has, 16 for whole tiles): out rows, cols of them kept.
 * Software-pipelined over pairs of blocks: a pair's sums are stored from C tiles 0-1
 * (2-3), the next pair's multiplies start on 2-3 (0-1), then the stored pair is scaled
 * while they run, so the tile unit and the vector scaling overlap in program order (not
 * only as far as the out-of-order window reaches). Blocks are scaled in order. */
static inline __attribute__((always_inline)) void amx_panel(int qtype, int pre,
                                                            const uint8_t *panel,
                                                            const uint8_t *copy, int64_t nb,
                                                            const qdot_xblock *xb, int64_t ldxb,
                                                            int64_t tiles, int rows, float *out,
                                                            int64_t ldo, int cols) {
    const int64_t bb = block_bytes(qtype), head = head_bytes(qtype);
    const int64_t cbb = copy_block(qtype), chead = cbb - 512;
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const int q8 = qtype == Q8_0;
    /* The scales (d, m: the same offsets in the panel and its copy) and the prefetched
     * bytes come from what the tiles read. */
    const uint8_t *sp = pre ? copy : panel;
    const int64_t sbb = pre ? cbb : bb;
    const int once = !q8 && !pre && tiles > 1 && nb <= UNPACKED_BLOCKS;
    uint8_t wb[UNPACKED_BLOCKS * 512] __attribute__((aligned(64)));
    int32_t cb[4][16 * 16] __attribute__((aligned(64)));
    if (once)
        for (int64_t b = 0; b < nb; b++) unpack(qtype, panel + b * bb + head, wb + b * 512);
    const int64_t ldx = ldxb * (int64_t)sizeof(qdot_xblock);
    for (int64_t t = 0; t < tiles; t++) {
        const qdot_xblock *xt = xb + t * 16 * ldxb;
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        if (t == 0) PREFETCH_WEIGHTS(sp, 2 * sbb, PREFETCH);
        if (nb > 0) MUL_BLOCK(0, 4, 5, 0, 0);
        if (nb > 1) MUL_BLOCK(1, 6, 7, 1, 1);
        for (int64_t b = 0; b < nb; b += 4) {
            if (t == 0) PREFETCH_WEIGHTS(sp + (b + 2) * sbb, 2 * sbb, PREFETCH);
            _tile_stored(0, cb[0], 64);
            if (b + 1 < nb) _tile_stored(1, cb[1], 64);
            if (b + 2 < nb) MUL_BLOCK(2, 4, 5, b + 2, 0);
            if (b + 3 < nb) MUL_BLOCK(3, 6, 7, b + 3, 1);
            scale_block(qtype, sp + b * sbb, xt, ldxb, b, cb[0], rows, acc);
            if (b + 1 < nb) scale_block(qtype, sp + (b + 1) * sbb, xt, ldxb, b + 1, cb[1], rows, acc);
            if (b + 2 >= nb) break;
            if (t == 0) PREFETCH_WEIGHTS(sp + (b + 4) * sbb, 2 * sbb, PREFETCH);
            _tile_stored(2, cb[2], 64);
            if (b + 3 < nb) _tile_stored(3, cb[3], 64);
            if (b + 4 < nb) MUL_BLOCK(0, 4, 5, b + 4, 0);
            if (b + 5 < nb) MUL_BLOCK(1, 6, 7, b + 5, 1);
            scale_block(qtype, sp + (b + 2) * sbb, xt, ldxb, b + 2, cb[2], rows, acc);
            if (b + 3 < nb) scale_block(qtype, sp + (b + 3) * sbb, xt, ldxb, b + 3, cb[3], rows, acc);
        }
        for (int r = 0; r < 16; r++)
            if (r < rows) _mm512_mask_storeu_ps(out + (t * 16 + r) * ldo, keep, acc[r]);
    }
}
#undef MUL_BLOCK

void quant_dot_amx_panel(int qtype, const uint8_t *panel, const uint8_t *copy, int64_t nb,
                         const qdot_xblock *xb, int64_t ldxb, int64_t tiles, int rows,
                         float *out, int64_t ldo, int cols) {
#define ARGS panel, copy, nb, xb, ldxb, tiles, rows, out, ldo, cols
    switch (qtype) {
    case Q8_0: amx_panel(Q8_0, 0, ARGS); break;
    case Q4_0: copy ? amx_panel(Q4_0, 1, ARGS) : amx_panel(Q4_0, 0, ARGS); break;
    case Q4_1: copy ? amx_panel(Q4_1, 1, ARGS) : amx_panel(Q4_1, 0, ARGS); break;
    case Q5_0: copy ? amx_panel(Q5_0, 1, ARGS) : amx_panel(Q5_0, 0, ARGS); break;
    case Q5_1: copy ? amx_panel(Q5_1, 1, ARGS) : amx_panel(Q5_1, 0, ARGS); break;
    }
#undef ARGS
}

void quant_dot_amx_unpack_panel(int qtype, const uint8_t *panel, int64_t nb, uint8_t *copy) {
    const int64_t bb = block_bytes(qtype), head = head_bytes(qtype), cbb = copy_block(qtype);
    uint8_t q[512] __attribute__((aligned(64)));
    for (int64_t b = 0; b < nb; b++) {
        memcpy(copy + b * cbb, panel + b * bb, 64); /* d, and m or bytes not read */
        unpack(qtype, panel + b * bb + head, q);
        memcpy(copy + b * cbb + cbb - 512, q, 512);
    }
}

#else
int quant_dot_amx_begin(int rows) {
    (void)rows;
    return 0;
}
void quant_dot_amx_end(void) {}
void quant_dot_amx_panel(int qtype, const uint8_t *panel, const uint8_t *copy, int64_t nb,
                         const qdot_xblock *xb, int64_t ldxb, int64_t tiles, int rows,
                         float *out, int64_t ldo, int cols) {
    (void)qtype, (void)panel, (void)copy, (void)nb, (void)xb, (void)ldxb, (void)tiles;
    (void)rows, (void)out, (void)ldo, (void)cols;
}
int64_t quant_dot_amx_copy_block(int qtype) {
    (void)qtype;
    return 576;
}
void quant_dot_amx_unpack_panel(int qtype, const uint8_t *panel, int64_t nb, uint8_t *copy) {
    (void)qtype, (void)panel, (void)nb, (void)copy;
}
#endif
