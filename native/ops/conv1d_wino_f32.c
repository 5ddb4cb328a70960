/* Fast mode's K = 7 and K = 2 causal dilated convs in F32, for CPUs without the BF16 kernels:
 * Winograd F(6,7) / F(6,2) over tiles of six output steps (t, t+d, ..., t+5d). Same sources,
 * flags, userdata and result contract as qtts_conv1d_tm_bf16_op (history apart, SnakeBeta on the
 * input, residual on the output), F32 throughout.
 *
 * A tile reads the AL = K + 5 input rows x_i = xp(t + i*d); per input channel they are
 * transformed to U_p = sum_i BT[p][i] x_i, and per point p the output block takes M_p[o] =
 * sum_c Gw_p[o, c] U_p[c] with the transformed weights Gw_p = sum_k G[p][k] W[:, :, k]
 * (pack_conv_weight_wino_f32); y(t + i*d) = bias + sum_p AT[i][p] M_p. 12 channel contractions
 * per six outputs instead of 42 (K = 7), 7 instead of 12 (K = 2: the transposed convs'
 * polyphase form).
 * Points: 0, +-1, +-2, +-1/2, +-1/4, +-3/2 and infinity (K = 7); 0, +-1, +-2, 1/2 and infinity
 * (K = 2). Every constant of BT and AT is dyadic, so exact in F32. On random data one K = 7
 * conv keeps 91-102 dB SNR against float64 (C_in 1024 down to 96; the direct F32 conv 116-127
 * dB; in simulation F(4,7) ~7 dB better for 25 % more products, F(8,7) ~9 dB worse for 12 %
 * fewer); the BF16 kernels' ~51 dB is what fast mode already accepts elsewhere.
 *
 * Layout: w F32 contiguous, ne = [16, C_in, AL, ceil(C_out / 16)] (numpy [n_blocks, AL, C_in,
 * 16]): w[j, p, c, i] = Gw_p[j*16 + i, c], zero past C_out; AL (12 or 7) gives K.
 *
 * Work: tile q of the output starts at step s_q = 6d * (q / d) + q % d (d phases of six steps
 * in every 6d steps; the last tiles may reach past T, whose outputs are not written). Convs with
 * a small weight share out the tiles (each thread its own range, all output blocks); convs with
 * a large weight share out the output blocks (each thread every tile, transformed again, which
 * is cheap next to the products of a wide conv), so no thread streams the whole weight twice.
 * Either way tiles go in chunks: stage the chunk's rows (snaked), transform its tiles into U
 * (tile, point, channel), then per output block and point a register tile of 16 channels x 6
 * tiles runs over the input channels, and the output transform writes the block's rows.
 */
#include <stdint.h>
#include <string.h>

#include "qtts_conv_srcs.h"
#include "qtts_ops.h"
#include "qtts_scratch.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WINO_SIMD 1
#else
#define WINO_SIMD 0
#endif

#define INLINE static inline __attribute__((always_inline))
#define OB QTTS_CONV_WINO_F32_BLOCK /* 16 output channels per packed block */
#define MT 6                        /* outputs per tile */
#define AL_MAX 12                   /* points: MT + K - 1 (K = 7) */
#define AL2 7                       /* K = 2 */
#define NT 6                        /* tiles per register tile */
#define SMALL_WEIGHT (4 << 20)      /* bytes: below, threads share out tiles */
#define CHUNK_BYTES (768 << 10)     /* staged rows + U of one chunk, small weights (L2) */
#define WIDE_CHUNK_BYTES (12 << 20) /* large weights: every chunk streams the weight (L3) */

int qtts_conv1d_wino_f32_fast(void) { return WINO_SIMD; }

