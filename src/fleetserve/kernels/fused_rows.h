/* One row's worth of the fused elementwise ops (fused_ops.c): shared by the standalone
 * kernels, which split rows over threads, and by the decode step (decode_step.c), which
 * runs them inside its own parallel region. One definition each, so both paths compute
 * bit-identical values. */
#ifndef FLEETSERVE_FUSED_ROWS_H
#define FLEETSERVE_FUSED_ROWS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* [res += x;] o = w * r / sqrt(mean(r^2) + eps), r = res (with residual) or x. */
static inline void rms_row(const float *x, float *res, float *o, const float *w, int64_t n,
                           float eps) {
    const float *r = x;
    if (res) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) res[i] += x[i];
        r = res;
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += r[i] * r[i];
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = w[i] * (r[i] * inv);
}

/* o = silu(g) * u */
static inline void silu_row(const float *g, const float *u, float *o, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* "Rotate half" of heads [0, heads) at x (head_dim apart), cos/sin rows c, s. */
static inline void rotate_row(float *x, int heads, int head_dim, const float *c,
                              const float *s) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        float *x1 = x + (int64_t)h * head_dim;
        float *x2 = x1 + half;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

/* Kv head h of one token into slot `offset` of cache block `block` (paged_attention.c's
 * layout: keys d-major within a block, values token-major). */
static inline void cache_write_head(const float *kh, const float *vh, float *k_cache,
                                    float *v_cache, int64_t block, int64_t offset, int h,
                                    int num_kv_heads, int head_dim, int block_size) {
    const int64_t head_block = (block * num_kv_heads + h) * block_size * head_dim;
    float *kt = k_cache + head_block + offset;
    for (int d = 0; d < head_dim; d++) kt[(int64_t)d * block_size] = kh[d];
    memcpy(v_cache + head_block + offset * head_dim, vh, (size_t)head_dim * sizeof(float));
}

#endif
