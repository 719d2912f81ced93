/* bf16 weights x float32 activations, any row count (issue 25 items 1-2).
 *
 * out[m, n] = sum_k bf16(x[m, k]) * w[n, k], accumulated in float32. The activations are
 * rounded to bf16 (nearest-even) once per row, as a bf16 GEMM would; the weights are
 * stored bf16 (uint16 bit patterns), so a row of W costs half the bytes of float32, which
 * is what a memory-bound decode step pays for. Compiled for the build's target: with
 * AVX512-BF16 the dot products run `vdpbf16ps` (32 products per instruction; where k % 32
 * == 0 in bf16_block.h's blocks of 4 rows x 4 outputs: ~0.16-0.2 TFLOP/s on one Zen 4
 * core against a 0.23 peak), without it a portable loop that gives the same sums up to
 * float32 summation order. At any row count, where the CPU has AMX-BF16 (and
 * FLEETSERVE_AMX is not 0), tiles of 16 x 16 outputs (`tdpbf16ps`, see amx_share): ~1
 * TFLOP/s on two Xeon cores against ~0.1 for float32.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "amx_perm.h"
#include "bf16_block.h"

#define BF16_NATIVE BF16_BLOCKS

#if BF16_NATIVE && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define BF16_AMX 1
#else
#define BF16_AMX 0
#endif

int bf16_native(void) { return BF16_NATIVE; }

/* Every row count multiplies through AMX tiles where the CPU has them: a partial tile
 * still streams the weights at the read rate (4096 x 768 tiled weights, one core: 1-8
 * rows 0.46-0.47 ms a call through tiles, against 0.48-0.97 ms through dot_rows4, the
 * `vdpbf16ps` loop of the time, on a Xeon). One path for every row count also makes a
 * row's sums the same whatever else is in its step (speculative verification rows against
 * plain decoding; a request alone or in a batch); so do the `vdpbf16ps` blocks
 * (bf16_block.h) that serve CPUs without AMX and FLEETSERVE_AMX=0. */
#define AMX_MIN_ROWS 1


/* One row against one weight row: lane p adds pair p of every 32-input chunk in turn (one
 * chain, as dot_rows4's rows: a row's sums do not depend on how many rows its call has),
 * then _mm512_reduce_add_ps's tree. */
static float dot_row(const uint16_t *xb, const uint16_t *w, int64_t k) {
    int64_t i = 0;
    float acc = 0.0f;
#if BF16_NATIVE
    __m512 a0 = _mm512_setzero_ps();
    for (; i + 32 <= k; i += 32)
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xb + i),
                              (__m512bh)_mm512_loadu_si512(w + i));
    acc = _mm512_reduce_add_ps(a0);
#endif
    for (; i < k; i++) acc += from_bf16(xb[i]) * from_bf16(w[i]);
    return acc;
}

/* Four activation rows against one weight row: each weight chunk is loaded once for the
 * four (decode steps of a few sequences are bound by the weight bytes, not the FLOPs). */
static void dot_rows4(const uint16_t *xb, int64_t k, const uint16_t *w, float *acc4) {
    int64_t i = 0;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if BF16_NATIVE
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    for (; i + 32 <= k; i += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i);
        for (int r = 0; r < 4; r++)
            a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(xb + r * k + i), wv);
    }
    for (int r = 0; r < 4; r++) s[r] = _mm512_reduce_add_ps(a[r]);
#endif
    for (; i < k; i++) {
        float wf = from_bf16(w[i]);
        for (int r = 0; r < 4; r++) s[r] += from_bf16(xb[r * k + i]) * wf;
    }
    for (int r = 0; r < 4; r++) acc4[r] = s[r];
}

#if BF16_NATIVE
/* This thread's share without AMX where k % 32 == 0 (see bf16_share): x rounded to bf16
 * once by the team (rows ldb apart, padded with zero rows to a multiple of 4), then work
 * items (chunk of rows, 16 weight rows) through bf16_block.h, the n % 16 weight rows
 * left over through dot_row: the same sums as every other path here. */
