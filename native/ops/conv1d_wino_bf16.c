/* The K = 7 and K = 2 BF16 causal dilated convs of conv1d_tm_bf16.c (same sources, flags and
 * contract) with fewer multiplies: Winograd F(2,3) / F(2,2) over pairs of output steps (t, t + d).
 *
 * Taps {0,1,2} (group A, rows t .. t+3d) and {3,4,5} (group B, rows t+3d .. t+6d) each give the
 * pair's two outputs from four products instead of six:
 *   D1 = x0 - x2, D2 = x1 + x2, D3 = x2 - x1, D4 = x1 - x3        (x_i = row s + i*d, s = t or t+3d)
 *   G1 = g0, G2 = (g0 + g1 + g2) / 2, G3 = (g0 - g1 + g2) / 2, G4 = g2
 *   M_i = sum_c G_i D_i,  y(t) = M1 + M2 + M3,  y(t + d) = M2 - M3 - M4;
 * tap 6 adds g6 * x(t + 6d) to M1 and -g6 * x(t + 7d) to M4. Both groups and tap 6 share the four
 * sums M1..M4 (the output transform is linear), so a pair costs 10 channel-contractions, not 14.
 * D_i are formed in F32 from the (snaked) input and rounded to BF16 like the direct kernel's
 * input; the transformed weights are rounded to BF16 at packing. Measured on random data: SNR
 * 50.8 dB against the exact conv, vs 52.3 dB for the direct BF16 kernel (F(3,3): 46 dB, F(2,7):
 * 40 dB, hence this form).
 *
 * K = 2 (the decoder's transposed convs in polyphase form): F(2,2) at the points 1/2, -1/2, inf
 * (1.9 dB better than 0, 1, inf; all scales powers of two), three products per pair instead of
 * four: D1 = x0/2 + x1, D2 = x1 - x0/2, D3 = x2 - x0/4; G1 = g0 + g1/2, G2 = g1/2 - g0, G3 = g1;
 * y(t) = M1 + M2, y(t + d) = (M1 - M2)/2 + M3 (x_i = row t + i*d; SNR 51.7 dB on random data
 * vs 52.3 for the direct kernel).
 *
 * Layout: w BF16 contiguous, ne = [2*B, 10, ceil(C_in/2), ceil(C_out/B)] (numpy [n_blocks, cp,
 * 10, B, 2]): slot k of input pair p holds, per output lane i, the pair (G[2p], G[2p+1]) of slot
 * k: A.G1..A.G4, B.G1..B.G4, g6, -g6 (qtts_ops.h, pack_conv_weight_wino_bf16).
 *
 * Work: units (time chunk, block of 32 output channels) as the direct kernel; chunks start at
 * multiples of 2d, so a chunk holds whole pairs (the last one may end mid-pair: y(t + d) past T
 * is not written). Per chunk each thread stages the snaked input rows in F32, then builds, per
 * row s and input pair p, the record (D1..D4)(s) as BF16 pairs (16 bytes) and the plain row x(s)
 * as BF16 pairs. A tile is 32 output channels x 3 pairs: 4 x 3 x 2 accumulators in registers; per
 * input pair it loads the 10 slots' weight vectors and broadcasts each pair's record entries.
 */
#include <stdint.h>
#include <string.h>

#include "qtts_conv_srcs.h"
#include "qtts_bf16.h"
#include "qtts_ops.h"
#include "qtts_scratch.h"

#define INLINE static inline __attribute__((always_inline))
#define OB QTTS_CONV_BF16_BLOCK /* 32 output channels per packed block */
#define VW 16
#define NPAIR 3                 /* output pairs per tile (K = 7) */
#define NSLOT 10                /* weight slots per input pair (K = 7) */
#define NPAIR2 4                /* K = 2 */
#define NSLOT2 3
#define TCH_MAX 384             /* most time steps per chunk */
#define SCRATCH_BUDGET (640 * 1024) /* staged rows + records of one chunk, per thread (L2) */
/* Wide convs: when a chunk that fits L2 is short (< WIDE_MIN_STEPS) or the weight is too big to
 * stay in L3 between chunks (> WIDE_WEIGHT), every chunk would stream the whole weight again;
 * chunks of up to WIDE_BUDGET (L3) instead, each tile reading its records from L3. Measured: 768
 * channels K = 7 0.6x -> 1.27x the direct kernel; 768 -> 1920 K = 2 (8.8 MB of weights) is
 * faster with L2 chunks (records re-read from L3 by every output block cost more there). */