static const float BT7[AL_MAX][AL_MAX] = {
    {-0.140625f, 0.0f, 3.05078125f, 0.0f, -13.87890625f, 0.0f, 17.53125f, 0.0f, -7.5625f, 0.0f, 1.0f, 0.0f},
    {0.0f, 0.140625f, 0.140625f, -2.91015625f, -2.91015625f, 10.96875f, 10.96875f, -6.5625f, -6.5625f, 1.0f, 1.0f, 0.0f},
    {0.0f, -0.140625f, 0.140625f, 2.91015625f, -2.91015625f, -10.96875f, 10.96875f, 6.5625f, -6.5625f, -1.0f, 1.0f, 0.0f},
    {0.0f, 0.0703125f, 0.03515625f, -1.5078125f, -0.75390625f, 6.5625f, 3.28125f, -7.125f, -3.5625f, 2.0f, 1.0f, 0.0f},
    {0.0f, -0.0703125f, 0.03515625f, 1.5078125f, -0.75390625f, -6.5625f, 3.28125f, 7.125f, -3.5625f, -2.0f, 1.0f, 0.0f},
    {0.0f, 0.28125f, 0.5625f, -4.9765625f, -9.953125f, 7.8515625f, 15.703125f, -3.65625f, -7.3125f, 0.5f, 1.0f, 0.0f},
    {0.0f, -0.28125f, 0.5625f, 4.9765625f, -9.953125f, -7.8515625f, 15.703125f, 3.65625f, -7.3125f, -0.5f, 1.0f, 0.0f},
    {0.0f, 0.5625f, 2.25f, -3.203125f, -12.8125f, 4.265625f, 17.0625f, -1.875f, -7.5f, 0.25f, 1.0f, 0.0f},
    {0.0f, -0.5625f, 2.25f, 3.203125f, -12.8125f, -4.265625f, 17.0625f, 1.875f, -7.5f, -0.25f, 1.0f, 0.0f},
    {0.0f, 0.09375f, 0.0625f, -1.9921875f, -1.328125f, 8.3671875f, 5.578125f, -7.96875f, -5.3125f, 1.5f, 1.0f, 0.0f},
    {0.0f, -0.09375f, 0.0625f, 1.9921875f, -1.328125f, -8.3671875f, 5.578125f, 7.96875f, -5.3125f, -1.5f, 1.0f, 0.0f},
    {0.0f, -0.140625f, 0.0f, 3.05078125f, 0.0f, -13.87890625f, 0.0f, 17.53125f, 0.0f, -7.5625f, 0.0f, 1.0f},
};

static const float AT7[MT][AL_MAX] = {
    {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f},
    {0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 0.5f, -0.5f, 0.25f, -0.25f, 1.5f, -1.5f, 0.0f},
    {0.0f, 1.0f, 1.0f, 4.0f, 4.0f, 0.25f, 0.25f, 0.0625f, 0.0625f, 2.25f, 2.25f, 0.0f},
    {0.0f, 1.0f, -1.0f, 8.0f, -8.0f, 0.125f, -0.125f, 0.015625f, -0.015625f, 3.375f, -3.375f, 0.0f},
    {0.0f, 1.0f, 1.0f, 16.0f, 16.0f, 0.0625f, 0.0625f, 0.00390625f, 0.00390625f, 5.0625f, 5.0625f, 0.0f},
    {0.0f, 1.0f, -1.0f, 32.0f, -32.0f, 0.03125f, -0.03125f, 0.0009765625f, -0.0009765625f, 7.59375f, -7.59375f, 1.0f},
};

static const float BT2[AL2][AL2] = {
    {-2.0f, 4.0f, 2.5f, -5.0f, -0.5f, 1.0f, 0.0f},
    {0.0f, 2.0f, -2.0f, -4.5f, 0.5f, 1.0f, 0.0f},
    {0.0f, -2.0f, 6.0f, -3.5f, -1.5f, 1.0f, 0.0f},
    {0.0f, 1.0f, -1.5f, -2.0f, 1.5f, 1.0f, 0.0f},
    {0.0f, -1.0f, 2.5f, 0.0f, -2.5f, 1.0f, 0.0f},
    {0.0f, 4.0f, 0.0f, -5.0f, 0.0f, 1.0f, 0.0f},
    {0.0f, -2.0f, 4.0f, 2.5f, -5.0f, -0.5f, 1.0f},
};

static const float AT2[MT][AL2] = {
    {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f},
    {0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 0.5f, 0.0f},
    {0.0f, 1.0f, 1.0f, 4.0f, 4.0f, 0.25f, 0.0f},
    {0.0f, 1.0f, -1.0f, 8.0f, -8.0f, 0.125f, 0.0f},
    {0.0f, 1.0f, 1.0f, 16.0f, 16.0f, 0.0625f, 0.0f},
    {0.0f, 1.0f, -1.0f, 32.0f, -32.0f, 0.03125f, 1.0f},
};

