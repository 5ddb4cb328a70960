/* Internal to libqtts_ops (not part of the cffi binding): thread-local scratch buffers. */
#pragma once

#include <stddef.h>

/* Scratch slots, one buffer each per thread. */
#define QTTS_SCRATCH_BF16_INPUT 0 /* conv1d_tm_bf16.c: the time chunk's input as BF16 pairs */
#define QTTS_SCRATCH_F32_STAGE 1  /* conv1d_tm.c: history + first new rows, joined */
#define QTTS_SCRATCH_I8_INPUT 2    /* gemm_i8.c: the row chunk's input as int8 + scales */
#define QTTS_SCRATCH_WINO 3         /* conv1d_wino_bf16.c: staged rows, records, BF16 rows */
#define QTTS_SCRATCH_Q4_INPUT 4     /* gemv_q4.c: the rows as int8 blocks + scales + sums */
#define QTTS_SCRATCH_ATTN 5          /* attn_causal.c: Q^T, O^T, scores, a block of K and V */
#define QTTS_SCRATCH_SEANET 6        /* conv1d_tm.c: a SEANet unit's time slice */
#define QTTS_SCRATCH_SLOTS 7

/* A 64-byte aligned buffer of at least `bytes` for the calling thread, kept between calls
 * (grown when too small; its old contents are not kept) and freed when the thread exits.
 * Aborts (GGML_ASSERT) when out of memory. */
__attribute__((visibility("hidden"))) void * qtts_scratch_get(int slot, size_t bytes);
