/* coll_kernels.c: what the shared-memory collectives reduce, and the
 * reduction kernels.  It owns the tables of dtypes and ops (their codes'
 * names, as torch spells them, and sizes), which op applies to which
 * dtype (mpc_coll_reduces, from which the bindings export COLL_REDUCES),
 * and the one-pass reduction of several sources into one buffer.  It is
 * the one file of the collectives with code for particular CPUs (NOTE
 * [ Reduction kernels on each architecture ]); everything else in them is
 * plain C. */
#include "coll.h"

#include <string.h>

/* Names as torch gives them: _core.COLL_DTYPES, _core.COLL_OPS and
 * _core.COLL_REDUCES are made from these tables and mpc_coll_reduces, and
 * nowhere else. */
static const char *const dtype_names[MPC_DT_COUNT] = {
    "float32", "float64", "float16", "bfloat16", "int32",  "int64",  "uint8",
    "bool",    "int8",    "int16",   "uint16",   "uint32", "uint64"};
static const char *const op_names[MPC_OP_COUNT] = {"SUM", "AVG",  "PRODUCT", "MIN",
                                                   "MAX", "BAND", "BOR",     "BXOR"};
static const size_t dtype_size[MPC_DT_COUNT] = {4, 8, 2, 2, 4, 8, 1, 1, 1, 2, 2, 4, 8};

size_t mpc_coll_dtype_size(int dtype) {
    return dtype >= 0 && dtype < MPC_DT_COUNT ? dtype_size[dtype] : 0;
}

const char *mpc_coll_dtype_name(int dtype) {
    return dtype >= 0 && dtype < MPC_DT_COUNT ? dtype_names[dtype] : NULL;
}

const char *mpc_coll_op_name(int op) {
    return op >= 0 && op < MPC_OP_COUNT ? op_names[op] : NULL;
}

static int is_float(int dtype) {
    return dtype == MPC_DT_F32 || dtype == MPC_DT_F64 || dtype == MPC_DT_F16 ||
           dtype == MPC_DT_BF16;
}

/* Integer and bool dtypes: the bitwise ops apply to them, AVG does not
 * (no rounding rule to pick); floating-point ones the other way round. */
int mpc_coll_reduces(int dtype, int op) {
    if (dtype < 0 || dtype >= MPC_DT_COUNT || op < 0 || op >= MPC_OP_COUNT)
        return 0;
    if (op == MPC_OP_AVG)
        return is_float(dtype);
    if (op == MPC_OP_BAND || op == MPC_OP_BOR || op == MPC_OP_BXOR)
        return !is_float(dtype);
    return 1;
}

int mpc__coll_check_args(int dtype, int op, int reducing) {
    if (dtype < 0 || dtype >= MPC_DT_COUNT)
        return mpc_fail(EINVAL, "unknown dtype code %d", dtype);
    if (!reducing)
        return 0;
    if (op < 0 || op >= MPC_OP_COUNT)
        return mpc_fail(EINVAL, "unknown reduction op code %d", op);
    if (mpc_coll_reduces(dtype, op))
        return 0;
    if (op == MPC_OP_AVG)
        return mpc_fail(EINVAL, "AVG needs a floating-point dtype, not %s", dtype_names[dtype]);
    return mpc_fail(EINVAL, "%s needs an integer or bool dtype, not %s", op_names[op],
                    dtype_names[dtype]);
}

/* ------------------------------------------------------------------ */
/* Kernels                                                            */
/* ------------------------------------------------------------------ */

/* NOTE [ Reduction kernels on each architecture ]
 * The kernels are plain loops that the compiler vectorises.  On x86-64 each
 * is built three times (AVX-512, AVX2 and the baseline SSE2) and the
 * loader picks the widest the CPU has (target_clones, an ifunc).  Elsewhere
 * one build serves: on aarch64 the baseline already has Advanced SIMD
 * (NEON), which -O3 uses, and GCC before 14 has no target_clones there.
 * tests/csrc/test_cross_compile.py builds the core for aarch64. */
#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* Integer sums and products are computed in U, an unsigned type at least
 * as wide as int: they wrap around as torch's do, without the undefined
 * behaviour of a signed (or promoted) overflow.  Every kernel is
 * d[i] = a[i] op b[i]; folding a source into an accumulator is the same
 * call with d == a.  They take no `restrict`, since d is so often a
 * source (NOTE [ Two sources straight into the result ]): the compiler
 * checks the distance between them at run time, and equal pointers keep
 * the vector loop. */
#define KERNEL(T, NAME, EXPR)                                                              \
    CLONES static void NAME(T *d, const T *a, const T *b, size_t n) {                      \
        for (size_t i = 0; i < n; i++)                                                     \
            d[i] = (EXPR);                                                                 \
    }

