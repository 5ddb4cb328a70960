/* Row argmax for the codec encoder's vector quantizer (see qtts_ops.h).
 *
 * ggml's ARGMAX runs on one thread (its n_tasks is 1) with a scalar compare per element, the
 * other thread idle: 16 of them per encode. Here rows are shared out over the
 * threads and each is read twice in vector lanes: its maximum, then the first index holding
 * it. Ties go to the first index, as in the reference's argmin over codebook distances (torch
 * returns the first; ggml's ARGMAX the last, which differs where a codebook holds an entry
 * twice); NaN is never taken; 0 when nothing exceeds -inf. */
#include <math.h>

#include "qtts_ops.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

static float row_max(const float * x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(_mm512_loadu_ps(x + i), vm); /* NaN: vm */
    m = _mm512_reduce_max_ps(vm);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(_mm256_loadu_ps(x + i), vm);
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

void qtts_argmax_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void)userdata;
    const struct ggml_tensor * x = dst->src[0];
    GGML_ASSERT(x->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_I32 && x->nb[0] == sizeof(float));
    const int64_t n = x->ne[0], rows = x->ne[1];
    GGML_ASSERT(dst->ne[0] == rows && ggml_is_contiguous(dst));
    const int64_t r0 = rows * ith / nth, r1 = rows * (ith + 1) / nth;
    int32_t * out = (int32_t *)dst->data;
    for (int64_t r = r0; r < r1; r++) {
        const float * xr = (const float *)((const char *)x->data + r * x->nb[1]);
        const float m = row_max(xr, n);
        int64_t i = 0;
        if (m > -INFINITY) {
            while (xr[i] != m) i++;
        }
        out[r] = (int32_t)i;
    }
}