/* ---- input transform --------------------------------------------------------------------------- */

/* u[p*ci + c] = sum_i BT[p][i] * x_i[c], x_i = row i*d of st (row stride ci), for the A x A
 * table BT (row stride A). Inlined with constant tables and unrolled, so their zeros cost
 * nothing. */
INLINE void transform(const int A, const float * BT, float * u, const float * st, int64_t d,
                      int64_t ci) {
    int64_t c = 0;
#if WINO_SIMD
    for (; c + 8 <= ci; c += 8) {
        __m256 x[AL_MAX];
#pragma GCC unroll 12
        for (int i = 0; i < A; i++) x[i] = _mm256_loadu_ps(st + i * d * ci + c);
#pragma GCC unroll 12
        for (int p = 0; p < A; p++) {
            __m256 acc = _mm256_setzero_ps();
#pragma GCC unroll 12
            for (int i = 0; i < A; i++) {
                const float b = BT[p * A + i];
                if (b != 0.0f) acc = _mm256_fmadd_ps(_mm256_set1_ps(b), x[i], acc);
            }
            _mm256_storeu_ps(u + p * ci + c, acc);
        }
    }
#endif
    for (; c < ci; c++) {
        for (int p = 0; p < A; p++) {
            float acc = 0.0f;
            for (int i = 0; i < A; i++) acc += BT[p * A + i] * st[i * d * ci + c];
            u[p * ci + c] = acc;
        }
    }
}

static void transform7(float * u, const float * st, int64_t d, int64_t ci) {
    transform(AL_MAX, &BT7[0][0], u, st, d, ci);
}

static void transform2(float * u, const float * st, int64_t d, int64_t ci) {
    transform(AL2, &BT2[0][0], u, st, d, ci);
}

/* ---- products ---------------------------------------------------------------------------------- */

/* m[j*ms + o] = sum_c w[c*OB + o] * u[j][c] for the nt tiles j of a register tile (m: the
 * tiles' sums of one point, tile stride ms = AL*OB). */
#if WINO_SIMD
INLINE void products(const int N, float * m, int64_t ms, const float * const * u, const float * w,
                     int64_t ci) {
    __m256 acc[2][NT];
#pragma GCC unroll 6
    for (int j = 0; j < N; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < ci; c++) {
        const __m256 w0 = _mm256_loadu_ps(w + c * OB), w1 = _mm256_loadu_ps(w + c * OB + 8);
#pragma GCC unroll 6
        for (int j = 0; j < N; j++) {
            const __m256 b = _mm256_broadcast_ss(u[j] + c);
            acc[0][j] = _mm256_fmadd_ps(w0, b, acc[0][j]);
            acc[1][j] = _mm256_fmadd_ps(w1, b, acc[1][j]);
        }
    }
#pragma GCC unroll 6
    for (int j = 0; j < N; j++) {
        _mm256_storeu_ps(m + j * ms, acc[0][j]);
        _mm256_storeu_ps(m + j * ms + 8, acc[1][j]);
    }
}
#define PRODUCTS(n)                                                                              \
    static void products_##n(float * m, int64_t ms, const float * const * u, const float * w,   \
                             int64_t ci) {                                                       \
        products(n, m, ms, u, w, ci);                                                            \
    }
#else
static void products_generic(int N, float * m, int64_t ms, const float * const * u,
                             const float * w, int64_t ci) {
    float acc[NT][OB];
    memset(acc, 0, sizeof(acc));
    for (int64_t c = 0; c < ci; c++) {
        for (int j = 0; j < N; j++) {
            const float b = u[j][c];
            for (int o = 0; o < OB; o++) acc[j][o] += w[c * OB + o] * b;
        }
    }
    for (int j = 0; j < N; j++) memcpy(m + j * ms, acc[j], sizeof(acc[j]));
}
#define PRODUCTS(n)                                                                              \
    static void products_##n(float * m, int64_t ms, const float * const * u, const float * w,   \
                             int64_t ci) {                                                       \
        products_generic(n, m, ms, u, w, ci);                                                    \
    }
