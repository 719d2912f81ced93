/* bf16 GEMM pieces shared by gemm_bf16.c (weights as [n, k] rows) and gemm_bf16_tiled.c
 * (AMX B tiles): x rounded to bf16 once per call by the team, the split of a call's rows
 * into chunks, and for CPUs without AMX `vdpbf16ps` over 16 weight rows at a time (the
 * tiled kernel untiles an n-block first). Included by both sources unconditionally; the
 * vector parts where AVX512-BF16 is compiled in.
 *
 * Each lane of an accumulator is one pair of inputs (2p, 2p + 1) of every 32-input chunk
 * in turn, one chain per lane; the 16 lanes are then summed in _mm512_reduce_add_ps's
 * tree. So an output's sum is the same bits whatever the row count, the rows beside it,
 * the blocking, the chunks or the team (the rows kernel's dot_row gives the same). */
#ifndef FLEETSERVE_BF16_BLOCK_H
#define FLEETSERVE_BF16_BLOCK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_bits.h"
#include "thread_buffer.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define BF16_BLOCKS 1
#else
#define BF16_BLOCKS 0
#endif

/* A buffer of `values` bf16 values, 64-byte aligned, kept across calls by the calling
 * thread (the OpenMP team's threads live as long as the process); NULL when it cannot
 * grow. One per including source. */
static uint16_t *bf16_team_buffer(size_t values) {
    static _Thread_local void *buf = NULL;
    static _Thread_local size_t cap = 0;
    return thread_buffer(&buf, &cap, values * sizeof(uint16_t));
}

/* Called by every thread of the team: x's m rows (ldx apart) rounded to bf16
 * (nearest-even) into one buffer the team shares, `rows` rows (>= m; those past m zero in
 * their first k values) ldb values apart, then `extra` values left to the caller. Every
 * thread gets the same pointer, or NULL (then no thread waits at a barrier here; with
 * abort_on_oom the process aborts instead, naming `who`: the C step has no error path
 * inside its team). Ends in the team's barrier. */
static uint16_t *bf16_round_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t rows,
                                 int64_t ldb, size_t extra, int abort_on_oom, const char *who) {
    uint16_t *xb = NULL;
#pragma omp single copyprivate(xb)
    xb = bf16_team_buffer((size_t)(rows * ldb) + extra);
    if (!xb) {
        if (abort_on_oom) {
            fprintf(stderr, "fleetserve: %s: cannot allocate the bf16 rows of x\n", who);
            abort();
        }
        return NULL;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *dst = xb + r * ldb;
        if (r >= m) {
            memset(dst, 0, (size_t)k * sizeof(uint16_t));
            continue;
        }
        const float *src = x + r * ldx;
        int64_t i = 0;
#if BF16_BLOCKS
        for (; i + 32 <= k; i += 32)
            _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16),
                                                                     _mm512_loadu_ps(src + i)));
#endif
        for (; i < k; i++) dst[i] = to_bf16(src[i]);
    }
    return xb;
}

/* Rows per chunk of a call's m rows over a team of `threads`: a chunk's bf16 rows (k * 2
 * + 64 bytes each) fill at most about half of a core's L2 (1 MiB on Zen 4), the rest
 * left to the n-block's weights, the outputs and the next n-block's; work items (chunk
 * of rows, n-block) go chunk-major, so a chunk stays in L2 while the n-blocks pass. The
 * chunks are of one size (a multiple of 4 rows, the last one shorter by the rounding)
 * and, where there are several, as many as a multiple of the team: a static split then
 * hands each thread the same number of rows (chunks of the L2 size alone left 1,024 rows
 * at k = 768 as 324 + 324 | 324 + 52 over two threads). The sums do not depend on it. */
#ifndef ROWS_CHUNK_BYTES
#define ROWS_CHUNK_BYTES (512 << 10)
#endif
static inline int64_t bf16_rows_chunk(int64_t m, int64_t k, int threads) {
    int64_t cap = ROWS_CHUNK_BYTES / ((k + 32) * 2);
    if (cap < 16) cap = 16;
    int64_t chunks = m > cap ? (m + cap - 1) / cap : 1;
    if (chunks > 1 && threads > 1) chunks = (chunks + threads - 1) / threads * threads;
    const int64_t rows = ((m + chunks - 1) / chunks + 3) / 4 * 4;
    return rows < 16 ? 16 : rows;
}

#if BF16_BLOCKS
/* _mm512_reduce_add_ps of 16 vectors at once: lane a of the result is acc[a]'s lanes
 * reduced in that function's tree (lane i + lane i + 8, then + 4, + 2, + 1), two vectors'
 * halves or quarters brought side by side by each shuffle. */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 acc[16]) {
    __m512 v[16], s1[8], s2[4];
    /* Inputs in this order leave acc[a]'s sum in lane a (the last step interleaves). */
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) v[i] = acc[4 * (i % 4) + i / 4];
#pragma GCC unroll 16
    for (int i = 0; i < 8; i++) { /* 256-bit halves: lane i + lane i + 8 */
        const __m512 lo = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44);
        const __m512 hi = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE);
        s1[i] = _mm512_add_ps(hi, lo);
        __asm__("" : "+v"(s1[i]));
    }
#pragma GCC unroll 16
    for (int i = 0; i < 4; i++) { /* 128-bit quarters: + 4 */
        const __m512 e = _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0x88);
        const __m512 o = _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0xDD);
        s2[i] = _mm512_add_ps(o, e);
        __asm__("" : "+v"(s2[i]));
    }
    __m512 s3[2];
