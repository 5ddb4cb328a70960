/* Runtime dispatch of libqtts_ops: the kernels are compiled once per ISA variant (native/build.py
 * passes -DQTTS_OPS_HAVE_<name> for each one linked in; qtts_variant.h suffixes their symbols)
 * and the public functions of qtts_ops.h forward to one variant, chosen once when the library is
 * loaded: the first, in the order below, whose instructions this CPU and OS support. This file is
 * compiled for the baseline of the architecture, so loading never executes anything newer.
 *
 * The variants are whole: one variant's block sizes and packed-weight layouts are used by every
 * op, so a weight packed through this library always meets the kernel that reads it. */
#define _GNU_SOURCE /* syscall() */
#include <stddef.h>
#include <stdint.h>

#include "qtts_amx.h"
#include "qtts_ops.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

volatile int qtts_amx_on;

/* X(variant, return type, name, parameters, arguments): every forwarded function. */
#define QTTS_VALUE_FUNCS(X, v)                                                                   \
    X(v, int, qtts_ops_isa, (void), ())                                                          \
    X(v, int, qtts_conv1d_tm_block, (void), ())                                                  \
    X(v, int, qtts_conv1d_tm_bf16_fast, (void), ())                                              \
    X(v, int, qtts_conv1d_tm_bf16_amx_built, (void), ())                                         \
    X(v, int, qtts_gemm_i8_fast, (void), ())                                                     \
    X(v, int, qtts_gemm_i8_amx_built, (void), ())                                                \
    X(v, int, qtts_gemv_q4_fast, (void), ())                                                     \
    X(v, int, qtts_attn_causal_fast, (void), ())                                                 \
    X(v, int, qtts_conv1d_wino_f32_fast, (void), ())

