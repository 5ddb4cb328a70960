/* Exact-F32 causal dilated conv1d in the time-major layout (see qtts_ops.h).
 *
 *   y[t, o] = bias[o] + sum_k sum_c W[k, c, o] * xp[t + k*d, c]
 *
 * Register-blocked direct convolution: a tile of NV vectors of output channels x NT time steps
 * (AVX-512: 2 x 16 channels x 12 steps = 24 zmm accumulators) lives in registers; for every
 * (k, c) it loads NV weight vectors from the packed block (contiguous: OB floats per (k, c))
 * and FMAs them with NT broadcast inputs xp[t0 + j + k*d, c]. Every output element is summed
 * in the same order (bias; then per input-channel chunk: k ascending, c ascending; one FMA
 * each) whatever the tile or the thread split, so results do not depend on the thread count.
 *
 * Work is cut into units of (time chunk, output-channel block); thread ith takes a contiguous
 * range of units, time-major, so with many time steps each thread walks its own stretch of
 * time and with few time steps the output channels are shared out instead.
 *
 * The history may come in a source of its own (src[3]) rather than in front of x: tiles past
 * the join read x directly, the few before it (t < (K-1)*d) read a joined copy (see the op).
 */
#include <stdint.h>
#include <string.h>

#include "qtts_conv_rows.h"
#include "qtts_elu.h"
#include "qtts_ops.h"
#include "qtts_scratch.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))
#define OB (NV_MAIN * VW) /* output channels per block (NV_MAIN, VW: per ISA below) */

/* What every tile of one (input-channel chunk of a) conv shares. xp and w point at the
 * chunk's first input channel (and w at the block's first output channel). */
typedef struct {
    const float * xp; /* row t of the tile is xp + t*xs */
    int64_t xs;       /* xp row stride (floats) */
    const float * w;  /* w[k, c, o] at w + k*wks + c*OB + o (one packed block, see below) */
    int64_t wks;      /* w stride between taps: C_in * OB */
    int64_t d;        /* dilation */
    int64_t nc;       /* input channels in this chunk */
    int K;            /* taps */
} conv_args;

/* One tile: out[j*ys + o] = init[j*is + o] + sum over the chunk, for j < nt and o < width
 * (init is the bias with is = 0 for the first chunk, else out itself with is = ys). */
typedef void (*tile_fn)(float * out, int64_t ys, const float * init, int64_t is,
                        const conv_args * a, int width);

#if defined(__AVX512F__)

#define VW 16      /* lanes */
#ifndef NV_MAIN
#define NV_MAIN 2 /* vectors per block: 32 output channels */
#endif
#ifndef NT_MAIN
#define NT_MAIN 12 /* time steps per tile: 24 accumulators */
#endif

INLINE void tile_avx512(const int NV, const int NT, const int MASKED, float * out, int64_t ys,
                        const float * init, int64_t is, const conv_args * a, int width) {
    const float * xp = a->xp;
    const float * w = a->w;
    const int64_t xs = a->xs, wks = a->wks, d = a->d, nc = a->nc;
    const int K = a->K;
    __m512 acc[NV_MAIN][NT_MAIN];
    __mmask16 m[NV_MAIN];
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        int rem = width - v * VW;
        rem = rem < 0 ? 0 : (rem > VW ? VW : rem);
        m[v] = MASKED ? (__mmask16)((1u << rem) - 1u) : (__mmask16)0xFFFF;
#pragma GCC unroll 16
        for (int j = 0; j < NT; j++) {
            acc[v][j] = MASKED ? _mm512_maskz_loadu_ps(m[v], init + j * is + v * VW)
                               : _mm512_loadu_ps(init + j * is + v * VW);
        }
    }
    for (int k = 0; k < K; k++) {
        const float * xk = xp + (int64_t)k * d * xs;
        const float * wk = w + (int64_t)k * wks;
        for (int64_t c = 0; c < nc; c++) {
            __m512 wv[NV_MAIN];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                wv[v] = _mm512_loadu_ps(wk + c * OB + v * VW); /* zero-padded past O */
            }
#pragma GCC unroll 16
            for (int j = 0; j < NT; j++) {
                const __m512 xb = _mm512_set1_ps(xk[j * xs + c]);
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) acc[v][j] = _mm512_fmadd_ps(wv[v], xb, acc[v][j]);
            }
        }
    }
#pragma GCC unroll 16
    for (int j = 0; j < NT; j++) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            if (MASKED) {
                _mm512_mask_storeu_ps(out + j * ys + v * VW, m[v], acc[v][j]);
            } else {
                _mm512_storeu_ps(out + j * ys + v * VW, acc[v][j]);
            }
        }
    }
}

#define DEF_TILE(nt)                                                                            \
    static void tile_full_##nt(TILE_ARGS) { tile_avx512(NV_MAIN, nt, 0, TILE_PASS); }          \
    static void tile_mask_##nt(TILE_ARGS) { tile_avx512(NV_MAIN, nt, 1, TILE_PASS); }

#elif defined(__AVX2__) && defined(__FMA__)

#define VW 8
#define NV_MAIN 2 /* 16 output channels */
#define NT_MAIN 6 /* 12 accumulators of 16 ymm registers */

