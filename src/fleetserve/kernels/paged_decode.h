/* Decode rows (one query row per sequence) of paged attention on AVX-512 with 16-key
 * blocks: one pass over the blocks with an online softmax. Included by
 * paged_attention.c (its kv_vec / kv_at / block_heads helpers; layouts as described
 * there).
 *
 * Why one pass: a decode row reads each key and value once, so it is bound by how fast
 * one core pulls the scattered 2-8 KB pieces of the cache and how much work it does per
 * byte. The two-pass loop (all scores, softmax, then all values) walked the blocks twice
 * (one stream of K, then one of V) and kept a score row per head in memory; here each
 * block's keys and values are read together (two streams at once, which this memory
 * system serves faster than one), the scores of a block never leave registers but for a
 * 16-float row of probabilities per head, and each block's value sums are folded into the
 * output with the running max's rescale factor (o = o * f + sum_j p_j v_j).
 *
 * Numerics: the same float32 products and per-key exponentials as two passes, but each
 * head's output is normalised once at the end (o / l) and the exponentials are relative
 * to the running max (rescaled when it grows): last-bit differences from the two-pass
 * order, well inside the kernel tests' tolerance. The C step and the module path both
 * call this code, so they stay bit-equal.
 */

#if defined(__AVX512F__)
#define DECODE_ONE_PASS 1
#ifndef DECODE_PF
#define DECODE_PF 1
#endif
#ifndef DECODE_HINT
#define DECODE_HINT _MM_HINT_T1
#endif

/* e^x for x <= 0 (x >= -87.3: below that the result is 0 after the mask): range
 * reduction by ln 2 in two parts and a degree-7 polynomial, scaled by 2^n (vscalefps);
 * within ~2 ulp of expf. */
static inline __attribute__((always_inline)) __m512 decode_exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* bf16 pairs: a 32-bit lane of the cache holds two bf16 values, the even-indexed one in
 * its low half. Shifted left by 16 it is the even value as a float32, masked to its high
 * half the odd one: one instruction per 16 values (a widening vpmovzxwd + vpslld takes
 * two), so 32 values cost one load and two instructions. */
