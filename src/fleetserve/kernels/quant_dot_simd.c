/* One panel of 16 weight rows in the dot layout (quant_dot.h) times up to QDOT_ROWS
 * quantized rows of x, for what the build's target has:
 *   AVX-512 VNNI: vpdpbusd (u8 x s8, 4 products summed into each int32 lane) on 16 rows
 *     at once. Q4 / Q5 quants are unsigned already (Q5's fifth bits are or-ed in at bit
 *     4 of each byte: a shift and a mask per group, see quant_dot.h's qh); Q8_0's are
 *     made unsigned by +128 (an xor), taken back out as 128 * sum(q_x) per block.
 *   AVX2: vpmaddubsw (u8 x s8 pairs into int16) then vpmaddwd by ones into int32, on 8
 *     rows per register. Q4: two nibble products stay under 2 * 15 * 127 per int16
 *     lane, so the 4 groups of a block (30,480 at most) sum in int16 before one widen;
 *     Q5 (2 * 31 * 127) widens every 2 groups (31,496 at most).
 *     Q8_0 takes |w| (128 for -128 still fits a u8) times x with w's sign, llama.cpp's
 *     trick: 2 * 128 * 127 per int16 lane, no saturation.
 *   otherwise: plain C on int32.
 * Per block: out += d_w * d_x * isum, plus d_x * sum(q_x) * m for Q4_1 / Q5_1; Q4_0's
 * -8, Q5_0's -16 and Q8_0's +128 come off isum in integers. CPUs with AVX-VNNI but no AVX-512 take the AVX2
 * kernel: their 256-bit vpdpbusd could not be run on this project's machines. */
#include "quant_common.h"
#include "quant_dot.h"

#define PR 16
#define PREFETCH 4096
#define PREFETCH_FAR 16384

/* Fewest rows of x for which the kernels prefetch the weights themselves. On AMD Zen 4
 * (GCC 12's -march=native calls it znver3) a step of 1-2 rows streams its weights
 * faster on the hardware prefetchers alone: a replayed 1-row SmolLM2 decode step (Q4_1
 * layers, Q8_0 LM head, ~96 MB from DRAM) took 3.57 ms (p10 of 400, thread CPU time)
 * against 4.24 with the prefetches below and 4.02 with one stream 16 KB ahead; the LM
 * head read 28.2 GB/s against 20.6, the Q4_1 projections 23.6-27.6 against 21.8-25.3;
 * 2 rows 3.71 against 4.43 ms. At 4 rows they pay (5.26 ms with them, 5.52 without), at
 * 8 more so (8.88 against 11.30); 3 rows, not measured, keep them. On the Xeon of
 * earlier sessions they paid at one row too (no prefetch read Q4_1 layers at 12.7 GB/s
 * against 18.5): other targets keep them (docs/benchmarks.md, issue 25, branch roof3). */
#if defined(__AVX512VNNI__) &&                                                            \
    (defined(__znver1__) || defined(__znver2__) || defined(__znver3__) ||                 \
     defined(__znver4__) || defined(__znver5__))
#define PREFETCH_MIN_ROWS 3
#else
#define PREFETCH_MIN_ROWS 1
#endif

/* A panel block's prefetches (from PREFETCH_MIN_ROWS rows): 4 KB ahead into L1 always
 * and, where the block's compute for `rows` rows is short for its bytes (under ~56
 * bytes per row and block: Q8_0 1-9 rows, Q4 2-5), 16 KB ahead into L2 as well. On the
 * Zen 4 here the one stream into L1 left a DRAM-bound weight half idle while the rows'
 * arithmetic ran: the 49152-row Q8_0 LM head ran 1.3-1.66x faster at 8 rows with the
 * far stream too. One row of Q4 keeps the one stream: it moved Q4_1 layers streamed from
 * DRAM by -6% to +12% (and cost 9% where the weights sit in L2); at 6-16 Q4 rows the
 * extra instructions cost 3-6% for nothing (docs/benchmarks.md, issue 25, branch
 * qvnni). */
static inline __attribute__((always_inline)) void prefetch_block(int qtype, const uint8_t *pb,
                                                                 int64_t bb, int rows) {
    if (rows < PREFETCH_MIN_ROWS) return;
    PREFETCH_WEIGHTS(pb, bb, PREFETCH);
    if ((rows >= 2 || qtype == Q8_0) && rows * 56 <= bb) PREFETCH_WEIGHTS_L2(pb, bb, PREFETCH_FAR);
}

