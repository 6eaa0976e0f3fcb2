/* Weight-only quantized matmuls: y = x @ W^T with W kept in GGUF's Q4_0 / Q4_1 / Q8_0 blocks.
 *
 * Built into the same library as cpu_ops.c (kernels/cpu_native.py) and called through ctypes by
 * kernels/quant.py. A weight is N rows of K/32 blocks exactly as the GGUF file stores them:
 *   Q4_0: fp16 d, 16 bytes of nibbles          w = d * (q - 8)
 *   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
 *   Q8_0: fp16 d, 32 int8                      w = d * q
 * (nibble j of byte i: low nibbles are weights 0..15, high nibbles 16..31).
 * Activations stay float32; every product is a float32 product of x with the dequantised value
 * (written as d * sum(q x) + m * sum(x) per block), so results equal the float twin (dequantise,
 * then F.linear) up to float32 summation order. Three entry points:
 *   pd_q_dequant   whole rows to float32 (the prefill path hands the result to MKL; also the
 *                  embedding lookup);
 *   pd_q_matmul    M <= Q_DIRECT_ROWS: each weight block is unpacked in registers once and
 *                  multiplied into every row (a lone user's decode step). `activations` says
 *                  how: ACT_FLOAT, float products as above; ACT_INT16 (the engine's default),
 *                  each row is first rounded to int16 per 32-wide block (1/32767 of the block's
 *                  largest value) and the products are exact integers (madd_epi16), about 1.6x
 *                  faster than float and scoring like it (at one or two rows eight weight rows
 *                  at a time, q_direct8_i16); ACT_INT8, rounded to int8 (llama.cpp's
 *                  Q8_1) with maddubs, faster again but measurably less accurate. The integer
 *                  paths' exact twin is kernels/quant.py matmul_int_twin;
 *                  ACT_INT16 and more than Q_DIRECT_INT16_ROWS rows (batched decode steps and
 *                  prompts): the same integer products as a GEMM (q_gemm: activations
 *                  repacked once a call, weight codes widened to int16 a panel at a time);
 *                  other larger M: tiles of Q_TILE weight rows are dequantised into a per-thread
 *                  float32 scratch (L2-resident), so unpacking is paid once per tile, not once
 *                  per row, and run through a 6x16 broadcast kernel over x transposed once per
 *                  call (measured 15-35% faster than oneDNN's packed float32 at 8-64 rows).
 *                  The K-quants (Q4_K, Q5_K, Q6_K) at up to QK256_ROWS rows with integer
 *                  activations round them per 256-wide super-block instead (ACT_INT16: int16;
 *                  ACT_INT8: int8, llama.cpp's q8_K), so that a super-block's sub-block scales are
 *                  applied in integers and its sum is converted to float once (qk256_matmul; twin
 *                  kernels/quant.py matmul_int_twin).
 *   pd_q_gemm_i8   ACT_INT8's rounding at any row count, as a GEMM on vpdpbusd (the same tiling
 *                  as the int16 one, int8 codes); AVX-512 VNNI only: the other variants return 2.
 * Instruction sets (kernels/native_build.py compiles this file once per level): the avx2 variant
 * is what is described above; the avx512 one replaces the int16 GEMM's micro-tile (vpdpwssd, 32
 * activation rows x 6 weight rows) and the tiled kernel's (12 weight rows x 32 rows of x, the whole
 * of K in registers); the baseline one (no AVX2) runs a weight row at a time in plain C, the
 * integer modes included (q_scalar_activations), and has no pd_f_matmul (it returns 2).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pd_ops.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define Q_TILE 24  /* a multiple of 6 */
#define Q_KC 256  /* K chunk of the tiled kernel */
#define Q_DIRECT_ROWS 4
/* The int16 path stays direct up to 7 rows: single-thread, gate_up (3072 x 576, Q4_1), it took
 * 397 us at 5 rows and 657 us at 8 against the tiled path's ~598 us for 5..8 (padded to 8). */
#define Q_DIRECT_INT16_ROWS 7
/* ... and at 1 or 2 rows eight weight rows at a time (q_direct8_i16; at 3 and 4 rows it measured
 * 0.85-1.1x of one row at a time). */
#define Q_DIRECT8_ROWS 2
/* ACT_* (pd_ops.h): how the direct path (<= Q_DIRECT_ROWS rows) takes x */

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return pd_half_to_float(h);
}

/* Bytes of one block: 32 weights, or for the K-quants a super-block of 256. */
static inline int q_block_bytes(int qt) {
    switch (qt) {
        case QT_Q4_0: return 18;
        case QT_Q4_1: return 20;
        case QT_Q5_0: return 22;
        case QT_Q5_1: return 24;
        case QT_Q4_K: return 144;
        case QT_Q5_K: return 176;
        case QT_Q6_K: return 210;
        default: return 34;
    }
}

static inline int q_is_k(int qt) { return qt == QT_Q4_K || qt == QT_Q5_K || qt == QT_Q6_K; }
static inline int q_is_5(int qt) { return qt == QT_Q5_0 || qt == QT_Q5_1; }

/* Block scale d, offset m (so that w = d * q + m, with q the raw code) and the codes' address
 * (Q5_0 / Q5_1: their 4 bytes of fifth bits, then the 16 bytes of nibbles). 32-weight blocks only. */
static inline const uint8_t *q_block_head(const uint8_t *blk, int qt, float *d, float *m) {
    *d = half_to_float(blk);
    if (qt == QT_Q4_1 || qt == QT_Q5_1) {
        *m = half_to_float(blk + 2);
        return blk + 4;
    }
    *m = qt == QT_Q4_0 ? -8.0f * *d : qt == QT_Q5_0 ? -16.0f * *d : 0.0f;
    return blk + 2;
}

/* Code j (0..31) of a 32-weight block whose codes start at q (q_block_head): Q8_0's signed, the
 * others' unsigned (Q5: the nibble, plus 16 where bit j of the fifth bits is set). */
static inline int q_code(const uint8_t *q, int qt, int j) {
    if (qt == QT_Q8_0) return (int8_t)q[j];
    if (q_is_5(qt)) {
        uint32_t qh;
        memcpy(&qh, q, 4);
        return (j < 16 ? q[4 + j] & 15 : q[4 + j - 16] >> 4) | (int)((qh >> j) & 1) << 4;
    }
    return j < 16 ? q[j] & 15 : q[j - 16] >> 4;
}

/* The K-quants, 256-weight super-blocks as llama.cpp's ggml-common.h lays them out:
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes holding eight 6-bit scales sc and mins mn
 *     (qk_scale_min), 128 bytes of nibbles: byte 32c + l holds weight l of sub-block 2c (low
 *     nibble) and of sub-block 2c + 1 (high)                         w = d * sc * q - dmin * mn
 *   Q5_K (176 bytes): the same with 32 bytes qh between the scales and the nibbles: bit i of qh[l]
 *     is the fifth bit of weight l of sub-block i
 *   Q6_K (210 bytes): 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 weights), fp16 d; in
 *     each half of 128 weights (ql + 64h, qh + 32h) weight 32k + l is nibble (k & 1 ? ql[l + 32] :
 *     ql[l]) (low for k < 2, high for k >= 2) with bits 2k, 2k+1 of qh[l] above it   w = d * sc * (q - 32)
 * qk_unpack spells a super-block out as signed codes c (int16), scales s and offsets m, the form
 * every kernel below takes: Q4_K / Q5_K w[j] = s[j / 32] * c[j] + m[j / 32] (eight sub-blocks of
 * 32, s = d * sc, m = -(dmin * mn)); Q6_K w[j] = s[j / 16] * c[j] (sixteen halves of 16, s = d *
 * sc, c = q - 32, no offset). s and m are exact float32 products (11 bits times 6 or 8), so that
 * s * c (+ m) rounds exactly as gguf's dequantizer does. */
static inline void qk_scale_min(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | (q[j - 4] >> 6) << 4;
        *mn = (q[j + 4] >> 4) | (q[j] >> 6) << 4;
    }
}

#ifdef __AVX2__
/* 32 code bytes (unsigned, or signed if sgn) widened to int16 at c[0..31]. */
static inline void qk_store_codes(int16_t *c, __m256i v, int sgn) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    _mm256_storeu_si256((__m256i *)c, sgn ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo));
    _mm256_storeu_si256((__m256i *)(c + 16), sgn ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi));
}

/* Half h (weights 128h..128h + 127) of a Q6_K super-block as four vectors of 32 unsigned code
 * bytes q (0..63), q[k] = weights 128h + 32k..: nibbles of ql (low for k < 2, high above; bytes
 * 0..31 for even k, 32..63 for odd) under bits 2k, 2k+1 of qh (16-bit shifts, then masked). */
static inline void qk6_codes(const uint8_t *blk, int h, __m256i q[4]) {
    const __m256i low4 = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(0x30);
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h)), v1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(v0, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top2));
    q[1] = _mm256_or_si256(_mm256_and_si256(v1, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), top2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low4), _mm256_and_si256(hb, top2));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), top2));
}

/* Sub-blocks 2k (*lo) and 2k + 1 (*hi) of a Q4_K / Q5_K super-block as 32 unsigned code bytes
 * each: the nibbles of qs[32k..], Q5_K with bits 2k, 2k + 1 of qh (its 32 bytes) above them. */
static inline void qk45_codes(const uint8_t *blk, int qt, int k, __m256i *lo, __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (qt == QT_Q5_K ? 48 : 16) + 32 * k));
    *lo = _mm256_and_si256(v, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if (qt == QT_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), one), 4));
        *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k + 1), one), 4));
    }
}
#endif

/* A Q4_K / Q5_K super-block's eight 6-bit scales and mins as bytes, four a word (sub-blocks 0..3
 * in sc[0], 4..7 in sc[1]): qk_scale_min four bytes at a time (u[0..2] are the 12 packed bytes). */
static inline void qk_scale_min_words(const uint8_t *blk, uint32_t sc[2], uint32_t mn[2]) {
    uint32_t u[3];
    memcpy(u, blk + 4, 12);
    sc[0] = u[0] & 0x3f3f3f3f;
    sc[1] = (u[2] & 0x0f0f0f0f) | (u[0] >> 6 & 0x03030303) << 4;
    mn[0] = u[1] & 0x3f3f3f3f;
    mn[1] = (u[2] >> 4 & 0x0f0f0f0f) | (u[1] >> 6 & 0x03030303) << 4;
}

/* A Q4_K / Q5_K super-block's eight sub-block scales s = d * sc and offsets m = -(dmin * mn). */
static inline void qk_scales_mins(const uint8_t *blk, float *restrict s, float *restrict m) {
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    uint32_t sc[2], mn[2];
    qk_scale_min_words(blk, sc, mn);
#ifdef __AVX2__
    const __m256 scv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)sc[0], (int)sc[1], 0, 0)));
    const __m256 mnv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)mn[0], (int)mn[1], 0, 0)));
    _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_set1_ps(d), scv));
    _mm256_storeu_ps(m, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), mnv), _mm256_set1_ps(-0.0f)));
#else
    for (int i = 0; i < 8; i++) {
        s[i] = d * (float)(sc[i >> 2] >> 8 * (i & 3) & 255);
        m[i] = -(dmin * (float)(mn[i >> 2] >> 8 * (i & 3) & 255));
    }
#endif
}

static inline void qk_unpack(const uint8_t *blk, int qt, int16_t *restrict c, float *restrict s, float *restrict m) {
#ifdef __AVX2__
    /* the codes as the plain C below spells them, 32 bytes at a time */
    if (qt == QT_Q6_K) {
        for (int half = 0; half < 2; half++) {
            __m256i q[4];
            qk6_codes(blk, half, q);
            for (int k = 0; k < 4; k++) qk_store_codes(c + 128 * half + 32 * k, _mm256_sub_epi8(q[k], _mm256_set1_epi8(32)), 1);
        }
    } else {
        for (int k = 0; k < 4; k++) {
            __m256i lo, hi;
            qk45_codes(blk, qt, k, &lo, &hi);
            qk_store_codes(c + 64 * k, lo, 0);
            qk_store_codes(c + 64 * k + 32, hi, 0);
        }
    }
#endif
    if (qt == QT_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = half_to_float(blk + 208);
        for (int h = 0; h < 16; h++) s[h] = d * (float)sc[h];
#ifndef __AVX2__
        for (int half = 0; half < 2; half++, ql += 64, qh += 32, c += 128)
            for (int l = 0; l < 32; l++) {
                c[l] = (int16_t)(((ql[l] & 15) | (qh[l] & 3) << 4) - 32);
                c[l + 32] = (int16_t)(((ql[l + 32] & 15) | (qh[l] >> 2 & 3) << 4) - 32);
                c[l + 64] = (int16_t)(((ql[l] >> 4) | (qh[l] >> 4 & 3) << 4) - 32);
                c[l + 96] = (int16_t)(((ql[l + 32] >> 4) | (qh[l] >> 6 & 3) << 4) - 32);
            }
#else
        (void)ql; (void)qh;
#endif
        return;
    }
    qk_scales_mins(blk, s, m);
#ifndef __AVX2__
    const uint8_t *qh = blk + 16, *qs = blk + (qt == QT_Q5_K ? 48 : 16);
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * k + l] & 15, hi = qs[32 * k + l] >> 4;
            if (qt == QT_Q5_K) {
                lo |= (qh[l] >> (2 * k) & 1) << 4;
                hi |= (qh[l] >> (2 * k + 1) & 1) << 4;
            }
            c[64 * k + l] = (int16_t)lo;
            c[64 * k + 32 + l] = (int16_t)hi;
        }
