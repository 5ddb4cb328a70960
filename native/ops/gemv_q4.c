/* Q4_0 matrix x few rows (W4A8): the talker's and code predictor's steps, y = W x.
 *
 *   y[t, o] = sum_b  (d_w[o, b] * d_x[t, b]) * (sum_{k in b} u[o, k] * xq[t, k] - 8 * sum xq[t, b])
 *
 * over blocks b of 32 input channels. W is a GGUF Q4_0 matrix (per (row, block): an F16 scale
 * d_w and 32 unsigned nibbles u, weight = (u - 8) * d_w), re-laid out by qtts_gemv_q4_pack; x is
 * rounded inside the op per (row, block) as ggml's Q8_0 activations are: d = max|x| / 127 (kept
 * as F16), q = nearest-even(x * 127 / max|x|). So the products are ggml's Q4_0 x Q8_0 dot.
 *
 * Why: a step multiplies one row (or one per batched session) by every matrix, so it streams
 * the weights once and its speed is the rate the kernel consumes them. ggml's repacked q4_0 GEMV
 * reaches about half the machine's read bandwidth on a stream of matrices larger than the cache
 * (docs/performance.md, Kernels); this kernel unpacks 128 nibbles per 64-byte load into two
 * VPDPBUSD (u8 weights x s8 inputs, 64 MACs each) with the scales beside the nibbles, so one
 * sequential stream per thread feeds it, and prefetches a few blocks ahead. Several rows (a
 * batched step) reuse each loaded block from L1: the weights are read from memory once for any
 * number of rows. On AVX2 the same layout feeds VPMADDUBSW (half a group per register).
 *
 * Packed layout, per output block j of 16 rows and input block b (QTTS_GEMV_Q4_BYTES bytes):
 *   256 bytes of nibbles, 4 groups g of 64: byte 4 * r + e of group g holds
 *     low nibble  = u[16 j + r, 32 b + 8 g + e], high nibble = u[16 j + r, 32 b + 8 g + 4 + e];
 *   then the 16 rows' F16 scales d_w.
 * so lane r of a VPDPBUSD is output row r and its 4 bytes meet 4 consecutive inputs.
 *
 * Result contract: each output is the F32 chain f = fma((float)isum_b, d_w * d_x, f) over b in
 * order, with exact integer block sums; so a row's outputs do not depend on the number of rows,
 * the thread count or the path (the portable C path gives the same bits).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qtts_ops.h"
#include "qtts_scratch.h"

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define Q4_SIMD 1
#include <immintrin.h>
#else
#define Q4_SIMD 0
#endif
/* AVX2 (no VNNI): VPMADDUBSW (u8 nibbles x s8 inputs, pairs summed to s16) does the products;
 * over a block each int16 lane sums 16 of a row's products, which fit exactly (16 x 15 x 127 =
 * 30480 < 2^15), so one VPMADDWD per block widens them to the same int32 sums */
#if !Q4_SIMD && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4_AVX2 1
#include <immintrin.h>
#else
#define Q4_AVX2 0
#endif

#define INLINE static inline __attribute__((always_inline))
#define OR QTTS_GEMV_Q4_ROWS /* output rows per packed block (16) */
#define QK 32                /* inputs per block */
#define BB QTTS_GEMV_Q4_BYTES
#define NTG 4                /* input rows per pass over a block pair */
#define PF_BYTES 2048        /* prefetch distance on the weight stream */

#if Q4_SIMD || Q4_AVX2
/* the packed block PF_BYTES ahead of p (its nibbles and scales: 5 cache lines), into L2, not
 * L1: on a Zen 4 the stream ran 7-15 % faster so (docs/performance.md, Session 35) */
INLINE void prefetch_block(const uint8_t * p) {
    for (int i = 0; i <= 256; i += 64) _mm_prefetch((const char *)p + PF_BYTES + i, _MM_HINT_T1);
}
#endif

int qtts_gemv_q4_fast(void) { return Q4_SIMD || Q4_AVX2; }

