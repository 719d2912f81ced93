/* Verification rows (a query of up to VERIFY_ROWS rows of one sequence, causal: row r
 * sees the context and rows 0..r) on AVX-512 with 16-key blocks: ONE walk over the
 * sequence's blocks for all the rows. Included by paged_decode.h (decode_row_begin,
 * decode_group_once, decode_row_finish: a row's setup, block update and end are the
 * decode's own).
 *
 * Why: the rows used to attend one after another through attend_decode, so a k + 1 row
 * verification read the sequence's keys and values k + 1 times (from L2 at best). Here a
 * block of one kv head (16 keys and 16 values, 4-8 KB) is loaded once and every row whose
 * causal prefix (and window) reaches it is updated while it sits in L1.
 *
 * Bits: each row keeps its own running max, sum and output, and sees its blocks in the
 * same order, with the same nk and key mask, through the same machine copy of
 * decode_group as attend_decode (decode_group_once): a row's arithmetic is exactly that
 * of a plain decode at its position, only interleaved with the other rows'
 * (tests/test_attention_decode.py checks the bits).
 *
 *   keys:   0 ........................ ctx ctx+1 ... ctx+q_len-1
 *   row 0:  [k_lo(0) ................. ctx]              n_keys(0) = ctx + 1
 *   row r:  [k_lo(r) ........................ ctx+r]     n_keys(r) = ctx + r + 1
 * Block t0 (keys t0 .. t0 + 15) is row r's when t0 < n_keys(r) and t0 + 16 > k_lo(r)
 * (k_lo(r) = n_keys(r) - window with a window, else 0); its keys below k_lo(r) are
 * masked off, those from n_keys(r) on are past nk.
 */

/* The prepared queries (decode_qprep) of the rows walked together: at most this many
 * floats on the stack (96 KB); wider heads walk fewer rows at a time. */
#define VERIFY_QP_FLOATS (24 * 1024)

/* Rows [r0, r1) of the sequence whose q_len query rows start at row q_start of q (its
 * cache holds seq_len tokens, the last q_len of them these rows') for the query heads of
 * kv heads [h0, h1). `dp`: bf16 products, as attend_decode's. */
static inline __attribute__((always_inline)) void attend_verify(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, float *out,
    const int64_t *table, int64_t q_start, int64_t q_len, int64_t seq_len, int64_t r0,
    int64_t r1, int h0, int h1, int num_heads, int num_kv_heads, const int head_dim,
    float scale, int window, float softcap, const int bf16, const int dp) {
    const int group = num_heads / num_kv_heads;
    const int heads = (h1 - h0) * group;
    const int64_t span = 16 * (int64_t)head_dim;
    const int64_t piece = span * (bf16 ? 2 : 4);
    const int64_t ctx = seq_len - q_len;
    const int pair = bf16 && head_dim % 32 == 0;
    const int64_t qh = decode_qprep(head_dim, pair, dp);
    const int64_t qp_row = heads * qh;
    int64_t pass = qp_row ? VERIFY_QP_FLOATS / qp_row : VERIFY_ROWS;
    if (pass < 1) pass = 1;
    if (pass > VERIFY_ROWS) pass = VERIFY_ROWS;
    for (int64_t a = r0; a < r1; a += pass) {
        const int n = (int)(a + pass < r1 ? pass : r1 - a);
        float m[n * heads], l[n * heads];
        decode_row row[n];
        float qbuf[n * qp_row + 16];
        float *qp = (float *)(((uintptr_t)qbuf + 63) & ~(uintptr_t)63);
        for (int i = 0; i < n; i++)
            row[i] = decode_row_begin(q, q_stride, out, q_start + a + i, ctx + a + i + 1, window,
                                      h0, num_heads, group, heads, head_dim, m + i * heads,
                                      l + i * heads, qp + i * qp_row, pair, dp);
        /* Rows' windows start in order (k_lo grows with r) and end in order. */
        const int64_t t_end = row[n - 1].n_keys;
        for (int64_t t0 = row[0].k_lo / 16 * 16; t0 < t_end; t0 += 16) {
            const int64_t b = t0 / 16;
            const void *kb = kv_at(k_cache, (table[b] * num_kv_heads + h0) * span, bf16);
            const void *vb = kv_at(v_cache, (table[b] * num_kv_heads + h0) * span, bf16);
            const char *kn = NULL, *vn = NULL;
            if (decode_prefetch(table, b, t0, t_end, dp)) {
                kn = kv_at(k_cache, (table[b + DECODE_PF] * num_kv_heads + h0) * span, bf16);
                vn = kv_at(v_cache, (table[b + DECODE_PF] * num_kv_heads + h0) * span, bf16);
            }
            for (int kv = 0; kv < h1 - h0; kv++) {
                int first = 1; /* the first row to use the block prefetches the next */
                for (int i = 0; i < n; i++) {
                    const int64_t n_keys = row[i].n_keys, k_lo = row[i].k_lo;
                    if (t0 >= n_keys || t0 + 16 <= k_lo) continue;
                    const int nk = (int)(t0 + 16 < n_keys ? 16 : n_keys - t0);
                    __mmask16 valid = (__mmask16)((1u << nk) - 1);
                    if (t0 < k_lo) valid &= (__mmask16)(0xffffu << (k_lo - t0));
                    const int hq = i * heads + kv * group;
                    decode_group_once(row[i].q + kv * group * head_dim,
                                      qp + i * qp_row + kv * group * qh,
                                      kv_at(kb, kv * span, bf16), kv_at(vb, kv * span, bf16), nk,
                                      valid, head_dim, scale, softcap, m + hq, l + hq,
                                      row[i].o + kv * group * head_dim, group,
                                      first && kn ? kn + kv * piece : NULL,
                                      first && vn ? vn + kv * piece : NULL, bf16, pair, dp);
                    first = 0;
                }
            }
        }
        for (int i = 0; i < n; i++)
            decode_row_finish(&row[i], l + i * heads, heads, head_dim, pair, dp);
    }
}