static inline __attribute__((always_inline)) __m512 bf16_even(__m512i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
static inline __attribute__((always_inline)) __m512 bf16_odd(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* One block (its first nk keys; `valid` marks the keys attended) for G query heads of
 * one kv head: scores against the d-major keys kt, the online softmax update of each
 * head's running max m[h] and sum l[h], then og_h = og_h * f_h + sum_j p_h[j] * v_j over
 * the token-major values vb (f_h = e^(m_old - m_new), ~0 on the head's first block).
 * G (1..4) and head_dim are constants where this is inlined: the score chains and the
 * value sums (G * head_dim / 16 vectors) live in registers.
 * `pair` (bf16 caches, head_dim a multiple of 32): keys and values are widened in pairs
 * (bf16_even / bf16_odd). A 512-bit load of keys is rows d and d + 1 (16 keys each):
 * its even and odd keys are multiplied by qp, the pair (q_d x 8, q_d+1 x 8), and the two
 * halves of each sum are added at the end. A load of a value row is 32 dimensions: og
 * then holds each 32 dimensions as 16 even ones and 16 odd ones (decode_finish puts
 * them back in order). */
static inline __attribute__((always_inline)) void decode_block(
    const float *q, const float *qp, const void *kt, const void *vb, int nk,
    __mmask16 valid, const int head_dim, float scale, float softcap, float *m, float *l,
    float *og, const char *pf_k, const char *pf_v, const int pf_lines, const int G,
    const int bf16, const int pair) {
    __m512 sc[4];
    if (pair) {
        /* Chains per head: 2 accumulators (even, odd keys) each, up to 16 in all. */
        const int CH = G <= 2 ? 4 : 2;
        __m512 ae[4][4], ao[4][4];
        for (int h = 0; h < G; h++)
            for (int c = 0; c < CH; c++) ae[h][c] = ao[h][c] = _mm512_setzero_ps();
        const uint16_t *kp = (const uint16_t *)kt;
        const float *qq = qp;
        for (int64_t d = 0; d < head_dim; d += 2 * CH, kp += 32 * CH, qq += 16 * CH)
            for (int c = 0; c < CH; c++) {
                const __m512i x = _mm512_loadu_si512(kp + 32 * c);
                const __m512 ev = bf16_even(x), od = bf16_odd(x);
                for (int h = 0; h < G; h++) {
                    const __m512 qv = _mm512_load_ps(qq + (int64_t)h * head_dim * 8 + 16 * c);
                    ae[h][c] = _mm512_fmadd_ps(qv, ev, ae[h][c]);
                    ao[h][c] = _mm512_fmadd_ps(qv, od, ao[h][c]);
                }
            }
        const __m512i order = _mm512_set_epi32(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
        for (int h = 0; h < G; h++) {
            __m512 e = ae[h][0], o = ao[h][0];
            for (int c = 1; c < CH; c++) e = _mm512_add_ps(e, ae[h][c]), o = _mm512_add_ps(o, ao[h][c]);
            /* lanes 0-7: row d's keys, 8-15: row d + 1's; even keys in e, odd in o */
            const __m256 e8 = _mm256_add_ps(_mm512_castps512_ps256(e),
                                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
            const __m256 o8 = _mm256_add_ps(_mm512_castps512_ps256(o),
                                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(o), 1)));
            const __m512 eo = _mm512_castpd_ps(_mm512_insertf64x4(
                _mm512_castps_pd(_mm512_castps256_ps512(e8)), _mm256_castps_pd(o8), 1));
            sc[h] = _mm512_permutexvar_ps(order, eo);
        }
    } else {
        /* CH independent chains over d per head (as block_scores). */
        const int CH = 16 / G >= 4 ? 4 : (16 / G >= 2 ? 2 : 1);
        __m512 a[4][4];
        for (int h = 0; h < G; h++)
            for (int c = 0; c < CH; c++) a[h][c] = _mm512_setzero_ps();
        for (int d = 0; d < head_dim; d += CH)
            for (int c = 0; c < CH; c++) {
                const __m512 kv = (__m512)kv_vec(kt, (d + c) * 16, bf16);
                for (int h = 0; h < G; h++)
                    a[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * head_dim + d + c]), kv, a[h][c]);
            }
        for (int h = 0; h < G; h++) {
            sc[h] = a[h][0];
            for (int c = 1; c < CH; c++) sc[h] = _mm512_add_ps(sc[h], a[h][c]);
        }
    }
    float p[4][16] __attribute__((aligned(64)));
    float f[4];
    for (int h = 0; h < G; h++) {
        __m512 s = _mm512_mul_ps(sc[h], _mm512_set1_ps(scale));
        if (softcap > 0.f) {
            float t[16] __attribute__((aligned(64)));
            _mm512_store_ps(t, s);
            for (int j = 0; j < 16; j++) t[j] = softcap * tanhf(t[j] / softcap);
            s = _mm512_load_ps(t);
        }
        /* No branch on whether the max grew (a data-dependent branch mispredicts and
         * throws away the overlap of neighbouring heads' work): f = e^(m_old - m_new)
         * is 1 exactly when it did not, ~0 on the head's first block (m = -1e30). */
        const __m512 mo = _mm512_set1_ps(m[h]);
        const __m512 mn = _mm512_max_ps(mo, _mm512_set1_ps(_mm512_mask_reduce_max_ps(valid, s)));
        f[h] = _mm512_cvtss_f32(decode_exp(_mm512_sub_ps(mo, mn)));
        m[h] = _mm512_cvtss_f32(mn);
        const __m512 e = _mm512_maskz_mov_ps(valid, decode_exp(_mm512_sub_ps(s, mn)));
        l[h] = l[h] * f[h] + _mm512_reduce_add_ps(e);
        _mm512_store_ps(p[h], e);
    }
    /* Values: head_dim / 16 vectors per head, summed over the block's rows. */
    enum { NVMAX = 8 };
    const int nv = head_dim / 16;
    __m512 acc[4][NVMAX];
    for (int h = 0; h < G; h++)
        for (int u = 0; u < nv; u++) acc[h][u] = _mm512_setzero_ps();
    for (int j = 0; j < nk; j++) {
        if (pf_k) /* the next block's piece: a row's worth of lines of keys and of values */
            for (int i = 0; i < pf_lines; i++) {
                _mm_prefetch(pf_k + (j * pf_lines + i) * 64, DECODE_HINT);
                _mm_prefetch(pf_v + (j * pf_lines + i) * 64, DECODE_HINT);
            }
        __m512 vr[NVMAX];
        if (pair)
            for (int w = 0; w < nv / 2; w++) {
                const __m512i x =
                    _mm512_loadu_si512((const uint16_t *)vb + (int64_t)j * head_dim + w * 32);
                vr[2 * w] = bf16_even(x);
                vr[2 * w + 1] = bf16_odd(x);
            }
        else
            for (int u = 0; u < nv; u++)
                vr[u] = (__m512)kv_vec(vb, (int64_t)j * head_dim + u * 16, bf16);
        for (int h = 0; h < G; h++) {
            const __m512 pj = _mm512_set1_ps(p[h][j]);
            for (int u = 0; u < nv; u++) acc[h][u] = _mm512_fmadd_ps(pj, vr[u], acc[h][u]);
        }
    }
    for (int h = 0; h < G; h++) {
        const __m512 fh = _mm512_set1_ps(f[h]);
        for (int u = 0; u < nv; u++) {
            float *o = og + h * head_dim + u * 16;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), fh, acc[h][u]));
        }
    }
}

