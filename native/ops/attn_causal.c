/* Causal GQA attention of a prefill over the talker's KV cache (see qtts_ops.h), fused:
 * scores, softmax and the product with V in one pass per head and block of queries.
 *
 * Why: ggml's path is four nodes per layer (K.Q, softmax over the padded key range, the
 * product with V, the merge of the heads), rounds Q and the probabilities to F16 for its F16
 * products, and scores every key of the padded range, the half a causal mask throws away
 * included. On a cloned voice's ~134-position prefill those nodes were a third of the time.
 *
 * Layout of one work item (a KV head and QB = 16 / G queries, G = query heads per KV head): the
 * 16 SIMD lanes are the item's G x QB query rows, so every step below is a vertical operation
 * across lanes: a score is sum_c K[j][c] * Q^T[c][lanes] (K's rows broadcast, Q transposed once
 * per item), the softmax's max and sum run down the key axis, and the output is
 * O^T[c][lanes] += V^T[c][j] * P[j][lanes], reading the cache's channel-major V as it lies. A
 * thread takes its items head by head and converts that head's K and V rows to F32 once, for
 * all its query blocks (the V rows are a cache length apart: re-reading them per block cost a
 * fifth of the op at a 4096-position cache). Keys go in blocks of KB with a running max and sum
 * (flash style), so the scores stay KB x 16. All sums are F32; F16 values are converted exactly;
 * the exponential is a Cephes-style polynomial (about 1 ulp) scaled by 2^n (scalef: no
 * overflow, gradual underflow to 0 for masked keys). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qtts_f16.h"
#include "qtts_ops.h"
#include "qtts_attn_simd.h"
#include "qtts_scratch.h"

int qtts_attn_causal_fast(void) { return ATTN_SIMD; }

#define KB 128 /* keys per block */

static inline float load_f(const char * row, int f16, int64_t i) {
    return f16 ? ggml_fp16_to_fp32(((const ggml_fp16_t *)row)[i]) : ((const float *)row)[i];
}

/* n values of a cache row (F16 or F32) as F32 */
static void to_f32(const char * row, int f16, int64_t n, float * out) {
    if (!f16) {
        memcpy(out, row, (size_t)n * sizeof(float));
        return;
    }
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    for (; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(out + i, live,
                              _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, row + 2 * i)));
    }
#elif ATTN_AVX2
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i))));
    }
#endif
    for (; i < n; i++) {
        out[i] = load_f(row, 1, i);
    }
}

/* S[j][lanes] = sum_c Kf[j][c] * QT[c][lanes] for the block's nk keys; lanes whose query sits
 * before key j0 + j get -inf. */
static void block_scores(const float * Kf, const float * QT, int64_t d, int64_t nk, int64_t j0,
                         const int32_t * lpos, float * S) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512i vpos = _mm512_loadu_si512(lpos);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (; j + 8 <= nk; j += 8) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
               a7 = a0;
        const float * k0 = Kf + j * d;
        for (int64_t c = 0; c < d; c++) {
            const __m512 qt = _mm512_loadu_ps(QT + c * LANES);
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(k0[c]), qt, a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(k0[d + c]), qt, a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(k0[2 * d + c]), qt, a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(k0[3 * d + c]), qt, a3);
            a4 = _mm512_fmadd_ps(_mm512_set1_ps(k0[4 * d + c]), qt, a4);
            a5 = _mm512_fmadd_ps(_mm512_set1_ps(k0[5 * d + c]), qt, a5);
            a6 = _mm512_fmadd_ps(_mm512_set1_ps(k0[6 * d + c]), qt, a6);
            a7 = _mm512_fmadd_ps(_mm512_set1_ps(k0[7 * d + c]), qt, a7);
        }
        const __m512 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
        for (int i = 0; i < 8; i++) {
            const __mmask16 hidden =
                _mm512_cmplt_epi32_mask(vpos, _mm512_set1_epi32((int32_t)(j0 + j + i)));
            _mm512_storeu_ps(S + (j + i) * LANES, _mm512_mask_mov_ps(acc[i], hidden, ninf));
        }
    }
