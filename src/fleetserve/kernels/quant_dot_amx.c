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

int quant_dot_amx_begin(void) {
    if (!amx_permitted()) return 0;
    /* Static: GCC 12 drops stores into a local config that only ldtilecfg reads. */
    static const tile_config c __attribute__((aligned(64))) = {
        .palette = 1,
        /* C: 16 x rows x 16 int32; A: 16 x rows x 32 int8; B: 8 groups x 16 weight rows
         * x 4 bytes; twice (tiles 0-2 and 3-5). */
        .colsb = {64, 32, 64, 64, 32, 64},
        .rows = {16, 16, 8, 16, 16, 8},
    };
    _tile_loadconfig(&c);
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

/* Scale block b's int32 sums (in cb, 16 x rows x 16 weight rows) into acc, as
 * quant_dot_simd.c's vector kernel does. */
static inline __attribute__((always_inline)) void scale_block(int qtype, const uint8_t *pb,
                                                              const qdot_xblock *xt,
                                                              int64_t ldxb, int64_t b,
                                                              const int32_t *cb, __m512 *acc) {
    const int32_t off = qtype == Q4_0 ? 8 : qtype == Q5_0 ? 16 : 0;
    const int min = qtype == Q4_1 || qtype == Q5_1;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pb));
    const __m512 m = min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pb + 32))) : d;
    for (int r = 0; r < 16; r++)
        acc[r] = qdot_scale(_mm512_load_si512(cb + 16 * r), off, min, xt + r * ldxb + b, d, m,
                            acc[r]);
}

/* Blocks of a panel whose Q4 / Q5 quants are unpacked once for all its tiles of x rows
 * (the stack buffer's 64 KB); longer rows unpack per tile and block. */
#define UNPACKED_BLOCKS 128

/* x rows [16t, 16t + 16) for t < tiles against one panel: out rows, cols of them kept.
 * Two blocks at a time on two sets of tiles (C0 A1 B2, C3 A4 B5): one block's sums are
 * stored and scaled while the other's multiply runs. */
static inline __attribute__((always_inline)) void amx_panel(int qtype, const uint8_t *panel,
                                                            int64_t nb, const qdot_xblock *xb,
                                                            int64_t ldxb, int64_t tiles,
                                                            float *out, int64_t ldo, int cols) {
    const int64_t bb = block_bytes(qtype), head = head_bytes(qtype);
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const int q8 = qtype == Q8_0;
    const int once = !q8 && tiles > 1 && nb <= UNPACKED_BLOCKS;
    uint8_t wb[UNPACKED_BLOCKS * 512] __attribute__((aligned(64)));
    int32_t cb[2][16 * 16] __attribute__((aligned(64)));
    if (once)
        for (int64_t b = 0; b < nb; b++) unpack(qtype, panel + b * bb + head, wb + b * 512);
    const int64_t ldx = ldxb * (int64_t)sizeof(qdot_xblock);
    for (int64_t t = 0; t < tiles; t++) {
        const qdot_xblock *xt = xb + t * 16 * ldxb;
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b += 2) {
            const uint8_t *p0 = panel + b * bb, *p1 = p0 + bb;
            const int two = b + 1 < nb;
            if (t == 0) PREFETCH_WEIGHTS(p0, 2 * bb, PREFETCH);
            _tile_zero(0);
            _tile_loadd(1, xt[b].q, ldx);
            if (q8) {
                _tile_loadd(2, p0 + head, 64);
                _tile_dpbssd(0, 1, 2);
            } else {
                const uint8_t *w0 = wb + (once ? b * 512 : 0);
                if (!once) unpack(qtype, p0 + head, wb);
                _tile_loadd(2, w0, 64);
                _tile_dpbsud(0, 1, 2);
            }
            if (two) {
                _tile_zero(3);
                _tile_loadd(4, xt[b + 1].q, ldx);
                if (q8) {
                    _tile_loadd(5, p1 + head, 64);
                    _tile_dpbssd(3, 4, 5);
                } else {
                    const uint8_t *w1 = wb + (once ? (b + 1) * 512 : 512);
                    if (!once) unpack(qtype, p1 + head, wb + 512);
                    _tile_loadd(5, w1, 64);
                    _tile_dpbsud(3, 4, 5);
                }
            }
            _tile_stored(0, cb[0], 64);
            if (two) _tile_stored(3, cb[1], 64);
            scale_block(qtype, p0, xt, ldxb, b, cb[0], acc);
            if (two) scale_block(qtype, p1, xt, ldxb, b + 1, cb[1], acc);
        }
        for (int r = 0; r < 16; r++) _mm512_mask_storeu_ps(out + (t * 16 + r) * ldo, keep, acc[r]);
    }
}

void quant_dot_amx_panel(int qtype, const uint8_t *panel, int64_t nb, const qdot_xblock *xb,
                         int64_t ldxb, int64_t tiles, float *out, int64_t ldo, int cols) {
    switch (qtype) {
    case Q8_0: amx_panel(Q8_0, panel, nb, xb, ldxb, tiles, out, ldo, cols); break;
    case Q4_0: amx_panel(Q4_0, panel, nb, xb, ldxb, tiles, out, ldo, cols); break;
    case Q4_1: amx_panel(Q4_1, panel, nb, xb, ldxb, tiles, out, ldo, cols); break;
    case Q5_0: amx_panel(Q5_0, panel, nb, xb, ldxb, tiles, out, ldo, cols); break;
    case Q5_1: amx_panel(Q5_1, panel, nb, xb, ldxb, tiles, out, ldo, cols); break;
    }
}

#else
int quant_dot_amx_begin(void) { return 0; }
void quant_dot_amx_end(void) {}
void quant_dot_amx_panel(int qtype, const uint8_t *panel, int64_t nb, const qdot_xblock *xb,
                         int64_t ldxb, int64_t tiles, float *out, int64_t ldo, int cols) {
    (void)qtype, (void)panel, (void)nb, (void)xb, (void)ldxb, (void)tiles, (void)out;
    (void)ldo, (void)cols;
}
#endif
