/* The sources of a BF16 conv node, checked (see qtts_conv_srcs.h). */
#include "qtts_conv_srcs.h"

#include "qtts_ops.h"

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