#elif ATTN_AVX2
    const __m256i vpos0 = _mm256_loadu_si256((const __m256i *)lpos);
    const __m256i vpos1 = _mm256_loadu_si256((const __m256i *)(lpos + 8));
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (; j + 4 <= nk; j += 4) { /* 4 keys x 2 halves: 8 sums, 2 Q loads, 1 broadcast */
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        const float * k0 = Kf + j * d;
        for (int64_t c = 0; c < d; c++) {
            const __m256 q0 = _mm256_loadu_ps(QT + c * LANES);
            const __m256 q1 = _mm256_loadu_ps(QT + c * LANES + 8);
            for (int i = 0; i < 4; i++) {
                const __m256 kc = _mm256_broadcast_ss(k0 + i * d + c);
                a[2 * i] = _mm256_fmadd_ps(kc, q0, a[2 * i]);
                a[2 * i + 1] = _mm256_fmadd_ps(kc, q1, a[2 * i + 1]);
            }
        }
        for (int i = 0; i < 4; i++) {
            const __m256i key = _mm256_set1_epi32((int32_t)(j0 + j + i));
            /* lanes whose position < key: hidden */
            const __m256 h0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(key, vpos0));
            const __m256 h1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(key, vpos1));
            _mm256_storeu_ps(S + (j + i) * LANES, _mm256_blendv_ps(a[2 * i], ninf, h0));
            _mm256_storeu_ps(S + (j + i) * LANES + 8, _mm256_blendv_ps(a[2 * i + 1], ninf, h1));
        }
    }
#endif
    /* the keys left over, and every key of a build without SIMD: fmaf rounds as the vector
     * FMAs do, so a score's bits do not depend on which path computed it (a query's keys
     * move between the two with the block's key count, that is with the other queries) */
    for (; j < nk; j++) {
        float acc[LANES] = {0};
        for (int64_t c = 0; c < d; c++) {
            const float kc = Kf[j * d + c];
            for (int r = 0; r < LANES; r++) {
                acc[r] = fmaf(kc, QT[c * LANES + r], acc[r]);
            }
        }
        for (int r = 0; r < LANES; r++) {
            S[j * LANES + r] = lpos[r] < j0 + j ? -INFINITY : acc[r];
        }
    }
}

/* The running softmax over one block: m, l updated; S becomes P = exp(S - m_new); alpha[lanes]
 * = exp(m_old - m_new), the factor of what was summed before. */
static void block_softmax(float * S, int64_t nk, float * m, float * l, float * alpha) {
#if defined(__AVX512F__)
    __m512 mb = _mm512_loadu_ps(m);
    for (int64_t j = 0; j < nk; j++) {
        mb = _mm512_max_ps(mb, _mm512_loadu_ps(S + j * LANES));
    }
    const __m512 a = exp16(_mm512_sub_ps(_mm512_loadu_ps(m), mb));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; j++) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(S + j * LANES), mb));
        _mm512_storeu_ps(S + j * LANES, p);
        sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), a, sum));
    _mm512_storeu_ps(m, mb);
    _mm512_storeu_ps(alpha, a);
#elif ATTN_AVX2
    for (int h = 0; h < LANES; h += 8) {
        __m256 mb = _mm256_loadu_ps(m + h);
        for (int64_t j = 0; j < nk; j++) {
            mb = _mm256_max_ps(mb, _mm256_loadu_ps(S + j * LANES + h));
        }
        const __m256 a = exp8(_mm256_sub_ps(_mm256_loadu_ps(m + h), mb));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < nk; j++) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(S + j * LANES + h), mb));
            _mm256_storeu_ps(S + j * LANES + h, p);
            sum = _mm256_add_ps(sum, p);
        }
        _mm256_storeu_ps(l + h, _mm256_fmadd_ps(_mm256_loadu_ps(l + h), a, sum));
        _mm256_storeu_ps(m + h, mb);
        _mm256_storeu_ps(alpha + h, a);
    }