void qtts_gemv_q4_pack(const uint8_t * q4, int64_t N, int64_t K, uint8_t * out) {
    const int64_t nkb = K / QK, nob = N / OR;
    /* at load time, for every Q4_0 matrix of a talker: use the machine's cores */
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < nob; j++) {
        for (int64_t b = 0; b < nkb; b++) {
            uint8_t * o = out + (j * nkb + b) * BB;
            for (int r = 0; r < OR; r++) {
                /* GGUF Q4_0 block: F16 d, then qs[i] = u[i] | u[i + 16] << 4 */
                const uint8_t * blk = q4 + ((j * OR + r) * nkb + b) * (2 + QK / 2);
                uint8_t u[QK];
                for (int i = 0; i < QK / 2; i++) {
                    u[i] = blk[2 + i] & 0x0F;
                    u[i + QK / 2] = blk[2 + i] >> 4;
                }
                for (int g = 0; g < 4; g++) {
                    for (int e = 0; e < 4; e++) {
                        o[g * 64 + 4 * r + e] = (uint8_t)(u[8 * g + e] | u[8 * g + 4 + e] << 4);
                    }
                }
                memcpy(o + 256 + 2 * r, blk, 2);
            }
        }
    }
}

/* One input row -> int8 blocks, their F16-rounded scales and 8 * their sums (ggml's Q8_0).
 * Every thread rounds every row of every product, so the AVX-512 form matters as soon as a step
 * has a few rows (docs/performance.md, Kernels); it gives the scalar loop's bits for finite
 * inputs (IEEE multiply, round-to-nearest-even, the F16 scale through ggml's conversion). */
#if Q4_SIMD
/* 16 values x id -> nearest-even integers clamped to [-127, 127] (as int32) */
INLINE __m512i to_q8(__m512 v, __m512 id) {
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i i = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v, id), rn));
    return _mm512_max_epi32(_mm512_min_epi32(i, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}

static void quantize_row(int8_t * q, float * d, int32_t * s8, const float * x, int64_t K) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < K / QK; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_and_ps(v0, abs_mask), _mm512_and_ps(v1, abs_mask)));
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        d[b] = ggml_fp16_to_fp32(ggml_fp32_to_fp16(amax / 127.0f));
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i c0 = to_q8(v0, vid), c1 = to_q8(v1, vid);
        _mm_storeu_si128((__m128i *)(void *)(q + b * QK), _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)(void *)(q + b * QK + 16), _mm512_cvtepi32_epi8(c1));
        s8[b] = 8 * _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
    }
}
#else
static void quantize_row(int8_t * q, float * d, int32_t * s8, const float * x, int64_t K) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float * v = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        d[b] = ggml_fp16_to_fp32(ggml_fp32_to_fp16(amax / 127.0f));
        int32_t sum = 0;
        for (int i = 0; i < QK; i++) {
            const float r = nearbyintf(v[i] * id);
            const int32_t qi = r > 127.0f ? 127 : (r < -127.0f ? -127 : (int32_t)r);
            q[b * QK + i] = (int8_t)qi;
            sum += qi;
        }
        s8[b] = 8 * sum;
    }
}
#endif

typedef struct {
    const int8_t * xq;  /* row t's blocks at xq + t * K */
    const float * xd;   /* row t, block b at xd[t * nkb + b] */
    const int32_t * xs; /* same indexing */
    int64_t nkb, K;
} q4_rows;

#if Q4_SIMD
INLINE __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}

/* NB (1 or 2) output blocks from w (consecutive) x NT rows from t0: y[t, 16 * NB] at y + t * ys */
INLINE void kernel(const int NB, const int NT, const uint8_t * w, const q4_rows * r, int64_t t0,
                   float * y, int64_t ys) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const int64_t nkb = r->nkb, wstride = nkb * BB;
    /* one row: low and high nibbles in two accumulator chains each (VPDPBUSD's latency); more
     * rows have chains enough, and one accumulator per (block, row) keeps them in registers */
    const int SPLIT = NT == 1;
    __m512 f[2][NTG];