#endif
}

void pd_qk_unpack(const uint8_t *blk, int qt, int16_t *c, float *s, float *m) { qk_unpack(blk, qt, c, s, m); }
void pd_qk_scale_min(const uint8_t *q, int j, int *sc, int *mn) { qk_scale_min(q, j, sc, mn); }

/* One super-block's 256 weights as float32: gguf's values, bit for bit (see qk_unpack). */
static inline void qk_dequant(const uint8_t *blk, int qt, float *out) {
    int16_t c[256];
    float s[16], m[8];
    qk_unpack(blk, qt, c, s, m);
    if (qt == QT_Q6_K) {
        for (int j = 0; j < 256; j++) out[j] = s[j >> 4] * (float)c[j];
    } else {
        for (int j = 0; j < 256; j++) out[j] = s[j >> 5] * (float)c[j] + m[j >> 5];
    }
}

/* One block's 32 dequantised weights, float32, in order. The same arithmetic as the torch twin
 * (d * q + m for Q4_1 / Q5_1, d * (q - 8) for Q4_0, d * (q - 16) for Q5_0, d * q for Q8_0) so
 * dequantised values match it bit for bit. */
static inline void q_block_dequant(const uint8_t *blk, int qt, float *out) {
    float d = half_to_float(blk);
    if (qt == QT_Q8_0) {
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int j = 0; j < 32; j++) out[j] = d * (float)q[j];
    } else if (qt == QT_Q4_1) {
        float m = half_to_float(blk + 2);
        const uint8_t *q = blk + 4;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(q[j] & 15) + m;
            out[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    } else if (qt == QT_Q5_1) {
        float m = half_to_float(blk + 2);
        for (int j = 0; j < 32; j++) out[j] = d * (float)q_code(blk + 4, qt, j) + m;
    } else if (qt == QT_Q5_0) {
        for (int j = 0; j < 32; j++) out[j] = d * (float)(q_code(blk + 2, qt, j) - 16);
    } else {
        const uint8_t *q = blk + 2;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((q[j] & 15) - 8);
            out[j + 16] = d * (float)((q[j] >> 4) - 8);
        }
    }
}

/* A row of K weights as float32, block by block (the twin's values). */
static void q_row_dequant(const uint8_t *row, int qt, int K, float *out) {
    const int bb = q_block_bytes(qt);
    if (q_is_k(qt)) {
        for (int b = 0; b < K / 256; b++) qk_dequant(row + (int64_t)b * bb, qt, out + b * 256);
    } else {
        for (int b = 0; b < K / 32; b++) q_block_dequant(row + (int64_t)b * bb, qt, out + b * 32);
    }
}

void pd_q_dequant(const uint8_t *w, int64_t row_bytes, int qt, int K, const int64_t *rows, int n, float *out) {
#pragma omp parallel for schedule(static) if (n > 16)
    for (int i = 0; i < n; i++) q_row_dequant(w + (rows ? rows[i] : i) * row_bytes, qt, K, out + (int64_t)i * K);
}

/* K-quants at a few rows with integer activations (QK256_ROWS: a lone stream's decode step and
 * small batches) take them with one scale per 256-wide super-block (qk256_activations), so that
 * the sub-block scales are applied in integers and the sums converted to float once a super-block:
 * int8 (ACT_INT8: llama.cpp's q8_K, qk8_rows_avx2) or int16 (ACT_INT16: qk16_rows_avx2). */
#define QK256_ROWS PD_QK256_ROWS

/* Per-thread float32 scratch for a dequantised tile, grown on demand, kept for the process. */
static float *q_scratch(size_t n) {
    static __thread float *buf = NULL;
    static __thread size_t cap = 0;
    if (n > cap) {
        free(buf);
        buf = (float *)aligned_alloc(64, ((n * sizeof(float) + 63) / 64) * 64);
        cap = buf ? n : 0;
    }
    return buf;
}

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A Q5_0 / Q5_1 block's 32 codes (0..31) as bytes in order; q points at its 4 bytes of fifth bits
 * (bit j: weight j), followed by its 16 bytes of nibbles (low: weights 0..15, high: 16..31). */
static inline __m256i q5_codes(const uint8_t *q) {
    uint32_t qh;
    memcpy(&qh, q, 4);
    const __m128i raw = _mm_loadu_si128((const __m128i *)(q + 4)), mask = _mm_set1_epi8(15);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
    /* byte j: byte j / 8 of qh, tested for its bit j % 8 */
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i bits = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread), sel);
    return _mm256_or_si256(nib, _mm256_and_si256(_mm256_cmpeq_epi8(bits, sel), _mm256_set1_epi8(16)));
}

/* The 32 codes of a block as four vectors of 8 floats (unscaled). */
static inline void q_block_codes(const uint8_t *q, int qt, __m256 c[4]) {
    if (qt == QT_Q8_0) {
        for (int j = 0; j < 4; j++) c[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * j))));
        return;
    }
    __m128i lo, hi;
    if (q_is_5(qt)) {
        const __m256i v = q5_codes(q);
        lo = _mm256_castsi256_si128(v);
        hi = _mm256_extracti128_si256(v, 1);
    } else {
        __m128i raw = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(15);
        lo = _mm_and_si128(raw, mask);
        hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    }
    c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    c[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    c[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

/* q_block_dequant, 8 lanes wide: the same products and sums, so the same values. */
static inline void q_block_dequant8(const uint8_t *blk, int qt, float *out) {
    float d, m;
    const uint8_t *q = q_block_head(blk, qt, &d, &m);
    __m256 c[4], dv = _mm256_set1_ps(d);
    q_block_codes(q, qt, c);
    for (int j = 0; j < 4; j++) {
        if (qt == QT_Q4_1 || qt == QT_Q5_1) {
            _mm256_store_ps(out + 8 * j, _mm256_add_ps(_mm256_mul_ps(dv, c[j]), _mm256_set1_ps(m)));
        } else if (qt == QT_Q4_0 || qt == QT_Q5_0) {
            _mm256_store_ps(out + 8 * j, _mm256_mul_ps(dv, _mm256_sub_ps(c[j], _mm256_set1_ps(qt == QT_Q4_0 ? 8.0f : 16.0f))));
        } else {
            _mm256_store_ps(out + 8 * j, _mm256_mul_ps(dv, c[j]));
        }
    }
}

/* One 32-wide block of activations for the integer paths: its four vectors in v, its exact float
 * sum in *sum, its scale *d = max|x| / limit, and the inverse scale returned (0 for a block of
 * zeros), so that codes = round(x * inverse) lie in [-limit, limit]. */
static inline float q_block_scale(const float *src, float limit, __m256 v[4], float *d, float *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps(), s = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(src + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        s = _mm256_add_ps(s, v[j]);
    }
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    const float mx = _mm_cvtss_f32(a);
    *d = mx / limit;
    *sum = hsum8(s);
    return mx > 0.0f ? limit / mx : 0.0f;
}

/* Activations for the integer path: each row's 32-wide blocks as int8 codes xq with a scale dx
 * (x ~ dx * xq, dx = max|x| / 127, rounded to nearest even) and the float sum of the block (for
 * the offset term m * sum(x), taken exactly). llama.cpp's Q8_1 activations, with an exact sum. */
static void q8_activations(const float *x, int64_t xs, int M, int K, int8_t *xq, float *dx, float *xsum) {
    const int nb = K / 32;
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            __m256 v[4];
            const __m256 idv = _mm256_set1_ps(q_block_scale(x + r * xs + b * 32, 127.0f, v, dx + r * nb + b, xsum + r * nb + b));
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], idv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], idv));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], idv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], idv));
            i0 = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            _mm256_storeu_si256((__m256i *)(xq + (int64_t)r * K + b * 32), _mm256_permutevar8x32_epi32(i0, perm));
        }
}

/* Activations for the int16 path: each row's 32-wide blocks as int16 codes xq with a scale dx
 * (x ~ dx * xq, dx = max|x| / 32767, rounded to nearest even) and the exact float block sum. The
 * rounding is 256 times finer than int8's: about 1.5e-5 of a block's largest value. */
static void q16_activations(const float *x, int64_t xs, int M, int K, int16_t *xq, float *dx, float *xsum) {
    const int nb = K / 32;
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            __m256 v[4];
            const __m256 idv = _mm256_set1_ps(q_block_scale(x + r * xs + b * 32, 32767.0f, v, dx + r * nb + b, xsum + r * nb + b));
            for (int j = 0; j < 4; j += 2) {
                __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], idv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], idv));
                __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);  /* back in order */
                _mm256_storeu_si256((__m256i *)(xq + (int64_t)r * K + b * 32 + 8 * j), p);
            }
        }
}

void pd_q16_activations(const float *x, int64_t xs, int M, int K, int16_t *xq, float *dx, float *xsum) {
    q16_activations(x, xs, M, K, xq, dx, xsum);
}

/* A block's 32 codes as int16: weights 0..15 in *w0, 16..31 in *w1. Q4: one vpmovzxbw of the 16
 * code bytes, the low nibble by a mask, the high one by a shift (each byte holds weight j low and
 * j + 16 high); Q8_0: the signed bytes widened. */
static inline void q_codes_i16(const uint8_t *q, const int qt, __m256i *w0, __m256i *w1) {
    if (qt == QT_Q8_0) {
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
    } else if (q_is_5(qt)) {
        const __m256i v = q5_codes(q);
        *w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v));
        *w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1));
    } else {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
        *w0 = _mm256_and_si256(v, _mm256_set1_epi16(15));
        *w1 = _mm256_srli_epi16(v, 4);
    }
}

/* int16 path, R (constant, 1..Q_DIRECT_INT16_ROWS) rows: out[r][n] = sum over blocks of d * dx * (q . xq) + m * sum(x);
 * q . xq is exact in int32 (|q| <= 127, |xq| <= 32767, 32 terms) and each 8-lane partial sum
 * (4 products) stays below 2^24, so its conversion to float is exact too. */
static inline __attribute__((always_inline)) void q_direct_i16(
    const uint8_t *w, int64_t row_bytes, int qt, int K, const int16_t *xq, const float *dx, const float *xsum,
    float *out, int64_t os, int n, const int R) {
    const int nb = K / 32, bb = q_block_bytes(qt);
    const uint8_t *row = w + (int64_t)n * row_bytes;
    __m256 acc[Q_DIRECT_INT16_ROWS];
    float moff[Q_DIRECT_INT16_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); moff[r] = 0.0f; }
    for (int b = 0; b < nb; b++) {
        float d, m;
        const uint8_t *q = q_block_head(row + (int64_t)b * bb, qt, &d, &m);
        __m256i w0, w1;
        q_codes_i16(q, qt, &w0, &w1);
        for (int r = 0; r < R; r++) {
            const int16_t *xr = xq + (int64_t)r * K + b * 32;
            __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xr)),
                                         _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xr + 16))));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[r * nb + b]), acc[r]);
            moff[r] += m * xsum[r * nb + b];
        }
    }
    for (int r = 0; r < R; r++) out[r * os + n] = hsum8(acc[r]) + moff[r];
}