#else
    for (int r = 0; r < LANES; r++) {
        float mb = m[r];
        for (int64_t j = 0; j < nk; j++) {
            mb = fmaxf(mb, S[j * LANES + r]);
        }
        const float a = m[r] == -INFINITY ? 0.0f : expf(m[r] - mb);
        float sum = 0.0f;
        for (int64_t j = 0; j < nk; j++) {
            const float p = expf(S[j * LANES + r] - mb);
            S[j * LANES + r] = p;
            sum += p;
        }
        l[r] = l[r] * a + sum;
        m[r] = mb;
        alpha[r] = a;
    }
#endif
}

/* OT[c][lanes] = alpha * OT[c][lanes] + sum_j Vf[c][j] * P[j][lanes] (Vf rows vs apart) */
static void block_output(const float * Vf, int64_t vs, const float * P, const float * alpha,
                         int64_t d, int64_t nk, float * OT) {
    int64_t c = 0;
#if defined(__AVX512F__)
    const __m512 a = _mm512_loadu_ps(alpha);
    for (; c + 8 <= d; c += 8) {
        __m512 o[8];
        for (int i = 0; i < 8; i++) {
            o[i] = _mm512_mul_ps(_mm512_loadu_ps(OT + (c + i) * LANES), a);
        }
        const float * v0 = Vf + c * vs;
        for (int64_t j = 0; j < nk; j++) {
            const __m512 p = _mm512_loadu_ps(P + j * LANES);
            o[0] = _mm512_fmadd_ps(_mm512_set1_ps(v0[j]), p, o[0]);
            o[1] = _mm512_fmadd_ps(_mm512_set1_ps(v0[vs + j]), p, o[1]);
            o[2] = _mm512_fmadd_ps(_mm512_set1_ps(v0[2 * vs + j]), p, o[2]);
            o[3] = _mm512_fmadd_ps(_mm512_set1_ps(v0[3 * vs + j]), p, o[3]);
            o[4] = _mm512_fmadd_ps(_mm512_set1_ps(v0[4 * vs + j]), p, o[4]);
            o[5] = _mm512_fmadd_ps(_mm512_set1_ps(v0[5 * vs + j]), p, o[5]);
            o[6] = _mm512_fmadd_ps(_mm512_set1_ps(v0[6 * vs + j]), p, o[6]);
            o[7] = _mm512_fmadd_ps(_mm512_set1_ps(v0[7 * vs + j]), p, o[7]);
        }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_ps(OT + (c + i) * LANES, o[i]);
        }
    }
#elif ATTN_AVX2
    const __m256 a0 = _mm256_loadu_ps(alpha), a1 = _mm256_loadu_ps(alpha + 8);
    for (; c + 4 <= d; c += 4) { /* 4 channels x 2 halves */
        __m256 o[8];
        for (int i = 0; i < 4; i++) {
            o[2 * i] = _mm256_mul_ps(_mm256_loadu_ps(OT + (c + i) * LANES), a0);
            o[2 * i + 1] = _mm256_mul_ps(_mm256_loadu_ps(OT + (c + i) * LANES + 8), a1);
        }
        const float * v0 = Vf + c * vs;
        for (int64_t j = 0; j < nk; j++) {
            const __m256 p0 = _mm256_loadu_ps(P + j * LANES);
            const __m256 p1 = _mm256_loadu_ps(P + j * LANES + 8);
            for (int i = 0; i < 4; i++) {
                const __m256 vj = _mm256_broadcast_ss(v0 + i * vs + j);
                o[2 * i] = _mm256_fmadd_ps(vj, p0, o[2 * i]);
                o[2 * i + 1] = _mm256_fmadd_ps(vj, p1, o[2 * i + 1]);
            }
        }
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_ps(OT + (c + i) * LANES, o[2 * i]);
            _mm256_storeu_ps(OT + (c + i) * LANES + 8, o[2 * i + 1]);
        }
    }
