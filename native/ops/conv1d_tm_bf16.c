/* BF16 causal dilated conv1d in the time-major layout (see qtts_ops.h): the fast-mode twin of
 * conv1d_tm.c. BF16 weights and inputs, F32 accumulation, F32 bias and output.
 *
 *   y[t, o] = bias[o] + sum_k sum_p ( W[k, 2p+1, o] * x[t + k*d, 2p+1]
 *                                   + W[k, 2p,   o] * x[t + k*d, 2p] )
 *
 * with W and x rounded to BF16 (round to nearest even, subnormals to signed zero, as
 * VCVTNEPS2BF16 does). AVX512_BF16 path: a tile of 2 x 16 output channels x 12 time steps
 * (24 zmm accumulators) stays in registers; per (tap k, input-channel pair p) it loads the two
 * weight vectors of the packed block (each lane o holds the pair W[k, 2p, o], W[k, 2p+1, o]) and
 * for each of the 12 time steps broadcasts the input pair (x[.., 2p], x[.., 2p+1]) as one dword
 * into VDPBF16PS (two BF16 products, exact in F32, added to the F32 accumulator: 2x the FMA
 * throughput of the F32 kernel).
 *
 * The F32 input is converted to BF16 pairs inside the op: each thread converts the rows of the
 * time chunk it works on (<= TCHUNK steps plus (K-1)*d of history) into a thread-local scratch
 * buffer (kept between calls, freed at thread exit), then runs every output-channel block of its
 * units over it. Odd C_in: the last pair is (x[C_in - 1], 0), with a zero weight. With the
 * history in a source of its own (src[3]) the conversion reads the rows before the join from
 * it and the rest from x: the scratch, and so the result, is the same as for a concatenated xp.
 *
 * Fusions (flags in the userdata, see qtts_ops.h): with SnakeBeta parameters the conversion
 * applies qtts_snake_row to each input row first (the history rows too: the op then carries
 * pre-snake rows), so the activation the conv reads is never written out; with a residual
 * source, each tile adds its rows of it as it stores its finished sums. Both give bit for bit the results of
 * the separate snake op before, and of the add after, the conv.
 *
 * Summation order per output element: bias; then per input-pair chunk (depends on C_in only):
 * k ascending, pair ascending, one VDPBF16PS each. Tiles and threads do not change it, so the
 * result does not depend on the thread count. Work split as in conv1d_tm.c, with time chunks
 * evened out (see the op).
 *
 * Without AVX512_BF16 (and AVX512BW/VL) a portable C path computes the same sums (odd product
 * first, then even, as Intel's VDPBF16PS pseudocode, but without its flushing of subnormal
 * products and sums): correct, not fast. qtts_conv1d_tm_bf16_fast() tells which one is built.
 */
#include <stdint.h>
#include <string.h>

#include "qtts_amx.h"
#include "qtts_conv_srcs.h"
#include "qtts_bf16.h"
#include "qtts_ops.h"
#include "qtts_scratch.h"
#include "qtts_tiles.h"
#include "qtts_snake.h"

#define INLINE static inline __attribute__((always_inline))
#define OB QTTS_CONV_BF16_BLOCK /* 32 output channels per packed block */
#define VW 16                   /* F32 lanes per zmm */
#define NT_MAIN 12              /* time steps per tile */
#ifndef TCHUNK
#define TCHUNK (NT_MAIN * 32)   /* most time steps per work unit */
#endif
#ifndef KP_MAX
#define KP_MAX 128 /* input-channel pairs per reduction chunk (256 channels, as conv1d_tm.c) */
#endif

int qtts_conv1d_tm_bf16_fast(void) { return BF16_SIMD; }

int qtts_conv1d_tm_bf16_amx_built(void) { return AMX_BF16; }

/* ---- F32 -> BF16 pairs ---------------------------------------------------------------------- */

/* SnakeBeta applied on the fly (ea == NULL: none); tmp holds one row of it. */
typedef struct {
    const float * ea;
    const float * ib;
    float * tmp;
} snake_args;

/* rows x ci floats (row stride ss) -> rows x cp pairs (row stride cp dwords), zero-padded;
 * with lo (QTTS_CONV_SPLIT), also the BF16 rounding of each value's rest x - bf16(x) there. */
