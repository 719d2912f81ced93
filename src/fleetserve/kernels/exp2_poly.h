/* 2^t for softmax exponentials on AVX-512 (t <= 0 where it counts): 2^floor(t) by
 * `vscalefps` (underflows to 0 below the float range) times 2^f for f = t - floor(t) in
 * [0, 1) (`vreduceps`) by a degree-4 polynomial fitted for relative error (2.6e-6 at most,
 * far under the bf16 rounding of the probabilities that use it). One copy for the prefill
 * rows (attention_bf16.h's softmax_row) and the decode / verification rows
 * (paged_decode_bf16.h): 7 dependent operations from a score to its exponential. */
#ifndef FLEETSERVE_EXP2_POLY_H
#define FLEETSERVE_EXP2_POLY_H

#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 exp2_poly(__m512 t) {
    const __m512 f = _mm512_reduce_ps(t, 0x09); /* round down, no precision exception */
    __m512 p = _mm512_set1_ps(1.353416724e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.201146191e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.414427561e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.930038346e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000002593f));
    return _mm512_scalef_ps(p, t);
}

#endif