/* int16 path for 8 weight rows n..n+7 at once and R (constant, 1 or 2) activation rows: the lone
 * user's decode step. Weight rows n..n+7 are contiguous in memory; while it works on them it
 * prefetches the next eight. Per block, each weight row's 32 codes (q_codes_i16) are multiplied
 * into x with two madd_epi16; the eight rows' int32 sums are folded into one vector by horizontal adds,
 * so the block scales of the eight rows (one fp16 -> float conversion for eight) are applied with
 * one FMA and the offsets m * sum(x) with another. Measured against q_direct_i16 on this machine
 * (2 threads, weights streamed from memory, best of 100): 1.2-1.4x at 1 row, 1.1-1.3x at 2. The products and block
 * sums are exact integers as in q_direct_i16; a Q4 block's sum (< 32 * 15 * 32767 < 2^24) also
 * converts to float exactly, a Q8_0 block's may round once (2^-24 relative). */
#ifdef __F16C__
static inline __attribute__((always_inline)) void q_direct8_i16(
    const uint8_t *w, int64_t row_bytes, const int qt, int K, const int16_t *xq, const float *dx, const float *xsum,
    float *out, int64_t os, int n, const int R) {
    const int nb = K / 32, bb = q_block_bytes(qt), has_m = qt == QT_Q4_1 || qt == QT_Q5_1, code_at = has_m ? 4 : 2;
    const uint8_t *row = w + (int64_t)n * row_bytes;
    __m256 acc[2], moff[2];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); moff[r] = _mm256_setzero_ps(); }
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (int64_t)b * bb;
        {  /* the next group's 8 rows (contiguous) */
            const char *next = (const char *)(row + 8 * row_bytes) + (int64_t)b * 8 * row_bytes / nb;
            _mm_prefetch(next, _MM_HINT_T0); _mm_prefetch(next + 64, _MM_HINT_T0); _mm_prefetch(next + 128, _MM_HINT_T0);
        }
        __m256i p[2][8];
        uint16_t dh[8], mh[8];
        for (int i = 0; i < 8; i++) {
            const uint8_t *bi = blk + i * row_bytes;
            memcpy(dh + i, bi, 2);
            if (has_m) memcpy(mh + i, bi + 2, 2);
            __m256i w0, w1;
            q_codes_i16(bi + code_at, qt, &w0, &w1);
            for (int r = 0; r < R; r++) {
                const int16_t *xr = xq + (int64_t)r * K + b * 32;
                p[r][i] = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xr)),
                                           _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xr + 16))));
            }
        }
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
        const __m256 m8 = has_m           ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh))
                          : qt == QT_Q4_0 ? _mm256_mul_ps(_mm256_set1_ps(-8.0f), d8)
                          : qt == QT_Q5_0 ? _mm256_mul_ps(_mm256_set1_ps(-16.0f), d8)
                                          : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            /* lane i of s: row n+i's block sum */
            const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[r][0], p[r][1]), _mm256_hadd_epi32(p[r][2], p[r][3]));
            const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(p[r][4], p[r][5]), _mm256_hadd_epi32(p[r][6], p[r][7]));
            const __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d8, _mm256_set1_ps(dx[r * nb + b])), acc[r]);
            if (qt != QT_Q8_0) moff[r] = _mm256_fmadd_ps(m8, _mm256_set1_ps(xsum[r * nb + b]), moff[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * os + n, _mm256_add_ps(acc[r], moff[r]));
}
#endif

/* Integer GEMMs (more rows than the direct paths: batched decode steps and prompts), two kinds of
 * activation codes over the same tiling:
 * - int16 (ACT_INT16, more than Q_DIRECT_INT16_ROWS rows; q_gemm(.., 0)): q_direct_i16's
 *   products, exact int32 block sums of codes times int16 activations;
 * - int8 (pd_q_gemm_i8, AVX-512 VNNI only; q_gemm(.., 1)): activations rounded to int8 per block
 *   as q8_activations does (the direct int8 path's rounding), products by vpdpbusd, which takes
 *   an unsigned byte times a signed one, four pairs a lane, 64 products an instruction (twice
 *   vpdpwssd's 32). The activation is the unsigned operand, offset by 128 (xq + 128 in 1..255:
 *   the byte xq ^ 0x80) and the weight code the signed one (Q8_0's codes as they are, Q4's
 *   nibbles 0..15), so that the weight quad is the broadcast memory operand; the offset's share,
 *   128 * sum(codes of the weight block), is the int32 accumulator's start value, computed once
 *   per panel (ggml instead flips signs, abs(w) times sign(x, w), which costs two instructions
 *   per weight vector that a GEMM would pay for every activation tile). The block sum is exact:
 *   |sum| <= 32 * 255 * 128 < 2^24, so its float conversion is exact too.
 * Both: each block sum scaled by d * dx in float, plus m * sum(x) (kernels/quant.py
 * matmul_int_twin), with lanes over activation rows instead of weight rows so that only the
 * activations are repacked (once a call; a tile's rows are a block's 32-bit words, 16 int16
 * pairs or 8 int8 quads, apart) and weight codes are unpacked in place into int16 / int8 rows,
 * one panel of Q_GEMM_NP weight rows per thread task, then broadcast one 32-bit word at a time.
 * A micro-tile is Q_GEMM_MT activation rows by Q_GEMM_NR weight rows: 2 * NR int32 accumulators
 * for a block, folded into 2 * NR float accumulators after each block. Rows past M are zero
 * codes with zero scales. */
#ifdef __AVX512VNNI__
/* AVX-512 VNNI: vpdpwssd / vpdpbusd multiply and add the pairs / quads in one instruction (the
 * same exact int32 sums as madd_epi16 + add_epi32), sixteen lanes wide, the weight word broadcast
 * from memory; 6 weight rows x 32 activation rows: 12 int32 + 12 float accumulators. */
#define Q_GEMM_MT 32  /* activation rows in a tile (two 16-lane vectors) */
#define Q_GEMM_NR 6   /* weight rows in a micro-tile */
#define Q_GEMM_I8 1   /* the int8 kind is built */
#else
#define Q_GEMM_MT 16  /* activation rows in a tile (two 8-lane vectors) */
#define Q_GEMM_NR 4   /* weight rows in a micro-tile */
#define Q_GEMM_I8 0   /* no vpdpbusd: pd_q_gemm_i8 returns 2 and q_gemm(.., 1) is never called */
#endif
#define Q_GEMM_NP 48  /* weight rows in a panel (a multiple of Q_GEMM_NR) */

/* Words w[i][0..7] of eight rows (r[i]) as eight vectors c[p] = w[0..7][p]: an 8x8 transpose. */
static inline void transpose8_epi32(const __m256i r[8], __m256i c[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int p = 0; p < 4; p++) {
        c[p] = _mm256_permute2x128_si256(u[p], u[p + 4], 0x20);
        c[p + 4] = _mm256_permute2x128_si256(u[p], u[p + 4], 0x31);
    }
}

/* Tiles of Q_GEMM_MT rows: per tile and block, codes as [P words][MT rows] (P = 16 int16 pairs,
 * or 8 quads of int8 codes offset by 128), then the rows' scales dx and block sums, [MT] each. */
static void q_gemm_pack_x(const float *x, int64_t xs, int M, int K, int32_t *xp, float *dxp, float *sump, int i8) {
    const int nb = K / 32, tiles = (M + Q_GEMM_MT - 1) / Q_GEMM_MT, P = i8 ? 8 : 16;
#pragma omp parallel for schedule(static) if (tiles > 1)
    for (int t = 0; t < tiles; t++) {
        for (int b = 0; b < nb; b++) {
            /* the tile's rows of this block as codes (P 32-bit words a row), then transposed
             * eight rows by eight words at a time into [word][row] */
            uint8_t codes[Q_GEMM_MT][64] __attribute__((aligned(32)));
            int32_t *dst = xp + ((int64_t)t * nb + b) * P * Q_GEMM_MT;
            float *dxd = dxp + ((int64_t)t * nb + b) * Q_GEMM_MT, *sd = sump + ((int64_t)t * nb + b) * Q_GEMM_MT;
            for (int i = 0; i < Q_GEMM_MT; i++) {
                const int r = t * Q_GEMM_MT + i;
                if (r >= M) {
                    memset(codes[i], i8 ? 0x80 : 0, sizeof codes[i]);  /* code 0 (int8: offset by 128) */
                    dxd[i] = sd[i] = 0.0f;
                } else if (i8) {
                    q8_activations(x + (int64_t)r * xs + b * 32, xs, 1, 32, (int8_t *)codes[i], dxd + i, sd + i);
                    const __m256i c = _mm256_load_si256((const __m256i *)codes[i]);
                    _mm256_store_si256((__m256i *)codes[i], _mm256_xor_si256(c, _mm256_set1_epi8((char)0x80)));
                } else {
                    q16_activations(x + (int64_t)r * xs + b * 32, xs, 1, 32, (int16_t *)codes[i], dxd + i, sd + i);
                }
            }
            for (int h = 0; h < Q_GEMM_MT / 8; h++)
                for (int g = 0; g < P / 8; g++) {
                    __m256i rows[8], cols[8];
                    for (int i = 0; i < 8; i++) rows[i] = _mm256_load_si256((const __m256i *)(codes[8 * h + i] + 32 * g));
                    transpose8_epi32(rows, cols);
                    for (int p = 0; p < 8; p++) _mm256_store_si256((__m256i *)(dst + (8 * g + p) * Q_GEMM_MT + 8 * h), cols[p]);
                }
        }
    }
}

/* The micro-tile's vectors: QL lanes of int32 / float, and the pair / quad products added in
 * (avx512: vpdpwssd / vpdpbusd; avx2: madd_epi16 + add_epi32, the same exact int32 sums, and no
 * int8 kind). QV_PIN keeps a value in a register: GCC reloaded the x vectors for every weight row
 * (10-14% slower) and reassociated the sums, spilling every product. */
#ifdef __AVX512VNNI__
#define QL 16
typedef __m512 qv_f;
typedef __m512i qv_i;
#define qv_zero_f _mm512_setzero_ps
#define qv_zero_i _mm512_setzero_si512
#define qv_load_i(p) _mm512_load_si512((const void *)(p))
#define qv_set1_i _mm512_set1_epi32
#define qv_dot_pairs(acc, w, x) _mm512_dpwssd_epi32(acc, x, w)
#define qv_dot_quads(acc, w, x) _mm512_dpbusd_epi32(acc, x, w)  /* x unsigned, w signed */
#define qv_load_f _mm512_load_ps
#define qv_store_f _mm512_storeu_ps
#define qv_set1_f _mm512_set1_ps
#define qv_fmadd _mm512_fmadd_ps
#define qv_mul _mm512_mul_ps
#define qv_cvt _mm512_cvtepi32_ps
#define QV_PIN(v) __asm__("" : "+v"(v))
#else
#define QL 8
typedef __m256 qv_f;
typedef __m256i qv_i;
#define qv_zero_f _mm256_setzero_ps
#define qv_zero_i _mm256_setzero_si256
#define qv_load_i(p) _mm256_load_si256((const __m256i *)(p))
#define qv_set1_i _mm256_set1_epi32
#define qv_dot_pairs(acc, w, x) _mm256_add_epi32(_mm256_madd_epi16(w, x), acc)
#define qv_dot_quads(acc, w, x) (acc)  /* never reached: Q_GEMM_I8 is 0 here */
#define qv_load_f _mm256_load_ps
#define qv_store_f _mm256_storeu_ps
#define qv_set1_f _mm256_set1_ps
#define qv_fmadd _mm256_fmadd_ps
#define qv_mul _mm256_mul_ps
#define qv_cvt _mm256_cvtepi32_ps
#define QV_PIN(v) __asm__("" : "+x"(v))
#endif

/* One micro-tile: the first QL * V (constant, 1 or 2) rows of an activation tile (packed) times
 * weight rows wc[0..NR) (codes, int16 or, I8, int8: K each), scales d / offsets m [NR][nb] and,
 * I8, the accumulators' start values w0 [NR][nb] (-128 * the block's code sum); the QL*V x NR
 * results go to res[NR][MT]. V = 1 for a last tile of at most QL rows. H = 2 (Q6_K, int16 only):
 * each half of a block (16 weights, words 0..7 and 8..15) has its own scale, the first's in wd
 * and the second's in wm (Q6_K has no offset), so each half's int32 sums are scaled alone. */
