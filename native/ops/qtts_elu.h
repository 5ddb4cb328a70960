/* Internal to libqtts_ops (not part of the cffi binding): the ELU of qtts_elu_op on a span, for
 * the ops that apply it inside a fused node (the same values bit for bit). */
#pragma once

#include <stdint.h>

/* y[i] = ELU(x[i]) for i < n (y == x is fine). */
__attribute__((visibility("hidden"))) void qtts_elu_span(float * y, const float * x, int64_t n);