#pragma GCC unroll 2
    for (int n = 0; n < NB; n++) {
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) f[n][t] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nkb; b++) {
        __m512i lo[2][NTG], hi[2][NTG];
#pragma GCC unroll 2
        for (int n = 0; n < NB; n++) {
            const uint8_t * p = w + n * wstride + b * BB;
            prefetch_block(p);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                lo[n][t] = _mm512_set1_epi32(-r->xs[(t0 + t) * nkb + b]);
                if (SPLIT) hi[n][t] = _mm512_setzero_si512();
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            __m512i ul[2], uh[2];
#pragma GCC unroll 2
            for (int n = 0; n < NB; n++) {
                const __m512i v = _mm512_loadu_si512((const void *)(w + n * wstride + b * BB + g * 64));
                ul[n] = _mm512_and_si512(v, m4);
                uh[n] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const int32_t * xb = (const int32_t *)(const void *)(r->xq + (t0 + t) * r->K + b * QK);
                const __m512i xl = _mm512_set1_epi32(xb[2 * g]);
                const __m512i xh = _mm512_set1_epi32(xb[2 * g + 1]);
#pragma GCC unroll 2
                for (int n = 0; n < NB; n++) {
                    lo[n][t] = dpbusd(lo[n][t], ul[n], xl);
                    if (SPLIT) {
                        hi[n][t] = dpbusd(hi[n][t], uh[n], xh);
                    } else {
                        lo[n][t] = dpbusd(lo[n][t], uh[n], xh);
                    }
                }
            }
        }
#pragma GCC unroll 2
        for (int n = 0; n < NB; n++) {
            const __m512 dw = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(const void *)(w + n * wstride + b * BB + 256)));
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(r->xd[(t0 + t) * nkb + b]));
                const __m512i s = SPLIT ? _mm512_add_epi32(lo[n][t], hi[n][t]) : lo[n][t];
                f[n][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, f[n][t]);
            }
        }
    }
#pragma GCC unroll 2
    for (int n = 0; n < NB; n++) {
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) _mm512_storeu_ps(y + t * ys + n * OR, f[n][t]);
    }
}

typedef void (*q4_kernel_fn)(const uint8_t *, const q4_rows *, int64_t, float *, int64_t);
#define DEF_K(nb, nt)                                                                           \
    static void k_##nb##_##nt(const uint8_t * w, const q4_rows * r, int64_t t0, float * y,       \
                              int64_t ys) {                                                      \
        kernel(nb, nt, w, r, t0, y, ys);                                                         \
    }
DEF_K(1, 1) DEF_K(1, 2) DEF_K(1, 3) DEF_K(1, 4)
DEF_K(2, 1) DEF_K(2, 2) DEF_K(2, 3) DEF_K(2, 4)
static const q4_kernel_fn KERNELS[2][NTG] = {{k_1_1, k_1_2, k_1_3, k_1_4},
                                             {k_2_1, k_2_2, k_2_3, k_2_4}};

static void blocks(int nb, const uint8_t * w, const q4_rows * r, int64_t t0, int nt, float * y,
                   int64_t ys) {
    KERNELS[nb - 1][nt - 1](w, r, t0, y, ys);
}

#elif Q4_AVX2

/* One output block (16 rows: lanes of two halves, rows 0-7 and 8-15) x NT input rows. */
INLINE void kernel2(const int NT, const uint8_t * w, const q4_rows * r, int64_t t0, float * y,
                    int64_t ys) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int64_t nkb = r->nkb;
    __m256 f[2][NTG];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) f[0][t] = f[1][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nkb; b++) {
        const uint8_t * p = w + b * BB;
        prefetch_block(p);
        __m256i s16[2][NTG];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) s16[0][t] = s16[1][t] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            __m256i ul[2], uh[2];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(p + g * 64 + h * 32));
                ul[h] = _mm256_and_si256(v, m4);
                uh[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const int32_t * xb = (const int32_t *)(const void *)(r->xq + (t0 + t) * r->K + b * QK);
                const __m256i xl = _mm256_set1_epi32(xb[2 * g]);
                const __m256i xh = _mm256_set1_epi32(xb[2 * g + 1]);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    s16[h][t] = _mm256_add_epi16(
                        s16[h][t], _mm256_add_epi16(_mm256_maddubs_epi16(ul[h], xl),
                                                    _mm256_maddubs_epi16(uh[h], xh)));
                }
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256 dw =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + 256 + 16 * h)));
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(s16[h][t], ones),
                                                   _mm256_set1_epi32(-r->xs[(t0 + t) * nkb + b]));
                const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(r->xd[(t0 + t) * nkb + b]));
                f[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, f[h][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        _mm256_storeu_ps(y + t * ys, f[0][t]);
        _mm256_storeu_ps(y + t * ys + 8, f[1][t]);
    }
}

typedef void (*q4_kernel_fn)(const uint8_t *, const q4_rows *, int64_t, float *, int64_t);
#define DEF_K2(nt)                                                                              \
    static void k2_##nt(const uint8_t * w, const q4_rows * r, int64_t t0, float * y, int64_t ys) \
    {                                                                                            \
        kernel2(nt, w, r, t0, y, ys);                                                            \
    }