static inline __attribute__((always_inline)) void q_gemm_tile(
    const int32_t *xp, const float *dxp, const float *sump, const uint8_t *wc, const float *wd, const float *wm, const int32_t *w0,
    int nb, int K, int qt, float res[Q_GEMM_NR][Q_GEMM_MT], const int V, const int I8, const int H) {
    const int P = I8 ? 8 : 16;  /* 32-bit words in a block */
    const int64_t row = (int64_t)K * (I8 ? 1 : 2);  /* bytes of a weight row's codes */
    qv_f f[Q_GEMM_NR][2];
    for (int j = 0; j < Q_GEMM_NR; j++)
        for (int v = 0; v < V; v++) f[j][v] = qv_zero_f();
    for (int b = 0; b < nb; b++)
      for (int h = 0; h < H; h++) {
        const int32_t *xb = xp + (int64_t)b * P * Q_GEMM_MT;
        qv_i a[Q_GEMM_NR][2];
        for (int j = 0; j < Q_GEMM_NR; j++)
            for (int v = 0; v < V; v++) a[j][v] = I8 ? qv_set1_i(w0[j * nb + b]) : qv_zero_i();
#pragma GCC unroll 16
        for (int p = h * P / H; p < (h + 1) * P / H; p++) {
            qv_i xv[2];
            for (int v = 0; v < V; v++) {
                xv[v] = qv_load_i(xb + p * Q_GEMM_MT + QL * v);
                QV_PIN(xv[v]);
            }
#pragma GCC unroll 8
            for (int j = 0; j < Q_GEMM_NR; j++) {
                int32_t word;
                memcpy(&word, wc + j * row + b * 4 * P + 4 * p, 4);
                const qv_i w = qv_set1_i(word);
                for (int v = 0; v < V; v++) {
                    a[j][v] = I8 ? qv_dot_quads(a[j][v], w, xv[v]) : qv_dot_pairs(a[j][v], w, xv[v]);
                    QV_PIN(a[j][v]);
                }
            }
        }
        for (int v = 0; v < V; v++) {
            const qv_f dx = qv_load_f(dxp + b * Q_GEMM_MT + QL * v);
            const float *sc = h ? wm : wd;
            for (int j = 0; j < Q_GEMM_NR; j++)
                f[j][v] = qv_fmadd(qv_cvt(a[j][v]), qv_mul(qv_set1_f(sc[j * nb + b]), dx), f[j][v]);
            if (H == 1 && qt != QT_Q8_0) {
                const qv_f s = qv_load_f(sump + b * Q_GEMM_MT + QL * v);
                for (int j = 0; j < Q_GEMM_NR; j++) f[j][v] = qv_fmadd(qv_set1_f(wm[j * nb + b]), s, f[j][v]);
            }
        }
    }
    for (int j = 0; j < Q_GEMM_NR; j++)
        for (int v = 0; v < V; v++) qv_store_f(res[j] + QL * v, f[j][v]);
}

/* A panel's weight rows n0.. (np of them, the rest of Q_GEMM_NP zeros) unpacked: codes (int16, or
 * I8 int8: K a row), d and m ([row][nb]) and, I8, -128 * each block's code sum (w0). */
static void q_gemm_unpack_panel(const uint8_t *w, int64_t row_bytes, int qt, int K, int n0, int np, uint8_t *wc, float *wd, float *wm,
                                int32_t *w0, int i8) {
    const int nb = K / 32, bb = q_block_bytes(qt), cb = i8 ? 32 : 64;  /* code bytes a block */
    if (q_is_k(qt)) {  /* int16 only: a super-block's codes are its 8 blocks' (qk_unpack); Q6_K's half scales in wd, wm */
        for (int i = 0; i < Q_GEMM_NP; i++)
            for (int sb = 0; sb < K / 256; sb++) {
                float *d = wd + i * nb + 8 * sb, *m = wm + i * nb + 8 * sb, sc[16], mn[8];
                int16_t *dst = (int16_t *)(wc + ((int64_t)i * nb + 8 * sb) * cb);
                if (i >= np) {
                    memset(dst, 0, 256 * sizeof(int16_t));
                    for (int j = 0; j < 8; j++) d[j] = m[j] = 0.0f;
                    continue;
                }
                qk_unpack(w + (int64_t)(n0 + i) * row_bytes + (int64_t)sb * bb, qt, dst, sc, mn);
                for (int j = 0; j < 8; j++) {
                    d[j] = qt == QT_Q6_K ? sc[2 * j] : sc[j];
                    m[j] = qt == QT_Q6_K ? sc[2 * j + 1] : mn[j];
                }
            }
        return;
    }
    for (int i = 0; i < Q_GEMM_NP; i++)
        for (int b = 0; b < nb; b++) {
            uint8_t *dst = wc + ((int64_t)i * nb + b) * cb;
            if (i >= np) {
                memset(dst, 0, cb);
                wd[i * nb + b] = wm[i * nb + b] = 0.0f;
                if (i8) w0[i * nb + b] = 0;
                continue;
            }
            const uint8_t *q = q_block_head(w + (int64_t)(n0 + i) * row_bytes + (int64_t)b * bb, qt, wd + i * nb + b, wm + i * nb + b);
            if (!i8) {
                __m256i c0, c1;
                q_codes_i16(q, qt, &c0, &c1);
                _mm256_storeu_si256((__m256i *)dst, c0);
                _mm256_storeu_si256((__m256i *)(dst + 32), c1);
                continue;
            }
            if (qt == QT_Q8_0) {
                memcpy(dst, q, 32);
            } else if (q_is_5(qt)) {
                _mm256_storeu_si256((__m256i *)dst, q5_codes(q));
            } else {
                const __m128i raw = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(15);
                _mm_storeu_si128((__m128i *)dst, _mm_and_si128(raw, mask));
                _mm_storeu_si128((__m128i *)(dst + 16), _mm_and_si128(_mm_srli_epi16(raw, 4), mask));
            }
            /* the 32 codes' sum by vpsadbw (Q8_0's signed bytes offset to unsigned and back) */
            const __m256i c = _mm256_loadu_si256((const __m256i *)dst);
            const __m256i s = _mm256_sad_epu8(qt == QT_Q8_0 ? _mm256_xor_si256(c, _mm256_set1_epi8((char)0x80)) : c, _mm256_setzero_si256());
            __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            t = _mm_add_epi64(t, _mm_unpackhi_epi64(t, t));
            w0[i * nb + b] = -128 * (_mm_cvtsi128_si32(t) - (qt == QT_Q8_0 ? 32 * 128 : 0));
        }
}

/* out (M, N) = x @ W^T by the integer GEMM of kind i8 (0: int16 codes, 1: int8, Q_GEMM_I8 builds only). */
static int q_gemm(const float *x, int64_t xs, const uint8_t *w, int64_t row_bytes, int qt, int M, int N, int K, float *out, int64_t os,
                  int i8) {
    const int nb = K / 32, tiles = (M + Q_GEMM_MT - 1) / Q_GEMM_MT, P = i8 ? 8 : 16;
    const int panels = (N + Q_GEMM_NP - 1) / Q_GEMM_NP;
    const size_t words = (size_t)tiles * nb * P * Q_GEMM_MT, scales = (size_t)tiles * nb * Q_GEMM_MT;
    int32_t *xp = (int32_t *)aligned_alloc(64, (words + 2 * scales) * 4);
    if (!xp) return 1;
    float *dxp = (float *)(xp + words), *sump = dxp + scales;
    q_gemm_pack_x(x, xs, M, K, xp, dxp, sump, i8);
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int pn = 0; pn < panels; pn++) {
        /* the panel's codes (K * P / 8 floats' room a row), then d, m and the int8 start values ([row][nb]) */
        float *scratch = q_scratch((size_t)Q_GEMM_NP * K * P / 32 + 3 * Q_GEMM_NP * nb);
        if (!scratch) { failed = 1; continue; }
        uint8_t *wc = (uint8_t *)scratch;
        float *wd = scratch + (size_t)Q_GEMM_NP * K * P / 32, *wm = wd + Q_GEMM_NP * nb;
        int32_t *w0 = (int32_t *)(wm + Q_GEMM_NP * nb);
        const int n0 = pn * Q_GEMM_NP, np = N - n0 < Q_GEMM_NP ? N - n0 : Q_GEMM_NP;
        const int64_t row = (int64_t)K * (i8 ? 1 : 2);
        q_gemm_unpack_panel(w, row_bytes, qt, K, n0, np, wc, wd, wm, w0, i8);
        for (int t = 0; t < tiles; t++) {
            const int m0 = t * Q_GEMM_MT, mr = M - m0 < Q_GEMM_MT ? M - m0 : Q_GEMM_MT;
            const int32_t *xt = xp + (int64_t)t * nb * P * Q_GEMM_MT;
            const float *dxt = dxp + (int64_t)t * nb * Q_GEMM_MT, *st = sump + (int64_t)t * nb * Q_GEMM_MT;
            for (int j0 = 0; j0 < np; j0 += Q_GEMM_NR) {
                float res[Q_GEMM_NR][Q_GEMM_MT];
                const uint8_t *wj = wc + j0 * row;
                const float *dj = wd + j0 * nb, *mj = wm + j0 * nb;
                const int32_t *zj = w0 + j0 * nb;
                if (Q_GEMM_I8 && i8) {  /* (the compiler drops these where the int8 kind is not built) */
                    if (mr > Q_GEMM_MT / 2) q_gemm_tile(xt, dxt, st, wj, dj, mj, zj, nb, K, qt, res, 2, 1, 1);
                    else q_gemm_tile(xt, dxt, st, wj, dj, mj, zj, nb, K, qt, res, 1, 1, 1);
                } else if (qt == QT_Q6_K) {
                    if (mr > Q_GEMM_MT / 2) q_gemm_tile(xt, dxt, st, wj, dj, mj, zj, nb, K, qt, res, 2, 0, 2);
                    else q_gemm_tile(xt, dxt, st, wj, dj, mj, zj, nb, K, qt, res, 1, 0, 2);
                } else {
                    if (mr > Q_GEMM_MT / 2) q_gemm_tile(xt, dxt, st, wj, dj, mj, zj, nb, K, qt, res, 2, 0, 1);
                    else q_gemm_tile(xt, dxt, st, wj, dj, mj, zj, nb, K, qt, res, 1, 0, 1);
                }
                const int nr = np - j0 < Q_GEMM_NR ? np - j0 : Q_GEMM_NR;
                for (int r = 0; r < mr; r++)
                    for (int j = 0; j < nr; j++) out[(int64_t)(m0 + r) * os + n0 + j0 + j] = res[j][r];
            }
        }
    }
    free(xp);
    return failed;
}

/* Direct path with float activations, R (constant, 1..4) rows: out[r][n] = sum over blocks of
 * d * (codes . x) + m * sum(x), every product a float32 product of x with an exact code. */
static inline __attribute__((always_inline)) void q_direct_f32(
    const uint8_t *w, int64_t row_bytes, int qt, int K, const float *x, int64_t xs, const float *xsum,
    float *out, int64_t os, int n, const int R) {
    const int nb = K / 32, bb = q_block_bytes(qt);
    const uint8_t *row = w + (int64_t)n * row_bytes;
    __m256 acc[4];
    float moff[4];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); moff[r] = 0.0f; }
    for (int b = 0; b < nb; b++) {
        float d, m;
        const uint8_t *q = q_block_head(row + (int64_t)b * bb, qt, &d, &m);
        __m256 c[4];
        q_block_codes(q, qt, c);
        __m256 dv = _mm256_set1_ps(d);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * xs + b * 32;
            __m256 t = _mm256_mul_ps(c[0], _mm256_loadu_ps(xr));
            t = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(xr + 8), t);
            t = _mm256_fmadd_ps(c[2], _mm256_loadu_ps(xr + 16), t);
            t = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xr + 24), t);
            acc[r] = _mm256_fmadd_ps(t, dv, acc[r]);
            moff[r] += m * xsum[r * nb + b];
        }
    }
    for (int r = 0; r < R; r++) out[r * os + n] = hsum8(acc[r]) + moff[r];
}

/* Integer path, R (constant, 1..4) rows: out[r][n] = sum over blocks of d * dx * (q . xq) + m * sum(x). */
static inline __attribute__((always_inline)) void q_direct_i8(
    const uint8_t *w, int64_t row_bytes, int qt, int K, const int8_t *xq, const float *dx, const float *xsum,
    float *out, int64_t os, int n, const int R) {
    const int nb = K / 32, bb = q_block_bytes(qt);
    const uint8_t *row = w + (int64_t)n * row_bytes;
    const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(15);
    __m256 acc[4];
    float moff[4];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); moff[r] = 0.0f; }
    for (int b = 0; b < nb; b++) {
        float d, m;
        const uint8_t *q = q_block_head(row + (int64_t)b * bb, qt, &d, &m);
        __m256i codes;
        if (qt == QT_Q8_0) {
            codes = _mm256_loadu_si256((const __m256i *)q);
        } else if (q_is_5(qt)) {
            codes = q5_codes(q);
        } else {
            __m128i raw = _mm_loadu_si128((const __m128i *)q);
            codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), mask);
        }
        const __m256i wabs = qt == QT_Q8_0 ? _mm256_sign_epi8(codes, codes) : codes;
        for (int r = 0; r < R; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)r * K + b * 32));
            if (qt == QT_Q8_0) xv = _mm256_sign_epi8(xv, codes);
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xv), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[r * nb + b]), acc[r]);
            moff[r] += m * xsum[r * nb + b];
        }
    }
    for (int r = 0; r < R; r++) out[r * os + n] = hsum8(acc[r]) + moff[r];
}

