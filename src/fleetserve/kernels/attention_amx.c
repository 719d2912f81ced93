/* Prefill attention on AMX-BF16 tiles (issue 25): a tile of up to 16 query rows of one
 * sequence against one kv head's keys, for the group of query heads sharing it, as two
 * tile products per 16 x 16 block instead of one matrix-vector FMA loop per row.
 *
 * Called from paged_attention.c's attend_tile_dispatch (so the C step and the module
 * path run the same code and stay bit-equal) for items of several query rows with a bf16
 * KV cache; it returns 0 when it does not apply (float32 cache, too few rows, a head size
 * not a multiple of 32, a block size not a multiple of 16, no AVX512-BF16 in the build,
 * FLEETSERVE_ATTENTION_AMX=0, a scratch buffer that cannot grow) and the caller runs its
 * float32 FMA loop instead. Decode rows never come here. Without AMX (none in the build,
 * Linux refuses it, or FLEETSERVE_AMX=0) the same steps run as `vdpbf16ps` register
 * blocks (attention_bf16.h's dp_head).
 *
 * Per item (kv head h, query rows r0 .. r1 - 1, G = num_heads / num_kv_heads heads):
 *   1. q rounded to bf16 once (nearest even): G A-operands of 16 rows x head_dim, rows
 *      past r1 zero.
 *   2. Keys t_lo .. N - 1 (N: the last row's key count; t_lo: the first row's window
 *      start, rounded down to 16) in chunks of 16: the chunk's K (d-major in the cache,
 *      kt[d * block_size + j]) paired into the B operand's layout (dims 2p and 2p + 1 of
 *      key j side by side: one 64-byte permute per pair of dims), then per head
 *      head_dim / 32 `tdpbf16ps` into a 16 x 16 float32 score tile, stored to S.
 *   3. Softmax per row over its own keys (two-pass: the whole row of S is there):
 *      scaled, softcapped, the max subtracted, exp, rounded to bf16 as P (keys the row
 *      does not see: exactly 0), the row's sum taken over the rounded values.
 *   4. O = P V: V paired the same way (keys 2r and 2r + 1 side by side, 32 keys and 16
 *      columns a B tile; keys past N zero), per head and 16 columns one C tile summed
 *      over all 32-key chunks, divided by the row's sum as it is written out.
 * A row's output depends only on its own q, keys and values (other rows' keys get an
 * exact 0), so it does not depend on the tile's other rows.
 *
 * Tiles: 0-3 C (score or output tiles of up to 4 heads / 4 column blocks), 4-5 A,
 * 6-7 B, all 16 rows x 64 bytes (gemm_bf16.c's configuration). Each call loads the
 * configuration and releases the tiles: the same thread runs other AMX kernels between.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_perm.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ATTN_BF16 1
#include "attention_bf16.h"
#else
#define ATTN_BF16 0
#endif
#if ATTN_BF16 && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define ATTN_AMX 1
#else
#define ATTN_AMX 0
#endif

/* Items of fewer query rows take the FMA loop: a tile costs 16 rows' products, and
 * 2-row items ran as fast either way (32 sequences x 2 rows after 40 or 300 keys, 1
 * thread); from 3 rows the tiles are ahead (1.4x at 3, 1.7x at 4, 3x at 8). */
#define AMX_ATTN_MIN_ROWS 3

/* -1: not read yet (FLEETSERVE_ATTENTION_AMX at first use), 0: off, 1: on. */
static int attn_amx_mode = -1;

/* The switch for tests and A/B runs (both bf16 kernels: AMX tiles and vdpbf16ps): 1 on
 * (where the CPU and Linux allow), 0 off, -1 back to the environment's choice. */
void attention_amx_set(int mode) {
    __atomic_store_n(&attn_amx_mode, mode < 0 ? -1 : (mode ? 1 : 0), __ATOMIC_RELEASE);
}

static int attn_switch_on(void) {
    int m = __atomic_load_n(&attn_amx_mode, __ATOMIC_ACQUIRE);
    if (m < 0) {
        const char *env = getenv("FLEETSERVE_ATTENTION_AMX");
        m = env && env[0] == '0' ? 0 : 1;
        __atomic_store_n(&attn_amx_mode, m, __ATOMIC_RELEASE);
    }
    return m == 1;
}

/* 1 when items of several rows with a bf16 cache run on AMX tiles here. */
int attention_amx_active(void) {
#if ATTN_AMX
    return attn_switch_on() && amx_permitted();
#else
    return 0;
#endif
}

/* Which kernel such items run now: 2 AMX tiles, 1 vdpbf16ps (AVX512-BF16 without AMX,
 * or AMX refused: FLEETSERVE_AMX=0), 0 the float32 FMA loop (switched off, or no
 * AVX512-BF16 in the build). */