#endif
    for (; c < d; c++) {
        float o[LANES];
        for (int r = 0; r < LANES; r++) {
            o[r] = OT[c * LANES + r] * alpha[r];
        }
        for (int64_t j = 0; j < nk; j++) {
            const float vj = Vf[c * vs + j];
            for (int r = 0; r < LANES; r++) {
                o[r] = fmaf(vj, P[j * LANES + r], o[r]);
            }
        }
        memcpy(OT + c * LANES, o, sizeof(o));
    }
}

/* A lane with no query: past the last one, or past G x QB where G does not divide the lanes
 * (its r / QB would name the next KV group's head, and past the last query, memory past q and
 * the output). */
static inline int spare(int r, int64_t t, int64_t T, int64_t live) {
    return t >= T || r >= live;
}

void qtts_attn_causal_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void)userdata;
    const struct ggml_tensor * q = dst->src[0];
    const struct ggml_tensor * k = dst->src[1];
    const struct ggml_tensor * v = dst->src[2];
    const struct ggml_tensor * pos = dst->src[3];
    const int64_t d = q->ne[0], H = q->ne[1], T = q->ne[2];
    const int64_t Hkv = k->ne[0] / d, G = H / Hkv, QB = LANES / G;
    const int64_t n_kv = k->ne[1];
    const int fk = k->type == GGML_TYPE_F16, fv = v->type == GGML_TYPE_F16;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t n_items = (T + QB - 1) / QB * Hkv;

    /* keys any query reads: the K and V rows of a KV head are converted to F32 once per thread
     * (items are split head-major, in contiguous ranges) and kept for its query blocks */
    int64_t n_keys = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t p = (int64_t)((const int32_t *)pos->data)[t] + 1;
        n_keys = p > n_keys ? p : n_keys;
    }
    n_keys = n_keys < n_kv ? n_keys : n_kv;
    float * QT = (float *)qtts_scratch_get(
        QTTS_SCRATCH_ATTN, (size_t)(2 * d * LANES + KB * LANES + 2 * n_keys * d) * sizeof(float));
    float * OT = QT + d * LANES;
    float * S = OT + d * LANES;
    float * Kf = S + KB * LANES; /* [n_keys][d] */
    float * Vf = Kf + n_keys * d; /* [d][n_keys] */
    const int64_t n_qb = (T + QB - 1) / QB;
    const int64_t i0 = n_items * ith / nth, i1 = n_items * (ith + 1) / nth;
    int64_t have_hk = -1, have = 0; /* the head converted, and how many of its keys */

    for (int64_t item = i0; item < i1; item++) {
        const int64_t hk = item / n_qb, t0 = item % n_qb * QB;
        int32_t lpos[LANES];
        int64_t jmax = 0;
        for (int r = 0; r < LANES; r++) {
            const int64_t t = t0 + r % QB;
            lpos[r] = spare(r, t, T, G * QB) ? 0 : ((const int32_t *)pos->data)[t]; /* key 0 */
            jmax = lpos[r] + 1 > jmax ? lpos[r] + 1 : jmax;
        }
        jmax = jmax < n_keys ? jmax : n_keys;
        if (hk != have_hk) {
            have_hk = hk;
            have = 0;
        }
        if (jmax > have) {
            for (int64_t j = have; j < jmax; j++) {
                to_f32((const char *)k->data + j * k->nb[1] + hk * d * (fk ? 2 : 4), fk, d,
                       Kf + j * d);
            }
            for (int64_t c = 0; c < d; c++) {
                to_f32((const char *)v->data + (hk * d + c) * v->nb[1] + have * (fv ? 2 : 4), fv,
                       jmax - have, Vf + c * n_keys + have);
            }
            have = jmax;
        }
        for (int r = 0; r < LANES; r++) {
            const int64_t t = t0 + r % QB, h = hk * G + r / QB;
            if (spare(r, t, T, G * QB)) {
                for (int64_t c = 0; c < d; c++) QT[c * LANES + r] = 0.0f;
                continue;
            }
            const float * qr = (const float *)((const char *)q->data + t * q->nb[2] +
                                               h * q->nb[1]);
            for (int64_t c = 0; c < d; c++) {
                QT[c * LANES + r] = qr[c] * scale;
            }
        }
        float m[LANES], l[LANES], alpha[LANES];
        for (int r = 0; r < LANES; r++) {
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        memset(OT, 0, (size_t)(d * LANES) * sizeof(float));
        for (int64_t j0 = 0; j0 < jmax; j0 += KB) {
            const int64_t nk = jmax - j0 < KB ? jmax - j0 : KB;
            block_scores(Kf + j0 * d, QT, d, nk, j0, lpos, S);
            block_softmax(S, nk, m, l, alpha);
            block_output(Vf + j0, n_keys, S, alpha, d, nk, OT);
        }
        for (int r = 0; r < LANES; r++) {
            const int64_t t = t0 + r % QB, h = hk * G + r / QB;
            if (spare(r, t, T, G * QB)) {
                continue;
            }
            float * out = (float *)((char *)dst->data + t * dst->nb[1]) + h * d;
            const float inv = 1.0f / l[r];
            for (int64_t c = 0; c < d; c++) {
                out[c] = OT[c * LANES + r] * inv;
            }
        }
    }
}

