/* Paged attention for the CPU: each query row reads its request's keys and values
 * straight from the paged KV cache, block by block, with no gathered copy.
 *
 * Layout (float32, contiguous but for q's rows; the caches float32 or bf16, see
 * kv_vec below):
 *   q, out       [num_tokens, num_heads, head_dim]; q's token rows q_stride floats apart
 *                (a slice of the fused qkv projection), each row's heads contiguous
 *   k cache      [num_blocks, num_kv_heads, head_dim, block_size]: d-major within a
 *                block, so the scores of a block's keys are block_size-wide vector FMAs
 *                with no horizontal sums
 *   v cache      [num_blocks, num_kv_heads, block_size, head_dim]: token-major, so a
 *                value row is added into a head_dim-wide accumulator
 *   tables       [num_seqs, max_blocks] block ids (int64), row i for sequence i
 * Either way one kv head's part of a block is contiguous (block_size * head_dim floats).
 * Sequence i owns query rows q_starts[i] .. q_starts[i] + q_lens[i]; its cache holds
 * seq_lens[i] tokens, the last q_lens[i] of which are these queries (causal: row j sees
 * keys 0 .. seq_lens[i] - q_lens[i] + j). With a sliding window W > 0 a row at position p
 * sees only keys p - W + 1 .. p (transformers' `kv > q - W`): blocks wholly before that
 * are never read, so their table entries may name blocks given to someone else. A
 * softcap c > 0 bounds each scaled score as c * tanh(s / c) (Gemma 2's logit softcap).
 *
 * One work item is (sequence, kv head, tile of query rows). The num_heads / num_kv_heads
 * query heads that share a kv head are handled together, so each key and value row is
 * loaded once for all of them. Softmax is two-pass over a per-thread score buffer, but for
 * decode rows on AVX-512 with 16-key blocks: one pass (paged_decode.h).
 *
 * Built at run time by fleetserve/kernels/cpu.py (cc -O3 -march=native -ffast-math
 * -fopenmp) and called through ctypes; it links the libgomp that torch has loaded, so
 * it shares torch's OpenMP threads.
 */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define Q_TILE 16
/* Queries of at most this many rows attend like decodes (attend_tile_dispatch). */
#define VERIFY_ROWS 16

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned access */
typedef uint16_t vhu __attribute__((vector_size(VL * 2), aligned(2)));
typedef uint32_t vu32 __attribute__((vector_size(VL * 4)));

/* The cache holds float32 or bf16 (`bf16`, a constant where these are inlined). A bf16
 * value is the high half of a float32: widening is a zero-extend and a shift (vpmovzxwd,
 * vpslld), in registers. Intrinsics on AVX-512 and AVX2 (gcc's generic conversion of
 * the vector type takes two half-width vpmovzxwd and an insert); the vector type's own
 * conversion elsewhere (plain C where there is no SIMD). */
static inline __attribute__((always_inline)) const void *kv_at(const void *base, int64_t i,
                                                               const int bf16) {
    return (const char *)base + i * (bf16 ? 2 : 4);
}

static inline __attribute__((always_inline)) vf kv_vec(const void *base, int64_t i,
                                                       const int bf16) {
    if (bf16) {
        const uint16_t *h = (const uint16_t *)base + i;
#if defined(__AVX512F__)
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h));
        return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#elif defined(__AVX2__)
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h));
        return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#else
        const vu32 w = __builtin_convertvector(*(const vhu *)h, vu32);
        return (vf)(w << 16);
#endif
    }
    return *(const vfu *)((const float *)base + i);
}

static inline __attribute__((always_inline)) float kv_one(const void *base, int64_t i,
                                                          const int bf16) {
    if (bf16) {
        const uint32_t w = (uint32_t)((const uint16_t *)base)[i] << 16;
        float f;
        memcpy(&f, &w, sizeof f);
        return f;
    }
    return ((const float *)base)[i];
}

/* Scores of G query heads against the first nk keys of one block whose keys are
 * stored d-major (kt[d * block_size + j]): s[h * s_stride + j] = scale * q_h . key_j,
 * q_h = q + h * head_dim. The G heads share a kv head, so each vector of keys is loaded
 * once for all of them. A 16-key block (the default block size) is one or two vectors
 * of keys per head, summed in independent chains over d; G is a constant (1..4) where
 * this is inlined, so the sums live in registers. Other block sizes take a plain loop. */
