/* Fused SnakeBeta for the time-major decoder layout (see qtts_ops.h).
 *
 *   y = x + inv_beta[c] * sin(exp_alpha[c] * x)^2
 *
 * sin^2 has period pi, so the argument is reduced modulo pi only (no quadrant/sign logic):
 *   z = ea * x computed exactly as zh + zl (FMA), n = round(zh / pi),
 *   r = ((zh - n*P1) - n*P2 - n*P3) + zl  in [-pi/2, pi/2] (+ a little),
 *   sin(r) = r + r^3 * Q(r^2)  (odd minimax polynomial, relative error 3.5e-11 on [0, 1.62]),
 * then y = fma(inv_beta, s*s, x). Error about 1-2 ulp of sin^2 for |z| <= QTTS_SNAKE_FAST_MAX;
 * lanes beyond it (and the scalar build) use double-precision libm sin of the exact product.
 */
#include <math.h>
#include <stdint.h>

#include "qtts_ops.h"
#include "qtts_snake.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define SNK_INV_PI 0.318309886f
#define SNK_P1 3.141592741e+00f
#define SNK_P2 -8.742277657e-08f
#define SNK_P3 -3.552713679e-15f
#define SNK_Q0 -1.666666716e-01f
#define SNK_Q1 8.333330043e-03f
#define SNK_Q2 -1.984078554e-04f
#define SNK_Q3 2.752115961e-06f
#define SNK_Q4 -2.381510456e-08f

int qtts_ops_isa(void) {
#if defined(__AVX512F__)
    return QTTS_ISA_AVX512;
#elif defined(__AVX2__) && defined(__FMA__)
    return QTTS_ISA_AVX2;
#else
    return QTTS_ISA_SCALAR;
#endif
}

/* The reference formula in double: used by the scalar build and for out-of-range lanes. */
static inline float snake_scalar(float x, float ea, float ib) {
    double s = sin((double)ea * (double)x);
    return (float)((double)x + (double)ib * s * s);
}

#if defined(__AVX512F__)

static inline __m512 snake_v16(__m512 x, __m512 ea, __m512 ib, __mmask16 * big) {
    const __m512 zh = _mm512_mul_ps(ea, x);
    const __m512 zl = _mm512_fmsub_ps(ea, x, zh);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(zh, _mm512_set1_ps(SNK_INV_PI)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(SNK_P1), zh);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(SNK_P2), r);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(SNK_P3), r);
    r = _mm512_add_ps(r, zl);
    const __m512 r2 = _mm512_mul_ps(r, r);
    __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(SNK_Q4), r2, _mm512_set1_ps(SNK_Q3));
    q = _mm512_fmadd_ps(q, r2, _mm512_set1_ps(SNK_Q2));
    q = _mm512_fmadd_ps(q, r2, _mm512_set1_ps(SNK_Q1));
    q = _mm512_fmadd_ps(q, r2, _mm512_set1_ps(SNK_Q0));
    const __m512 s = _mm512_fmadd_ps(_mm512_mul_ps(r, r2), q, r);
    *big = _mm512_cmp_ps_mask(_mm512_abs_ps(zh), _mm512_set1_ps((float)QTTS_SNAKE_FAST_MAX),
                              _CMP_GT_OQ);
    return _mm512_fmadd_ps(ib, _mm512_mul_ps(s, s), x);
}

/* Redo the lanes flagged by `big` with libm (x taken from the register: y may alias x). */
static void snake_fix(float * y, __m512 xv, const float * ea, const float * ib, unsigned big) {
    float xs[16];
    _mm512_storeu_ps(xs, xv);
    for (int i = 0; i < 16; i++) {
        if (big & (1u << i)) y[i] = snake_scalar(xs[i], ea[i], ib[i]);
    }
}

void qtts_snake_row(float * y, const float * x, const float * ea, const float * ib, int64_t C) {
    int64_t c = 0;
    for (; c + 16 <= C; c += 16) {
        __mmask16 big;
        const __m512 xv = _mm512_loadu_ps(x + c);
        const __m512 v = snake_v16(xv, _mm512_loadu_ps(ea + c), _mm512_loadu_ps(ib + c), &big);
        _mm512_storeu_ps(y + c, v);
        if (big) snake_fix(y + c, xv, ea + c, ib + c, big);
    }
    if (c < C) {
        const __mmask16 m = (__mmask16)((1u << (C - c)) - 1u);
        __mmask16 big;
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + c);
        const __m512 v = snake_v16(xv, _mm512_maskz_loadu_ps(m, ea + c),
                                   _mm512_maskz_loadu_ps(m, ib + c), &big);
        _mm512_mask_storeu_ps(y + c, m, v);
        big &= m;
        if (big) snake_fix(y + c, xv, ea + c, ib + c, big);
    }
}