INLINE void tile_avx2(const int NV, const int NT, const int MASKED, float * out, int64_t ys,
                      const float * init, int64_t is, const conv_args * a, int width) {
    const float * xp = a->xp;
    const float * w = a->w;
    const int64_t xs = a->xs, wks = a->wks, d = a->d, nc = a->nc;
    const int K = a->K;
    __m256 acc[NV_MAIN][NT_MAIN];
    __m256i m[NV_MAIN];
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        m[v] = _mm256_cmpgt_epi32(_mm256_set1_epi32(width - v * VW), idx);
#pragma GCC unroll 16
        for (int j = 0; j < NT; j++) {
            acc[v][j] = MASKED ? _mm256_maskload_ps(init + j * is + v * VW, m[v])
                               : _mm256_loadu_ps(init + j * is + v * VW);
        }
    }
    for (int k = 0; k < K; k++) {
        const float * xk = xp + (int64_t)k * d * xs;
        const float * wk = w + (int64_t)k * wks;
        for (int64_t c = 0; c < nc; c++) {
            __m256 wv[NV_MAIN];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                wv[v] = _mm256_loadu_ps(wk + c * OB + v * VW); /* zero-padded past O */
            }
#pragma GCC unroll 16
            for (int j = 0; j < NT; j++) {
                const __m256 xb = _mm256_broadcast_ss(xk + j * xs + c);
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) acc[v][j] = _mm256_fmadd_ps(wv[v], xb, acc[v][j]);
            }
        }
    }
#pragma GCC unroll 16
    for (int j = 0; j < NT; j++) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            if (MASKED) {
                _mm256_maskstore_ps(out + j * ys + v * VW, m[v], acc[v][j]);
            } else {
                _mm256_storeu_ps(out + j * ys + v * VW, acc[v][j]);
            }
        }
    }
}

#define DEF_TILE(nt)                                                                            \
    static void tile_full_##nt(TILE_ARGS) { tile_avx2(NV_MAIN, nt, 0, TILE_PASS); }            \
    static void tile_mask_##nt(TILE_ARGS) { tile_avx2(NV_MAIN, nt, 1, TILE_PASS); }

#else

#include <math.h>
#ifdef FP_FAST_FMAF
#define MADD(a, b, c) fmaf(a, b, c)
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

#define VW 1
#define NV_MAIN 64 /* a block of 64 output channels, one accumulator row per time step */
#define NT_MAIN 4

static void tile_scalar(int NT, float * out, int64_t ys, const float * init, int64_t is,
                        const conv_args * a, int width) {
    const float * xp = a->xp;
    const float * w = a->w;
    const int64_t xs = a->xs, wks = a->wks, d = a->d, nc = a->nc;
    const int K = a->K;
    float acc[NT_MAIN][NV_MAIN];
    for (int j = 0; j < NT; j++) {
        for (int o = 0; o < width; o++) acc[j][o] = init[j * is + o];
    }
    for (int k = 0; k < K; k++) {
        const float * xk = xp + (int64_t)k * d * xs;
        const float * wk = w + (int64_t)k * wks;
        for (int64_t c = 0; c < nc; c++) {
            const float * wc = wk + c * OB;
            for (int j = 0; j < NT; j++) {
                const float xv = xk[j * xs + c];
                for (int o = 0; o < width; o++) acc[j][o] = MADD(wc[o], xv, acc[j][o]);
            }
        }
    }
    for (int j = 0; j < NT; j++) memcpy(out + j * ys, acc[j], (size_t)width * sizeof(float));
}

#define DEF_TILE(nt)                                                                            \
    static void tile_full_##nt(TILE_ARGS) { tile_scalar(nt, TILE_PASS); }                      \
    static void tile_mask_##nt(TILE_ARGS) { tile_scalar(nt, TILE_PASS); }

#endif

#define TILE_ARGS                                                                               \
    float * out, int64_t ys, const float * init, int64_t is, const conv_args * a, int width
#define TILE_PASS out, ys, init, is, a, width

DEF_TILE(1)
DEF_TILE(2)
DEF_TILE(3)
DEF_TILE(4)
#if NT_MAIN >= 5
DEF_TILE(5)
#endif
#if NT_MAIN >= 6
DEF_TILE(6)
#endif
#if NT_MAIN >= 7
DEF_TILE(7)
#endif
#if NT_MAIN >= 8
DEF_TILE(8)
#endif
#if NT_MAIN >= 9
DEF_TILE(9)
#endif
#if NT_MAIN >= 10
DEF_TILE(10)
#endif
#if NT_MAIN >= 11
DEF_TILE(11)
#endif
#if NT_MAIN >= 12
DEF_TILE(12)
#endif
#if NT_MAIN >= 13
DEF_TILE(13)
#endif
#if NT_MAIN >= 14
DEF_TILE(14)
#endif
#if NT_MAIN >= 15
DEF_TILE(15)
#endif
#if NT_MAIN >= 16
DEF_TILE(16)
#endif

static const tile_fn TILE_FULL[NT_MAIN + 1] = {
    0,
    tile_full_1,
    tile_full_2,
    tile_full_3,
    tile_full_4,
#if NT_MAIN >= 5
    tile_full_5,
#endif
#if NT_MAIN >= 6
    tile_full_6,
#endif
#if NT_MAIN >= 7
    tile_full_7,
#endif
#if NT_MAIN >= 8
    tile_full_8,
#endif
#if NT_MAIN >= 9
    tile_full_9,
#endif
#if NT_MAIN >= 10
    tile_full_10,
#endif
#if NT_MAIN >= 11
    tile_full_11,
#endif
#if NT_MAIN >= 12
    tile_full_12,
#endif
#if NT_MAIN >= 13
    tile_full_13,
#endif
#if NT_MAIN >= 14
    tile_full_14,
#endif
#if NT_MAIN >= 15
    tile_full_15,
#endif
#if NT_MAIN >= 16
    tile_full_16,
#endif
};

