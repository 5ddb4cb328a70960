/* Internal to libqtts_ops (not part of the cffi binding): the sources of a conv node with fused
 * history, SnakeBeta and residual (the BF16 and Winograd convs), and their input rows. */
#pragma once

#include <stdint.h>

#include "ggml.h"

/* What qtts_conv1d_tm_bf16_op and the Winograd convs read besides their weight:
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

/* The conv's logical input xp = [history rows | x rows], read row by row. */
typedef struct {
    const float * hist; /* rows 0 .. ph of xp (NULL: none) */
    int64_t hs, ph;
    const float * x;    /* rows ph .. of xp */
    int64_t xs, n_xp;   /* row stride; rows of xp in all (T + n_hist) */
    const float * ea;   /* SnakeBeta (NULL: none) */
    const float * ib;
    int64_t ci;
} qtts_conv_rows;

__attribute__((visibility("hidden"))) void qtts_conv_rows_of(qtts_conv_rows * r,
                                                             const qtts_conv_srcs * s);

/* rows r0 .. r0+n of xp (zero past its end), snaked when there is a snake, into st (row stride
 * ci floats) */
__attribute__((visibility("hidden"))) void qtts_conv_stage_rows(float * st,
                                                                const qtts_conv_rows * s,
                                                                int64_t r0, int64_t n);
