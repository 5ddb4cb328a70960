/* Internal to libqtts_ops (not part of the cffi binding): which BF16 path is compiled, and
 * scalar BF16 conversions as the AVX512-BF16 instructions do them (the portable paths and the
 * odd tails use these). */
#pragma once

#include <stdint.h>
#include <string.h>

/* BF16_SIMD: the AVX512-BF16 kernels are compiled (by -march), else the portable paths. */
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BF16_SIMD 1
#include <immintrin.h>
#else
#define BF16_SIMD 0
#endif

/* Rounding as VCVTNEPS2BF16: NaN quieted, zero/subnormal to signed zero, else nearest even. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    if ((u & 0x7F800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
