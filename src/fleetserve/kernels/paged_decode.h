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

/* One block (its first nk keys; `valid` marks the keys attended) for G query heads of
 * one kv head: scores against the d-major keys kt, the online softmax update of each
 * head's running max m[h] and sum l[h], then og_h = og_h * f_h + sum_j p_h[j] * v_j over
 * the token-major values vb (f_h = e^(m_old - m_new), 0 on the head's first block).
 * G (1..4) and head_dim are constants where this is inlined: the score chains and the
 * value sums (G * head_dim / 16 vectors) live in registers. */
static inline __attribute__((always_inline)) void decode_block(
    const float *q, const void *kt, const void *vb, int nk, __mmask16 valid,
    const int head_dim, float scale, float softcap, float *m, float *l, float *og,
    const int G, const int bf16) {
    /* Scores: CH independent chains over d per head (as block_scores). */
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
    float p[4][16] __attribute__((aligned(64)));
    float f[4];
    for (int h = 0; h < G; h++) {
        __m512 s = a[h][0];
        for (int c = 1; c < CH; c++) s = _mm512_add_ps(s, a[h][c]);
        s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
        if (softcap > 0.f) {
            float t[16] __attribute__((aligned(64)));
            _mm512_store_ps(t, s);
            for (int j = 0; j < 16; j++) t[j] = softcap * tanhf(t[j] / softcap);
            s = _mm512_load_ps(t);
        }
        const float bm = _mm512_mask_reduce_max_ps(valid, s);
        float mn = m[h];
        if (l[h] == 0.f) { /* the head's first block: nothing to rescale */
            mn = bm;
            f[h] = 0.f;
        } else if (bm > mn) {
            f[h] = expf(mn - bm);
            mn = bm;
        } else {
            f[h] = 1.f;
        }
        m[h] = mn;
        const __m512 e = _mm512_maskz_mov_ps(valid, decode_exp(_mm512_sub_ps(s, _mm512_set1_ps(mn))));
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
        __m512 vr[NVMAX];
        for (int u = 0; u < nv; u++) vr[u] = (__m512)kv_vec(vb, (int64_t)j * head_dim + u * 16, bf16);
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
    const float *q, const void *kt, const void *vb, int nk, __mmask16 valid,
    const int head_dim, float scale, float softcap, float *m, float *l, float *og, int group,
    const int bf16) {
    const int chunk = decode_chunk(head_dim);
    int h = 0;
#define DECODE_BLOCK(n)                                                                      \
    decode_block(q + h * head_dim, kt, vb, nk, valid, head_dim, scale, softcap, m + h, l + h, \
                 og + h * head_dim, n, bf16)
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

/* Whether attend_decode takes a row with these shapes (else the two-pass attend_tile). */
static inline int decode_one_pass(int block_size, int head_dim) {
    return block_size == 16 && head_dim % 16 == 0 && head_dim <= 128;
}

/* One decode row (the last of its sequence's seq_len positions) for the query heads of
 * kv heads [h0, h1): one pass over the blocks. */
static inline __attribute__((always_inline)) void attend_decode(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, float *out,
    const int64_t *table, int64_t q_start, int64_t seq_len, int h0, int h1, int num_heads,
    int num_kv_heads, const int head_dim, float scale, int window, float softcap,
    const int bf16) {
    const int group = num_heads / num_kv_heads;
    const int heads = (h1 - h0) * group;
    const int64_t span = 16 * (int64_t)head_dim;
    const int64_t n_keys = seq_len;
    const int64_t k_lo = window > 0 && n_keys > window ? n_keys - window : 0;
    const int64_t t_lo = k_lo / 16 * 16;
    const float *qr = q + q_start * q_stride + (int64_t)h0 * group * head_dim;
    float *orow = out + q_start * (int64_t)num_heads * head_dim + (int64_t)h0 * group * head_dim;
    float m[heads], l[heads];
    for (int h = 0; h < heads; h++) l[h] = 0.f, m[h] = 0.f;
    memset(orow, 0, sizeof(float) * heads * head_dim);
    for (int64_t t0 = t_lo; t0 < n_keys; t0 += 16) {
        const int nk = (int)(t0 + 16 < n_keys ? 16 : n_keys - t0);
        __mmask16 valid = (__mmask16)((1u << nk) - 1);
        if (t0 < k_lo) valid &= (__mmask16)(0xffffu << (k_lo - t0));
        const int64_t b = t0 / 16;
        const void *kb = kv_at(k_cache, (table[b] * num_kv_heads + h0) * span, bf16);
        const void *vb = kv_at(v_cache, (table[b] * num_kv_heads + h0) * span, bf16);
        const char *kn = NULL, *vn = NULL;
        if (DECODE_PF > 0 && t0 + DECODE_PF * 16 < n_keys) {
            kn = kv_at(k_cache, (table[b + DECODE_PF] * num_kv_heads + h0) * span, bf16);
            vn = kv_at(v_cache, (table[b + DECODE_PF] * num_kv_heads + h0) * span, bf16);
        }
        const int64_t piece = span * (bf16 ? 2 : 4);
        for (int kv = 0; kv < h1 - h0; kv++) {
            if (kn)
                for (int64_t i = 0; i < piece; i += 64) {
                    _mm_prefetch(kn + kv * piece + i, DECODE_HINT);
                    _mm_prefetch(vn + kv * piece + i, DECODE_HINT);
                }
            decode_group(qr + kv * group * head_dim, kv_at(kb, kv * span, bf16),
                         kv_at(vb, kv * span, bf16), nk, valid, head_dim, scale, softcap,
                         m + kv * group, l + kv * group, orow + kv * group * head_dim, group,
                         bf16);
        }
    }
    for (int h = 0; h < heads; h++) {
        const float inv = 1.f / l[h];
        for (int d = 0; d < head_dim; d++) orow[h * head_dim + d] *= inv;
    }
}
#endif
