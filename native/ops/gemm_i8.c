/* INT8 GEMM (W8A8) for the prefill of quantised talkers: y = W x with W and x rounded to int8
 * in blocks of QTTS_GEMM_I8_KBLOCK input channels, int32 sums, F32 scales and output.
 *
 *   y[t, o] = sum_b  ws[o, b] * xs[t, b] * sum_{k in block b} Wq[o, k] * xq[t, k]
 *
 * Wq, ws: the weight rounded per (output channel, block) by qtts_gemm_i8_pack; xq, xs: the
 * input rounded per (row, block) inside the op, the same rule: s = max|v| / 127,
 * q = nearest-even(v * (1/s)) clamped to +-127 (all zero: s = 0, q = 0).
 *
 * Why: a prompt's prefill is compute-bound. ggml's Q4_0 GEMM (repacked q4_0_8x8) runs at ~255
 * GFLOP/s on this CPU because it rescales every 32-element block in F32; VPDPBUSD does 64 int8
 * MACs per instruction (2x VDPBF16PS) and, with a scale per 256 elements, the F32 work is ~5 %
 * of the sums. The int8 copy of a Q4_0 weight costs 1 byte per weight next to the 0.56 the Q4_0
 * matrices take; its rounding error (1/254 of a 256-block's largest value) is ~1/16 of Q4_0's
 * own, and the per-block input rounding is ggml's Q8_0 activation rounding at 8x the block.
 *
 * AVX512_VNNI path: a tile of 2 x 16 output channels x 12 rows keeps 24 int32 accumulators in
 * registers; per group of 4 input channels it loads the 2 packed weight vectors (lane o holds
 * Wq[o, 4g .. 4g+3]) and for each row broadcasts that row's 4 input bytes into VPDPBUSD (u8 x s8:
 * the input is stored as q + 128, and the accumulators start at -128 * sum_k Wq[o, k] of the
 * block, from the pack). After each block the tile adds acc * (ws * xs) to its F32 sums (one
 * FMA per element and block). Integer sums are exact, so the portable C path (same block order,
 * fmaf) gives the same result bit for bit, and neither depends on the thread count.
 *
 * Work: units (row chunk, output block) as conv1d_tm_bf16.c; each thread rounds the rows of its
 * chunk once, block-major (a tile's block is one contiguous run); a unit walks the input blocks
 * outermost (the block's weights stay in L1 across the chunk's tiles) and keeps its sums in a
 * contiguous scratch, copied to dst at the end (dst's rows are N floats apart: with N a multiple
 * of 1024 they would all fall in one L1 set).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qtts_amx.h"
#include "qtts_ops.h"
#include "qtts_scratch.h"
#include "qtts_tiles.h"

#if AMX_BF16 && defined(__AMX_INT8__)
#define AMX_I8 1
#else
#define AMX_I8 0
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define I8_SIMD 1
#include <immintrin.h>
#else
#define I8_SIMD 0
#endif

#define INLINE static inline __attribute__((always_inline))

#if I8_SIMD
/* acc += VPDPBUSD(u8 x, s8 w). Inline asm: GCC 12 spills most of a tile's 24 accumulators
 * around the intrinsic (its pattern ties the operands), halving the kernel's rate. */
INLINE __m512i dpbusd(__m512i acc, __m512i x, __m512i w) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
    return acc;
}
#endif
#define OB QTTS_GEMM_I8_BLOCK /* 32 output channels per packed block */
#define KB QTTS_GEMM_I8_KBLOCK
#define VW 16                 /* int32 / F32 lanes per zmm */
#define NT_MAIN 12            /* rows per tile */
#define TCHUNK (NT_MAIN * 32) /* most rows per work unit */

/* ---- rounding to int8 ------------------------------------------------------------------------ */

