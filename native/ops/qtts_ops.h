/* qtts native kernels: ggml custom ops written for the Qwen3-TTS decoder.
 *
 * Declarations only (this header is also fed to cffi by native/build.py): no includes other
 * than ggml.h, no macros other than integer #defines.
 *
 * Layout ("time-major"): activations are F32 tensors with ne = [C, T] (channels fastest,
 * contiguous rows); per-channel parameters are F32 vectors ne = [C].
 */
#pragma once

#include "ggml.h"

/* The library holds the kernels compiled once per ISA variant (native/build.py) and forwards
 * every function below to one of them, chosen when it is loaded (dispatch.c): the best variant
 * this CPU runs. qtts_ops_variant() names it ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx512",
 * "avx2", "scalar"; "native" in a -march=native build; "generic" off x86); qtts_ops_variants()
 * lists the variants built in, best first, comma-separated. */
const char * qtts_ops_variant(void);
const char * qtts_ops_variants(void);

/* Which SIMD path the variant in use was compiled with. */
#define QTTS_ISA_SCALAR 0
#define QTTS_ISA_AVX2 2
#define QTTS_ISA_AVX512 5

/* Fast-path limit of the vectorised sine: |exp_alpha * x| above it goes through libm (double). */
#define QTTS_SNAKE_FAST_MAX 131072

int qtts_ops_isa(void);

/* SnakeBeta as a ggml_custom3_op_t for ggml_map_custom3(ctx, x, exp_alpha, inv_beta, ...):
 *   dst[t, c] = x[t, c] + inv_beta[c] * sin(exp_alpha[c] * x[t, c])^2
 * x, dst: F32 contiguous, ne = [C, T, ...]; exp_alpha, inv_beta: F32 contiguous, ne = [C].
 * Rows (time steps) are split across the nth threads. */
void qtts_snake_beta_op(struct ggml_tensor * dst, const struct ggml_tensor * a,
                        const struct ggml_tensor * b, const struct ggml_tensor * c,
                        int ith, int nth, void * userdata);

/* ELU (alpha = 1) as a ggml_custom1_op_t for ggml_map_custom1(ctx, x, qtts_elu_op, n, NULL):
 *   dst = x > 0 ? x : expm1(x)   (vectorised expm1, about 1 ulp; NaN passes through)
 * x, dst: F32 contiguous, any shape. Elements are split across the nth threads. */
void qtts_elu_op(struct ggml_tensor * dst, const struct ggml_tensor * a, int ith, int nth,
                 void * userdata);

/* The transposed V write of a prefill as a ggml_custom2_op_t for
 * ggml_map_custom2_inplace(ctx, cache_view, v, qtts_kv_write_transposed_op, n, NULL):
 *   cache_view[c, p] = v[p, c]   (converted to the cache's type)
 * cache_view: F16 or F32 ne = [n, C], contiguous rows (nb[0] = type size), any row stride (a view
 * of the cache's channel-major V); v: F32 ne = [C, n], contiguous rows, any row stride. Channel
 * blocks of 16 are split across the nth threads. F32 -> F16 rounds to nearest even: the bits
 * ggml's CPY writes. */
void qtts_kv_write_transposed_op(struct ggml_tensor * dst, const struct ggml_tensor * a,
                                 const struct ggml_tensor * b, int ith, int nth, void * userdata);

/* Channel join of time-major activations as a ggml_custom_op_t for
 * ggml_custom_4d(ctx, F32, C_0 + ... + C_{n-1}, T, 1, 1, parts, n, qtts_channel_join_op, n, NULL):
 *   dst[t, :] = [part0[t, :] | part1[t, :] | ...]   (n <= GGML_MAX_SRC parts)
 * parts: F32 ne = [C_i, T], contiguous rows (nb[0] = 4), any row stride (views of channel
 * ranges too); dst: contiguous. Rows are split across the nth threads. */
void qtts_channel_join_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* Time join of time-major activations as a ggml_custom_op_t for
 * ggml_custom_4d(ctx, F32, C, T_0 + ... + T_{n-1}, 1, 1, parts, n, qtts_time_join_op, n, NULL):
 *   dst = [part0 rows | part1 rows | ...]   (n <= GGML_MAX_SRC parts)
 * parts: F32 ne = [C, T_i], contiguous rows (nb[0] = 4), any row stride; dst: contiguous.
 * Rows are split across the nth threads. */