/* K-quant direct path, R (constant, QK256_ROWS + 1..Q_DIRECT_INT16_ROWS) rows of int16 activations
 * per 32 (q16_activations) times weight row n: out[r][n] = sum over sub-blocks b of s * dx * (c . xq) +
 * m * sum(x) (Q6_K: per half of 16, both halves under their sub-block's dx; no offset). Each
 * super-block is spelled out once into L1 (qk_unpack) and read by every row; madd_epi16 gives a
 * sub-block's (or half's) products as eight exact int32 pair sums (|c| <= 32, |xq| <= 32767, each
 * < 2^24, so its float conversion is exact too), scaled by s * dx (computed eight at a time) into
 * eight float lanes, which are summed once at the end; the eight offsets m * sum(x) take one FMA.
 * (Folding each sub-block's lanes first, as q_direct8_i16 does, measured about 1.2x slower here.) */
static inline __attribute__((always_inline)) void qk_direct_int(
    const uint8_t *w, int64_t row_bytes, const int qt, int K, const int16_t *xq, const float *dx, const float *xsum,
    float *out, int64_t os, int n, const int R) {
    const int nb = K / 32, bb = q_block_bytes(qt);
    const uint8_t *row = w + (int64_t)n * row_bytes;
    const __m256i lo_half = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), hi_half = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    __m256 acc[Q_DIRECT_INT16_ROWS], moff[Q_DIRECT_INT16_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); moff[r] = _mm256_setzero_ps(); }
    int16_t c[256] __attribute__((aligned(32)));
    float s[16] __attribute__((aligned(32))), m[8] __attribute__((aligned(32)));
    for (int sb = 0; sb < K / 256; sb++) {
        if (sb + 1 < K / 256)
            for (int off = 0; off < bb; off += 64) _mm_prefetch((const char *)row + (int64_t)(sb + 1) * bb + off, _MM_HINT_T0);
        qk_unpack(row + (int64_t)sb * bb, qt, c, s, m);
        for (int r = 0; r < R; r++) {
            const int64_t at = (int64_t)r * K + sb * 256;  /* this row's activations of the super-block */
            float sd[16] __attribute__((aligned(32)));  /* each sub-block's (Q6_K: half's) s * dx */
            const __m256 d8 = _mm256_loadu_ps(dx + r * nb + 8 * sb);
            if (qt == QT_Q6_K) {  /* halves 0..7 are sub-blocks 0..3's, 8..15 sub-blocks 4..7's */
                _mm256_store_ps(sd, _mm256_mul_ps(_mm256_load_ps(s), _mm256_permutevar8x32_ps(d8, lo_half)));
                _mm256_store_ps(sd + 8, _mm256_mul_ps(_mm256_load_ps(s + 8), _mm256_permutevar8x32_ps(d8, hi_half)));
            } else {
                _mm256_store_ps(sd, _mm256_mul_ps(_mm256_load_ps(s), d8));
                moff[r] = _mm256_fmadd_ps(_mm256_load_ps(m), _mm256_loadu_ps(xsum + r * nb + 8 * sb), moff[r]);
            }
            for (int i = 0; i < 8; i++) {
                const int16_t *xr = xq + at + 32 * i;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)xr), x1 = _mm256_loadu_si256((const __m256i *)(xr + 16));
                const __m256i a0 = _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(c + 32 * i)), x0);
                const __m256i a1 = _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(c + 32 * i + 16)), x1);
                if (qt == QT_Q6_K) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0), _mm256_broadcast_ss(sd + 2 * i), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), _mm256_broadcast_ss(sd + 2 * i + 1), acc[r]);
                } else {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(a0, a1)), _mm256_broadcast_ss(sd + i), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) out[r * os + n] = hsum8(_mm256_add_ps(acc[r], moff[r]));
}

/* K-quant direct path with float activations, R (constant, 1..Q_DIRECT_ROWS) rows: each
 * super-block dequantised (qk_dequant: the twin's values) and multiplied into every row in float32. */
static inline __attribute__((always_inline)) void qk_direct_f32(
    const uint8_t *w, int64_t row_bytes, int qt, int K, const float *x, int64_t xs, float *out, int64_t os, int n, const int R) {
    const int bb = q_block_bytes(qt);
    const uint8_t *row = w + (int64_t)n * row_bytes;
    float wf[256] __attribute__((aligned(32)));
    __m256 acc[Q_DIRECT_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int sb = 0; sb < K / 256; sb++) {
        qk_dequant(row + (int64_t)sb * bb, qt, wf);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * xs + sb * 256;
            for (int j = 0; j < 256; j += 16) {
                acc[r][0] = _mm256_fmadd_ps(_mm256_load_ps(wf + j), _mm256_loadu_ps(xr + j), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_load_ps(wf + j + 8), _mm256_loadu_ps(xr + j + 8), acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r * os + n] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* The next super-block's bb bytes into L1, a line at a time. */
static inline void qk_prefetch(const uint8_t *blk, int bb) {
    for (int off = 0; off < bb; off += 64) _mm_prefetch((const char *)blk + off, _MM_HINT_T0);
}

/* The eight offsets m = -(dmin * mn) of a Q4_K / Q5_K super-block (mn: qk_scale_min_words). */
static inline __m256 qk_mins8(float dmin, const uint32_t mn[2]) {
    return _mm256_mul_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)mn[0], (int)mn[1], 0, 0))));
}

/* K-quants at a few rows (M <= QK256_ROWS: the lone stream's decode step), the int8 kind (ACT_INT8):
 * activations in llama.cpp's q8_K form (qk256_activations: int8 codes, one scale per 256), weight row n times
 * each. Per super-block the codes meet the activations in bytes (maddubs: unsigned code times
 * signed activation, pairs summed to int16, exact: |pair| <= 2 * 63 * 128), each 32-bit lane's
 * pair sums are multiplied by their sub-block's integer scale and added (madd_epi16, or one
 * vpdpwssd where AVX-512 VNNI is built), and the int32 sum is converted to float once per
 * super-block, times d * dx. Q4_K / Q5_K: the mins term m * sum(x) over the float sums of x;
 * Q6_K: codes q (0..63) times x, less 32 * sum over its sixteen 16-wide groups of sc * (code sum
 * of the group) (bsum), so the offset stays in integers. Lane sums stay far inside int32
 * (|lane| <= 8 * 2 * 16128 * 128 + 32 * 16 * 128 * 2032). The twin: kernels/quant.py
 * matmul_int_twin; the plain C form: qk256_row_scalar (the baseline variant). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)  /* acc + the int16 pairs' products, pairwise summed */
#define QK_MADD_ADD(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#else
#define QK_MADD_ADD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif

static inline __attribute__((always_inline)) void qk8_rows_avx2(
    const uint8_t *w, int64_t row_bytes, const int qt, int K, const int8_t *xq, const float *xd, const int16_t *bsum,
    const float *xsum, float *out, int64_t os, int n, const int R) {
    const int nsb = K / 256, bb = q_block_bytes(qt);
    const uint8_t *row = w + (int64_t)n * row_bytes;
    __m256 acc[QK256_ROWS], moff[QK256_ROWS];
    for (int r = 0; r < R; r++) acc[r] = moff[r] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = row + (int64_t)sb * bb;
        if (sb + 1 < nsb) qk_prefetch(blk + bb, bb);
        __m256i isum[QK256_ROWS][2];
        for (int r = 0; r < R; r++) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
        float d;
        if (qt == QT_Q6_K) {
            d = half_to_float(blk + 208);
            const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
            const __m256i sc16 = _mm256_cvtepi8_epi16(sc);
            for (int r = 0; r < R; r++)  /* -32 * sum of sc * (group's code sum): the codes' offset */
                isum[r][1] = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(bsum + (int64_t)r * (K / 16) + 16 * sb))), 5);
            for (int half = 0; half < 2; half++) {
                __m256i q[4];
                qk6_codes(blk, half, q);
                for (int k = 0; k < 4; k++) {  /* weights 128 half + 32 k..: groups g, g + 1 in the two 128-bit lanes */
                    const int g = 8 * half + 2 * k;
                    const __m256i scl = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, _mm_set_epi64x(0x0101010101010101LL * (g + 1), 0x0101010101010101LL * g)));
                    for (int r = 0; r < R; r++) {
                        const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *)(xq + (int64_t)r * K + sb * 256 + 32 * g / 2)));
                        isum[r][0] = QK_MADD_ADD(isum[r][0], p, scl);
                    }
                }
            }
            for (int r = 0; r < R; r++) isum[r][0] = _mm256_sub_epi32(isum[r][0], isum[r][1]);
        } else {
            d = half_to_float(blk);
            const float dmin = half_to_float(blk + 2);
            uint32_t sc[2], mn[2];
            qk_scale_min_words(blk, sc, mn);
            const __m256i scw = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_setr_epi32((int)sc[0], (int)sc[1], 0, 0)));
            const __m256 m8 = qk_mins8(dmin, mn);
            for (int r = 0; r < R; r++) moff[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xsum + (int64_t)r * (K / 32) + 8 * sb), moff[r]);
            for (int c = 0; c < 4; c++) {  /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
                __m256i lo, hi;
                qk45_codes(blk, qt, c, &lo, &hi);
                const __m256i slo = _mm256_shuffle_epi8(scw, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * c))));
                const __m256i shi = _mm256_shuffle_epi8(scw, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * c + 1))));
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xq + (int64_t)r * K + sb * 256 + 64 * c;
                    isum[r][0] = QK_MADD_ADD(isum[r][0], _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr)), slo);
                    isum[r][1] = QK_MADD_ADD(isum[r][1], _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 32))), shi);
                }
            }
            for (int r = 0; r < R; r++) isum[r][0] = _mm256_add_epi32(isum[r][0], isum[r][1]);
        }
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][0]), _mm256_set1_ps(d * xd[r * nsb + sb]), acc[r]);
    }
    for (int r = 0; r < R; r++) out[r * os + n] = hsum8(_mm256_add_ps(acc[r], moff[r]));
}

/* The int16 kind (ACT_INT16): activations int16 with a scale per 256 (qk256_activations), codes
 * widened to int16 and multiplied by their sub-block's (Q6_K: group's) integer scale (|sc * code|
 * <= 63 * 31 for Q4_K / Q5_K, 128 * 32 for Q6_K's signed q - 32: fits int16), then pairs with x
 * (madd_epi16 / vpdpwssd) into two int32 accumulators a super-block, each lane the sum of at
 * most 16 products (<= 16 * 4096 * 32767 < 2^31), each converted to float once, times d * xd. */