static const tile_fn TILE_MASK[NT_MAIN + 1] = {
    0,
    tile_mask_1,
    tile_mask_2,
    tile_mask_3,
    tile_mask_4,
#if NT_MAIN >= 5
    tile_mask_5,
#endif
#if NT_MAIN >= 6
    tile_mask_6,
#endif
#if NT_MAIN >= 7
    tile_mask_7,
#endif
#if NT_MAIN >= 8
    tile_mask_8,
#endif
#if NT_MAIN >= 9
    tile_mask_9,
#endif
#if NT_MAIN >= 10
    tile_mask_10,
#endif
#if NT_MAIN >= 11
    tile_mask_11,
#endif
#if NT_MAIN >= 12
    tile_mask_12,
#endif
#if NT_MAIN >= 13
    tile_mask_13,
#endif
#if NT_MAIN >= 14
    tile_mask_14,
#endif
#if NT_MAIN >= 15
    tile_mask_15,
#endif
#if NT_MAIN >= 16
    tile_mask_16,
#endif
};

#ifndef TCHUNK
#define TCHUNK (NT_MAIN * 32) /* time steps per work unit */
#endif
#ifndef KC_MAX
#define KC_MAX 256 /* input channels per reduction chunk (bounds w's strip per block) */
#endif

int qtts_conv1d_tm_block(void) { return OB; }

/* The input channels of a conv in reduction chunks of <= KC_MAX, the same for every caller. */
static int64_t chunk_width(int64_t Ci) {
    const int64_t n_kc = (Ci + KC_MAX - 1) / KC_MAX;
    return (Ci + n_kc - 1) / n_kc;
}

/* Rows 0 .. n-1 of one output block (width channels; y and init at the block's first
 * channel, w at its packed taps, tap stride Ci * OB): out[t] = init[t*is] + the conv's sum,
 * per input-channel chunk then per tile (the order of qtts_conv1d_tm_op). */
static void block_rows(float * y, int64_t ys, const float * init, int64_t is, const float * xp,
                       int64_t xs, const float * w, int64_t Ci, int K, int64_t d, int64_t n,
                       int width) {
    const tile_fn * fns = width == OB ? TILE_FULL : TILE_MASK;
    const int64_t kc = chunk_width(Ci);
    for (int64_t c0 = 0; c0 < Ci; c0 += kc) {
        const int64_t nc = Ci - c0 < kc ? Ci - c0 : kc;
        for (int64_t t = 0; t < n; t += NT_MAIN) {
            const int nt = (int)(n - t < NT_MAIN ? n - t : NT_MAIN);
            const conv_args at = {
                .xp = xp + t * xs + c0, .xs = xs, .w = w + c0 * OB, .wks = Ci * OB, .d = d,
                .nc = nc, .K = K,
            };
            float * out = y + t * ys;
            if (c0 == 0) {
                fns[nt](out, ys, init + t * is, is, &at, width);
            } else {
                fns[nt](out, ys, out, ys, &at, width);
            }
        }
    }
}

/* Winograd groups for the codec encoder's convs of dilation 1 with 2 taps (its strided convs,
 * folded) or 3 (its residual units): F(3, 2) makes three outputs y_i = g0 x_i + g1 x_(i+1)
 * from four products over the input channels instead of six, F(2, 3) two outputs y_i =
 * g0 x_i + g1 x_(i+1) + g2 x_(i+2) from four instead of six (points 0, 1, -1 and infinity).
 * Both read the group's four input rows x0 .. x3 through the same transforms,
 *   A = x0 - x2,  Bp = x1 + x2,  Bm = x1 - x2,  C = x3 - x1,
 * with the weights packed as K + 2 taps: the K taps themselves, then gp and gm:
 *   F(3, 2): gp = (g0 + g1) / 2, gm = (g0 - g1) / 2,
 *            P = bias + gp Bp,  y1 = P + gm Bm,  Q = 2P - y1,  y0 = Q + g0 A,  y2 = Q + g1 C;
 *   F(2, 3): gp = (g0 + g1 + g2) / 2, gm = (g1 - g0 - g2) / 2,
 *            P = bias + gp Bp,  M = P + gm Bm,  Q = 2P - M,  y0 = M + g0 A,  y1 = Q + g2 C.
 * The halves are exact and each transform one F32 sum or difference: the error stays of the
 * direct sums' order (docs/performance.md: the codes against the reference). The row made as
 * P plus a product is summed onto P the way a tile sums onto a bias, and Q from it (P + P
 * exact, one rounding), so no row of y is written outside the tiles, whose stores hide behind
 * the products. A group starts at an output row that is a multiple of its size counted from the
 * conv's first, so no value depends on slices or the thread split; rows past the last whole
 * group are summed directly. */

typedef struct { /* the conv's input rows: hist rows 0 .. ph - 1, then x's */
    const float * h;
    int64_t hs, ph;
    const float * x;
    int64_t xs;
} rows_src;

INLINE const float * src_row(const rows_src * s, int64_t r) {
    return r < s->ph ? s->h + r * s->hs : s->x + (r - s->ph) * s->xs;
}

/* Outputs of a group of a conv of K taps (F(3, 2) or F(2, 3)). */
INLINE int64_t wino_outputs(int K) { return K == 2 ? 3 : 2; }

/* VW floats as one vector of GCC's (the ISA's width), read and written unaligned */
typedef float vwf __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float)),
                                 may_alias));

/* The transforms of G groups (group q: the source's rows r0 + m q .. r0 + m q + 3, m outputs
 * a group): four arrays of G rows of Ci, A, Bp, Bm and C, at tr. */