static inline int64_t panel_block_bytes(int qtype) {
    switch (qtype) {
    case Q8_0: return PR * 34;
    case Q4_1: return PR * 20;
    case Q5_0: return PR * 22;
    case Q5_1: return PR * 24;
    default: return PR * 18;
    }
}

/* Bytes before the quants in a panel block (quant_dot.c's head_bytes). */
static inline int64_t panel_head(int qtype) {
    switch (qtype) {
    case Q4_1: return 64;
    case Q5_0: return 96;
    case Q5_1: return 128;
    default: return 32;
    }
}

static inline int has_min(int qtype) { return qtype == Q4_1 || qtype == Q5_1; }
static inline int is_q5(int qtype) { return qtype == Q5_0 || qtype == Q5_1; }

/* What comes off isum per unit of sum(q_x): the quants' offset (Q4_0 8, Q5_0 16, Q8_0's
 * +128 for the unsigned trick; 0 where a min m is added in floats instead). */
static inline int32_t quant_offset(int qtype) {
    switch (qtype) {
    case Q4_0: return 8;
    case Q5_0: return 16;
    default: return 0;
    }
}

static inline int32_t ld32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* acc + w . (x's 4 bytes at q, broadcast): vpdpbusd with the broadcast as its memory
 * operand ({1to16}). GCC 12 emits a separate vpbroadcastd per call from the intrinsics,
 * an instruction per vpdpbusd more through the front end and the scheduler. */
static inline __attribute__((always_inline)) __m512i dp_x4(__m512i acc, __m512i w,
                                                          const int8_t *q) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)q));
    return acc;
}

/* 8 rows: 2 zmm each (acc, one int32 chain) + ~9 shared stay within the 32 registers
 * (no spills: checked in the objdump), so a speculative verification of k <= 7 drafts is
 * one pass over the weights; 9-16 rows take dot_panel_wide, also one pass. */
#define QDOT_ROWS 8

static inline __attribute__((always_inline)) void dot_panel(int qtype, const uint8_t *panel,
                                                            int64_t nb, const qdot_xblock *xb,
                                                            int64_t ldxb, int rows, float *out,
                                                            int64_t ldo, int cols) {
    const int64_t bb = panel_block_bytes(qtype), head = panel_head(qtype);
    const __m512i m4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    const __m512i bit4 = _mm512_set1_epi8(16);
    /* Two int32 chains per row at 1-2 rows (one of 8 dependent vpdpbusd would set the
     * pace); from 3 rows on, the rows' chains interleave and hide vpdpbusd's latency. */
    const int chains = rows < 3 ? 2 : 1;
    __m512 acc[QDOT_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = panel + b * bb, *qs = pb + head;
        prefetch_block(qtype, pb, bb, rows);
        __m512i s0[QDOT_ROWS], s1[QDOT_ROWS];
        for (int r = 0; r < rows; r++) s0[r] = s1[r] = _mm512_setzero_si512();
        if (qtype == Q8_0) {
            for (int g = 0; g < 8; g += 2) {
                const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(qs + g * 64), flip);
                const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(qs + g * 64 + 64), flip);
                for (int r = 0; r < rows; r++) {
                    const int8_t *q = xb[r * ldxb + b].q + 4 * g;
                    s0[r] = _mm512_dpbusd_epi32(s0[r], w0, _mm512_set1_epi32(ld32(q)));
                    if (chains == 2)
                        s1[r] = _mm512_dpbusd_epi32(s1[r], w1, _mm512_set1_epi32(ld32(q + 4)));
                    else
                        s0[r] = _mm512_dpbusd_epi32(s0[r], w1, _mm512_set1_epi32(ld32(q + 4)));
                }
            }
        } else {
            const __m512i qh = is_q5(qtype) ? _mm512_loadu_si512(qs - 64) : _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                const __m512i v = _mm512_loadu_si512(qs + g * 64);
                __m512i lo = _mm512_and_si512(v, m4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if (is_q5(qtype)) {
                    /* Group g's fifth bits: bit 8j + g (low nibbles), 8j + 4 + g (high). */
                    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi32(qh, 4 - g), bit4));
                    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi32(qh, g), bit4));
                }
                for (int r = 0; r < rows; r++) {
                    const int8_t *q = xb[r * ldxb + b].q + 4 * g;
                    s0[r] = _mm512_dpbusd_epi32(s0[r], lo, _mm512_set1_epi32(ld32(q)));
                    if (chains == 2)
                        s1[r] = _mm512_dpbusd_epi32(s1[r], hi, _mm512_set1_epi32(ld32(q + 16)));
                    else
                        s0[r] = _mm512_dpbusd_epi32(s0[r], hi, _mm512_set1_epi32(ld32(q + 16)));
                }
            }
        }
        /* Q8_0's +128 (the unsigned trick) comes off as the others' offsets do. */
        const int32_t off = qtype == Q8_0 ? 128 : quant_offset(qtype);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pb));
        const __m512 m =
            has_min(qtype) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pb + 32))) : d;
        for (int r = 0; r < rows; r++)
            acc[r] = qdot_scale(chains == 2 ? _mm512_add_epi32(s0[r], s1[r]) : s0[r], off,
                                has_min(qtype), xb + r * ldxb + b, d, m, acc[r]);
    }
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(out + r * ldo, keep, acc[r]);
}