static inline __attribute__((always_inline)) void block_scores(const float *q, const void *kt,
                                                               int nk, const int head_dim,
                                                               int block_size, float scale,
                                                               float *s, int64_t s_stride,
                                                               const int G, const int bf16) {
    if (block_size == 16) {
        enum { NV = 16 / VL, ACCS = VL == 16 ? 16 : 8 };
        /* Independent chains over d: as many as the accumulators allow (16 of AVX-512's
         * 32 registers, 8 of AVX2's 16), up to 4; an FMA's latency is ~4 of its issue
         * slots, so fewer chains leave the FMA ports idle (3 heads per kv head took 2
         * chains, 6 accumulators, before). */
        const int CH = ACCS / (G * NV) >= 4 ? 4 : (ACCS / (G * NV) >= 2 ? 2 : 1);
        vf a[4][4][NV];
        for (int h = 0; h < G; h++)
            for (int c = 0; c < CH; c++)
                for (int u = 0; u < NV; u++) a[h][c][u] = (vf){0};
        int d = 0;
        for (; d + CH <= head_dim; d += CH)
            for (int c = 0; c < CH; c++) {
                vf kv[NV];
                for (int u = 0; u < NV; u++) kv[u] = kv_vec(kt, (d + c) * 16 + u * VL, bf16);
                for (int h = 0; h < G; h++)
                    for (int u = 0; u < NV; u++) a[h][c][u] += q[h * head_dim + d + c] * kv[u];
            }
        for (; d < head_dim; d++)
            for (int h = 0; h < G; h++)
                for (int u = 0; u < NV; u++)
                    a[h][0][u] += q[h * head_dim + d] * kv_vec(kt, d * 16 + u * VL, bf16);
        for (int h = 0; h < G; h++) {
            float tmp[16];
            float *dst = nk == 16 ? s + h * s_stride : tmp;
            for (int u = 0; u < NV; u++) {
                vf r = a[h][0][u];
                for (int c = 1; c < CH; c++) r += a[h][c][u];
                *(vfu *)(dst + u * VL) = r * scale;
            }
            for (int j = 0; j < nk && nk < 16; j++) s[h * s_stride + j] = tmp[j];
        }
        return;
    }
    for (int h = 0; h < G; h++) {
        const float *qh = q + h * head_dim;
        float *sh = s + h * s_stride;
        for (int j = 0; j < nk; j++) sh[j] = 0.f;
        for (int d = 0; d < head_dim; d++) {
            const float qd = qh[d];
            const int64_t row = (int64_t)d * block_size;
#pragma omp simd
            for (int j = 0; j < nk; j++) sh[j] += qd * kv_one(kt, row + j, bf16);
        }
        for (int j = 0; j < nk; j++) sh[j] *= scale;
    }
}

/* og_h += sum_j p_h[j] * value_j over the first nk values of a block (token-major rows),
 * for G query heads: p_h = p + h * p_stride, og_h = og + h * head_dim. Each value row is
 * loaded once for the G heads. For head sizes of up to 8 vectors the sums live in
 * registers (G is a constant where this is inlined) and are added to og once per
 * block. */
static inline __attribute__((always_inline)) void block_values(const float *p, int64_t p_stride,
                                                               const void *vb, int nk,
                                                               const int head_dim, float *og,
                                                               const int G, const int bf16) {
    if (head_dim % VL == 0 && head_dim <= 8 * VL) {
        const int nv = head_dim / VL;
        vf a[4][8];
        for (int h = 0; h < G; h++)
            for (int u = 0; u < nv; u++) a[h][u] = (vf){0};
        for (int j = 0; j < nk; j++) {
            const int64_t row = (int64_t)j * head_dim;
            vf vr[8];
            for (int u = 0; u < nv; u++) vr[u] = kv_vec(vb, row + u * VL, bf16);
            for (int h = 0; h < G; h++) {
                const float pj = p[h * p_stride + j];
                for (int u = 0; u < nv; u++) a[h][u] += pj * vr[u];
            }
        }
        for (int h = 0; h < G; h++)
            for (int u = 0; u < nv; u++) *(vfu *)(og + h * head_dim + u * VL) += a[h][u];
        return;
    }
    for (int h = 0; h < G; h++)
        for (int j = 0; j < nk; j++) {
            const float pj = p[h * p_stride + j];
            const int64_t row = (int64_t)j * head_dim;
            float *o = og + h * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) o[d] += pj * kv_one(vb, row + d, bf16);
        }
}