#define WIDE_MIN_STEPS 64
#define WIDE_WEIGHT (16 * 1024 * 1024)
#define WIDE_BUDGET (16 * 1024 * 1024)
#define WIDE_TCH_MAX 4096

static inline uint32_t bf16_pair(float lo, float hi) {
    return (uint32_t)f32_to_bf16(lo) | ((uint32_t)f32_to_bf16(hi) << 16);
}

/* ---- records ------------------------------------------------------------------------------- */

/* From n staged rows: xb[s][p] = row s as BF16 pairs (all s), rec[s][p][0..3] = D1..D4 of row s
 * (s + 3d < n). Odd C_in: the last pair is (x, 0). */
static void build_records(uint32_t * rec, uint32_t * xb, const float * st, int64_t n, int64_t ci,
                          int64_t cp, int64_t d) {
    const int64_t nd = n - 3 * d;
    for (int64_t s = 0; s < n; s++) {
        const float * x0 = st + s * ci;
        uint32_t * xo = xb + s * cp;
        uint32_t * ro = rec + s * cp * 4;
        int64_t c = 0;
#if BF16_SIMD
        for (; c + 32 <= ci; c += 32) {
            const __m512 lo = _mm512_loadu_ps(x0 + c), hi = _mm512_loadu_ps(x0 + c + 16);
            /* dword q = channels (c + 2q, c + 2q + 1): 16 pairs in order */
            _mm512_storeu_si512((void *)(xo + c / 2), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            if (s < nd) {
                const float * x1 = x0 + d * ci;
                const float * x2 = x0 + 2 * d * ci;
                const float * x3 = x0 + 3 * d * ci;
                const __m512 a0 = lo, b0 = hi;
                const __m512 a1 = _mm512_loadu_ps(x1 + c), b1 = _mm512_loadu_ps(x1 + c + 16);
                const __m512 a2 = _mm512_loadu_ps(x2 + c), b2 = _mm512_loadu_ps(x2 + c + 16);
                const __m512 a3 = _mm512_loadu_ps(x3 + c), b3 = _mm512_loadu_ps(x3 + c + 16);
                __m512i D[4];
                D[0] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b0, b2), _mm512_sub_ps(a0, a2));
                D[1] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(b1, b2), _mm512_add_ps(a1, a2));
                D[2] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b2, b1), _mm512_sub_ps(a2, a1));
                D[3] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b1, b3), _mm512_sub_ps(a1, a3));
                /* 16 pairs x (D1..D4) -> records of 4 dwords: 4x4 transposes in 128-bit lanes,
                 * then of the lanes */
                const __m512i t0 = _mm512_unpacklo_epi32(D[0], D[1]);
                const __m512i t1 = _mm512_unpacklo_epi32(D[2], D[3]);
                const __m512i t2 = _mm512_unpackhi_epi32(D[0], D[1]);
                const __m512i t3 = _mm512_unpackhi_epi32(D[2], D[3]);
                const __m512i u0 = _mm512_unpacklo_epi64(t0, t1); /* lane L: pair 4L */
                const __m512i u1 = _mm512_unpackhi_epi64(t0, t1); /* pair 4L + 1 */
                const __m512i u2 = _mm512_unpacklo_epi64(t2, t3); /* pair 4L + 2 */
                const __m512i u3 = _mm512_unpackhi_epi64(t2, t3); /* pair 4L + 3 */
                const __m512i v0 = _mm512_shuffle_i32x4(u0, u1, 0x44); /* u0.L0 u0.L1 u1.L0 u1.L1 */
                const __m512i v1 = _mm512_shuffle_i32x4(u2, u3, 0x44);
                const __m512i v2 = _mm512_shuffle_i32x4(u0, u1, 0xEE); /* L2, L3 */
                const __m512i v3 = _mm512_shuffle_i32x4(u2, u3, 0xEE);
                uint32_t * r = ro + (c / 2) * 4;
                /* pairs 0..3 = u0.L0 u1.L0 u2.L0 u3.L0, etc. */
                _mm512_storeu_si512((void *)(r + 0), _mm512_shuffle_i32x4(v0, v1, 0x88));
                _mm512_storeu_si512((void *)(r + 16), _mm512_shuffle_i32x4(v0, v1, 0xDD));
                _mm512_storeu_si512((void *)(r + 32), _mm512_shuffle_i32x4(v2, v3, 0x88));
                _mm512_storeu_si512((void *)(r + 48), _mm512_shuffle_i32x4(v2, v3, 0xDD));
            }
        }
