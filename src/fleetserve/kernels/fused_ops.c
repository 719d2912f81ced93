/* Fused elementwise steps of a decoder layer for the CPU, float32.
 *
 * Each replaces a chain of torch ops (one pass over memory each, plus temporaries)
 * with one pass:
 *   rms_norm     [residual += x;] out = w * r / sqrt(mean(r^2) + eps), r the (new) residual
 *   silu_mul     out = silu(gate) * up, gate and up the two halves of one row
 *   rotary       "rotate half" rotary embedding of q and k heads, in place
 *   cache_write  this step's k and v rows into their slots of the paged KV cache
 *
 * Rows of an input may be strided (a slice of a fused projection's output); the rows of
 * every output are contiguous. Same build as paged_attention.c (see kernels/cpu.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Below this many floats the work runs on the calling thread: waking the team costs
 * more than it saves. */
#define PAR_MIN 16384

void rms_norm(const float *x, int64_t x_stride, float *residual, float *out, const float *w,
              int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PAR_MIN) schedule(static)
    for (int64_t m = 0; m < rows; m++) {
        const float *xr = x + m * x_stride;
        float *o = out + m * n;
        const float *r = xr;
        if (residual) {
            float *res = residual + m * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) res[i] += xr[i];
            r = res;
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += r[i] * r[i];
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (r[i] * inv);
    }
}

void silu_mul(const float *gate_up, int64_t stride, float *out, int64_t rows, int64_t n,
              int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PAR_MIN) schedule(static)
    for (int64_t m = 0; m < rows; m++) {
        const float *g = gate_up + m * stride;
        const float *u = g + n;
        float *o = out + m * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* Heads [0, num_heads) of token t start at x + t * stride + h * head_dim. cos/sin rows
 * are [max_position, head_dim / 2], indexed by the token's position. */
static void rotate_heads(float *x, int64_t stride, int num_heads, int head_dim,
                         const int64_t *positions, const float *cos_t, const float *sin_t,
                         int64_t tokens, int threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * num_heads * head_dim >= PAR_MIN) \
    schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + positions[t] * half;
        const float *s = sin_t + positions[t] * half;
        for (int h = 0; h < num_heads; h++) {
            float *x1 = x + t * stride + (int64_t)h * head_dim;
            float *x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

void rotary(float *q, int64_t q_stride, int num_heads, float *k, int64_t k_stride,
            int num_kv_heads, int head_dim, const int64_t *positions, const float *cos_t,
            const float *sin_t, int64_t tokens, int threads) {
    rotate_heads(q, q_stride, num_heads, head_dim, positions, cos_t, sin_t, tokens, threads);
    rotate_heads(k, k_stride, num_kv_heads, head_dim, positions, cos_t, sin_t, tokens, threads);
}

/* The caches in paged_attention.c's layout: k [num_blocks, num_kv_heads, head_dim,
 * block_size] (d-major), v [num_blocks, num_kv_heads, block_size, head_dim]. Token t
 * goes to block slot_blocks[t], slot slot_offsets[t] of each kv head. */
void cache_write(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                 float *k_cache, float *v_cache, const int64_t *slot_blocks,
                 const int64_t *slot_offsets, int64_t tokens, int num_kv_heads, int head_dim,
                 int block_size, int threads) {
    const size_t row = (size_t)head_dim * sizeof(float);
    /* Split by kv head: each thread writes its own heads' parts of the blocks. */
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1)
    for (int h = 0; h < num_kv_heads; h++) {
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t head_block = (slot_blocks[t] * num_kv_heads + h) * block_size * head_dim;
            const float *kh = k + t * k_stride + (int64_t)h * head_dim;
            float *kt = k_cache + head_block + slot_offsets[t];
            for (int d = 0; d < head_dim; d++) kt[(int64_t)d * block_size] = kh[d];
            memcpy(v_cache + head_block + slot_offsets[t] * head_dim,
                   v + t * v_stride + (int64_t)h * head_dim, row);
        }
    }
}