#elif defined(__AVX2__) && defined(__FMA__)

static inline __m256 snake_v8(__m256 x, __m256 ea, __m256 ib, int * big) {
    const __m256 zh = _mm256_mul_ps(ea, x);
    const __m256 zl = _mm256_fmsub_ps(ea, x, zh);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(zh, _mm256_set1_ps(SNK_INV_PI)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(SNK_P1), zh);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(SNK_P2), r);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(SNK_P3), r);
    r = _mm256_add_ps(r, zl);
    const __m256 r2 = _mm256_mul_ps(r, r);
    __m256 q = _mm256_fmadd_ps(_mm256_set1_ps(SNK_Q4), r2, _mm256_set1_ps(SNK_Q3));
    q = _mm256_fmadd_ps(q, r2, _mm256_set1_ps(SNK_Q2));
    q = _mm256_fmadd_ps(q, r2, _mm256_set1_ps(SNK_Q1));
    q = _mm256_fmadd_ps(q, r2, _mm256_set1_ps(SNK_Q0));
    const __m256 s = _mm256_fmadd_ps(_mm256_mul_ps(r, r2), q, r);
    const __m256 absz = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), zh);
    *big = _mm256_movemask_ps(
        _mm256_cmp_ps(absz, _mm256_set1_ps((float)QTTS_SNAKE_FAST_MAX), _CMP_GT_OQ));
    return _mm256_fmadd_ps(ib, _mm256_mul_ps(s, s), x);
}

/* Redo the lanes flagged by `big` with libm (x taken from the register: y may alias x). */
static void snake_fix(float * y, __m256 xv, const float * ea, const float * ib, unsigned big) {
    float xs[8];
    _mm256_storeu_ps(xs, xv);
    for (int i = 0; i < 8; i++) {
        if (big & (1u << i)) y[i] = snake_scalar(xs[i], ea[i], ib[i]);
    }
}

void qtts_snake_row(float * y, const float * x, const float * ea, const float * ib, int64_t C) {
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {
        int big;
        const __m256 xv = _mm256_loadu_ps(x + c);
        const __m256 v = snake_v8(xv, _mm256_loadu_ps(ea + c), _mm256_loadu_ps(ib + c), &big);
        _mm256_storeu_ps(y + c, v);
        if (big) snake_fix(y + c, xv, ea + c, ib + c, big);
    }
    if (c < C) {
        const int rem = (int)(C - c);
        const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), idx);
        int big;
        const __m256 xv = _mm256_maskload_ps(x + c, m);
        const __m256 v = snake_v8(xv, _mm256_maskload_ps(ea + c, m), _mm256_maskload_ps(ib + c, m),
                                  &big);
        _mm256_maskstore_ps(y + c, m, v);
        big &= (1 << rem) - 1;
        if (big) snake_fix(y + c, xv, ea + c, ib + c, (unsigned)big);
    }
}

#else

void qtts_snake_row(float * y, const float * x, const float * ea, const float * ib, int64_t C) {
    for (int64_t c = 0; c < C; c++) y[c] = snake_scalar(x[c], ea[c], ib[c]);
}

#endif

void qtts_snake_beta_op(struct ggml_tensor * dst, const struct ggml_tensor * a,
                        const struct ggml_tensor * b, const struct ggml_tensor * c,
                        int ith, int nth, void * userdata) {
    (void)userdata;
    GGML_ASSERT(a->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32);
    GGML_ASSERT(b->type == GGML_TYPE_F32 && c->type == GGML_TYPE_F32);
    GGML_ASSERT(ggml_is_contiguous(a) && ggml_is_contiguous(dst));
    GGML_ASSERT(ggml_is_contiguous(b) && ggml_is_contiguous(c));
    const int64_t C = a->ne[0];
    GGML_ASSERT(ggml_nelements(b) == C && ggml_nelements(c) == C);
    GGML_ASSERT(ggml_nelements(dst) == ggml_nelements(a));

    const int64_t rows = ggml_nrows(a);
    const int64_t per = (rows + nth - 1) / nth;
    const int64_t r0 = per * ith;
    const int64_t r1 = r0 + per < rows ? r0 + per : rows;

    const float * x = (const float *)a->data;
    const float * ea = (const float *)b->data;
    const float * ib = (const float *)c->data;
    float * y = (float *)dst->data;
    for (int64_t r = r0; r < r1; r++) qtts_snake_row(y + r * C, x + r * C, ea, ib, C);
}