#endif
        for (; c < ci; c += 2) {
            const int two = c + 1 < ci;
            const int64_t p = c / 2;
            xo[p] = bf16_pair(x0[c], two ? x0[c + 1] : 0.0f);
            if (s < nd) {
                const float * x1 = x0 + d * ci;
                const float * x2 = x0 + 2 * d * ci;
                const float * x3 = x0 + 3 * d * ci;
                float v[4][2];
                for (int e = 0; e < 2; e++) {
                    const int64_t k = c + e;
                    const int ok = e == 0 || two;
                    const float a0 = ok ? x0[k] : 0.0f, a1 = ok ? x1[k] : 0.0f;
                    const float a2 = ok ? x2[k] : 0.0f, a3 = ok ? x3[k] : 0.0f;
                    v[0][e] = a0 - a2;
                    v[1][e] = a1 + a2;
                    v[2][e] = a2 - a1;
                    v[3][e] = a1 - a3;
                }
                for (int i = 0; i < 4; i++) ro[p * 4 + i] = bf16_pair(v[i][0], v[i][1]);
            }
        }
    }
}

/* ---- tiles ----------------------------------------------------------------------------------- */

typedef struct {
    const uint32_t * rec; /* records of the chunk: row s, pair p at rec + (s*cp + p)*4 */
    const uint32_t * xb;  /* plain rows: xb + s*cp + p */
    const uint16_t * w;   /* the output block's weights: pair p, slot k at w + (p*10 + k)*64 */
    int64_t cp, d;
} wino_args;

/* Where a tile's pairs go: pair j's outputs y(t) at y0[j], y(t + d) at y1[j] (NULL: past the
 * end), residual rows r0[j], r1[j] (NULL: none); bias and the valid lanes of the block. */
typedef struct {
    float * y0[NPAIR2];
    float * y1[NPAIR2];
    const float * r0[NPAIR2];
    const float * r1[NPAIR2];
    const float * bias;
    int width;
} wino_out;

/* The sums M[i][j] (i: M1..M4, j: pair) for the pairs starting at rows s[j] of the chunk, over
 * all input pairs, then the output transform y(t) = M1 + M2 + M3 (+ bias, + residual),
 * y(t + d) = M2 - M3 - M4 (+ bias, + residual). */
typedef void (*wtile_fn)(const wino_args * a, const int64_t * s, const wino_out * out);

#if BF16_SIMD

INLINE __m512 dpbf16(__m512 acc, __m512bh w, __m512bh x) {
    /* inline asm: GCC 12 spills the tile's 24 accumulators around the intrinsic */
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}

/* acc[j] (2 x 16 lanes) += slot weights w (32 output lanes x an input pair) * the input pair at
 * px[j][off], for NP pairs. */
INLINE void slot_dp(const int NP, __m512 (*acc)[2], const uint16_t * w,
                    const uint32_t * const * px, int64_t off) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(w + 32));
#pragma GCC unroll 4
    for (int j = 0; j < NP; j++) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32((int)px[j][off]);
        acc[j][0] = dpbf16(acc[j][0], w0, b);
        acc[j][1] = dpbf16(acc[j][1], w1, b);
    }
}

/* The 16-lane masks of an output block's `width` valid channels. */
INLINE void block_masks(int width, __mmask16 * mk) {
    for (int v = 0; v < 2; v++) {
        int rem = width - v * VW;
        rem = rem < 0 ? 0 : (rem > VW ? VW : rem);
        mk[v] = (__mmask16)((1u << rem) - 1u);
    }
}