/* 9-16 rows in one pass over the panel (dot_panel would take them in two): per block, the
 * 8 weight vectors are unpacked once into registers (w[i] pairs with x's quants
 * 4i .. 4i + 3: Q4 / Q5 groups 0-3 low nibbles then high ones, Q8_0 groups 0-7), then
 * each row's 8 vpdpbusd run as two chains of 4 and its sum is scaled by qdot_scale as
 * dot_panel's is (the same float steps: the same bits). On Zen 4 vpdpbusd, vmulps and
 * vfmadd share the two multiply pipes (one zmm op a cycle, measured), so both kernels run
 * at ~94% of that bound from L2; the second pass mattered for weights streamed from DRAM:
 * it computed from L1 while memory sat idle (the 49152-row Q8_0 LM head at 16 rows ran
 * 1.09-1.15x faster in one pass). */
#define QDOT_WIDE 16

static inline __attribute__((always_inline)) void dot_panel_wide(int qtype, const uint8_t *panel,
                                                                 int64_t nb,
                                                                 const qdot_xblock *xb,
                                                                 int64_t ldxb, int rows,
                                                                 float *out, int64_t ldo,
                                                                 int cols) {
    const int64_t bb = panel_block_bytes(qtype), head = panel_head(qtype);
    const __m512i m4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    const __m512i bit4 = _mm512_set1_epi8(16);
    const int32_t off = qtype == Q8_0 ? 128 : quant_offset(qtype);
    __m512 acc[QDOT_WIDE];
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = panel + b * bb, *qs = pb + head;
        prefetch_block(qtype, pb, bb, rows);
        __m512i w[8];
        if (qtype == Q8_0) {
            for (int g = 0; g < 8; g++)
                w[g] = _mm512_xor_si512(_mm512_loadu_si512(qs + g * 64), flip);
        } else {
            const __m512i qh = is_q5(qtype) ? _mm512_loadu_si512(qs - 64) : _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                const __m512i v = _mm512_loadu_si512(qs + g * 64);
                w[g] = _mm512_and_si512(v, m4);
                w[4 + g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if (is_q5(qtype)) {
                    w[g] = _mm512_or_si512(w[g], _mm512_and_si512(_mm512_slli_epi32(qh, 4 - g), bit4));
                    w[4 + g] = _mm512_or_si512(w[4 + g], _mm512_and_si512(_mm512_srli_epi32(qh, g), bit4));
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pb));
        const __m512 m =
            has_min(qtype) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pb + 32))) : d;
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            const qdot_xblock *x = xb + r * ldxb + b;
            __m512i s0 = dp_x4(_mm512_setzero_si512(), w[0], x->q);
            __m512i s1 = dp_x4(_mm512_setzero_si512(), w[1], x->q + 4);
            for (int i = 2; i < 8; i += 2) {
                s0 = dp_x4(s0, w[i], x->q + 4 * i);
                s1 = dp_x4(s1, w[i + 1], x->q + 4 * i + 4);
            }
            acc[r] = qdot_scale(_mm512_add_epi32(s0, s1), off, has_min(qtype), x, d, m, acc[r]);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(out + r * ldo, keep, acc[r]);
}

#elif defined(__AVX2__)
#define QDOT_ROWS 2

