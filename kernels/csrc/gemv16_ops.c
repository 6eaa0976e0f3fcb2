/* The decode step's quantized GEMV: up to PD_GEMV16_ROWS rows of int16 activations times a GGUF
 * Q4_0 / Q4_1 / Q8_0 weight kept in a second layout, sixteen weight rows interleaved (a "repacked"
 * copy, as ggml-cpu's repack.cpp does for its Q4_0 8x8 kernels), so that AVX-512 VNNI's vpdpwssd
 * computes sixteen rows' block sums in the sixteen lanes of one register: no horizontal adds, no
 * scalar loads of the rows' scales. A group's block is widened to int16 once per pass and
 * multiplied into up to GEMV16_R activation rows (each row's pair broadcast); more rows take more
 * passes over the group, which its cache holds. Measured at the 1B shapes (8192 x 2048, 2048 x
 * 8192, Q4_0, one thread, AMD EPYC Zen 4, 2026-12-08): 4 rows 0.79 ms against the int16 path's
 * 2.14 (one weight row at a time), 16 rows 3.0 against 4.6 (q_gemm's tiles, whose 32 activation
 * lanes a batch of 16 half fills and whose weight panel is unpacked to memory a call), 64 rows
 * 11.9 against 13.2, 128 even, 512 q_gemm 10% ahead: hence PD_GEMV16_ROWS 128.
 *
 * Built into the same library as quant_ops.c (kernels/native_build.py); pd_q_repack16 is plain C
 * in every variant, pd_q_gemv16 only in the avx512 one (elsewhere it returns 2). Called by
 * kernels/cpu_native.py (NativeOps.q_linear, int16 activations, <= PD_GEMV16_ROWS rows) and by step_ops.c's
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


/* Bytes a row's 32-weight block takes in the copy: the GGUF block's for Q4_0 / Q4_1 / Q8_0; Q4_K its sc and mn bytes
 * and nibbles (its d and dmin: G4K_HEAD below); Q5_K / Q6_K 8 bytes of float32 scales (d and m, Q6_K its two halves'
 * d) and a byte a code. */
static int g_row_block_bytes(int qt) {
    switch (qt) {
        case QT_Q4_0: return 18;
        case QT_Q4_1: return 20;
        case QT_Q8_0: return 34;
        case QT_Q4_K: return 18;  /* its 6-bit sc and mn a byte each, the nibbles; + G4K_HEAD a super-block's 16 rows */
        default: return 40;  /* Q5_K, Q6_K */
    }
}

/* Q4_K keeps the file's scales: a group's super-block is G4K_HEAD bytes (16 fp16 d, then 16 fp16 dmin) and its 8
 * blocks, each 16 sc bytes, 16 mn bytes and 256 bytes of nibbles; the kernel forms d * sc and -(dmin * mn), the
 * float32 products qk_unpack gives (exact: 11 bits times 6), so the copy reads ~0.58 bytes a weight, not 0.75. */
#define G4K_HEAD 64
#define G4K_SUPER (G4K_HEAD + 8 * 16 * 18)

/* A group's bytes: nb blocks of its 16 rows. */
static int64_t g_group_bytes(int qt, int nb) {
    return qt == QT_Q4_K ? (int64_t)nb / 8 * G4K_SUPER : (int64_t)nb * 16 * g_row_block_bytes(qt);
}

/* Where block b of a group starts (its head: scales, then codes). */
static inline const uint8_t *g_block(const uint8_t *grp, int qt, int b) {
    if (qt == QT_Q4_K) return grp + (int64_t)(b >> 3) * G4K_SUPER + G4K_HEAD + (b & 7) * 16 * 18;
    return grp + (int64_t)b * 16 * g_row_block_bytes(qt);
}

static int g_is_k(int qt) { return qt == QT_Q4_K || qt == QT_Q5_K || qt == QT_Q6_K; }
/* The head of a group's block: 16 fp16 d (Q4_1: and 16 fp16 m); Q4_K 16 sc then 16 mn bytes; Q5_K / Q6_K 16 float32 d
 * then 16 float32 m. */
static int g_head(int qt) { return qt == QT_Q4_K ? 32 : g_is_k(qt) ? 128 : qt == QT_Q4_1 ? 64 : 32; }
/* Whether the codes are nibbles (the Q4 chunk layout) or a byte each (Q8_0's pair layout). */
static int g_nibbles(int qt) { return qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q4_K; }

/* Code j (0..31) of one row's block, as a byte (Q4: 0..15; Q8_0: the int8 bits). */
static uint8_t g_code(const uint8_t *blk, int qt, int j) {
    if (qt == QT_Q8_0) return blk[2 + j];
    const uint8_t *q = blk + (qt == QT_Q4_1 ? 4 : 2);
    return j < 16 ? (q[j] & 15) : (q[j - 16] >> 4);
}

/* Row i's codes (one byte each: Q4 0..15, Q8_0 / Q6_K signed, Q5_K 0..31) of its 32-weight block at
 * `codes` into the group's block at dst (after its head), in the layout above. */