DEF_K2(1) DEF_K2(2) DEF_K2(3) DEF_K2(4)
static const q4_kernel_fn KERNELS2[NTG] = {k2_1, k2_2, k2_3, k2_4};

static void blocks(int nb, const uint8_t * w, const q4_rows * r, int64_t t0, int nt, float * y,
                   int64_t ys) {
    for (int n = 0; n < nb; n++) KERNELS2[nt - 1](w + n * r->nkb * BB, r, t0, y + n * OR, ys);
}

#else

static void blocks(int nb, const uint8_t * w, const q4_rows * r, int64_t t0, int nt, float * y,
                   int64_t ys) {
    const int64_t nkb = r->nkb;
    for (int n = 0; n < nb; n++) {
        for (int t = 0; t < nt; t++) {
            const int8_t * xq = r->xq + (t0 + t) * r->K;
            for (int o = 0; o < OR; o++) {
                float f = 0.0f;
                for (int64_t b = 0; b < nkb; b++) {
                    const uint8_t * p = w + (n * nkb + b) * BB;
                    int32_t s = -r->xs[(t0 + t) * nkb + b];
                    for (int g = 0; g < 4; g++) {
                        for (int e = 0; e < 4; e++) {
                            const uint8_t v = p[g * 64 + 4 * o + e];
                            s += (int32_t)(v & 0x0F) * xq[b * QK + 8 * g + e];
                            s += (int32_t)(v >> 4) * xq[b * QK + 8 * g + 4 + e];
                        }
                    }
                    uint16_t h;
                    memcpy(&h, p + 256 + 2 * o, 2);
                    const float d = ggml_fp16_to_fp32(h) * r->xd[(t0 + t) * nkb + b];
                    f = fmaf((float)s, d, f);
                }
                y[t * ys + n * OR + o] = f;
            }
        }
    }
}

#endif

void qtts_gemv_q4_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void)userdata;
    const struct ggml_tensor * xt = dst->src[0];
    const struct ggml_tensor * wt = dst->src[1];
    GGML_ASSERT(xt->type == GGML_TYPE_F32 && xt->nb[0] == sizeof(float));
    GGML_ASSERT(wt->type == GGML_TYPE_I8 && ggml_is_contiguous(wt) && wt->ne[0] == BB);
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));
    const int64_t K = xt->ne[0], nkb = K / QK, nob = wt->ne[2], N = nob * OR;
    GGML_ASSERT(K % QK == 0 && wt->ne[1] == nkb && dst->ne[0] == N);
    const int64_t T = xt->ne[1] * xt->ne[2] * xt->ne[3];
    GGML_ASSERT(dst->ne[1] * dst->ne[2] * dst->ne[3] == T);

    /* every thread rounds all rows (T * K values: small next to the weights it streams) */
    const size_t q_bytes = ((size_t)(T * K) + 63) & ~(size_t)63;
    uint8_t * scratch = (uint8_t *)qtts_scratch_get(
        QTTS_SCRATCH_Q4_INPUT, q_bytes + (size_t)(T * nkb) * (sizeof(float) + sizeof(int32_t)));
    int8_t * xq = (int8_t *)scratch;
    float * xd = (float *)(scratch + q_bytes);
    int32_t * xs = (int32_t *)(xd + T * nkb);
    for (int64_t i3 = 0, t = 0; i3 < xt->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < xt->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < xt->ne[1]; i1++, t++) {
                const float * row = (const float *)(const void *)((const char *)xt->data +
                    (size_t)i1 * xt->nb[1] + (size_t)i2 * xt->nb[2] + (size_t)i3 * xt->nb[3]);
                quantize_row(xq + t * K, xd + t * nkb, xs + t * nkb, row, K);
            }
        }
    }
    const q4_rows r = {.xq = xq, .xd = xd, .xs = xs, .nkb = nkb, .K = K};

    /* units: pairs of output blocks, split evenly; a pair's weights stay in L1/L2 while every
     * group of NTG rows passes over them */
    const int64_t units = (nob + 1) / 2;
    const int64_t u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    const uint8_t * w = (const uint8_t *)wt->data;
    float * y = (float *)dst->data;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t j = 2 * u;
        const int nb = j + 1 < nob ? 2 : 1;
        for (int64_t t0 = 0; t0 < T; t0 += NTG) {
            const int nt = (int)(T - t0 < NTG ? T - t0 : NTG);
            blocks(nb, w + j * nkb * BB, &r, t0, nt, y + t0 * N + j * OR, N);
        }
    }
}