/* Stores y (+ the residual row r, when there is one) to the valid lanes of row o. */
INLINE void store_row(float * o, const float * r, __m512 y, int v, const __mmask16 * mk) {
    if (r) y = _mm512_add_ps(_mm512_maskz_loadu_ps(mk[v], r + v * VW), y);
    _mm512_mask_storeu_ps(o + v * VW, mk[v], y);
}

INLINE void wtile(const int NP, const wino_args * a, const int64_t * s, const wino_out * out) {
    const int64_t cp = a->cp, d = a->d;
    __m512 acc[4][NPAIR][2];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
#pragma GCC unroll 3
        for (int j = 0; j < NP; j++) acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();
    }
    const uint32_t * pa[NPAIR];
    const uint32_t * pb[NPAIR];
    const uint32_t * p6[NPAIR];
    const uint32_t * p7[NPAIR];
#pragma GCC unroll 3
    for (int j = 0; j < NP; j++) {
        pa[j] = a->rec + s[j] * cp * 4;
        pb[j] = a->rec + (s[j] + 3 * d) * cp * 4;
        p6[j] = a->xb + (s[j] + 6 * d) * cp;
        p7[j] = a->xb + (s[j] + 7 * d) * cp;
    }
    const uint16_t * w = a->w;
    for (int64_t p = 0; p < cp; p++, w += NSLOT * 2 * OB) {
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            slot_dp(NP, acc[i], w + i * 64, pa, p * 4 + i);
            slot_dp(NP, acc[i], w + (4 + i) * 64, pb, p * 4 + i);
        }
        slot_dp(NP, acc[0], w + 8 * 64, p6, p);
        slot_dp(NP, acc[3], w + 9 * 64, p7, p);
    }
    __mmask16 mk[2];
    block_masks(out->width, mk);
#pragma GCC unroll 3
    for (int j = 0; j < NP; j++) {
#pragma GCC unroll 2
        for (int v = 0; v < 2; v++) {
            const __m512 b = _mm512_maskz_loadu_ps(mk[v], out->bias + v * VW);
            store_row(out->y0[j], out->r0[j],
                      _mm512_add_ps(b, _mm512_add_ps(_mm512_add_ps(acc[0][j][v], acc[1][j][v]),
                                                     acc[2][j][v])), v, mk);
            if (out->y1[j]) {
                store_row(out->y1[j], out->r1[j],
                          _mm512_add_ps(b, _mm512_sub_ps(_mm512_sub_ps(acc[1][j][v],
                                                                       acc[2][j][v]),
                                                         acc[3][j][v])), v, mk);
            }
        }
    }
}

#define WTILE_ARGS const wino_args * a, const int64_t * s, const wino_out * out
static void wtile_1(WTILE_ARGS) { wtile(1, a, s, out); }
static void wtile_2(WTILE_ARGS) { wtile(2, a, s, out); }
static void wtile_3(WTILE_ARGS) { wtile(3, a, s, out); }

#else

/* acc += the two products of a weight pair and an input pair, odd product first (VDPBF16PS) */
static inline float dp_pair(float acc, const uint16_t * w2, uint32_t x) {
    const float s = acc + bf16_to_f32(w2[1]) * bf16_to_f32((uint16_t)(x >> 16));
    return s + bf16_to_f32(w2[0]) * bf16_to_f32((uint16_t)(x & 0xFFFFu));
}

