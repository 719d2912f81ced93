/* Decode and verification rows over a bf16 KV cache with bf16 products (`vdpbf16ps`, AVX512-BF16,
 * issue 25): the one-pass walk of paged_decode.h with its scores and value sums as pair
 * products instead of float32 FMAs over widened keys and values. Included by paged_decode.h
 * where the build has AVX512-BF16 and AVX512-BW; used for head sizes that are multiples of
 * 32 while kernels/attention_amx.c's switch is on (FLEETSERVE_ATTENTION_AMX, the one that
 * runs prefill tiles with bf16 products too).
 *
 * Why: a decode row does ~3 FLOPs per byte of K/V it reads, and the float32 loop spent two
 * instructions widening each 64 bytes of keys or values besides its FMAs (16-key block,
 * 3 query heads per kv head, head size 64: ~630 vector instructions a block and kv head):
 * it ran at half the rate the memory serves. Pair products halve the work of both halves:
 * a 64-byte load of keys is one permute and G `vdpbf16ps`, two value rows are two unpacks
 * per 32 dimensions and G `vdpbf16ps` per 16 dimensions.
 *
 * Numerics (those of the prefill kernels, attention_bf16.h): q rounded to bf16 (nearest
 * even) once per row; scores are float32 sums of exact pair products, in CH chains per
 * head; the online softmax in float32 as paged_decode.h's (its exponentials as powers of
 * 2 by a shorter polynomial, exp2_poly.h); each block's probabilities
 * rounded to bf16 as P, the running sum l taken over the rounded values, so a row's output
 * is sum_t P_t v_t / sum_t P_t. The decode row, a verification row at the same position
 * and the module path all run the one machine copy per (head size) below: bit-equal.
 *
 * Layouts. Keys: a block's kv head is d-major, kt[d * 16 + j]; a 64-byte load holds dims
 * 2p and 2p + 1 of the 16 keys, and one `vpermw` makes lane j the pair (k[2p][j],
 * k[2p + 1][j]) that meets the broadcast pair (q[2p], q[2p + 1]). Values: token-major rows
 * of head_dim; `vpunpcklwd` / `vpunpckhwd` of rows 2r and 2r + 1 give, per 32 dimensions,
 * the pairs of 16 dimensions in the order
 *     lo: dims 0-3, 8-11, 16-19, 24-27     hi: dims 4-7, 12-15, 20-23, 28-31
 * (per 128-bit lane), so a head's output is kept in that order while blocks are summed
 * and put back in order once by decode_finish_dp.
 */

/* A bf16 pair in 32 bits, read from buffers that other rows' code holds as floats. */
typedef uint32_t dp_pair __attribute__((may_alias));

/* vpermw index: output element 2j is input element j (dim 2p, key j), 2j + 1 is input
 * 16 + j (dim 2p + 1, key j). */
