/* Internal to libqtts_ops (not part of the cffi binding): one row of SnakeBeta, for ops that
 * apply it on the fly (the BF16 conv applies it while converting its input). */
#pragma once

#include <stdint.h>

/* y[c] = x[c] + ib[c] * sin(ea[c] * x[c])^2 for c < C; the same values as qtts_snake_beta_op.
 * y may alias x. */
__attribute__((visibility("hidden"))) void qtts_snake_row(float * y, const float * x,
                                                          const float * ea, const float * ib,
                                                          int64_t C);
