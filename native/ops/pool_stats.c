/* Per-channel statistics over time for the speaker encoder's pooling (see qtts_ops.h).
 *
 * Why: the attentive statistics pooling takes, per channel, a mean over time and the mean of
 * the squared deviations from it, twice (uniform, then softmax-weighted). As ggml nodes the
 * deviation is a broadcast SUB along ne0, which ggml runs one element per call, and MEAN /
 * SUM_ROWS run on one thread: ~35 ms of CPU per 10 s reference. Here a channel's row (a few
 * KB) stays in L1 for both passes; sums in double. */
#include "qtts_ops.h"

#define POOL_LANES 4

static double row_sum(const float * x, const float * w, double shift, int squared, int64_t n) {
    double acc[POOL_LANES] = {0.0};
    int64_t t = 0;
    for (; t + POOL_LANES <= n; t += POOL_LANES) {
        for (int l = 0; l < POOL_LANES; l++) {
            double v = (double)x[t + l] - shift;
            if (squared) v *= v;
            acc[l] += w != NULL ? (double)w[t + l] * v : v;
        }
    }
    for (; t < n; t++) {
        double v = (double)x[t] - shift;
        if (squared) v *= v;
        acc[0] += w != NULL ? (double)w[t] * v : v;
    }
    double s = 0.0;
    for (int l = 0; l < POOL_LANES; l++) s += acc[l];
    return s;
}

void qtts_pool_stats_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void)userdata;
    const struct ggml_tensor * x = dst->src[0];
    const struct ggml_tensor * w = dst->src[1];
    const int64_t T = x->ne[0], C = x->ne[1];
    const int64_t c0 = C * ith / nth, c1 = C * (ith + 1) / nth;
    float * out = (float *)dst->data;
    for (int64_t c = c0; c < c1; c++) {
        const float * xr = (const float *)((const char *)x->data + c * x->nb[1]);
        const float * wr = w != NULL ? (const float *)((const char *)w->data + c * w->nb[1]) : NULL;
        const double scale = w != NULL ? 1.0 : 1.0 / (double)T;
        const double mean = row_sum(xr, wr, 0.0, 0, T) * scale;
        out[c] = (float)mean;
        out[C + c] = (float)(row_sum(xr, wr, mean, 1, T) * scale);
    }
}
