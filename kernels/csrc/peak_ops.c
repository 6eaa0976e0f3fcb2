/* The machine's arithmetic peak, measured: a tight loop of independent vector multiply-adds on
 * every thread asked for, with nothing else in it (no loads, no stores), the instruction each
 * kind of product of the GEMMs in quant_ops.c uses at this library's instruction-set level.
 *
 * benchmarks/roofline.py divides the operations pd_peak_loop reports by the longest CPU time one
 * of its threads took (each thread's own clock: on a machine others share, the time the thread
 * was not running does not count, so the figure is the hardware's, not what was left of it):
 * the compute ceiling of the roofline (the fp32 one for the float32 decode step; the
 * int16 and int8 dot-product ones for the quantized GEMMs' integer products). Stateless.
 *
 * kind 0, fp32: vfmadd (avx512: 16 lanes, avx2: 8, baseline: scalar), 2 operations a lane;
 * kind 1, int16 pairs: vpdpwssd (avx512 VNNI, 32 products a zmm) or vpmaddwd + vpaddd (avx2);
 * kind 2, int8 quads: vpdpbusd (avx512 VNNI, 64 products a zmm) or vpmaddubsw + vpmaddwd +
 * vpaddd (avx2); an integer product and its add count 2 operations, as a float FMA's do.
 * Twelve independent accumulators cover the multiply-add's latency (4 cycles, 2 a cycle).
 */
#include <stdint.h>
#include <time.h>

#include "pd_ops.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* Each level's vector types and steps: a constant operand is hoisted out of the loop unless the
 * instruction takes the accumulator (vpdpwssd / vpdpbusd do; avx2's vpmaddwd is given it). */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define PEAK_REG "+v"  /* any of the 32 vector registers */
#define PEAK_LANES 16
typedef __m512 peak_f;
typedef __m512i peak_i;
#define peak_set1_f _mm512_set1_ps
#define peak_set1_i _mm512_set1_epi32
#define peak_add_f _mm512_add_ps
#define peak_add_i _mm512_add_epi32
#define F_STEP(v) _mm512_fmadd_ps(v, a, b)
#define I16_STEP(v) _mm512_dpwssd_epi32(v, w, x)
#define I8_STEP(v) _mm512_dpbusd_epi32(v, w, x)
#elif defined(__AVX2__)
#define PEAK_REG "+x"
#define PEAK_LANES 8
typedef __m256 peak_f;
typedef __m256i peak_i;
#define peak_set1_f _mm256_set1_ps
#define peak_set1_i _mm256_set1_epi32
#define peak_add_f _mm256_add_ps
#define peak_add_i _mm256_add_epi32
#define F_STEP(v) _mm256_fmadd_ps(v, a, b)
#define I16_STEP(v) _mm256_add_epi32(v, _mm256_madd_epi16(v, x))
#define I8_STEP(v) _mm256_add_epi32(v, _mm256_madd_epi16(_mm256_maddubs_epi16(v, x), ones))
#endif
/* PD_PEAK_CHAINS (12) accumulators of type T, named so that they live in registers, stepped
 * `iters` times; the asm keeps every step in the loop (the compiler may neither fold nor drop
 * one); their sum goes to a volatile `sink`. */
#define PD_PEAK_CHAINS 12
#define PEAK_LOOP(T, zero, step, fold, lanes_ops)                                                                      \
    do {                                                                                                                \
        T a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero, a6 = zero, a7 = zero, a8 = zero, a9 = zero, \
          a10 = zero, a11 = zero;                                                                                       \
        for (int64_t i = 0; i < iters; i++) {                                                                           \
            a0 = step(a0); a1 = step(a1); a2 = step(a2); a3 = step(a3); a4 = step(a4); a5 = step(a5);                   \
            a6 = step(a6); a7 = step(a7); a8 = step(a8); a9 = step(a9); a10 = step(a10); a11 = step(a11);               \
            __asm__("" : PEAK_REG(a0), PEAK_REG(a1), PEAK_REG(a2), PEAK_REG(a3), PEAK_REG(a4), PEAK_REG(a5),            \
                    PEAK_REG(a6), PEAK_REG(a7), PEAK_REG(a8), PEAK_REG(a9), PEAK_REG(a10), PEAK_REG(a11));              \
        }                                                                                                               \
        sink = fold(fold(fold(fold(a0, a1), fold(a2, a3)), fold(fold(a4, a5), fold(a6, a7))),                          \
                    fold(fold(a8, a9), fold(a10, a11)));                                                                \
        (void)sink;                                                                                                     \
        ops = lanes_ops;                                                                                                \
    } while (0)

/* One thread's loop: `iters` rounds of PD_PEAK_CHAINS multiply-adds; returns the operations done. */
static int64_t peak_thread(int kind, int64_t iters) {
    int64_t ops = 0;
#ifdef PEAK_LANES
    const peak_f a = peak_set1_f(0.999f), b = peak_set1_f(1e-3f);
    const peak_i w = peak_set1_i(0x01020304), x = peak_set1_i(0x05060708), ones = peak_set1_i(0x00010001);
    (void)w; (void)ones;  /* (avx512 multiplies w, avx2 the accumulator and its sums by ones) */
    if (kind == 0) {
        volatile peak_f sink;
        PEAK_LOOP(peak_f, peak_set1_f(0.0f), F_STEP, peak_add_f, PEAK_LANES * 2);
    } else {
        volatile peak_i sink;
        if (kind == 1) PEAK_LOOP(peak_i, peak_set1_i(0), I16_STEP, peak_add_i, PEAK_LANES * 4);  /* 2 pairs a lane */
        else PEAK_LOOP(peak_i, peak_set1_i(0), I8_STEP, peak_add_i, PEAK_LANES * 8);  /* 4 quads a lane */
    }
#else
    (void)kind;
    float acc[PD_PEAK_CHAINS];
    for (int c = 0; c < PD_PEAK_CHAINS; c++) acc[c] = 0.0f;
    for (int64_t i = 0; i < iters; i++)
        for (int c = 0; c < PD_PEAK_CHAINS; c++) acc[c] = acc[c] * 0.999f + 1e-3f;  /* (no reassociation: -ffp-contract=off, no fast-math) */
    for (int c = 1; c < PD_PEAK_CHAINS; c++) acc[0] += acc[c];
    volatile float sink = acc[0];
    (void)sink;
    ops = 2;
#endif
    return ops * PD_PEAK_CHAINS * iters;
}

static double thread_cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int64_t pd_peak_loop(int kind, int64_t iters, int threads, double *cpu_seconds) {
    int64_t total = 0;
    double longest = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total) reduction(max : longest)
    {
        const double t0 = thread_cpu_seconds();
        total += peak_thread(kind, iters);
        longest = thread_cpu_seconds() - t0;
    }
    if (cpu_seconds) *cpu_seconds = longest;
    return total;
}
