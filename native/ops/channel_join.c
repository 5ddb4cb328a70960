/* Channel join of time-major activations (see qtts_ops.h): dst[t] = [src0[t] | src1[t] | ...];
 * and time join: dst = [src0 rows | src1 rows | ...].
 *
 * Why: ggml's CONCAT copies one element at a time with its index arithmetic (~3 ns each), and
 * joining n parts takes n - 1 of them, each copying everything joined so far: the speaker
 * encoder's Res2Net blocks (8 parts) and its MFA input (3 parts) spent ~25 ms of a 10 s
 * reference that way. Here every part's row is one memcpy into its place. */
#include <string.h>

#include "qtts_ops.h"

void qtts_channel_join_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void)userdata;
    const int64_t T = dst->ne[1];
    const int64_t t0 = T * ith / nth, t1 = T * (ith + 1) / nth;
    for (int64_t t = t0; t < t1; t++) {
        char * row = (char *)dst->data + t * dst->nb[1];
        for (int i = 0; i < GGML_MAX_SRC && dst->src[i] != NULL; i++) {
            const struct ggml_tensor * s = dst->src[i];
            const size_t bytes = (size_t)s->ne[0] * sizeof(float);
            memcpy(row, (const char *)s->data + t * s->nb[1], bytes);
            row += bytes;
        }
    }
}

/* Why: several streams' rows pushed through one decoder graph are joined in time before every
 * conv that looks back (each stream's carried rows in front of its new ones) and after it; a
 * REPEAT of one row and a SET_ROWS per part wrote every row twice, one element at a time. */
void qtts_time_join_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void)userdata;
    const int64_t T = dst->ne[1];
    const int64_t t0 = T * ith / nth, t1 = T * (ith + 1) / nth;
    const size_t bytes = (size_t)dst->ne[0] * sizeof(float);
    int64_t start = 0; /* the first row of part i in dst */
    for (int i = 0; i < GGML_MAX_SRC && dst->src[i] != NULL && start < t1; i++) {
        const struct ggml_tensor * s = dst->src[i];
        const int64_t lo = t0 > start ? t0 : start;
        const int64_t hi = t1 < start + s->ne[1] ? t1 : start + s->ne[1];
        for (int64_t t = lo; t < hi; t++) {
            memcpy((char *)dst->data + t * dst->nb[1],
                   (const char *)s->data + (t - start) * s->nb[1], bytes);
        }
        start += s->ne[1];
    }
}
