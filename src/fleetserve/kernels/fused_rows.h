/* One row's worth of the fused elementwise ops, defined in fused_ops.c: shared by the
 * standalone kernels, which split rows over threads, and by the decode step
 * (decode_step.c), which runs them inside its own parallel region. Out-of-line and never
 * inlined on purpose: under -ffast-math each inlined copy of a reduction or of a
 * vectorized expf may be compiled into a different order of operations; one machine
 * copy makes both paths bit-identical. */
#ifndef FLEETSERVE_FUSED_ROWS_H
#define FLEETSERVE_FUSED_ROWS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* [res += x;] o = w * r / sqrt(mean(r^2) + eps), r = res (with residual) or x. */
void rms_row(const float *x, float *res, float *o, const float *w, int64_t n, float eps);

/* o = silu(g) * u */
void silu_row(const float *g, const float *u, float *o, int64_t n);

/* o = gelu_tanh(g) * u (Gemma's GeGLU) */
void gelu_tanh_row(const float *g, const float *u, float *o, int64_t n);

/* "Rotate half" of heads [0, heads) at x (head_dim apart), cos/sin rows c, s. */
void rotate_row(float *x, int heads, int head_dim, const float *c, const float *s);

/* Kv head h of one token into slot `offset` of cache block `block` (paged_attention.c's
 * layout: keys d-major within a block, values token-major); the caches hold float32, or
 * bf16 (rounded to nearest even) when `bf16`. */
void cache_write_head(const float *kh, const float *vh, void *k_cache, void *v_cache,
                      int64_t block, int64_t offset, int h, int num_kv_heads, int head_dim,
                      int block_size, int bf16);

/* numpy's argmax of x[0, n), n >= 1 (the first maximum; the first NaN if any): index
 * and value out; returns 1 when it is a NaN. */
int span_argmax(const float *x, int64_t n, float *best, int64_t *idx);

/* A row's argmax from its spans' span_argmax results in index order (idx -1: empty). */
int64_t argmax_merge(const float *best, const int64_t *idx, const int *nan, int spans);

#endif