static inline __attribute__((always_inline)) void dot_panel(int qtype, const uint8_t *panel,
                                                            int64_t nb, const qdot_xblock *xb,
                                                            int64_t ldxb, int rows, float *out,
                                                            int64_t ldo, int cols) {
    const int64_t bb = panel_block_bytes(qtype), head = panel_head(qtype);
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i bit4 = _mm256_set1_epi8(16);
    __m256 acc[QDOT_ROWS][2]; /* [x row][rows 0-7 | 8-15 of the panel] */
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = panel + b * bb, *qs = pb + head;
        prefetch_block(qtype, pb, bb, rows);
        __m256i s[QDOT_ROWS][2];
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < rows; r++) s[r][h] = _mm256_setzero_si256();
            if (qtype == Q8_0) {
                for (int g = 0; g < 8; g++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + g * 64 + h * 32));
                    const __m256i aw = _mm256_abs_epi8(w);
                    for (int r = 0; r < rows; r++) {
                        const __m256i xq = _mm256_set1_epi32(ld32(xb[r * ldxb + b].q + 4 * g));
                        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xq, w));
                        s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(p, ones));
                    }
                }
                continue;
            }
            const __m256i qh = is_q5(qtype)
                                   ? _mm256_loadu_si256((const __m256i *)(qs - 64 + h * 32))
                                   : _mm256_setzero_si256();
            /* int16 sums of the block's groups: all 4 for Q4, 2 at a time for Q5. */
            const int per_widen = is_q5(qtype) ? 2 : 4;
            for (int g0 = 0; g0 < 4; g0 += per_widen) {
                __m256i t[QDOT_ROWS];
                for (int r = 0; r < rows; r++) t[r] = _mm256_setzero_si256();
                for (int g = g0; g < g0 + per_widen; g++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + g * 64 + h * 32));
                    __m256i lo = _mm256_and_si256(v, m4);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    if (is_q5(qtype)) {
                        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32(qh, 4 - g), bit4));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi32(qh, g), bit4));
                    }
                    for (int r = 0; r < rows; r++) {
                        const int8_t *q = xb[r * ldxb + b].q + 4 * g;
                        const __m256i a = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(ld32(q)));
                        const __m256i c = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ld32(q + 16)));
                        t[r] = _mm256_add_epi16(t[r], _mm256_add_epi16(a, c));
                    }
                }
                for (int r = 0; r < rows; r++)
                    s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(t[r], ones));
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 16 * h)));
            for (int r = 0; r < rows; r++) {
                const qdot_xblock *x = xb + r * ldxb + b;
                __m256i is = s[r][h];
                if (quant_offset(qtype))
                    is = _mm256_sub_epi32(is, _mm256_set1_epi32(quant_offset(qtype) * x->s));
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is),
                                            _mm256_mul_ps(d, _mm256_set1_ps(x->d)), acc[r][h]);
                if (has_min(qtype)) {
                    const __m256 m =
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 32 + 16 * h)));
                    acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->d * (float)x->s), acc[r][h]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float tmp[16];
        _mm256_storeu_ps(tmp, acc[r][0]);
        _mm256_storeu_ps(tmp + 8, acc[r][1]);
        memcpy(out + r * ldo, tmp, (size_t)cols * sizeof(float));
    }
}

#else
#define QDOT_ROWS 4

static inline __attribute__((always_inline)) void dot_panel(int qtype, const uint8_t *panel,
                                                            int64_t nb, const qdot_xblock *xb,
                                                            int64_t ldxb, int rows, float *out,
                                                            int64_t ldo, int cols) {
    const int64_t bb = panel_block_bytes(qtype), head = panel_head(qtype);
    float acc[QDOT_ROWS][PR] = {{0}};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = panel + b * bb, *qs = pb + head;
        for (int r = 0; r < rows; r++) {
            const qdot_xblock *x = xb + r * ldxb + b;
            for (int j = 0; j < PR; j++) {
                int32_t is = 0;
                if (qtype == Q8_0) {
                    for (int i = 0; i < 32; i++)
                        is += (int8_t)qs[(i / 4) * 64 + 4 * j + i % 4] * x->q[i];
                } else {
                    uint32_t qh = 0;
                    if (is_q5(qtype)) memcpy(&qh, qs - 64 + 4 * j, 4);
                    for (int i = 0; i < 16; i++) {
                        const int g = i / 4, l = i % 4;
                        const uint8_t q = qs[g * 64 + 4 * j + l];
                        const int lo = (q & 15) | (int)(((qh >> (8 * l + g)) & 1u) << 4);
                        const int hi = (q >> 4) | (int)(((qh >> (8 * l + 4 + g)) & 1u) << 4);
                        is += lo * x->q[i] + hi * x->q[i + 16];
                    }
                    is -= quant_offset(qtype) * x->s;
                }
                acc[r][j] += h2f(pb + 2 * j) * x->d * (float)is;
                if (has_min(qtype)) acc[r][j] += h2f(pb + 32 + 2 * j) * x->d * (float)x->s;
            }
        }
    }
    for (int r = 0; r < rows; r++) memcpy(out + r * ldo, acc[r], (size_t)cols * sizeof(float));
}
#endif