/* Scale of one block: max|v| / 127 (0 for an all-zero block). */
static float block_scale(const float * v, int64_t n) {
    float m = 0.0f;
    int64_t i = 0;
#if I8_SIMD
    __m512 mv = _mm512_setzero_ps();
    for (; i + VW <= n; i += VW) mv = _mm512_max_ps(mv, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; i < n; i++) m = fmaxf(m, fabsf(v[i]));
    return m / 127.0f;
}

static inline int32_t round_i8(float v, float inv) {
    const float r = nearbyintf(v * inv);
    return r > 127.0f ? 127 : (r < -127.0f ? -127 : (int32_t)r);
}

/* One row of K inputs -> its int8 blocks (q + 128; block b at q + b * bs, KB bytes, padded
 * with 128 = zero up to Kp) and its nkb block scales. */
static void quantize_row(uint8_t * q, int64_t bs, float * sc, const float * x, int64_t K,
                         int64_t Kp) {
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t n = K - k0 < KB ? K - k0 : KB;
        const float s = block_scale(x + k0, n);
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        uint8_t * qb = q + (k0 / KB) * bs;
        sc[k0 / KB] = s;
        int64_t i = 0;
#if I8_SIMD
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
        const __m512i off = _mm512_set1_epi32(128);
        for (; i + VW <= n; i += VW) {
            /* VCVTPS2DQ rounds to nearest even (the default MXCSR), as nearbyintf does */
            __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k0 + i), vinv));
            r = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(r, nlim), lim), off);
            _mm_storeu_si128((__m128i *)(qb + i), _mm512_cvtepi32_epi8(r));
        }
#endif
        for (; i < n; i++) qb[i] = (uint8_t)(round_i8(x[k0 + i], inv) + 128);
        for (; k0 + i < Kp && i < KB; i++) qb[i] = 128;
    }
}

void qtts_gemm_i8_pack(const float * W, int64_t N, int64_t K, int8_t * wq, float * ws,
                       int32_t * wc) {
    const int64_t Kp = (K + 3) & ~(int64_t)3, ng = Kp / 4, nkb = (K + KB - 1) / KB;
    const int64_t nob = (N + OB - 1) / OB;
    /* at load time, for every matrix of a talker: use the machine's cores */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t j = 0; j < nob; j++) {
        int8_t * blk = wq + j * ng * OB * 4;
        memset(blk, 0, (size_t)(ng * OB * 4));
        memset(ws + j * nkb * OB, 0, (size_t)(nkb * OB) * sizeof(float));
        memset(wc + j * nkb * OB, 0, (size_t)(nkb * OB) * sizeof(int32_t));
        for (int64_t i = 0; i < OB && j * OB + i < N; i++) {
            const int64_t o = j * OB + i;
            for (int64_t b = 0; b < nkb; b++) {
                const int64_t k0 = b * KB, n = K - k0 < KB ? K - k0 : KB;
                const float * row = W + o * K + k0;
                const float s = block_scale(row, n);
                const float inv = s > 0.0f ? 1.0f / s : 0.0f;
                int32_t sum = 0;
                for (int64_t k = 0; k < n; k++) {
                    const int32_t q = round_i8(row[k], inv);
                    const int64_t kk = k0 + k;
                    blk[(kk / 4) * OB * 4 + i * 4 + kk % 4] = (int8_t)q;
                    sum += q;
                }
                ws[(j * nkb + b) * OB + i] = s;
                wc[(j * nkb + b) * OB + i] = -128 * sum;
            }
        }
    }
}

/* ---- tiles ----------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t * x;  /* the tile's part of the current input block: row j at x + j * KB */
    const float * xsc;  /* the tile's block scales: row j, block b at xsc + j * nkb + b */
    const int8_t * w;   /* the output block: group g at w + g * OB * 4 */
    const float * wsc;  /* ws of the block: [nkb][OB] */
    const int32_t * wc; /* wc of the block: [nkb][OB] */
    int64_t nkb, ng;
} i8_args;

/* Adds input block b of a tile (NT rows x width output channels) to out. */
typedef void (*i8tile_fn)(float * out, int64_t ys, const i8_args * a, int width, int64_t b);

