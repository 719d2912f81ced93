/* Paged attention for the CPU: each query row reads its request's keys and values
 * straight from the paged KV cache, block by block, with no gathered copy.
 *
 * Layout (float32, contiguous):
 *   q, out       [num_tokens, num_heads, head_dim]
 *   k cache      [num_blocks, num_kv_heads, head_dim, block_size]: d-major within a
 *                block, so the scores of a block's keys are block_size-wide vector FMAs
 *                with no horizontal sums
 *   v cache      [num_blocks, num_kv_heads, block_size, head_dim]: token-major, so a
 *                value row is added into a head_dim-wide accumulator
 *   tables       [num_seqs, max_blocks] block ids (int64), row i for sequence i
 * Either way one kv head's part of a block is contiguous (block_size * head_dim floats).
 * Sequence i owns query rows q_starts[i] .. q_starts[i] + q_lens[i]; its cache holds
 * seq_lens[i] tokens, the last q_lens[i] of which are these queries (causal: row j sees
 * keys 0 .. seq_lens[i] - q_lens[i] + j).
 *
 * One work item is (sequence, kv head, tile of query rows). The num_heads / num_kv_heads
 * query heads that share a kv head are handled together, so each key and value row is
 * loaded once for all of them. Softmax is two-pass over a per-thread score buffer.
 *
 * Built at run time by fleetserve/kernels/cpu.py (cc -O3 -march=native -ffast-math
 * -fopenmp) and called through ctypes; it links the libgomp that torch has loaded, so
 * it shares torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define Q_TILE 16

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned access */

/* s[j] = scale * qg . key_j for the first nk keys of a block whose keys are stored
 * d-major (kt[d * block_size + j]). A 16-key block (the default block size) is one or
 * two vectors of keys, summed in four independent chains over d; other block sizes take
 * a plain loop. */
static inline __attribute__((always_inline)) void block_scores(const float *qg, const float *kt,
                                                               int nk, const int head_dim,
                                                               int block_size, float scale,
                                                               float *s) {
    if (block_size == 16) {
        enum { NV = 16 / VL };
        vf a[4][NV];
        for (int c = 0; c < 4; c++)
            for (int u = 0; u < NV; u++) a[c][u] = (vf){0};
        int d = 0;
        for (; d + 4 <= head_dim; d += 4)
            for (int c = 0; c < 4; c++)
                for (int u = 0; u < NV; u++)
                    a[c][u] += qg[d + c] * *(const vfu *)(kt + (d + c) * 16 + u * VL);
        for (; d < head_dim; d++)
            for (int u = 0; u < NV; u++) a[0][u] += qg[d] * *(const vfu *)(kt + d * 16 + u * VL);
        float tmp[16];
        for (int u = 0; u < NV; u++) {
            const vf r = ((a[0][u] + a[1][u]) + (a[2][u] + a[3][u])) * scale;
            if (nk == 16)
                *(vfu *)(s + u * VL) = r;
            else
                *(vfu *)(tmp + u * VL) = r;
        }
        for (int j = 0; j < nk && nk < 16; j++) s[j] = tmp[j];
        return;
    }
    for (int j = 0; j < nk; j++) s[j] = 0.f;
    for (int d = 0; d < head_dim; d++) {
        const float qd = qg[d];
        const float *row = kt + (int64_t)d * block_size;
#pragma omp simd
        for (int j = 0; j < nk; j++) s[j] += qd * row[j];
    }
    for (int j = 0; j < nk; j++) s[j] *= scale;
}

/* og += sum_j p[j] * value_j over the first nk values of a block (token-major rows).
 * For head sizes of up to 8 vectors the sums are kept in vector registers (two chains
 * over alternate keys when they fit), and added to og once per block. */
