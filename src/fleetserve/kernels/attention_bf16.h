/* Prefill attention over a bf16 KV cache with bf16 products, shared by attention_amx.c's
 * two kernels: AMX-BF16 tile products (`tdpbf16ps`) and, on CPUs with AVX512-BF16 but no
 * AMX (Zen 4), the same arithmetic as `vdpbf16ps` register blocks (issue 25).
 *
 * Both take one item (kv head h, query rows r0 .. r1 - 1 of one sequence, the G query
 * heads sharing h) through the same steps (attention_amx.c's header comment): q rounded
 * to bf16 once; raw scores over keys t_lo .. n_end - 1 in 16-key chunks as sums over
 * pairs of dims; per row a softmax whose exps are rounded to bf16 as P (0 for keys the
 * row does not see), its sum taken over the rounded values; O = P V summed over pairs of
 * keys, divided by the row's sum. Each output element is one chain of pair products in
 * dim (or key) order, as the SDM writes both instructions. The order inside a pair
 * differs between them (tdpbf16ps adds the even element first, vdpbf16ps the odd one), so
 * the vdpbf16ps kernel stores its pairs swapped: on paper both give the same bits. Not
 * checked on a machine with AMX (none here).
 *
 * Included once, by attention_amx.c, where AVX512-BF16 and AVX512-BW are in the build
 * (immintrin.h included, ATTN_BF16 1).
 */
#ifndef FLEETSERVE_ATTENTION_BF16_H
#define FLEETSERVE_ATTENTION_BF16_H

#include "exp2_poly.h"
#include "thread_buffer.h"

/* This thread's scratch, kept across calls; NULL when it cannot grow. */
static void *scratch(size_t bytes) {
    static _Thread_local void *buf = NULL;
    static _Thread_local size_t cap = 0;
    return thread_buffer(&buf, &cap, bytes);
}

/* 16 bf16 of row a and 16 of row b, interleaved by idx into 64 bytes. */
static inline __attribute__((always_inline)) void pair16(const uint16_t *a, const uint16_t *b,
                                                         uint16_t *dst, __m512i idx) {
    __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a));
    x = _mm512_inserti64x4(x, _mm256_loadu_si256((const __m256i *)b), 1);
    _mm512_store_si512(dst, _mm512_permutexvar_epi16(idx, x));
}

/* a0 b0 a1 b1 ... (the AMX kernel's pairs), or b0 a0 b1 a1 ... when `swapped` (the
 * vdpbf16ps kernel's, so that a's element is added first there too). */
