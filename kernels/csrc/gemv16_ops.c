/* The lone stream's quantized GEMV: one or two rows of int16 activations times a GGUF Q4_0 / Q4_1
 * / Q8_0 weight kept in a second layout, sixteen weight rows interleaved (a "repacked" copy, as
 * ggml-cpu's repack.cpp does for its Q4_0 8x8 kernels), so that AVX-512 VNNI's vpdpwssd
 * computes sixteen rows' block sums in the sixteen lanes of one register: no horizontal adds, no
 * scalar loads of the rows' scales.
 *
 * Built into the same library as quant_ops.c (kernels/native_build.py); pd_q_repack16 is plain C
 * in every variant, pd_q_gemv16 only in the avx512 one (elsewhere it returns 2). Called by
 * kernels/cpu_native.py (NativeOps.q_linear, int16 activations, <= 2 rows) and by step_ops.c's
 * one-call decode step for weights that carry the copy (pd_qweight.w16).
 *
 * Layout (pd_q_repack16): N rows in groups of 16 (N % 16 == 0); a group is its K/32 blocks in
 * order, a block of a group is
 *   16 fp16 scales d (row i's at i), then for Q4_1 16 fp16 offsets m, then the codes:
 *   Q4_0 / Q4_1: 256 bytes, four chunks c of 64; byte c*64 + h*32 + 2i + e holds, low nibble,
 *     row i's weight 2(4c+h)+e of the block and, high nibble, its weight 2(4c+2+h)+e (h, e in
 *     {0, 1}): a chunk's low nibbles widened to int16 (vpmovzxbw) are the weight pairs 4c and
 *     4c+1 of the 16 rows, one row a 32-bit lane, its high nibbles the pairs 4c+2 and 4c+3;
 *   Q8_0: 512 bytes; bytes 32p + 2i + e hold row i's weight 2p+e (pair p of the 16 rows
 *     widened with vpmovsxbw).
 * A group's block takes 16 times the bytes of a row's block: the copy is as large as the weight.
 *
 * Arithmetic: exactly q_direct8_i16's (quant_ops.c), lane by lane: activations rounded to int16
 * per 32-wide block by the same q16_activations, each (row, block) sum of code x activation
 * products exact in int32, then per block acc = fma(float(sum), d * dx, acc) and, Q4,
 * moff = fma(m, sum(x), moff) (Q4_0: m = -8 d), out = acc + moff: the same bits
 * (tests/kernels/test_gemv16.py checks torch.equal against pd_q_matmul).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pd_ops.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif


static int g_row_block_bytes(int qt) { return qt == QT_Q4_0 ? 18 : qt == QT_Q4_1 ? 20 : 34; }

/* Code j (0..31) of one row's block, as a byte (Q4: 0..15; Q8_0: the int8 bits). */
static uint8_t g_code(const uint8_t *blk, int qt, int j) {
    if (qt == QT_Q8_0) return blk[2 + j];
    const uint8_t *q = blk + (qt == QT_Q4_1 ? 4 : 2);
    return j < 16 ? (q[j] & 15) : (q[j - 16] >> 4);
}

