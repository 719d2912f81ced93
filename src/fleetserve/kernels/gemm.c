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
#include "gemm_tile.h"

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

/* This thread's share of the panels for one block of mc rows (tiles packed at xp): an
 * orphaned `omp for`. Each thread takes a contiguous run of panels: it streams its share
 * of the weights in order, and the prefetch of the next panel stays its own. */
__attribute__((noinline)) static void panels_share(const float *xp, const float *packed, const float *bias, float *out,
                         int64_t ldo, int64_t mc, int64_t n, int64_t k) {
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t tiles = (mc + MR - 1) / MR;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
        const float *panel = packed + p * k * NR;
        const float *next = p + 1 < panels ? panel + k * NR : NULL;
        for (int64_t t = 0; t < tiles; t++) {
            const int rows = (int)(mc - t * MR < MR ? mc - t * MR : MR);
            tile_rows(xp + t * k * MR, panel, k, t == 0 ? next : NULL,
                      bias ? bias + p * NR : NULL, out + t * MR * ldo + p * NR, ldo, rows,
                      cols);
        }
    }
}

/* This thread's share of out = x @ W^T (+ bias) for any m, inside a parallel region: per
 * block of rows (MC_ONE rows when m <= MC_ONE, else MC), the team packs the block's x
 * tiles into the shared buffer xp (gemm_rows_x_floats(k) floats, 64-byte aligned), then
 * splits the panels. Each block ends in the team's barrier. gemm_packed runs it, and so
 * does the decode step (decode_step.c) for steps past the private shares' rows. */
void gemm_packed_rows_share(const float *x, int64_t ldx, float *xp, const float *packed,
                            const float *bias, float *out, int64_t ldo, int64_t m, int64_t n,
                            int64_t k) {
    const int64_t block = m <= MC_ONE ? MC_ONE : MC;
    for (int64_t m0 = 0; m0 < m; m0 += block) {
        const int64_t mc = m - m0 < block ? m - m0 : block;
        pack_x_tiles(x, ldx, m0, mc, m, k, xp);
        panels_share(xp, packed, bias, out + m0 * ldo, ldo, mc, n, k);
    }
}

int64_t gemm_rows_x_floats(int64_t k) { return (int64_t)MC_ONE * k; }

/* Returns 0, or -1 if the row buffer could not be allocated. */
int gemm_packed(const float *x, int64_t ldx, const float *packed, const float *bias,
                float *out, int64_t ldo, int64_t m, int64_t n, int64_t k, int threads) {
    const size_t xbytes = ((size_t)gemm_rows_x_floats(k) * sizeof(float) + 63) / 64 * 64;
    float *xp = aligned_alloc(64, xbytes);
    if (!xp) return -1;
#pragma omp parallel num_threads(threads)
    gemm_packed_rows_share(x, ldx, xp, packed, bias, out, ldo, m, n, k);
    free(xp);
    return 0;
}

/* The decode step's entry (decode_step.c), for m <= gemm_share_max_rows(): x's m rows
 * packed by this thread alone into its own tiles at xp (gemm_x_floats(m, k) floats,
 * 64-byte aligned), then this thread's share of out = x @ W^T + bias, the same
 * arithmetic as gemm_packed. */
void gemm_packed_share(const float *x, int64_t ldx, float *xp, const float *packed,
                       const float *bias, float *out, int64_t ldo, int64_t m, int64_t n,
                       int64_t k) {
    for (int64_t t = 0; t < (m + MR - 1) / MR; t++) pack_x_tile(x, ldx, 0, t, m, k, xp);
    panels_share(xp, packed, bias, out, ldo, m, n, k);
}

int gemm_share_max_rows(void) { return MC_ONE; }

int64_t gemm_x_floats(int64_t m, int64_t k) { return (m + MR - 1) / MR * MR * k; }