int attention_tiles_kind(void) {
    if (attention_amx_active()) return 2;
    return ATTN_BF16 && attn_switch_on() ? 1 : 0;
}

#if ATTN_AMX
#include "amx_tiles.h"

/* Score tiles of heads g0 .. g0 + ng - 1 (ng 1..4) against one 16-key chunk whose paired
 * K is at kp; stored to S at column `col`. */
static inline __attribute__((always_inline)) void score_chunk(const uint16_t *qb, const uint16_t *kp,
                                                              float *S, int64_t lk, int64_t col,
                                                              int g0, int ng, int hd) {
    const int nc = hd / 32;
    const int64_t qs = (int64_t)hd * 2;
    const uint16_t *q0 = qb + (int64_t)g0 * 16 * hd;
    _tile_zero(0);
    if (ng > 1) _tile_zero(1);
    if (ng > 2) _tile_zero(2);
    if (ng > 3) _tile_zero(3);
    for (int c = 0; c < nc; c += 2) {
        const int two = c + 1 < nc;
        _tile_loadd(6, kp + c * 512, 64);
        if (two) _tile_loadd(7, kp + (c + 1) * 512, 64);
#define HEAD(j)                                                                \
    if (ng > j) {                                                              \
        _tile_loadd(4, q0 + (int64_t)j * 16 * hd + c * 32, qs);                \
        _tile_dpbf16ps(j, 4, 6);                                               \
        if (two) {                                                             \
            _tile_loadd(5, q0 + (int64_t)j * 16 * hd + (c + 1) * 32, qs);      \
            _tile_dpbf16ps(j, 5, 7);                                           \
        }                                                                      \
    }
        HEAD(0) HEAD(1) HEAD(2) HEAD(3)
#undef HEAD
    }
    float *s0 = S + (int64_t)g0 * 16 * lk + col;
    _tile_stored(0, s0, lk * 4);
    if (ng > 1) _tile_stored(1, s0 + 16 * lk, lk * 4);
    if (ng > 2) _tile_stored(2, s0 + 32 * lk, lk * 4);
    if (ng > 3) _tile_stored(3, s0 + 48 * lk, lk * 4);
}

