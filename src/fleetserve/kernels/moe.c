/* The routed experts of one mixture-of-experts layer, tokens grouped by expert.
 *
 * A dense MLP multiplies every token by all of its weights; an MoE layer sends each
 * token to its top-k experts. Run token by token, every expert's weights would be
 * streamed once per token that picked it; here the step's (token, k) pairs are grouped
 * by expert first, so each expert's weights are streamed once per step, in one GEMM
 * over all of its tokens (gemm.c's packed float32 kernel or quant_gemm.c's GGUF blocks):
 *
 *   ids [T, K] (global expert ids), wts [T, K]
 *      -> slots: the pairs whose expert is local, expert-major, (t, k) order within one
 *         expert; expert e's slots are [off[e], off[e + 1])
 *   xg[slot]  = x[token of slot]                          gather
 *   h         = xg[off[e]:off[e+1]] @ gate_up[e]^T        per expert, [n_e, 2I]
 *   y[slots]  = (silu(h[:, :I]) * h[:, I:]) @ down[e]^T   per expert, [n_e, H]
 *   out[t]    = sum over k of wts[t, k] * y[slot(t, k)]   combine, in k order
 *
 * Experts outside [first, first + num_local) are another rank's (expert parallelism):
 * their pairs add nothing here, and the ranks' outputs are summed afterwards. The
 * combine runs in a fixed order per token, so results do not depend on thread timing.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fused_rows.h"

/* One weight matrix [rows, k] of one expert, as the GEMM kernels take it. */
typedef struct {
    const void *data;  /* gemm.c's packed panels (kind < 0) or GGUF block rows */
    int64_t row_bytes; /* bytes per row of blocks; unused for float32 */
    int64_t rows;      /* output features */
    int32_t kind;      /* -1: packed float32; else quant_gemm's qtype id */
    int32_t pad;
} moe_weight;

int gemm_packed(const float *x, int64_t ldx, const float *packed, const float *bias,
                float *out, int64_t ldo, int64_t m, int64_t n, int64_t k, int threads);
int quant_gemm(int qtype, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
               const float *bias, float *out, int64_t ldo, int64_t m, int64_t n, int64_t k,
               int threads);

static int run_gemm(const moe_weight *w, const float *x, int64_t ldx, float *out, int64_t ldo,
                    int64_t m, int64_t k, int threads) {
    if (w->kind < 0)
        return gemm_packed(x, ldx, (const float *)w->data, NULL, out, ldo, m, w->rows, k,
                           threads);
    return quant_gemm(w->kind, x, ldx, (const uint8_t *)w->data, w->row_bytes, NULL, out, ldo,
                      m, w->rows, k, threads);
}

/* out [T, H] (contiguous) = the local experts' share of the layer's output for x [T, H]
 * (row stride ldx). gate_up: num_local * nseg weights, expert-major; segment s of an
 * expert writes columns [sum of earlier segments' rows, + rows) of its [n_e, 2I] output.
 * down: num_local weights [H, I]. Returns 0; -1: out of memory; or a GEMM's error. */
int moe_grouped(const float *x, int64_t ldx, int64_t T, int64_t H, int64_t I,
                const int64_t *ids, const float *wts, int64_t K, int64_t first,
                int64_t num_local, const moe_weight *gate_up, int nseg,
                const moe_weight *down, float *out, int threads) {
    int64_t *off = calloc((size_t)num_local + 1, sizeof(int64_t));
    int64_t *slot_of = malloc((size_t)(T * K + 1) * sizeof(int64_t));
    int64_t *token_of = malloc((size_t)(T * K + 1) * sizeof(int64_t));
    int64_t *cursor = malloc((size_t)(num_local + 1) * sizeof(int64_t));
    float *xg = NULL, *h = NULL, *act = NULL, *y = NULL;
    int rc = -1;
    if (!off || !slot_of || !token_of || !cursor) goto done;
    for (int64_t i = 0; i < T * K; i++) {
        const int64_t e = ids[i] - first;
        if (e >= 0 && e < num_local) off[e + 1]++;
    }
    int64_t max_rows = 0;
    for (int64_t e = 0; e < num_local; e++) {
        if (off[e + 1] > max_rows) max_rows = off[e + 1];
        off[e + 1] += off[e];
    }
    const int64_t n = off[num_local];
    memcpy(cursor, off, (size_t)num_local * sizeof(int64_t));
    for (int64_t i = 0; i < T * K; i++) {
        const int64_t e = ids[i] - first;
        if (e >= 0 && e < num_local) {
            slot_of[i] = cursor[e]++;
            token_of[slot_of[i]] = i / K;
        } else {
            slot_of[i] = -1;
        }
    }
    xg = malloc((size_t)(n + 1) * H * sizeof(float));
    h = malloc((size_t)(max_rows + 1) * 2 * I * sizeof(float));
    act = malloc((size_t)(max_rows + 1) * I * sizeof(float));
    y = malloc((size_t)(n + 1) * H * sizeof(float));
    if (!xg || !h || !act || !y) goto done;

#pragma omp parallel for num_threads(threads) schedule(static) if (n * H > 32768)
    for (int64_t s = 0; s < n; s++)
        memcpy(xg + s * H, x + token_of[s] * ldx, (size_t)H * sizeof(float));

    rc = 0;
    for (int64_t e = 0; e < num_local && rc == 0; e++) {
        const int64_t m = off[e + 1] - off[e];
        if (m == 0) continue;
        const float *xe = xg + off[e] * H;
        int64_t col = 0;
        for (int s = 0; s < nseg && rc == 0; s++) {
            const moe_weight *w = &gate_up[e * nseg + s];
            rc = run_gemm(w, xe, H, h + col, 2 * I, m, H, threads);
            col += w->rows;
        }
        if (rc) break;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * I > 32768)
        for (int64_t r = 0; r < m; r++) silu_row(h + r * 2 * I, h + r * 2 * I + I, act + r * I, I);
        rc = run_gemm(&down[e], act, I, y + off[e] * H, H, m, I, threads);
    }
    if (rc) goto done;

#pragma omp parallel for num_threads(threads) schedule(static) if (T * H > 32768)
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * H;
        memset(o, 0, (size_t)H * sizeof(float));
        for (int64_t k = 0; k < K; k++) {
            const int64_t s = slot_of[t * K + k];
            if (s < 0) continue;
            const float wk = wts[t * K + k];
            const float *ys = y + s * H;
#pragma omp simd
            for (int64_t j = 0; j < H; j++) o[j] += wk * ys[j];
        }
    }
done:
    free(off);
    free(slot_of);
    free(token_of);
    free(cursor);
    free(xg);
    free(h);
    free(act);
    free(y);
    return rc;
}