#endif

PRODUCTS(1)
PRODUCTS(2)
PRODUCTS(3)
PRODUCTS(4)
PRODUCTS(5)
PRODUCTS(6)

typedef void (*products_fn)(float * m, int64_t ms, const float * const * u, const float * w,
                            int64_t ci);
static const products_fn PRODUCTS_N[NT + 1] = {0, products_1, products_2, products_3,
                                               products_4, products_5, products_6};

/* ---- output transform -------------------------------------------------------------------------- */

/* Row i of a tile (i < n: the rows before T): y[i*d*ys + o] = bias[o] + sum_p AT[i][p] m[p*OB + o]
 * (+ res[i*d*rs + o]) for the block's `width` valid channels; AT is MT x A (row stride A). */
INLINE void output(const int A, const float * AT, float * y, int64_t ys, const float * res,
                   int64_t rs, const float * m, const float * bias, int width, int n,
                   int64_t d) {
    float tmp[OB];
    for (int i = 0; i < n; i++) {
        float * yo = y + i * d * ys;
        const float * ro = res ? res + i * d * rs : NULL;
#if WINO_SIMD
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
#pragma GCC unroll 12
        for (int p = 0; p < A; p++) {
            const float k = AT[i * A + p];
            if (k == 0.0f) continue;
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(k), _mm256_loadu_ps(m + p * OB), a0);
            a1 = _mm256_fmadd_ps(_mm256_set1_ps(k), _mm256_loadu_ps(m + p * OB + 8), a1);
        }
        _mm256_storeu_ps(tmp, a0);
        _mm256_storeu_ps(tmp + 8, a1);
#else
        for (int o = 0; o < OB; o++) {
            float a = 0.0f;
            for (int p = 0; p < A; p++) a += AT[i * A + p] * m[p * OB + o];
            tmp[o] = a;
        }
#endif
        for (int o = 0; o < width; o++) {
            const float v = bias[o] + tmp[o];
            yo[o] = ro ? ro[o] + v : v;
        }
    }
}

#define OUTPUT_ARGS                                                                              \
    float * y, int64_t ys, const float * res, int64_t rs, const float * m, const float * bias,  \
        int width, int n, int64_t d
static void output7(OUTPUT_ARGS) {
    output(AL_MAX, &AT7[0][0], y, ys, res, rs, m, bias, width, n, d);
}
static void output2(OUTPUT_ARGS) {
    output(AL2, &AT2[0][0], y, ys, res, rs, m, bias, width, n, d);
}

/* ---- the op ------------------------------------------------------------------------------------ */

/* tile q's first output step */
static inline int64_t tile_start(int64_t q, int64_t d) { return MT * d * (q / d) + q % d; }