/* ---- qtts_attn_step_op: the attention of decoding steps, K/V writes included ----------------
 *
 * Why: a step's query is one row, and ggml's path is six nodes per session and layer (two
 * set_rows, K.Q, softmax, the product with V, the merge), each tiny and each with its own
 * thread barrier and F16 rounding of Q and the probabilities; with several sessions in one
 * step graph those nodes were a third of the step. Here one node per layer does every
 * session: a (session, KV head) item writes its new K/V rows into the session's cache and
 * attends with its G query heads over rows 0 .. p. An item is computed by one thread in a fixed
 * order, so a session's result does not depend on the other sessions or the thread count.
 *
 * Sums run in 16 lanes (lane l takes the elements l, l + 16, ...) folded by halves at the end:
 * the AVX-512, AVX2 and portable paths add in that same order.
 *
 * On AVX-512 with an F16 cache and head sizes a multiple of 16 (the released models), the
 * cache rows are converted as they are read and eight sums run at once (eight keys' scores,
 * eight channels' outputs), folded together by one shuffle network in the same order: one sum
 * at a time waited on its own FMA chain and fold, and the F32 copies of K and V went through
 * the cache, which at long contexts made the op a step's largest cost. */

/* F32 -> the cache's type, as ggml's CPY / SET_ROWS write it (qtts_f16.h) */
static void store_row(char * dst, const float * src, int64_t n, int f16) {
    if (f16) {
        qtts_f16_row((ggml_fp16_t *)dst, src, n);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* one value into a channel-major V row */
static inline void store_one(char * dst, float x, int f16) {
    if (f16) {
        *(ggml_fp16_t *)dst = qtts_f16(x);
    } else {
        *(float *)dst = x;
    }
}

/* n values of a cache row as F32, then zeros up to the next multiple of 16 */
static void to_f32_pad16(const char * row, int f16, int64_t n, float * out) {
    const int64_t n16 = (n + LANES - 1) / LANES * LANES;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (f16) {
        for (int64_t i = 0; i < n16; i += 16) {
            const __mmask16 live =
                n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, row + 2 * i)));
        }
        return;
    }
#endif
    to_f32(row, f16, n, out);
    for (int64_t i = n; i < n16; i++) out[i] = 0.0f;
}