void qtts_time_join_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* Per-channel mean and variance over time (the speaker encoder's pooling) as a ggml_custom_op_t
 * for ggml_custom_4d(ctx, F32, 2 * C, 1, 1, 1, {x}, 1, qtts_pool_stats_op, n, NULL), or with
 * weights, {x, w} and 2 sources:
 *   dst[c] = m_c = sum_t w[c, t] x[c, t],  dst[C + c] = sum_t w[c, t] (x[c, t] - m_c)^2
 * (w = 1 / T without weights). x, w: F32 channel-major ne = [T, C], contiguous rows (nb[0] = 4,
 * any row stride). Sums in double; channels are split across the nth threads. */
void qtts_pool_stats_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* Causal GQA attention of a prefill, fused (scores, softmax, product with V), as a
 * ggml_custom_op_t for
 * ggml_custom_4d(ctx, F32, d * H, T, 1, 1, {q, k, v, pos}, 4, qtts_attn_causal_op, n, NULL):
 *   dst[t, h*d + c] = sum_j softmax_j(K[j, hk] . q[t, h] / sqrt(d)) V[j, hk, c] over the keys
 *   j <= pos[t], hk = h / (H / H_kv)
 * q: F32 ne = [d, H, T], contiguous rows of d (any head and position strides); k: a view of the
 * cache's position-major K, F16 or F32 ne = [d * H_kv, n_kv], contiguous rows; v: a view of the
 * cache's channel-major V, F16 or F32 ne = [n_kv, d * H_kv], contiguous rows; pos: I32 ne =
 * [T], every value in 0 .. n_kv - 1 (a query at position p sees cache rows 0 .. p); H a multiple
 * of H_kv with H / H_kv <= 16. F32 sums; (KV head, block of 16 / (H / H_kv) queries) items are
 * split across the nth threads. */
void qtts_attn_causal_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);
/* 1 where the op has its SIMD path (AVX-512 or AVX2): the portable C one is slower than ggml's
 * nodes */
int qtts_attn_causal_fast(void);

/* The attention of decoding steps, fused with their K/V writes, as a ggml_custom_op_t for
 * ggml_custom_4d(ctx, F32, d * H, T, 1, 1, {q, k, v, pos}, 4, qtts_attn_step_op, n, args):
 *   for each column t, session s = t / per, in order: the cache of s gets K row k[t] at
 *   position p = pos[t] and V column v[t] there; then
 *   dst[t, h*d + c] = sum_{j <= p} softmax_j(K_s[j, hk] . q[t, h] / sqrt(d)) V_s[j, hk, c]
 * q: F32 ne = [d, H, T], contiguous rows of d; k, v: F32 ne = [d * H_kv, T], contiguous rows
 * (the new rows); pos: I32 ne = [T]; args (int64_t): n_sessions, per (columns per session,
 * consecutive), f16 (1: F16 caches, 0: F32), then per session its layer's K data pointer, K row
 * stride (bytes per position), V data pointer (channel 0, position 0), V row stride (bytes per
 * channel) and n_ctx (its positions). A p outside 0 .. n_ctx - 1 writes nothing and gives
 * zeros. (session, KV head) items are split across the nth threads; the caches are written
 * through the pointers, which must stay valid while the graph is used. */