#define QTTS_OP_ARGS (struct ggml_tensor * dst, int ith, int nth, void * userdata)
#define QTTS_VOID_FUNCS(X, v)                                                                    \
    X(v, void, qtts_snake_beta_op,                                                               \
      (struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,     \
       const struct ggml_tensor * c, int ith, int nth, void * userdata),                         \
      (dst, a, b, c, ith, nth, userdata))                                                        \
    X(v, void, qtts_elu_op,                                                                      \
      (struct ggml_tensor * dst, const struct ggml_tensor * a, int ith, int nth, void * userdata), \
      (dst, a, ith, nth, userdata))                                                              \
    X(v, void, qtts_gelu_erf_op,                                                                 \
      (struct ggml_tensor * dst, const struct ggml_tensor * a, int ith, int nth, void * userdata), \
      (dst, a, ith, nth, userdata))                                                              \
    X(v, void, qtts_kv_write_transposed_op,                                                      \
      (struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,     \
       int ith, int nth, void * userdata),                                                       \
      (dst, a, b, ith, nth, userdata))                                                           \
    X(v, void, qtts_attn_causal_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                     \
    X(v, void, qtts_attn_step_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                       \
    X(v, void, qtts_attn_window_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                     \
    X(v, void, qtts_attn_full_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                       \
    X(v, void, qtts_channel_join_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                    \
    X(v, void, qtts_time_join_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                       \
    X(v, void, qtts_pool_stats_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                      \
    X(v, void, qtts_argmax_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                          \
    X(v, void, qtts_conv1d_tm_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                       \
    X(v, void, qtts_seanet_unit_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                     \
    X(v, void, qtts_seanet_stage_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                    \
    X(v, void, qtts_conv1d_tm_bf16_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                  \
    X(v, void, qtts_conv1d_wino_bf16_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                \
    X(v, void, qtts_conv1d_wino_f32_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                 \
    X(v, void, qtts_gemm_i8_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                         \
    X(v, void, qtts_gemm_i8_pack,                                                                \
      (const float * W, int64_t N, int64_t K, int8_t * wq, float * ws, int32_t * wc),            \
      (W, N, K, wq, ws, wc))                                                                     \
    X(v, void, qtts_gemv_q4_op, QTTS_OP_ARGS, (dst, ith, nth, userdata))                         \
    X(v, void, qtts_gemv_q4_pack, (const uint8_t * q4, int64_t N, int64_t K, uint8_t * out),     \
      (q4, N, K, out))

#define QTTS_FUNCS(X, v) QTTS_VALUE_FUNCS(X, v) QTTS_VOID_FUNCS(X, v)

#define QTTS_PROTO(v, ret, name, params, args) ret name##__##v params;
#define QTTS_FIELD(v, ret, name, params, args) ret(*name) params;
#define QTTS_INIT(v, ret, name, params, args) name##__##v,

struct qtts_ops_table {
    QTTS_FUNCS(QTTS_FIELD, _)
};

typedef struct {
    const char * name;
    int (*usable)(void);
    struct qtts_ops_table fns;
} qtts_ops_variant_t;

#if defined(__x86_64__) || defined(__i386__)
/* __builtin_cpu_supports checks the CPUID bits and that the OS saves the registers (XCR0). */
static int cpu_v4(void) { return __builtin_cpu_supports("x86-64-v4"); }
static int cpu_avx512_vnni(void) { return cpu_v4() && __builtin_cpu_supports("avx512vnni"); }
static int cpu_avx512_bf16(void) {
    return cpu_avx512_vnni() && __builtin_cpu_supports("avx512bf16");
}
static int cpu_avx2(void) { return __builtin_cpu_supports("x86-64-v3"); }
#endif

/* AMX-BF16: CPUID.(7,0):EDX bits 22 (AMX-BF16), 24 (AMX-TILE) and 25 (AMX-INT8: the int8 GEMM's
 * tiles; every AMX CPU has all three), the OS enabling the tile
 * state in XCR0 (bits 17, 18), and Linux granting this process the tile data: it is off until
 * asked for (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per process. GCC 12's
 * __builtin_cpu_supports("amx-bf16") reads 0 on such CPUs, hence CPUID by hand. Checked once. */
static int amx_allowed = 1; /* qtts_ops_set_amx */
static int amx_checked, amx_ready;
static int cpu_amx_ready(void) {
    if (!amx_checked) {
        amx_checked = 1;
#if defined(__x86_64__) && defined(__linux__)
        unsigned a, b, c, d;
        if (cpu_avx512_bf16() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) &&
            (d >> 24 & 1) && (d >> 25 & 1)) {
            unsigned lo, hi;
            __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
            (void)hi;
            if ((lo & 0x60000u) == 0x60000u) {
                amx_ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                    18 /* XFEATURE_XTILEDATA */) == 0;
            }
        }
#endif
    }
    return amx_ready;
}
#if defined(__x86_64__) || defined(__i386__)
static int cpu_amx_bf16(void) { return amx_allowed && cpu_amx_ready(); }
#endif
/* The baseline variants, and "native": built with -march=native for the machine it runs on. */
static int cpu_any(void) { return 1; }

#define QTTS_VARIANT_ENTRY(v, check) {#v, check, {QTTS_FUNCS(QTTS_INIT, v)}},

#ifdef QTTS_OPS_HAVE_native
QTTS_FUNCS(QTTS_PROTO, native)
#endif
#ifdef QTTS_OPS_HAVE_amx_bf16
QTTS_FUNCS(QTTS_PROTO, amx_bf16)
#endif
#ifdef QTTS_OPS_HAVE_avx512_bf16
QTTS_FUNCS(QTTS_PROTO, avx512_bf16)
#endif
#ifdef QTTS_OPS_HAVE_avx512_vnni
QTTS_FUNCS(QTTS_PROTO, avx512_vnni)
#endif
#ifdef QTTS_OPS_HAVE_avx512
QTTS_FUNCS(QTTS_PROTO, avx512)
#endif
#ifdef QTTS_OPS_HAVE_avx2
QTTS_FUNCS(QTTS_PROTO, avx2)
#endif
#ifdef QTTS_OPS_HAVE_scalar
QTTS_FUNCS(QTTS_PROTO, scalar)
#endif
#ifdef QTTS_OPS_HAVE_generic
QTTS_FUNCS(QTTS_PROTO, generic)
#endif

/* Best first. */
static const qtts_ops_variant_t variants[] = {
#ifdef QTTS_OPS_HAVE_native
    QTTS_VARIANT_ENTRY(native, cpu_any)
#endif
#ifdef QTTS_OPS_HAVE_amx_bf16
    QTTS_VARIANT_ENTRY(amx_bf16, cpu_amx_bf16)
#endif
#ifdef QTTS_OPS_HAVE_avx512_bf16
    QTTS_VARIANT_ENTRY(avx512_bf16, cpu_avx512_bf16)
#endif
#ifdef QTTS_OPS_HAVE_avx512_vnni
    QTTS_VARIANT_ENTRY(avx512_vnni, cpu_avx512_vnni)
#endif
#ifdef QTTS_OPS_HAVE_avx512
    QTTS_VARIANT_ENTRY(avx512, cpu_v4)
#endif
#ifdef QTTS_OPS_HAVE_avx2
    QTTS_VARIANT_ENTRY(avx2, cpu_avx2)
#endif
#ifdef QTTS_OPS_HAVE_scalar
    QTTS_VARIANT_ENTRY(scalar, cpu_any)
#endif
#ifdef QTTS_OPS_HAVE_generic
    QTTS_VARIANT_ENTRY(generic, cpu_any)
#endif
};
#define N_VARIANTS (sizeof(variants) / sizeof(variants[0]))

static const qtts_ops_variant_t * chosen = &variants[N_VARIANTS - 1];
static char variant_list[256];

/* The first usable variant; the tile kernels of the one chosen run when AMX is ready too. */
static void select_variant(void) {
    for (size_t i = 0; i < N_VARIANTS; i++) {
        if (variants[i].usable()) {
            chosen = &variants[i];
            break;
        }
    }
    qtts_amx_on = amx_allowed && chosen->fns.qtts_conv1d_tm_bf16_amx_built() && cpu_amx_ready();
}

/* At load, before cffi or ggml can call anything here. */
__attribute__((constructor)) static void qtts_ops_select(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init(); /* constructors may run before libgcc's own */
#endif
    size_t n = 0;
    for (size_t i = 0; i < N_VARIANTS; i++) {
        for (const char * p = variants[i].name; *p && n + 2 < sizeof(variant_list); p++) {
            variant_list[n++] = *p;
        }
        if (i + 1 < N_VARIANTS && n + 2 < sizeof(variant_list)) variant_list[n++] = ',';
    }
    variant_list[n] = '\0';
    select_variant();
}

const char * qtts_ops_variant(void) { return chosen->name; }

const char * qtts_ops_variants(void) { return variant_list; }

int qtts_ops_amx(void) { return qtts_amx_on; }

int qtts_ops_set_amx(int on) {
    amx_allowed = on != 0;
    select_variant();
    return qtts_amx_on;
}

#define QTTS_FORWARD_VALUE(v, ret, name, params, args)                                           \
    ret name params { return chosen->fns.name args; }
#define QTTS_FORWARD_VOID(v, ret, name, params, args)                                            \
    ret name params { chosen->fns.name args; }

QTTS_VALUE_FUNCS(QTTS_FORWARD_VALUE, _)
QTTS_VOID_FUNCS(QTTS_FORWARD_VOID, _)