static void convert_rows(uint32_t * dst, uint32_t * lo, int64_t cp, const float * src, int64_t ss,
                         int64_t rows, int64_t ci, const snake_args * sn) {
    for (int64_t r = 0; r < rows; r++) {
        const float * s = src + r * ss;
        if (sn->ea) {
            qtts_snake_row(sn->tmp, s, sn->ea, sn->ib, ci);
            s = sn->tmp;
        }
        uint16_t * o = (uint16_t *)(dst + r * cp);
        uint16_t * ol = lo ? (uint16_t *)(lo + r * cp) : NULL;
        int64_t c = 0;
#if BF16_SIMD
        if (ol) {
            for (; c < ci; c += 16) {
                const int rem = (int)(ci - c < 16 ? ci - c : 16);
                const __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << rem) - 1u), s + c);
                const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
                const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf));
                const int ne = (rem + 1) & ~1; /* the pad of an odd C_in is written as 0 */
                _mm256_mask_storeu_epi16((void *)(o + c), (__mmask16)((1u << ne) - 1u), h);
                _mm256_mask_storeu_epi16((void *)(ol + c), (__mmask16)((1u << ne) - 1u), l);
            }
        }
        for (; c + 32 <= ci; c += 32) {
            const __m512 lo16 = _mm512_loadu_ps(s + c), hi16 = _mm512_loadu_ps(s + c + 16);
            _mm512_storeu_si512((void *)(o + c), (__m512i)_mm512_cvtne2ps_pbh(hi16, lo16));
        }
        for (; c < ci; c += 16) {
            const int rem = (int)(ci - c < 16 ? ci - c : 16);
            const __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << rem) - 1u), s + c);
            const int ne = (rem + 1) & ~1; /* the pad of an odd C_in is written as 0 */
            _mm256_mask_storeu_epi16((void *)(o + c), (__mmask16)((1u << ne) - 1u),
                                     (__m256i)_mm512_cvtneps_pbh(v));
        }
#else
        for (; c < ci; c++) {
            o[c] = f32_to_bf16(s[c]);
            if (ol) ol[c] = f32_to_bf16(s[c] - bf16_to_f32(o[c]));
        }
        if (ci & 1) {
            o[ci] = 0;
            if (ol) ol[ci] = 0;
        }
#endif
        /* the AMX path's rows are padded to whole 16-pair tiles: zero products there */
        const int64_t used = (ci + 1) / 2;
        if (cp > used) {
            memset(dst + r * cp + used, 0, (size_t)(cp - used) * sizeof(uint32_t));
            if (lo) memset(lo + r * cp + used, 0, (size_t)(cp - used) * sizeof(uint32_t));
        }
    }
}

/* Rows r0 .. r1 of the logical input xp = [hist rows 0 .. ph | x rows] -> dst (row stride cp
 * dwords): rows r < ph come from hist row r, the others from x row r - ph. */
static void convert_xp_rows(uint32_t * dst, uint32_t * lo, int64_t cp, const float * hist,
                            int64_t hs, int64_t ph, const float * x, int64_t xs, int64_t r0,
                            int64_t r1, int64_t ci, const snake_args * sn) {
    if (r0 < ph) {
        const int64_t r = r1 < ph ? r1 : ph;
        convert_rows(dst, lo, cp, hist + r0 * hs, hs, r - r0, ci, sn);
        dst += (r - r0) * cp;
        if (lo) lo += (r - r0) * cp;
        r0 = r;
    }
    if (r0 < r1) convert_rows(dst, lo, cp, x + (r0 - ph) * xs, xs, r1 - r0, ci, sn);
}

/* ---- tiles -------------------------------------------------------------------------------- */

/* What the tiles of one (input-pair chunk of a) conv share. x and w point at the chunk's first
 * pair (w also at the block's first output channel). */
typedef struct {
    const uint32_t * x; /* BF16 pair p of row j at x[j*xs + p] */
    int64_t xs;         /* row stride (pairs) */
    const uint16_t * w; /* block: w[(k*wks) + p*2*OB + 2*o + {0,1}] (BF16) */
    int64_t wks;        /* stride between taps: cp * 2*OB */
    int64_t d;          /* dilation */
    int64_t np;         /* pairs in this chunk */
    int K;
} bconv_args;