static void g_put_codes(uint8_t *dst, int qt, int i, const uint8_t codes[32]) {
    for (int e = 0; e < 2; e++) {
        if (!g_nibbles(qt)) {
            for (int p = 0; p < 16; p++) dst[32 * p + 2 * i + e] = codes[2 * p + e];
        } else {
            for (int c = 0; c < 4; c++)
                for (int h = 0; h < 2; h++)
                    dst[c * 64 + h * 32 + 2 * i + e] = (uint8_t)(codes[2 * (4 * c + h) + e] | codes[2 * (4 * c + 2 + h) + e] << 4);
        }
    }
}

int pd_q_repack16(const uint8_t *w, int64_t row_bytes, int qt, int N, int K, uint8_t *out) {
    const int k = g_is_k(qt);
    if (N % 16 || K % (k ? 256 : 32) || (qt != QT_Q4_0 && qt != QT_Q4_1 && qt != QT_Q8_0 && !k)) return 1;
    const int nb = K / 32, head = g_head(qt);
    const int64_t group = g_group_bytes(qt, nb);
    for (int g = 0; g < N / 16; g++)
        for (int i = 0; i < 16; i++) {
            const uint8_t *row = w + (int64_t)(16 * g + i) * row_bytes;
            if (k) {  /* a super-block at a time: qk_unpack's exact float32 scales and offsets, its codes */
                const int sbb = qt == QT_Q4_K ? 144 : qt == QT_Q5_K ? 176 : 210;  /* a super-block's bytes in the file */
                for (int sb = 0; sb < nb / 8; sb++) {
                    int16_t c[256];
                    float sc[16], mn[8];
                    const uint8_t *blk = row + (int64_t)sb * sbb;
                    pd_qk_unpack(blk, qt, c, sc, mn);
                    if (qt == QT_Q4_K) {  /* the super-block's fp16 d and dmin, as the file has them */
                        uint8_t *sup = out + g * group + (int64_t)sb * G4K_SUPER;
                        memcpy(sup + 2 * i, blk, 2);
                        memcpy(sup + 32 + 2 * i, blk + 2, 2);
                    }
                    for (int j = 0; j < 8; j++) {
                        uint8_t *dst = (uint8_t *)g_block(out + g * group, qt, 8 * sb + j);
                        if (qt == QT_Q4_K) {
                            int sc6, mn6;
                            pd_qk_scale_min(blk + 4, j, &sc6, &mn6);
                            dst[i] = (uint8_t)sc6;
                            dst[16 + i] = (uint8_t)mn6;
                        } else {
                            float *d = (float *)dst, *m = d + 16;
                            d[i] = qt == QT_Q6_K ? sc[2 * j] : sc[j];
                            m[i] = qt == QT_Q6_K ? sc[2 * j + 1] : mn[j];
                        }
                        uint8_t codes[32];
                        for (int l = 0; l < 32; l++) codes[l] = (uint8_t)(int8_t)c[32 * j + l];
                        g_put_codes(dst + head, qt, i, codes);
                    }
                }
                continue;
            }
            const int rb = g_row_block_bytes(qt);
            for (int b = 0; b < nb; b++) {
                uint8_t *dst = (uint8_t *)g_block(out + g * group, qt, b);
                const uint8_t *blk = row + (int64_t)b * rb;
                memcpy(dst + 2 * i, blk, 2);
                if (qt == QT_Q4_1) memcpy(dst + 32 + 2 * i, blk + 2, 2);
                uint8_t codes[32];
                for (int l = 0; l < 32; l++) codes[l] = g_code(blk, qt, l);
                g_put_codes(dst + head, qt, i, codes);
            }
        }
    return 0;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GEMV16_R 8  /* activation rows a pass over a group takes (pd_q_gemv16 runs more in passes of up to 8) */
/* One group of 16 weight rows (its blocks at grp) times R (constant, 1..GEMV16_R) activation rows:
 * out[r * os + i] for i in 0..15. Each block's codes are widened once and multiplied into every
 * row: s, acc and moff take 3 R of the 32 vector registers. */
static inline __attribute__((always_inline)) void gemv16_group(const uint8_t *grp, const int qt, int nb, const int16_t *xq, int K,
                                                               const float *dx, const float *xsum, float *out, int64_t os, const int R) {
    const int gb = 16 * g_row_block_bytes(qt), head = g_head(qt), halves = qt == QT_Q6_K;  /* Q6_K: a scale a half block */
    __m512 kd = _mm512_setzero_ps(), kdmin = _mm512_setzero_ps();  /* Q4_K: the super-block's 16 d and dmin */
    const int offset = qt != QT_Q8_0 && qt != QT_Q6_K;  /* moff: m * sum(x) */
    __m512 acc[GEMV16_R], moff[GEMV16_R];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); moff[r] = _mm512_setzero_ps(); }
    const __m512i low = _mm512_set1_epi8(15);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g_block(grp, qt, b), *codes = blk + head;
        for (int ahead = 0; ahead < gb; ahead += 64) _mm_prefetch((const char *)blk + 8 * gb + ahead, _MM_HINT_T0);
        if (qt == QT_Q4_K && (b & 7) == 0) {
            const uint8_t *sup = grp + (int64_t)(b >> 3) * G4K_SUPER;
            kd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sup));
            kdmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sup + 32)));
        }
        __m512i s[GEMV16_R], s2[GEMV16_R];
        for (int r = 0; r < R; r++) s[r] = s2[r] = _mm512_setzero_si512();
        const int16_t *xb = xq + b * 32;
        if (!g_nibbles(qt)) {
            for (int p = 0; p < 16; p++) {
                const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(codes + 32 * p)));
                for (int r = 0; r < R; r++) {
                    int32_t pair;
                    memcpy(&pair, xb + (int64_t)r * K + 2 * p, 4);
                    if (halves && p >= 8) s2[r] = _mm512_dpwssd_epi32(s2[r], wv, _mm512_set1_epi32(pair));
                    else s[r] = _mm512_dpwssd_epi32(s[r], wv, _mm512_set1_epi32(pair));
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
        __m512 d16, m16;
        if (qt == QT_Q4_K) {  /* d * sc and -(dmin * mn): qk_unpack's float32 products */
            d16 = _mm512_mul_ps(kd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk))));
            m16 = _mm512_xor_ps(_mm512_mul_ps(kdmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16))))),
                                _mm512_set1_ps(-0.0f));
        } else if (g_is_k(qt)) {  /* float32 scales (Q6_K: m16 is the second half's d) */
            d16 = _mm512_loadu_ps((const float *)blk);
            m16 = _mm512_loadu_ps((const float *)blk + 16);
        } else {
            d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            m16 = qt == QT_Q4_1   ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                  : qt == QT_Q4_0 ? _mm512_mul_ps(_mm512_set1_ps(-8.0f), d16)
                                  : _mm512_setzero_ps();
        }
        for (int r = 0; r < R; r++) {
            const __m512 dxr = _mm512_set1_ps(dx[r * nb + b]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d16, dxr), acc[r]);
            if (halves) acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2[r]), _mm512_mul_ps(m16, dxr), acc[r]);
            if (offset) moff[r] = _mm512_fmadd_ps(m16, _mm512_set1_ps(xsum[r * nb + b]), moff[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * os, offset ? _mm512_add_ps(acc[r], moff[r]) : acc[r]);
}