static void wino_transform(float * tr, const rows_src * s, int64_t r0, int64_t G, int64_t m,
                           int64_t Ci) {
    const int64_t n = G * Ci;
    for (int64_t q = 0; q < G; q++) {
        const float * x0 = src_row(s, r0 + m * q);
        const float * x1 = src_row(s, r0 + m * q + 1);
        const float * x2 = src_row(s, r0 + m * q + 2);
        const float * x3 = src_row(s, r0 + m * q + 3);
        float * a = tr + q * Ci;
        int64_t c = 0;
        for (; c + VW <= Ci; c += VW) {
            const vwf v0 = *(const vwf *)(x0 + c), v1 = *(const vwf *)(x1 + c);
            const vwf v2 = *(const vwf *)(x2 + c), v3 = *(const vwf *)(x3 + c);
            *(vwf *)(a + c) = v0 - v2;
            *(vwf *)(a + n + c) = v1 + v2;
            *(vwf *)(a + 2 * n + c) = v1 - v2;
            *(vwf *)(a + 3 * n + c) = v3 - v1;
        }
        for (; c < Ci; c++) {
            a[c] = x0[c] - x2[c];
            a[n + c] = x1[c] + x2[c];
            a[2 * n + c] = x1[c] - x2[c];
            a[3 * n + c] = x3[c] - x1[c];
        }
    }
}

/* Output rows 0 .. m G - 1 of one output block (y at its first channel, row stride ys) from the
 * transforms tr; w: the block's K + 2 packed taps; P: scratch of G OB floats. */
static void wino_block(float * y, int64_t ys, const float * tr, int64_t G, int64_t Ci, int K,
                       const float * w, const float * bias, int width, float * P) {
    const int64_t n = G * Ci, tap = Ci * OB, m = wino_outputs(K);
    float * M = K == 2 ? y + ys : y; /* the row made as P + gm Bm */
    block_rows(P, OB, bias, 0, tr + n, Ci, w + K * tap, Ci, 1, 1, G, width);
    block_rows(M, m * ys, P, OB, tr + 2 * n, Ci, w + (K + 1) * tap, Ci, 1, 1, G, width);
    for (int64_t q = 0; q < G; q++) {
        float * restrict p = P + q * OB;
        const float * restrict mq = M + m * q * ys;
        for (int o = 0; o < width; o++) p[o] = (p[o] + p[o]) - mq[o];
    }
    if (K == 2) {
        block_rows(y, m * ys, P, OB, tr, Ci, w, Ci, 1, 1, G, width);
        block_rows(y + 2 * ys, m * ys, P, OB, tr + 3 * n, Ci, w + tap, Ci, 1, 1, G, width);
    } else {
        block_rows(y, m * ys, y, m * ys, tr, Ci, w, Ci, 1, 1, G, width);
        block_rows(y + ys, m * ys, P, OB, tr + 3 * n, Ci, w + 2 * tap, Ci, 1, 1, G, width);
    }
}

/* The conv's rows r0 .. r0 + n - 1 (r0 at a group's start) for the output blocks ob0 .. ob1 -
 * 1: groups while whole ones remain, then the direct sum (its source rows copied together into
 * tmp). w: packed with K + 2 taps (see above); transformed: tr already holds these rows'
 * transforms. Scratch: tr 4 * G * Ci, P G * OB, tmp (K + 1) * Ci floats. */
static void wino_rows(float * y, int64_t ys, const rows_src * s, int64_t r0, int64_t n, int K,
                      const float * w, const float * bias, int64_t Ci, int64_t O, int64_t ob0,
                      int64_t ob1, int transformed, float * tr, float * P, float * tmp) {
    const int64_t m = wino_outputs(K), G = n / m, rest = n - G * m;
    if (G && !transformed) wino_transform(tr, s, r0, G, m, Ci);
    for (int64_t i = 0; rest && i < rest + K - 1; i++) {
        memcpy(tmp + i * Ci, src_row(s, r0 + G * m + i), (size_t)Ci * sizeof(float));
    }
    for (int64_t ob = ob0; ob < ob1; ob++) {
        const int64_t o0 = ob * OB;
        const int width = (int)(O - o0 < OB ? O - o0 : OB);
        const float * wb = w + ob * (K + 2) * Ci * OB;
        if (G) wino_block(y + o0, ys, tr, G, Ci, K, wb, bias + o0, width, P);
        if (rest) {
            block_rows(y + G * m * ys + o0, ys, bias + o0, 0, tmp, Ci, wb, Ci, K, 1, rest,
                       width);
        }
    }
}

/* qtts_conv1d_tm_op with QTTS_CONV_WINOGRAD: the conv in Winograd groups (see wino_rows).
 * Units of (time chunk, output block) as in the direct op, time chunks a whole number of
 * groups; a thread transforms a chunk's rows once for its consecutive units of that chunk. */
