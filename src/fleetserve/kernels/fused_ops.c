/* Fused elementwise steps of a decoder layer for the CPU, float32.
 *
 * Each replaces a chain of torch ops (one pass over memory each, plus temporaries)
 * with one pass:
 *   rms_norm     [residual += x;] out = w * r / sqrt(mean(r^2) + eps), r the (new) residual
 *   silu_mul     out = silu(gate) * up, gate and up the two halves of one row
 *   rotary       "rotate half" rotary embedding of q and k heads, in place
 *   cache_write  this step's k and v rows into their slots of the paged KV cache
 *   rms_norm_heads  RMSNorm of each head of q or k (Qwen3's q/k norm)
 *
 * Rows of an input may be strided (a slice of a fused projection's output); the rows of
 * every output are contiguous. Same build as paged_attention.c (see kernels/cpu.py).
 */
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fused_rows.h"

#define NOINLINE __attribute__((noinline))

/* [res += x;] o = w * r / sqrt(mean(r^2) + eps), r = res (with residual) or x. */
NOINLINE void rms_row(const float *x, float *res, float *o, const float *w, int64_t n,
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
NOINLINE void silu_row(const float *g, const float *u, float *o, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* o = gelu_tanh(g) * u (Gemma's GeGLU), gelu_tanh(g) = 0.5 g (1 + tanh(y)) with
 * y = sqrt(2 / pi) (g + 0.044715 g^3), written as g * sigmoid(2 y): the same value. The
 * exponent is clamped to +-80: -ffast-math assumes no infinities, and exp's overflow
 * (|g| past ~10) would otherwise give NaN; at 80 the sigmoid is already 0 or 1. */
NOINLINE void gelu_tanh_row(const float *g, const float *u, float *o, int64_t n) {
    const float c = 1.5957691216057308f; /* 2 sqrt(2 / pi) */
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        float z = -c * (x + 0.044715f * x * x * x);
        z = z > 80.f ? 80.f : (z < -80.f ? -80.f : z);
        o[i] = x / (1.f + expf(z)) * u[i];
    }
}

/* "Rotate half" of heads [0, heads) at x (head_dim apart), cos/sin rows c, s. */
NOINLINE void rotate_row(float *x, int heads, int head_dim, const float *c,
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
/* float32 to bf16, rounded to nearest even (as torch's .to(torch.bfloat16)); a NaN stays
 * a (quiet) NaN. Integer ops only: -ffast-math does not touch them. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

NOINLINE void cache_write_head(const float *kh, const float *vh, void *k_cache,
                                    void *v_cache, int64_t block, int64_t offset, int h,
                                    int num_kv_heads, int head_dim, int block_size,
                                    int bf16) {
    const int64_t head_block = (block * num_kv_heads + h) * block_size * head_dim;
    if (bf16) {
        uint16_t *kt = (uint16_t *)k_cache + head_block + offset;
        uint16_t *vt = (uint16_t *)v_cache + head_block + offset * head_dim;
        for (int d = 0; d < head_dim; d++) kt[(int64_t)d * block_size] = to_bf16(kh[d]);
        for (int d = 0; d < head_dim; d++) vt[d] = to_bf16(vh[d]);
        return;
    }
    float *kt = (float *)k_cache + head_block + offset;
    for (int d = 0; d < head_dim; d++) kt[(int64_t)d * block_size] = kh[d];
    memcpy((float *)v_cache + head_block + offset * head_dim, vh,
           (size_t)head_dim * sizeof(float));
}


/* Below this many floats the work runs on the calling thread: waking the team costs
 * more than it saves. */
#define PAR_MIN 16384

void rms_norm(const float *x, int64_t x_stride, float *residual, float *out, const float *w,
              int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PAR_MIN) schedule(static)
    for (int64_t m = 0; m < rows; m++)
        rms_row(x + m * x_stride, residual ? residual + m * n : NULL, out + m * n, w, n, eps);
}

/* RMSNorm of each head (Qwen3's q/k norm): x [tokens, heads, head_dim], tokens x_stride
 * floats apart, each token's heads contiguous; out [tokens, heads, head_dim] contiguous. */
void rms_norm_heads(const float *x, int64_t x_stride, int heads, float *out, const float *w,
                    int64_t tokens, int head_dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (tokens * heads * head_dim >= PAR_MIN) \
    schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        for (int h = 0; h < heads; h++)
            rms_row(x + t * x_stride + (int64_t)h * head_dim, NULL,
                    out + (t * heads + h) * head_dim, w, head_dim, eps);
}

void silu_mul(const float *gate_up, int64_t stride, float *out, int64_t rows, int64_t n,
              int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PAR_MIN) schedule(static)
    for (int64_t m = 0; m < rows; m++)
        silu_row(gate_up + m * stride, gate_up + m * stride + n, out + m * n, n);
}

void gelu_tanh_mul(const float *gate_up, int64_t stride, float *out, int64_t rows, int64_t n,
                   int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PAR_MIN) schedule(static)
    for (int64_t m = 0; m < rows; m++)
        gelu_tanh_row(gate_up + m * stride, gate_up + m * stride + n, out + m * n, n);
}

