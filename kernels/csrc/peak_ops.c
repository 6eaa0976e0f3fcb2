/* The machine's arithmetic peak, measured: a tight loop of independent vector multiply-adds on
 * every thread asked for, with nothing else in it (no loads, no stores), the instruction each
 * kind of product of the GEMMs in quant_ops.c uses at this library's instruction-set level.
 *
 * benchmarks/roofline.py times pd_peak_loop and divides the operations it reports by the
 * seconds: the compute ceiling of the roofline (the fp32 one for the float32 decode step; the
 * int16 and int8 dot-product ones for the quantized GEMMs' integer products). Stateless.
 *
 * kind 0, fp32: vfmadd (avx512: 16 lanes, avx2: 8, baseline: scalar), 2 operations a lane;
 * kind 1, int16 pairs: vpdpwssd (avx512 VNNI, 32 products a zmm) or vpmaddwd + vpaddd (avx2);
 * kind 2, int8 quads: vpdpbusd (avx512 VNNI, 64 products a zmm) or vpmaddubsw + vpmaddwd +
 * vpaddd (avx2); an integer product and its add count 2 operations, as a float FMA's do.
 * PD_PEAK_CHAINS independent accumulators cover the multiply-add's latency (4 cycles, 2 a cycle).
 */
#include <stdint.h>

#include "pd_ops.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define PD_PEAK_CHAINS 12

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define PEAK_REG "+v"  /* any of the 32 vector registers */
#elif defined(__AVX2__)
#define PEAK_REG "+x"
#endif
/* PD_PEAK_CHAINS accumulators of type T stepped `iters` times; the asm keeps each step in the
 * loop (the compiler may not fold or drop it); the sum goes to a volatile `sink`. */
#define PEAK_LOOP(T, zero, step, fold, lanes_ops)                              \
    do {                                                                        \
        T acc[PD_PEAK_CHAINS];                                                  \
        for (int c = 0; c < PD_PEAK_CHAINS; c++) acc[c] = zero;                 \
        for (int64_t i = 0; i < iters; i++)                                     \
            for (int c = 0; c < PD_PEAK_CHAINS; c++) {                          \
                acc[c] = step(acc[c]);                                          \
                __asm__("" : PEAK_REG(acc[c]));                                 \
            }                                                                   \
        for (int c = 1; c < PD_PEAK_CHAINS; c++) acc[0] = fold(acc[0], acc[c]); \
        sink = acc[0];                                                          \
        (void)sink;                                                             \
        ops = lanes_ops;                                                        \
    } while (0)

/* One thread's loop: `iters` rounds of PD_PEAK_CHAINS multiply-adds; returns the operations done. */
static int64_t peak_thread(int kind, int64_t iters) {
    int64_t ops = 0;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
    const __m512i w = _mm512_set1_epi32(0x01020304), x = _mm512_set1_epi32(0x05060708);
#define F_STEP(v) _mm512_fmadd_ps(v, a, b)
#define I16_STEP(v) _mm512_dpwssd_epi32(v, w, x)
#define I8_STEP(v) _mm512_dpbusd_epi32(v, w, x)
    if (kind == 0) {
        volatile __m512 sink;
        PEAK_LOOP(__m512, _mm512_setzero_ps(), F_STEP, _mm512_add_ps, 16 * 2);
    } else {
        volatile __m512i sink;
        if (kind == 1) PEAK_LOOP(__m512i, _mm512_setzero_si512(), I16_STEP, _mm512_add_epi32, 32 * 2);
        else PEAK_LOOP(__m512i, _mm512_setzero_si512(), I8_STEP, _mm512_add_epi32, 64 * 2);
    }
#elif defined(__AVX2__)
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
    const __m256i w = _mm256_set1_epi32(0x01020304), x = _mm256_set1_epi32(0x05060708), ones = _mm256_set1_epi16(1);
#define F_STEP(v) _mm256_fmadd_ps(v, a, b)
    (void)w;  /* (the products take the accumulator itself: constant operands would be hoisted out of the loop) */
#define I16_STEP(v) _mm256_add_epi32(v, _mm256_madd_epi16(v, x))
#define I8_STEP(v) _mm256_add_epi32(v, _mm256_madd_epi16(_mm256_maddubs_epi16(v, x), ones))
    if (kind == 0) {
        volatile __m256 sink;
        PEAK_LOOP(__m256, _mm256_setzero_ps(), F_STEP, _mm256_add_ps, 8 * 2);
    } else {
        volatile __m256i sink;
        if (kind == 1) PEAK_LOOP(__m256i, _mm256_setzero_si256(), I16_STEP, _mm256_add_epi32, 16 * 2);
        else PEAK_LOOP(__m256i, _mm256_setzero_si256(), I8_STEP, _mm256_add_epi32, 32 * 2);
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

int64_t pd_peak_loop(int kind, int64_t iters, int threads) {
    int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    total += peak_thread(kind, iters);
    return total;
}