static void conv1d_winograd(struct ggml_tensor * dst, int ith, int nth) {
    const struct ggml_tensor * x = dst->src[0];
    const struct ggml_tensor * wt = dst->src[1];
    const struct ggml_tensor * bt = dst->src[2];
    const struct ggml_tensor * ht = dst->src[3];
    const int64_t Ci = x->ne[0], O = dst->ne[0], T = dst->ne[1];
    const int64_t n_ob = (O + OB - 1) / OB;
    const int K = (int)wt->ne[2] - 2;
    GGML_ASSERT(K == 2 || K == 3);
    GGML_ASSERT(x->type == GGML_TYPE_F32 && wt->type == GGML_TYPE_F32);
    GGML_ASSERT(bt->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32);
    GGML_ASSERT(ht != NULL && ht->type == GGML_TYPE_F32 && ht->ne[0] == Ci);
    GGML_ASSERT(ht->ne[1] == K - 1 && ht->nb[0] == sizeof(float));
    GGML_ASSERT(ht->ne[2] == 1 && ht->ne[3] == 1);
    GGML_ASSERT(wt->ne[0] == OB && wt->ne[1] == Ci && wt->ne[3] == n_ob);
    GGML_ASSERT(ggml_is_contiguous(wt) && ggml_nelements(bt) == O && ggml_is_contiguous(bt));
    GGML_ASSERT(x->ne[1] == T && x->ne[2] == 1 && x->ne[3] == 1 && x->nb[0] == sizeof(float));
    GGML_ASSERT(ggml_is_contiguous(dst));
    const rows_src src = {
        .h = (const float *)ht->data, .hs = (int64_t)(ht->nb[1] / sizeof(float)), .ph = K - 1,
        .x = (const float *)x->data, .xs = (int64_t)(x->nb[1] / sizeof(float)),
    };
    const int64_t m = wino_outputs(K), step = m * NT_MAIN;
    const int64_t n_tc = (T + TCHUNK - 1) / TCHUNK;
    const int64_t tlen = ((T + n_tc - 1) / n_tc + step - 1) / step * step;
    const int64_t gmax = tlen / m;
    float * tr = (float *)qtts_scratch_get(
        QTTS_SCRATCH_F32_STAGE,
        (size_t)(4 * gmax * Ci + gmax * OB + (K + 1) * Ci) * sizeof(float));
    const int64_t units = n_ob * n_tc;
    const int64_t u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    int64_t done = -1; /* the time chunk whose rows tr holds */
    for (int64_t u = u0; u < u1; u++) {
        const int64_t tc = u / n_ob, ob = u % n_ob;
        const int64_t t0 = tc * tlen, t1 = t0 + tlen < T ? t0 + tlen : T;
        wino_rows((float *)dst->data + t0 * O, O, &src, t0, t1 - t0, K,
                  (const float *)wt->data, (const float *)bt->data, Ci, O, ob, ob + 1,
                  done == tc, tr, tr + 4 * gmax * Ci, tr + 4 * gmax * Ci + gmax * OB);
        done = tc;
    }
}

void qtts_conv1d_tm_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    if ((int64_t)(intptr_t)userdata == (1 | QTTS_CONV_WINOGRAD)) {
        conv1d_winograd(dst, ith, nth);
        return;
    }
    const struct ggml_tensor * x = dst->src[0];
    const struct ggml_tensor * wt = dst->src[1];
    const struct ggml_tensor * bt = dst->src[2];
    const struct ggml_tensor * ht = dst->src[3]; /* optional: the history rows, apart from x */
    const int64_t d = (int64_t)(intptr_t)userdata;
    GGML_ASSERT(x->type == GGML_TYPE_F32 && wt->type == GGML_TYPE_F32);
    GGML_ASSERT(bt->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32);
    const int64_t Ci = x->ne[0], O = dst->ne[0], T = dst->ne[1];
    const int K = (int)wt->ne[2];
    const int64_t n_ob = (O + OB - 1) / OB;
    const int64_t P = (int64_t)(K - 1) * d; /* history rows */
    const int64_t ph = ht ? P : 0;          /* rows of xp that come from ht */
    GGML_ASSERT(wt->ne[0] == OB && wt->ne[1] == Ci && wt->ne[3] == n_ob && ggml_is_contiguous(wt));
    GGML_ASSERT(ggml_nelements(bt) == O && ggml_is_contiguous(bt));
    GGML_ASSERT(d >= 1 && x->ne[1] + ph == T + P && x->ne[2] == 1 && x->ne[3] == 1);
    GGML_ASSERT(x->nb[0] == sizeof(float) && ggml_is_contiguous(dst));
    if (ht) {
        GGML_ASSERT(ht->type == GGML_TYPE_F32 && ht->ne[0] == Ci && ht->ne[1] == P);
        GGML_ASSERT(ht->ne[2] == 1 && ht->ne[3] == 1 && ht->nb[0] == sizeof(float));
    }

    const int64_t xs = (int64_t)(x->nb[1] / sizeof(float));
    const float * xp = (const float *)x->data;
    const float * w = (const float *)wt->data;
    const float * bias = (const float *)bt->data;
    float * y = (float *)dst->data;

    /* The logical input is xp = [ht rows 0 .. ph | x rows]. A tile at t >= ph reads rows
     * t .. t + NT_MAIN - 1 + P of xp, all in x (row r of xp is x row r - ph). The tiles at
     * t < ph read across the join: for them the thread copies xp rows 0 .. stage_rows once
     * into a contiguous scratch (row stride Ci) and runs the same tile on it, so every
     * element is summed exactly as for a concatenated xp. Such a tile starts before row ph
     * and spans at most NT_MAIN steps, so it reads below row min(T, ph - 1 + NT_MAIN) + P. */
    const int64_t stage_rows = ph ? (T < ph - 1 + NT_MAIN ? T : ph - 1 + NT_MAIN) + P : 0;
    const float * stage = NULL;

    /* Input channels are summed in chunks of <= KC_MAX (the chunking depends on C_in only,
     * so the summation order is the same for any thread count): per (chunk, block) the
     * packed weight strip K x nc x OB floats (<= 7*256*32*4 = 229 KB) is one contiguous
     * stretch that stays in L2 across the unit's tiles. Measured on Zen 4 (1 MB L2, 1 thread,
     * C = 96..1536): 108-114 GFLOP/s with KC_MAX 128, 256 or unchunked and TCHUNK 384 or 768
     * alike (192: -4 %); the chunking is insurance for smaller L2s. Before the weights were
     * packed (rows of C_out floats) C >= 384 lost 10-50 % and chunking won that partly back. */
    const int64_t kc = chunk_width(Ci);

    /* Time chunks of equal length (a multiple of the tile) rather than TCHUNK and a remainder:
     * units are shared out in contiguous ranges, so with few chunks (T = 250: 192 + 58 steps)
     * one thread would get most of the work. */
    const int64_t n_tc = (T + TCHUNK - 1) / TCHUNK;
    const int64_t tlen = ((T + n_tc - 1) / n_tc + NT_MAIN - 1) / NT_MAIN * NT_MAIN;
    const int64_t units = n_ob * n_tc;
    const int64_t u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t tc = u / n_ob, ob = u % n_ob;
        const int64_t o0 = ob * OB;
        const int width = (int)(O - o0 < OB ? O - o0 : OB);
        const tile_fn * fns = width == OB ? TILE_FULL : TILE_MASK;
        const int64_t t_end = (tc + 1) * tlen < T ? (tc + 1) * tlen : T;
        if (tc * tlen < ph && stage == NULL) {
            float * s = (float *)qtts_scratch_get(QTTS_SCRATCH_F32_STAGE,
                                                  (size_t)(stage_rows * Ci) * sizeof(float));
            const float * hp = (const float *)ht->data;
            const int64_t hs = (int64_t)(ht->nb[1] / sizeof(float));
            for (int64_t r = 0; r < stage_rows; r++) {
                const float * src = r < ph ? hp + r * hs : xp + (r - ph) * xs;
                memcpy(s + r * Ci, src, (size_t)Ci * sizeof(float));
            }
            stage = s;
        }
        for (int64_t c0 = 0; c0 < Ci; c0 += kc) {
            const int64_t nc = Ci - c0 < kc ? Ci - c0 : kc;
            const float * wc = w + (ob * K * Ci + c0) * OB;
            for (int64_t t = tc * tlen; t < t_end; t += NT_MAIN) {
                const int nt = (int)(t_end - t < NT_MAIN ? t_end - t : NT_MAIN);
                float * out = y + t * O + o0;
                const int staged = t < ph;
                const conv_args at = {
                    .xp = staged ? stage + t * Ci + c0 : xp + (t - ph) * xs + c0,
                    .xs = staged ? Ci : xs, .w = wc, .wks = Ci * OB, .d = d, .nc = nc, .K = K,
                };
                if (c0 == 0) {
                    fns[nt](out, O, bias + o0, 0, &at, width);
                } else {
                    fns[nt](out, O, out, O, &at, width);
                }
            }
        }
    }
}