/* sum_i a[i] * b[i] in 16 lanes; n a multiple of 16 (the caller pads with zeros) */
static float dot16(const float * a, const float * b, int64_t n) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    }
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
#elif ATTN_AVX2
    __m256 lo = _mm256_setzero_ps(), hi = lo;
    for (int64_t i = 0; i < n; i += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
    }
    __m256 h = _mm256_add_ps(lo, hi);
#endif
#if defined(__AVX512F__) || ATTN_AVX2
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
#else
    float acc[LANES] = {0};
    for (int64_t i = 0; i < n; i += LANES) {
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    }
    return fold16(acc);
#endif
}

/* column t's new K and V rows of KV head hk into its session's cache at position p */
static void write_rows(const struct ggml_tensor * kn, const struct ggml_tensor * vn, int64_t t,
                       int64_t hk, int64_t d, int64_t p, char * kc, int64_t k_nb1, char * vc,
                       int64_t v_nb1, int f16) {
    const int64_t es = f16 ? 2 : 4;
    const float * kr = (const float *)((const char *)kn->data + t * kn->nb[1]) + hk * d;
    const float * vr = (const float *)((const char *)vn->data + t * vn->nb[1]) + hk * d;
    store_row(kc + p * k_nb1 + hk * d * es, kr, d, f16);
    for (int64_t ch = 0; ch < d; ch++) {
        store_one(vc + (hk * d + ch) * v_nb1 + p * es, vr[ch], f16);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define STEP_FAST 1
#ifndef STEP_PF_ROWS
#define STEP_PF_ROWS 24
#endif
/* the 16-lane sums of a[0..7], each folded by halves as dot16 folds one: (l, l + 8), then
 * (l, l + 4), (l, l + 2), (0, 1); out[i] = the sum of a[i] */
static inline void fold8x16(const __m512 * a, float * out) {
    __m512 s[4], t[2];
    for (int i = 0; i < 4; i++) { /* [a_2i + hi 8 | a_2i+1 + hi 8] */
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    }
    for (int i = 0; i < 2; i++) { /* 128-bit block b: a_4i+b's l + l + 4 */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
    }
    /* block b: [a_b: 0 + 2, 1 + 3 | a_b+4: 0 + 2, 1 + 3] */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x44),
                                   _mm512_shuffle_ps(t[0], t[1], 0xEE));
    const __m512 w = _mm512_add_ps(u, _mm512_movehdup_ps(u)); /* a_b at 4b, a_b+4 at 4b + 2 */
    const __m512i order = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 10, 6, 2, 12, 8, 4, 0);
    _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, w)));
}

