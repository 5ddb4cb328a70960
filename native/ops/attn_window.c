/* Sliding-window causal attention of the decoder's pre-transformer (see qtts_ops.h) in one node:
 * scores, softmax and the product with V for each (query, head).
 *
 * Why its own op: in ggml's nodes a query's keys sit at offsets that depend on where the chunk
 * starts (the carried window, then the chunk's rows), and their SIMD sums group the keys by
 * offset, so a stream decoded in other chunks came out different by rounding, which fast mode's
 * BF16 convs then amplify. Here a query's keys are visited in position order from the first one
 * it sees, every sum in that order: the result depends on positions only, so any chunking of a
 * stream gives the same bits, and so does any thread count (an item is one thread's). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qtts_attn_simd.h"
#include "qtts_ops.h"
#include "qtts_scratch.h"

/* sum_c a[c] * b[c], in one fixed order for a given d (per build) */
static inline float dot(const float * a, const float * b, int64_t d) {
    int64_t c = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    if (d >= 16) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (c = 16; c + 16 <= d; c += 16) {
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc);
        }
        s = _mm512_reduce_add_ps(acc);
    }
#elif ATTN_AVX2
    if (d >= 8) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
        for (c = 8; c + 8 <= d; c += 8) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
        }
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
        s = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
    }
#endif
    for (; c < d; c++) s += a[c] * b[c];
    return s;
}

/* out[c] = sum_i P[i] * V_i[c] / l, i ascending (V_i = v + i * vs) */
static void weighted_sum(float * out, const float * P, int64_t n, const char * v, size_t vs,
                         int64_t d, float l) {
    const float inv = 1.0f / l;
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= d; c += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            const float * vi = (const float *)(v + (size_t)i * vs);
            acc = _mm512_fmadd_ps(_mm512_set1_ps(P[i]), _mm512_loadu_ps(vi + c), acc);
        }
        _mm512_storeu_ps(out + c, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
    }
#elif ATTN_AVX2
    for (; c + 8 <= d; c += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            const float * vi = (const float *)(v + (size_t)i * vs);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(P[i]), _mm256_loadu_ps(vi + c), acc);
        }
        _mm256_storeu_ps(out + c, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
    }
#endif
    for (; c < d; c++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < n; i++) acc = fmaf(P[i], ((const float *)(v + (size_t)i * vs))[c], acc);
        out[c] = acc * inv;
    }
}

void qtts_attn_window_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct ggml_tensor * q = dst->src[0];
    const struct ggml_tensor * k = dst->src[1];
    const struct ggml_tensor * v = dst->src[2];
    const struct ggml_tensor * pos = dst->src[3];
    const int64_t window = (int64_t)(intptr_t)userdata;
    const int64_t d = q->ne[0], H = q->ne[1], T = q->ne[2];
    const int64_t Hkv = k->ne[1], Tk = k->ne[2], n_cache = Tk - T;
    GGML_ASSERT(q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F32 && v->type == GGML_TYPE_F32);
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));
    GGML_ASSERT(dst->ne[0] == d * H && dst->ne[1] == T);
    GGML_ASSERT(q->nb[0] == sizeof(float) && k->nb[0] == sizeof(float) &&
                v->nb[0] == sizeof(float));
    GGML_ASSERT(k->ne[0] == d && v->ne[0] == d && v->ne[1] == Hkv && v->ne[2] == Tk);
    GGML_ASSERT(Hkv > 0 && H % Hkv == 0 && n_cache >= 0 && window >= 1);
    GGML_ASSERT(pos->type == GGML_TYPE_I32 && pos->ne[0] == T && ggml_is_contiguous(pos));
    const int32_t * pp = (const int32_t *)pos->data;
    const int64_t p0 = pp[0];
    const int64_t G = H / Hkv;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t tk16 = (Tk + LANES - 1) / LANES * LANES; /* exp_sum16 pads to lanes */
    float * S = (float *)qtts_scratch_get(QTTS_SCRATCH_ATTN, (size_t)tk16 * sizeof(float));

    const int64_t items = T * H;
    const int64_t i0 = items * ith / nth, i1 = items * (ith + 1) / nth;
    for (int64_t item = i0; item < i1; item++) {
        const int64_t t = item / H, h = item % H, hk = h / G;
        /* key j holds position p0 - n_cache + j; query t (position p0 + t) sees positions
         * max(0, p - window + 1) .. p: keys lo .. hi */
        const int64_t hi = t + n_cache;
        int64_t lo = hi - window + 1;
        if (lo < n_cache - p0) lo = n_cache - p0;
        if (lo < 0) lo = 0;
        float * out = (float *)((char *)dst->data + t * dst->nb[1]) + h * d;
        const int64_t n = hi - lo + 1;
        if (n <= 0) { /* sees no key (cannot happen for positions >= 0): zeros */
            memset(out, 0, (size_t)d * sizeof(float));
            continue;
        }
        const float * qv = (const float *)((const char *)q->data + t * q->nb[2] + h * q->nb[1]);
        const char * kb = (const char *)k->data + hk * k->nb[1] + lo * k->nb[2];
        float m = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            S[i] = dot(qv, (const float *)(kb + i * k->nb[2]), d) * scale;
            m = S[i] > m ? S[i] : m;
        }
        const float l = exp_sum16(S, n, (n + LANES - 1) / LANES * LANES, m);
        weighted_sum(out, S, n, (const char *)v->data + hk * v->nb[1] + lo * v->nb[2],
                     (size_t)v->nb[2], d, l);
    }
}
