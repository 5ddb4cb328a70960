/* The sources of a conv node with fused parts, checked, and its input rows (qtts_conv_srcs.h). */
#include "qtts_conv_srcs.h"

#include <string.h>

#include "qtts_ops.h"
#include "qtts_snake.h"

void qtts_conv_srcs_get(qtts_conv_srcs * s, const struct ggml_tensor * dst, intptr_t ud,
                        int64_t taps) {
    int next = 3;
    s->x = dst->src[0];
    s->bias = dst->src[2];
    s->hist = (ud & QTTS_CONV_HIST) ? dst->src[next++] : NULL;
    s->ea = (ud & QTTS_CONV_SNAKE) ? dst->src[next++] : NULL;
    s->ib = (ud & QTTS_CONV_SNAKE) ? dst->src[next++] : NULL;
    s->res = (ud & QTTS_CONV_RESIDUAL) ? dst->src[next++] : NULL;
    s->d = (int64_t)(ud & QTTS_CONV_DILATION_MASK);
    s->ci = s->x->ne[0];
    s->co = dst->ne[0];
    s->t = dst->ne[1];
    s->n_hist = (taps - 1) * s->d;
    s->ph = s->hist ? s->n_hist : 0;
    const struct ggml_tensor * x = s->x;
    GGML_ASSERT(x->type == GGML_TYPE_F32 && s->bias->type == GGML_TYPE_F32);
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));
    GGML_ASSERT(ggml_nelements(s->bias) == s->co && ggml_is_contiguous(s->bias));
    GGML_ASSERT(s->d >= 1 && x->ne[1] + s->ph == s->t + s->n_hist && x->ne[2] == 1 &&
                x->ne[3] == 1);
    GGML_ASSERT(x->nb[0] == sizeof(float));
    if (s->hist) {
        const struct ggml_tensor * h = s->hist;
        GGML_ASSERT(h->type == GGML_TYPE_F32 && h->ne[0] == s->ci && h->ne[1] == s->n_hist);
        GGML_ASSERT(h->ne[2] == 1 && h->ne[3] == 1 && h->nb[0] == sizeof(float));
    }
    if (s->ea) {
        GGML_ASSERT(s->ea->type == GGML_TYPE_F32 && ggml_nelements(s->ea) == s->ci &&
                    ggml_is_contiguous(s->ea));
        GGML_ASSERT(s->ib->type == GGML_TYPE_F32 && ggml_nelements(s->ib) == s->ci &&
                    ggml_is_contiguous(s->ib));
    }
    if (s->res) {
        const struct ggml_tensor * r = s->res;
        GGML_ASSERT(r->type == GGML_TYPE_F32 && r->ne[0] == s->co && r->ne[1] == s->t);
        GGML_ASSERT(r->ne[2] == 1 && r->ne[3] == 1 && r->nb[0] == sizeof(float));
    }
}

void qtts_conv_rows_of(qtts_conv_rows * r, const qtts_conv_srcs * s) {
    r->hist = s->hist ? (const float *)s->hist->data : NULL;
    r->hs = s->hist ? (int64_t)(s->hist->nb[1] / sizeof(float)) : 0;
    r->ph = s->ph;
    r->x = (const float *)s->x->data;
    r->xs = (int64_t)(s->x->nb[1] / sizeof(float));
    r->n_xp = s->t + s->n_hist;
    r->ea = s->ea ? (const float *)s->ea->data : NULL;
    r->ib = s->ib ? (const float *)s->ib->data : NULL;
    r->ci = s->ci;
}

void qtts_conv_stage_rows(float * st, const qtts_conv_rows * s, int64_t r0, int64_t n) {
    for (int64_t r = 0; r < n; r++) {
        const int64_t R = r0 + r;
        float * o = st + r * s->ci;
        if (R >= s->n_xp) {
            memset(o, 0, (size_t)s->ci * sizeof(float));
            continue;
        }
        const float * src = R < s->ph ? s->hist + R * s->hs : s->x + (R - s->ph) * s->xs;
        if (s->ea) {
            qtts_snake_row(o, src, s->ea, s->ib, s->ci);
        } else {
            memcpy(o, src, (size_t)s->ci * sizeof(float));
        }
    }
}