#if I8_SIMD

/* One input block [g0, g1) of a tile: NV vectors (1 or 2) x NT rows of int32 sums, started at
 * wc, then added as F32 to out (written, for the first block). MASKED: a partial output block
 * (its weights are zero). */
INLINE void block_i8(const int NV, const int NT, const int MASKED, float * out, int64_t ys,
                     const i8_args * a, const __mmask16 * m, int64_t b) {
    const int64_t g0 = b * (KB / 4);
    const int64_t g1 = g0 + KB / 4 < a->ng ? g0 + KB / 4 : a->ng;
    const uint8_t * x = a->x - g0 * 4; /* indexed by g below */
    const int64_t xs = KB;
    const int8_t * w = a->w;
    __m512i acc[2][NT_MAIN];
#pragma GCC unroll 2
    for (int v = 0; v < NV; v++) {
        const __m512i c = _mm512_loadu_si512((const void *)(a->wc + b * OB + v * VW));
#pragma GCC unroll 16
        for (int j = 0; j < NT; j++) acc[v][j] = c;
    }
    for (int64_t g = g0; g < g1; g++) {
        __m512i wv[2];
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++) {
            wv[v] = _mm512_loadu_si512((const void *)(w + g * OB * 4 + v * VW * 4));
        }
#pragma GCC unroll 16
        for (int j = 0; j < NT; j++) {
            const __m512i xb = _mm512_set1_epi32(*(const int32_t *)(const void *)(x + j * xs + g * 4));
#pragma GCC unroll 2
            for (int v = 0; v < NV; v++) acc[v][j] = dpbusd(acc[v][j], xb, wv[v]);
        }
    }
#pragma GCC unroll 2
    for (int v = 0; v < NV; v++) {
        const __m512 wsv = _mm512_loadu_ps(a->wsc + b * OB + v * VW);
#pragma GCC unroll 16
        for (int j = 0; j < NT; j++) {
            float * o = out + j * ys + v * VW;
            const __m512 sc = _mm512_mul_ps(wsv, _mm512_set1_ps(a->xsc[j * a->nkb + b]));
            const __m512 prev = b == 0 ? _mm512_setzero_ps()
                                       : (MASKED ? _mm512_maskz_loadu_ps(m[v], o)
                                                 : _mm512_loadu_ps(o));
            const __m512 r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[v][j]), sc, prev);
            if (MASKED) {
                _mm512_mask_storeu_ps(o, m[v], r);
            } else {
                _mm512_storeu_ps(o, r);
            }
        }
    }
}

/* NV vectors x NT rows, input block b. */
INLINE void tile_i8(const int NV, const int NT, const int MASKED, float * out, int64_t ys,
                    const i8_args * a, int width, int64_t b) {
    __mmask16 m[2];
#pragma GCC unroll 2
    for (int v = 0; v < NV; v++) {
        int rem = width - v * VW;
        rem = rem < 0 ? 0 : (rem > VW ? VW : rem);
        m[v] = MASKED ? (__mmask16)((1u << rem) - 1u) : (__mmask16)0xFFFF;
    }
    block_i8(NV, NT, MASKED, out, ys, a, m, b);
}

#define DEF_TILE(nt)                                                                            \
    static void i8tile_full_##nt(TILE_ARGS) { tile_i8(2, nt, 0, TILE_PASS); }                  \
    static void i8tile_mask_##nt(TILE_ARGS) { tile_i8(2, nt, 1, TILE_PASS); }                  \
    static void i8tile_half_##nt(TILE_ARGS) { tile_i8(1, nt, 1, TILE_PASS); }

#else