/* attend_verify out of line, one copy per (head size, cache dtype, products): inlined
 * into attend_tile_dispatch, its code changed how the compiler ordered the prefill tile's
 * (attend_tile's) sums there under -ffast-math, and with them the prefill's last bits
 * (and the greedy text of a near tie). */
#define VERIFY_COPY(NAME, HD, BF, DP)                                                         \
    static __attribute__((noinline)) void NAME(                                               \
        const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,           \
        float *out, const int64_t *table, int64_t q_start, int64_t q_len, int64_t seq_len,    \
        int64_t r0, int64_t r1, int h0, int h1, int num_heads, int num_kv_heads,              \
        int head_dim, float scale, int window, float softcap) {                               \
        attend_verify(q, q_stride, k_cache, v_cache, out, table, q_start, q_len, seq_len, r0, \
                      r1, h0, h1, num_heads, num_kv_heads, HD, scale, window, softcap, BF,    \
                      DP);                                                                    \
    }
VERIFY_COPY(attend_verify_64_f32, 64, 0, 0)
VERIFY_COPY(attend_verify_64_bf16, 64, 1, 0)
VERIFY_COPY(attend_verify_128_f32, 128, 0, 0)
VERIFY_COPY(attend_verify_128_bf16, 128, 1, 0)
VERIFY_COPY(attend_verify_any_f32, head_dim, 0, 0)
VERIFY_COPY(attend_verify_any_bf16, head_dim, 1, 0)

/* The copy for this head size and cache dtype. */
#define ATTEND_VERIFY(BF, q, q_stride, kc, vc, out, table, q_start, q_len, seq_len, r0, r1, h0, \
                      h1, nh, nkv, hd, scale, window, softcap)                                 \
    ((hd) == 64    ? ((BF) ? attend_verify_64_bf16 : attend_verify_64_f32)                     \
     : (hd) == 128 ? ((BF) ? attend_verify_128_bf16 : attend_verify_128_f32)                   \
                   : ((BF) ? attend_verify_any_bf16 : attend_verify_any_f32))(                 \
        q, q_stride, kc, vc, out, table, q_start, q_len, seq_len, r0, r1, h0, h1, nh, nkv, hd,  \
        scale, window, softcap)

#if DECODE_DP
VERIFY_COPY(attend_verify_64_dp, 64, 1, 1)
VERIFY_COPY(attend_verify_128_dp, 128, 1, 1)
VERIFY_COPY(attend_verify_any_dp, head_dim, 1, 1)

/* Decode or verification rows [r0, r1) of a query of at most VERIFY_ROWS rows over a bf16
 * cache, with bf16 products (head_dim a multiple of 32, at most 128; 16-key blocks). Out
 * of line, so that attend_tile_dispatch's other paths compile as they did before it. */
static __attribute__((noinline)) void attend_rows_dp(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, float *out,
    const int64_t *table, int64_t q_start, int64_t q_len, int64_t seq_len, int64_t r0,
    int64_t r1, int h0, int h1, int num_heads, int num_kv_heads, int head_dim, float scale,
    int window, float softcap) {
    if (q_len > 1) {
        (head_dim == 64    ? attend_verify_64_dp
         : head_dim == 128 ? attend_verify_128_dp
                           : attend_verify_any_dp)(q, q_stride, k_cache, v_cache, out, table,
                                                   q_start, q_len, seq_len, r0, r1, h0, h1,
                                                   num_heads, num_kv_heads, head_dim, scale,
                                                   window, softcap);
        return;
    }
#define ROWS(HD)                                                                           \
    for (int64_t r = r0; r < r1; r++)                                                      \
        attend_decode(q, q_stride, k_cache, v_cache, out, table, q_start + r,              \
                      seq_len - q_len + r + 1, h0, h1, num_heads, num_kv_heads, HD, scale, \
                      window, softcap, 1, 1)
    if (head_dim == 64)
        ROWS(64);
    else if (head_dim == 128)
        ROWS(128);
    else
        ROWS(head_dim);
#undef ROWS
}
#endif
#undef VERIFY_COPY
