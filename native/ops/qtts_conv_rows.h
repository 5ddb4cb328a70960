/* Internal to libqtts_ops (not part of the cffi binding): the direct F32 conv of
 * qtts_conv1d_tm_op over rows in memory, for the ops that run it inside a fused node. */
#pragma once

#include <stdint.h>

/* y rows 0 .. n-1 (row stride ys) of a conv over xp (row stride xs, its (K-1)*d history rows
 * in front): y[t, o] = bias[o] + sum_k sum_c W[k, c, o] xp[t + k d, c], W packed as for
 * qtts_conv1d_tm_op (wbs: floats from one output block to the next, 0 for K * Ci * B: a
 * weight packed for more input channels than Ci is read in its first Ci), every output
 * block, the tiles and summation order of that op (with K = 1: c ascending, one sum, whatever
 * the chunking). On the calling thread. */
__attribute__((visibility("hidden"))) void qtts_conv_rows(float * y, int64_t ys, const float * xp,
                                                          int64_t xs, const float * w,
                                                          int64_t wbs, const float * bias,
                                                          int64_t Ci, int64_t O, int K,
                                                          int64_t d, int64_t n);