static inline __attribute__((always_inline)) void block_values(const float *p, const float *vb,
                                                               int nk, const int head_dim,
                                                               float *og) {
    if (head_dim % VL == 0 && head_dim <= 8 * VL) {
        const int nv = head_dim / VL;
        const int chains = nv <= 4 ? 2 : 1;
        vf a[2][8];
        for (int c = 0; c < chains; c++)
            for (int u = 0; u < nv; u++) a[c][u] = (vf){0};
        int j = 0;
        for (; j + chains <= nk; j += chains)
            for (int c = 0; c < chains; c++) {
                const float pj = p[j + c];
                const float *row = vb + (int64_t)(j + c) * head_dim;
                for (int u = 0; u < nv; u++) a[c][u] += pj * *(const vfu *)(row + u * VL);
            }
        for (; j < nk; j++)
            for (int u = 0; u < nv; u++)
                a[0][u] += p[j] * *(const vfu *)(vb + (int64_t)j * head_dim + u * VL);
        for (int u = 0; u < nv; u++) {
            vf sum = a[0][u];
            if (chains == 2) sum += a[1][u];
            *(vfu *)(og + u * VL) += sum;
        }
        return;
    }
    for (int j = 0; j < nk; j++) {
        const float pj = p[j];
        const float *row = vb + (int64_t)j * head_dim;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) og[d] += pj * row[d];
    }
}

/* Kv heads [h0, h1) of the block holding key t0 of `cache` (contiguous: kv head h0's
 * rows first). When the sequence's next block does not follow this one in memory, its
 * same heads are prefetched: the hardware prefetcher stops at such a jump. When it does
 * follow, the hardware prefetcher streams on by itself, and software prefetches only
 * get in its way (a decode micro-benchmark ran at 21 GB/s with them, 33 without). */
static inline const float *block_heads(const float *cache, const int64_t *table, int64_t t0,
                                       int64_t n_keys, int h0, int h1, int num_kv_heads,
                                       int block_size, int head_dim) {
    const int64_t span = (int64_t)block_size * head_dim;
    const int64_t b = t0 / block_size;
    if (t0 + block_size < n_keys && table[b + 1] != table[b] + 1) {
        const float *next = cache + (table[b + 1] * num_kv_heads + h0) * span;
        for (int64_t i = 0; i < (h1 - h0) * span; i += 16) __builtin_prefetch(next + i);
    }
    return cache + (table[b] * num_kv_heads + h0) * span;
}

/* Attend query rows [r0, r1) of one sequence for the query heads of kv heads [h0, h1).
 * Each work item takes as many kv heads as it can: a decode row takes all of them, so
 * each block is read as one contiguous run of num_kv_heads * block_size * head_dim
 * floats (4x the bytes per jump of one head, which this memory system rewards); a tile
 * of prefill rows takes one, so the context it rereads per row stays in L2.
 * Always inlined into attend_tile_dispatch so that common head sizes get a copy with
 * head_dim a constant: fixed-length loops the compiler unrolls into vector registers. */
static inline __attribute__((always_inline)) void attend_tile(
    const float *q, const float *k_cache, const float *v_cache, float *out,
    const int64_t *table, int64_t q_start, int64_t q_len, int64_t seq_len, int64_t r0,
    int64_t r1, int h0, int h1, int num_heads, int num_kv_heads, const int head_dim,
    int block_size, float scale, float *scores) {
    const int group = num_heads / num_kv_heads;
    const int heads = (h1 - h0) * group; /* query heads handled here */
    const int64_t span = (int64_t)block_size * head_dim;
    const int64_t ctx = seq_len - q_len;
    const int64_t row_stride = (int64_t)num_heads * head_dim;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t n_keys = ctx + r + 1;
        const float *qr = q + (q_start + r) * row_stride + (int64_t)h0 * group * head_dim;
        float *orow = out + (q_start + r) * row_stride + (int64_t)h0 * group * head_dim;
        /* Pass 1: scores[h * n_keys + t] = scale * q_h . k_t, a block of keys at a time
         * (a kv head's keys stay in L1 across the query heads that share it). */
        for (int64_t t0 = 0; t0 < n_keys; t0 += block_size) {
            const int nk = (int)(t0 + block_size < n_keys ? block_size : n_keys - t0);
            const float *kb = block_heads(k_cache, table, t0, n_keys, h0, h1, num_kv_heads,
                                          block_size, head_dim);
            for (int h = 0; h < heads; h++)
                block_scores(qr + h * head_dim, kb + (h / group) * span, nk, head_dim,
                             block_size, scale, scores + h * n_keys + t0);
        }
        /* Softmax per head. */
        for (int h = 0; h < heads; h++) {
            float *s = scores + h * n_keys;
            float m = s[0];
            for (int64_t t = 1; t < n_keys; t++) m = s[t] > m ? s[t] : m;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n_keys; t++) {
                s[t] = expf(s[t] - m);
                sum += s[t];
            }
            const float inv = 1.f / sum;
#pragma omp simd
            for (int64_t t = 0; t < n_keys; t++) s[t] *= inv;
            memset(orow + h * head_dim, 0, sizeof(float) * head_dim);
        }
        /* Pass 2: out_h = sum_t p_h[t] * v_t, a block at a time. */
        for (int64_t t0 = 0; t0 < n_keys; t0 += block_size) {
            const int nk = (int)(t0 + block_size < n_keys ? block_size : n_keys - t0);
            const float *vb = block_heads(v_cache, table, t0, n_keys, h0, h1, num_kv_heads,
                                          block_size, head_dim);
            for (int h = 0; h < heads; h++)
                block_values(scores + h * n_keys + t0, vb + (h / group) * span, nk, head_dim,
                             orow + h * head_dim);
        }
    }
}

