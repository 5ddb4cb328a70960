/* GELU with the exact erf, y = x/2 * (1 + erf(x / sqrt 2)), for the codec encoder's
 * transformer and the decoder's upsampler (see qtts_ops.h).
 *
 * ggml's GELU_ERF calls libm erff once per element (docs/performance.md, Session 22). Here in
 * vector lanes, with 1 + erf(z) = erfc(-z):
 *   |z| < 1/2:  1 + z * E(z^2), E the Taylor series of erf(z)/z to z^14 (truncation < 3e-10);
 *   otherwise:  erfc(a), a = |z|, as t * exp(-a^2 + g(t)), t = 1 / (1 + a/2), g a polynomial of
 *               degree 9 in u = (t - 7/12) * 12/5 (t over [1/6, 1] for a up to 10), fitted to
 *               log(erfc(a) / t) + a^2 in float64 (weighted least squares, max error 5e-8:
 *               native/fit_gelu.py prints the coefficients);
 *               a^2 enters as its rounded square and a remainder (exp(-hi) (1 - lo)) that holds
 *               the square's rounding and z's (x / sqrt 2 rounded), which erfc would otherwise
 *               amplify 2 a^2 times, and so does the rounding of g - hi; z > 0 takes
 *               2 - erfc(a).
 * Within 6 ulp of the float64 GELU from x = -5 up (11 below, where it is under 1e-6); ggml's
 * is within 2.5 ulp above x = -1 and loses all digits below x = -5, where 1 + erff cancels.
 * erfc(a) is 0 from a = 10 (below 2e-45). NaN stays NaN. The scalar build calls erff (as
 * ggml does). */
#include <math.h>
#include <stdint.h>

#include "qtts_attn_simd.h"
#include "qtts_elu.h"
#include "qtts_ops.h"

#define GELU_INV_SQRT2 0.70710678118654752f
#define GELU_INV_SQRT2_LO 1.2101617e-08f /* 1/sqrt 2 - GELU_INV_SQRT2 */
#define GELU_A_MAX 10.0f
#define GELU_U_MID 0.58333333333f /* (1/6 + 1) / 2: the centre of t's fitted range */
#define GELU_U_SCALE 2.4f         /* 1 / (5/12) */
/* E(w) = erf(z)/z, w = z^2: 2/sqrt(pi) (-1)^n / (n! (2n+1)) */
#define GELU_E0 1.1283791671e+00f
#define GELU_E1 -3.7612638903e-01f
#define GELU_E2 1.1283791671e-01f
#define GELU_E3 -2.6866170645e-02f
#define GELU_E4 5.2239776254e-03f
#define GELU_E5 -8.5483270235e-04f
#define GELU_E6 1.2055332982e-04f
#define GELU_E7 -1.4925650358e-05f
/* g(u), lowest degree first */
#define GELU_G0 -5.585953956e-01f
#define GELU_G1 5.703070710e-01f
#define GELU_G2 1.574721605e-02f
#define GELU_G3 -2.946988936e-02f
#define GELU_G4 -1.062950594e-03f
#define GELU_G5 3.705812034e-03f
#define GELU_G6 -2.267045386e-04f
#define GELU_G7 -5.320486619e-04f
#define GELU_G8 7.310249795e-05f
#define GELU_G9 5.383271671e-05f

/* One vector GELU for both SIMD paths: the operations it needs, per ISA (SEL(CMP(..), a, b)
 * is a where the comparison holds, else b). */
#if defined(__AVX512F__)
#define V __m512
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define FMSUB _mm512_fmsub_ps
#define MUL _mm512_mul_ps
#define ADD _mm512_add_ps
#define SUB _mm512_sub_ps
#define DIV _mm512_div_ps
#define MIN _mm512_min_ps
#define ABS _mm512_abs_ps
#define CMP(a, b, op) _mm512_cmp_ps_mask(a, b, op)
#define SEL(m, a, b) _mm512_mask_blend_ps(m, b, a)
#define EXPV exp16 /* subnormal results kept */
#elif ATTN_AVX2
#define V __m256
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define FMSUB _mm256_fmsub_ps
#define MUL _mm256_mul_ps
#define ADD _mm256_add_ps
#define SUB _mm256_sub_ps
#define DIV _mm256_div_ps
#define MIN _mm256_min_ps
#define ABS(x) _mm256_andnot_ps(SET1(-0.0f), x)
#define CMP(a, b, op) _mm256_cmp_ps(a, b, op)
#define SEL(m, a, b) _mm256_blendv_ps(b, a, m)
#define EXPV exp8 /* flushes below -87 to 0: erfc(a) is below 1e-38 there */
#endif

