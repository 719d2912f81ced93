/* bf16 <-> float32 one value at a time, in plain C: rounding to nearest even as torch's
 * `.to(torch.bfloat16)` does (NaN kept quiet), widening exact. The kernels' scalar paths
 * and packing loops use these; the vector loops use AVX512-BF16 instructions. */
#ifndef FLEETSERVE_BF16_BITS_H
#define FLEETSERVE_BF16_BITS_H

#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#endif