static inline __attribute__((always_inline)) __m512i dp_key_pairs(void) {
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                            22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

/* Exponentials by exp2_poly.h, the prefill rows' polynomial: a shorter chain than
 * decode_exp's (7 dependent operations, not 12) on the path from a block's scores to its
 * value sums. */
#include "exp2_poly.h"

/* One 16-key block for G query heads of one kv head (as paged_decode.h's decode_block):
 * qb the G heads' bf16 query pairs (head h's pair p at qb[h * head_dim / 2 + p]), kt the
 * block's keys, vb its values, og the G heads' sums in unpack order. */
static inline __attribute__((always_inline)) void decode_block_dp(
    const dp_pair *qb, const uint16_t *kt, const uint16_t *vb, int nk, __mmask16 valid,
    const int head_dim, float scale, float softcap, float *m, float *l, float *og,
    const char *pf_k, const char *pf_v, const int pf_lines, const int G) {
    enum { CH = 4 }; /* chains per head: a vdpbf16ps takes ~6 cycles, G * CH in flight */
    const int np = head_dim / 2;
    const __m512i idx = dp_key_pairs();
    __m512 a[4][CH];
    for (int h = 0; h < G; h++)
        for (int c = 0; c < CH; c++) a[h][c] = _mm512_setzero_ps();
    for (int p = 0; p < np; p += CH)
        for (int c = 0; c < CH; c++) {
            const __m512bh k =
                (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(kt + (p + c) * 32));
            for (int h = 0; h < G; h++)
                a[h][c] = _mm512_dpbf16_ps(
                    a[h][c], (__m512bh)_mm512_set1_epi32((int)qb[h * np + p + c]), k);
        }
    uint32_t pw[4][8] __attribute__((aligned(32))); /* P of each head, pairs of keys */
    float f[4];
    /* The running max m is kept in the units of s: raw sums, or scaled and capped with a
     * softcap; e^(scale * (s - m)) = 2^(s * c - m * c). */
    const __m512 c = _mm512_set1_ps((softcap > 0.f ? 1.f : scale) * 1.44269504088896f);
    for (int h = 0; h < G; h++) {
        __m512 s = _mm512_add_ps(_mm512_add_ps(a[h][0], a[h][1]), _mm512_add_ps(a[h][2], a[h][3]));
        if (softcap > 0.f) {
            float t[16] __attribute__((aligned(64)));
            _mm512_store_ps(t, _mm512_mul_ps(s, _mm512_set1_ps(scale)));
            for (int j = 0; j < 16; j++) t[j] = softcap * tanhf(t[j] / softcap);
            s = _mm512_load_ps(t);
        }
        /* the running max without a branch, as decode_block */
        const __m512 mo = _mm512_set1_ps(m[h]);
        const __m512 mn = _mm512_max_ps(mo, _mm512_set1_ps(_mm512_mask_reduce_max_ps(valid, s)));
        f[h] = _mm512_cvtss_f32(exp2_poly(_mm512_mul_ps(_mm512_sub_ps(mo, mn), c)));
        m[h] = _mm512_cvtss_f32(mn);
        const __m256i pb = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(
            valid, exp2_poly(_mm512_fmsub_ps(s, c, _mm512_mul_ps(mn, c)))));
        _mm256_store_si256((__m256i *)pw[h], pb);
        const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16));
        l[h] = l[h] * f[h] + _mm512_reduce_add_ps(back);
    }
    /* Values: pairs of rows (2r, 2r + 1); an odd last row is paired with zeros (the row
     * past nk may not be a finite number: its P is 0, but 0 * NaN is not). */
    enum { NVMAX = 8 };
    const int nw = head_dim / 32;
    __m512 acc[4][NVMAX];
    for (int h = 0; h < G; h++)
        for (int u = 0; u < 2 * nw; u++) acc[h][u] = _mm512_setzero_ps();
    const int pairs = (nk + 1) / 2;
    for (int r = 0; r < pairs; r++) {
        if (pf_k) /* the next block's piece: two rows' worth of lines of keys and values */
            for (int i = 0; i < 2 * pf_lines; i++) {
                _mm_prefetch(pf_k + (2 * r * pf_lines + i) * 64, DECODE_HINT);
                _mm_prefetch(pf_v + (2 * r * pf_lines + i) * 64, DECODE_HINT);
            }
        const uint16_t *ra = vb + (int64_t)2 * r * head_dim;
        const int odd = 2 * r + 1 == nk;
        __m512bh vr[NVMAX];
        for (int w = 0; w < nw; w++) {
            const __m512i x = _mm512_loadu_si512(ra + w * 32);
            const __m512i y = odd ? _mm512_setzero_si512() : _mm512_loadu_si512(ra + head_dim + w * 32);
            vr[2 * w] = (__m512bh)_mm512_unpacklo_epi16(x, y);
            vr[2 * w + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
        }
        for (int h = 0; h < G; h++) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pw[h][r]);
            for (int u = 0; u < 2 * nw; u++) acc[h][u] = _mm512_dpbf16_ps(acc[h][u], pp, vr[u]);
        }
    }
    for (int h = 0; h < G; h++) {
        const __m512 fh = _mm512_set1_ps(f[h]);
        for (int u = 0; u < 2 * nw; u++) {
            float *o = og + h * head_dim + u * 16;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), fh, acc[h][u]));
        }
    }
}