#if defined(__AVX512F__) || ATTN_AVX2

static inline V gelu_v(V x) {
    const V z = MUL(x, SET1(GELU_INV_SQRT2));
    const V az = ABS(z);
    const V a = MIN(az, SET1(GELU_A_MAX));
    const V w = MUL(z, z);
    V e = FMA(SET1(GELU_E7), w, SET1(GELU_E6));
    e = FMA(e, w, SET1(GELU_E5));
    e = FMA(e, w, SET1(GELU_E4));
    e = FMA(e, w, SET1(GELU_E3));
    e = FMA(e, w, SET1(GELU_E2));
    e = FMA(e, w, SET1(GELU_E1));
    e = FMA(e, w, SET1(GELU_E0));
    const V s_small = FMA(z, e, SET1(1.0f));
    const V t = DIV(SET1(1.0f), FMA(a, SET1(0.5f), SET1(1.0f)));
    const V u = MUL(SUB(t, SET1(GELU_U_MID)), SET1(GELU_U_SCALE));
    V g = FMA(SET1(GELU_G9), u, SET1(GELU_G8));
    g = FMA(g, u, SET1(GELU_G7));
    g = FMA(g, u, SET1(GELU_G6));
    g = FMA(g, u, SET1(GELU_G5));
    g = FMA(g, u, SET1(GELU_G4));
    g = FMA(g, u, SET1(GELU_G3));
    g = FMA(g, u, SET1(GELU_G2));
    g = FMA(g, u, SET1(GELU_G1));
    g = FMA(g, u, SET1(GELU_G0));
    /* a^2 = hi + lo: z's own rounding (x/sqrt 2 = z + dz) counts too, as 2 z dz */
    const V dz = FMA(x, SET1(GELU_INV_SQRT2_LO), FMSUB(x, SET1(GELU_INV_SQRT2), z));
    const V hi = MUL(a, a);
    const V lo = FMA(MUL(z, SET1(2.0f)), dz, FMSUB(a, a, hi));
    /* g - hi rounded, and what the rounding dropped (TwoSum): exp(arg) (1 + err - lo) */
    const V arg = SUB(g, hi);
    const V bv = SUB(arg, g);
    const V err = SUB(SUB(g, SUB(arg, bv)), ADD(hi, bv));
    V c = MUL(MUL(t, EXPV(arg)), ADD(SET1(1.0f), SUB(err, lo)));
    c = SEL(CMP(a, SET1(GELU_A_MAX), _CMP_LT_OQ), c, SET1(0.0f));
    V s = SEL(CMP(z, SET1(0.0f), _CMP_GT_OQ), SUB(SET1(2.0f), c), c);
    s = SEL(CMP(az, SET1(0.5f), _CMP_LT_OQ), s_small, s);
    /* NaN: z is NaN, so is s_small; a = min(NaN, 10) is 10 there: keep NaN */
    s = SEL(CMP(x, x, _CMP_UNORD_Q), x, s);
    return MUL(MUL(x, SET1(0.5f)), s);
}

#endif

#if defined(__AVX512F__)

static void gelu_span(float * y, const float * x, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, gelu_v(_mm512_loadu_ps(x + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, m, gelu_v(_mm512_maskz_loadu_ps(m, x + i)));
    }
}

#elif ATTN_AVX2

static void gelu_span(float * y, const float * x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, gelu_v(_mm256_loadu_ps(x + i)));
    if (i < n) { /* the same lanes for the tail */
        float buf[8] = {0};
        for (int64_t j = i; j < n; j++) buf[j - i] = x[j];
        _mm256_storeu_ps(buf, gelu_v(_mm256_loadu_ps(buf)));
        for (int64_t j = i; j < n; j++) y[j] = buf[j - i];
    }
}

#else

static void gelu_span(float * y, const float * x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = 0.5f * x[i] * (1.0f + erff(x[i] * GELU_INV_SQRT2));
}

#endif

void qtts_gelu_erf_op(struct ggml_tensor * dst, const struct ggml_tensor * a, int ith, int nth,
                      void * userdata) {
    (void)userdata;
    qtts_elementwise(dst, a, ith, nth, gelu_span);
}