static void wtile_generic(int NP, const wino_args * a, const int64_t * s, const wino_out * out) {
    const int64_t cp = a->cp, d = a->d;
    float acc[4][NPAIR][2 * VW];
    memset(acc, 0, sizeof(acc));
    for (int64_t p = 0; p < cp; p++) {
        const uint16_t * w = a->w + p * NSLOT * 2 * OB;
        for (int j = 0; j < NP; j++) {
            const uint32_t * ra = a->rec + (s[j] * cp + p) * 4;
            const uint32_t * rb = a->rec + ((s[j] + 3 * d) * cp + p) * 4;
            const uint32_t x6 = a->xb[(s[j] + 6 * d) * cp + p];
            const uint32_t x7 = a->xb[(s[j] + 7 * d) * cp + p];
            for (int o = 0; o < OB; o++) {
                for (int i = 0; i < 4; i++) {
                    float v = dp_pair(acc[i][j][o], w + i * 64 + 2 * o, ra[i]);
                    acc[i][j][o] = dp_pair(v, w + (4 + i) * 64 + 2 * o, rb[i]);
                }
                acc[0][j][o] = dp_pair(acc[0][j][o], w + 8 * 64 + 2 * o, x6);
                acc[3][j][o] = dp_pair(acc[3][j][o], w + 9 * 64 + 2 * o, x7);
            }
        }
    }
    for (int j = 0; j < NP; j++) {
        for (int i = 0; i < out->width; i++) {
            const float y = out->bias[i] + ((acc[0][j][i] + acc[1][j][i]) + acc[2][j][i]);
            out->y0[j][i] = out->r0[j] ? out->r0[j][i] + y : y;
            if (out->y1[j]) {
                const float z = out->bias[i] + ((acc[1][j][i] - acc[2][j][i]) - acc[3][j][i]);
                out->y1[j][i] = out->r1[j] ? out->r1[j][i] + z : z;
            }
        }
    }
}

#define WTILE_ARGS const wino_args * a, const int64_t * s, const wino_out * out
static void wtile_1(WTILE_ARGS) { wtile_generic(1, a, s, out); }
static void wtile_2(WTILE_ARGS) { wtile_generic(2, a, s, out); }
static void wtile_3(WTILE_ARGS) { wtile_generic(3, a, s, out); }

#endif

static const wtile_fn WTILE[NPAIR + 1] = {0, wtile_1, wtile_2, wtile_3};

/* ---- K = 2: F(2,2) ---------------------------------------------------------------------------- */

/* For pair q (start row s = 2d*(q/d) + q%d) of the staged rows, as BF16 pairs:
 * e[0][q] = x(s)/2 + x(s+d), e[1][q] = x(s+d) - x(s)/2, e[2][q] = x(s+2d) - x(s)/4
 * (e[i] = e0 + i*stride). */
static void build_records_k2(uint32_t * e0, int64_t stride, const float * st, int64_t n_pairs,
                             int64_t ci, int64_t cp, int64_t d) {
    for (int64_t q = 0; q < n_pairs; q++) {
        const int64_t s = 2 * d * (q / d) + q % d;
        const float * x0 = st + s * ci;
        const float * x1 = x0 + d * ci;
        const float * x2 = x0 + 2 * d * ci;
        uint32_t * o1 = e0 + q * cp;
        uint32_t * o2 = o1 + stride;
        uint32_t * o3 = o2 + stride;
        int64_t c = 0;
#if BF16_SIMD
        const __m512 half = _mm512_set1_ps(0.5f), quarter = _mm512_set1_ps(0.25f);
        for (; c + 32 <= ci; c += 32) {
            const __m512 a0 = _mm512_loadu_ps(x0 + c), b0 = _mm512_loadu_ps(x0 + c + 16);
            const __m512 a1 = _mm512_loadu_ps(x1 + c), b1 = _mm512_loadu_ps(x1 + c + 16);
            const __m512 a2 = _mm512_loadu_ps(x2 + c), b2 = _mm512_loadu_ps(x2 + c + 16);
            const __m512 ah = _mm512_mul_ps(a0, half), bh = _mm512_mul_ps(b0, half);
            const __m512 aq = _mm512_mul_ps(a0, quarter), bq = _mm512_mul_ps(b0, quarter);
            _mm512_storeu_si512((void *)(o1 + c / 2), (__m512i)_mm512_cvtne2ps_pbh(
                                    _mm512_add_ps(bh, b1), _mm512_add_ps(ah, a1)));
            _mm512_storeu_si512((void *)(o2 + c / 2), (__m512i)_mm512_cvtne2ps_pbh(
                                    _mm512_sub_ps(b1, bh), _mm512_sub_ps(a1, ah)));
            _mm512_storeu_si512((void *)(o3 + c / 2), (__m512i)_mm512_cvtne2ps_pbh(
                                    _mm512_sub_ps(b2, bq), _mm512_sub_ps(a2, aq)));
        }
#endif
        for (; c < ci; c += 2) {
            float v[3][2];
            for (int e = 0; e < 2; e++) {
                const int ok = e == 0 || c + 1 < ci;
                const float h = ok ? x0[c + e] * 0.5f : 0.0f, q4 = ok ? x0[c + e] * 0.25f : 0.0f;
                const float b1 = ok ? x1[c + e] : 0.0f, b2 = ok ? x2[c + e] : 0.0f;
                v[0][e] = h + b1;
                v[1][e] = b1 - h;
                v[2][e] = b2 - q4;
            }
            o1[c / 2] = bf16_pair(v[0][0], v[0][1]);
            o2[c / 2] = bf16_pair(v[1][0], v[1][1]);
            o3[c / 2] = bf16_pair(v[2][0], v[2][1]);
        }
    }
}

