/* Internal to libqtts_ops (not part of the cffi binding): the attention kernels' SIMD paths,
 * their exponential and the softmax's exponentials and sum in 16 lanes (attn_causal.c,
 * attn_window.c). */
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
/* AVX2 builds (no AVX-512): the 16 lanes are two 8-float registers */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ATTN_AVX2 1
#else
#define ATTN_AVX2 0
#endif

#if defined(__AVX512F__) || ATTN_AVX2
#define ATTN_SIMD 1
#else
#define ATTN_SIMD 0
#endif

/* exp(x) = 2^n * P(r), n = round(x log2 e), r = x - n ln 2 in two parts (Cephes' expf): one set
 * of constants for both SIMD paths */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-110.0f)); /* -inf (masked) -> exactly 0 */
    const __m512 n =
        _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#elif ATTN_AVX2
/* exp16's polynomial; 2^n through the exponent bits, so x below -87 (2^n no longer normal)
 * flushes to exactly 0: those terms are < 1.2e-38 of the largest, which is 1 */
static inline __m256 exp8(__m256 x) {
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}
#endif

#define LANES 16 /* the lanes of the SIMD sums (both paths: 16 or 2 x 8 floats) */

/* lanes[16] folded by halves: (l, l + 8), then (l, l + 4), (l, l + 2), (0, 1) */
static inline float fold16(float * acc) {
    for (int w = 8; w; w >>= 1) {
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    }
    return acc[0];
}

/* P[j] = exp(S[j] - m) for j < n (the padding up to n16 stays 0); returns sum_j P[j] in lanes */
static inline float exp_sum16(float * S, int64_t n, int64_t n16, float m) {
    float acc[LANES] = {0};
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(S + j), _mm512_set1_ps(m)));
        _mm512_storeu_ps(S + j, p);
        sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(acc, sum);
#elif ATTN_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (; j + 16 <= n; j += 16) {
        const __m256 p0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(S + j), _mm256_set1_ps(m)));
        const __m256 p1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(S + j + 8), _mm256_set1_ps(m)));
        _mm256_storeu_ps(S + j, p0);
        _mm256_storeu_ps(S + j + 8, p1);
        s0 = _mm256_add_ps(s0, p0);
        s1 = _mm256_add_ps(s1, p1);
    }
    _mm256_storeu_ps(acc, s0);
    _mm256_storeu_ps(acc + 8, s1);
#endif
    for (; j < n; j++) {
        S[j] = expf(S[j] - m);
        acc[j % LANES] += S[j];
    }
    for (; j < n16; j++) S[j] = 0.0f;
    return fold16(acc);
}