/* Registers for value sums: 16 of AVX-512's 32 vectors, 8 of AVX2's 16. */
#define VALUE_ACCS (VL == 16 ? 16 : 8)

/* The query heads [0, group) sharing one kv head, against one block: in chunks of at
 * most 4 heads (fewer for values of wide heads), each chunk size a constant. */
static inline __attribute__((always_inline)) void group_scores(const float *q, const void *kt,
                                                               int nk, const int head_dim,
                                                               int block_size, float scale,
                                                               float *s, int64_t s_stride,
                                                               int group, const int bf16) {
    int h = 0;
    for (; h + 4 <= group; h += 4)
        block_scores(q + h * head_dim, kt, nk, head_dim, block_size, scale, s + h * s_stride,
                     s_stride, 4, bf16);
    switch (group - h) {
#define REST(n)                                                                          \
    case n:                                                                              \
        block_scores(q + h * head_dim, kt, nk, head_dim, block_size, scale,              \
                     s + h * s_stride, s_stride, n, bf16);                               \
        break;
        REST(1) REST(2) REST(3)
#undef REST
    }
}

static inline __attribute__((always_inline)) void group_values(const float *p, int64_t p_stride,
                                                               const void *vb, int nk,
                                                               const int head_dim, float *og,
                                                               int group, const int bf16) {
    const int nv = head_dim % VL == 0 ? head_dim / VL : 8;
    const int chunk = nv >= VALUE_ACCS ? 1 : (VALUE_ACCS / nv > 4 ? 4 : VALUE_ACCS / nv);
    int h = 0;
#define CHUNK(n)                                                                         \
    block_values(p + h * p_stride, p_stride, vb, nk, head_dim, og + h * head_dim, n, bf16)
    if (chunk == 4)
        for (; h + 4 <= group; h += 4) CHUNK(4);
    if (chunk >= 2)
        for (; h + 2 <= group; h += 2) CHUNK(2);
    for (; h < group; h++) CHUNK(1);
#undef CHUNK
}

/* Kv heads [h0, h1) of the block holding key t0 of `cache` (contiguous: kv head h0's
 * rows first). When the sequence's next block does not follow this one in memory, its
 * same heads are prefetched: the hardware prefetcher stops at such a jump. When it does
 * follow, the hardware prefetcher streams on by itself, and software prefetches only
 * get in its way (a decode micro-benchmark ran at 21 GB/s with them, 33 without). */
static inline __attribute__((always_inline)) const void *block_heads(
    const void *cache, const int64_t *table, int64_t t0, int64_t n_keys, int h0, int h1,
    int num_kv_heads, int block_size, int head_dim, const int bf16) {
    const int64_t span = (int64_t)block_size * head_dim;
    const int64_t b = t0 / block_size;
    if (t0 + block_size < n_keys && table[b + 1] != table[b] + 1) {
        const char *next = kv_at(cache, (table[b + 1] * num_kv_heads + h0) * span, bf16);
        const int64_t bytes = (h1 - h0) * span * (bf16 ? 2 : 4);
        for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(next + i);
    }
    return kv_at(cache, (table[b] * num_kv_heads + h0) * span, bf16);
}

/* Decode rows on AVX-512: one pass over the blocks (attend_decode); verification rows:
 * one pass for all of them (attend_verify, paged_verify.h). */
#include "paged_decode.h"

/* Attend query rows [r0, r1) of one sequence for the query heads of kv heads [h0, h1).
 * Each work item takes as many kv heads as it can: a decode row takes all of them, so
 * each block is read as one contiguous run of num_kv_heads * block_size * head_dim
 * floats (4x the bytes per jump of one head, which this memory system rewards); a tile
 * of prefill rows takes one, so the context it rereads per row stays in L2.
 * Always inlined into attend_tile_dispatch so that common head sizes get a copy with
 * head_dim a constant: fixed-length loops the compiler unrolls into vector registers. */