static inline __attribute__((always_inline)) void qk16_rows_avx2(
    const uint8_t *w, int64_t row_bytes, const int qt, int K, const int16_t *xq, const float *xd, const float *xsum, float *out,
    int64_t os, int n, const int R) {
    const int nsb = K / 256, bb = q_block_bytes(qt);
    const uint8_t *row = w + (int64_t)n * row_bytes;
    __m256 acc[QK256_ROWS], moff[QK256_ROWS];
    for (int r = 0; r < R; r++) acc[r] = moff[r] = _mm256_setzero_ps();
    int16_t scw[16] __attribute__((aligned(32)));  /* the super-block's integer scales */
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = row + (int64_t)sb * bb;
        if (sb + 1 < nsb) qk_prefetch(blk + bb, bb);
        __m256i isum[QK256_ROWS][2];
        for (int r = 0; r < R; r++) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
        __m256i q[8];  /* 32 codes each, as bytes: Q6_K groups 2i, 2i + 1; Q4_K / Q5_K sub-block i */
        float d;
        if (qt == QT_Q6_K) {
            d = half_to_float(blk + 208);
            _mm256_store_si256((__m256i *)scw, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))));
            qk6_codes(blk, 0, q);
            qk6_codes(blk, 1, q + 4);
            for (int i = 0; i < 8; i++) q[i] = _mm256_sub_epi8(q[i], _mm256_set1_epi8(32));
        } else {
            d = half_to_float(blk);
            uint32_t sc[2], mn[2];
            qk_scale_min_words(blk, sc, mn);
            _mm_store_si128((__m128i *)scw, _mm_cvtepu8_epi16(_mm_setr_epi32((int)sc[0], (int)sc[1], 0, 0)));
            const __m256 m8 = qk_mins8(half_to_float(blk + 2), mn);
            for (int r = 0; r < R; r++) moff[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xsum + (int64_t)r * (K / 32) + 8 * sb), moff[r]);
            for (int c = 0; c < 4; c++) qk45_codes(blk, qt, c, q + 2 * c, q + 2 * c + 1);
        }
        for (int i = 0; i < 8; i++) {  /* weights 32i..32i + 31: two vectors of 16 */
            const __m128i lo = _mm256_castsi256_si128(q[i]), hi = _mm256_extracti128_si256(q[i], 1);
            const __m256i s0 = _mm256_set1_epi16(scw[qt == QT_Q6_K ? 2 * i : i]), s1 = _mm256_set1_epi16(scw[qt == QT_Q6_K ? 2 * i + 1 : i]);
            const __m256i c0 = _mm256_mullo_epi16(qt == QT_Q6_K ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo), s0);
            const __m256i c1 = _mm256_mullo_epi16(qt == QT_Q6_K ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi), s1);
            for (int r = 0; r < R; r++) {
                const int16_t *xr = xq + (int64_t)r * K + sb * 256 + 32 * i;
                isum[r][i >> 2] = QK_MADD_ADD(isum[r][i >> 2], c0, _mm256_loadu_si256((const __m256i *)xr));
                isum[r][i >> 2] = QK_MADD_ADD(isum[r][i >> 2], c1, _mm256_loadu_si256((const __m256i *)(xr + 16)));
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256 dd = _mm256_set1_ps(d * xd[r * nsb + sb]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][0]), dd, acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][1]), dd, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * os + n] = hsum8(_mm256_add_ps(acc[r], moff[r]));
}


#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* qk16_rows_avx2 sixteen lanes wide (the avx512 variant): a sub-block's 32 codes widened in one
 * vpmovzxbw / vpmovsxbw, times their scale (Q6_K: the two groups' scales, words 0..15 and 16..31,
 * by vpermw), into vpdpwssd; each lane of the two int32 accumulators sums at most 8 products a
 * super-block (<= 8 * 4096 * 32767 < 2^31). The same integers, another float summation order. */
static inline __attribute__((always_inline)) void qk16_rows_512(
    const uint8_t *w, int64_t row_bytes, const int qt, int K, const int16_t *xq, const float *xd, const float *xsum, float *out,
    int64_t os, int n, const int R) {
    const int nsb = K / 256, bb = q_block_bytes(qt);
    const uint8_t *row = w + (int64_t)n * row_bytes;
    __m512 acc[QK256_ROWS];
    __m256 moff[QK256_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); moff[r] = _mm256_setzero_ps(); }
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = row + (int64_t)sb * bb;
        if (sb + 1 < nsb) qk_prefetch(blk + bb, bb);
        __m512i isum[QK256_ROWS][2], scz;
        for (int r = 0; r < R; r++) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
        __m512i c[8];  /* weights 32i..32i + 31 as int16 codes (Q6_K: q - 32) */
        float d;
        const __m512i low4 = _mm512_set1_epi16(15), one = _mm512_set1_epi16(1);
        if (qt == QT_Q6_K) {
            d = half_to_float(blk + 208);
            scz = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))));
            for (int half = 0; half < 2; half++) {  /* spelled in bytes, then widened */
                __m256i q[4];
                qk6_codes(blk, half, q);
                for (int k = 0; k < 4; k++) c[4 * half + k] = _mm512_cvtepi8_epi16(_mm256_sub_epi8(q[k], _mm256_set1_epi8(32)));
            }
        } else {
            d = half_to_float(blk);
            uint32_t sc[2], mn[2];
            qk_scale_min_words(blk, sc, mn);
            scz = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_setr_epi32((int)sc[0], (int)sc[1], 0, 0)));
            const __m256 m8 = qk_mins8(half_to_float(blk + 2), mn);
            for (int r = 0; r < R; r++) moff[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xsum + (int64_t)r * (K / 32) + 8 * sb), moff[r]);
            const __m512i qh = qt == QT_Q5_K ? _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16))) : _mm512_setzero_si512();
            const uint8_t *qs = blk + (qt == QT_Q5_K ? 48 : 16);
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * k)));
                c[2 * k] = _mm512_and_si512(v, low4);
                c[2 * k + 1] = _mm512_srli_epi16(v, 4);
                if (qt == QT_Q5_K) {
                    c[2 * k] = _mm512_or_si512(c[2 * k], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * k), one), 4));
                    c[2 * k + 1] = _mm512_or_si512(c[2 * k + 1], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * k + 1), one), 4));
                }
            }
        }
        for (int i = 0; i < 8; i++) {  /* weights 32i..32i + 31 */
            /* words 0..15 take scale word 2i (Q6_K) or i, words 16..31 word 2i + 1 or i */
            const __m512i idx = qt == QT_Q6_K ? _mm512_mask_set1_epi16(_mm512_set1_epi16((short)(2 * i)), 0xFFFF0000u, (short)(2 * i + 1)) : _mm512_set1_epi16((short)i);
            const __m512i cs = _mm512_mullo_epi16(c[i], _mm512_permutexvar_epi16(idx, scz));
            for (int r = 0; r < R; r++)
                isum[r][i & 1] = _mm512_dpwssd_epi32(isum[r][i & 1], cs, _mm512_loadu_si512((const void *)(xq + (int64_t)r * K + sb * 256 + 32 * i)));
        }
        for (int r = 0; r < R; r++) {
            const __m512 dd = _mm512_set1_ps(d * xd[r * nsb + sb]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][0]), dd, acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][1]), dd, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * os + n] = _mm512_reduce_add_ps(acc[r]) + hsum8(moff[r]);
}
#define qk16_rows qk16_rows_512
#else
#define qk16_rows qk16_rows_avx2
#endif

/* Weight row n at R = M rows of either kind (i16), qt and R constants (the compiler specialises each). */
static void qk256_row(const uint8_t *w, int64_t row_bytes, int qt, int K, const void *xq, int i16, const float *xd,
                      const int16_t *bsum, const float *xsum, float *out, int64_t os, int n, int M) {
#define QK_CASE(T, R)                                                                                              \
    case T * 8 + R:                                                                                                \
        if (i16) qk16_rows(w, row_bytes, T, K, (const int16_t *)xq, xd, xsum, out, os, n, R);                     \
        else qk8_rows_avx2(w, row_bytes, T, K, (const int8_t *)xq, xd, bsum, xsum, out, os, n, R);                 \
        break
    switch (qt * 8 + M) {
        QK_CASE(QT_Q4_K, 1); QK_CASE(QT_Q4_K, 2); QK_CASE(QT_Q4_K, 3); QK_CASE(QT_Q4_K, 4);
        QK_CASE(QT_Q5_K, 1); QK_CASE(QT_Q5_K, 2); QK_CASE(QT_Q5_K, 3); QK_CASE(QT_Q5_K, 4);
        QK_CASE(QT_Q6_K, 1); QK_CASE(QT_Q6_K, 2); QK_CASE(QT_Q6_K, 3);
        default: QK_CASE(QT_Q6_K, 4);
    }
#undef QK_CASE
}

/* One weight row of a K-quant through the direct path at M rows: int16 activations per 32 above
 * QK256_ROWS rows (fewer, and int8 activations, take qk256_matmul), else float. */
static void qk_direct_row(const uint8_t *w, int64_t row_bytes, int qt, int K, const float *x, int64_t xs, const int16_t *xq,
                          const float *dx, const float *xsum, float *out, int64_t os, int n, int M, int activations) {
    if (activations == ACT_INT16) {
        switch (M) {
            case 5: qk_direct_int(w, row_bytes, qt, K, xq, dx, xsum, out, os, n, 5); break;
            case 6: qk_direct_int(w, row_bytes, qt, K, xq, dx, xsum, out, os, n, 6); break;
            default: qk_direct_int(w, row_bytes, qt, K, xq, dx, xsum, out, os, n, 7); break;
        }
    } else {
        switch (M) {
            case 1: qk_direct_f32(w, row_bytes, qt, K, x, xs, out, os, n, 1); break;
            case 2: qk_direct_f32(w, row_bytes, qt, K, x, xs, out, os, n, 2); break;
            case 3: qk_direct_f32(w, row_bytes, qt, K, x, xs, out, os, n, 3); break;
            default: qk_direct_f32(w, row_bytes, qt, K, x, xs, out, os, n, 4); break;
        }
    }
}

/* Tiled path (M > Q_DIRECT_ROWS): x transposed once per call into xt (K, Mp),
 * Mp = M rounded up to 8 (zero rows), so that a (6 rows of W) x (16 rows of x) block is 12
 * accumulators fed by one broadcast weight and two vectors of x per k: no horizontal sums and
 * 8 loads per 12 FMAs (V = 2; a last block of at most 8 rows of x runs V = 1).
 * res[r][j] = W row r . x row m0 + j. */
