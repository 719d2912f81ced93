/* bf16 weights x float32 activations for decode-sized row counts (issue 25 item 1).
 *
 * out[m, n] = sum_k bf16(x[m, k]) * w[n, k], accumulated in float32. The activations are
 * rounded to bf16 (nearest-even) once per row, as a bf16 GEMM would; the weights are
 * stored bf16 (uint16 bit patterns), so a row of W costs half the bytes of float32, which
 * is what a memory-bound decode step pays for. Compiled for the build's target: with
 * AVX512-BF16 the dot products run `vdpbf16ps` (32 products per instruction), without it
 * a portable loop that gives the same sums up to float32 summation order.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define BF16_NATIVE 1
#else
#define BF16_NATIVE 0
#endif

int bf16_native(void) { return BF16_NATIVE; }

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float dot_row(const uint16_t *xb, const uint16_t *w, int64_t k) {
    int64_t i = 0;
    float acc = 0.0f;
#if BF16_NATIVE
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; i + 64 <= k; i += 64) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xb + i),
                              (__m512bh)_mm512_loadu_si512(w + i));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(xb + i + 32),
                              (__m512bh)_mm512_loadu_si512(w + i + 32));
    }
    for (; i + 32 <= k; i += 32)
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xb + i),
                              (__m512bh)_mm512_loadu_si512(w + i));
    acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
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

/* A scratch row of bf16 activations per thread, kept across calls (the OpenMP team's
 * threads live as long as the process); NULL when it cannot grow. */
static uint16_t *thread_scratch(size_t need) {
    static _Thread_local uint16_t *buf = NULL;
    static _Thread_local size_t cap = 0;
    if (need > cap) {
        uint16_t *grown = realloc(buf, need * sizeof(uint16_t));
        if (!grown) return NULL;
        buf = grown, cap = need;
    }
    return buf;
}

/* This thread's share of out[m, n] = bf16(x) @ w^T (+ bias), called by every thread of
 * an OpenMP team (the C step's linear dispatch, or gemm_bf16 below): each rounds the m
 * rows of x into its own scratch, then the weight rows are split over the team (ends in
 * the team's barrier). Every output is computed by the same code whatever the team, so
 * the C step and the module path agree bit for bit. Returns 0, or -1 when this thread's
 * scratch could not grow (its share is then left undone; with abort_on_oom the process
 * aborts instead). */
static int bf16_share(const float *x, int64_t ldx, const uint16_t *w, const float *bias,
                      float *out, int64_t ldo, int64_t m, int64_t n, int64_t k,
                      int abort_on_oom) {
    uint16_t *xb = thread_scratch((size_t)(m * k));
    int rc = 0;
    if (xb) {
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < k; i++) xb[r * k + i] = to_bf16(x[r * ldx + i]);
    } else if (abort_on_oom) {
        /* The C step cannot return an error from inside its team: a share left undone
         * would be a wrong answer served silently, so the process dies loudly instead
         * (the fleet replaces and migrates a dead engine). */
        fprintf(stderr, "fleetserve: gemm_bf16: cannot allocate %lld bf16 scratch values\n",
                (long long)(m * k));
        abort();
    } else {
        rc = -1;
    }
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        if (!xb) continue;
        const float b = bias ? bias[j] : 0.0f;
        int64_t r = 0;
        for (; r + 4 <= m; r += 4) {
            float acc4[4];
            dot_rows4(xb + r * k, k, w + j * k, acc4);
            for (int q = 0; q < 4; q++) out[(r + q) * ldo + j] = acc4[q] + b;
        }
        for (; r < m; r++) out[r * ldo + j] = dot_row(xb + r * k, w + j * k, k) + b;
    }
    return rc;
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