static void attend_tile_dispatch(const float *q, const float *k_cache, const float *v_cache,
                                 float *out, const int64_t *table, int64_t q_start,
                                 int64_t q_len, int64_t seq_len, int64_t r0, int64_t r1,
                                 int h0, int h1, int num_heads, int num_kv_heads, int head_dim,
                                 int block_size, float scale, float *scores) {
#define ATTEND(HD)                                                                          \
    attend_tile(q, k_cache, v_cache, out, table, q_start, q_len, seq_len, r0, r1, h0, h1,   \
                num_heads, num_kv_heads, HD, block_size, scale, scores)
    switch (head_dim) {
        case 64: ATTEND(64); break;
        case 128: ATTEND(128); break;
        default: ATTEND(head_dim);
    }
#undef ATTEND
}

/* Returns 0, or -1 if a score buffer could not be allocated. */
int paged_attention(const float *q, const float *k_cache, const float *v_cache, float *out,
                    int num_seqs, const int64_t *q_starts, const int64_t *q_lens,
                    const int64_t *seq_lens, const int64_t *tables, int64_t max_blocks,
                    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                    int num_threads) {
    /* Work items, numbered through a prefix sum: a decode (one query row) is one item
     * over all kv heads; a longer query is one item per (tile of rows, kv head). */
    int64_t *item_start = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (!item_start) return -1;
    int64_t max_len = 1;
    item_start[0] = 0;
    for (int i = 0; i < num_seqs; i++) {
        const int64_t n = q_lens[i] == 1 ? 1 : (q_lens[i] + Q_TILE - 1) / Q_TILE * num_kv_heads;
        item_start[i + 1] = item_start[i] + n;
        if (seq_lens[i] > max_len) max_len = seq_lens[i];
    }
    const int64_t items = item_start[num_seqs];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * num_heads * max_len);
        if (!scores) failed = 1;
        int seq = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!scores) continue;
            /* Items arrive in increasing order within a thread: walk seq forward. */
            if (item < item_start[seq]) seq = 0;
            while (item >= item_start[seq + 1]) seq++;
            int64_t r0 = 0, r1 = 1;
            int h0 = 0, h1 = num_kv_heads;
            if (q_lens[seq] != 1) {
                const int64_t local = item - item_start[seq];
                h0 = (int)(local % num_kv_heads);
                h1 = h0 + 1;
                r0 = local / num_kv_heads * Q_TILE;
                r1 = r0 + Q_TILE < q_lens[seq] ? r0 + Q_TILE : q_lens[seq];
            }
            attend_tile_dispatch(q, k_cache, v_cache, out, tables + (int64_t)seq * max_blocks,
                                 q_starts[seq], q_lens[seq], seq_lens[seq], r0, r1, h0, h1,
                                 num_heads, num_kv_heads, head_dim, block_size, scale, scores);
        }
        free(scores);
    }
    free(item_start);
    return failed ? -1 : 0;
}