/* The query heads [0, group) of one kv head against one block, in chunks of
 * decode_chunk(head_dim) heads (as decode_group). */
static inline __attribute__((always_inline)) void decode_group_dp(
    const dp_pair *qb, const uint16_t *kt, const uint16_t *vb, int nk, __mmask16 valid,
    const int head_dim, float scale, float softcap, float *m, float *l, float *og, int group,
    const char *pf_k, const char *pf_v) {
    const int pf_lines = (head_dim * 2 + 63) / 64;
    const int chunk = decode_chunk(head_dim);
    int h = 0;
#define DECODE_BLOCK_DP(n)                                                                   \
    decode_block_dp(qb + h * head_dim / 2, kt, vb, nk, valid, head_dim, scale, softcap, m + h, \
                    l + h, og + h * head_dim, h ? NULL : pf_k, pf_v, pf_lines, n)
    if (chunk == 4) {
        for (; h + 4 <= group; h += 4) DECODE_BLOCK_DP(4);
        switch (group - h) {
            case 3: DECODE_BLOCK_DP(3); break;
            case 2: DECODE_BLOCK_DP(2); break;
            case 1: DECODE_BLOCK_DP(1); break;
            default: break;
        }
    } else {
        for (; h + 2 <= group; h += 2) DECODE_BLOCK_DP(2);
        if (h < group) DECODE_BLOCK_DP(1);
    }
#undef DECODE_BLOCK_DP
}

/* One machine copy per head size (the reason: paged_decode.h's DECODE_GROUP_COPY). */
#define DECODE_GROUP_DP_COPY(NAME, HD)                                                       \
    static __attribute__((noinline)) void NAME(                                              \
        const dp_pair *qb, const uint16_t *kt, const uint16_t *vb, int nk, __mmask16 valid, \
        int head_dim, float scale, float softcap, float *m, float *l, float *og, int group,  \
        const char *pf_k, const char *pf_v) {                                                \
        decode_group_dp(qb, kt, vb, nk, valid, HD, scale, softcap, m, l, og, group, pf_k,    \
                        pf_v);                                                               \
    }
DECODE_GROUP_DP_COPY(decode_group_64_dp, 64)
DECODE_GROUP_DP_COPY(decode_group_128_dp, 128)
DECODE_GROUP_DP_COPY(decode_group_any_dp, head_dim)
#undef DECODE_GROUP_DP_COPY

/* q rounded to bf16: n values (a multiple of 32) into n / 2 pairs. */
static inline __attribute__((always_inline)) void decode_query_bf16(const float *q, int n,
                                                                    dp_pair *qb) {
    for (int i = 0; i < n; i += 32)
        _mm512_storeu_si512(qb + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + i + 16),
                                                                     _mm512_loadu_ps(q + i)));
}

/* Each head's output divided by its sum, each 32 dimensions put back in order from the
 * unpack order (lo: 0-3, 8-11, 16-19, 24-27; hi: 4-7, 12-15, 20-23, 28-31). */
static inline __attribute__((always_inline)) void decode_finish_dp(float *orow, const float *l,
                                                                   int heads,
                                                                   const int head_dim) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int h = 0; h < heads; h++) {
        const __m512 inv = _mm512_set1_ps(1.f / l[h]);
        float *o = orow + h * head_dim;
        for (int w = 0; w < head_dim; w += 32) {
            const __m512 lo = _mm512_loadu_ps(o + w), hi = _mm512_loadu_ps(o + w + 16);
            _mm512_storeu_ps(o + w, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv));
            _mm512_storeu_ps(o + w + 16,
                             _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv));
        }
    }
}
