/* The tile configuration the bf16 AMX kernels (gemm_bf16_tiled.c, attention_amx.c) load:
 * eight tiles of 16 rows x 64 bytes (16 x 16 float32 or 16 x 32 bf16). Included where the
 * source is compiled with AMX-TILE (immintrin.h already included). */
#ifndef FLEETSERVE_AMX_TILES_H
#define FLEETSERVE_AMX_TILES_H

#include <stdint.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void tiles_begin(void) {
    /* Static: a local config only ldtilecfg reads may lose its stores (GCC 12). */
    static const tile_config c __attribute__((aligned(64))) = {
        .palette = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
    };
    _tile_loadconfig(&c);
}

#endif
