/* A whole decode step of a Llama-family decoder in one call, one OpenMP parallel region.
 *
 * Why: on one stream a step is ~30 layers x ~10 small kernels. Called one by one from
 * Python, each costs a few microseconds of glue (module call, ctypes checks, an output
 * tensor) and opens its own parallel region, whose end parks the team: with the short
 * OpenMP spin fleetserve sets (busy machines), every region pays a futex sleep and wake.
 * Here the pointers that do not change between steps (weights, norms, caches, rotary
 * tables) sit in a plan built once at load; one call runs every layer.
 *
 * Inside the region only the work worth splitting is split: the GEMMs (each thread takes
 * chunks of weight rows through the same share functions the standalone kernels use, so
 * every output is computed by the same code) and attention (one item per sequence, or
 * per (sequence, kv head) when there are fewer sequences than threads). The cheap
 * row-wise work (residual add + RMSNorm, silu * mul, block sums) is done by EVERY thread
 * on its own copy: the residual stream and the next GEMM's input are private, identical
 * in each thread, so no barrier is needed to hand them over. Per layer that leaves five
 * barriers (after qkv, attention, o, gate_up, down) and no region start or end.
 *
 * Per layer, for the step's m decode rows (one query token per sequence, row i =
 * sequence i):
 *   h = rmsnorm(res += x)                            private, every thread
 *   qkv = h @ Wqkv^T                                 split by weight rows     | barrier
 *   per (sequence, kv head): bias, q/k norm, rotary, cache write, attention  | barrier
 *   x = attn @ Wo^T                                  split                    | barrier
 *   h = rmsnorm(res += x); gu = h @ Wgu^T            private; split           | barrier
 *   h = silu(gate) * up; x = h @ Wdown^T             private; split           | barrier
 * and after the last layer, out = rmsnorm(res += x).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fused_rows.h"

/* quant_gemm.c, gemm.c, paged_attention.c */
void quant_gemm_share(int qtype, const float *x, int64_t ldx, const float *xsum,
                      const uint8_t *w, int64_t row_bytes, float *out, int64_t ldo, int64_t m,
                      int64_t n, int64_t k);
void quant_panel_xsum(const float *x, int64_t ldx, int64_t m, int64_t k, float *xsum);
int quant_share_max_rows(void);
void gemm_packed_share(const float *x, int64_t ldx, float *xp, const float *packed,
                       const float *bias, float *out, int64_t ldo, int64_t m, int64_t n,
                       int64_t k);
int gemm_share_max_rows(void);
int64_t gemm_x_floats(int64_t m, int64_t k);
void attend_tile_dispatch(const float *q, int64_t q_stride, const float *k_cache,
                          const float *v_cache, float *out, const int64_t *table,
                          int64_t q_start, int64_t q_len, int64_t seq_len, int64_t r0,
                          int64_t r1, int h0, int h1, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, float scale, int window,
                          float softcap, float *scores);

/* The plan: mirrored field for field by kernels/decode_step.py (ctypes). */
enum { W_QUANT = 0, W_PACKED = 1 };
#define MAX_SEGMENTS 3

typedef struct {
    int32_t kind;  /* W_QUANT: GGUF blocks (quant.py), W_PACKED: gemm.c panels */
    int32_t qtype; /* W_QUANT only */
    const void *data;
    int64_t row_bytes; /* W_QUANT only */
    int64_t n;         /* output features of this segment */
} ds_segment;

/* Output features: the segments side by side. bias: NULL, or [sum of n] (a packed
 * weight adds it in its register tile, quantized ones after the GEMM, as quant.py). */
typedef struct {
    ds_segment seg[MAX_SEGMENTS];
    int32_t num_segments;
    int64_t k;
    const float *bias;
} ds_linear;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q/k_norm NULL: none */
    ds_linear qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* kv_cache_shapes (cpu.py): keys d-major in a block */
} ds_layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const float *cos, *sin; /* [max_position, head_dim / 2] */
    const float *final_norm;
    const ds_layer *layers;
} ds_plan;