#pragma GCC unroll 16
    for (int i = 0; i < 2; i++) { /* 64-bit pairs: + 2 */
        const __m512d r = (__m512d)s2[2 * i], s = (__m512d)s2[2 * i + 1];
        s3[i] = _mm512_add_ps((__m512)_mm512_unpacklo_pd(r, s), (__m512)_mm512_unpackhi_pd(r, s));
        __asm__("" : "+v"(s3[i]));
    }
    /* + 1 */
    return _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Rows x .. x + (R - 1) * ldb against 16 / R outputs w, w + ldw, ... (rows of k inputs,
 * untile_nblock): lane r * 16 / R + j of the result is row r's output j. Each lane of an
 * accumulator is one pair of every chunk in turn (one chain per lane, as lanes8x2), so
 * the sums are those bits whatever R. pf: pfl lines (64 bytes) to ask into L2 per chunk
 * (the next n-block's tiles, while this one multiplies; NULL: none). Inlined with R
 * constant (block_rows). */
static inline __attribute__((always_inline)) __m512 block_rj(const uint16_t *x, int64_t ldb,
                                                             const uint16_t *w, int64_t ldw,
                                                             int64_t kc, int R,
                                                             const char *pf, int pfl) {
    const int J = 16 / R;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < kc; c++) {
        if (pf)
            for (int i = 0; i < pfl; i++) _mm_prefetch(pf + (c * pfl + i) * 64, _MM_HINT_T1);
        __m512bh xv[4];
        for (int r = 0; r < R; r++) xv[r] = (__m512bh)_mm512_loadu_si512(x + r * ldb + c * 32);
#pragma GCC unroll 16
        for (int j = 0; j < J; j++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * ldw + c * 32);
            for (int r = 0; r < R; r++)
                acc[r * J + j] = _mm512_dpbf16_ps(acc[r * J + j], xv[r], wv);
        }
    }
    return reduce16(acc);
}

/* Not inlined: the caller's live values would crowd the inner loop's registers (spills
 * there cost ~15% at 64 rows). Each case a loop of its own, without prefetches where pf
 * is NULL. */
static __attribute__((noinline)) __m512 block_rows(const uint16_t *x, int64_t ldb,
                                                   const uint16_t *w, int64_t ldw, int64_t kc,
                                                   int R, const char *pf, int pfl) {
    if (pf) switch (R) {
        case 1: return block_rj(x, ldb, w, ldw, kc, 1, pf, pfl);
        case 2: return block_rj(x, ldb, w, ldw, kc, 2, pf, pfl);
        default: return block_rj(x, ldb, w, ldw, kc, 4, pf, pfl);
        }
    switch (R) {
    case 1: return block_rj(x, ldb, w, ldw, kc, 1, NULL, 0);
    case 2: return block_rj(x, ldb, w, ldw, kc, 2, NULL, 0);
    default: return block_rj(x, ldb, w, ldw, kc, 4, NULL, 0);
    }
}

/* Outputs j0 .. j0 + 15 of rows r0 .. r1 - 1: x rounded to bf16 in xb (rows ldb apart,
 * one more readable row past r1 where (r1 - r0) % 4 == 3: it is multiplied, not stored),
 * weight rows w, w + ldw, ... (k = 32 * kc inputs each), plus bias (NULL: none), into
 * out (rows ldo apart). 4 rows x 4 outputs a block_rows call (2 x 8 or 1 x 16 for the
 * last rows); the 16 * kc lines at `next` (the next n-block's weights; NULL: none) are
 * asked into L2 meanwhile, and each row's 16 outputs are stored as one 64-byte line. */
static void bf16_nblock(const uint16_t *xb, int64_t ldb, int64_t r0, int64_t r1, int64_t kc,
                        const uint16_t *w, int64_t ldw, const void *next, const float *bias,
                        float *out, int64_t ldo, int64_t j0) {
    const int64_t m = r1 - r0;
    /* Calls of block_rows for this n-block: the next one's 16 * kc lines spread over them. */
    const int64_t calls = m / 4 * 4 + (m % 4 == 3 ? 4 : m % 4 == 2 ? 2 : m % 4);
    const int pfl = next ? (int)((16 + calls - 1) / calls) : 0;
    const __m512 b = bias ? _mm512_loadu_ps(bias + j0) : _mm512_setzero_ps();
    int64_t q = 0;
    for (int64_t r = r0; r < r1;) {
        const int R = r1 - r >= 3 ? 4 : (int)(r1 - r), J = 16 / R; /* 3 rows: a zero row */
        __m512 v[4]; /* v[g]: outputs g * J .. g * J + J - 1 of the R rows, row-major */
        for (int g = 0; g < R; g++, q++) {
            const char *pf = q * pfl < 16 ? (const char *)next + q * pfl * kc * 64 : NULL;
            v[g] = block_rows(xb + r * ldb, ldb, w + g * J * ldw, ldw, kc, R, pf, pfl);
        }
        __m512 row[4];
        if (R == 4) { /* row i: 128-bit block i of v[0], v[1], v[2], v[3] */
            const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44);
            const __m512 t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
            const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
            const __m512 t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
            row[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
            row[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
            row[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
            row[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
        } else if (R == 2) { /* row i: 256-bit half i of v[0], v[1] */
            row[0] = _mm512_shuffle_f32x4(v[0], v[1], 0x44);
            row[1] = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
        } else {
            row[0] = v[0];
        }
        for (int i = 0; i < R && r + i < r1; i++)
            _mm512_storeu_ps(out + (r + i) * ldo + j0, _mm512_add_ps(row[i], b));
        r += R;
    }
}

#endif /* BF16_BLOCKS */

#endif