typedef struct {
    const uint32_t * e;  /* pair q's D_i at e + i*stride + q*cp */
    int64_t stride;
    const uint16_t * w;  /* the output block's weights: pair p, slot k at w + (p*3 + k)*64 */
    int64_t cp;
} wino2_args;

typedef void (*wtile2_fn)(const wino2_args * a, int64_t q0, const wino_out * out);

#if BF16_SIMD

INLINE void wtile2(const int NP, const wino2_args * a, int64_t q0, const wino_out * out) {
    const int64_t cp = a->cp;
    __m512 acc[3][NPAIR2][2];
#pragma GCC unroll 3
    for (int i = 0; i < 3; i++) {
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++) acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();
    }
    const uint32_t * pe[3][NPAIR2]; /* D1..D3 of each pair */
#pragma GCC unroll 4
    for (int j = 0; j < NP; j++) {
        pe[0][j] = a->e + (q0 + j) * cp;
        pe[1][j] = pe[0][j] + a->stride;
        pe[2][j] = pe[1][j] + a->stride;
    }
    const uint16_t * w = a->w;
    for (int64_t p = 0; p < cp; p++, w += NSLOT2 * 2 * OB) {
#pragma GCC unroll 3
        for (int i = 0; i < 3; i++) slot_dp(NP, acc[i], w + i * 64, pe[i], p);
    }
    __mmask16 mk[2];
    block_masks(out->width, mk);
    const __m512 half = _mm512_set1_ps(0.5f);
#pragma GCC unroll 4
    for (int j = 0; j < NP; j++) {
#pragma GCC unroll 2
        for (int v = 0; v < 2; v++) {
            const __m512 b = _mm512_maskz_loadu_ps(mk[v], out->bias + v * VW);
            store_row(out->y0[j], out->r0[j],
                      _mm512_add_ps(b, _mm512_add_ps(acc[0][j][v], acc[1][j][v])), v, mk);
            if (out->y1[j]) {
                const __m512 h = _mm512_mul_ps(half, _mm512_sub_ps(acc[0][j][v], acc[1][j][v]));
                store_row(out->y1[j], out->r1[j],
                          _mm512_add_ps(b, _mm512_add_ps(h, acc[2][j][v])), v, mk);
            }
        }
    }
}

#define WTILE2_ARGS const wino2_args * a, int64_t q0, const wino_out * out
static void wtile2_1(WTILE2_ARGS) { wtile2(1, a, q0, out); }
static void wtile2_2(WTILE2_ARGS) { wtile2(2, a, q0, out); }
static void wtile2_3(WTILE2_ARGS) { wtile2(3, a, q0, out); }
static void wtile2_4(WTILE2_ARGS) { wtile2(4, a, q0, out); }

#else