void qtts_attn_step_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* Sliding-window causal attention (the decoder's pre-transformer), as a ggml_custom_op_t for
 * ggml_custom_4d(ctx, F32, d * H, T, 1, 1, {q, k, v, pos}, 4, qtts_attn_window_op, n, window):
 *   dst[t, h*d + c] = sum_j softmax_j(k[j, hk] . q[t, h] / sqrt(d)) v[j, hk, c] over the keys j
 *   whose position p0 - n_cache + j lies in max(0, p - window + 1) .. p, p = p0 + t,
 *   p0 = pos[0], n_cache = Tk - T, hk = h / (H / H_kv)
 * q: F32 ne = [d, H, T]; k, v: F32 ne = [d, H_kv, Tk] (the carried rows, then the chunk's), rows
 * of d contiguous, any other strides; pos: I32 ne = [T], consecutive positions. Each query's keys
 * are summed in position order: the result depends on positions only, not on where a chunk
 * starts or on the thread count. */
void qtts_attn_window_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* GELU with the exact erf, y = x/2 (1 + erf(x / sqrt 2)) (ggml's GELU_ERF), as a
 * ggml_custom1_op_t for ggml_map_custom1(ctx, x, qtts_gelu_erf_op, n, NULL): vectorised,
 * within 6 ulp of the float64 GELU from x = -5 up (scalar build: erff); x: F32, contiguous,
 * any shape. */
void qtts_gelu_erf_op(struct ggml_tensor * dst, const struct ggml_tensor * a, int ith, int nth,
                      void * userdata);

/* Row argmax, as a ggml_custom_op_t for
 * ggml_custom_4d(ctx, I32, rows, 1, 1, 1, {x}, 1, qtts_argmax_op, n, NULL):
 *   dst[r] = the first index of the largest value of row r (NaN never taken; 0 when no value
 *   exceeds -inf; ggml_argmax takes the last of equal values and runs on one thread).
 * x: F32 ne = [n, rows], contiguous rows (any row stride); 2-D. */
void qtts_argmax_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* Causal attention over a whole input (the codec encoder's transformer), as a
 * ggml_custom_op_t for ggml_custom_4d(ctx, F32, d * H, T, 1, 1, {q, k, v}, 3,
 * qtts_attn_full_op, n, NULL):
 *   dst[t, h*d + c] = sum_{j <= t} softmax_j(k[j, hk] . q[t, h] / sqrt(d)) v[j, hk, c],
 *   hk = h / (H / H_kv)
 * q: F32 ne = [d, H, T]; k, v: F32 ne = [d, H_kv, T]; rows of d contiguous, any other strides.
 * The products run on qtts_conv1d_tm_op's tiles (scores as a 1x1 conv of q by the keys, the
 * output as one of the probabilities by the values): every sum in key or channel order, the
 * result independent of the thread count. */
void qtts_attn_full_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* Causal dilated conv1d, time-major, as a ggml_custom_op_t for
 * ggml_custom_4d(ctx, F32, C_out, T, 1, 1, {xp, w, bias}, 3, qtts_conv1d_tm_op, n, (void*)d)
 * or, with the history in a tensor of its own (no concat),
 * ggml_custom_4d(ctx, F32, C_out, T, 1, 1, {x, w, bias, hist}, 4, qtts_conv1d_tm_op, n, (void*)d):
 *   dst[t, o] = bias[o] + sum_k sum_c W[k, c, o] * xp[t + k*d, c]
 * xp: F32 ne = [C_in, T + (K-1)*d], rows contiguous (nb[0] = 4, any row stride);
 *   with 4 sources xp is the join [hist | x]: hist F32 ne = [C_in, (K-1)*d] (K > 1) and
 *   x F32 ne = [C_in, T], rows contiguous, any row stride each; the result is bit for bit the
 *   one on the concatenated xp;
 * w: F32 contiguous, W packed in blocks of B = qtts_conv1d_tm_block() output channels:
 *   ne = [B, C_in, K, ceil(C_out / B)] (numpy [n_blocks, K, C_in, B]), w[j, k, c, i] =
 *   W[k, c, j*B + i], zero past C_out;
 * bias: F32 ne = [C_out]; dst: ne = [C_out, T]; userdata: the dilation d (an integer cast to
 * a pointer). Threads split time chunks (and output-channel blocks when time is short).
 * With userdata 1 | QTTS_CONV_WINOGRAD and the history apart (K - 1 rows): a conv of K = 2
 * or 3 taps and dilation 1 whose w holds K + 2 taps, the K and two combinations of them
 * (pack_conv_weight_winograd), runs in Winograd groups: F(3, 2), four products over C_in for
 * every three outputs instead of six, or F(2, 3), four for every two instead of six. Its sums
 * differ from the direct ones by F32 roundings; the result does not depend on the thread
 * count either. */
#define QTTS_CONV_WINOGRAD 0x100000
void qtts_conv1d_tm_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* Output channels per packed weight block of qtts_conv1d_tm_op (depends on the SIMD path). */
int qtts_conv1d_tm_block(void);

/* One SEANet residual unit of the speech-tokenizer encoder in a single node, as a
 * ggml_custom_op_t for
 * ggml_custom_4d(ctx, F32, C, T, 1, 1, {h, w3, b3, w1, b1}, 5, qtts_seanet_unit_op, n, flags):
 *   r = conv_K(ELU(h)) (causal: (K-1)*d zero rows in front), s = h + conv_1(ELU(r)),
 *   dst = s, or ELU(s) with QTTS_SEANET_ELU_OUT in the flags,
 * every value bit for bit that of the separate ELU, qtts_conv1d_tm_op and add nodes. The unit
 * runs slice by slice in time, so its intermediates stay in the cache instead of being written
 * out and read back. h: F32 ne = [C, T], contiguous; w3, b3: a conv C -> R of K taps packed as
 * for qtts_conv1d_tm_op; w1, b1: a conv R -> C of 1 tap; flags: the dilation d in the low 16
 * bits, or'ed with QTTS_SEANET_ELU_OUT. */
#define QTTS_SEANET_ELU_OUT 0x10000
/* ...or'ed with QTTS_SEANET_UNIT_WINO (also for qtts_seanet_stage_op): w3 is a conv of K = 3
 * and dilation 1 packed with five taps (see QTTS_CONV_WINOGRAD) and runs in Winograd F(2, 3)
 * groups, bit for bit as qtts_conv1d_tm_op runs it. */
#define QTTS_SEANET_UNIT_WINO 0x40000
void qtts_seanet_unit_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* A SEANet unit and the strided conv after it (one stage of the encoder) in a single node:
 * ggml_custom_4d(ctx, F32, C_out, T_out, 1, 1, {h, w3, b3, w1, b1, ws, bs}, 7,
 *                qtts_seanet_stage_op, n, flags):
 *   dst = conv_s(ELU(unit(h))), conv_s: a causal conv of 2s taps with stride s, C -> C_out,
 *   its s rows of left padding and the rows that complete the last window zeros,
 *   T_out = ceil(T / s),
 * every value bit for bit that of the separate nodes (the unit as qtts_seanet_unit_op with
 * QTTS_SEANET_ELU_OUT, then qtts_conv1d_tm_op on the folded rows). The unit's output never
 * leaves the cache: each slice of it is folded and convolved at once. h .. b1 as for
 * qtts_seanet_unit_op; ws: the conv folded to 2 taps over rows of s * C channels and packed
 * as for qtts_conv1d_tm_op (ne = [B, s * C, 2, ceil(C_out / B)]); bs: F32 [C_out]; flags:
 * the unit's dilation in the low 16 bits, or'ed with s << QTTS_SEANET_STRIDE_SHIFT. */
#define QTTS_SEANET_STRIDE_SHIFT 20
/* ...or'ed with QTTS_SEANET_WINO: ws packed with four taps as for QTTS_CONV_WINOGRAD (above),
 * and the strided conv runs in Winograd F(3, 2) groups, bit for bit as qtts_conv1d_tm_op does. */
#define QTTS_SEANET_WINO 0x20000
void qtts_seanet_stage_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* Output channels per packed weight block of qtts_conv1d_tm_bf16_op (every build). */
#define QTTS_CONV_BF16_BLOCK 32

/* qtts_conv1d_tm_bf16_op's userdata: the dilation in the low bits, or'ed with flags naming the
 * optional sources that follow bias, in this order: hist, exp_alpha + inv_beta, residual. */
#define QTTS_CONV_DILATION_MASK 65535
#define QTTS_CONV_HIST 65536
#define QTTS_CONV_SNAKE 131072
#define QTTS_CONV_RESIDUAL 262144
/* qtts_conv1d_tm_bf16_op only: the weight holds 2K taps, W's BF16 part hi(W) in taps 0 .. K-1
 * and the BF16 rounding of its rest lo(W) = bf16(W - hi(W)) in taps K .. 2K-1, and each
 * product is hi(W) hi(x) + hi(W) lo(x) + lo(W) hi(x) (x likewise split): ~16 significant bits
 * of each operand, F32-class error at BF16 speed where the AMX tiles run. */
#define QTTS_CONV_SPLIT 524288

/* BF16 causal dilated conv1d, time-major (fast mode), as a ggml_custom_op_t for
 * ggml_custom_4d(ctx, F32, C_out, T, 1, 1, {xp, w, bias}, 3, qtts_conv1d_tm_bf16_op, n, (void*)d)
 * or with {x, w, bias, hist}, 4 sources and d | QTTS_CONV_HIST: the history apart, as for
 * qtts_conv1d_tm_op:
 *   dst[t, o] = bias[o] + sum_k sum_c bf16(W[k, c, o]) * bf16(xp[t + k*d, c])   (F32 sums)
 * With QTTS_CONV_SNAKE, two more sources exp_alpha, inv_beta (F32 ne = [C_in]) and xp read as
 * snake(xp) (qtts_snake_beta_op's values; the history too). With QTTS_CONV_RESIDUAL, one more
 * source res (F32 ne = [C_out, T], rows contiguous) and dst = res + (the conv).
 * xp: F32 ne = [C_in, T + (K-1)*d], rows contiguous (nb[0] = 4, any row stride), converted to
 *   BF16 inside the op (nearest even, subnormals to zero);
 * w: BF16 contiguous, ne = [2*B, ceil(C_in / 2), K, ceil(C_out / B)], B = QTTS_CONV_BF16_BLOCK
 *   (numpy [n_blocks, K, C_in/2, B, 2]): w[j, k, p, i, e] = W[k, 2p + e, j*B + i], zero past
 *   C_out and past C_in;
 * bias: F32 ne = [C_out]; dst: ne = [C_out, T]; userdata: the dilation d. The result does not
 * depend on the thread count. */
void qtts_conv1d_tm_bf16_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* 1 when qtts_conv1d_tm_bf16_op has its AVX512_BF16 kernel, 0 for the slow portable path. */
int qtts_conv1d_tm_bf16_fast(void);

/* 1 when the variant in use has the AMX-BF16 tile kernel of qtts_conv1d_tm_bf16_op compiled in
 * (whether it runs: qtts_ops_amx). */
int qtts_conv1d_tm_bf16_amx_built(void);

/* 1 while qtts_conv1d_tm_bf16_op runs on AMX tiles: the CPU has AMX-BF16, the OS granted this
 * process the tile state (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, asked once at load), a
 * variant with the tile kernel is built in and AMX is not turned off. Same sources, flags,
 * packed weights and result contract (BF16 products, F32 sums; another summation order). */
int qtts_ops_amx(void);

/* Allow (on != 0, the default) or forbid the AMX tile path: re-chooses the variant as at load
 * (a portable build then runs "avx512_bf16" instead of "amx_bf16"; every variant shares the
 * packed-weight layouts). Not while a graph runs. Returns qtts_ops_amx(). */
int qtts_ops_set_amx(int on);

/* INT8 GEMM (W8A8) for prefills of quantised models, as a ggml_custom_op_t for
 * ggml_custom_4d(ctx, F32, N, T, 1, 1, {x, wq, ws, wc}, 4, qtts_gemm_i8_op, n, NULL):
 *   dst[t, o] = sum_b ws[o, b] * xs[t, b] * sum_{k in block b} Wq[o, k] * xq[t, k]
 * over blocks b of QTTS_GEMM_I8_KBLOCK input channels, with x rounded to int8 per (row, block)
 * inside the op (s = max|x| / 127, nearest even, clamped to +-127).
 * x: F32 ne = [K, T], rows contiguous (nb[0] = 4, any row stride);
 * wq, ws, wc from qtts_gemm_i8_pack, B = QTTS_GEMM_I8_BLOCK, Kp = K rounded up to 4:
 *   wq: I8 contiguous ne = [4*B, Kp/4, ceil(N/B)] (wq[j, g, i, e] = Wq[j*B + i, 4g + e]);
 *   ws: F32 and wc: I32 contiguous ne = [B, ceil(K/KBLOCK), ceil(N/B)] (scale, -128 * sum Wq);
 * dst: F32 ne = [N, T]. The result does not depend on the thread count. */
#define QTTS_GEMM_I8_BLOCK 32
#define QTTS_GEMM_I8_KBLOCK 256
void qtts_gemm_i8_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* W (F32, row-major [N][K]: ggml's ne = [K, N]) -> wq, ws, wc for qtts_gemm_i8_op; the
 * buffers hold ceil(N/B)*B*Kp bytes and ceil(N/B)*ceil(K/KBLOCK)*B values each. */
void qtts_gemm_i8_pack(const float * W, int64_t N, int64_t K, int8_t * wq, float * ws,
                       int32_t * wc);

/* 1 when qtts_gemm_i8_op has its AVX512_VNNI kernel, 0 for the slow portable path. */
int qtts_gemm_i8_fast(void);

/* 1 when this variant's qtts_gemm_i8_op has its AMX-INT8 tile path, which runs while the AMX
 * tiles are on (qtts_ops_amx) for matrices of whole 256-input and 32-output blocks: the same
 * bits as the VNNI kernel (exact integer sums, the same epilogue). */
int qtts_gemm_i8_amx_built(void);

/* Q4_0 matrix x a few rows (W4A8; the steps of quantised talkers), as a ggml_custom_op_t for
 * ggml_custom_4d(ctx, F32, N, ne1, ne2, ne3, {x, w}, 2, qtts_gemv_q4_op, n, NULL):
 *   dst[t, o] = sum_b d_w[o, b] * d_x[t, b] * (sum_{k in b} u[o, k] * xq[t, k] - 8 * sum xq[t, b])
 * over blocks b of 32 inputs: the weight's Q4_0 blocks (scale d_w, nibbles u), x rounded per
 * (row, block) inside the op as ggml's Q8_0 activations (d_x = F16(max|x| / 127), q = nearest
 * even of x * 127 / max|x|).
 * x: F32 ne = [K, ne1, ne2, ne3], K a multiple of 32, rows contiguous (nb[0] = 4, any strides);
 * w: I8 contiguous ne = [QTTS_GEMV_Q4_BYTES, K/32, N/QTTS_GEMV_Q4_ROWS] from qtts_gemv_q4_pack;
 * dst: F32 contiguous, N outputs per row. Each output is one F32 fma chain over the blocks in
 * order with exact integer block sums: independent of the row count, thread count and path. */
#define QTTS_GEMV_Q4_ROWS 16
#define QTTS_GEMV_Q4_BYTES 288
void qtts_gemv_q4_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* A GGUF Q4_0 matrix (N rows of K/32 blocks of 18 bytes; N a multiple of QTTS_GEMV_Q4_ROWS) ->
 * the layout of qtts_gemv_q4_op's w: N/16 * K/32 * QTTS_GEMV_Q4_BYTES bytes. */
void qtts_gemv_q4_pack(const uint8_t * q4, int64_t N, int64_t K, uint8_t * out);

/* 1 when qtts_gemv_q4_op has its AVX512_VNNI kernel, 0 for the portable path (same bits). */
int qtts_gemv_q4_fast(void);

/* The K = 7 BF16 conv of qtts_conv1d_tm_bf16_op (same sources, flags, userdata and result
 * contract, BF16 rounding aside) by Winograd F(2,3) over output pairs (t, t+d): 10
 * channel-contractions per pair instead of 14. w: BF16 contiguous,
 * ne = [2*B, 10, ceil(C_in / 2), ceil(C_out / B)], B = QTTS_CONV_BF16_BLOCK (numpy
 * [n_blocks, cp, 10, B, 2]): w[j, p, k, i, e] = G_k[2p + e, j*B + i] for the slots k =
 * (g0, (g0+g1+g2)/2, (g0-g1+g2)/2, g2) of taps 0-2, the same of taps 3-5, g6, -g6. */
void qtts_conv1d_wino_bf16_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* Fast mode's K = 7 and K = 2 convs in F32 where the BF16 kernels are missing: the sources,
 * flags, userdata and result contract of qtts_conv1d_tm_bf16_op (F32 products and sums) by
 * Winograd F(6,7) / F(6,2) over tiles of six output steps (t, t+d, .., t+5d): 12 (7)
 * channel-contractions per tile instead of 42 (12). w: F32 contiguous,
 * ne = [B, C_in, AL, ceil(C_out / B)], AL = K + 5, B = QTTS_CONV_WINO_F32_BLOCK (numpy
 * [n_blocks, AL, C_in, B]): w[j, p, c, i] = sum_k G[p][k] W[k, c, j*B + i], G the filter
 * transform of conv1d_wino_f32.c's points, zero past C_out. */
#define QTTS_CONV_WINO_F32_BLOCK 16
void qtts_conv1d_wino_f32_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* 1 when qtts_conv1d_wino_f32_op has its AVX2/FMA kernel, 0 for the portable path. */
int qtts_conv1d_wino_f32_fast(void);