static int blocks_share(const float *x, int64_t ldx, const uint16_t *w, const float *bias,
                        float *out, int64_t ldo, int64_t m, int64_t n, int64_t k,
                        int abort_on_oom) {
    const int64_t ldb = k + 32, kc = k / 32, nb16 = n / 16;
    const uint16_t *xb = bf16_round_rows(x, ldx, m, k, (m + 3) / 4 * 4, ldb, 0, abort_on_oom,
                                         "gemm_bf16");
    if (!xb) return -1; /* every thread sees the same NULL: none waits at a barrier below */
    const int64_t rows = bf16_rows_chunk(m, k, omp_get_num_threads());
    const int64_t nchunks = (m + rows - 1) / rows;
#pragma omp for schedule(static)
    for (int64_t q = 0; q < nchunks * nb16; q++) {
        const int64_t b = q % nb16, r0 = q / nb16 * rows;
        const uint16_t *wb = w + b * 16 * k;
        bf16_nblock(xb, ldb, r0, r0 + rows < m ? r0 + rows : m, kc, wb, k,
                    b + 1 < nb16 ? wb + 16 * k : NULL, bias, out, ldo, b * 16);
    }
    if (n % 16 == 0) return 0; /* no tail rows: no loop, no barrier (the same for all) */
#pragma omp for schedule(static)
    for (int64_t j = nb16 * 16; j < n; j++)
        for (int64_t r = 0; r < m; r++)
            out[r * ldo + j] = dot_row(xb + r * ldb, w + j * k, k) + (bias ? bias[j] : 0.0f);
    return 0;
}
#endif

#if BF16_AMX
/* AMX-BF16 for many rows. Roles swapped against the usual C = X W^T so the weights need
 * no second layout: the A tiles are 16 weight rows x 32 inputs read straight from the
 * [n, k] rows (stride k), the B tiles 16 pairs of inputs x 16 rows of x, which is x
 * rounded to bf16 and packed once per call by the team into blocks of 16 rows x 32
 * inputs (1 KiB each: pair r of row i at uint32 r * 16 + i; rows past m are zero). A C
 * tile is then 16 weight rows x 16 rows of x in float32, summed over k in the same order
 * whatever m or the team, written out transposed. Tiles 0-3: C; 4-5: A; 6-7: B. */
#define PACK_BLOCK 512 /* bf16 values in one packed 16 x 32 block */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static void amx_begin(void) {
    /* Static: a local config only ldtilecfg reads may lose its stores (GCC 12). */
    static const amx_config c __attribute__((aligned(64))) = {
        .palette = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
    };
    _tile_loadconfig(&c);
}

/* Rows b * 16 .. b * 16 + 15 of x, inputs c * 32 .. c * 32 + 31, into one packed block. */
static void pack_block(const float *x, int64_t ldx, int64_t m, int64_t b, int64_t c,
                       uint32_t *blk) {
    /* Pair r of a row goes to uint32 r * 16 + i: one 16-wide scatter per row. */
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                           5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(16));
    for (int i = 0; i < 16; i++) {
        const int64_t row = b * 16 + i;
        __m512i v = _mm512_setzero_si512();
        if (row < m) {
            const float *src = x + row * ldx + c * 32;
            v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        }
        _mm512_i32scatter_epi32(blk + i, at, v, 4);
    }
}

/* A stored C tile (16 weight rows x 16 rows of x) into out, transposed, plus bias. */
static void put_tile(const float *t, float *out, int64_t ldo, int64_t j0, int64_t r0,
                     int64_t m, const float *bias) {
    const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                            6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    const __m512 b = bias ? _mm512_loadu_ps(bias + j0) : _mm512_setzero_ps();
    for (int i = 0; i < 16 && r0 + i < m; i++) {
        const __m512 v = _mm512_i32gather_ps(col, t + i, 4); /* column i: t[j * 16 + i] */
        _mm512_storeu_ps(out + (r0 + i) * ldo + j0, _mm512_add_ps(v, b));
    }
}

