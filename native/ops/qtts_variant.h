/* Force-included (cc -include) into every kernel source when native/build.py compiles it once
 * per ISA variant (-DQTTS_VARIANT=avx2, ...): each external symbol gets the variant's suffix,
 * e.g. qtts_snake_beta_op__avx2, so that the copies link into one library side by side and
 * dispatch.c forwards the public names to the variant the CPU runs.
 *
 * A new external function (public or hidden) belongs here, and a public one in dispatch.c's
 * list too: without its line here the link fails with "multiple definition". */
#pragma once

#ifndef QTTS_VARIANT
#error "qtts_variant.h: compile with -DQTTS_VARIANT=<name>"
#endif

#define QTTS_VCAT2(a, b) a##__##b
#define QTTS_VCAT(a, b) QTTS_VCAT2(a, b)
#define QTTS_V(name) QTTS_VCAT(name, QTTS_VARIANT)

/* public (qtts_ops.h) */
#define qtts_ops_isa QTTS_V(qtts_ops_isa)
#define qtts_snake_beta_op QTTS_V(qtts_snake_beta_op)
#define qtts_elu_op QTTS_V(qtts_elu_op)
#define qtts_gelu_erf_op QTTS_V(qtts_gelu_erf_op)
#define qtts_kv_write_transposed_op QTTS_V(qtts_kv_write_transposed_op)
#define qtts_attn_causal_op QTTS_V(qtts_attn_causal_op)
#define qtts_attn_causal_fast QTTS_V(qtts_attn_causal_fast)
#define qtts_attn_step_op QTTS_V(qtts_attn_step_op)
#define qtts_attn_window_op QTTS_V(qtts_attn_window_op)
#define qtts_attn_full_op QTTS_V(qtts_attn_full_op)
#define qtts_channel_join_op QTTS_V(qtts_channel_join_op)
#define qtts_time_join_op QTTS_V(qtts_time_join_op)
#define qtts_pool_stats_op QTTS_V(qtts_pool_stats_op)
#define qtts_argmax_op QTTS_V(qtts_argmax_op)
#define qtts_conv1d_tm_op QTTS_V(qtts_conv1d_tm_op)
#define qtts_conv1d_tm_block QTTS_V(qtts_conv1d_tm_block)
#define qtts_seanet_unit_op QTTS_V(qtts_seanet_unit_op)
#define qtts_seanet_stage_op QTTS_V(qtts_seanet_stage_op)
#define qtts_conv1d_tm_bf16_op QTTS_V(qtts_conv1d_tm_bf16_op)
#define qtts_conv1d_tm_bf16_fast QTTS_V(qtts_conv1d_tm_bf16_fast)
#define qtts_conv1d_tm_bf16_amx_built QTTS_V(qtts_conv1d_tm_bf16_amx_built)
#define qtts_conv1d_wino_bf16_op QTTS_V(qtts_conv1d_wino_bf16_op)
#define qtts_conv1d_wino_f32_op QTTS_V(qtts_conv1d_wino_f32_op)
#define qtts_conv1d_wino_f32_fast QTTS_V(qtts_conv1d_wino_f32_fast)
#define qtts_gemm_i8_op QTTS_V(qtts_gemm_i8_op)
#define qtts_gemm_i8_pack QTTS_V(qtts_gemm_i8_pack)
#define qtts_gemm_i8_fast QTTS_V(qtts_gemm_i8_fast)
#define qtts_gemm_i8_amx_built QTTS_V(qtts_gemm_i8_amx_built)
#define qtts_gemv_q4_op QTTS_V(qtts_gemv_q4_op)
#define qtts_gemv_q4_pack QTTS_V(qtts_gemv_q4_pack)
#define qtts_gemv_q4_fast QTTS_V(qtts_gemv_q4_fast)

/* hidden, shared between the sources of one variant */
#define qtts_scratch_get QTTS_V(qtts_scratch_get)
#define qtts_conv_srcs_get QTTS_V(qtts_conv_srcs_get)
#define qtts_conv_rows_of QTTS_V(qtts_conv_rows_of)
#define qtts_conv_stage_rows QTTS_V(qtts_conv_stage_rows)
#define qtts_snake_row QTTS_V(qtts_snake_row)
#define qtts_elu_span QTTS_V(qtts_elu_span)
#define qtts_conv_rows QTTS_V(qtts_conv_rows)
