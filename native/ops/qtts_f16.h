/* Internal to libqtts_ops (not part of the cffi binding): F32 -> F16 as ggml's CPY and
 * SET_ROWS write a cache (round to nearest even): the hardware conversion where the variant
 * has one, ggml's converter otherwise; the same bits either way. */
#pragma once

#include <stdint.h>

#include "ggml.h"

#if defined(__AVX512F__) || (defined(__F16C__) && defined(__AVX__))
#include <immintrin.h>
#endif

static inline void qtts_f16_row(ggml_fp16_t * dst, const float * src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#elif defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8) {
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    if (i < n) {
        ggml_fp32_to_fp16_row(src + i, dst + i, n - i);
    }
}

/* one value (a channel-major V row's new position): no call for the F16C / AVX-512 variants */
static inline ggml_fp16_t qtts_f16(float x) {
#if defined(__F16C__) || defined(__AVX512F__)
    return (ggml_fp16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
    ggml_fp16_t h;
    ggml_fp32_to_fp16_row(&x, &h, 1);
    return h;
#endif
}