/* res (row stride rs): added to the finished sums as they are stored (the last input chunk), or
 * NULL */
typedef void (*btile_fn)(float * out, int64_t ys, const float * init, int64_t is,
                         const bconv_args * a, int width, const float * res, int64_t rs);

#if BF16_SIMD

/* NV vectors (1 or 2) x NT steps; MASKED: the last, partial block (weights are zero there). */
INLINE void tile_bf16(const int NV, const int NT, const int MASKED, float * out, int64_t ys,
                      const float * init, int64_t is, const bconv_args * a, int width,
                      const float * res, int64_t rs) {
    const uint32_t * x = a->x;
    const uint16_t * w = a->w;
    const int64_t xs = a->xs, wks = a->wks, d = a->d, np = a->np;
    const int K = a->K;
    __m512 acc[2][NT_MAIN];
    __mmask16 m[2];
#pragma GCC unroll 2
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
        const uint32_t * xk = x + (int64_t)k * d * xs;
        const uint16_t * wk = w + (int64_t)k * wks;
        for (int64_t p = 0; p < np; p++) {
            __m512bh wv[2];
#pragma GCC unroll 2
            for (int v = 0; v < NV; v++) {
                wv[v] = (__m512bh)_mm512_loadu_si512((const void *)(wk + p * 2 * OB + v * 2 * VW));
            }
#pragma GCC unroll 16
            for (int j = 0; j < NT; j++) {
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xk[j * xs + p]);
#pragma GCC unroll 2
                for (int v = 0; v < NV; v++) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], wv[v], xb);
            }
        }
    }
#pragma GCC unroll 16
    for (int j = 0; j < NT; j++) {
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++) {
            __m512 r = acc[v][j];
            if (res) {
                r = _mm512_add_ps(r, MASKED ? _mm512_maskz_loadu_ps(m[v], res + j * rs + v * VW)
                                            : _mm512_loadu_ps(res + j * rs + v * VW));
            }
            if (MASKED) {
                _mm512_mask_storeu_ps(out + j * ys + v * VW, m[v], r);
            } else {
                _mm512_storeu_ps(out + j * ys + v * VW, r);
            }
        }
    }
}

#define DEF_TILE(nt)                                                                            \
    static void btile_full_##nt(TILE_ARGS) { tile_bf16(2, nt, 0, TILE_PASS); }                 \
    static void btile_mask_##nt(TILE_ARGS) { tile_bf16(2, nt, 1, TILE_PASS); }                 \
    static void btile_half_##nt(TILE_ARGS) { tile_bf16(1, nt, 1, TILE_PASS); }

#else

static void tile_generic(int NT, float * out, int64_t ys, const float * init, int64_t is,
                         const bconv_args * a, int width, const float * res, int64_t rs) {
    const uint32_t * x = a->x;
    const uint16_t * w = a->w;
    const int64_t xs = a->xs, wks = a->wks, d = a->d, np = a->np;
    const int K = a->K;
    float acc[NT_MAIN][OB];
    for (int j = 0; j < NT; j++) {
        for (int o = 0; o < OB; o++) acc[j][o] = o < width ? init[j * is + o] : 0.0f;
    }
    for (int k = 0; k < K; k++) {
        const uint32_t * xk = x + (int64_t)k * d * xs;
        const uint16_t * wk = w + (int64_t)k * wks;
        for (int64_t p = 0; p < np; p++) {
            const uint16_t * wp = wk + p * 2 * OB;
            float w0[OB], w1[OB];
            for (int o = 0; o < OB; o++) {
                w0[o] = bf16_to_f32(wp[2 * o]);
                w1[o] = bf16_to_f32(wp[2 * o + 1]);
            }
            for (int j = 0; j < NT; j++) {
                const uint32_t xv = xk[j * xs + p];
                const float x0 = bf16_to_f32((uint16_t)(xv & 0xFFFFu));
                const float x1 = bf16_to_f32((uint16_t)(xv >> 16));
                for (int o = 0; o < OB; o++) {
                    float s = acc[j][o] + w1[o] * x1; /* products are exact in F32 */
                    acc[j][o] = s + w0[o] * x0;
                }
            }
        }
    }
    for (int j = 0; j < NT; j++) {
        if (res) {
            for (int o = 0; o < width; o++) acc[j][o] += res[j * rs + o];
        }
        memcpy(out + j * ys, acc[j], (size_t)width * sizeof(float));
    }
}