static inline __attribute__((always_inline)) void attend_tile(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, float *out,
    const int64_t *table, int64_t q_start, int64_t q_len, int64_t seq_len, int64_t r0,
    int64_t r1, int h0, int h1, int num_heads, int num_kv_heads, const int head_dim,
    int block_size, float scale, int window, float softcap, float *scores, const int bf16) {
    const int group = num_heads / num_kv_heads;
    const int heads = (h1 - h0) * group; /* query heads handled here */
    const int64_t span = (int64_t)block_size * head_dim;
    const int64_t ctx = seq_len - q_len;
    const int64_t row_stride = (int64_t)num_heads * head_dim;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t n_keys = ctx + r + 1;
        /* Keys [k_lo, n_keys) are attended; the walk starts at k_lo's block, whose
         * leading keys [t_lo, k_lo) get probability 0. */
        const int64_t k_lo = window > 0 && n_keys > window ? n_keys - window : 0;
        const int64_t t_lo = k_lo / block_size * block_size;
        const float *qr = q + (q_start + r) * q_stride + (int64_t)h0 * group * head_dim;
        float *orow = out + (q_start + r) * row_stride + (int64_t)h0 * group * head_dim;
        /* Pass 1: scores[h * n_keys + t] = scale * q_h . k_t, a block of keys at a time
         * (a kv head's keys stay in L1 across the query heads that share it). */
        for (int64_t t0 = t_lo; t0 < n_keys; t0 += block_size) {
            const int nk = (int)(t0 + block_size < n_keys ? block_size : n_keys - t0);
            const void *kb = block_heads(k_cache, table, t0, n_keys, h0, h1, num_kv_heads,
                                         block_size, head_dim, bf16);
            for (int kv = 0; kv < h1 - h0; kv++)
                group_scores(qr + kv * group * head_dim, kv_at(kb, kv * span, bf16), nk,
                             head_dim, block_size, scale, scores + kv * group * n_keys + t0,
                             n_keys, group, bf16);
        }
        /* Softmax per head. */
        for (int h = 0; h < heads; h++) {
            float *s = scores + h * n_keys;
            if (softcap > 0.f)
                for (int64_t t = k_lo; t < n_keys; t++) s[t] = softcap * tanhf(s[t] / softcap);
            for (int64_t t = t_lo; t < k_lo; t++) s[t] = 0.f;
            float m = s[k_lo];
            for (int64_t t = k_lo + 1; t < n_keys; t++) m = s[t] > m ? s[t] : m;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = k_lo; t < n_keys; t++) {
                s[t] = expf(s[t] - m);
                sum += s[t];
            }
            const float inv = 1.f / sum;
#pragma omp simd
            for (int64_t t = k_lo; t < n_keys; t++) s[t] *= inv;
            memset(orow + h * head_dim, 0, sizeof(float) * head_dim);
        }
        /* Pass 2: out_h = sum_t p_h[t] * v_t, a block at a time. */
        for (int64_t t0 = t_lo; t0 < n_keys; t0 += block_size) {
            const int nk = (int)(t0 + block_size < n_keys ? block_size : n_keys - t0);
            const void *vb = block_heads(v_cache, table, t0, n_keys, h0, h1, num_kv_heads,
                                         block_size, head_dim, bf16);
            for (int kv = 0; kv < h1 - h0; kv++)
                group_values(scores + kv * group * n_keys + t0, n_keys,
                             kv_at(vb, kv * span, bf16), nk, head_dim,
                             orow + kv * group * head_dim, group, bf16);
        }
    }
}

/* attention_amx.c: which kernel multi-row items over a bf16 cache run (0: the float32
 * loops; its switch also picks decode rows' bf16 products, paged_decode_bf16.h). */
int attention_tiles_kind(void);

/* attention_amx.c: tiles of several query rows against a bf16 cache as AMX-BF16 tile
 * products; 1 when it did the item, 0 when the loop below must. */
int attend_tile_amx(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    float *out, const int64_t *table, int64_t q_start, int64_t q_len,
                    int64_t seq_len, int64_t r0, int64_t r1, int h0, int h1, int num_heads,
                    int num_kv_heads, int head_dim, int block_size, float scale, int window,
                    float softcap);

/* Not static: the decode step (decode_step.c) attends its rows through it too; never
 * inlined, so both callers run one machine copy (see fused_rows.h). The caches hold
 * float32, or bf16 when `kv_bf16` (widened to float32 as they are read, or bf16 pair
 * products: decode and verification rows in paged_decode_bf16.h, tiles of a longer
 * query in attention_amx.c, where the CPU has them and their switch is on). */