static void tile_generic(int NT, float * out, int64_t ys, const i8_args * a, int width,
                         int64_t b) {
    const int64_t g0 = b * (KB / 4);
    const int64_t g1 = g0 + KB / 4 < a->ng ? g0 + KB / 4 : a->ng;
    for (int j = 0; j < NT; j++) {
        const uint8_t * x = a->x + j * KB - g0 * 4;
        for (int o = 0; o < width; o++) {
            int32_t acc = a->wc[b * OB + o];
            for (int64_t g = g0; g < g1; g++) {
                const int8_t * w = a->w + g * OB * 4 + o * 4;
                for (int e = 0; e < 4; e++) acc += (int32_t)x[g * 4 + e] * (int32_t)w[e];
            }
            const float sc = a->wsc[b * OB + o] * a->xsc[j * a->nkb + b];
            float * y = out + j * ys + o;
            *y = fmaf((float)acc, sc, b == 0 ? 0.0f : *y);
        }
    }
}

#define DEF_TILE(nt)                                                                            \
    static void i8tile_full_##nt(TILE_ARGS) { tile_generic(nt, TILE_PASS); }                   \
    static void i8tile_mask_##nt(TILE_ARGS) { tile_generic(nt, TILE_PASS); }                   \
    static void i8tile_half_##nt(TILE_ARGS) { tile_generic(nt, TILE_PASS); }

#endif

#define TILE_ARGS float * out, int64_t ys, const i8_args * a, int width, int64_t b
#define TILE_PASS out, ys, a, width, b

QTTS_DEF_TILES

static const i8tile_fn I8TILE_FULL[NT_MAIN + 1] = QTTS_TILE_TABLE(i8tile_, full);
static const i8tile_fn I8TILE_MASK[NT_MAIN + 1] = QTTS_TILE_TABLE(i8tile_, mask);
static const i8tile_fn I8TILE_HALF[NT_MAIN + 1] = QTTS_TILE_TABLE(i8tile_, half);

int qtts_gemm_i8_fast(void) { return I8_SIMD; }
int qtts_gemm_i8_amx_built(void) { return AMX_I8; }

/* ---- AMX-INT8 tiles --------------------------------------------------------------------------- */

#if AMX_I8
/* Tiles (palette 1, all 16 rows x 64 bytes): 0-3 int32 sums (tmm0/1: rows 0-15 x channels 0-15 /
 * 16-31, tmm2/3: rows 16-31), 4-5 the input (16 rows x 64 bytes of one input block), 6-7 the
 * weights (16 groups of 4 inputs x 16 channels: the packed block's groups are 128 bytes, channels
 * 0-15 first, so a tile is a 64-byte column of them). TDPBUSD: u8 input x s8 weight, int32 sums,
 * exact as VPDPBUSD's; the epilogue is the VNNI path's, so the results are the same bits.
 * (qtts_amx_configure: every tile 16 rows x 64 bytes.) */

/* Input block b of NG x 16 rows (x: the first row's block, rows xs bytes apart; rows past nt are
 * read and dropped) x 32 channels, added to out (rows ys apart; written at b == 0). */
INLINE void amx_i8_block(const int NG, float * out, int64_t ys, int nt, const i8_args * a,
                         const uint8_t * x, int64_t xs, int64_t b) {
    _tile_zero(0);
    _tile_zero(1);
    if (NG == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int s = 0; s < KB / 64; s++) {
        const int8_t * w = a->w + (b * (KB / 4) + s * 16) * OB * 4;
        _tile_loadd(6, w, OB * 4);
        _tile_loadd(7, w + VW * 4, OB * 4);
        _tile_loadd(4, x + s * 64, xs);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        if (NG == 2) {
            _tile_loadd(5, x + 16 * xs + s * 64, xs);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
        }
    }
    int32_t sums[32][OB] __attribute__((aligned(64)));
    _tile_stored(0, &sums[0][0], OB * sizeof(int32_t));
    _tile_stored(1, &sums[0][VW], OB * sizeof(int32_t));
    if (NG == 2) {
        _tile_stored(2, &sums[16][0], OB * sizeof(int32_t));
        _tile_stored(3, &sums[16][VW], OB * sizeof(int32_t));
    }
    const __m512i c0 = _mm512_loadu_si512((const void *)(a->wc + b * OB));
    const __m512i c1 = _mm512_loadu_si512((const void *)(a->wc + b * OB + VW));
    const __m512 s0 = _mm512_loadu_ps(a->wsc + b * OB), s1 = _mm512_loadu_ps(a->wsc + b * OB + VW);
    for (int j = 0; j < nt; j++) {
        float * o = out + j * ys;
        const __m512 xsc = _mm512_set1_ps(a->xsc[j * a->nkb + b]);
        const __m512i i0 = _mm512_add_epi32(_mm512_load_si512((const void *)&sums[j][0]), c0);
        const __m512i i1 = _mm512_add_epi32(_mm512_load_si512((const void *)&sums[j][VW]), c1);
        const __m512 p0 = b == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
        const __m512 p1 = b == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + VW);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(s0, xsc), p0));
        _mm512_storeu_ps(o + VW, _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(s1, xsc),
                                                 p1));
    }
}
#endif

