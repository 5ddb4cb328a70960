/* Internal to libqtts_ops (not part of the cffi binding): the AMX tile paths (the BF16 conv's,
 * and the int8 GEMM's where AMX-INT8 is compiled in too). AMX_BF16: the tile kernels are
 * compiled (by -march); they run only while qtts_amx_on is set, which dispatch.c does when the
 * CPU has AMX-BF16, the OS lets this process use the tile data (arch_prctl(ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA)), the chosen variant has the tile kernels and nobody turned them off
 * (qtts_ops_set_amx). Otherwise the AVX512-BF16 kernels run. */
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) &&             \
    defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AMX_BF16 1
#else
#define AMX_BF16 0
#endif

/* Defined once in dispatch.c (no variant suffix): read by every variant's kernels. */
extern __attribute__((visibility("hidden"))) volatile int qtts_amx_on;

#if AMX_BF16
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* The one tile configuration of qtts's tile kernels (palette 1): all 8 tiles 16 rows x 64 bytes.
 * Loaded per thread at the start of an op (ggml's worker threads run other code between ops)
 * and released at its end. */
typedef struct __attribute__((packed)) {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} qtts_amx_tilecfg;

static inline void qtts_amx_configure(void) {
    qtts_amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}
#endif
