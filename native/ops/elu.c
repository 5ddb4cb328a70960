/* ELU (alpha = 1) for the cloning encoders (see qtts_ops.h):  y = x > 0 ? x : expm1(x).
 *
 * ggml's ELU calls libm expm1f once per element, which made it one of the largest costs of the
 * speech-tokenizer encoder (tens of millions of elements per 10 s of audio). Vectorised here:
 *   n = round(x / ln2), r = (x - n*L1) - n*L2 (Cody-Waite, |r| <= ln2/2 + a little),
 *   expm1(r) = r + r^2 * P(r) (Taylor to r^9: truncation below 3e-11 relative),
 *   expm1(x) = 2^n * expm1(r) + (2^n - 1)  (both terms exact for n >= -24; one rounding).
 * For n = 0 this is expm1(r) itself, so small |x| keeps its relative accuracy. x below
 * ELU_CLAMP is computed at ELU_CLAMP and x below ELU_ONE (where expm1f is -1) gives -1.
 * Error about 1 ulp; NaN passes through. The scalar build uses libm expm1f (as ggml does).
 */
#include <math.h>
#include <stdint.h>

#include "qtts_elu.h"
#include "qtts_ops.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define ELU_INV_LN2 1.44269504f
#define ELU_L1 6.93145752e-01f /* ln2 split: L1 has 16 significant bits, n*L1 is exact */
#define ELU_L2 1.42860677e-06f
#define ELU_CLAMP -16.5f
#define ELU_ONE -17.3286796f /* ln(2^-25): below it expm1f rounds to -1 */
#define ELU_C2 (1.0f / 2)
#define ELU_C3 (1.0f / 6)
#define ELU_C4 (1.0f / 24)
#define ELU_C5 (1.0f / 120)
#define ELU_C6 (1.0f / 720)
#define ELU_C7 (1.0f / 5040)
#define ELU_C8 (1.0f / 40320)
#define ELU_C9 (1.0f / 362880)

#if defined(__AVX512F__)

static inline __m512 elu_v16(__m512 x) {
    const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(ELU_CLAMP));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(ELU_INV_LN2)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ELU_L1), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ELU_L2), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(ELU_C9), r, _mm512_set1_ps(ELU_C8));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ELU_C7));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ELU_C6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ELU_C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ELU_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ELU_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ELU_C2));
    const __m512 q = _mm512_fmadd_ps(_mm512_mul_ps(r, r), p, r); /* expm1(r) */
    const __m512 two_n = _mm512_scalef_ps(_mm512_set1_ps(1.0f), n);
    __m512 y = _mm512_fmadd_ps(two_n, q, _mm512_sub_ps(two_n, _mm512_set1_ps(1.0f)));
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(ELU_ONE), _CMP_LT_OQ), y,
                             _mm512_set1_ps(-1.0f));
    /* x > 0 or NaN: x itself */
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NLE_UQ), y, x);
}

void qtts_elu_span(float * y, const float * x, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, elu_v16(_mm512_loadu_ps(x + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, m, elu_v16(_mm512_maskz_loadu_ps(m, x + i)));
    }
}

#elif defined(__AVX2__) && defined(__FMA__)

static inline __m256 elu_v8(__m256 x) {
    const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(ELU_CLAMP));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(ELU_INV_LN2)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ELU_L1), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ELU_L2), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(ELU_C9), r, _mm256_set1_ps(ELU_C8));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ELU_C7));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ELU_C6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ELU_C5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ELU_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ELU_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ELU_C2));
    const __m256 q = _mm256_fmadd_ps(_mm256_mul_ps(r, r), p, r);
    /* 2^n from the exponent bits (n >= -24 after the clamp, n <= 0 where it is used) */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    const __m256 two_n = _mm256_castsi256_ps(e);
    __m256 y = _mm256_fmadd_ps(two_n, q, _mm256_sub_ps(two_n, _mm256_set1_ps(1.0f)));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(-1.0f),
                         _mm256_cmp_ps(x, _mm256_set1_ps(ELU_ONE), _CMP_LT_OQ));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NLE_UQ));
}

void qtts_elu_span(float * y, const float * x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, elu_v8(_mm256_loadu_ps(x + i)));
    if (i < n) { /* the same lanes for the tail: a value does not depend on where a span ends */
        float buf[8] = {0};
        for (int64_t j = i; j < n; j++) buf[j - i] = x[j];
        _mm256_storeu_ps(buf, elu_v8(_mm256_loadu_ps(buf)));
        for (int64_t j = i; j < n; j++) y[j] = buf[j - i];
    }
}

#else

void qtts_elu_span(float * y, const float * x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : expm1f(x[i]);
}

#endif

void qtts_elu_op(struct ggml_tensor * dst, const struct ggml_tensor * a, int ith, int nth,
                 void * userdata) {
    (void)userdata;
    qtts_elementwise(dst, a, ith, nth, qtts_elu_span);
}