#define DEF_TILE(nt)                                                                            \
    static void btile_full_##nt(TILE_ARGS) { tile_generic(nt, TILE_PASS); }                    \
    static void btile_mask_##nt(TILE_ARGS) { tile_generic(nt, TILE_PASS); }                    \
    static void btile_half_##nt(TILE_ARGS) { tile_generic(nt, TILE_PASS); }

#endif

#define TILE_ARGS                                                                               \
    float * out, int64_t ys, const float * init, int64_t is, const bconv_args * a, int width,   \
        const float * res, int64_t rs
#define TILE_PASS out, ys, init, is, a, width, res, rs

QTTS_DEF_TILES

static const btile_fn BTILE_FULL[NT_MAIN + 1] = QTTS_TILE_TABLE(btile_, full);
static const btile_fn BTILE_MASK[NT_MAIN + 1] = QTTS_TILE_TABLE(btile_, mask);
static const btile_fn BTILE_HALF[NT_MAIN + 1] = QTTS_TILE_TABLE(btile_, half);

/* ---- AMX-BF16 tiles ------------------------------------------------------------------------ */

#if AMX_BF16

/* Tile registers: 0-3 the F32 sums of 16 time steps x 16 output channels (tmm0: steps 0-15 x
 * channels 0-15, tmm1: steps 0-15 x 16-31, tmm2/3: steps 16-31), 4-5 the input (16 steps x 16
 * BF16 pairs each), 6-7 the weights (16 pairs x 16 channels x 2, the VNNI layout the packed
 * block already has: pair p's 32 channels are 128 bytes, channels 0-15 first). All 16 rows x
 * 64 bytes (qtts_amx_configure). */

/* A tile's sums (bias, then res, added) into the valid rows / channels of out. */
INLINE void amx_store(float (*sums)[OB], float * out, int64_t ys, int nt, int width,
                      const float * bias, const float * res, int64_t rs) {
    const __mmask16 m0 = (__mmask16)(width >= VW ? 0xFFFFu : (1u << width) - 1u);
    const __mmask16 m1 = (__mmask16)(width >= OB ? 0xFFFFu
                                                 : (width <= VW ? 0u : (1u << (width - VW)) - 1u));
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, bias), b1 = _mm512_maskz_loadu_ps(m1, bias + VW);
    for (int j = 0; j < nt; j++) {
        __m512 r0 = _mm512_add_ps(_mm512_load_ps(&sums[j][0]), b0);
        __m512 r1 = _mm512_add_ps(_mm512_load_ps(&sums[j][VW]), b1);
        if (res) {
            r0 = _mm512_add_ps(r0, _mm512_maskz_loadu_ps(m0, res + j * rs));
            r1 = _mm512_add_ps(r1, _mm512_maskz_loadu_ps(m1, res + j * rs + VW));
        }
        _mm512_mask_storeu_ps(out + j * ys, m0, r0);
        _mm512_mask_storeu_ps(out + j * ys + VW, m1, r1);
    }
}

/* One 16 or 32 (NG = 1, 2) steps x 32 channels tile over the whole reduction (every tap, every
 * pair), then bias (+ res) added and the valid rows / channels stored. x: the scratch row of the
 * tile's first step (row stride xs pairs, a multiple of 16, zero past cp; rows past the chunk
 * are read and their sums dropped); w: the block's packed weights; wtail: a zeroed 16 x 128 byte
 * buffer for a last partial group of pairs. */