/* One kv head h's item. */
static void amx_head(const float *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc,
                     float *out, const int64_t *table, int64_t q_start, int64_t ctx, int64_t r0,
                     int64_t r1, int h, int num_heads, int num_kv_heads, int hd, int bs,
                     float scale, int window, float softcap, char *buf, const layout *l,
                     int64_t t_lo, int64_t n_end, int64_t lk) {
    const int G = num_heads / num_kv_heads, R = (int)(r1 - r0), nct = hd / 16;
    const int64_t span = (int64_t)bs * hd, row_stride = (int64_t)num_heads * hd;
    uint16_t *qb = (uint16_t *)(buf + l->qb), *kp = (uint16_t *)(buf + l->kp);
    float *S = (float *)(buf + l->s), *ot = (float *)(buf + l->ot);
    float *sums = (float *)(buf + l->sums);
    uint16_t *P = (uint16_t *)(buf + l->p), *vp = (uint16_t *)(buf + l->vp);
    const uint16_t *zero = (const uint16_t *)(buf + l->zero);
    const __m512i idx = pair_index(0);

    /* 1. q in bf16, rows past R zero. */
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 16; i++) {
            uint16_t *dst = qb + ((int64_t)g * 16 + i) * hd;
            if (i >= R) {
                memset(dst, 0, (size_t)hd * 2);
                continue;
            }
            const float *src = q + (q_start + r0 + i) * q_stride + ((int64_t)h * G + g) * hd;
            for (int d = 0; d < hd; d += 32)
                _mm512_store_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(
                                                _mm512_loadu_ps(src + d + 16),
                                                _mm512_loadu_ps(src + d)));
        }
    /* 2. Scores, 16 keys at a time. */
    for (int64_t t0 = t_lo; t0 < n_end; t0 += 16) {
        const uint16_t *kt = kc + (table[t0 / bs] * num_kv_heads + h) * span + t0 % bs;
        if (bs == 16) /* dims 2p and 2p + 1: 64 contiguous bytes */
            for (int pr = 0; pr < hd / 2; pr++)
                _mm512_store_si512(kp + pr * 32,
                                   _mm512_permutexvar_epi16(
                                       idx, _mm512_loadu_si512(kt + (int64_t)pr * 32)));
        else
            for (int pr = 0; pr < hd / 2; pr++)
                pair16(kt + (int64_t)2 * pr * bs, kt + (int64_t)(2 * pr + 1) * bs, kp + pr * 32,
                       idx);
        for (int g0 = 0; g0 < G; g0 += 4)
            score_chunk(qb, kp, S, lk, t0 - t_lo, g0, G - g0 < 4 ? G - g0 : 4, hd);
    }
    /* 3. Softmax per row. */
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 16; i++) {
            uint16_t *p = P + ((int64_t)g * 16 + i) * lk;
            if (i >= R) {
                memset(p, 0, (size_t)lk * 2);
                continue;
            }
            const int64_t n_keys = ctx + r0 + i + 1;
            const int64_t k_lo = window > 0 && n_keys > window ? n_keys - window : 0;
            sums[g * 16 + i] = softmax_row(S + ((int64_t)g * 16 + i) * lk, p, lk, k_lo - t_lo,
                                           n_keys - t_lo, scale, softcap, 0);
        }
    /* 4a. V paired: 32 keys x 16 columns a B tile; keys past n_end zero. A run of 16
     * keys never crosses a block (t_lo and the block size are multiples of 16). */
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
    /* 4b. O = P V per head, 4 column tiles at a time. */
    for (int g = 0; g < G; g++) {
        const uint16_t *pg = P + (int64_t)g * 16 * lk;
        for (int c0 = 0; c0 < nct; c0 += 4) {
            const int nt = nct - c0 < 4 ? nct - c0 : 4;
            _tile_zero(0);
            if (nt > 1) _tile_zero(1);
            if (nt > 2) _tile_zero(2);
            if (nt > 3) _tile_zero(3);
            for (int64_t c32 = 0; c32 < lk / 32; c32++) {
                const uint16_t *vt = vp + (c32 * nct + c0) * 512;
                _tile_loadd(4, pg + c32 * 32, lk * 2);
                _tile_loadd(6, vt, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (nt > 1) {
                    _tile_loadd(7, vt + 512, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (nt > 2) {
                    _tile_loadd(6, vt + 1024, 64);
                    _tile_dpbf16ps(2, 4, 6);
                }
                if (nt > 3) {
                    _tile_loadd(7, vt + 1536, 64);
                    _tile_dpbf16ps(3, 4, 7);
                }
            }
            _tile_stored(0, ot, 256);
            if (nt > 1) _tile_stored(1, ot + 16, 256);
            if (nt > 2) _tile_stored(2, ot + 32, 256);
            if (nt > 3) _tile_stored(3, ot + 48, 256);
            for (int i = 0; i < R; i++) {
                const float inv = 1.f / sums[g * 16 + i];
                float *o = out + (q_start + r0 + i) * row_stride + ((int64_t)h * G + g) * hd +
                           c0 * 16;
                for (int c = 0; c < nt * 16; c++) o[c] = ot[i * 64 + c] * inv;
            }
        }
    }
}
#endif

/* Attend query rows [r0, r1) of one sequence for the query heads of kv heads [h0, h1)
 * (arguments as paged_attention.c's attend_tile, the caches bf16). Returns 1 when done
 * here, 0 when the caller must run its own loop (nothing written then). */
int attend_tile_amx(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    float *out, const int64_t *table, int64_t q_start, int64_t q_len,
                    int64_t seq_len, int64_t r0, int64_t r1, int h0, int h1, int num_heads,
                    int num_kv_heads, int head_dim, int block_size, float scale, int window,
                    float softcap) {
#if ATTN_BF16
    const int kind = attention_tiles_kind();
    if (r1 - r0 < AMX_ATTN_MIN_ROWS || head_dim % 32 != 0 || block_size % 16 != 0 || !kind)
        return 0;
    const int G = num_heads / num_kv_heads;
    const int64_t ctx = seq_len - q_len;
    const int64_t first = ctx + r0 + 1; /* keys the first row sees */
    const int64_t k_lo = window > 0 && first > window ? first - window : 0;
    const int64_t t_lo = k_lo / 16 * 16, n_end = ctx + r1;
    const int64_t lk = (n_end - t_lo + 31) / 32 * 32;
    const layout l = plan_scratch(G, head_dim, lk);
    char *buf = scratch(l.total);
    if (!buf) return 0;
    memset(buf + l.zero, 0, (size_t)head_dim * 2);
#if ATTN_AMX
    if (kind == 2) {
        tiles_begin();
        for (int h = h0; h < h1; h++)
            amx_head(q, q_stride, (const uint16_t *)k_cache, (const uint16_t *)v_cache, out,
                     table, q_start, ctx, r0, r1, h, num_heads, num_kv_heads, head_dim,
                     block_size, scale, window, softcap, buf, &l, t_lo, n_end, lk);
        _tile_release();
        return 1;
    }
#endif
    dp_item(q, q_stride, (const uint16_t *)k_cache, (const uint16_t *)v_cache, out, table,
            q_start, ctx, r0, r1, h0, h1, num_heads, num_kv_heads, head_dim, block_size, scale,
            window, softcap, buf, &l, t_lo, n_end, lk);
    return 1;
#else
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)out, (void)table;
    (void)q_start, (void)q_len, (void)seq_len, (void)r0, (void)r1, (void)h0, (void)h1;
    (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale;
    (void)window, (void)softcap;
    return 0;
#endif
}