/* Heads per decode_block call: the value sums of G heads take G * head_dim / 16 of the
 * 32 vector registers; up to 16 of them. */
static inline __attribute__((always_inline)) int decode_chunk(const int head_dim) {
    return head_dim <= 64 ? 4 : 2;
}

/* The query heads [0, group) of one kv head against one block, in chunks of
 * decode_chunk(head_dim) heads (the rest a constant 1..3 too). */
static inline __attribute__((always_inline)) void decode_group(
    const float *q, const float *qp, const void *kt, const void *vb, int nk, __mmask16 valid,
    const int head_dim, float scale, float softcap, float *m, float *l, float *og, int group,
    const char *pf_k, const char *pf_v, const int bf16, const int pair) {
    /* The next block's piece (16 rows of head_dim values), a row's lines (rounded up)
     * between each of this block's value rows; the first chunk prefetches it. */
    const int pf_lines = (head_dim * (bf16 ? 2 : 4) + 63) / 64;
    const int chunk = decode_chunk(head_dim);
    int h = 0;
#define DECODE_BLOCK(n)                                                                      \
    decode_block(q + h * head_dim, qp + h * head_dim * 8, kt, vb, nk, valid, head_dim, scale, \
                 softcap, m + h, l + h, og + h * head_dim, h ? NULL : pf_k, pf_v, pf_lines, n, bf16, \
                 pair)
    if (chunk == 4) {
        for (; h + 4 <= group; h += 4) DECODE_BLOCK(4);
        switch (group - h) {
            case 3: DECODE_BLOCK(3); break;
            case 2: DECODE_BLOCK(2); break;
            case 1: DECODE_BLOCK(1); break;
            default: break;
        }
    } else {
        for (; h + 2 <= group; h += 2) DECODE_BLOCK(2);
        if (h < group) DECODE_BLOCK(1);
    }
#undef DECODE_BLOCK
}

