/* Internal to libqtts_ops (not part of the cffi binding): the ELU of qtts_elu_op on a span, for
 * the ops that apply it inside a fused node (the same values bit for bit), and how the
 * element-wise ops share a tensor out. */
#pragma once

#include <stdint.h>

#include "ggml.h"

/* An element-wise op's node: y = f(x) over a contiguous F32 tensor, each thread one stretch of
 * whole cache lines (span(y, x, n) computes f). */
static inline void qtts_elementwise(struct ggml_tensor * dst, const struct ggml_tensor * a,
                                    int ith, int nth,
                                    void (*span)(float *, const float *, int64_t)) {
    GGML_ASSERT(a->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32);
    GGML_ASSERT(ggml_is_contiguous(a) && ggml_is_contiguous(dst));
    const int64_t n = ggml_nelements(a);
    GGML_ASSERT(ggml_nelements(dst) == n);
    const int64_t per = ((n + nth - 1) / nth + 15) / 16 * 16;
    const int64_t i0 = per * ith;
    const int64_t i1 = i0 + per < n ? i0 + per : n;
    if (i0 < i1) span((float *)dst->data + i0, (const float *)a->data + i0, i1 - i0);
}

/* y[i] = ELU(x[i]) for i < n (y == x is fine). */
__attribute__((visibility("hidden"))) void qtts_elu_span(float * y, const float * x, int64_t n);