void qtts_conv_rows(float * y, int64_t ys, const float * xp, int64_t xs, const float * w,
                    int64_t wbs, const float * bias, int64_t Ci, int64_t O, int K, int64_t d,
                    int64_t n) {
    wbs = wbs ? wbs : (int64_t)K * Ci * OB;
    for (int64_t o0 = 0; o0 < O; o0 += OB) {
        const int width = (int)(O - o0 < OB ? O - o0 : OB);
        block_rows(y + o0, ys, bias + o0, 0, xp, xs, w + o0 / OB * wbs, Ci, K, d, n, width);
    }
}

#ifndef SEANET_SLICE_BYTES
#define SEANET_SLICE_BYTES (512 * 1024) /* a slice's ELU(h), r and output together */
#endif
#ifndef SEANET_STAGE_SLICE_BYTES
/* the same in a stage, whose strided conv reads its weights once per slice: longer slices
 * (the best of 0.5 to 2 MB for the codec encoder, docs/performance.md) */
#define SEANET_STAGE_SLICE_BYTES (1536 * 1024)
#endif

/* A SEANet residual unit's weights and shapes (see qtts_ops.h), read from a node's sources
 * src[0] (h) .. src[4] (b1) and its flags, every shape checked. */
typedef struct {
    const float * h;
    const float * w3;
    const float * b3;
    const float * w1;
    const float * b1;
    int64_t C, R, T, d, P;
    int K;
    int elu_out;
    int wino; /* its K = 3 conv in Winograd F(2, 3) groups (w3 packed with 5 taps) */
} seanet_unit;

static seanet_unit seanet_unit_get(const struct ggml_tensor * dst, int64_t flags) {
    const struct ggml_tensor * h = dst->src[0];
    const struct ggml_tensor * w3 = dst->src[1];
    const struct ggml_tensor * b3 = dst->src[2];
    const struct ggml_tensor * w1 = dst->src[3];
    const struct ggml_tensor * b1 = dst->src[4];
    seanet_unit u = {
        .h = (const float *)h->data, .w3 = (const float *)w3->data,
        .b3 = (const float *)b3->data, .w1 = (const float *)w1->data,
        .b1 = (const float *)b1->data, .C = b1->ne[0], .R = b3->ne[0], .T = h->ne[1],
        .d = flags & QTTS_CONV_DILATION_MASK, .K = (int)w3->ne[2],
        .elu_out = (flags & QTTS_SEANET_ELU_OUT) != 0,
        .wino = (flags & QTTS_SEANET_UNIT_WINO) != 0,
    };
    if (u.wino) {
        GGML_ASSERT(u.K == 5 && u.d == 1);
        u.K = 3;
    }
    u.P = (int64_t)(u.K - 1) * u.d;
    GGML_ASSERT(h->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32 && u.d >= 1);
    GGML_ASSERT(ggml_is_contiguous(h) && ggml_is_contiguous(dst) && h->ne[2] == 1 && h->ne[3] == 1);
    GGML_ASSERT(w3->type == GGML_TYPE_F32 && ggml_is_contiguous(w3) && w3->ne[0] == OB);
    GGML_ASSERT(w3->ne[1] == u.C && w3->ne[3] == (u.R + OB - 1) / OB);
    GGML_ASSERT(w1->type == GGML_TYPE_F32 && ggml_is_contiguous(w1) && w1->ne[0] == OB);
    GGML_ASSERT(w1->ne[1] == u.R && w1->ne[2] == 1 && w1->ne[3] == (u.C + OB - 1) / OB);
    GGML_ASSERT(b3->type == GGML_TYPE_F32 && ggml_is_contiguous(b3) && ggml_nelements(b3) == u.R);
    GGML_ASSERT(b1->type == GGML_TYPE_F32 && ggml_is_contiguous(b1) && ggml_nelements(b1) == u.C);
    GGML_ASSERT(dst->src[7] != NULL || h->ne[0] == u.C); /* else h is the pre-conv's input */
    return u;
}

