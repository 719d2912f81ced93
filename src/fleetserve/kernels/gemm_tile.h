/* The float32 register-tile microkernel shared by gemm.c and quant_gemm.c (see gemm.c
 * for the layouts): weight panels [k][NR], x tiles [k][MR]. */
#ifndef FLEETSERVE_GEMM_TILE_H
#define FLEETSERVE_GEMM_TILE_H
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#define VL 16
#define MR 14
#else
#define VL 8
#define MR 6
#endif
#define NR (2 * VL)
/* Rows of x packed and run against all panels at a time. Up to MC_ONE rows (decode
 * batches) go in one block, so the weights are streamed once; larger batches go in
 * blocks of MC rows, which stay in L2 beside the panel. (At 1024 rows, 4 tiles per
 * block ran at 160-176 GFLOP/s and 8 tiles at 145-160 on this 2-core machine, whose
 * timings vary by +-10%: a lean, not a proof.) */
#define MC_ONE (8 * MR)
#define MC (4 * MR)

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned access */

/* Tile t of rows m0 .. m0+mc-1 of x into xp + t * k * MR ([k][MR], zero rows past m). */
static inline void pack_x_tile(const float *x, int64_t ldx, int64_t m0, int64_t t, int64_t m,
                               int64_t k, float *xp) {
    float *dst = xp + t * k * MR;
    for (int r = 0; r < MR; r++) {
        const int64_t row = m0 + t * MR + r;
        if (row < m) {
            for (int64_t kk = 0; kk < k; kk++) dst[kk * MR + r] = x[row * ldx + kk];
        } else {
            for (int64_t kk = 0; kk < k; kk++) dst[kk * MR + r] = 0.f;
        }
    }
}

/* Copy rows m0 .. m0+mc-1 of x into tiles [k][MR] at xp (zero rows past m). An orphaned
 * `omp for`: call it from inside a parallel region. */
static __attribute__((unused)) void pack_x_tiles(const float *x, int64_t ldx, int64_t m0, int64_t mc, int64_t m,
                         int64_t k, float *xp) {
    const int64_t tiles = (mc + MR - 1) / MR;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) pack_x_tile(x, ldx, m0, t, m, k, xp);
}

/* One MR x NR tile of out from an x tile ([k][MR]) and a weight panel ([k][NR]).
 * `rows` and `cols` trim the tile at the edges of out; `next` is the panel to prefetch
 * (NULL: none). Inlined with `rows` constant for each case of tile_rows. */
static inline __attribute__((always_inline)) void tile(const float *xt, const float *panel,
                                                       int64_t k, const float *next,
                                                       const float *bias, float *out,
                                                       int64_t ldo, int rows, int cols) {
    vf acc0[MR], acc1[MR];
    for (int r = 0; r < rows; r++) {
        acc0[r] = (vf){0};
        acc1[r] = (vf){0};
    }
#pragma GCC unroll 4
    for (int64_t kk = 0; kk < k; kk++) {
        if (next) {
            /* A whole panel ahead is more than L1 holds: fetch into L2 (prefetcht1).
             * Into L1 it ran ~10% slower at 8 rows and ~6% at 34 (interleaved runs). */
            __builtin_prefetch(next + kk * NR, 0, 2);
            __builtin_prefetch(next + kk * NR + 64 / sizeof(float), 0, 2);
        }
        const vf w0 = *(const vf *)(panel + kk * NR);
        const vf w1 = *(const vf *)(panel + kk * NR + VL);
        for (int r = 0; r < rows; r++) {
            const float xv = xt[kk * MR + r];
            acc0[r] += xv * w0;
            acc1[r] += xv * w1;
        }
    }
    for (int r = 0; r < rows; r++) {
        float *o = out + r * ldo;
        if (cols == NR) {
            vf a0 = acc0[r], a1 = acc1[r];
            if (bias) {
                a0 += *(const vfu *)bias;
                a1 += *(const vfu *)(bias + VL);
            }
            *(vfu *)o = a0;
            *(vfu *)(o + VL) = a1;
        } else {
            float buf[NR];
            *(vfu *)buf = acc0[r];
            *(vfu *)(buf + VL) = acc1[r];
            for (int j = 0; j < cols; j++) o[j] = buf[j] + (bias ? bias[j] : 0.f);
        }
    }
}

static __attribute__((unused)) void tile_rows(const float *xt, const float *panel, int64_t k, const float *next,
                      const float *bias, float *out, int64_t ldo, int rows, int cols) {
    switch (rows) {
#define ROWS(n) \
    case n: tile(xt, panel, k, next, bias, out, ldo, n, cols); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#if MR > 6
        ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14)
#endif
#undef ROWS
    }
}

#endif