static inline __attribute__((always_inline)) void dot_6xV(const float *const w[6], const float *xt, int64_t xts, int k0, int k1,
                                                          float res[6][16], const int V, int64_t ahead) {
    __m256 c[6][2];
    for (int r = 0; r < 6; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
    for (int k = k0; k < k1; k++) {
        if (ahead && k % 16 == 0)  /* the rows `ahead` floats on (the next tile's) into L2, a line at a time */
            for (int r = 0; r < 6; r++) _mm_prefetch((const char *)(w[r] + ahead + k), _MM_HINT_T1);
        const __m256 b0 = _mm256_load_ps(xt + k * xts), b1 = V == 2 ? _mm256_load_ps(xt + k * xts + 8) : b0;
        for (int r = 0; r < 6; r++) {
            const __m256 a = _mm256_broadcast_ss(w[r] + k);
            c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
            if (V == 2) c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
        }
    }
    for (int r = 0; r < 6; r++) {  /* res += this range's sums */
        _mm256_storeu_ps(res[r], _mm256_add_ps(_mm256_loadu_ps(res[r]), c[r][0]));
        if (V == 2) _mm256_storeu_ps(res[r] + 8, _mm256_add_ps(_mm256_loadu_ps(res[r] + 8), c[r][1]));
    }
}

/* One tile of the tiled path, AVX2: nt (<= Q_TILE) weight rows (K apart) times every row of x
 * (xt, transposed, Mp apart): blocks of 16 rows of x, K chunks of Q_KC, 6-row register blocks;
 * during the first block of x the rows `ahead` floats on (0: none) are prefetched into L2. */
static __attribute__((unused)) void tile_avx2(const float *tile, int nt, int K, const float *xt, int Mp, int M, float *out, int64_t os,
                                              int64_t ahead) {
    for (int m0 = 0; m0 < M; m0 += 16) {
        const int mr = M - m0 < 16 ? M - m0 : 16;
        float res[Q_TILE / 6][6][16];
        memset(res, 0, sizeof res);
        for (int k0 = 0; k0 < K; k0 += Q_KC) {  /* a K chunk of x stays in L1 across the tile's row blocks */
            const int k1 = K - k0 < Q_KC ? K : k0 + Q_KC;
            for (int j = 0; j < nt; j += 6) {
                const int nr = nt - j < 6 ? nt - j : 6;
                const float *wr[6];
                for (int c = 0; c < 6; c++) wr[c] = tile + (int64_t)(j + (c < nr ? c : 0)) * K;  /* tails repeat row 0 */
                if (mr > 8) dot_6xV(wr, xt + m0, Mp, k0, k1, res[j / 6], 2, m0 ? 0 : ahead);
                else dot_6xV(wr, xt + m0, Mp, k0, k1, res[j / 6], 1, m0 ? 0 : ahead);
            }
        }
        for (int j = 0; j < nt; j += 6) {
            const int nr = nt - j < 6 ? nt - j : 6;
            for (int r = 0; r < mr; r++)
                for (int c = 0; c < nr; c++) out[(int64_t)(m0 + r) * os + j + c] = res[j / 6][c][r];
        }
    }
}

#ifdef __AVX512F__
/* The AVX-512 form: 32 registers hold a 12-row x 32-column block (24 accumulators, two vectors of
 * x, the weight broadcast folded into the FMA's memory operand), over the whole of K at once (x,
 * at most Mp * K floats, stays in L2; the weight rows stream once): 2 vector loads and 12
 * broadcasts per 24 FMAs, no partial sums stored and reloaded. While it works on its 12 rows it
 * prefetches the next 12 into L2 (12 streams at once defeat the hardware prefetcher: the LM head,
 * 49152 x 576 at 32 rows, one thread, went from 25 to 20 ms, oneDNN's packed fp32 taking 20-24). */
#define F_R 12
#define F_TILE 48  /* weight rows a thread task takes (a multiple of F_R) */
static inline __attribute__((always_inline)) void dot_12xV(const float *const w[F_R], const float *xt, int64_t xts, int K,
                                                           float res[F_R][32], const int V) {
    __m512 c[F_R][2];
    for (int r = 0; r < F_R; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
    for (int k0 = 0; k0 < K; k0 += 16) {
        for (int r = 0; r < F_R; r++) _mm_prefetch((const char *)(w[r] + (int64_t)F_R * K + k0), _MM_HINT_T1);  /* the next block's rows */
        const int k1 = K - k0 < 16 ? K : k0 + 16;
        for (int k = k0; k < k1; k++) {
            const __m512 b0 = _mm512_load_ps(xt + k * xts), b1 = V == 2 ? _mm512_load_ps(xt + k * xts + 16) : b0;
            for (int r = 0; r < F_R; r++) {
                const __m512 a = _mm512_set1_ps(w[r][k]);
                c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
                if (V == 2) c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
            }
        }
    }
    for (int r = 0; r < F_R; r++) {
        _mm512_storeu_ps(res[r], c[r][0]);
        if (V == 2) _mm512_storeu_ps(res[r] + 16, c[r][1]);
    }
}

static void tile_avx512(const float *tile, int nt, int K, const float *xt, int Mp, int M, float *out, int64_t os, int64_t ahead) {
    (void)ahead;  /* (dot_12xV prefetches its next 12 rows itself) */
    for (int m0 = 0; m0 < M; m0 += 32) {
        const int mr = M - m0 < 32 ? M - m0 : 32;
        for (int j = 0; j < nt; j += F_R) {
            const int nr = nt - j < F_R ? nt - j : F_R;
            const float *wr[F_R];
            float res[F_R][32];
            for (int c = 0; c < F_R; c++) wr[c] = tile + (int64_t)(j + (c < nr ? c : 0)) * K;  /* tails repeat row 0 */
            if (mr > 16) dot_12xV(wr, xt + m0, Mp, K, res, 2);
            else dot_12xV(wr, xt + m0, Mp, K, res, 1);
            for (int r = 0; r < mr; r++)
                for (int c = 0; c < nr; c++) out[(int64_t)(m0 + r) * os + j + c] = res[c][r];
        }
    }
}
#define T_ROWS F_TILE
#define T_PAD 15  /* x's rows padded to a multiple of 16 */
#define tile_gemm tile_avx512
#else
#define T_ROWS Q_TILE
#define T_PAD 7
#define tile_gemm tile_avx2
#endif

/* The tiled path: out (M, N) = x (M, K) @ W^T for W given as float32 rows (wf, K apart: read in
 * place) or as quantized rows (w, dequantised a tile of T_ROWS rows at a time into a per-thread
 * scratch). Returns nonzero if memory could not be allocated. */
static int tiled_matmul(const float *x, int64_t xs, int M, int N, int K, float *out, int64_t os,
                        const float *wf, const uint8_t *w, int64_t row_bytes, int qt) {
    const int tiles = (N + T_ROWS - 1) / T_ROWS, nb = K / 32;
    int failed = 0;
    const int Mp = (M + T_PAD) & ~T_PAD;
    float *xt = (float *)aligned_alloc(64, (size_t)K * Mp * sizeof(float));
    if (!xt) return 1;
    for (int k = 0; k < K; k++) {
        for (int m = 0; m < M; m++) xt[(int64_t)k * Mp + m] = x[(int64_t)m * xs + k];
        for (int m = M; m < Mp; m++) xt[(int64_t)k * Mp + m] = 0.0f;
    }
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int t = 0; t < tiles; t++) {
        const int n0 = t * T_ROWS, nt = N - n0 < T_ROWS ? N - n0 : T_ROWS;
        const float *tile = wf ? wf + (int64_t)n0 * K : q_scratch((size_t)T_ROWS * K);
        if (!tile) { failed = 1; continue; }
        if (!wf)
            for (int i = 0; i < nt; i++) {
                if (q_is_k(qt)) {
                    q_row_dequant(w + (int64_t)(n0 + i) * row_bytes, qt, K, (float *)tile + (int64_t)i * K);
                    continue;
                }
                for (int b = 0; b < nb; b++)
                    q_block_dequant8(w + (int64_t)(n0 + i) * row_bytes + (int64_t)b * q_block_bytes(qt), qt, (float *)tile + (int64_t)i * K + b * 32);
            }
        tile_gemm(tile, nt, K, xt, Mp, M, out + n0, os, wf ? (int64_t)T_ROWS * K : 0);  /* float rows in place: prefetch the next tile's */
    }
    free(xt);
    return failed;
}

/* out (M, N, row stride os) = x (M, K, row stride xs) @ W^T for a float32 W (N, K), contiguous
 * rows: the tiled kernel without the dequantising (float weights of batched decode steps; the
 * float twin is F.linear up to summation order). Returns 1 if memory could not be allocated, 2
 * where the kernel is not built (no AVX2: callers use F.linear). */
int pd_f_matmul(const float *x, int64_t xs, const float *wf, int M, int N, int K, float *out, int64_t os) {
    if (M <= 0) return 0;  /* (and how a caller asks whether the kernel is built) */
    return tiled_matmul(x, xs, M, N, K, out, os, wf, NULL, 0, 0);
}
#else
int pd_f_matmul(const float *x, int64_t xs, const float *wf, int M, int N, int K, float *out, int64_t os) {
    (void)x; (void)xs; (void)wf; (void)M; (void)N; (void)K; (void)out; (void)os;
    return 2;
}
#endif

#ifndef __AVX2__
/* The integer paths' activations in plain C: per 32-wide block, codes round(x * limit / max|x|)
 * (to nearest even, as cvtps_epi32), the scale max|x| / limit and the block's float sum. */
static void q_scalar_activations(const float *x, int64_t xs, int M, int K, float limit, int32_t *xq, float *dx, float *xsum) {
    const int nb = K / 32;
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            const float *src = x + r * xs + b * 32;
            float mx = 0.0f, sum = 0.0f;
            for (int j = 0; j < 32; j++) {
                mx = fmaxf(mx, fabsf(src[j]));
                sum += src[j];
            }
            const float inv = mx > 0.0f ? limit / mx : 0.0f;
            dx[r * nb + b] = mx / limit;
            xsum[r * nb + b] = sum;
            for (int j = 0; j < 32; j++) xq[(int64_t)r * K + b * 32 + j] = (int32_t)nearbyintf(src[j] * inv);
        }
}

/* One weight row times one row of integer activations: sum over blocks of d * dx * (q . xq) + m * sum(x)
 * (K-quants: over their sub-blocks, qk_unpack's scales and offsets; Q6_K's per half). */
static float q_scalar_row_int(const uint8_t *row, int qt, int nb, const int32_t *xq, const float *dx, const float *xsum) {
    const int bb = q_block_bytes(qt);
    float acc = 0.0f, moff = 0.0f;
    if (q_is_k(qt)) {
        for (int sb = 0; sb < nb / 8; sb++) {
            int16_t c[256];
            float s[16], m[8];
            qk_unpack(row + (int64_t)sb * bb, qt, c, s, m);
            for (int i = 0; i < 8; i++) {
                const int b = 8 * sb + i;
                int32_t dot[2] = {0, 0};
                for (int j = 0; j < 32; j++) dot[j >> 4] += c[32 * i + j] * xq[b * 32 + j];
                if (qt == QT_Q6_K) {
                    acc += (float)dot[0] * (s[2 * i] * dx[b]) + (float)dot[1] * (s[2 * i + 1] * dx[b]);
                } else {
                    acc += (float)(dot[0] + dot[1]) * (s[i] * dx[b]);
                    moff += m[i] * xsum[b];
                }
            }
        }
        return acc + moff;
    }
    for (int b = 0; b < nb; b++) {
        float d, m;
        const uint8_t *q = q_block_head(row + (int64_t)b * bb, qt, &d, &m);
        const int32_t *xb = xq + b * 32;
        int32_t dot = 0;
        for (int j = 0; j < 32; j++) dot += q_code(q, qt, j) * xb[j];
        acc += (float)dot * (d * dx[b]);
        moff += m * xsum[b];
    }
    return acc + moff;
}
/* qk8_rows_avx2 / qk16_rows_avx2 in plain C (the baseline variant), one weight row times one row
 * of per-256 activations (int8, or int16 where i16): per super-block d * xd * sum over sub-blocks
 * (Q6_K: groups of 16) of sc * (codes . xq), Q6_K's codes taken signed (q - 32, qk_unpack) so that
 * no code sums are needed, plus m * sum(x). */
static float qk256_row_scalar(const uint8_t *row, int qt, int K, const void *xq, int i16, const float *xd, const float *xsum) {
    const int bb = q_block_bytes(qt), groups = qt == QT_Q6_K ? 16 : 8, len = 256 / groups;
    float acc = 0.0f, moff = 0.0f;
    for (int sb = 0; sb < K / 256; sb++) {
        const uint8_t *blk = row + (int64_t)sb * bb;
        int16_t c[256];
        float s[16], m[8] = {0};
        qk_unpack(blk, qt, c, s, m);
        int64_t isum = 0;
        for (int g = 0; g < groups; g++) {
            int sc = 0, mn = 0;
            if (qt == QT_Q6_K) sc = (int8_t)blk[192 + g];
            else qk_scale_min(blk + 4, g, &sc, &mn);
            int64_t dot = 0;
            for (int j = sb * 256 + len * g; j < sb * 256 + len * (g + 1); j++)
                dot += c[j - sb * 256] * (i16 ? ((const int16_t *)xq)[j] : ((const int8_t *)xq)[j]);
            isum += sc * dot;
        }
        acc += (float)isum * (half_to_float(blk + (qt == QT_Q6_K ? 208 : 0)) * xd[sb]);
        if (qt != QT_Q6_K)
            for (int b = 0; b < 8; b++) moff += m[b] * xsum[8 * sb + b];
    }
    return acc + moff;
}
#endif

/* Activations for the K-quants' few-row path: each row's 256-wide super-blocks as codes xq (int8,
 * or int16 where i16; x ~ xd * xq, xd = max|x| / 127 (32767) of the super-block, rounded to nearest
 * even), the super-block's scale xd, the float sums of each 32 x (xsum: the Q4_K / Q5_K mins term,
 * taken on x itself) and, int8, the sums of each 16 codes (bsum: Q6_K's offset of 32 in
 * integers). AVX2: eight lanes at a time (the same codes: cvtps_epi32 rounds to nearest even as
 * nearbyintf does; the float sums in another order). */
static void qk256_activations(const float *x, int64_t xs, int M, int K, int i16, void *xq, float *xd, int16_t *bsum, float *xsum) {
    const float limit = i16 ? 32767.0f : 127.0f;
    for (int r = 0; r < M; r++)
        for (int sb = 0; sb < K / 256; sb++) {
            const float *src = x + r * xs + sb * 256;
            const int64_t at = (int64_t)r * K + sb * 256;
            float *sums = xsum + (int64_t)r * (K / 32) + 8 * sb;
            int16_t *bs = bsum + (int64_t)r * (K / 16) + 16 * sb;
#ifdef __AVX2__
            __m256 amax = _mm256_setzero_ps();
            for (int j = 0; j < 256; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(src + j)));
            __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            a = _mm_max_ps(a, _mm_movehl_ps(a, a));
            const float mx = _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
#else
            float mx = 0.0f;
            for (int j = 0; j < 256; j++) mx = mx > fabsf(src[j]) ? mx : fabsf(src[j]);
#endif
            const float inv = mx > 0.0f ? limit / mx : 0.0f;
            xd[r * (K / 256) + sb] = mx / limit;
#ifdef __AVX2__
            const __m256 idv = _mm256_set1_ps(inv);
            for (int g = 0; g < 16; g++) {  /* 16 codes a step */
                const __m256 v0 = _mm256_loadu_ps(src + 16 * g), v1 = _mm256_loadu_ps(src + 16 * g + 8);
                const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, idv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, idv));
                const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);  /* in order */
                if (i16) {
                    _mm256_storeu_si256((__m256i *)((int16_t *)xq + at + 16 * g), p16);
                } else {
                    const __m256i p8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(p16, p16), 0x08);
                    _mm_storeu_si128((__m128i *)((int8_t *)xq + at + 16 * g), _mm256_castsi256_si128(p8));
                    const __m256i t = _mm256_add_epi32(i0, i1);
                    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
                    u = _mm_add_epi32(u, _mm_unpackhi_epi64(u, u));
                    bs[g] = (int16_t)(_mm_cvtsi128_si32(u) + _mm_extract_epi32(u, 1));
                }
                if (g & 1) {
                    const __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(src + 16 * g - 16), _mm256_loadu_ps(src + 16 * g - 8)), _mm256_add_ps(v0, v1));
                    sums[g >> 1] = hsum8(t);
                }
            }