/* Heads [0, num_heads) of token t start at x + t * stride + h * head_dim. cos/sin rows
 * are [max_position, head_dim / 2], indexed by the token's position. */
static void rotate_heads(float *x, int64_t stride, int num_heads, int head_dim,
                         const int64_t *positions, const float *cos_t, const float *sin_t,
                         int64_t tokens, int threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * num_heads * head_dim >= PAR_MIN) \
    schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        rotate_row(x + t * stride, num_heads, head_dim, cos_t + positions[t] * half,
                   sin_t + positions[t] * half);
}

void rotary(float *q, int64_t q_stride, int num_heads, float *k, int64_t k_stride,
            int num_kv_heads, int head_dim, const int64_t *positions, const float *cos_t,
            const float *sin_t, int64_t tokens, int threads) {
    rotate_heads(q, q_stride, num_heads, head_dim, positions, cos_t, sin_t, tokens, threads);
    rotate_heads(k, k_stride, num_kv_heads, head_dim, positions, cos_t, sin_t, tokens, threads);
}

/* The caches in paged_attention.c's layout: k [num_blocks, num_kv_heads, head_dim,
 * block_size] (d-major), v [num_blocks, num_kv_heads, block_size, head_dim]; float32, or
 * bf16 when `bf16`. Token t goes to block slot_blocks[t], slot slot_offsets[t] of each kv
 * head. */
void cache_write(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                 void *k_cache, void *v_cache, const int64_t *slot_blocks,
                 const int64_t *slot_offsets, int64_t tokens, int num_kv_heads, int head_dim,
                 int block_size, int bf16, int threads) {
    /* Split by kv head: each thread writes its own heads' parts of the blocks. */
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1)
    for (int h = 0; h < num_kv_heads; h++)
        for (int64_t t = 0; t < tokens; t++)
            cache_write_head(k + t * k_stride + (int64_t)h * head_dim,
                             v + t * v_stride + (int64_t)h * head_dim, k_cache, v_cache,
                             slot_blocks[t], slot_offsets[t], h, num_kv_heads, head_dim,
                             block_size, bf16);
}

/* numpy's argmax of x[0, n) (n >= 1): the first maximum, or the first NaN if there is
 * one. NaN is found by its bits: under -ffast-math a float compare may not see it. */
static int is_nan_bits(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    return (b & 0x7fffffffu) > 0x7f800000u;
}

int span_argmax(const float *x, int64_t n, float *best, int64_t *idx) {
    float m = x[0];
    int nan = 0;
    int64_t i = 0;
#ifdef __AVX512F__
    if (n >= 16) {
        const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
        __m512 vm = _mm512_loadu_ps(x);
        __mmask16 nm = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            nm |= _mm512_cmpgt_epu32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf);
            vm = _mm512_max_ps(vm, v);
        }
        nan = nm != 0;
        m = _mm512_reduce_max_ps(vm);
    }
#endif
    for (; i < n; i++) {
        nan |= is_nan_bits(x[i]);
        m = x[i] > m ? x[i] : m;
    }
    i = 0;
    if (nan) {
        while (!is_nan_bits(x[i])) i++;
    } else {
#ifdef __AVX512F__
        const __m512 vm = _mm512_set1_ps(m);
        for (; i + 16 <= n; i += 16) {
            const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vm, _CMP_EQ_OQ);
            if (eq) {
                i += __builtin_ctz(eq);
                break;
            }
        }
#endif
        while (x[i] != m) i++;
    }
    *best = x[i];
    *idx = i;
    return nan;
}

/* The argmax of a row from its spans' span_argmax results, spans in index order (idx
 * -1: an empty span): the first span's NaN, else the first of the largest. */
int64_t argmax_merge(const float *best, const int64_t *idx, const int *nan, int spans) {
    for (int s = 0; s < spans; s++)
        if (idx[s] >= 0 && nan[s]) return idx[s];
    int64_t r = -1;
    float m = 0.f;
    for (int s = 0; s < spans; s++)
        if (idx[s] >= 0 && (r < 0 || best[s] > m)) {
            m = best[s];
            r = idx[s];
        }
    return r;
}

/* out[r] = argmax of row r of x [rows, n] (numpy's), n >= 1, each row cut into `spans`
 * (<= 64) as the decode step cuts a row over its team: the standalone twin of the step's
 * fused argmax (the same span and merge code), for tests. */
void rows_argmax(const float *x, int64_t rows, int64_t n, int spans, int64_t *out) {
    float best[64];
    int64_t idx[64];
    int nan[64];
    spans = spans < 1 ? 1 : spans > 64 ? 64 : spans;
    for (int64_t r = 0; r < rows; r++) {
        for (int s = 0; s < spans; s++) {
            const int64_t v0 = n * s / spans, v1 = n * (s + 1) / spans;
            idx[s] = -1;
            nan[s] = 0;
            if (v1 > v0) {
                nan[s] = span_argmax(x + r * n + v0, v1 - v0, &best[s], &idx[s]);
                idx[s] += v0;
            }
        }
        out[r] = argmax_merge(best, idx, nan, spans);
    }
}