/* decode_group as one machine copy per (head size, cache dtype), which attend_decode and
 * attend_verify both call: a row's sums must be bit-equal whichever of them runs it, and
 * -ffast-math lets the compiler reorder the score chains differently in two inlined
 * copies (a 48-wide head did). One call per block and kv head: ~nothing beside the
 * block's work. head_dim 64 and 128 get copies with it a constant (register-resident
 * sums); others one copy with it a variable. */
#define DECODE_GROUP_COPY(NAME, HD, BF, PAIR)                                                \
    static __attribute__((noinline)) void NAME(                                              \
        const float *q, const float *qp, const void *kt, const void *vb, int nk,             \
        __mmask16 valid, int head_dim, float scale, float softcap, float *m, float *l,       \
        float *og, int group, const char *pf_k, const char *pf_v, int pair) {                \
        decode_group(q, qp, kt, vb, nk, valid, HD, scale, softcap, m, l, og, group, pf_k,    \
                     pf_v, BF, PAIR);                                                        \
    }
/* bf16 64 and 128: always pairs (head_dim % 32 == 0) */
DECODE_GROUP_COPY(decode_group_64_f32, 64, 0, 0)
DECODE_GROUP_COPY(decode_group_64_bf16, 64, 1, 1)
DECODE_GROUP_COPY(decode_group_128_f32, 128, 0, 0)
DECODE_GROUP_COPY(decode_group_128_bf16, 128, 1, 1)
DECODE_GROUP_COPY(decode_group_any_f32, head_dim, 0, 0)
DECODE_GROUP_COPY(decode_group_any_bf16, head_dim, 1, pair)
#undef DECODE_GROUP_COPY

/* Rows over a bf16 cache with bf16 products where the build has them. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DECODE_DP 1
#include "paged_decode_bf16.h"
#else
#define DECODE_DP 0
#endif

/* The copy for this head size and cache dtype (head_dim, bf16 and dp constants where this
 * is inlined, so the choice folds away); `dp`: bf16 products (paged_decode_bf16.h), qp
 * then holding the heads' bf16 query pairs. */
static inline __attribute__((always_inline)) void decode_group_once(
    const float *q, const float *qp, const void *kt, const void *vb, int nk, __mmask16 valid,
    const int head_dim, float scale, float softcap, float *m, float *l, float *og, int group,
    const char *pf_k, const char *pf_v, const int bf16, const int pair, const int dp) {
#if DECODE_DP
    if (dp) {
#define CALL_DP(NAME)                                                                        \
    NAME((const dp_pair *)qp, (const uint16_t *)kt, (const uint16_t *)vb, nk, valid, head_dim, \
         scale, softcap, m, l, og, group, pf_k, pf_v)
        if (head_dim == 64)
            CALL_DP(decode_group_64_dp);
        else if (head_dim == 128)
            CALL_DP(decode_group_128_dp);
        else
            CALL_DP(decode_group_any_dp);
#undef CALL_DP
        return;
    }
#else
    (void)dp;
#endif
#define CALL(NAME) \
    NAME(q, qp, kt, vb, nk, valid, head_dim, scale, softcap, m, l, og, group, pf_k, pf_v, pair)
    if (head_dim == 64)
        bf16 ? CALL(decode_group_64_bf16) : CALL(decode_group_64_f32);
    else if (head_dim == 128)
        bf16 ? CALL(decode_group_128_bf16) : CALL(decode_group_128_f32);
    else
        bf16 ? CALL(decode_group_any_bf16) : CALL(decode_group_any_f32);
#undef CALL
}

/* The query pairs of decode_block (pair): for n = heads * head_dim query values and
 * d = 2i, 16 floats (q[d] x 8, q[d + 1] x 8) at qp + i * 16. */
static inline __attribute__((always_inline)) void decode_query_pairs(const float *q, int n,
                                                                     float *qp) {
    for (int i = 0; i < n / 2; i++)
        _mm512_store_ps(qp + i * 16, _mm512_mask_blend_ps((__mmask16)0xff00,
                                                          _mm512_set1_ps(q[2 * i]),
                                                          _mm512_set1_ps(q[2 * i + 1])));
}