static inline __m512i pair_index(int swapped) {
    if (swapped)
        return _mm512_set_epi16(15, 31, 14, 30, 13, 29, 12, 28, 11, 27, 10, 26, 9, 25, 8, 24, 7,
                                23, 6, 22, 5, 21, 4, 20, 3, 19, 2, 18, 1, 17, 0, 16);
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                            22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

/* Sizes of one item's scratch, in bytes from its start (each part 64-byte aligned). */
typedef struct {
    size_t qb, kp, s, p, vp, ot, sums, zero, total;
} layout;

static layout plan_scratch(int G, int hd, int64_t lk) {
    layout l;
    size_t at = 0;
#define PART(f, bytes) (l.f = at, at += ((size_t)(bytes) + 63) / 64 * 64)
    PART(qb, (size_t)G * 16 * hd * 2);
    PART(kp, (size_t)hd * 16 * 2);
    PART(s, (size_t)G * 16 * lk * 4);
    PART(p, (size_t)G * 16 * lk * 2);
    PART(vp, (size_t)lk * hd * 2);
    PART(ot, 16 * 64 * 4);
    PART(sums, (size_t)G * 16 * 4);
    PART(zero, (size_t)hd * 2);
#undef PART
    l.total = at;
    return l;
}

/* Lanes t .. t + 15 that fall in [a, b). */
static inline __mmask16 lanes(int64_t t, int64_t a, int64_t b) {
    const int64_t lo = a - t > 0 ? a - t : 0, hi = b - t < 16 ? b - t : 16;
    if (hi <= lo) return 0;
    return (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

/* Softmax of one row of raw scores s[0 .. lk) whose own keys are [a, b): P (bf16) gets
 * the rounded exps there and 0 elsewhere, each pair of keys swapped when `swapped`;
 * returns the sum of the rounded values (in one order either way). The scale (and
 * softcap) are applied here; s is changed only with a softcap. */
static float softmax_row(float *s, uint16_t *p, int64_t lk, int64_t a, int64_t b, float scale,
                         float softcap, int swapped) {
    if (softcap > 0.f) {
        for (int64_t t = a; t < b; t++) s[t] = softcap * tanhf(s[t] * scale / softcap);
        scale = 1.f;
    }
    const int64_t c_lo = a / 32 * 32, c_hi = (b + 31) / 32 * 32;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = a / 16 * 16; t < b; t += 16)
        mx = _mm512_mask_max_ps(mx, lanes(t, a, b), mx, _mm512_loadu_ps(s + t));
    /* exp(scale * (s - max)) = 2^(s * c1 - c0): one fmsub per 16 scores. */
    const float c1 = scale * 1.44269504f;
    const __m512 sc = _mm512_set1_ps(c1), m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * c1);
    const __m512i zero = _mm512_setzero_si512(), hi16 = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t t = 0; t < c_lo; t += 32) _mm512_storeu_si512(p + t, zero);
    for (int64_t t = c_hi; t < lk; t += 32) _mm512_storeu_si512(p + t, zero);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t t = c_lo; t < c_hi; t += 32) {
        const __m512 e0 = _mm512_maskz_mov_ps(
            lanes(t, a, b), exp2_poly(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), sc, m)));
        const __m512 e1 = _mm512_maskz_mov_ps(
            lanes(t + 16, a, b), exp2_poly(_mm512_fmsub_ps(_mm512_loadu_ps(s + t + 16), sc, m)));
        const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
        _mm512_storeu_si512(p + t, swapped ? _mm512_rol_epi32(h, 16) : h);
        /* The rounded values back to float32: low and high halves of each 32-bit pair. */
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_and_si512(h, hi16)));
    }
    return _mm512_reduce_add_ps(acc);
}

/* Raw scores of MB query rows (bf16, pairs swapped: row i's dims 2p, 2p + 1 the 32 bits at
 * q + i * hd / 2 + p) against one 16-key chunk (kp: hd / 2 vectors, pairs swapped), into
 * s + i * lk. One accumulator per row, summed in dim order; MB (a constant where this is
 * inlined) rows share each load of keys. */
static inline __attribute__((always_inline)) void dp_scores(const uint32_t *q, const uint16_t *kp,
                                                            float *s, int64_t lk, int hd,
                                                            const int MB) {
    __m512 a[16];
    for (int i = 0; i < MB; i++) a[i] = _mm512_setzero_ps();
    for (int pr = 0; pr < hd / 2; pr++) {
        const __m512bh k = (__m512bh)_mm512_load_si512(kp + pr * 32);
        for (int i = 0; i < MB; i++)
            a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32((int)q[i * hd / 2 + pr]), k);
    }
    for (int i = 0; i < MB; i++) _mm512_storeu_ps(s + i * lk, a[i]);
}

/* NT 16-column blocks (from column tile c0) of O = P V for MB rows (P: rows lk bf16
 * apart, pairs swapped; vp: the item's paired V, pairs swapped), each divided by its
 * row's sum; written to o + i * o_stride. One accumulator per row and block, summed in
 * key order over the first n32 32-key chunks: P is exactly 0 past them for these rows,
 * and the AMX kernel's further products add exact zeros (V there finite or zeroed), so
 * stopping early leaves the same bits. */
static inline __attribute__((always_inline)) void dp_values(const uint16_t *P, int64_t lk,
                                                            const uint16_t *vp, int nct, int c0,
                                                            int64_t n32, const float *sums,
                                                            float *o, int64_t o_stride,
                                                            const int MB, const int NT) {
    __m512 a[4][4];
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NT; c++) a[i][c] = _mm512_setzero_ps();
    for (int64_t c32 = 0; c32 < n32; c32++) {
        const uint16_t *vt = vp + (c32 * nct + c0) * 512;
        for (int r = 0; r < 16; r++) {
            __m512bh v[4];
            for (int c = 0; c < NT; c++)
                v[c] = (__m512bh)_mm512_load_si512(vt + c * 512 + r * 32);
            for (int i = 0; i < MB; i++) {
                uint32_t pp;
                memcpy(&pp, P + i * lk + c32 * 32 + 2 * r, 4);
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp);
                for (int c = 0; c < NT; c++) a[i][c] = _mm512_dpbf16_ps(a[i][c], pb, v[c]);
            }
        }
    }
    for (int i = 0; i < MB; i++) {
        const __m512 inv = _mm512_set1_ps(1.f / sums[i]);
        for (int c = 0; c < NT; c++)
            _mm512_storeu_ps(o + i * o_stride + c * 16, _mm512_mul_ps(a[i][c], inv));
    }
}