/* Rows of x per pass for a step of `rows` left to multiply: all of them in one pass up to
 * QDOT_WIDE (dot_panel_wide), else passes of QDOT_ROWS. Past 16 rows (the prefill chunks
 * of mixed steps) the narrow passes stay: a served run's mixed steps (64-255 rows) were
 * 4-6% slower in 16-row passes, for no gain in the kernel's bench. */
int quant_dot_pass_rows(int64_t rows) {
#ifdef QDOT_WIDE
    if (rows <= QDOT_WIDE) return (int)rows;
#endif
    return rows < QDOT_ROWS ? (int)rows : QDOT_ROWS;
}

/* Which integer kernel this build runs: 2 AVX-512 VNNI, 1 AVX2, 0 plain C (where the
 * float path is faster: models/quantize.py's default reads it). */
int quant_dot_kind(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

#if QDOT_ROWS == 8
/* 9-16 rows with the count a constant: dot_panel_wide's row loops unrolled, its
 * accumulators in registers (with a run-time count they sit on the stack, zeroed by a
 * memset per panel: 5-7% of a 13-row verification's samples). The same steps per row. */
#define WIDE_CASES(QT)                                                                  \
    case 9: dot_panel_wide(QT, panel, nb, xb, ldxb, 9, out, ldo, cols); break;          \
    case 10: dot_panel_wide(QT, panel, nb, xb, ldxb, 10, out, ldo, cols); break;        \
    case 11: dot_panel_wide(QT, panel, nb, xb, ldxb, 11, out, ldo, cols); break;        \
    case 12: dot_panel_wide(QT, panel, nb, xb, ldxb, 12, out, ldo, cols); break;        \
    case 13: dot_panel_wide(QT, panel, nb, xb, ldxb, 13, out, ldo, cols); break;        \
    case 14: dot_panel_wide(QT, panel, nb, xb, ldxb, 14, out, ldo, cols); break;        \
    case 15: dot_panel_wide(QT, panel, nb, xb, ldxb, 15, out, ldo, cols); break;        \
    case 16: dot_panel_wide(QT, panel, nb, xb, ldxb, 16, out, ldo, cols); break;
#define ROW_CASES(QT)                                                                   \
    switch (rows) {                                                                     \
    case 1: dot_panel(QT, panel, nb, xb, ldxb, 1, out, ldo, cols); break;               \
    case 2: dot_panel(QT, panel, nb, xb, ldxb, 2, out, ldo, cols); break;               \
    case 3: dot_panel(QT, panel, nb, xb, ldxb, 3, out, ldo, cols); break;               \
    case 4: dot_panel(QT, panel, nb, xb, ldxb, 4, out, ldo, cols); break;               \
    case 5: dot_panel(QT, panel, nb, xb, ldxb, 5, out, ldo, cols); break;               \
    case 6: dot_panel(QT, panel, nb, xb, ldxb, 6, out, ldo, cols); break;               \
    case 7: dot_panel(QT, panel, nb, xb, ldxb, 7, out, ldo, cols); break;               \
    case 8: dot_panel(QT, panel, nb, xb, ldxb, 8, out, ldo, cols); break;               \
    WIDE_CASES(QT)                                                                      \
    default: dot_panel_wide(QT, panel, nb, xb, ldxb, rows, out, ldo, cols); break;      \
    }
#elif QDOT_ROWS == 4
#define ROW_CASES(QT)                                                                   \
    switch (rows) {                                                                     \
    case 1: dot_panel(QT, panel, nb, xb, ldxb, 1, out, ldo, cols); break;               \
    case 2: dot_panel(QT, panel, nb, xb, ldxb, 2, out, ldo, cols); break;               \
    case 3: dot_panel(QT, panel, nb, xb, ldxb, 3, out, ldo, cols); break;               \
    default: dot_panel(QT, panel, nb, xb, ldxb, 4, out, ldo, cols); break;              \
    }
#else
#define ROW_CASES(QT)                                                                   \
    switch (rows) {                                                                     \
    case 1: dot_panel(QT, panel, nb, xb, ldxb, 1, out, ldo, cols); break;               \
    default: dot_panel(QT, panel, nb, xb, ldxb, 2, out, ldo, cols); break;              \
    }
#endif

void quant_dot_panel(int qtype, const uint8_t *panel, int64_t nb, const qdot_xblock *xb,
                     int64_t ldxb, int rows, float *out, int64_t ldo, int cols) {
    switch (qtype) {
    case Q8_0: ROW_CASES(Q8_0) break;
    case Q4_0: ROW_CASES(Q4_0) break;
    case Q4_1: ROW_CASES(Q4_1) break;
    case Q5_0: ROW_CASES(Q5_0) break;
    case Q5_1: ROW_CASES(Q5_1) break;
    }
}
