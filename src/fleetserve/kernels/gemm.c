/* out = x @ W^T (+ bias) for the CPU, float32, with W repacked once at load time.
 *
 * Why not the BLAS behind torch: decode steps multiply a handful of rows (one per
 * running request) by every weight of the model. There the weights are streamed from
 * memory once per step, and a general GEMM that re-packs its operands on every call
 * leaves much of the memory bandwidth and of the FMA units idle. Here the weights are
 * packed ahead of time into column panels laid out in the order the inner loop reads
 * them, so each step streams them straight through, prefetching the next panel while
 * the current one is used for every row.
 *
 * Layouts (float32):
 *   W       [n, k] row-major (nn.Linear's weight)
 *   packed  [ceil(n / NR)][k][NR]: panel p holds output columns p*NR .. p*NR+NR-1,
 *           k-major, zero padded past n
 *   x       [m, k] with row stride ldx; out [m, n] with row stride ldo
 * Rows of x are copied per block of MC rows into tiles [k][MR], so the MR values the
 * inner loop broadcasts at step kk lie side by side.
 *
 * Register tile: MR rows x NR columns of out, held in 2*MR vector accumulators (NR is
 * two vectors wide). GCC vector extensions keep it portable: AVX-512 gets 16-float
 * vectors and 14 rows (28 + 3 of 32 registers), narrower targets 8 floats and 6 rows.
 */
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

int gemm_panel_width(void) { return NR; }

void gemm_pack_weight(const float *w, int64_t n, int64_t k, float *packed, int threads) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * NR;
        for (int64_t j = 0; j < NR; j++) {
            const int64_t row = p * NR + j;
            if (row < n) {
                for (int64_t kk = 0; kk < k; kk++) dst[kk * NR + j] = w[row * k + kk];
            } else {
                for (int64_t kk = 0; kk < k; kk++) dst[kk * NR + j] = 0.f;
            }
        }
    }
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

static void tile_rows(const float *xt, const float *panel, int64_t k, const float *next,
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

/* Returns 0, or -1 if the row buffer could not be allocated. */
int gemm_packed(const float *x, int64_t ldx, const float *packed, const float *bias,
                float *out, int64_t ldo, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t block = m <= MC_ONE ? MC_ONE : MC;
    const size_t xbytes = ((size_t)block * k * sizeof(float) + 63) / 64 * 64;
    float *xp = aligned_alloc(64, xbytes);
    if (!xp) return -1;
    for (int64_t m0 = 0; m0 < m; m0 += block) {
        const int64_t mc = m - m0 < block ? m - m0 : block;
        const int64_t tiles = (mc + MR - 1) / MR;
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
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
            /* Each thread takes a contiguous run of panels: it streams its share of the
             * weights in order, and the prefetch of the next panel stays its own. */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
                const float *panel = packed + p * k * NR;
                const float *next = p + 1 < panels ? panel + k * NR : NULL;
                for (int64_t t = 0; t < tiles; t++) {
                    const int rows = (int)(mc - t * MR < MR ? mc - t * MR : MR);
                    tile_rows(xp + t * k * MR, panel, k, t == 0 ? next : NULL,
                              bias ? bias + p * NR : NULL, out + (m0 + t * MR) * ldo + p * NR,
                              ldo, rows, cols);
                }
            }
        }
    }
    free(xp);
    return 0;
}