static inline __m512 f16x16(const char * p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* A query row's attention for one KV head over rows 0 .. n - 1 of an F16 cache (k: row j at
 * k + j * k_nb1, the head's d channels; v: its channel c at v + c * v_nb1), d a multiple of 16.
 * Q: [G][d] scaled queries; P: [G][cap] scratch; out: [G][d]. The eight sums of a block are
 * 8 / GB keys (channels) x GB heads, so each converted K (V) vector serves GB heads. K's rows,
 * a cache row apart, are prefetched STEP_PF_ROWS ahead, and V's lines go into L2 while the
 * scores read K (as many lines per key row as K's), so the products with V find them there. */
static inline __attribute__((always_inline)) void step_head_f16(
        const char * k, int64_t k_nb1, const char * v, int64_t v_nb1, int64_t n, int64_t d,
        int64_t G, const float * Q, float * P, int64_t cap, float * out, const int GB) {
    const int R = 8 / GB;
    const int64_t n16 = (n + LANES - 1) / LANES * LANES, v_row = (2 * n + 63) / 64 * 64;
    int64_t vp_c = 0, vp_b = 0;
    for (int64_t j = 0; j < n; j += R) {
        for (int r = 0; r < R && j + r + STEP_PF_ROWS < n; r++) {
            const char * ahead = k + (j + r + STEP_PF_ROWS) * k_nb1;
            for (int64_t b = 0; b < 2 * d; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
        }
        for (int64_t b = 0; b < R * 2 * d && vp_c < d; b += 64) {
            _mm_prefetch(v + vp_c * v_nb1 + vp_b, _MM_HINT_T1);
            vp_b += 64;
            if (vp_b >= v_row) {
                vp_b = 0;
                vp_c++;
            }
        }
        const char * kr[8];
        for (int r = 0; r < R; r++) { /* past the last row: the last row again, dropped */
            kr[r] = k + (j + r < n ? j + r : n - 1) * k_nb1;
        }
        for (int64_t h = 0; h < G; h += GB) {
            __m512 a[8];
            for (int r = 0; r < 8; r++) a[r] = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i += 16) {
                for (int r = 0; r < R; r++) {
                    const __m512 kv = f16x16(kr[r] + 2 * i);
                    for (int g = 0; g < GB; g++) {
                        a[r * GB + g] = _mm512_fmadd_ps(
                            kv, _mm512_loadu_ps(Q + (h + g) * d + i), a[r * GB + g]);
                    }
                }
            }
            float s8[8];
            fold8x16(a, s8);
            for (int r = 0; r < R && j + r < n; r++) {
                for (int g = 0; g < GB; g++) P[(h + g) * cap + j + r] = s8[r * GB + g];
            }
        }
    }
    for (int64_t h = 0; h < G; h += GB) {
        float inv[8];
        for (int g = 0; g < GB; g++) {
            float * Ph = P + (h + g) * cap;
            float m = -INFINITY;
            for (int64_t j = 0; j < n; j++) m = Ph[j] > m ? Ph[j] : m;
            inv[g] = 1.0f / exp_sum16(Ph, n, n16, m);
        }
        for (int64_t c = 0; c < d; c += R) {
            __m512 a[8];
            for (int r = 0; r < 8; r++) a[r] = _mm512_setzero_ps();
            for (int64_t i = 0; i < n16; i += 16) {
                const __mmask16 live =
                    n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
                for (int r = 0; r < R; r++) {
                    const __m512 vv = _mm512_cvtph_ps(
                        _mm256_maskz_loadu_epi16(live, v + (c + r) * v_nb1 + 2 * i));
                    for (int g = 0; g < GB; g++) {
                        a[r * GB + g] = _mm512_fmadd_ps(
                            vv, _mm512_loadu_ps(P + (h + g) * cap + i), a[r * GB + g]);
                    }
                }
            }
            float s8[8];
            fold8x16(a, s8);
            for (int r = 0; r < R; r++) {
                for (int g = 0; g < GB; g++) out[(h + g) * d + c + r] = s8[r * GB + g] * inv[g];
            }
        }
    }
}

static void step_head(const char * k, int64_t k_nb1, const char * v, int64_t v_nb1, int64_t n,
                      int64_t d, int64_t G, const float * Q, float * P, int64_t cap,
                      float * out) {
    if (G % 4 == 0) {
        step_head_f16(k, k_nb1, v, v_nb1, n, d, G, Q, P, cap, out, 4);
    } else if (G % 2 == 0) {
        step_head_f16(k, k_nb1, v, v_nb1, n, d, G, Q, P, cap, out, 2);
    } else {
        step_head_f16(k, k_nb1, v, v_nb1, n, d, G, Q, P, cap, out, 1);
    }
}
#else
#define STEP_FAST 0
#endif

void qtts_attn_step_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct ggml_tensor * q = dst->src[0];
    const struct ggml_tensor * kn = dst->src[1];
    const struct ggml_tensor * vn = dst->src[2];
    const struct ggml_tensor * pos = dst->src[3];
    const int64_t * args = (const int64_t *)userdata;
    const int64_t n_sess = args[0], per = args[1], f16 = args[2];
    const int64_t d = q->ne[0], H = q->ne[1];
    const int64_t Hkv = kn->ne[0] / d, G = H / Hkv, es = f16 ? 2 : 4;
    const float scale = 1.0f / sqrtf((float)d);
    int64_t max_ctx = 0;
    for (int64_t s = 0; s < n_sess; s++) {
        const int64_t n_ctx = args[3 + 5 * s + 4];
        max_ctx = n_ctx > max_ctx ? n_ctx : max_ctx;
    }
    const int64_t cap = (max_ctx + LANES - 1) / LANES * LANES, d16 = (d + LANES - 1) / LANES * LANES;
    const int64_t n_items = n_sess * Hkv;
    const int64_t i0 = n_items * ith / nth, i1 = n_items * (ith + 1) / nth;
    float * Kf = (float *)qtts_scratch_get(
        QTTS_SCRATCH_ATTN, (size_t)(cap * d16 + d * cap + G * cap + G * d16) * sizeof(float));
    float * Vf = Kf + cap * d16; /* [d][cap]: a channel's positions */
    float * P = Vf + d * cap;    /* [G][cap] */
    float * Q = P + G * cap;     /* [d16]; the fast path's [G][d] */
    for (int64_t item = i0; item < i1; item++) {
        const int64_t s = item / Hkv, hk = item % Hkv;
        const int64_t * c = args + 3 + 5 * s;
        char * kc = (char *)(intptr_t)c[0];
        char * vc = (char *)(intptr_t)c[2];
        const int64_t k_nb1 = c[1], v_nb1 = c[3], n_ctx = c[4];
        for (int64_t t = s * per; t < (s + 1) * per; t++) {
            const int64_t p = ((const int32_t *)pos->data)[t];
            float * out = (float *)((char *)dst->data + t * dst->nb[1]) + hk * G * d;
            if (p < 0 || p >= n_ctx) { /* the wrapper's callers never upload one */
                memset(out, 0, (size_t)(G * d) * sizeof(float));
                continue;
            }
            write_rows(kn, vn, t, hk, d, p, kc, k_nb1, vc, v_nb1, (int)f16);
            const int64_t n = p + 1, n16 = (n + LANES - 1) / LANES * LANES;
#if STEP_FAST
            if (f16 && d % LANES == 0) {
                for (int64_t g = 0; g < G; g++) {
                    const float * qr = (const float *)((const char *)q->data + t * q->nb[2] +
                                                       (hk * G + g) * q->nb[1]);
                    for (int64_t i = 0; i < d; i++) Q[g * d + i] = qr[i] * scale;
                }
                step_head(kc + hk * d * es, k_nb1, vc + hk * d * v_nb1, v_nb1, n, d, G, Q, P, cap,
                          out);
                continue;
            }
#endif
            for (int64_t j = 0; j < n; j++) {
                to_f32_pad16(kc + j * k_nb1 + hk * d * es, (int)f16, d, Kf + j * d16);
            }
            for (int64_t ch = 0; ch < d; ch++) {
                to_f32_pad16(vc + (hk * d + ch) * v_nb1, (int)f16, n, Vf + ch * cap);
            }
            for (int64_t g = 0; g < G; g++) {
                const float * qr = (const float *)((const char *)q->data + t * q->nb[2] +
                                                   (hk * G + g) * q->nb[1]);
                for (int64_t i = 0; i < d16; i++) Q[i] = i < d ? qr[i] * scale : 0.0f;
                float * Pg = P + g * cap;
                float m = -INFINITY;
                for (int64_t j = 0; j < n; j++) {
                    Pg[j] = dot16(Kf + j * d16, Q, d16);
                    m = Pg[j] > m ? Pg[j] : m;
                }
                const float inv = 1.0f / exp_sum16(Pg, n, n16, m);
                float * o = out + g * d;
                for (int64_t ch = 0; ch < d; ch++) {
                    o[ch] = dot16(Vf + ch * cap, Pg, n16) * inv;
                }
            }
        }
    }
}