/* ---- the op ---------------------------------------------------------------------------------- */

void qtts_gemm_i8_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void)userdata;
    const struct ggml_tensor * xt = dst->src[0];
    const struct ggml_tensor * wt = dst->src[1];
    const struct ggml_tensor * st = dst->src[2];
    const struct ggml_tensor * ct = dst->src[3];
    GGML_ASSERT(xt->type == GGML_TYPE_F32 && wt->type == GGML_TYPE_I8);
    GGML_ASSERT(st->type == GGML_TYPE_F32 && ct->type == GGML_TYPE_I32);
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));
    const int64_t K = xt->ne[0], T = xt->ne[1], N = dst->ne[0];
    const int64_t Kp = (K + 3) & ~(int64_t)3, ng = Kp / 4, nkb = (K + KB - 1) / KB;
    const int64_t n_ob = (N + OB - 1) / OB;
    GGML_ASSERT(dst->ne[1] == T && xt->ne[2] == 1 && xt->ne[3] == 1 && xt->nb[0] == sizeof(float));
    GGML_ASSERT(wt->ne[0] == 4 * OB && wt->ne[1] == ng && wt->ne[2] == n_ob &&
                ggml_is_contiguous(wt));
    GGML_ASSERT(st->ne[0] == OB && st->ne[1] == nkb && st->ne[2] == n_ob && ggml_is_contiguous(st));
    GGML_ASSERT(ct->ne[0] == OB && ct->ne[1] == nkb && ct->ne[2] == n_ob && ggml_is_contiguous(ct));

    /* Units: (row chunk, output block), chunk-major, split evenly as in conv1d_tm_bf16.c. */
    const int64_t n_tiles = (T + NT_MAIN - 1) / NT_MAIN;
    int64_t n_tc = (T + TCHUNK - 1) / TCHUNK;
    if (n_tc * n_ob < 4 * (int64_t)nth) {
        const int64_t want = (4 * (int64_t)nth + n_ob - 1) / n_ob;
        n_tc = want < n_tiles ? want : n_tiles;
    }
    const int64_t tch = (n_tiles + n_tc - 1) / n_tc * NT_MAIN;
    n_tc = (T + tch - 1) / tch;
    const int64_t units = n_ob * n_tc;
    const int64_t u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    if (u0 >= u1) return;

#if AMX_I8
    /* whole 256-input blocks and 32-channel blocks only (every talker matrix) */
    const int amx = qtts_amx_on && K % KB == 0 && N % OB == 0;
#else
    const int amx = 0;