INLINE void amx_tile(const int NG, float * out, int64_t ys, int nt, int width, const float * bias,
                     const uint32_t * x, int64_t xs, const uint16_t * w, int64_t cp, int64_t d,
                     int K, uint16_t * wtail, const float * res, int64_t rs) {
    _tile_zero(0);
    _tile_zero(1);
    if (NG == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const int64_t xb = xs * (int64_t)sizeof(uint32_t);
    for (int k = 0; k < K; k++) {
        const uint32_t * xk = x + (int64_t)k * d * xs;
        const uint16_t * wk = w + (int64_t)k * cp * 2 * OB;
        for (int64_t p0 = 0; p0 < cp; p0 += 16) {
            const uint16_t * wp = wk + p0 * 2 * OB;
            if (p0 + 16 > cp) { /* last partial group: the missing pairs' weights are zero */
                memcpy(wtail, wp, (size_t)(cp - p0) * 2 * OB * sizeof(uint16_t));
                wp = wtail;
            }
            _tile_loadd(6, wp, 2 * OB * sizeof(uint16_t));
            _tile_loadd(7, wp + 2 * VW, 2 * OB * sizeof(uint16_t));
            _tile_loadd(4, xk + p0, xb);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (NG == 2) {
                _tile_loadd(5, xk + 16 * xs + p0, xb);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
    float sums[32][OB] __attribute__((aligned(64)));
    _tile_stored(0, &sums[0][0], OB * sizeof(float));
    _tile_stored(1, &sums[0][VW], OB * sizeof(float));
    if (NG == 2) {
        _tile_stored(2, &sums[16][0], OB * sizeof(float));
        _tile_stored(3, &sums[16][VW], OB * sizeof(float));
    }
    amx_store(sums, out, ys, nt, width, bias, res, rs);
}

/* QTTS_CONV_SPLIT: 16 steps x 32 channels, hi(W) hi(x) + hi(W) lo(x) + lo(W) hi(x) per pair
 * group (each hi(W) tile load serves both input tiles); w: the block's hi(W) taps, wl: its
 * lo(W) taps; xl: the lo(x) rows, laid out as x's. Then as amx_tile. */
INLINE void amx_tile_split(float * out, int64_t ys, int nt, int width, const float * bias,
                           const uint32_t * x, const uint32_t * xl, int64_t xs,
                           const uint16_t * w, const uint16_t * wl, int64_t cp, int64_t d, int K,
                           uint16_t * wtail, const float * res, int64_t rs) {
    _tile_zero(0);
    _tile_zero(1);
    const int64_t xb = xs * (int64_t)sizeof(uint32_t);
    for (int k = 0; k < K; k++) {
        const int64_t xo = (int64_t)k * d * xs;
        const uint16_t * wk = w + (int64_t)k * cp * 2 * OB;
        const uint16_t * wlk = wl + (int64_t)k * cp * 2 * OB;
        for (int64_t p0 = 0; p0 < cp; p0 += 16) {
            const uint16_t * wp = wk + p0 * 2 * OB;
            const uint16_t * wlp = wlk + p0 * 2 * OB;
            const int tail = p0 + 16 > cp; /* the missing pairs' weights are zero */
            if (tail) {
                memcpy(wtail, wp, (size_t)(cp - p0) * 2 * OB * sizeof(uint16_t));
                wp = wtail;
            }
            _tile_loadd(6, wp, 2 * OB * sizeof(uint16_t));
            _tile_loadd(7, wp + 2 * VW, 2 * OB * sizeof(uint16_t));
            _tile_loadd(4, x + xo + p0, xb);
            _tile_loadd(5, xl + xo + p0, xb);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(0, 5, 6);
            _tile_dpbf16ps(1, 5, 7);
            if (tail) {
                memcpy(wtail, wlp, (size_t)(cp - p0) * 2 * OB * sizeof(uint16_t));
                wlp = wtail;
            }
            _tile_loadd(6, wlp, 2 * OB * sizeof(uint16_t));
            _tile_loadd(7, wlp + 2 * VW, 2 * OB * sizeof(uint16_t));
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    float sums[16][OB] __attribute__((aligned(64)));
    _tile_stored(0, &sums[0][0], OB * sizeof(float));
    _tile_stored(1, &sums[0][VW], OB * sizeof(float));
    amx_store(sums, out, ys, nt, width, bias, res, rs);
}

#endif

/* ---- the op ------------------------------------------------------------------------------- */

void qtts_conv1d_tm_bf16_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct ggml_tensor * wt = dst->src[1];
    GGML_ASSERT(wt->type == GGML_TYPE_BF16);
    const int split = ((intptr_t)userdata & QTTS_CONV_SPLIT) != 0;
    GGML_ASSERT(!split || wt->ne[2] % 2 == 0);
    const int K = (int)(split ? wt->ne[2] / 2 : wt->ne[2]);
    const int64_t KW = wt->ne[2]; /* taps per block in the weight: 2K when split */
    qtts_conv_srcs sr;
    qtts_conv_srcs_get(&sr, dst, (intptr_t)userdata, K);
    const struct ggml_tensor * x = sr.x;
    const struct ggml_tensor * ht = sr.hist;
    const struct ggml_tensor * eat = sr.ea;
    const struct ggml_tensor * ibt = sr.ib;
    const struct ggml_tensor * rt = sr.res;
    const int64_t d = sr.d, Ci = sr.ci, O = sr.co, T = sr.t, hist = sr.n_hist, ph = sr.ph;
    const int64_t cp = (Ci + 1) / 2;
    const int64_t n_ob = (O + OB - 1) / OB;
    GGML_ASSERT(wt->ne[0] == 2 * OB && wt->ne[1] == cp && wt->ne[3] == n_ob &&
                ggml_is_contiguous(wt));

    const int64_t xs = (int64_t)(x->nb[1] / sizeof(float));
    const float * xp = (const float *)x->data;
    const int64_t hs = ht ? (int64_t)(ht->nb[1] / sizeof(float)) : 0;
    const float * hp = ht ? (const float *)ht->data : NULL;
    const uint16_t * w = (const uint16_t *)wt->data;
    const float * bias = (const float *)sr.bias->data;
    float * y = (float *)dst->data;

    const int64_t n_kc = (cp + KP_MAX - 1) / KP_MAX;
    const int64_t kc = (cp + n_kc - 1) / n_kc;

    /* Time chunks of equal length (whole tiles), at most TCHUNK steps; when that leaves fewer
     * than 4 units per thread, shorter ones, so that contiguous unit ranges share the work out
     * evenly (T = 1240, 2 threads: 4 chunks of 312 rather than 384, 384, 384, 88). Only which
     * thread computes an element depends on this, never its sum. */
    const int64_t n_tiles = (T + NT_MAIN - 1) / NT_MAIN;
    int64_t n_tc = (T + TCHUNK - 1) / TCHUNK;
    if (n_tc * n_ob < 4 * (int64_t)nth) {
        const int64_t want = (4 * (int64_t)nth + n_ob - 1) / n_ob;
        n_tc = want < n_tiles ? want : n_tiles;
    }
    const int64_t tch = (n_tiles + n_tc - 1) / n_tc * NT_MAIN; /* steps per chunk */
    n_tc = (T + tch - 1) / tch;
    const int64_t units = n_ob * n_tc;
    const int64_t u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    if (u0 >= u1) return;
#if AMX_BF16
    const int amx = qtts_amx_on;
#else
    const int amx = 0;
#endif
    /* the AMX tiles read whole groups of 16 pairs and 32 rows: rows padded with zero pairs,
     * and 32 more rows than the chunk needs (read, their sums dropped) */
    const int64_t xst = amx ? (cp + 15) & ~(int64_t)15 : cp;
    const int64_t max_rows = (T < tch ? T : tch) + hist + (amx ? 32 : 0);
    /* one allocation: the BF16 pairs (split: then the lo pairs), then (with the snake) one F32
     * row for it */
    const size_t xb_bytes = ((size_t)(max_rows * xst) * sizeof(uint32_t) + 63) & ~(size_t)63;
    const size_t pairs_bytes = xb_bytes * (split ? 2 : 1);
    uint8_t * scratch = (uint8_t *)qtts_scratch_get(
        QTTS_SCRATCH_BF16_INPUT, pairs_bytes + (eat ? (size_t)Ci * sizeof(float) : 0));
    uint32_t * xb = (uint32_t *)scratch;
    uint32_t * xl = split ? (uint32_t *)(scratch + xb_bytes) : NULL;
    const snake_args sn = {
        .ea = eat ? (const float *)eat->data : NULL,
        .ib = ibt ? (const float *)ibt->data : NULL,
        .tmp = eat ? (float *)(scratch + pairs_bytes) : NULL,
    };
    const float * res = rt ? (const float *)rt->data : NULL;
    const int64_t rs = rt ? (int64_t)(rt->nb[1] / sizeof(float)) : 0;
    int64_t have_tc = -1;
#if AMX_BF16
    uint16_t wtail[16 * 2 * OB] __attribute__((aligned(64)));
    if (amx) {
        memset(wtail, 0, sizeof wtail);
        qtts_amx_configure(); /* per thread, per call: the ggml worker threads run other code too */
    }
#endif
    for (int64_t u = u0; u < u1; u++) {
        const int64_t tc = u / n_ob, ob = u % n_ob;
        const int64_t t0 = tc * tch;
        const int64_t t_end = t0 + tch < T ? t0 + tch : T;
        if (tc != have_tc) { /* rows t0 .. t_end + hist of xp (= [ht | x]), as BF16 pairs */
            convert_xp_rows(xb, xl, xst, hp, hs, ph, xp, xs, t0, t_end + hist, Ci, &sn);
            have_tc = tc;
        }
        const int64_t o0 = ob * OB;
        const int width = (int)(O - o0 < OB ? O - o0 : OB);
#if AMX_BF16
        if (amx && split) {
            const uint16_t * wb = w + ob * KW * cp * 2 * OB;
            for (int64_t t = t0; t < t_end; t += 16) {
                const int nt = (int)(t_end - t < 16 ? t_end - t : 16);
                amx_tile_split(y + t * O + o0, O, nt, width, bias + o0, xb + (t - t0) * xst,
                               xl + (t - t0) * xst, xst, wb, wb + K * cp * 2 * OB, cp, d, K,
                               wtail, res ? res + t * rs + o0 : NULL, rs);
            }
            continue;
        }
        if (amx) {
            const uint16_t * wb = w + ob * K * cp * 2 * OB;
            for (int64_t t = t0; t < t_end; t += 32) {
                const int nt = (int)(t_end - t < 32 ? t_end - t : 32);
                const float * rt_ = res ? res + t * rs + o0 : NULL;
                const uint32_t * xt = xb + (t - t0) * xst;
                if (nt > 16) {
                    amx_tile(2, y + t * O + o0, O, nt, width, bias + o0, xt, xst, wb, cp, d, K,
                             wtail, rt_, rs);
                } else {
                    amx_tile(1, y + t * O + o0, O, nt, width, bias + o0, xt, xst, wb, cp, d, K,
                             wtail, rt_, rs);
                }
            }
            continue;
        }
#endif
        const btile_fn * fns = width == OB ? BTILE_FULL : (width <= VW ? BTILE_HALF : BTILE_MASK);
        /* split: three passes over the reduction, hi(W) hi(x), hi(W) lo(x), lo(W) hi(x) */
        const int n_pass = split ? 3 : 1;
        for (int64_t q = 0; q < n_pass * n_kc; q++) {
            const int pass = (int)(q / n_kc);
            const int64_t p0 = (q % n_kc) * kc; /* < cp: n_kc chunks of kc cover cp */
            const bconv_args a = {
                .x = (pass == 1 ? xl : xb) + p0, .xs = cp,
                .w = w + (ob * KW * cp + (pass == 2 ? K * cp : 0) + p0) * 2 * OB,
                .wks = cp * 2 * OB, .d = d, .np = cp - p0 < kc ? cp - p0 : kc, .K = K,
            };
            for (int64_t t = t0; t < t_end; t += NT_MAIN) {
                const int nt = (int)(t_end - t < NT_MAIN ? t_end - t : NT_MAIN);
                float * out = y + t * O + o0;
                const bconv_args at = {
                    .x = a.x + (t - t0) * cp, .xs = cp, .w = a.w, .wks = a.wks, .d = d,
                    .np = a.np, .K = K,
                };
                /* the residual joins the sums as the last input chunk stores them */
                const float * rt_ = res && q + 1 == n_pass * n_kc ? res + t * rs + o0 : NULL;
                if (q == 0) {
                    fns[nt](out, O, bias + o0, 0, &at, width, rt_, rs);
                } else {
                    fns[nt](out, O, out, O, &at, width, rt_, rs);
                }
            }
        }
    }
#if AMX_BF16
    if (amx) _tile_release();
#endif
}