void qtts_conv1d_wino_f32_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct ggml_tensor * wt = dst->src[1];
    GGML_ASSERT(wt->type == GGML_TYPE_F32 && (wt->ne[2] == AL_MAX || wt->ne[2] == AL2));
    const int k7 = wt->ne[2] == AL_MAX;
    const int64_t AL = wt->ne[2];
    void (*const transform_tile)(float *, const float *, int64_t, int64_t) =
        k7 ? transform7 : transform2;
    void (*const output_tile)(OUTPUT_ARGS) = k7 ? output7 : output2;
    qtts_conv_srcs sr;
    qtts_conv_srcs_get(&sr, dst, (intptr_t)userdata, AL - MT + 1);
    const int64_t d = sr.d, ci = sr.ci, co = sr.co, T = sr.t;
    const int64_t n_ob = (co + OB - 1) / OB;
    GGML_ASSERT(wt->ne[0] == OB && wt->ne[1] == ci && wt->ne[3] == n_ob && ggml_is_contiguous(wt));
    qtts_conv_rows src;
    qtts_conv_rows_of(&src, &sr);
    const float * w = (const float *)wt->data;
    const float * bias = (const float *)sr.bias->data;
    const float * res = sr.res ? (const float *)sr.res->data : NULL;
    const int64_t rs = sr.res ? (int64_t)(sr.res->nb[1] / sizeof(float)) : 0;
    float * y = (float *)dst->data;

    /* tiles: the d phases of every 6d steps, and of the last partial stretch */
    const int64_t n_tiles = T / (MT * d) * d + (T % (MT * d) < d ? T % (MT * d) : d);
    const int64_t w_block = AL * ci * OB;
    const int small = n_ob * w_block * (int64_t)sizeof(float) <= SMALL_WEIGHT;
    int64_t q_lo = 0, q_hi = n_tiles, ob_lo = 0, ob_hi = n_ob;
    if (small) {
        q_lo = n_tiles * ith / nth;
        q_hi = n_tiles * (ith + 1) / nth;
    } else {
        ob_lo = n_ob * ith / nth;
        ob_hi = n_ob * (ith + 1) / nth;
    }
    if (q_lo >= q_hi || ob_lo >= ob_hi) return;

    /* Tiles per chunk: the chunk's staged rows (about 6 a tile, plus the reach of (AL - 1)d)
     * and its U (AL rows a tile) within the budget; at least a whole register tile. */
    const int64_t reach = (AL - 1) * d + 1;
    const int64_t row_bytes = ci * (int64_t)sizeof(float);
    const int64_t budget = small ? CHUNK_BYTES : WIDE_CHUNK_BYTES;
    int64_t per_chunk = (budget / row_bytes - reach) / (MT + AL);
    if (per_chunk < NT) per_chunk = NT;
    if (per_chunk > q_hi - q_lo) per_chunk = q_hi - q_lo;
    /* a chunk of n consecutive tiles spans at most 6d * (ceil(n / d) + 1) rows before its reach */
    const int64_t max_rows = MT * d * ((per_chunk + d - 1) / d + 1) + reach;
    const size_t st_bytes = ((size_t)(max_rows * ci) * sizeof(float) + 63) & ~(size_t)63;
    const size_t u_bytes = ((size_t)(per_chunk * AL * ci) * sizeof(float) + 63) & ~(size_t)63;
    const size_t m_bytes = (size_t)(per_chunk * AL * OB) * sizeof(float);
    uint8_t * scratch = (uint8_t *)qtts_scratch_get(QTTS_SCRATCH_WINO,
                                                    st_bytes + u_bytes + m_bytes);
    float * st = (float *)scratch;
    float * U = (float *)(scratch + st_bytes);
    float * Mb = (float *)(scratch + st_bytes + u_bytes);

    for (int64_t qa = q_lo; qa < q_hi; qa += per_chunk) {
        const int64_t nq = q_hi - qa < per_chunk ? q_hi - qa : per_chunk;
        /* rows s_qa .. s_(qa+nq-1) + reach */
        const int64_t r0 = tile_start(qa, d);
        const int64_t rows = tile_start(qa + nq - 1, d) + reach - r0;
        qtts_conv_stage_rows(st, &src, r0, rows);
        for (int64_t j = 0; j < nq; j++) {
            transform_tile(U + j * AL * ci, st + (tile_start(qa + j, d) - r0) * ci, d, ci);
        }
        for (int64_t ob = ob_lo; ob < ob_hi; ob++) {
            const float * wb = w + ob * w_block;
            for (int p = 0; p < AL; p++) {
                const float * wp = wb + p * ci * OB;
                for (int64_t j0 = 0; j0 < nq; j0 += NT) {
                    const int n = (int)(nq - j0 < NT ? nq - j0 : NT);
                    const float * u[NT];
                    for (int j = 0; j < n; j++) u[j] = U + ((j0 + j) * AL + p) * ci;
                    PRODUCTS_N[n](Mb + (j0 * AL + p) * OB, AL * OB, u, wp, ci);
                }
            }
            const int64_t o0 = ob * OB;
            const int width = (int)(co - o0 < OB ? co - o0 : OB);
            for (int64_t j = 0; j < nq; j++) {
                const int64_t t = tile_start(qa + j, d);
                const int64_t left = (T - t + d - 1) / d; /* rows of this tile before T */
                output_tile(y + t * co + o0, co, res ? res + t * rs + o0 : NULL, rs,
                            Mb + j * AL * OB, bias + o0, width, (int)(left < MT ? left : MT), d);
            }
        }
    }
}
