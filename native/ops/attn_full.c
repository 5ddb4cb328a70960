/* Causal attention over a whole input for the codec encoder's transformer (see qtts_ops.h).
 *
 * As ggml nodes (per-head copies, two MUL_MATs whose F32 path takes one dot product per output,
 * the masked softmax) the eight layers took a tenth of the encode for a fiftieth of its work
 * (docs/performance.md, Session 22). Here each (head, block of queries) is one work item: the
 * scores are a 1x1 conv of the queries by the head's keys (packed once per head as a conv
 * weight: keys are the output channels), the masked softmax runs in vector lanes, and the
 * output is a 1x1 conv of the probabilities by the values over the keys the block can see, all
 * on qtts_conv1d_tm_op's register tiles. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qtts_attn_simd.h"
#include "qtts_conv_rows.h"
#include "qtts_ops.h"
#include "qtts_scratch.h"

#define QBLOCK 48 /* query rows of a work item (a multiple of every build's tile height) */

/* Key rows of head hk as the weight of a 1x1 conv d -> n_keys: blocks of B keys,
 * w[b][c][i] = k[b*B + i][c], zero past n_keys. */
static void pack_keys(float * w, const struct ggml_tensor * k, int64_t hk, int64_t n_keys,
                      int64_t d, int64_t B) {
    const int64_t nb = (n_keys + B - 1) / B;
    memset(w, 0, (size_t)(nb * B * d) * sizeof(float));
    for (int64_t j = 0; j < n_keys; j++) {
        const float * kr = (const float *)((const char *)k->data + j * k->nb[2] + hk * k->nb[1]);
        float * wb = w + (j / B) * d * B + j % B;
        for (int64_t c = 0; c < d; c++) wb[c * B] = kr[c];
    }
}

/* Value rows of head hk as the weight of a 1x1 conv n_keys -> d: w[b][j][i] = v[j][b*B + i]. */
static void pack_values(float * w, const struct ggml_tensor * v, int64_t hk, int64_t n_keys,
                        int64_t d, int64_t B) {
    const int64_t nb = (d + B - 1) / B;
    memset(w, 0, (size_t)(nb * B * n_keys) * sizeof(float));
    for (int64_t j = 0; j < n_keys; j++) {
        const float * vr = (const float *)((const char *)v->data + j * v->nb[2] + hk * v->nb[1]);
        for (int64_t b = 0; b < nb; b++) {
            const int64_t n = d - b * B < B ? d - b * B : B;
            memcpy(w + (b * n_keys + j) * B, vr + b * B, (size_t)n * sizeof(float));
        }
    }
}

/* Row S[0 .. n) (scores of one query over keys 0 .. n-1) -> probabilities, as ggml's soft_max
 * with a scale: exp(s * scale - max) / sum; S is padded with zeros up to n16. */
static void softmax_row(float * S, int64_t n, int64_t n16, float scale) {
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        S[j] *= scale;
        m = S[j] > m ? S[j] : m;
    }
    const float inv = 1.0f / exp_sum16(S, n, n16, m);
    for (int64_t j = 0; j < n; j++) S[j] *= inv;
}

void qtts_attn_full_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void)userdata;
    const struct ggml_tensor * q = dst->src[0];
    const struct ggml_tensor * k = dst->src[1];
    const struct ggml_tensor * v = dst->src[2];
    const int64_t d = q->ne[0], H = q->ne[1], T = q->ne[2], Hkv = k->ne[1];
    GGML_ASSERT(q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F32 && v->type == GGML_TYPE_F32);
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));
    GGML_ASSERT(dst->ne[0] == d * H && dst->ne[1] == T);
    GGML_ASSERT(q->nb[0] == sizeof(float) && k->nb[0] == sizeof(float) &&
                v->nb[0] == sizeof(float));
    GGML_ASSERT(k->ne[0] == d && k->ne[2] == T && v->ne[0] == d && v->ne[1] == Hkv &&
                v->ne[2] == T);
    GGML_ASSERT(Hkv > 0 && H % Hkv == 0 && q->nb[1] == d * (int64_t)sizeof(float));
    const int64_t G = H / Hkv, B = qtts_conv1d_tm_block();
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t t16 = (T + 15) / 16 * 16, tb = (T + B - 1) / B * B, db = (d + B - 1) / B * B;
    /* scratch: the head's packed keys and values, a block's scores, zeros for the biases */
    float * wk = (float *)qtts_scratch_get(
        QTTS_SCRATCH_ATTN,
        (size_t)(tb * d + db * T + QBLOCK * t16 + (tb > db ? tb : db)) * sizeof(float));
    float * wv = wk + tb * d;
    float * S = wv + db * T;
    float * zeros = S + QBLOCK * t16;
    memset(zeros, 0, (size_t)(tb > db ? tb : db) * sizeof(float));

    const int64_t n_qb = (T + QBLOCK - 1) / QBLOCK, items = H * n_qb;
    const int64_t i0 = items * ith / nth, i1 = items * (ith + 1) / nth;
    const int64_t qs = q->nb[2] / (int64_t)sizeof(float); /* a query row: all heads */
    float * out = (float *)dst->data;
    int64_t packed = -1; /* the kv head whose keys and values wk, wv hold */
    for (int64_t item = i0; item < i1; item++) {
        const int64_t h = item / n_qb, t0 = (item % n_qb) * QBLOCK, hk = h / G;
        const int64_t n = T - t0 < QBLOCK ? T - t0 : QBLOCK, keys = t0 + n; /* causal */
        if (hk != packed) {
            pack_keys(wk, k, hk, T, d, B);
            pack_values(wv, v, hk, T, d, B);
            packed = hk;
        }
        const float * qh = (const float *)q->data + t0 * qs + h * d;
        /* scores of the block's queries over the keys they can see (row stride t16) */
        qtts_conv_rows(S, t16, qh, qs, wk, 0, zeros, d, keys, 1, 1, n);
        for (int64_t i = 0; i < n; i++) {
            float * row = S + i * t16;
            softmax_row(row, t0 + i + 1, keys, scale); /* zeros past the query's position */
        }
        /* the output: the probabilities by the values of the keys the block sees (wv is
         * packed for all T keys: its blocks are T * B floats apart) */
        qtts_conv_rows(out + t0 * d * H + h * d, d * H, S, t16, wv, T * B, zeros, keys, d, 1,
                       1, n);
    }
}