int decode_step_max_rows(void) {
    const int q = quant_share_max_rows(), g = gemm_share_max_rows();
    return q < g ? q : g;
}

/* This thread's share of out[m, n] = x @ W^T (+ bias for packed weights); xsum: x's block
 * sums when a segment is in a panel format; xp: this thread's tile buffer. Ends in the
 * team's barrier (that of the last segment's `omp for`). */
static void linear_share(const ds_linear *lin, const float *x, int64_t ldx, const float *xsum,
                         float *xp, float *out, int64_t ldo, int64_t m) {
    int64_t off = 0;
    for (int s = 0; s < lin->num_segments; s++) {
        const ds_segment *g = &lin->seg[s];
        if (g->kind == W_PACKED) {
            gemm_packed_share(x, ldx, xp, g->data, lin->bias ? lin->bias + off : NULL,
                              out + off, ldo, m, g->n, lin->k);
        } else {
            quant_gemm_share(g->qtype, x, ldx, xsum, g->data, g->row_bytes, out + off, ldo, m,
                             g->n, lin->k);
        }
        off += g->n;
    }
}

static int quant_bias(const ds_linear *lin) {
    return lin->bias && lin->num_segments > 0 && lin->seg[0].kind == W_QUANT;
}

/* Sequence i's query heads of kv heads [h0, h1), its keys and values of those heads: bias
 * (quantized qkv), q/k norm, rotary, cache write, then attention into attn. */
static void attend_item(const ds_plan *p, const ds_layer *L, float *qkv, int64_t ldq,
                        float *attn, int64_t i, int h0, int h1, const int64_t *positions,
                        const int64_t *slot_blocks, const int64_t *slot_offsets,
                        const int64_t *seq_lens, const int64_t *tables, int64_t max_blocks,
                        float *scores) {
    const int hd = p->head_dim, group = p->num_heads / p->num_kv_heads;
    const int64_t q_size = (int64_t)p->num_heads * hd, kv_size = (int64_t)p->num_kv_heads * hd;
    float *row = qkv + i * ldq;
    const float *c = p->cos + positions[i] * (hd / 2), *s = p->sin + positions[i] * (hd / 2);
    for (int h = h0; h < h1; h++) {
        float *q = row + (int64_t)h * group * hd, *k = row + q_size + (int64_t)h * hd;
        float *v = k + kv_size;
        if (quant_bias(&L->qkv)) {
            const float *b = L->qkv.bias;
            for (int64_t j = 0; j < group * hd; j++) q[j] += b[h * group * hd + j];
            for (int j = 0; j < hd; j++) k[j] += b[q_size + h * hd + j];
            for (int j = 0; j < hd; j++) v[j] += b[q_size + kv_size + h * hd + j];
        }
        if (L->q_norm) {
            for (int g = 0; g < group; g++)
                rms_row(q + g * hd, NULL, q + g * hd, L->q_norm, hd, p->eps);
            rms_row(k, NULL, k, L->k_norm, hd, p->eps);
        }
        rotate_row(q, group, hd, c, s);
        rotate_row(k, 1, hd, c, s);
        cache_write_head(k, v, L->k_cache, L->v_cache, slot_blocks[i], slot_offsets[i], h,
                         p->num_kv_heads, hd, p->block_size);
    }
    attend_tile_dispatch(qkv, ldq, L->k_cache, L->v_cache, attn, tables + i * max_blocks, i, 1,
                         seq_lens[i], 0, 1, h0, h1, p->num_heads, p->num_kv_heads, hd,
                         p->block_size, p->scale, 0, 0.f, scores);
}

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    const int64_t ab = a > b ? a : b;
    return ab > c ? ab : c;
}

static size_t up64(size_t floats) { return (floats + 15) / 16 * 16; }

