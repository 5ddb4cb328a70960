/* Internal to libqtts_ops (not part of the cffi binding): the sources of a BF16 conv node. */
#pragma once

#include <stdint.h>

#include "ggml.h"

/* What qtts_conv1d_tm_bf16_op and qtts_conv1d_wino_bf16_op read besides their weight:
 * src[0] x, src[2] bias, then (by the userdata flags, in this order) hist, exp_alpha + inv_beta,
 * residual; NULL where a flag is off. */
typedef struct {
    const struct ggml_tensor * x;
    const struct ggml_tensor * bias;
    const struct ggml_tensor * hist;
    const struct ggml_tensor * ea;
    const struct ggml_tensor * ib;
    const struct ggml_tensor * res;
    int64_t d;      /* dilation */
    int64_t ci;     /* input channels */
    int64_t co;     /* output channels */
    int64_t t;      /* output rows */
    int64_t n_hist; /* history rows the conv reads: (K - 1) * d */
    int64_t ph;     /* rows of xp that come from hist (0 without one) */
} qtts_conv_srcs;

/* Fill s from the node and its userdata for a conv of `taps` taps, checking every shape and
 * type rule of qtts_ops.h (GGML_ASSERT: the Python wrappers check the same first). */
__attribute__((visibility("hidden"))) void qtts_conv_srcs_get(qtts_conv_srcs * s,
                                                              const struct ggml_tensor * dst,
                                                              intptr_t ud, int64_t taps);