#else
            if (i16) {
                for (int j = 0; j < 256; j++) ((int16_t *)xq)[at + j] = (int16_t)nearbyintf(src[j] * inv);
            } else {
                int8_t *q = (int8_t *)xq + at;
                for (int j = 0; j < 256; j++) q[j] = (int8_t)nearbyintf(src[j] * inv);
                for (int g = 0; g < 16; g++) {
                    int s = 0;
                    for (int j = 0; j < 16; j++) s += q[16 * g + j];
                    bs[g] = (int16_t)s;
                }
            }
            for (int b = 0; b < 8; b++) {
                float s = 0.0f;
                for (int j = 0; j < 32; j++) s += src[32 * b + j];
                sums[b] = s;
            }
#endif
        }
}

/* out (M <= QK256_ROWS, N) = x @ W^T for a K-quant W with per-256 activations (qk256_activations;
 * int16 where i16, else int8). Returns 1 if memory could not be allocated. */
static int qk256_matmul(const float *x, int64_t xs, const uint8_t *w, int64_t row_bytes, int qt, int M, int N, int K, float *out,
                        int64_t os, int i16) {
    /* codes, then the super-block scales, the float sums of 32 and the code sums of 16: one allocation */
    const size_t code_bytes = (size_t)M * K * (i16 ? 2 : 1);
    int8_t *xq = (int8_t *)malloc(code_bytes + sizeof(float) * M * (K / 256 + K / 32) + sizeof(int16_t) * M * (K / 16));
    if (!xq) return 1;
    float *xd = (float *)(xq + code_bytes), *xsum = xd + M * (K / 256);  /* K is a multiple of 256 */
    int16_t *bsum = (int16_t *)(xsum + M * (K / 32));
    qk256_activations(x, xs, M, K, i16, xq, xd, bsum, xsum);
#pragma omp parallel for schedule(static) if (N > 8)
    for (int n = 0; n < N; n++) {
#ifdef __AVX2__
        qk256_row(w, row_bytes, qt, K, xq, i16, xd, bsum, xsum, out, os, n, M);
#else
        const uint8_t *row = w + (int64_t)n * row_bytes;
        for (int r = 0; r < M; r++)
            out[r * os + n] = qk256_row_scalar(row, qt, K, xq + (int64_t)r * K * (i16 ? 2 : 1), i16, xd + r * (K / 256), xsum + r * (K / 32));
#endif
    }
    free(xq);
    return 0;
}

/* out (M, N, row stride os) = x (M, K, row stride xs) @ W^T. Returns nonzero if scratch could
 * not be allocated. K is a multiple of 32. */
int pd_q_matmul(const float *x, int64_t xs, const uint8_t *w, int64_t row_bytes, int qt, int M, int N, int K,
                float *out, int64_t os, int activations) {
    const int nb = K / 32;
    if (q_is_k(qt) && activations != ACT_FLOAT && M <= QK256_ROWS)
        return qk256_matmul(x, xs, w, row_bytes, qt, M, N, K, out, os, activations == ACT_INT16);
#ifdef __AVX2__
    if (M <= Q_DIRECT_ROWS || (activations == ACT_INT16 && M <= Q_DIRECT_INT16_ROWS)) {
        /* codes (int8: 1 byte each, int16: 2), block scales, block sums: one allocation */
        const size_t code_bytes = (size_t)M * K * (activations == ACT_INT16 ? 2 : 1);
        int8_t *xq = (int8_t *)malloc(code_bytes + 2 * sizeof(float) * M * nb);
        if (!xq) return 1;
        int16_t *xq16 = (int16_t *)xq;
        float *dx = (float *)(xq + code_bytes), *xsum = dx + M * nb;  /* M * K is a multiple of 32 */
        if (activations == ACT_INT8) {
            q8_activations(x, xs, M, K, xq, dx, xsum);
        } else if (activations == ACT_INT16) {
            q16_activations(x, xs, M, K, xq16, dx, xsum);
        } else {
            for (int r = 0; r < M; r++)
                for (int b = 0; b < nb; b++) {
                    __m256 v = _mm256_loadu_ps(x + r * xs + b * 32);
                    for (int j = 1; j < 4; j++) v = _mm256_add_ps(v, _mm256_loadu_ps(x + r * xs + b * 32 + 8 * j));
                    xsum[r * nb + b] = hsum8(v);
                }
        }
        /* int16, one or two rows: groups of 8 weight rows (q_direct8_i16); the last N % 8 weight
         * rows, and 3 or more rows of x, one weight row at a time below */
#ifdef __F16C__
        const int n8 = activations == ACT_INT16 && M <= Q_DIRECT8_ROWS && !q_is_k(qt) ? N / 8 * 8 : 0;
#pragma omp parallel for schedule(static)
        for (int g = 0; g < n8; g += 8) {
            switch (qt * 2 + M) {  /* constant qt and R: the compiler specialises each */
                case QT_Q4_1 * 2 + 1: q_direct8_i16(w, row_bytes, QT_Q4_1, K, xq16, dx, xsum, out, os, g, 1); break;
                case QT_Q4_1 * 2 + 2: q_direct8_i16(w, row_bytes, QT_Q4_1, K, xq16, dx, xsum, out, os, g, 2); break;
                case QT_Q4_0 * 2 + 1: q_direct8_i16(w, row_bytes, QT_Q4_0, K, xq16, dx, xsum, out, os, g, 1); break;
                case QT_Q4_0 * 2 + 2: q_direct8_i16(w, row_bytes, QT_Q4_0, K, xq16, dx, xsum, out, os, g, 2); break;
                case QT_Q5_0 * 2 + 1: q_direct8_i16(w, row_bytes, QT_Q5_0, K, xq16, dx, xsum, out, os, g, 1); break;
                case QT_Q5_0 * 2 + 2: q_direct8_i16(w, row_bytes, QT_Q5_0, K, xq16, dx, xsum, out, os, g, 2); break;
                case QT_Q5_1 * 2 + 1: q_direct8_i16(w, row_bytes, QT_Q5_1, K, xq16, dx, xsum, out, os, g, 1); break;
                case QT_Q5_1 * 2 + 2: q_direct8_i16(w, row_bytes, QT_Q5_1, K, xq16, dx, xsum, out, os, g, 2); break;
                case QT_Q8_0 * 2 + 1: q_direct8_i16(w, row_bytes, QT_Q8_0, K, xq16, dx, xsum, out, os, g, 1); break;
                default: q_direct8_i16(w, row_bytes, QT_Q8_0, K, xq16, dx, xsum, out, os, g, 2); break;
            }
        }
#else
        const int n8 = 0;
#endif
        if (n8 < N)  /* (every row in groups of 8: no second parallel region in the decode step) */
#pragma omp parallel for schedule(static) if (N - n8 > 8)
        for (int n = n8; n < N; n++) {
            if (q_is_k(qt)) {
                qk_direct_row(w, row_bytes, qt, K, x, xs, xq16, dx, xsum, out, os, n, M, activations);
            } else if (activations == ACT_INT16) {
                switch (M) {
                    case 1: q_direct_i16(w, row_bytes, qt, K, xq16, dx, xsum, out, os, n, 1); break;
                    case 2: q_direct_i16(w, row_bytes, qt, K, xq16, dx, xsum, out, os, n, 2); break;
                    case 3: q_direct_i16(w, row_bytes, qt, K, xq16, dx, xsum, out, os, n, 3); break;
                    case 4: q_direct_i16(w, row_bytes, qt, K, xq16, dx, xsum, out, os, n, 4); break;
                    case 5: q_direct_i16(w, row_bytes, qt, K, xq16, dx, xsum, out, os, n, 5); break;
                    case 6: q_direct_i16(w, row_bytes, qt, K, xq16, dx, xsum, out, os, n, 6); break;
                    default: q_direct_i16(w, row_bytes, qt, K, xq16, dx, xsum, out, os, n, 7); break;
                }
            } else if (activations == ACT_INT8) {
                switch (M) {
                    case 1: q_direct_i8(w, row_bytes, qt, K, xq, dx, xsum, out, os, n, 1); break;
                    case 2: q_direct_i8(w, row_bytes, qt, K, xq, dx, xsum, out, os, n, 2); break;
                    case 3: q_direct_i8(w, row_bytes, qt, K, xq, dx, xsum, out, os, n, 3); break;
                    default: q_direct_i8(w, row_bytes, qt, K, xq, dx, xsum, out, os, n, 4); break;
                }
            } else {
                switch (M) {
                    case 1: q_direct_f32(w, row_bytes, qt, K, x, xs, xsum, out, os, n, 1); break;
                    case 2: q_direct_f32(w, row_bytes, qt, K, x, xs, xsum, out, os, n, 2); break;
                    case 3: q_direct_f32(w, row_bytes, qt, K, x, xs, xsum, out, os, n, 3); break;
                    default: q_direct_f32(w, row_bytes, qt, K, x, xs, xsum, out, os, n, 4); break;
                }
            }
        }
        free(xq);
        return 0;
    }
    if (activations == ACT_INT16) return q_gemm(x, xs, w, row_bytes, qt, M, N, K, out, os, 0);
    return tiled_matmul(x, xs, M, N, K, out, os, NULL, w, row_bytes, qt);
#else
    /* No AVX2 (the baseline variant): a weight row at a time in plain C. The integer modes round
     * the activations as the vector paths do (q_scalar_activations), so that a mode computes the
     * same products on every CPU (kernels/quant.py matmul_int_twin); int8 up to Q_DIRECT_ROWS rows. */
    const int integer = activations == ACT_INT16 || (activations == ACT_INT8 && M <= Q_DIRECT_ROWS);
    int32_t *xq = integer ? (int32_t *)malloc(((size_t)M * K + 2 * (size_t)M * nb) * 4) : NULL;
    if (integer && !xq) return 1;
    float *dx = (float *)(xq + (size_t)M * K), *xsum = dx + (size_t)M * nb;
    if (integer) q_scalar_activations(x, xs, M, K, activations == ACT_INT16 ? 32767.0f : 127.0f, xq, dx, xsum);
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = w + (int64_t)n * row_bytes;
        if (integer) {
            for (int m = 0; m < M; m++) out[m * os + n] = q_scalar_row_int(row, qt, nb, xq + (int64_t)m * K, dx + m * nb, xsum + m * nb);
            continue;
        }
        float *wrow = q_scratch((size_t)K);
        if (!wrow) { failed = 1; continue; }
        q_row_dequant(row, qt, K, wrow);
        for (int m = 0; m < M; m++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += x[m * xs + k] * wrow[k];
            out[m * os + n] = s;
        }
    }
    free(xq);
    return failed;
#endif
}

/* out (M, N) = x @ W^T, activations rounded to int8 per 32-wide block (q8_activations; the twin:
 * kernels/quant.py matmul_int_twin "int8"), at any row count by the int8 GEMM (q_gemm(.., 1),
 * vpdpbusd). Returns 1 if memory could not be allocated, 2 where it is not built (no AVX-512 VNNI
 * in this variant: kernels/backends.py then never offers it). */
int pd_q_gemm_i8(const float *x, int64_t xs, const uint8_t *w, int64_t row_bytes, int qt, int M, int N, int K, float *out,
                 int64_t os) {
#if defined(__AVX2__) && Q_GEMM_I8
    if (q_is_k(qt)) return 3;
    if (M <= 0) return 0;  /* (and how a caller asks whether the kernel is built) */
    return q_gemm(x, xs, w, row_bytes, qt, M, N, K, out, os, 1);
#else
    (void)x; (void)xs; (void)w; (void)row_bytes; (void)qt; (void)M; (void)N; (void)K; (void)out; (void)os;
    return 2;
#endif
}