static void wtile2_generic(int NP, const wino2_args * a, int64_t q0, const wino_out * out) {
    const int64_t cp = a->cp;
    float acc[3][NPAIR2][2 * VW];
    memset(acc, 0, sizeof(acc));
    for (int64_t p = 0; p < cp; p++) {
        const uint16_t * w = a->w + p * NSLOT2 * 2 * OB;
        for (int j = 0; j < NP; j++) {
            const uint32_t * e = a->e + (q0 + j) * cp + p;
            for (int o = 0; o < OB; o++) {
                for (int i = 0; i < 3; i++) {
                    acc[i][j][o] = dp_pair(acc[i][j][o], w + i * 64 + 2 * o, e[i * a->stride]);
                }
            }
        }
    }
    for (int j = 0; j < NP; j++) {
        for (int i = 0; i < out->width; i++) {
            const float y = out->bias[i] + (acc[0][j][i] + acc[1][j][i]);
            out->y0[j][i] = out->r0[j] ? out->r0[j][i] + y : y;
            if (out->y1[j]) {
                const float h = 0.5f * (acc[0][j][i] - acc[1][j][i]);
                const float z = out->bias[i] + (h + acc[2][j][i]);
                out->y1[j][i] = out->r1[j] ? out->r1[j][i] + z : z;
            }
        }
    }
}

#define WTILE2_ARGS const wino2_args * a, int64_t q0, const wino_out * out
static void wtile2_1(WTILE2_ARGS) { wtile2_generic(1, a, q0, out); }
static void wtile2_2(WTILE2_ARGS) { wtile2_generic(2, a, q0, out); }
static void wtile2_3(WTILE2_ARGS) { wtile2_generic(3, a, q0, out); }
static void wtile2_4(WTILE2_ARGS) { wtile2_generic(4, a, q0, out); }

#endif

static const wtile2_fn WTILE2[NPAIR2 + 1] = {0, wtile2_1, wtile2_2, wtile2_3, wtile2_4};

/* ---- the op ---------------------------------------------------------------------------------- */

/* Time steps per chunk: a multiple of 2d (at least 2d), at most `cap`, with the chunk's staged
 * rows and records (per_row bytes a row) within `budget`; reach: rows past a pair's start that
 * it reads. */
static int64_t steps_within(int64_t budget, int64_t cap, int64_t per_row, int64_t d,
                            int64_t reach) {
    int64_t rows = budget / per_row - reach;
    if (rows > cap) rows = cap;
    const int64_t steps = rows / (2 * d) * (2 * d);
    return steps < 2 * d ? 2 * d : steps;
}

/* L2-sized chunks, or L3-sized ones for wide convs (see WIDE_MIN_STEPS). */
static int64_t chunk_steps(int64_t per_row, int64_t w_bytes, int64_t d, int64_t reach) {
    const int64_t l2 = steps_within(SCRATCH_BUDGET, TCH_MAX, per_row, d, reach);
    if (l2 >= WIDE_MIN_STEPS && w_bytes <= WIDE_WEIGHT) return l2;
    return steps_within(WIDE_BUDGET, WIDE_TCH_MAX, per_row, d, reach);
}