int pd_q_gemv16(const float *x, int64_t xs, const uint8_t *w16, int qt, int M, int N, int K, float *out, int64_t os) {
    if (M <= 0) return 0;  /* (and how a caller asks whether the kernel is built) */
    if (M > PD_GEMV16_ROWS || N % 16 || K % 32 || (qt != QT_Q4_0 && qt != QT_Q4_1 && qt != QT_Q8_0 && !g_is_k(qt))) return 3;
    const int nb = K / 32;
    int16_t *xq = (int16_t *)malloc((size_t)M * K * 2 + 2 * sizeof(float) * M * nb);
    if (!xq) return 1;
    float *dx = (float *)(xq + (size_t)M * K), *xsum = dx + M * nb;
    pd_q16_activations(x, xs, M, K, xq, dx, xsum);
    const int64_t gbytes = g_group_bytes(qt, nb);
#pragma omp parallel for schedule(static)
    for (int g = 0; g < N / 16; g++) {
        const uint8_t *grp = w16 + g * gbytes;
        for (int r0 = 0; r0 < M; r0 += GEMV16_R) {  /* a second pass reads the group from cache */
            const int R = M - r0 < GEMV16_R ? M - r0 : GEMV16_R;
            const int16_t *xr = xq + (int64_t)r0 * K;
            const float *dr = dx + r0 * nb, *sr = xsum + r0 * nb;
            float *o = out + (int64_t)r0 * os + 16 * g;
#define G16_CASE(T, R_) case (R_): gemv16_group(grp, T, nb, xr, K, dr, sr, o, os, R_); break;
#define G16_ROWS(T) switch (R) { G16_CASE(T, 1) G16_CASE(T, 2) G16_CASE(T, 3) G16_CASE(T, 4) G16_CASE(T, 5) G16_CASE(T, 6) \
                                 G16_CASE(T, 7) default: gemv16_group(grp, T, nb, xr, K, dr, sr, o, os, 8); }
            switch (qt) {  /* constant qt and R: the compiler specialises each */
                case QT_Q4_0: G16_ROWS(QT_Q4_0) break;
                case QT_Q4_1: G16_ROWS(QT_Q4_1) break;
                case QT_Q4_K: G16_ROWS(QT_Q4_K) break;
                case QT_Q5_K: G16_ROWS(QT_Q5_K) break;
                case QT_Q6_K: G16_ROWS(QT_Q6_K) break;
                default: G16_ROWS(QT_Q8_0) break;
            }
#undef G16_ROWS
#undef G16_CASE
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