/* Rows [I0, R) of one head in blocks of 16, 8, 4, 2, 1 (each a constant). */
#define ROW_BLOCKS(I0, R, CALL)                                \
    do {                                                       \
        int i_ = (I0);                                         \
        for (; i_ + 16 <= (R); i_ += 16) CALL(i_, 16);         \
        if (i_ + 8 <= (R)) CALL(i_, 8), i_ += 8;               \
        if (i_ + 4 <= (R)) CALL(i_, 4), i_ += 4;               \
        if (i_ + 2 <= (R)) CALL(i_, 2), i_ += 2;               \
        if (i_ < (R)) CALL(i_, 1);                             \
    } while (0)

/* One kv head h's item on vdpbf16ps (arguments as attention_amx.c's amx_head). Inlined
 * with hd a constant for common head sizes (dp_item): the query rows' broadcasts then
 * take fixed offsets from one pointer (with hd a variable GCC kept a pointer per row and
 * ran out of registers). */
static inline __attribute__((always_inline)) void dp_head(const float *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc,
                    float *out, const int64_t *table, int64_t q_start, int64_t ctx, int64_t r0,
                    int64_t r1, int h, int num_heads, int num_kv_heads, int hd, int bs,
                    float scale, int window, float softcap, char *buf, const layout *l,
                    int64_t t_lo, int64_t n_end, int64_t lk) {
    const int G = num_heads / num_kv_heads, R = (int)(r1 - r0), nct = hd / 16;
    const int64_t span = (int64_t)bs * hd, row_stride = (int64_t)num_heads * hd;
    uint16_t *qb = (uint16_t *)(buf + l->qb), *kp = (uint16_t *)(buf + l->kp);
    float *S = (float *)(buf + l->s), *sums = (float *)(buf + l->sums);
    uint16_t *P = (uint16_t *)(buf + l->p), *vp = (uint16_t *)(buf + l->vp);
    const uint16_t *zero = (const uint16_t *)(buf + l->zero);
    const __m512i idx = pair_index(1);

    /* 1. q in bf16, pairs swapped: [G][16][hd], rows past R unused. */
    for (int g = 0; g < G; g++)
        for (int i = 0; i < R; i++) {
            uint16_t *dst = qb + ((int64_t)g * 16 + i) * hd;
            const float *src = q + (q_start + r0 + i) * q_stride + ((int64_t)h * G + g) * hd;
            for (int d = 0; d < hd; d += 32) {
                const __m512i x = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + d + 16),
                                                               _mm512_loadu_ps(src + d));
                _mm512_store_si512(dst + d, _mm512_rol_epi32(x, 16));
            }
        }
    /* 2. Scores, 16 keys at a time: each chunk's keys paired once for all G * R rows. */
    for (int64_t t0 = t_lo; t0 < n_end; t0 += 16) {
        const uint16_t *kt = kc + (table[t0 / bs] * num_kv_heads + h) * span + t0 % bs;
        if (bs == 16)
            for (int pr = 0; pr < hd / 2; pr++)
                _mm512_store_si512(kp + pr * 32,
                                   _mm512_permutexvar_epi16(
                                       idx, _mm512_loadu_si512(kt + (int64_t)pr * 32)));
        else
            for (int pr = 0; pr < hd / 2; pr++)
                pair16(kt + (int64_t)2 * pr * bs, kt + (int64_t)(2 * pr + 1) * bs, kp + pr * 32,
                       idx);
        /* Rows before i0 see none of these keys (row i sees keys up to ctx + r0 + i):
         * their scores here are never read. */
        const int i0 = t0 - ctx - r0 > 0 ? (int)(t0 - ctx - r0) : 0;
        for (int g = 0; g < G; g++) {
            const uint32_t *qg = (const uint32_t *)(qb + (int64_t)g * 16 * hd);
            float *sg = S + (int64_t)g * 16 * lk + (t0 - t_lo);
#define SCORES(i, MB) dp_scores(qg + (i) * hd / 2, kp, sg + (i) * lk, lk, hd, MB)
            ROW_BLOCKS(i0, R, SCORES);
#undef SCORES
        }
    }
    /* 3. Softmax per row, P's pairs swapped. */
    for (int g = 0; g < G; g++)
        for (int i = 0; i < R; i++) {
            const int64_t n_keys = ctx + r0 + i + 1;
            const int64_t k_lo = window > 0 && n_keys > window ? n_keys - window : 0;
            const int64_t row = (int64_t)g * 16 + i;
            sums[row] = softmax_row(S + row * lk, P + row * lk, lk, k_lo - t_lo, n_keys - t_lo,
                                    scale, softcap, 1);
        }
    /* 4a. V paired (swapped) as the AMX kernel pairs it: 32 keys x 16 columns a block of
     * 512 bf16; keys past n_end zero. */
    for (int64_t t16 = t_lo; t16 < t_lo + lk; t16 += 16) {
        const uint16_t *v0 =
            t16 < n_end ? vc + (table[t16 / bs] * num_kv_heads + h) * span + t16 % bs * hd : zero;
        uint16_t *dst = vp + (t16 - t_lo) / 32 * nct * 512 + (t16 - t_lo) % 32 / 2 * 32;
        for (int r = 0; r < 8; r++) {
            const int64_t ta = t16 + 2 * r;
            const uint16_t *va = ta < n_end ? v0 + 2 * r * hd : zero;
            const uint16_t *vb = ta + 1 < n_end ? v0 + (2 * r + 1) * hd : zero;
            for (int ct = 0; ct < nct; ct++)
                pair16(va + ct * 16, vb + ct * 16, dst + ct * 512 + r * 32, idx);
        }
    }
    /* 4b. O = P V: blocks of 4 rows x 4 column tiles (16 accumulators). */
    for (int g = 0; g < G; g++) {
        const uint16_t *pg = P + (int64_t)g * 16 * lk;
        float *og = out + (q_start + r0) * row_stride + ((int64_t)h * G + g) * hd;
        for (int c0 = 0; c0 < nct; c0 += 4) {
/* The block's last row sees keys up to ctx + r0 + i + MB - 1: its 32-key chunks. */
#define VALUES(i, MB, NT)                                                                  \
    dp_values(pg + (i) * lk, lk, vp, nct, c0, (ctx + r0 + (i) + (MB) - t_lo + 31) / 32,    \
              sums + g * 16 + (i), og + (i) * row_stride + c0 * 16, row_stride, MB, NT)
#define ROWS(NT)                                               \
    do {                                                       \
        int i = 0;                                             \
        for (; i + 4 <= R; i += 4) VALUES(i, 4, NT);           \
        if (i + 2 <= R) VALUES(i, 2, NT), i += 2;              \
        if (i < R) VALUES(i, 1, NT);                           \
    } while (0)
            switch (nct - c0 < 4 ? nct - c0 : 4) {
                case 4: ROWS(4); break;
                case 3: ROWS(3); break;
                case 2: ROWS(2); break;
                default: ROWS(1);
            }
#undef ROWS
#undef VALUES
        }
    }
}

/* Kv heads [h0, h1) of one item on vdpbf16ps. */
static void dp_item(const float *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc,
                    float *out, const int64_t *table, int64_t q_start, int64_t ctx, int64_t r0,
                    int64_t r1, int h0, int h1, int num_heads, int num_kv_heads, int hd, int bs,
                    float scale, int window, float softcap, char *buf, const layout *l,
                    int64_t t_lo, int64_t n_end, int64_t lk) {
#define HEAD(HD)                                                                          \
    for (int h = h0; h < h1; h++)                                                         \
        dp_head(q, q_stride, kc, vc, out, table, q_start, ctx, r0, r1, h, num_heads,      \
                num_kv_heads, HD, bs, scale, window, softcap, buf, l, t_lo, n_end, lk)
    switch (hd) {
        case 64: HEAD(64); break;
        case 128: HEAD(128); break;
        default: HEAD(hd);
    }
#undef HEAD
}

#endif