void qtts_conv1d_wino_bf16_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct ggml_tensor * wt = dst->src[1];
    GGML_ASSERT(wt->type == GGML_TYPE_BF16);
    const int k7 = wt->ne[1] == NSLOT; /* else K = 2: NSLOT2 slots */
    qtts_conv_srcs sr;
    qtts_conv_srcs_get(&sr, dst, (intptr_t)userdata, k7 ? 7 : 2);
    const int64_t d = sr.d, Ci = sr.ci, O = sr.co, T = sr.t;
    const int64_t cp = (Ci + 1) / 2;
    const int64_t n_ob = (O + OB - 1) / OB;
    const int64_t reach = (k7 ? 7 : 2) * d;
    GGML_ASSERT(wt->ne[0] == 2 * OB && (k7 || wt->ne[1] == NSLOT2) && wt->ne[2] == cp &&
                wt->ne[3] == n_ob && ggml_is_contiguous(wt));
    qtts_conv_rows src;
    qtts_conv_rows_of(&src, &sr);
    const uint16_t * w = (const uint16_t *)wt->data;
    const int64_t w_block = cp * (k7 ? NSLOT : NSLOT2) * 2 * OB; /* BF16 per output block */
    const float * bias = (const float *)sr.bias->data;
    const float * res = sr.res ? (const float *)sr.res->data : NULL;
    const int64_t rs = sr.res ? (int64_t)(sr.res->nb[1] / sizeof(float)) : 0;
    float * y = (float *)dst->data;

    /* per staged row: F32 row + records (K = 7: a BF16 row + 4 per row; K = 2: 3 per pair) */
    const int64_t per_row = Ci * (int64_t)sizeof(float) + cp * (k7 ? 5 : 2) * 4;
    /* chunks of tch steps (a multiple of 2d); shorter when that leaves < 4 units per thread */
    int64_t tch = chunk_steps(per_row, n_ob * w_block * 2, d, reach);
    int64_t n_tc = (T + tch - 1) / tch;
    if (n_tc * n_ob < 4 * (int64_t)nth) {
        const int64_t n_blk = (T + 2 * d - 1) / (2 * d); /* 2d-step blocks */
        int64_t want = (4 * (int64_t)nth + n_ob - 1) / n_ob;
        if (want > n_blk) want = n_blk;
        tch = (n_blk + want - 1) / want * (2 * d);
        n_tc = (T + tch - 1) / tch;
    }
    const int64_t units = n_ob * n_tc;
    const int64_t u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    if (u0 >= u1) return;

    const int64_t max_rows = (T < tch ? T : tch) + reach;
    const size_t st_bytes = ((size_t)(max_rows * Ci) * sizeof(float) + 63) & ~(size_t)63;
    const size_t rec_bytes = ((size_t)(max_rows * cp * 4) * sizeof(uint32_t) + 63) & ~(size_t)63;
    const size_t xb_bytes = (size_t)(max_rows * cp) * sizeof(uint32_t);
    uint8_t * scratch = (uint8_t *)qtts_scratch_get(QTTS_SCRATCH_WINO,
                                                    st_bytes + rec_bytes + xb_bytes);
    float * st = (float *)scratch;
    uint32_t * rec = (uint32_t *)(scratch + st_bytes); /* K = 2: D1, D2, D3 of each pair */
    const int64_t e_stride = (max_rows / 2 + 1) * cp;
    uint32_t * xb = (uint32_t *)(scratch + st_bytes + rec_bytes);
    const int npair = k7 ? NPAIR : NPAIR2;
    int64_t have_tc = -1, n_pairs = 0;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t tc = u / n_ob, ob = u % n_ob;
        const int64_t t0 = tc * tch;
        const int64_t t_end = t0 + tch < T ? t0 + tch : T;
        if (tc != have_tc) {
            /* pair q starts at t0 + 2d*(q / d) + q % d; the pairs starting before t_end */
            const int64_t len = t_end - t0, full = len / (2 * d), rem = len % (2 * d);
            n_pairs = full * d + (rem < d ? rem : d);
            const int64_t last = 2 * d * ((n_pairs - 1) / d) + (n_pairs - 1) % d;
            const int64_t rows = last + reach + 1;
            qtts_conv_stage_rows(st, &src, t0, rows);
            if (k7) {
                build_records(rec, xb, st, rows, Ci, cp, d);
            } else {
                build_records_k2(rec, e_stride, st, n_pairs, Ci, cp, d);
            }
            have_tc = tc;
        }
        const int64_t o0 = ob * OB;
        const int width = (int)(O - o0 < OB ? O - o0 : OB);
        const wino_args a = {.rec = rec, .xb = xb, .w = w + ob * w_block, .cp = cp, .d = d};
        const wino2_args a2 = {.e = rec, .stride = e_stride, .w = w + ob * w_block, .cp = cp};
        for (int64_t q0 = 0; q0 < n_pairs; q0 += npair) {
            const int np = (int)(n_pairs - q0 < npair ? n_pairs - q0 : npair);
            int64_t s[NPAIR2];
            wino_out out = {.bias = bias + o0, .width = width};
            for (int j = 0; j < np; j++) {
                const int64_t q = q0 + j;
                s[j] = 2 * d * (q / d) + q % d;
                const int64_t t = t0 + s[j];
                out.y0[j] = y + t * O + o0;
                out.r0[j] = res ? res + t * rs + o0 : NULL;
                out.y1[j] = t + d < t_end ? y + (t + d) * O + o0 : NULL;
                out.r1[j] = res && t + d < t_end ? res + (t + d) * rs + o0 : NULL;
            }
            if (k7) {
                WTILE[np](&a, s, &out);
            } else {
                WTILE2[np](&a2, q0, &out);
            }
        }
    }
}
