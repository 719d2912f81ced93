/* bf16 weights laid out once at load as AMX B tiles (issue 25), where AMX runs them: the
 * same products as gemm_bf16.c, which serves [n, k] rows (shapes that do not tile, n % 16
 * or k % 32, and every weight on CPUs without AMX: kernels/bf16.py `layout_bf16`).
 *
 * Layout (kernels/bf16.py `tile_bf16`): for n-block b (weight rows 16b .. 16b + 15) and
 * input chunk c (inputs 32c .. 32c + 31), one 1 KiB tile at (b * k / 32 + c) * 512 bf16
 * values; in it, pair p of weight row j (inputs 32c + 2p and 32c + 2p + 1) at
 * p * 32 + j * 2. That is a `tdpbf16ps` B operand as it stands: x rounded to bf16 is the
 * A operand as plain rows (no packing), a C tile is 16 rows of x x 16 outputs, copied out
 * row by row. Each weight tile is one contiguous read, and an n-block's tiles follow one
 * another along k, so a step's weights stream in order.
 *
 * Every output's float32 sum runs in the order gemm_bf16.c's own paths give it: AMX sums
 * each 32-input chunk in turn (the products are exact, the roles of A and B swapped);
 * without AMX (FLEETSERVE_AMX=0) each n-block is untiled in registers into 16 rows and
 * multiplied by bf16_block.h's `vdpbf16ps` blocks, as gemm_bf16.c's rows are. So tokens
 * and logprobs do not change with the layout (tests/test_bf16_tiled.py). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "amx_perm.h"
#include "bf16_block.h"
#include "thread_buffer.h"

#define TILED_NATIVE BF16_BLOCKS

#if TILED_NATIVE && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define TILED_AMX 1
#else
#define TILED_AMX 0
#endif

#define TILE 512       /* bf16 values in one 16 x 32 weight tile */
#define AMX_MIN_ROWS 1 /* as gemm_bf16.c: every row count on tiles where AMX is */


#if TILED_NATIVE
/* An n-block's tiles as 16 rows of k bf16 (row j: output j's inputs in order, ld apart):
 * each 16 x 16 tile of 32-bit pairs transposed in registers, for bf16_block.h's blocks,
 * whose operands are 32 inputs of one output. ~64 cycles a tile on Zen 4: at a few rows
 * that is most of the call, hence rows, not tiles, where AMX is not used. */