#define BINOPS(T, U, NAME)                                                                 \
    KERNEL(T, NAME##_sum, (T)((U)a[i] + (U)b[i]))                                          \
    KERNEL(T, NAME##_prod, (T)((U)a[i] * (U)b[i]))                                         \
    KERNEL(T, NAME##_min, b[i] < a[i] ? b[i] : a[i])                                       \
    KERNEL(T, NAME##_max, b[i] > a[i] ? b[i] : a[i])                                       \
    static void NAME##_apply(int op, T *d, const T *a, const T *b, size_t n) {             \
        switch (op) {                                                                      \
        case MPC_OP_PROD: NAME##_prod(d, a, b, n); break;                                  \
        case MPC_OP_MIN: NAME##_min(d, a, b, n); break;                                    \
        case MPC_OP_MAX: NAME##_max(d, a, b, n); break;                                    \
        default: NAME##_sum(d, a, b, n);                                                   \
        }                                                                                  \
    }

/* The bitwise ops of an integer type, and all its ops in one switch. */
#define BITOPS(T, U, NAME)                                                                 \
    BINOPS(T, U, NAME##a)                                                                  \
    KERNEL(T, NAME##_band, (T)(a[i] & b[i]))                                               \
    KERNEL(T, NAME##_bor, (T)(a[i] | b[i]))                                                \
    KERNEL(T, NAME##_bxor, (T)(a[i] ^ b[i]))                                               \
    static void NAME##_apply(int op, T *d, const T *a, const T *b, size_t n) {             \
        switch (op) {                                                                      \
        case MPC_OP_BAND: NAME##_band(d, a, b, n); break;                                  \
        case MPC_OP_BOR: NAME##_bor(d, a, b, n); break;                                    \
        case MPC_OP_BXOR: NAME##_bxor(d, a, b, n); break;                                  \
        default: NAME##a_apply(op, d, a, b, n);                                            \
        }                                                                                  \
    }

BINOPS(float, float, f32)
BINOPS(double, double, f64)
BITOPS(int32_t, uint32_t, i32)
BITOPS(int64_t, uint64_t, i64)
BITOPS(uint8_t, uint32_t, u8)
BITOPS(int8_t, uint32_t, i8)
BITOPS(int16_t, uint32_t, i16)
BITOPS(uint16_t, uint32_t, u16)
BITOPS(uint32_t, uint32_t, u32)
BITOPS(uint64_t, uint64_t, u64)

/* bool (one byte, 0 or 1), as torch's gloo reduces it: SUM and MAX are a
 * logical or, PRODUCT and MIN a logical and, the bitwise ops bitwise. */
static void bool_apply(int op, uint8_t *d, const uint8_t *a, const uint8_t *b, size_t n) {
    switch (op) {
    case MPC_OP_SUM:
    case MPC_OP_MAX:
    case MPC_OP_BOR: u8_bor(d, a, b, n); break;
    case MPC_OP_PROD:
    case MPC_OP_MIN:
    case MPC_OP_BAND: u8_band(d, a, b, n); break;
    default: u8_bxor(d, a, b, n);
    }
}

/* d[i] = a[i] op b[i] for n elements of a dtype reduced in its own type
 * (every one but the half types). */
static void apply(int dtype, int op, void *d, const void *a, const void *b, size_t n) {
    switch (dtype) {
    case MPC_DT_F32: f32_apply(op, d, a, b, n); break;
    case MPC_DT_F64: f64_apply(op, d, a, b, n); break;
    case MPC_DT_I32: i32_apply(op, d, a, b, n); break;
    case MPC_DT_I64: i64_apply(op, d, a, b, n); break;
    case MPC_DT_BOOL: bool_apply(op, d, a, b, n); break;
    case MPC_DT_I8: i8_apply(op, d, a, b, n); break;
    case MPC_DT_I16: i16_apply(op, d, a, b, n); break;
    case MPC_DT_U16: u16_apply(op, d, a, b, n); break;
    case MPC_DT_U32: u32_apply(op, d, a, b, n); break;
    case MPC_DT_U64: u64_apply(op, d, a, b, n); break;
    default: u8_apply(op, d, a, b, n); break;
    }
}

/* d[i] / k, the average's division.  For k a power of two (two ranks, four)
 * it multiplies by 1/k instead: both are exact scalings rounded once, so the
 * results are the same bits, and a vector multiply costs a fraction of a
 * divide. */
#define SCALE(T, name)                                                       \
    CLONES static void name(T *d, int k, size_t n) {                         \
        if ((k & (k - 1)) == 0) {                                            \
            T inv = (T)1 / (T)k;                                             \
            for (size_t i = 0; i < n; i++)                                   \
                d[i] = d[i] * inv;                                           \
            return;                                                          \
        }                                                                    \
        for (size_t i = 0; i < n; i++)                                       \
            d[i] = d[i] / (T)k;                                              \
    }

SCALE(float, f32_scale)
SCALE(double, f64_scale)

CLONES static void f16_to_f32(float *restrict d, const _Float16 *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++)
        d[i] = (float)s[i];
}

CLONES static void f32_to_f16(_Float16 *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++)
        d[i] = (_Float16)s[i];
}

CLONES static void bf16_to_f32(float *restrict d, const uint16_t *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)s[i] << 16;
        memcpy(&d[i], &u, 4);
    }
}

/* Rounds to nearest even, as torch does; NaN stays a (quiet) NaN. */
CLONES static void f32_to_bf16(uint16_t *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &s[i], 4);
        uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        d[i] = (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? ((u >> 16) | 0x40u) : r);
    }
}