/* Each head's output divided by its sum l[h]; with `pair`, each 32 dimensions put back
 * in order from 16 even ones and 16 odd ones. */
static inline __attribute__((always_inline)) void decode_finish(float *orow, const float *l,
                                                                int heads, const int head_dim,
                                                                const int pair) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int h = 0; h < heads; h++) {
        const __m512 inv = _mm512_set1_ps(1.f / l[h]);
        float *o = orow + h * head_dim;
        if (pair)
            for (int w = 0; w < head_dim; w += 32) {
                /* 16 even dimensions, then 16 odd: back in order */
                const __m512 e = _mm512_loadu_ps(o + w), od = _mm512_loadu_ps(o + w + 16);
                _mm512_storeu_ps(o + w, _mm512_mul_ps(_mm512_permutex2var_ps(e, lo, od), inv));
                _mm512_storeu_ps(o + w + 16,
                                 _mm512_mul_ps(_mm512_permutex2var_ps(e, hi, od), inv));
            }
        else
            for (int d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), inv));
    }
}

/* Whether attend_decode takes a row with these shapes (else the two-pass attend_tile). */
static inline int decode_one_pass(int block_size, int head_dim) {
    return block_size == 16 && head_dim % 16 == 0 && head_dim <= 128;
}

/* Floats of prepared query per query head: pairs of floats (`pair`), bf16 pairs (`dp`,
 * one float's room each), or none (q read as it is). */
static inline __attribute__((always_inline)) int64_t decode_qprep(const int head_dim,
                                                                  const int pair, const int dp) {
    return dp ? head_dim / 2 : pair ? (int64_t)head_dim * 8 : 0;
}

/* Whether the walk at block b (keys t0 ..) prefetches block b + DECODE_PF (before the
 * keys end at n_keys). The float32 loop always does; the bf16 products (dp), which
 * finish a block in about two thirds of the time, only where the sequence's blocks jump:
 * along consecutive block ids the hardware prefetcher streams on by itself, and software
 * prefetches in its way cost more than they hid (the offline run's widest decode step,
 * 248 MB of bf16 K/V, 1 thread: 12.95 ms prefetching at jumps only, 15.71 ms always,
 * 14.28 ms never; the float32 loop 18.3 ms; load 5.7). */
static inline __attribute__((always_inline)) int decode_prefetch(const int64_t *table,
                                                                 int64_t b, int64_t t0,
                                                                 int64_t n_keys, const int dp) {
    if (DECODE_PF <= 0 || t0 + DECODE_PF * 16 >= n_keys) return 0;
    return !dp || table[b + DECODE_PF] != table[b] + DECODE_PF;
}

/* One row attended by attend_decode or attend_verify (paged_verify.h): the last of
 * n_keys positions, keys [k_lo, n_keys) attended. */
typedef struct {
    int64_t n_keys, k_lo;
    const float *q; /* the row's query heads of kv heads [h0, h1) */
    float *o;       /* their outputs */
} decode_row;

/* A row's setup, the same for a decode and a verification row: its key range and rows
 * of q and out, each head's running max and sum reset (m, l: `heads` each), its outputs
 * zeroed and its query prepared into qp (decode_qprep floats a head). */
static inline __attribute__((always_inline)) decode_row decode_row_begin(
    const float *q, int64_t q_stride, float *out, int64_t row, int64_t n_keys, int window,
    int h0, int num_heads, int group, int heads, const int head_dim, float *m, float *l,
    float *qp, const int pair, const int dp) {
    decode_row r;
    r.n_keys = n_keys;
    r.k_lo = window > 0 && n_keys > window ? n_keys - window : 0;
    r.q = q + row * q_stride + (int64_t)h0 * group * head_dim;
    r.o = out + row * (int64_t)num_heads * head_dim + (int64_t)h0 * group * head_dim;
    for (int h = 0; h < heads; h++) l[h] = 0.f, m[h] = -1e30f;
    memset(r.o, 0, sizeof(float) * heads * head_dim);
#if DECODE_DP
    if (dp) {
        decode_query_bf16(r.q, heads * head_dim, (dp_pair *)qp);
        return r;
    }
#else
    (void)dp;
#endif
    if (pair) decode_query_pairs(r.q, heads * head_dim, qp);
    return r;
}