/* Rows of a slice: a multiple of the tile, its three buffers (and the transforms of Winograd
 * groups) within `bytes`. */
static int64_t unit_slice_rows(const seanet_unit * u, int64_t bytes) {
    const int64_t S = bytes / (int64_t)sizeof(float) / (2 * u->C + u->R + 2 * u->C * u->wino);
    return S < NT_MAIN ? NT_MAIN : S / NT_MAIN * NT_MAIN;
}

/* Scratch floats of unit_rows for n rows: e, r and (Winograd groups) their transforms. */
static int64_t unit_scratch(const seanet_unit * u, int64_t n) {
    const int64_t m = n + 2, g = m / 2; /* conv rows at most, and their groups */
    return (u->P + m) * u->C + m * u->R + (u->wino ? 4 * g * u->C + g * OB + 4 * u->C : 0);
}

/* Rows t0 .. t0+n-1 of the unit's output into y (row stride C), from hs: h's row t0, the
 * min(P + wino, t0) rows before it and (wino, t0 + n < T) the one after the last; scratch:
 * unit_scratch(n) floats. With Winograd groups the K = 3 conv runs over whole groups of two
 * rows from an even time step, one row more at either end where needed, so that every row is
 * summed the same way whatever the slice. */
static void unit_rows(const seanet_unit * u, float * y, const float * hs, int64_t t0, int64_t n,
                      float * scratch) {
    const int64_t C = u->C, P = u->P, R = u->R;
    int64_t a0 = t0, a1 = t0 + n;
    if (u->wino) {
        a0 = t0 / 2 * 2;
        a1 += (a1 & 1) && a1 < u->T;
    }
    const int64_t m = a1 - a0, g = m / 2;
    float * e = scratch;
    float * r = e + (P + m) * C;
    /* e = ELU(h) over rows a0 - P .. a1 - 1; rows before 0 are the conv's zero padding */
    const int64_t zr = P - a0 > 0 ? P - a0 : 0;
    memset(e, 0, (size_t)(zr * C) * sizeof(float));
    qtts_elu_span(e + zr * C, hs - (t0 - a0 + P - zr) * C, (P + m - zr) * C);
    if (u->wino) {
        float * tr = r + m * R;
        const rows_src src = {.x = e, .xs = C};
        wino_rows(r, R, &src, 0, m, 3, u->w3, u->b3, C, R, 0, (R + OB - 1) / OB, 0, tr,
                  tr + 4 * g * C, tr + 4 * g * C + g * OB);
    } else {
        qtts_conv_rows(r, R, e, C, u->w3, 0, u->b3, C, R, u->K, u->d, m);
    }
    r += (t0 - a0) * R;
    qtts_elu_span(r, r, n * R);
    qtts_conv_rows(y, C, r, R, u->w1, 0, u->b1, R, C, 1, 1, n);
    for (int64_t i = 0; i < n * C; i++) y[i] = hs[i] + y[i];
    if (u->elu_out) qtts_elu_span(y, y, n * C);
}

void qtts_seanet_unit_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const seanet_unit u = seanet_unit_get(dst, (int64_t)(intptr_t)userdata);
    GGML_ASSERT(dst->ne[0] == u.C && dst->ne[1] == u.T);
    const int64_t S = unit_slice_rows(&u, SEANET_SLICE_BYTES);
    const int64_t t0 = u.T * ith / nth, t1 = u.T * (ith + 1) / nth;
    if (t0 >= t1) return;
    float * e = (float *)qtts_scratch_get(QTTS_SCRATCH_SEANET,
                                          (size_t)unit_scratch(&u, S) * sizeof(float));
    for (int64_t s0 = t0; s0 < t1; s0 += S) {
        const int64_t n = t1 - s0 < S ? t1 - s0 : S;
        unit_rows(&u, (float *)dst->data + s0 * u.C, u.h + s0 * u.C, s0, n, e);
    }
}

/* A stage's first conv, when the node makes h itself (src[7], src[8]). */
typedef struct {
    const float * x;  /* the pre-conv's input [T] (one channel), or NULL: h is in u.h */
    const float * w0; /* its packed weight (1 -> C, K0 taps) and bias */
    const float * b0;
    int K0;
} seanet_preconv;

/* The h rows unit_rows reads for its rows t0 .. t0 + n - 1 into H (row stride C): rows of h
 * itself, or the pre-conv's output over the input x (one channel, its K0 - 1 rows of zero
 * padding in front; xs: scratch of n + P + K0 + 1 floats). Returns h's row t0. */
static const float * stage_h_rows(const seanet_unit * u, const seanet_preconv * pc, float * H,
                                  float * xs, int64_t t0, int64_t n) {
    if (pc->x == NULL) return u->h + t0 * u->C;
    const int64_t back = t0 < u->P + u->wino ? t0 : u->P + u->wino;
    n += u->wino && t0 + n < u->T;
    const int64_t P0 = pc->K0 - 1, first = t0 - back - P0, rows = back + n + P0;
    for (int64_t i = 0; i < rows; i++) xs[i] = first + i < 0 ? 0.0f : pc->x[first + i];
    qtts_conv_rows(H, u->C, xs, 1, pc->w0, 0, pc->b0, 1, u->C, pc->K0, 1, back + n);
    return H + back * u->C;
}