/* NOTE [ Two sources straight into the result ]
 * The reduction reads its sources a tile at a time into an accumulator in
 * L1 and copies the tile out, which lets any number of sources, and the
 * half types' float32 sums, take one pass over dst.  Two sources, the
 * common case (two ranks, and every pair of a two-rank group), need no
 * accumulator: dst[i] = a[i] op b[i] reads each source once and writes dst
 * once, with no copies in L1 between.  Measured in a C program linking the
 * core (two processes, the core's all_reduce, float32 SUM, built -O3), the
 * tile way and this one alternated: from group buffers 1 MB 29.9 / 30.3 us
 * against 22.5 / 22.3, 16 MB 1.10 / 1.07 ms against 0.86 / 0.78; staged,
 * 1 MB, the reduction's part 85 us against 64 to 69.  The bits are the
 * same: each element is a[i] op b[i] in the same order, and AVG scales the
 * sum as before.  It needs dst and each source to be the same memory or
 * apart (an element is written after both of its own are read, not a
 * tile after the whole tile), which every caller's is (NOTE [ Movers write
 * where no one reads ] in coll.c); anything else takes the tiles.  Its
 * kernels take no `restrict`: dst is often one of the sources (the rank's
 * own buffer), and the measurement above is of that case. */

/* Whether n bytes at d and at s are the same memory or apart. */
static int same_or_apart(const uint8_t *d, const uint8_t *s, size_t n) {
    return d == s || d + n <= s || s + n <= d;
}

#define TILE 1024

/* dst[i] = a[i] op b[i] (avg: that sum over 2), a tile at a time (the
 * average's scaling reads the tile from L1), for a dtype reduced in its
 * own type (NOTE [ Two sources straight into the result ]). */
static void reduce_two(int dtype, int op, uint8_t *dst, const uint8_t *a, const uint8_t *b,
                       size_t n, size_t es) {
    for (size_t off = 0; off < n; off += TILE) {
        size_t m = n - off < TILE ? n - off : TILE;
        uint8_t *d = dst + off * es;
        const uint8_t *x = a + off * es, *y = b + off * es;
        apply(dtype, op, d, x, y, m);
        if (op == MPC_OP_AVG) {
            if (dtype == MPC_DT_F32)
                f32_scale((float *)d, 2, m);
            else
                f64_scale((double *)d, 2, m);
        }
    }
}

/* dst[i] = op over srcs[0..nsrc-1][i], in that order (avg: the sum over
 * nsrc).  One pass: the sources are read a tile at a time into an
 * accumulator that stays in L1, and dst is written once.  dst may alias
 * any source: each tile is read whole before it is written.  Two sources
 * go straight into dst (NOTE [ Two sources straight into the result ]). */
void mpc__coll_reduce(int dtype, int op, void *dst, void *const *srcs, int nsrc, size_t n) {
    size_t es = dtype_size[dtype];
    int half = dtype == MPC_DT_F16 || dtype == MPC_DT_BF16;
    if (nsrc == 2 && !half && same_or_apart(dst, srcs[0], n * es) &&
        same_or_apart(dst, srcs[1], n * es)) {
        reduce_two(dtype, op, dst, srcs[0], srcs[1], n, es);
        return;
    }
    _Alignas(64) uint8_t acc_b[TILE * 8], tmp_b[TILE * 8];
    float *acc = (float *)acc_b, *tmp = (float *)tmp_b;
    for (size_t off = 0; off < n; off += TILE) {
        size_t m = n - off < TILE ? n - off : TILE;
        for (int r = 0; r < nsrc; r++) {
            const uint8_t *s = (const uint8_t *)srcs[r] + off * es;
            if (half) {
                float *into = r == 0 ? acc : tmp;
                if (dtype == MPC_DT_F16)
                    f16_to_f32(into, (const _Float16 *)s, m);
                else
                    bf16_to_f32(into, (const uint16_t *)s, m);
                if (r > 0)
                    f32_apply(op, acc, acc, tmp, m);
                continue;
            }
            if (r == 0) {
                memcpy(acc_b, s, m * es);
                continue;
            }
            apply(dtype, op, acc_b, acc_b, s, m);
        }
        void *d = (uint8_t *)dst + off * es;
        if (half) {
            if (op == MPC_OP_AVG)
                f32_scale(acc, nsrc, m);
            if (dtype == MPC_DT_F16)
                f32_to_f16(d, acc, m);
            else
                f32_to_bf16(d, acc, m);
            continue;
        }
        if (op == MPC_OP_AVG) {
            if (dtype == MPC_DT_F32)
                f32_scale((float *)acc_b, nsrc, m);
            else
                f64_scale((double *)acc_b, nsrc, m);
        }
        memcpy(d, acc_b, m * es);
    }
}