__attribute__((noinline)) void attend_tile_dispatch(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, float *out,
    const int64_t *table, int64_t q_start, int64_t q_len, int64_t seq_len, int64_t r0,
    int64_t r1, int h0, int h1, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, int window, float softcap, int kv_bf16, float *scores) {
#if defined(DECODE_ONE_PASS)
#if DECODE_DP
    /* Decode and verification rows over a bf16 cache with bf16 products (paged_decode_bf16.h)
     * while attention_amx.c's switch is on: out of line, first, so that the code below
     * compiles as it did before it. */
    if (kv_bf16 && q_len <= VERIFY_ROWS && head_dim % 32 == 0 &&
        decode_one_pass(block_size, head_dim) && attention_tiles_kind()) {
        attend_rows_dp(q, q_stride, k_cache, v_cache, out, table, q_start, q_len, seq_len, r0,
                       r1, h0, h1, num_heads, num_kv_heads, head_dim, scale, window, softcap);
        return;
    }
#endif
    /* A query of 2..VERIFY_ROWS rows (speculative verification: k + 1 rows): one walk over
     * the blocks for all its rows, each row with a plain decode's arithmetic at its
     * position (paged_verify.h), so verification accepts exactly the tokens plain decoding
     * would emit. Out of line and tested first, so that the code below compiles as it did
     * before it (the prefill tile's sums kept their last bits). */
    if (q_len > 1 && q_len <= VERIFY_ROWS && decode_one_pass(block_size, head_dim)) {
        ATTEND_VERIFY(kv_bf16, q, q_stride, k_cache, v_cache, out, table, q_start, q_len,
                      seq_len, r0, r1, h0, h1, num_heads, num_kv_heads, head_dim, scale, window,
                      softcap);
        return;
    }
    /* A decode row (the only query of at most VERIFY_ROWS rows left here). */
#define DECODE(HD, BF)                                                                      \
    if (q_len <= VERIFY_ROWS && decode_one_pass(block_size, HD)) {                          \
        for (int64_t r = r0; r < r1; r++)                                                   \
            attend_decode(q, q_stride, k_cache, v_cache, out, table, q_start + r,           \
                          seq_len - q_len + r + 1, h0, h1, num_heads, num_kv_heads, HD,     \
                          scale, window, softcap, BF, 0);                                   \
        return;                                                                             \
    }
#else
#define DECODE(HD, BF)
#endif
#define ATTEND(HD, BF)                                                                      \
    DECODE(HD, BF)                                                                          \
    attend_tile(q, q_stride, k_cache, v_cache, out, table, q_start, q_len, seq_len, r0, r1, \
                h0, h1, num_heads, num_kv_heads, HD, block_size, scale, window, softcap,    \
                scores, BF)
#define HEADS(BF)                                                                           \
    switch (head_dim) {                                                                     \
        case 64: ATTEND(64, BF); break;                                                     \
        case 128: ATTEND(128, BF); break;                                                   \
        default: ATTEND(head_dim, BF);                                                      \
    }
    if (kv_bf16 && q_len > VERIFY_ROWS &&
        attend_tile_amx(q, q_stride, k_cache, v_cache, out, table, q_start, q_len, seq_len, r0,
                        r1, h0, h1, num_heads, num_kv_heads, head_dim, block_size, scale,
                        window, softcap))
        return;
    if (kv_bf16) {
        HEADS(1)
    } else {
        HEADS(0)
    }
#undef HEADS
#undef ATTEND
#undef DECODE
}

/* Returns 0, or -1 if a score buffer could not be allocated. */
int paged_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    float *out, int num_seqs, const int64_t *q_starts, const int64_t *q_lens,
                    const int64_t *seq_lens, const int64_t *tables, int64_t max_blocks,
                    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                    int window, float softcap, int kv_bf16, int num_threads) {
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
            attend_tile_dispatch(q, q_stride, k_cache, v_cache, out, tables + (int64_t)seq * max_blocks,
                                 q_starts[seq], q_lens[seq], seq_lens[seq], r0, r1, h0, h1,
                                 num_heads, num_kv_heads, head_dim, block_size, scale, window,
                                 softcap, kv_bf16, scores);
        }
        free(scores);
    }
    free(item_start);
    return failed ? -1 : 0;
}
