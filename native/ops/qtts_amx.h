/* Internal to libqtts_ops (not part of the cffi binding): the AMX-BF16 tile path of the BF16
 * conv. AMX_BF16: the tile kernels are compiled (by -march); they run only while qtts_amx_on is
 * set, which dispatch.c does when the CPU has AMX-BF16, the OS lets this process use the tile
 * data (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), the chosen variant has the tile
 * kernels and nobody turned them off (qtts_ops_set_amx). Otherwise the AVX512-BF16 kernels run. */
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) &&             \
    defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AMX_BF16 1
#else
#define AMX_BF16 0
#endif

/* Defined once in dispatch.c (no variant suffix): read by every variant's kernels. */
extern __attribute__((visibility("hidden"))) volatile int qtts_amx_on;