void qtts_seanet_stage_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const int64_t flags = (int64_t)(intptr_t)userdata;
    seanet_unit u = seanet_unit_get(dst, flags | QTTS_SEANET_ELU_OUT);
    const int wino = (flags & QTTS_SEANET_WINO) != 0;
    const struct ggml_tensor * ws = dst->src[5];
    const struct ggml_tensor * bs = dst->src[6];
    const struct ggml_tensor * w0 = dst->src[7];
    const struct ggml_tensor * b0 = dst->src[8];
    seanet_preconv pc = {0};
    if (w0 != NULL) {
        const struct ggml_tensor * x = dst->src[0];
        GGML_ASSERT(x->ne[0] == 1 && b0 != NULL && b0->type == GGML_TYPE_F32);
        GGML_ASSERT(ggml_is_contiguous(b0) && ggml_nelements(b0) == u.C);
        GGML_ASSERT(w0->type == GGML_TYPE_F32 && ggml_is_contiguous(w0) && w0->ne[0] == OB);
        GGML_ASSERT(w0->ne[1] == 1 && w0->ne[3] == (u.C + OB - 1) / OB);
        pc = (seanet_preconv){.x = (const float *)x->data, .w0 = (const float *)w0->data,
                              .b0 = (const float *)b0->data, .K0 = (int)w0->ne[2]};
    }
    const int64_t st = flags >> QTTS_SEANET_STRIDE_SHIFT, C = u.C, T = u.T;
    const int64_t Ci = st * C, O = bs->ne[0], T_out = (T + st - 1) / st;
    GGML_ASSERT(st >= 1 && dst->ne[0] == O && dst->ne[1] == T_out);
    GGML_ASSERT(ws->type == GGML_TYPE_F32 && ggml_is_contiguous(ws) && ws->ne[0] == OB);
    GGML_ASSERT(ws->ne[1] == Ci && ws->ne[2] == (wino ? 4 : 2));
    GGML_ASSERT(ws->ne[3] == (O + OB - 1) / OB);
    GGML_ASSERT(bs->type == GGML_TYPE_F32 && ggml_is_contiguous(bs));

    /* folded rows of a slice: their unit rows fill about a unit slice; with groups of three
     * a slice and a thread's range start at a group */
    const int64_t step = wino ? 3 * NT_MAIN : NT_MAIN;
    int64_t F = unit_slice_rows(&u, SEANET_STAGE_SLICE_BYTES) / st / step * step;
    F = F < step ? step : F;
    int64_t f0 = T_out * ith / nth, f1 = T_out * (ith + 1) / nth;
    if (wino) {
        f0 = f0 / 3 * 3;
        f1 = ith == nth - 1 ? T_out : f1 / 3 * 3;
    }
    if (f0 >= f1) return;
    const int64_t n_max = F * st; /* unit rows a slice computes at most */
    const int64_t h_rows = pc.x != NULL ? u.P + n_max + 2 : 0;
    const int64_t x_rows = pc.x ? h_rows + pc.K0 : 0;
    const int64_t g_max = wino ? F / 3 : 0;
    const int64_t wino_floats = wino ? 4 * g_max * Ci + g_max * OB + 3 * Ci : 0;
    const int64_t unit_floats = unit_scratch(&u, n_max);
    float * e = (float *)qtts_scratch_get(
        QTTS_SCRATCH_SEANET, (size_t)(unit_floats + (F + 1) * Ci + h_rows * C + x_rows +
                                      wino_floats) * sizeof(float));
    float * U = e + unit_floats; /* folded rows: the one before the slice, then the slice's */
    float * H = U + (F + 1) * Ci; /* the pre-conv's rows */
    float * xs = H + h_rows * C;
    float * tr = xs + x_rows; /* the Winograd transforms, products and last rows */
    const float * w = (const float *)ws->data;
    const float * b = (const float *)bs->data;
    float * y = (float *)dst->data;
    /* the folded row before the first: the conv's zero padding, or this unit's rows */
    if (f0 == 0) {
        memset(U, 0, (size_t)Ci * sizeof(float));
    } else {
        const int64_t a = (f0 - 1) * st;
        unit_rows(&u, U, stage_h_rows(&u, &pc, H, xs, a, st), a, st, e);
    }
    for (int64_t s0 = f0; s0 < f1; s0 += F) {
        const int64_t nf = f1 - s0 < F ? f1 - s0 : F;
        const int64_t a = s0 * st, n = (s0 + nf) * st < T ? nf * st : T - a;
        unit_rows(&u, U + Ci, stage_h_rows(&u, &pc, H, xs, a, n), a, n, e);
        /* past the input's end: the zeros that complete the last window */
        memset(U + Ci + n * C, 0, (size_t)((nf * st - n) * C) * sizeof(float));
        if (wino) {
            const rows_src src = {.x = U, .xs = Ci};
            wino_rows(y + s0 * O, O, &src, 0, nf, 2, w, b, Ci, O, 0, (O + OB - 1) / OB, 0, tr,
                      tr + 4 * g_max * Ci, tr + 4 * g_max * Ci + g_max * OB);
        } else {
            qtts_conv_rows(y + s0 * O, O, U, Ci, w, 0, b, Ci, O, 2, 1, nf);
        }
        memcpy(U, U + nf * Ci, (size_t)Ci * sizeof(float));
    }
}