int pd_q_repack16(const uint8_t *w, int64_t row_bytes, int qt, int N, int K, uint8_t *out) {
    if (N % 16 || K % 32 || (qt != QT_Q4_0 && qt != QT_Q4_1 && qt != QT_Q8_0)) return 1;
    const int nb = K / 32, rb = g_row_block_bytes(qt), gb = 16 * rb, head = qt == QT_Q4_1 ? 64 : 32;
    for (int g = 0; g < N / 16; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *dst = out + ((int64_t)g * nb + b) * gb;
            for (int i = 0; i < 16; i++) {
                const uint8_t *blk = w + (int64_t)(16 * g + i) * row_bytes + (int64_t)b * rb;
                memcpy(dst + 2 * i, blk, 2);
                if (qt == QT_Q4_1) memcpy(dst + 32 + 2 * i, blk + 2, 2);
                for (int e = 0; e < 2; e++) {
                    if (qt == QT_Q8_0) {
                        for (int p = 0; p < 16; p++) dst[head + 32 * p + 2 * i + e] = g_code(blk, qt, 2 * p + e);
                    } else {
                        for (int c = 0; c < 4; c++)
                            for (int h = 0; h < 2; h++)
                                dst[head + c * 64 + h * 32 + 2 * i + e] =
                                    (uint8_t)(g_code(blk, qt, 2 * (4 * c + h) + e) | g_code(blk, qt, 2 * (4 * c + 2 + h) + e) << 4);
                    }
                }
            }
        }
    return 0;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* One group of 16 weight rows (its blocks at grp) times R (constant, 1 or 2) activation rows:
 * out[r * os + i] for i in 0..15. */
static inline __attribute__((always_inline)) void gemv16_group(const uint8_t *grp, const int qt, int nb, const int16_t *xq, int K,
                                                               const float *dx, const float *xsum, float *out, int64_t os, const int R) {
    const int gb = 16 * g_row_block_bytes(qt), head = qt == QT_Q4_1 ? 64 : 32;
    __m512 acc[2], moff[2];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); moff[r] = _mm512_setzero_ps(); }
    const __m512i low = _mm512_set1_epi8(15);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = grp + (int64_t)b * gb, *codes = blk + head;
        _mm_prefetch((const char *)blk + 8 * gb, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + 8 * gb + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + 8 * gb + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + 8 * gb + 192, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + 8 * gb + 256, _MM_HINT_T0);
        if (qt == QT_Q8_0) {
            _mm_prefetch((const char *)blk + 8 * gb + 320, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + 8 * gb + 384, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + 8 * gb + 448, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + 8 * gb + 512, _MM_HINT_T0);
        }
        __m512i s[2];
        for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
        const int16_t *xb = xq + b * 32;
        if (qt == QT_Q8_0) {
            for (int p = 0; p < 16; p++) {
                const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(codes + 32 * p)));
                for (int r = 0; r < R; r++) {
                    int32_t pair;
                    memcpy(&pair, xb + (int64_t)r * K + 2 * p, 4);
                    s[r] = _mm512_dpwssd_epi32(s[r], wv, _mm512_set1_epi32(pair));
                }
            }
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(codes + 64 * c));
                const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                const __m512i wv[4] = {_mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo)), _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1)),
                                       _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi)), _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1))};
                for (int h = 0; h < 4; h++)
                    for (int r = 0; r < R; r++) {
                        int32_t pair;
                        memcpy(&pair, xb + (int64_t)r * K + 2 * (4 * c + h), 4);
                        s[r] = _mm512_dpwssd_epi32(s[r], wv[h], _mm512_set1_epi32(pair));
                    }
            }
        }
        const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 m16 = qt == QT_Q4_1   ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                           : qt == QT_Q4_0 ? _mm512_mul_ps(_mm512_set1_ps(-8.0f), d16)
                                          : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d16, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
            if (qt != QT_Q8_0) moff[r] = _mm512_fmadd_ps(m16, _mm512_set1_ps(xsum[r * nb + b]), moff[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * os, _mm512_add_ps(acc[r], moff[r]));
}

int pd_q_gemv16(const float *x, int64_t xs, const uint8_t *w16, int qt, int M, int N, int K, float *out, int64_t os) {
    if (M <= 0) return 0;  /* (and how a caller asks whether the kernel is built) */
    if (M > PD_GEMV16_ROWS || N % 16 || K % 32 || (qt != QT_Q4_0 && qt != QT_Q4_1 && qt != QT_Q8_0)) return 3;
    const int nb = K / 32;
    int16_t *xq = (int16_t *)malloc((size_t)M * K * 2 + 2 * sizeof(float) * M * nb);
    if (!xq) return 1;
    float *dx = (float *)(xq + (size_t)M * K), *xsum = dx + M * nb;
    pd_q16_activations(x, xs, M, K, xq, dx, xsum);
    const int64_t gbytes = (int64_t)nb * 16 * g_row_block_bytes(qt);
#pragma omp parallel for schedule(static)
    for (int g = 0; g < N / 16; g++) {
        const uint8_t *grp = w16 + g * gbytes;
        float *o = out + 16 * g;
        switch (qt * 2 + M) {  /* constant qt and R: the compiler specialises each */
            case QT_Q4_1 * 2 + 1: gemv16_group(grp, QT_Q4_1, nb, xq, K, dx, xsum, o, os, 1); break;
            case QT_Q4_1 * 2 + 2: gemv16_group(grp, QT_Q4_1, nb, xq, K, dx, xsum, o, os, 2); break;
            case QT_Q4_0 * 2 + 1: gemv16_group(grp, QT_Q4_0, nb, xq, K, dx, xsum, o, os, 1); break;
            case QT_Q4_0 * 2 + 2: gemv16_group(grp, QT_Q4_0, nb, xq, K, dx, xsum, o, os, 2); break;
            case QT_Q8_0 * 2 + 1: gemv16_group(grp, QT_Q8_0, nb, xq, K, dx, xsum, o, os, 1); break;
            default: gemv16_group(grp, QT_Q8_0, nb, xq, K, dx, xsum, o, os, 2); break;
        }
    }
    free(xq);
    return 0;
}
#else
int pd_q_gemv16(const float *x, int64_t xs, const uint8_t *w16, int qt, int M, int N, int K, float *out, int64_t os) {
    (void)x; (void)xs; (void)w16; (void)qt; (void)M; (void)N; (void)K; (void)out; (void)os;
    return 2;
}
#endif