/* x: [m, hidden] the step's embeddings (read only); out: [m, hidden] the final norm's
 * output. Row i is sequence i's one decode token: positions, slot_blocks, slot_offsets,
 * seq_lens [m] int64; tables [m, max_blocks] int64. Returns 0; -1: out of memory; -2: m
 * above decode_step_max_rows(). */
int decode_step(const ds_plan *p, const float *x, float *out, int64_t m,
                const int64_t *positions, const int64_t *slot_blocks,
                const int64_t *slot_offsets, const int64_t *seq_lens, const int64_t *tables,
                int64_t max_blocks, int threads) {
    if (m < 1 || m > decode_step_max_rows()) return -2;
    const int64_t H = p->hidden, I = p->intermediate, hd = p->head_dim;
    const int64_t q_size = p->num_heads * hd, ldq = q_size + 2 * p->num_kv_heads * hd;
    const int64_t kmax = max3(H, I, q_size);
    int64_t max_len = 1;
    for (int64_t i = 0; i < m; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    if (threads < 1) threads = 1;
    /* Shared: qkv, attn, x (o and down outputs), gate_up. Private per thread: residual,
     * GEMM input, block sums, x tiles, attention scores. */
    const size_t shared = up64(m * ldq) + up64(m * q_size) + up64(m * H) + up64(m * 2 * I);
    const size_t priv = up64(m * H) + up64(m * kmax) + up64(m * (kmax / 32) + 1) +
                        up64(gemm_x_floats(m, kmax)) + up64(p->num_heads * max_len);
    float *buf = aligned_alloc(64, (shared + (size_t)threads * priv) * sizeof(float));
    if (!buf) return -1;
    float *qkv = buf, *attn = qkv + up64(m * ldq), *xs = attn + up64(m * q_size);
    float *gu = xs + up64(m * H);
    const int64_t split = m < threads ? p->num_kv_heads : 1; /* attention items per row */
#pragma omp parallel num_threads(threads)
    {
        float *res = buf + shared + (size_t)omp_get_thread_num() * priv;
        float *h = res + up64(m * H), *xsum = h + up64(m * kmax);
        float *xp = xsum + up64(m * (kmax / 32) + 1), *scores = xp + up64(gemm_x_floats(m, kmax));
        memcpy(res, x, (size_t)(m * H) * sizeof(float));
        for (int l = 0; l < p->num_layers; l++) {
            const ds_layer *L = &p->layers[l];
            for (int64_t r = 0; r < m; r++)
                rms_row(l ? xs + r * H : res + r * H, l ? res + r * H : NULL, h + r * H,
                        L->input_norm, H, p->eps);
            quant_panel_xsum(h, H, m, H, xsum);
            linear_share(&L->qkv, h, H, xsum, xp, qkv, ldq, m);
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < m * split; it++) {
                const int h0 = split == 1 ? 0 : (int)(it % split);
                const int h1 = split == 1 ? p->num_kv_heads : h0 + 1;
                attend_item(p, L, qkv, ldq, attn, it / split, h0, h1, positions, slot_blocks,
                            slot_offsets, seq_lens, tables, max_blocks, scores);
            }
            quant_panel_xsum(attn, q_size, m, q_size, xsum);
            linear_share(&L->o, attn, q_size, xsum, xp, xs, H, m);
            for (int64_t r = 0; r < m; r++)
                rms_row(xs + r * H, res + r * H, h + r * H, L->post_norm, H, p->eps);
            quant_panel_xsum(h, H, m, H, xsum);
            linear_share(&L->gate_up, h, H, xsum, xp, gu, 2 * I, m);
            for (int64_t r = 0; r < m; r++)
                silu_row(gu + r * 2 * I, gu + r * 2 * I + I, h + r * I, I);
            quant_panel_xsum(h, I, m, I, xsum);
            linear_share(&L->down, h, I, xsum, xp, xs, H, m);
        }
#pragma omp master
        for (int64_t r = 0; r < m; r++)
            rms_row(xs + r * H, res + r * H, out + r * H, p->final_norm, H, p->eps);
    }
    free(buf);
    return 0;
}