#endif
    /* this thread's copy of a row chunk's input as int8, block-major (block b of row r at
     * xq + (b * rows + r) * KB) so that a tile's block is one contiguous run; with tiles, 32 rows
     * more, read past the chunk's last row and dropped */
    const int64_t rows = T < tch ? T : tch;
    const size_t q_bytes = ((size_t)(nkb * rows * KB + (amx ? 32 * KB : 0)) + 63) & ~(size_t)63;
    /* then the unit's output rows, OB floats each: contiguous, where dst's rows (N floats
     * apart, a multiple of 4 KB for most matrices) would all fall in one L1 set */
    const size_t acc_bytes = (size_t)(rows * OB) * sizeof(float);
    uint8_t * scratch = (uint8_t *)qtts_scratch_get(
        QTTS_SCRATCH_I8_INPUT, q_bytes + acc_bytes + (size_t)(rows * nkb) * sizeof(float));
    uint8_t * xq = scratch;
    float * yacc = (float *)(scratch + q_bytes);
    float * xsc = (float *)(scratch + q_bytes + acc_bytes);
    const int64_t xs = (int64_t)(xt->nb[1] / sizeof(float));
    const float * x = (const float *)xt->data;
    const int8_t * w = (const int8_t *)wt->data;
    const float * ws = (const float *)st->data;
    const int32_t * wc = (const int32_t *)ct->data;
    float * y = (float *)dst->data;
    int64_t have_tc = -1;
#if AMX_I8
    if (amx) qtts_amx_configure(); /* per thread, per call: the ggml worker threads run other code */
#endif
    for (int64_t u = u0; u < u1; u++) {
        const int64_t tc = u / n_ob, ob = u % n_ob;
        const int64_t t0 = tc * tch, t_end = t0 + tch < T ? t0 + tch : T;
        if (tc != have_tc) {
            for (int64_t t = t0; t < t_end; t++) {
                quantize_row(xq + (t - t0) * KB, rows * KB, xsc + (t - t0) * nkb, x + t * xs, K, Kp);
            }
            have_tc = tc;
        }
        const int64_t o0 = ob * OB;
        const int width = (int)(N - o0 < OB ? N - o0 : OB);
#if AMX_I8
        if (amx) {
            for (int64_t b = 0; b < nkb; b++) {
                for (int64_t t = t0; t < t_end; t += 32) {
                    const int nt = (int)(t_end - t < 32 ? t_end - t : 32);
                    const i8_args at = {.xsc = xsc + (t - t0) * nkb, .w = w + ob * ng * OB * 4,
                                        .wsc = ws + ob * nkb * OB, .wc = wc + ob * nkb * OB,
                                        .nkb = nkb, .ng = ng};
                    const uint8_t * xb = xq + (b * rows + (t - t0)) * KB;
                    if (nt > 16) {
                        amx_i8_block(2, yacc + (t - t0) * OB, OB, nt, &at, xb, KB, b);
                    } else {
                        amx_i8_block(1, yacc + (t - t0) * OB, OB, nt, &at, xb, KB, b);
                    }
                }
            }
            for (int64_t t = t0; t < t_end; t++) {
                memcpy(y + t * N + o0, yacc + (t - t0) * OB, (size_t)width * sizeof(float));
            }
            continue;
        }
#endif
        const i8tile_fn * fns = width == OB ? I8TILE_FULL : (width <= VW ? I8TILE_HALF : I8TILE_MASK);
        /* block-outer: the block's weights (B x KB bytes) stay in L1 across the chunk's tiles */
        for (int64_t b = 0; b < nkb; b++) {
            for (int64_t t = t0; t < t_end; t += NT_MAIN) {
                const int nt = (int)(t_end - t < NT_MAIN ? t_end - t : NT_MAIN);
                const i8_args a = {
                    .x = xq + (b * rows + (t - t0)) * KB, .xsc = xsc + (t - t0) * nkb,
                    .w = w + ob * ng * OB * 4, .wsc = ws + ob * nkb * OB,
                    .wc = wc + ob * nkb * OB, .nkb = nkb, .ng = ng,
                };
                fns[nt](yacc + (t - t0) * OB, OB, &a, width, b);
            }
        }
        for (int64_t t = t0; t < t_end; t++) {
            memcpy(y + t * N + o0, yacc + (t - t0) * OB, (size_t)width * sizeof(float));
        }
    }
#if AMX_I8
    if (amx) _tile_release();
#endif
}