/* Inputs per pass: a pass multiplies the n-block's 32 weight rows x KBLOCK * 32 inputs
 * (16 KiB, kept in L1) against every row of x, the C tiles parked in `acc` between
 * passes (stored and reloaded exactly: the sums' order is that of one long pass). */
#define KBLOCK 8

/* Weight rows j0 .. j0 + 16 * na - 1 (na 1 or 2) against rows b0 * 16 .. b1 * 16 - 1 of
 * x (b0 even; rows past m read as zero, written nowhere); acc: 1024 floats per pair of
 * 16-row blocks of x. */
static void amx_rows(const uint16_t *w, const uint16_t *xp, const float *bias, float *out,
                     int64_t ldo, int64_t m, int64_t k, int64_t j0, int na, int64_t b0,
                     int64_t b1, float *acc) {
    const int64_t kc = k / 32, wstride = k * 2;
    const uint16_t *w0 = w + j0 * k, *w1 = w + (j0 + 16) * k;
    for (int64_t c0 = 0; c0 < kc; c0 += KBLOCK) {
        const int64_t c1 = c0 + KBLOCK < kc ? c0 + KBLOCK : kc;
        for (int64_t b = b0; b < b1; b += 2) {
            const int nb = b + 1 < b1 ? 2 : 1;
            const uint16_t *x0 = xp + b * kc * PACK_BLOCK, *x1 = x0 + kc * PACK_BLOCK;
            float *t = acc + (b - b0) / 2 * 1024; /* C tiles 0-3 at t + 256 * tile */
            if (c0 == 0) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            } else {
                _tile_loadd(0, t, 64);
                if (nb == 2) _tile_loadd(1, t + 256, 64);
                if (na == 2) _tile_loadd(2, t + 512, 64);
                if (na == 2 && nb == 2) _tile_loadd(3, t + 768, 64);
            }
            for (int64_t c = c0; c < c1; c++) {
                _tile_loadd(4, w0 + c * 32, wstride);
                _tile_loadd(6, x0 + c * PACK_BLOCK, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (nb == 2) {
                    _tile_loadd(7, x1 + c * PACK_BLOCK, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (na == 2) {
                    _tile_loadd(5, w1 + c * 32, wstride);
                    _tile_dpbf16ps(2, 5, 6);
                    if (nb == 2) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, t, 64);
            if (nb == 2) _tile_stored(1, t + 256, 64);
            if (na == 2) _tile_stored(2, t + 512, 64);
            if (na == 2 && nb == 2) _tile_stored(3, t + 768, 64);
            if (c1 < kc) continue;
            put_tile(t, out, ldo, j0, b * 16, m, bias);
            if (nb == 2) put_tile(t + 256, out, ldo, j0, (b + 1) * 16, m, bias);
            if (na == 2) put_tile(t + 512, out, ldo, j0 + 16, b * 16, m, bias);
            if (na == 2 && nb == 2) put_tile(t + 768, out, ldo, j0 + 16, (b + 1) * 16, m, bias);
        }
    }
}

/* The packed x of a row's inputs c * 32 + 2r + e, for the weight rows past the last
 * whole 16 (a scalar loop over the same bf16 values). */
static float packed_dot(const uint16_t *xp, int64_t kc, int64_t row, const uint16_t *w,
                        int64_t k) {
    const uint16_t *blk = xp + (row / 16) * kc * PACK_BLOCK;
    const int64_t i = row % 16;
    float acc = 0.0f;
    for (int64_t q = 0; q < k; q++) {
        const int64_t c = q / 32, r = (q % 32) / 2, e = q % 2;
        acc += from_bf16(blk[c * PACK_BLOCK + (r * 16 + i) * 2 + e]) * from_bf16(w[q]);
    }
    return acc;
}

/* 16-row blocks of x per chunk of rows: a chunk's packed rows (k * 2 bytes each) are
 * read again for every pair of weight blocks, so they must stay in the core's L2 beside
 * the weights streaming past, the parked C tiles and the outputs: one pass over 1024
 * rows of k = 768 (1.5 MiB packed, a prefill chunk of the default token budget) ran at
 * ~0.5 TFLOP/s on one core where 512 rows ran at ~1.0. An even count, at least 2 (pairs
 * of blocks go together); the sums do not depend on it (each output's k order is fixed). */
#define AMX_CHUNK_BYTES (384 << 10)
static int64_t amx_chunk_blocks(int64_t k) {
    int64_t blocks = AMX_CHUNK_BYTES / (k * 2 * 16);
    blocks -= blocks % 2;
    return blocks < 2 ? 2 : blocks;
}

/* This thread's share through AMX (see bf16_share); every thread of the team calls it. */
static int amx_share(const float *x, int64_t ldx, const uint16_t *w, const float *bias,
                     float *out, int64_t ldo, int64_t m, int64_t n, int64_t k,
                     int abort_on_oom) {
    const int64_t mb = (m + 15) / 16, kc = k / 32;
    uint16_t *xp = NULL;
    /* After the packed rows, each thread's parked C tiles (1024 floats = 2048 bf16 per
     * pair of 16-row blocks), 64-byte aligned. */
    const int64_t chunk = amx_chunk_blocks(k), cb = chunk < mb ? chunk : mb;
    const int64_t xp_len = (mb + 1) * kc * PACK_BLOCK, acc_len = (cb + 1) / 2 * 2048;
#pragma omp single copyprivate(xp)
    xp = bf16_team_buffer((size_t)(xp_len + omp_get_num_threads() * acc_len));
    if (!xp) {
        if (abort_on_oom) {
            fprintf(stderr, "fleetserve: gemm_bf16: cannot allocate the packed rows of x\n");
            abort();
        }
        return -1; /* every thread sees the same NULL: none waits at a barrier below */
    }
#pragma omp for schedule(static)
    for (int64_t q = 0; q < mb * kc; q++)
        pack_block(x, ldx, m, q / kc, q % kc, (uint32_t *)(xp + q * PACK_BLOCK));
    const int64_t nb16 = n / 16, npairs = (nb16 + 1) / 2;
    const int64_t nchunks = (mb + chunk - 1) / chunk;
    int configured = 0;
    /* Work items: (chunk of x's rows, pair of 16-row weight blocks), chunk-major, so a
     * static split hands each thread whole chunks when there are several: its packed
     * rows stay in its own L2 while the weights stream past them. */
#pragma omp for schedule(static)
    for (int64_t q = 0; q < nchunks * npairs; q++) {
        if (!configured) amx_begin(), configured = 1;
        const int64_t b0 = q / npairs * chunk, p = q % npairs;
        const int64_t b1 = b0 + chunk < mb ? b0 + chunk : mb;
        amx_rows(w, xp, bias, out, ldo, m, k, p * 32, 2 * p + 1 < nb16 ? 2 : 1, b0, b1,
                 (float *)(xp + xp_len + omp_get_thread_num() * acc_len));
    }
    if (configured) _tile_release();
    if (n % 16 == 0) return 0; /* no tail rows: no loop, no barrier (the same for all) */
#pragma omp for schedule(static)
    for (int64_t j = nb16 * 16; j < n; j++)
        for (int64_t r = 0; r < m; r++)
            out[r * ldo + j] = packed_dot(xp, kc, r, w + j * k, k) + (bias ? bias[j] : 0.0f);
    return 0;
}
#endif

/* This thread's share of out[m, n] = bf16(x) @ w^T (+ bias), called by every thread of
 * an OpenMP team (the C step's linear dispatch, or gemm_bf16 below): the team rounds the
 * m rows of x once into a buffer it shares, then the weight rows are split over the team
 * (ends in the team's barrier). Every output is computed by the same code whatever the
 * team, so the C step and the module path agree bit for bit. Returns 0, or -1 when the
 * buffer could not grow (nothing is then computed; with abort_on_oom the process aborts
 * instead). */
static int bf16_share(const float *x, int64_t ldx, const uint16_t *w, const float *bias,
                      float *out, int64_t ldo, int64_t m, int64_t n, int64_t k,
                      int abort_on_oom) {
#if BF16_AMX
    if (m >= AMX_MIN_ROWS && k % 32 == 0 && n >= 16 && amx_permitted())
        return amx_share(x, ldx, w, bias, out, ldo, m, n, k, abort_on_oom);
#endif
#if BF16_NATIVE
    if (k % 32 == 0) return blocks_share(x, ldx, w, bias, out, ldo, m, n, k, abort_on_oom);
#endif
    /* The C step cannot return an error from inside its team: a share left undone would
     * be a wrong answer served silently, so with abort_on_oom the process dies loudly
     * instead (the fleet replaces and migrates a dead engine). */
    const uint16_t *xb = bf16_round_rows(x, ldx, m, k, m, k, 0, abort_on_oom, "gemm_bf16");
    if (!xb) return -1; /* the same NULL for every thread: no barrier below */
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const float b = bias ? bias[j] : 0.0f;
        int64_t r = 0;
        for (; r + 4 <= m; r += 4) {
            float acc4[4];
            dot_rows4(xb + r * k, k, w + j * k, acc4);
            for (int q = 0; q < 4; q++) out[(r + q) * ldo + j] = acc4[q] + b;
        }
        for (; r < m; r++) out[r * ldo + j] = dot_row(xb + r * k, w + j * k, k) + b;
    }
    return 0;
}

/* The C step's share (it has no error path inside its team: see bf16_share). */
int gemm_bf16_share(const float *x, int64_t ldx, const uint16_t *w, const float *bias,
                    float *out, int64_t ldo, int64_t m, int64_t n, int64_t k) {
    return bf16_share(x, ldx, w, bias, out, ldo, m, n, k, 1);
}

/* x: [m, k] float32 with row stride ldx; w: [n, k] bf16 contiguous; bias: NULL or [n];
 * out: [m, n] float32 with row stride ldo. Returns 0, or -1 when a scratch row cannot
 * be allocated. */
int gemm_bf16(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *out,
              int64_t ldo, int64_t m, int64_t n, int64_t k, int threads) {
    int rc = 0;
#pragma omp parallel num_threads(threads) reduction(min : rc)
    rc = bf16_share(x, ldx, w, bias, out, ldo, m, n, k, 0);
    return rc;
}

/* The core's own `vdpbf16ps` rate, for bench/bf16_tiles.py's peak line: iters x 16
 * instructions (64 FLOP each) in 16 independent chains, operands in registers, so
 * nothing but the FMA pipes limits it. Returns a sum of the chains so the loop is kept.
 * Without AVX512-BF16: returns 0 at once (no peak to state). */
float bf16_dot_peak(int64_t iters) {
#if BF16_NATIVE
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_set1_ps((float)i);
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), w = (__m512bh)_mm512_set1_epi16(0x2000);
    for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) a[i] = _mm512_dpbf16_ps(a[i], x, w);
        __asm__ volatile("" : "+v"(x)); /* x may change: the loop is not folded */
    }
    __m512 s = a[0];
    for (int i = 1; i < 16; i++) s = _mm512_add_ps(s, a[i]);
    return _mm512_reduce_add_ps(s);
#else
    (void)iters;
    return 0.0f;
#endif
}
