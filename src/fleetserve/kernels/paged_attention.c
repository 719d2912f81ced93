/* Paged attention for the CPU: each query row reads its request's keys and values
 * straight from the paged KV cache, block by block, with no gathered copy.
 *
 * Layout (float32, contiguous):
 *   q, out       [num_tokens, num_heads, head_dim]
 *   k/v cache    [num_blocks, num_kv_heads, block_size, head_dim]: one kv head's rows
 *                of one block are contiguous (block_size * head_dim floats)
 *   tables       [num_seqs, max_blocks] block ids (int64), row i for sequence i
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

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* Kv head `kvh`'s rows in the block holding key t0 of `cache`; the next block's rows
 * (if the sequence goes on) are prefetched, since blocks are scattered in memory and
 * the hardware prefetcher stops at each jump. */
static inline const float *block_rows(const float *cache, const int64_t *table, int64_t t0,
                                      int64_t n_keys, int kvh, int num_kv_heads,
                                      int block_size, int head_dim) {
    const int64_t span = (int64_t)block_size * head_dim;
    const int64_t b = t0 / block_size;
    if (t0 + block_size < n_keys) {
        const float *next = cache + (table[b + 1] * num_kv_heads + kvh) * span;
        for (int64_t i = 0; i < span; i += 16) __builtin_prefetch(next + i);
    }
    return cache + (table[b] * num_kv_heads + kvh) * span;
}

/* Attend query rows [r0, r1) of one sequence for the query heads of kv head `kvh`.
 * Always inlined into attend_tile_dispatch so that common head sizes get a copy with
 * head_dim a constant: fixed-length loops the compiler unrolls into vector registers. */
static inline __attribute__((always_inline)) void attend_tile(
    const float *q, const float *k_cache, const float *v_cache, float *out,
    const int64_t *table, int64_t q_start, int64_t q_len, int64_t seq_len, int64_t r0,
    int64_t r1, int kvh, int num_heads, int num_kv_heads, const int head_dim,
    int block_size, float scale, float *scores) {
    const int group = num_heads / num_kv_heads;
    const int64_t ctx = seq_len - q_len;
    const int64_t row_stride = (int64_t)num_heads * head_dim;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t n_keys = ctx + r + 1;
        const float *qr = q + (q_start + r) * row_stride + (int64_t)kvh * group * head_dim;
        float *orow = out + (q_start + r) * row_stride + (int64_t)kvh * group * head_dim;
        /* Pass 1: scores[g * n_keys + t] = scale * q_g . k_t, four keys at a time so
         * that four independent sums are in flight. */
        for (int64_t t0 = 0; t0 < n_keys; t0 += block_size) {
            const int64_t t1 = t0 + block_size < n_keys ? t0 + block_size : n_keys;
            const float *kb =
                block_rows(k_cache, table, t0, n_keys, kvh, num_kv_heads, block_size, head_dim);
            for (int g = 0; g < group; g++) {
                const float *qg = qr + g * head_dim;
                float *sg = scores + g * n_keys;
                int64_t t = t0;
                for (; t + 4 <= t1; t += 4) {
                    const float *k0 = kb + (t - t0) * head_dim;
                    const float *k1 = k0 + head_dim, *k2 = k1 + head_dim, *k3 = k2 + head_dim;
                    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                    for (int d = 0; d < head_dim; d++) {
                        s0 += qg[d] * k0[d];
                        s1 += qg[d] * k1[d];
                        s2 += qg[d] * k2[d];
                        s3 += qg[d] * k3[d];
                    }
                    sg[t] = scale * s0;
                    sg[t + 1] = scale * s1;
                    sg[t + 2] = scale * s2;
                    sg[t + 3] = scale * s3;
                }
                for (; t < t1; t++) sg[t] = scale * dot(qg, kb + (t - t0) * head_dim, head_dim);
            }
        }
        /* Softmax per head. */
        for (int g = 0; g < group; g++) {
            float *s = scores + g * n_keys;
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
            memset(orow + g * head_dim, 0, sizeof(float) * head_dim);
        }
        /* Pass 2: out_g = sum_t p_g[t] * v_t, summed per block in a local accumulator
         * (registers, for a constant head_dim) and added to the output once per block. */
        for (int64_t t0 = 0; t0 < n_keys; t0 += block_size) {
            const int64_t t1 = t0 + block_size < n_keys ? t0 + block_size : n_keys;
            const float *vb =
                block_rows(v_cache, table, t0, n_keys, kvh, num_kv_heads, block_size, head_dim);
            for (int g = 0; g < group; g++) {
                const float *pg = scores + g * n_keys;
                float acc[head_dim];
                memset(acc, 0, sizeof(float) * head_dim);
                for (int64_t t = t0; t < t1; t++) axpy(acc, pg[t], vb + (t - t0) * head_dim, head_dim);
                float *og = orow + g * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) og[d] += acc[d];
            }
        }
    }
}

static void attend_tile_dispatch(const float *q, const float *k_cache, const float *v_cache,
                                 float *out, const int64_t *table, int64_t q_start,
                                 int64_t q_len, int64_t seq_len, int64_t r0, int64_t r1,
                                 int kvh, int num_heads, int num_kv_heads, int head_dim,
                                 int block_size, float scale, float *scores) {
#define ATTEND(HD)                                                                       \
    attend_tile(q, k_cache, v_cache, out, table, q_start, q_len, seq_len, r0, r1, kvh,   \
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
    /* Work items: (sequence, kv head, query tile), numbered through a prefix sum. */
    int64_t *tile_start = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (!tile_start) return -1;
    int64_t max_len = 1;
    tile_start[0] = 0;
    for (int i = 0; i < num_seqs; i++) {
        tile_start[i + 1] = tile_start[i] + (q_lens[i] + Q_TILE - 1) / Q_TILE;
        if (seq_lens[i] > max_len) max_len = seq_lens[i];
    }
    const int64_t tiles = tile_start[num_seqs];
    const int64_t items = tiles * num_kv_heads;
    const int group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * max_len);
        if (!scores) failed = 1;
        int seq = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!scores) continue;
            const int64_t tile = item / num_kv_heads;
            const int kvh = (int)(item % num_kv_heads);
            /* Items arrive in increasing order within a thread: walk seq forward. */
            if (tile < tile_start[seq]) seq = 0;
            while (tile >= tile_start[seq + 1]) seq++;
            const int64_t r0 = (tile - tile_start[seq]) * Q_TILE;
            const int64_t r1 = r0 + Q_TILE < q_lens[seq] ? r0 + Q_TILE : q_lens[seq];
            attend_tile_dispatch(q, k_cache, v_cache, out, tables + (int64_t)seq * max_blocks,
                        q_starts[seq], q_lens[seq], seq_lens[seq], r0, r1, kvh, num_heads,
                        num_kv_heads, head_dim, block_size, scale, scores);
        }
        free(scores);
    }
    free(tile_start);
    return failed ? -1 : 0;
}
