/* The transposed V write of a prefill (see qtts_ops.h): a block of new V rows, position-major
 * F32 [C, n], into the talker cache's channel-major V (one row of n_ctx positions per channel),
 * converted to the cache's type.
 *
 * Why: ggml's CPY through a transposed view converts and stores one element per step with a
 * stride of the cache row between neighbours: ~4.5 ns per element, ~18 ms of a cloned voice's
 * 134-position prefill at 0.6B. Here a thread takes 16 channels at a time and walks the
 * positions: one 64-byte load of a position's 16 channels, one conversion, 16 stores that each
 * continue a channel row, so the rows fill sequentially.
 *
 * The conversion is ggml's own: F32 -> F16 rounds to nearest even (F16C / AVX-512 here, ggml's
 * converter in the portable build), so the cache holds the bits ggml's CPY would write. */
#include <stdint.h>
#include <string.h>

#include "qtts_f16.h"
#include "qtts_ops.h"

void qtts_kv_write_transposed_op(struct ggml_tensor * dst, const struct ggml_tensor * a,
                                 const struct ggml_tensor * b, int ith, int nth, void * userdata) {
    (void)a;
    (void)userdata;
    const int64_t n = dst->ne[0], C = dst->ne[1];
    const int f16 = dst->type == GGML_TYPE_F16;
    const int64_t n_blocks = (C + 15) / 16;
    const int64_t k0 = n_blocks * ith / nth, k1 = n_blocks * (ith + 1) / nth;
    for (int64_t k = k0; k < k1; k++) {
        const int64_t c0 = k * 16, m = C - c0 < 16 ? C - c0 : 16;
        char * rows = (char *)dst->data + c0 * dst->nb[1];
        for (int64_t p = 0; p < n; p++) {
            const float * src = (const float *)((const char *)b->data + p * b->nb[1]) + c0;
            if (f16) {
                ggml_fp16_t h[16];
                qtts_f16_row(h, src, m);
                for (int64_t j = 0; j < m; j++) {
                    ((ggml_fp16_t *)(rows + j * dst->nb[1]))[p] = h[j];
                }
            } else {
                for (int64_t j = 0; j < m; j++) {
                    ((float *)(rows + j * dst->nb[1]))[p] = src[j];
                }
            }
        }
    }
}