/* A row's end: each head divided by its sum, dimensions back in order. */
static inline __attribute__((always_inline)) void decode_row_finish(const decode_row *r,
                                                                    const float *l, int heads,
                                                                    const int head_dim,
                                                                    const int pair,
                                                                    const int dp) {
#if DECODE_DP
    if (dp) {
        decode_finish_dp(r->o, l, heads, head_dim);
        return;
    }
#else
    (void)dp;
#endif
    decode_finish(r->o, l, heads, head_dim, pair);
}

/* One decode row (the last of its sequence's seq_len positions) for the query heads of
 * kv heads [h0, h1): one pass over the blocks. `dp` (a bf16 cache, head_dim a multiple
 * of 32, DECODE_DP): bf16 products. */
static inline __attribute__((always_inline)) void attend_decode(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, float *out,
    const int64_t *table, int64_t q_start, int64_t seq_len, int h0, int h1, int num_heads,
    int num_kv_heads, const int head_dim, float scale, int window, float softcap,
    const int bf16, const int dp) {
    const int group = num_heads / num_kv_heads;
    const int heads = (h1 - h0) * group;
    const int64_t span = 16 * (int64_t)head_dim;
    const int pair = bf16 && head_dim % 32 == 0;
    const int64_t qh = decode_qprep(head_dim, pair, dp);
    float m[heads], l[heads];
    float qbuf[heads * qh + 16];
    float *qp = (float *)(((uintptr_t)qbuf + 63) & ~(uintptr_t)63);
    const decode_row row = decode_row_begin(q, q_stride, out, q_start, seq_len, window, h0,
                                            num_heads, group, heads, head_dim, m, l, qp, pair, dp);
    const int64_t n_keys = row.n_keys, k_lo = row.k_lo;
    for (int64_t t0 = k_lo / 16 * 16; t0 < n_keys; t0 += 16) {
        const int nk = (int)(t0 + 16 < n_keys ? 16 : n_keys - t0);
        __mmask16 valid = (__mmask16)((1u << nk) - 1);
        if (t0 < k_lo) valid &= (__mmask16)(0xffffu << (k_lo - t0));
        const int64_t b = t0 / 16;
        const void *kb = kv_at(k_cache, (table[b] * num_kv_heads + h0) * span, bf16);
        const void *vb = kv_at(v_cache, (table[b] * num_kv_heads + h0) * span, bf16);
        const char *kn = NULL, *vn = NULL;
        if (decode_prefetch(table, b, t0, n_keys, dp)) {
            kn = kv_at(k_cache, (table[b + DECODE_PF] * num_kv_heads + h0) * span, bf16);
            vn = kv_at(v_cache, (table[b + DECODE_PF] * num_kv_heads + h0) * span, bf16);
        }
        const int64_t piece = span * (bf16 ? 2 : 4);
        for (int kv = 0; kv < h1 - h0; kv++) {
            decode_group_once(row.q + kv * group * head_dim, qp + kv * group * qh,
                              kv_at(kb, kv * span, bf16), kv_at(vb, kv * span, bf16), nk, valid,
                              head_dim, scale, softcap, m + kv * group, l + kv * group,
                              row.o + kv * group * head_dim, group, kn ? kn + kv * piece : NULL,
                              vn ? vn + kv * piece : NULL, bf16, pair, dp);
        }
    }
    decode_row_finish(&row, l, heads, head_dim, pair, dp);
}

#include "paged_verify.h"
#endif