static void untile_nblock(const uint16_t *tiles, int64_t kc, uint16_t *dst, int64_t ld) {
    for (int64_t c = 0; c < kc; c++) {
        const uint16_t *t = tiles + c * TILE;
        __m512i r[16], u[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(t + i * 32);
        for (int i = 0; i < 16; i += 2) {
            u[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
            u[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        }
        /* r[4g + e], 128-bit lane L: column 4L + e of tile rows 4g .. 4g + 3 */
        for (int i = 0; i < 16; i += 4) {
            r[i] = _mm512_unpacklo_epi64(u[i], u[i + 2]);
            r[i + 1] = _mm512_unpackhi_epi64(u[i], u[i + 2]);
            r[i + 2] = _mm512_unpacklo_epi64(u[i + 1], u[i + 3]);
            r[i + 3] = _mm512_unpackhi_epi64(u[i + 1], u[i + 3]);
        }
        for (int e = 0; e < 4; e++) { /* 4 x 4 transposition of the 128-bit lanes */
            const __m512i v0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44);
            const __m512i v1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
            const __m512i v2 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
            const __m512i v3 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
            uint16_t *o = dst + c * 32;
            _mm512_storeu_si512(o + (0 + e) * ld, _mm512_shuffle_i32x4(v0, v2, 0x88));
            _mm512_storeu_si512(o + (4 + e) * ld, _mm512_shuffle_i32x4(v0, v2, 0xDD));
            _mm512_storeu_si512(o + (8 + e) * ld, _mm512_shuffle_i32x4(v1, v3, 0x88));
            _mm512_storeu_si512(o + (12 + e) * ld, _mm512_shuffle_i32x4(v1, v3, 0xDD));
        }
    }
}

/* A thread's scratch for an untiled n-block (16 rows of ld values), kept across calls. */
static uint16_t *nblock_scratch(size_t values) {
    static _Thread_local void *buf = NULL;
    static _Thread_local size_t cap = 0;
    return thread_buffer(&buf, &cap, values * sizeof(uint16_t));
}
#endif

/* Outputs 16b .. 16b + 15 of rows r0 .. r1 - 1, without AMX (xb's rows ldb values
 * apart, zero rows up to a multiple of 16; wr: this thread's nblock_scratch): the n-block
 * untiled into wr, then bf16_block.h's 4 x 4 blocks over it. */
static void rows_nblock(const uint16_t *xb, int64_t ldb, int64_t r0, int64_t r1, int64_t k,
                        const uint16_t *tiles, const uint16_t *next, const float *bias,
                        float *out, int64_t ldo, int64_t j0, uint16_t *wr) {
#if TILED_NATIVE
    untile_nblock(tiles, k / 32, wr, k + 32);
    bf16_nblock(xb, ldb, r0, r1, k / 32, wr, k + 32, next, bias, out, ldo, j0);
#else
    (void)next;
    for (int64_t r = r0; r < r1; r++)
        for (int j = 0; j < 16; j++) {
            float acc = 0.0f;
            for (int64_t q = 0; q < k; q++)
                acc += from_bf16(xb[r * ldb + q]) *
                       from_bf16(tiles[(q / 32) * TILE + (q % 32) / 2 * 32 + j * 2 + q % 2]);
            out[r * ldo + j0 + j] = acc + (bias ? bias[j0 + j] : 0.0f);
        }
    (void)wr;
#endif
}

#if TILED_AMX
#include "amx_tiles.h"

/* Chunks per pass: the pass's weight tiles (2 n-blocks x KBLOCK KiB) stay in L1 for every
 * row block of the chunk of rows, C tiles parked in `acc` between passes (stored and
 * reloaded exactly). Weight tiles PREFETCH chunks ahead are asked for while the first
 * pair of row blocks multiplies, so the stream overlaps the tile products. Both, and
 * CHUNK_BYTES below, can be set with -D for A/B builds (bench/bf16_tiles.py numbers). */
#ifndef KBLOCK
#define KBLOCK 8
#endif
#ifndef PREFETCH
#define PREFETCH 8
#endif

static inline void prefetch_tile(const uint16_t *t) {
    for (int q = 0; q < TILE; q += 32) _mm_prefetch((const char *)(t + q), _MM_HINT_T0);
}

/* n-blocks 2p and 2p + 1 (na 2) or 2p alone (na 1) against row blocks b0 .. b1 - 1 of
 * xb (16 rows each, zero past m); acc: 1024 floats per pair of row blocks. */
static void amx_pair(const uint16_t *wt, const uint16_t *xb, int64_t ldb, const float *bias,
                     float *out, int64_t ldo, int64_t m, int64_t k, int64_t p, int na,
                     int64_t b0, int64_t b1, float *acc) {
    const int64_t kc = k / 32, xstride = ldb * 2;
    const uint16_t *w0 = wt + 2 * p * kc * TILE, *w1 = w0 + kc * TILE;
    for (int64_t c0 = 0; c0 < kc; c0 += KBLOCK) {
        const int64_t c1 = c0 + KBLOCK < kc ? c0 + KBLOCK : kc;
        for (int64_t b = b0; b < b1; b += 2) {
            const int nb = b + 1 < b1 ? 2 : 1;
            const uint16_t *x0 = xb + b * 16 * ldb, *x1 = x0 + 16 * ldb;
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
#ifndef NO_OUT_PREFETCH
            /* The outputs' lines asked for (for writing) while the last k-block runs: their
             * stores then do not wait on the reads for ownership (1024 x 2304 x 768, one
             * core: 0.59-0.64 -> 0.78-0.84 TFLOP/s). */
            if (c1 == kc)
                for (int i = 0; i < 16 * nb && b * 16 + i < m; i++) {
                    float *o = out + (b * 16 + i) * ldo + 2 * p * 16;
                    _mm_prefetch((const char *)o, _MM_HINT_ET0);
                    if (na == 2) _mm_prefetch((const char *)(o + 16), _MM_HINT_ET0);
                }
#endif
            for (int64_t c = c0; c < c1; c++) {
                if (b == b0 && c + PREFETCH < kc) {
                    prefetch_tile(w0 + (c + PREFETCH) * TILE);
                    if (na == 2) prefetch_tile(w1 + (c + PREFETCH) * TILE);
                }
                _tile_loadd(4, x0 + c * 32, xstride);
                _tile_loadd(6, w0 + c * TILE, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (nb == 2) {
                    _tile_loadd(5, x1 + c * 32, xstride);
                    _tile_dpbf16ps(1, 5, 6);
                }
                if (na == 2) {
                    _tile_loadd(7, w1 + c * TILE, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    if (nb == 2) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, t, 64);
            if (nb == 2) _tile_stored(1, t + 256, 64);
            if (na == 2) _tile_stored(2, t + 512, 64);
            if (na == 2 && nb == 2) _tile_stored(3, t + 768, 64);
            if (c1 < kc) continue;
            for (int q = 0; q < 2 * 2; q++) { /* tile q: row block b + q % 2, n-block q / 2 */
                const int64_t r0 = (b + q % 2) * 16, j0 = (2 * p + q / 2) * 16;
                if (q % 2 >= nb || q / 2 >= na) continue;
                const __m512 bv = bias ? _mm512_loadu_ps(bias + j0) : _mm512_setzero_ps();
                for (int i = 0; i < 16 && r0 + i < m; i++)
                    _mm512_storeu_ps(out + (r0 + i) * ldo + j0,
                                     _mm512_add_ps(_mm512_load_ps(t + q * 256 + i * 16), bv));
            }
        }
    }
}

/* Row blocks per chunk of rows: as gemm_bf16.c's amx_chunk_blocks, the chunk's bf16 rows
 * stay in the core's L2 while the weights stream past (an even count), but at least 256
 * rows: each chunk streams all the weights again (1024 x 768 x 2048: 96-row chunks read
 * 3 MiB of weights 11 times; 256-row chunks 0.83-0.93 -> 0.97-0.99 TFLOP/s on one core). */
#ifndef CHUNK_BYTES
#define CHUNK_BYTES (384 << 10)
#endif
static int64_t chunk_blocks(int64_t k) {
    int64_t blocks = CHUNK_BYTES / (k * 2 * 16);
    blocks -= blocks % 2;
    return blocks < 16 ? 16 : blocks;
}
#endif

/* This thread's share of out[m, n] = bf16(x) @ w^T (+ bias) over tiled weights; every
 * thread of the team calls it, and it ends in the team's barrier. Returns 0, or -1 when
 * the rows' buffer could not grow (abort_on_oom: the process aborts instead, as the C
 * step cannot return an error from inside its team). */
static int tiled_share(const float *x, int64_t ldx, const uint16_t *wt, const float *bias,
                       float *out, int64_t ldo, int64_t m, int64_t n, int64_t k,
                       int abort_on_oom) {
    const int64_t mb = (m + 15) / 16, nblocks = n / 16, kc = k / 32;
    int use_amx = 0;
#if TILED_AMX
    use_amx = m >= AMX_MIN_ROWS && amx_permitted();
    const int64_t chunk = chunk_blocks(k), cb = chunk < mb ? chunk : mb;
    const size_t acc_floats = use_amx ? (size_t)((cb + 1) / 2 * 1024) : 0;
#else
    const size_t acc_floats = 0;
#endif
    /* Rows of x 64 bytes longer than k values: an A tile's 16 rows then fall in different
     * L1 sets where k * 2 is a multiple of 4 KiB (k = 2048: 64 x 768 x 2048 ran at
     * 0.50 TFLOP/s, the rows kernel's packed blocks at 0.58). */
    const int64_t ldb = k + 32;
    const size_t rows_len = (size_t)(mb * 16 * ldb), acc_at = (rows_len + 32 + 31) / 32 * 32;
    /* After the rows (16 * mb of them, zero past m), each thread's parked C tiles. */
    uint16_t *xb = bf16_round_rows(x, ldx, m, k, mb * 16, ldb,
                                   acc_at - rows_len + 2 * acc_floats * omp_get_num_threads(),
                                   abort_on_oom, "gemm_bf16 (tiled)");
    if (!xb) return -1; /* every thread sees the same NULL: none waits at a barrier below */
    if (!use_amx) {
        uint16_t *wr = NULL;
        int rc = 0;
#if TILED_NATIVE
        if (!(wr = nblock_scratch((size_t)(16 * (k + 32))))) {
            if (abort_on_oom) {
                fprintf(stderr, "fleetserve: gemm_bf16 (tiled): cannot allocate an n-block\n");
                abort();
            }
            rc = -1; /* this thread's share is left undone; it still meets the barrier */
        }
#endif
        /* Work items (chunk of rows, n-block), chunk-major: a chunk's bf16 rows stay in
         * L2 while the n-blocks pass (a static split gives both threads each chunk's
         * half of the n-blocks). */
#if TILED_NATIVE
        const int64_t rows = bf16_rows_chunk(m, k, omp_get_num_threads());
#else
        const int64_t rows = m;
#endif
        const int64_t nrchunks = (m + rows - 1) / rows;
#pragma omp for schedule(static)
        for (int64_t q = 0; q < nrchunks * nblocks; q++) {
            const int64_t b = q % nblocks, r0 = q / nblocks * rows;
            const uint16_t *tiles = wt + b * kc * TILE;
            if (rc == 0)
                rows_nblock(xb, ldb, r0, r0 + rows < m ? r0 + rows : m, k, tiles,
                            b + 1 < nblocks ? tiles + kc * TILE : NULL, bias, out, ldo, b * 16,
                            wr);
        }
        return rc;
    }
#if TILED_AMX
    float *acc = (float *)(xb + acc_at) + (size_t)omp_get_thread_num() * acc_floats;
    const int64_t npairs = (nblocks + 1) / 2, nchunks = (mb + chunk - 1) / chunk;
    int configured = 0;
    /* Work items (chunk of rows, pair of n-blocks), chunk-major: with several chunks a
     * static split gives each thread whole chunks, whose rows stay in its L2. */
#pragma omp for schedule(static)
    for (int64_t q = 0; q < nchunks * npairs; q++) {
        if (!configured) tiles_begin(), configured = 1;
        const int64_t b0 = q / npairs * chunk, p = q % npairs;
        const int64_t b1 = b0 + chunk < mb ? b0 + chunk : mb;
        amx_pair(wt, xb, ldb, bias, out, ldo, m, k, p, 2 * p + 1 < nblocks ? 2 : 1, b0, b1, acc);
    }
    if (configured) _tile_release();
#endif
    return 0;
}

/* Whether tiles are the faster layout here: only where AMX multiplies them (else the
 * blocks untile each n-block first, which [n, k] rows spare: kernels/bf16.py's
 * `layout_bf16` keeps rows then). */
int bf16_tiles_pay(void) { return TILED_AMX && amx_permitted(); }

/* The C step's share (decode_step.c's W_BF16_TILED). */
int gemm_bf16_tiled_share(const float *x, int64_t ldx, const uint16_t *wt, const float *bias,
                          float *out, int64_t ldo, int64_t m, int64_t n, int64_t k) {
    return tiled_share(x, ldx, wt, bias, out, ldo, m, n, k, 1);
}

/* x: [m, k] float32 with row stride ldx; wt: the tiles of an [n, k] weight (n % 16 == 0,
 * k % 32 == 0, 64-byte aligned); bias: NULL or [n]; out: [m, n] float32 with row stride
 * ldo. Returns 0, or -1 when the rows' buffer cannot be allocated. */
int gemm_bf16_tiled(const float *x, int64_t ldx, const uint16_t *wt, const float *bias,
                    float *out, int64_t ldo, int64_t m, int64_t n, int64_t k, int threads) {
    int rc = 0;
#pragma omp parallel num_threads(threads) reduction(min : rc)
    rc = tiled_share(x, ldx, wt, bias, out, ldo, m, n, k, 0);
    return rc;
}
