/* pdserve's fused CPU kernels, float32: called through ctypes by kernels/cpu_native.py.
 *
 * Each function does what a handful of small torch ops would, in one pass over memory and
 * without a Python round trip per op; each has a torch twin in kernels/cpu_native.py that the
 * tests compare it with. Linked
 * against the OpenMP runtime torch has already loaded, so both share one thread pool and the
 * thread count torch.set_num_threads set. Compiled once per instruction-set level (baseline, avx2,
 * avx512: kernels/native_build.py), never for the build machine alone; "#ifdef __AVX2__" parts are
 * what the avx2 and avx512 variants add.
 *
 * Rounding: elementwise arithmetic keeps torch's order of operations (the file is compiled with
 * -ffp-contract=off, so a*b + c*d is two rounded products and a rounded sum, as in eager torch);
 * reductions (RMSNorm's mean of squares, attention's dot products and softmax) sum in another
 * order than torch, so results differ from the twins at the level of float32 rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pd_ops.h"

/* exp(x) to about 2 ulp (Cephes' expf: range reduction by ln 2, degree-6 polynomial). The
 * scalar form serves loop tails and non-AVX2 builds; exp8 is the same arithmetic 8 lanes wide. */
static inline float pd_expf(float x) {
    x = fminf(fmaxf(x, -87.0f), 88.0f);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef __AVX2__
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* y[i] = exp(x[i] - m) for i < n; returns the sum of the y (softmax's denominator). */
static float exp_shifted(float *x, int n, float m) {
    int i = 0;
    float sum = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++) sum += lanes[l];
#endif
    for (; i < n; i++) {
        x[i] = pd_expf(x[i] - m);
        sum += x[i];
    }
    return sum;
}

/* A per-thread scratch buffer for attention scores, grown on demand and kept for the process. */
static float *scratch(size_t n) {
    static __thread float *buf = NULL;
    static __thread size_t cap = 0;
    if (n > cap) {
        free(buf);
        cap = n < 4096 ? 4096 : n;
        buf = (float *)malloc(cap * sizeof(float));
    }
    return buf;
}

/* The int8 KV cache (kernels/kv_quant.py): a (token, kv head) row is D uint8 codes c, then the
 * float16 bits of its scale s and its int16 zero code z (little-endian): y ~ s (c - z), where y
 * = H x, the row rotated by the +-1 Sylvester Hadamard matrix (H H = D I) when D is a power of
 * two (`q8_rotated`), else y = x. quantize_q8 is kv_quant.pack's arithmetic, bit for bit:
 * s = max((max y - min y) / 255, |min y| / 32000) as float16 (clamped to [2^-24, 65504]; 0 for a
 * row of zeros), z = round(-min y / s), c = clamp(round(y / s) + z, 0, 255). */
#define Q8_META_BYTES 4
#define Q8_ZERO_LIMIT 32000.0f

static inline int q8_rotated(int D) { return D > 1 && (D & (D - 1)) == 0; }

#ifdef __AVX512F__
/* One butterfly stage within each 16-lane vector, pairs h lanes apart: `swap` has each lane's partner, `upper` the
 * lanes that take a - b (partner - own). */
static inline __m512 butterfly16(__m512 x, __m512 swap, __mmask16 upper) {
    return _mm512_mask_sub_ps(_mm512_add_ps(x, swap), upper, swap, x);
}
#endif

/* x = H x in place (D a power of two), by butterflies: kv_quant.hadamard's float operations in its order (stage h =
 * 1, 2, .. D / 2, pairs (a, b) h apart -> (a + b, a - b)); D = 64 on AVX-512 in four registers, the same operations. */
static inline void hadamard(float *x, int D) {
#ifdef __AVX512F__
    if (D == 64) {
        __m512 r[4];
        for (int i = 0; i < 4; i++) {
            r[i] = _mm512_loadu_ps(x + 16 * i);
            r[i] = butterfly16(r[i], _mm512_permute_ps(r[i], 0xB1), 0xAAAA);           /* h = 1 */
            r[i] = butterfly16(r[i], _mm512_permute_ps(r[i], 0x4E), 0xCCCC);           /* h = 2 */
            r[i] = butterfly16(r[i], _mm512_shuffle_f32x4(r[i], r[i], 0xB1), 0xF0F0);  /* h = 4 */
            r[i] = butterfly16(r[i], _mm512_shuffle_f32x4(r[i], r[i], 0x4E), 0xFF00);  /* h = 8 */
        }
        for (int h = 1; h <= 2; h <<= 1)  /* h = 16, 32: whole registers */
            for (int i = 0; i < 4; i++)
                if (!(i & h)) {
                    const __m512 a = r[i], b = r[i + h];
                    r[i] = _mm512_add_ps(a, b);
                    r[i + h] = _mm512_sub_ps(a, b);
                }
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(x + 16 * i, r[i]);
        return;
    }
#endif
    for (int h = 1; h < D; h <<= 1)
        for (int i = 0; i < D; i += 2 * h)
#pragma omp simd
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

/* H x / D of G rows of D (the query heads of a kv head, or their attention output), in place. */
static inline void hadamard_rows(float *x, int G, int D) {
    const float inv = 1.0f / (float)D;  /* a power of two: exact */
    for (int g = 0; g < G; g++) {
        hadamard(x + (int64_t)g * D, D);
        for (int d = 0; d < D; d++) x[(int64_t)g * D + d] *= inv;
    }
}

/* A float in [0, 65504] as float16 bits, rounded to nearest even (as torch's .half()). */
static inline uint16_t float_to_half(float x) {
    if (!(x > 0.0f)) return 0;
    int e;
    (void)frexpf(x, &e);  /* x in [2^(e-1), 2^e) */
    if (e - 1 < -14) return (uint16_t)nearbyintf(ldexpf(x, 24));  /* subnormal: a multiple of 2^-24 (1024: 2^-14, the bits agree) */
    float r = nearbyintf(ldexpf(x, 11 - e));  /* x / ulp: 1024..2048 */
    if (r >= 2048.0f) { r = 1024.0f; e += 1; }
    return (uint16_t)(((e + 14) << 10) | ((int)r - 1024));
}

/* A row's scale and zero code. */
static inline float q8_meta(const uint8_t *row, int D, int *zero) {
    uint16_t bits;
    int16_t z;
    memcpy(&bits, row + D, sizeof bits);
    memcpy(&z, row + D + 2, sizeof z);
    *zero = z;
    return pd_half_to_float(bits);
}

/* One (sequence, kv head) item of decode attention: the G query heads qs (G, D), already scaled,
 * against the len keys/values first..first+len-1 of kv head kh (first > 0: a sliding window),
 * read page by page through `table`. s: G * len scores of scratch, acc: G * D. Always inlined with a constant D so that the D-loops compile
 * to straight vector code (fused multiply-adds: attention is not bit-matched to torch anyway). */
static inline __attribute__((always_inline)) void decode_item(
    const float *qs, float *ob, float *s, float *acc, const float *k_cache, const float *v_cache,
    const int32_t *table, int first, int len, int kh, int G, int KVH, const int BS, const int D) {
    for (int g = 0; g < G; g++) s[(int64_t)g * len] = 0.0f;
    float mx[G];
    for (int g = 0; g < G; g++) mx[g] = -INFINITY;
    const float *kp = k_cache, *vp = v_cache;
    const int64_t row = (int64_t)KVH * D;
    for (int t = 0; t < len; t++) {
        const int u = first + t;  /* the key's position */
        if (t == 0 || u % BS == 0) kp = k_cache + ((int64_t)table[u / BS] * BS * KVH + kh) * D + (int64_t)(u % BS) * row;
        else kp += row;
        for (int g = 0; g < G; g++) {
            const float *qg = qs + g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot = fmaf(qg[d], kp[d], dot);
            s[(int64_t)g * len + t] = dot;
            mx[g] = dot > mx[g] ? dot : mx[g];
        }
    }
    float inv_sum[G];
    for (int g = 0; g < G; g++) {
        inv_sum[g] = 1.0f / exp_shifted(s + (int64_t)g * len, len, mx[g]);
    }
    for (int i = 0; i < G * D; i++) acc[i] = 0.0f;
    for (int t = 0; t < len; t++) {
        const int u = first + t;
        if (t == 0 || u % BS == 0) vp = v_cache + ((int64_t)table[u / BS] * BS * KVH + kh) * D + (int64_t)(u % BS) * row;
        else vp += row;
        for (int g = 0; g < G; g++) {
            const float w = s[(int64_t)g * len + t];
            float *ag = acc + g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) ag[d] = fmaf(w, vp[d], ag[d]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) ob[g * D + d] = acc[g * D + d] * inv_sum[g];
}

#ifdef __AVX512F__
/* decode_item (Q8: decode_item_q8) for head dim 64 and a query group of G (constant, 1..4) heads,
 * AVX-512: a key or value row is four vectors (an int8 row's 64 codes widened once, then shared
 * by the group's heads; its scale applied to the score and to the value's weight, its zero code
 * folded into the score (- z sum(q)) and, for the values, into one sum after the loop; the caller
 * rotates the queries and the output: decode_attention_pages); the group's
 * queries and its G x 64 output accumulators stay in registers (the generic form kept the
 * accumulators in memory, a load and a store per value row), and the G dot products of a key are
 * summed across lanes together (hsum4: one add tree for four heads instead of one per head).
 * Same arithmetic as the generic forms up to summation order. (The generic int8 form ran a
 * 4k-token lone stream's attention at about half the float pages' speed, though it reads a
 * quarter of the bytes.) */
static inline __m128 hsum4(const __m512 p[4]) {
    __m256 h[4];
    for (int g = 0; g < 4; g++) h[g] = _mm256_add_ps(_mm512_castps512_ps256(p[g]), _mm512_extractf32x8_ps(p[g], 1));
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  /* lane g: head g's sum */
}

/* Row u of kv head kh (float pages, or Q8 rows of 64 uint8 codes + scale and zero code) as four float vectors (Q8: the
 * codes), its scale in *scale (1 for float) and its zero code in *zero (0 for float). */
static inline __attribute__((always_inline)) const char *row64(const char *cache, const char *prev, const int32_t *table, int t, int u,
                                                               int kh, int KVH, const int BS, const int Q8, __m512 r[4], float *scale,
                                                               float *zero) {
    const int64_t bytes = Q8 ? 64 + Q8_META_BYTES : 64 * sizeof(float), row = (int64_t)KVH * bytes;
    const char *p = t == 0 || u % BS == 0 ? cache + ((int64_t)table[u / BS] * BS * KVH + kh) * bytes + (int64_t)(u % BS) * row : prev + row;
    if (Q8) {
        /* the 4 metadata bytes loaded into a vector register and converted there */
        const __m128i m = _mm_castps_si128(_mm_load_ss((const float *)(p + 64)));
        *scale = _mm_cvtss_f32(_mm_cvtph_ps(m));                          /* lane 0: the float16 scale */
        *zero = _mm_cvtss_f32(_mm_cvtepi32_ps(_mm_srai_epi32(m, 16)));    /* the int16 zero code, sign-extended */
        for (int i = 0; i < 4; i++) r[i] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * i))));
    } else {
        for (int i = 0; i < 4; i++) r[i] = _mm512_loadu_ps((const float *)p + 16 * i);
        *scale = 1.0f;
        *zero = 0.0f;
    }
    return p;
}

static inline __attribute__((always_inline)) void decode_item64(
    const float *qs, float *ob, float *s, const void *k_cache, const void *v_cache, const int32_t *table, int first, int len,
    int kh, int KVH, const int BS, const int G, const int Q8) {
    __m512 q[4][4], a[4][4];
    float *sz = s + (int64_t)G * len + 2 * G * 64;  /* Q8: each value row's scale * zero code (scratch after the scores, acc and qs) */
    float mx[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, qsum[4] = {0.0f, 0.0f, 0.0f, 0.0f}, zsum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++) q[g][i] = _mm512_loadu_ps(qs + g * 64 + 16 * i);
    if (Q8)  /* q . (c - z) = q . c - z sum(q): the zero code folded into the score (one product a head, not 64 subtractions) */
        for (int g = 0; g < G; g++) qsum[g] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(q[g][0], q[g][1]), _mm512_add_ps(q[g][2], q[g][3])));
    const __m128 qsum4 = _mm_loadu_ps(qsum);
    const char *kp = k_cache;
    for (int t = 0; t < len; t++) {
        __m512 k[4], p[4];
        float ks, kz;
        kp = row64(k_cache, kp, table, t, first + t, kh, KVH, BS, Q8, k, &ks, &kz);
        for (int g = 0; g < 4; g++) {
            if (g >= G) { p[g] = _mm512_setzero_ps(); continue; }
            p[g] = _mm512_mul_ps(q[g][0], k[0]);
            for (int i = 1; i < 4; i++) p[g] = _mm512_fmadd_ps(q[g][i], k[i], p[g]);
        }
        float dots[4];
        __m128 d = hsum4(p);
        if (Q8) d = _mm_mul_ps(_mm_fnmadd_ps(_mm_set1_ps(kz), qsum4, d), _mm_set1_ps(ks));  /* (q . c - z sum(q)) * scale, 4 heads at once */
        _mm_storeu_ps(dots, d);
        for (int g = 0; g < G; g++) {
            const float dot = dots[g];
            s[(int64_t)g * len + t] = dot;
            mx[g] = dot > mx[g] ? dot : mx[g];
        }
    }
    float inv_sum[4];
    for (int g = 0; g < G; g++) inv_sum[g] = 1.0f / exp_shifted(s + (int64_t)g * len, len, mx[g]);
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++) a[g][i] = _mm512_setzero_ps();
    const char *vp = v_cache;
    for (int t = 0; t < len; t++) {
        __m512 v[4];
        float vs, vz;
        vp = row64(v_cache, vp, table, t, first + t, kh, KVH, BS, Q8, v, &vs, &vz);
        if (Q8) sz[t] = vs * vz;
        for (int g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(Q8 ? s[(int64_t)g * len + t] * vs : s[(int64_t)g * len + t]);
            for (int i = 0; i < 4; i++) a[g][i] = _mm512_fmadd_ps(w, v[i], a[g][i]);
        }
    }
    if (Q8)  /* sum p s (c - z) = sum (p s) c - sum p (s z): the zero codes' share of each head, one dot product over the rows */
        for (int g = 0; g < G; g++) {
            __m512 acc = _mm512_setzero_ps();
            int t = 0;
            for (; t + 16 <= len; t += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(s + (int64_t)g * len + t), _mm512_loadu_ps(sz + t), acc);
            zsum[g] = _mm512_reduce_add_ps(acc);
            for (; t < len; t++) zsum[g] += s[(int64_t)g * len + t] * sz[t];
        }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++)
            _mm512_storeu_ps(ob + g * 64 + 16 * i, _mm512_mul_ps(_mm512_sub_ps(a[g][i], _mm512_set1_ps(zsum[g])), _mm512_set1_ps(inv_sum[g])));
}

/* decode_item64 for the group sizes it takes, Q8 constant (1 when it does not: the caller runs the generic form). */
static inline __attribute__((always_inline)) int decode_item64_g(const float *qs, float *ob, float *s, const void *k_cache, const void *v_cache,
                                                                 const int32_t *table, int first, int len, int kh, int G, int KVH, int BS, const int Q8) {
    switch (G * (BS == 16 ? 1 : -1)) {
        case 1: decode_item64(qs, ob, s, k_cache, v_cache, table, first, len, kh, KVH, 16, 1, Q8); return 0;
        case 2: decode_item64(qs, ob, s, k_cache, v_cache, table, first, len, kh, KVH, 16, 2, Q8); return 0;
        case 3: decode_item64(qs, ob, s, k_cache, v_cache, table, first, len, kh, KVH, 16, 3, Q8); return 0;
        case 4: decode_item64(qs, ob, s, k_cache, v_cache, table, first, len, kh, KVH, 16, 4, Q8); return 0;
        case -1: decode_item64(qs, ob, s, k_cache, v_cache, table, first, len, kh, KVH, BS, 1, Q8); return 0;
        case -2: decode_item64(qs, ob, s, k_cache, v_cache, table, first, len, kh, KVH, BS, 2, Q8); return 0;
        case -3: decode_item64(qs, ob, s, k_cache, v_cache, table, first, len, kh, KVH, BS, 3, Q8); return 0;
        case -4: decode_item64(qs, ob, s, k_cache, v_cache, table, first, len, kh, KVH, BS, 4, Q8); return 0;
        default: return 1;
    }
}

static int decode_item64_any(const float *qs, float *ob, float *s, const void *k_cache, const void *v_cache, const int32_t *table,
                             int first, int len, int kh, int G, int KVH, int BS, int q8) {
    return q8 ? decode_item64_g(qs, ob, s, k_cache, v_cache, table, first, len, kh, G, KVH, BS, 1)
              : decode_item64_g(qs, ob, s, k_cache, v_cache, table, first, len, kh, G, KVH, BS, 0);
}
#else
static int decode_item64_any(const float *qs, float *ob, float *s, const void *k_cache, const void *v_cache, const int32_t *table,
                             int first, int len, int kh, int G, int KVH, int BS, int q8) {
    (void)qs; (void)ob; (void)s; (void)k_cache; (void)v_cache; (void)table; (void)first; (void)len; (void)kh; (void)G; (void)KVH; (void)BS;
    (void)q8;
    return 1;
}
#endif

/* Keys x kv heads (summed over the step's sequences) above which the (sequence, kv head) items
 * run in parallel. It was 4096: 1365 keys for the default model (3 kv heads), so a lone stream's
 * attention ran on one core (an item ~0.04 us a key here: ~65 us a layer at 533 keys, against a
 * parallel region's few us). Each item's arithmetic is the same either way. */
#define ATTN_PARALLEL_WORK 384

/* RMSNorm of `rows` rows of x (row stride x_stride) into out (contiguous), as transformers'
 * LlamaRMSNorm: out = w * (x * rsqrt(mean(x^2) + eps)). With residual != NULL it first adds x
 * into the residual stream (residual += x) and normalises the sum (vLLM's fused_add_rms_norm). */
void pd_rms_norm(const float *x, int64_t x_stride, float *residual, const float *w, float *out,
                 int rows, int dim, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * x_stride;
        float *src = (float *)xr;
        if (residual != NULL) {
            src = residual + (int64_t)r * dim;
#pragma omp simd
            for (int i = 0; i < dim; i++) src[i] = src[i] + xr[i];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < dim; i++) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *o = out + (int64_t)r * dim;
#pragma omp simd
        for (int i = 0; i < dim; i++) o[i] = w[i] * (src[i] * inv);
    }
}

/* out (rows, inter) = silu(gate) * up for gate_up (rows, 2 * inter) = [gate | up]; silu(x) =
 * x / (1 + exp(-x)), as torch's vectorised CPU silu. */
static void silu_mul_row(const float *g, const float *u, float *o, int n) {
    int i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) o[i] = (g[i] / (1.0f + pd_expf(-g[i]))) * u[i];
}

void pd_silu_mul(const float *gate_up, float *out, int rows, int inter) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * inter >= 65536)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (int64_t)r * 2 * inter;
        silu_mul_row(g, g + inter, out + (int64_t)r * inter, inter);
    }
}

/* Rotary embedding (rotate-half / NeoX layout, as transformers' Llama) applied in place to the
 * q and k heads of the fused qkv rows (T, qkv_stride) = [q (H*D) | k (KVH*D) | v (KVH*D)], then
 * k and v stored at their cache slots: the work of rope + write_kv in one pass.
 * cos, sin: (max_position, D) tables; positions, slots: (T,) int64. */
/* q and k heads of one qkv row rotated in place (the rotate-half form, torch's order of operations). */
static inline void rope_row(float *row, const float *c, const float *s, int heads, int D) {
    const int half = D / 2;
    for (int h = 0; h < heads; h++) {
        float *x = row + (int64_t)h * D;
        float tmp[half];
#pragma omp simd
        for (int i = 0; i < half; i++) tmp[i] = x[i];
#pragma omp simd
        for (int i = 0; i < half; i++) x[i] = x[i] * c[i] + (-x[i + half]) * s[i];
#pragma omp simd
        for (int i = 0; i < half; i++) x[i + half] = x[i + half] * c[i + half] + tmp[i] * s[i + half];
    }
}

void pd_rope_write_kv(float *qkv, int64_t qkv_stride, const int64_t *positions, const float *cos_t,
                      const float *sin_t, float *k_cache, float *v_cache, const int64_t *slots,
                      int T, int H, int KVH, int D) {
#pragma omp parallel for schedule(static) if (T >= 64)
    for (int t = 0; t < T; t++) {
        float *row = qkv + (int64_t)t * qkv_stride;
        rope_row(row, cos_t + positions[t] * D, sin_t + positions[t] * D, H + KVH, D);
        const int64_t slot = slots[t];
        memcpy(k_cache + slot * KVH * D, row + (int64_t)H * D, sizeof(float) * KVH * D);
        memcpy(v_cache + slot * KVH * D, row + (int64_t)(H + KVH) * D, sizeof(float) * KVH * D);
    }
}

/* quantize_q8: one row as pd_rope_write_kv_q8 stores it (the row format: above decode_item). */
static inline void quantize_q8(const float *x, uint8_t *row, int D) {
    float y[D];
    memcpy(y, x, sizeof(float) * D);
    if (q8_rotated(D)) hadamard(y, D);
    float lo = y[0], hi = y[0];
    for (int i = 1; i < D; i++) {
        lo = fminf(lo, y[i]);
        hi = fmaxf(hi, y[i]);
    }
    const float s = fminf(fmaxf((hi - lo) / 255.0f, fabsf(lo) / Q8_ZERO_LIMIT), 65504.0f);
    uint16_t bits = float_to_half(s);
    if (s > 0.0f && bits == 0) bits = 1;  /* under float16's range: its smallest, 2^-24 */
    const float sf = pd_half_to_float(bits);
    const int16_t z = sf > 0.0f ? (int16_t)fminf(fmaxf(nearbyintf(-lo / sf), -32768.0f), 32767.0f) : 0;
    for (int i = 0; i < D; i++) row[i] = sf > 0.0f ? (uint8_t)fminf(fmaxf(nearbyintf(y[i] / sf) + (float)z, 0.0f), 255.0f) : 0;
    memcpy(row + D, &bits, sizeof bits);
    memcpy(row + D + 2, &z, sizeof z);
}

/* pd_rope_write_kv into an int8 cache (num_blocks * BS slots of KVH rows of D + 4 bytes). */
void pd_rope_write_kv_q8(float *qkv, int64_t qkv_stride, const int64_t *positions, const float *cos_t,
                         const float *sin_t, uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots,
                         int T, int H, int KVH, int D) {
    const int64_t W = D + Q8_META_BYTES;
#pragma omp parallel for schedule(static) if (T >= 64)
    for (int t = 0; t < T; t++) {
        float *row = qkv + (int64_t)t * qkv_stride;
        rope_row(row, cos_t + positions[t] * D, sin_t + positions[t] * D, H + KVH, D);
        const int64_t slot = slots[t];
        for (int h = 0; h < KVH; h++) {
            quantize_q8(row + (int64_t)(H + h) * D, k_cache + (slot * KVH + h) * W, D);
            quantize_q8(row + (int64_t)(H + KVH + h) * D, v_cache + (slot * KVH + h) * W, D);
        }
    }
}

/* decode_item over an int8 cache, in the rows' (rotated) basis: each score is (q . codes - zero *
 * sum(q)) * the key's scale, each value row adds (weight * its scale) * codes, and each head's output
 * loses sum(weight * scale * zero) at the end; the same sums as decode_item over s (c - z), up to
 * rounding. (The caller rotates q before and the output after.) */
static inline __attribute__((always_inline)) void decode_item_q8(
    const float *qs, float *ob, float *s, float *acc, const uint8_t *k_cache, const uint8_t *v_cache,
    const int32_t *table, int first, int len, int kh, int G, int KVH, const int BS, const int D) {
    const int64_t W = D + Q8_META_BYTES, row = (int64_t)KVH * W;
    float mx[G], qsum[G], zsum[G];
    for (int g = 0; g < G; g++) {
        mx[g] = -INFINITY;
        zsum[g] = qsum[g] = 0.0f;
        for (int d = 0; d < D; d++) qsum[g] += qs[g * D + d];
    }
    const uint8_t *kp = k_cache, *vp = v_cache;
    for (int t = 0; t < len; t++) {
        const int u = first + t;
        kp = t == 0 || u % BS == 0 ? k_cache + ((int64_t)table[u / BS] * BS * KVH + kh) * W + (int64_t)(u % BS) * row : kp + row;
        int kz;
        const float ks = q8_meta(kp, D, &kz);
        for (int g = 0; g < G; g++) {
            const float *qg = qs + g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot = fmaf(qg[d], (float)kp[d], dot);
            dot = (dot - (float)kz * qsum[g]) * ks;
            s[(int64_t)g * len + t] = dot;
            mx[g] = dot > mx[g] ? dot : mx[g];
        }
    }
    float inv_sum[G];
    for (int g = 0; g < G; g++) inv_sum[g] = 1.0f / exp_shifted(s + (int64_t)g * len, len, mx[g]);
    for (int i = 0; i < G * D; i++) acc[i] = 0.0f;
    for (int t = 0; t < len; t++) {
        const int u = first + t;
        vp = t == 0 || u % BS == 0 ? v_cache + ((int64_t)table[u / BS] * BS * KVH + kh) * W + (int64_t)(u % BS) * row : vp + row;
        int vz;
        const float vs = q8_meta(vp, D, &vz);
        for (int g = 0; g < G; g++) {
            const float w = s[(int64_t)g * len + t] * vs;
            zsum[g] += w * (float)vz;
            float *ag = acc + g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) ag[d] = fmaf(w, (float)vp[d], ag[d]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) ob[g * D + d] = (acc[g * D + d] - zsum[g]) * inv_sum[g];
}

/* One (sequence, kv head) item over an int8 cache: decode_item64 (AVX-512, D = 64) or decode_item_q8. */
static inline void decode_q8(const float *qs, float *ob, float *s, float *acc, const uint8_t *k_codes, const uint8_t *v_codes,
                             const int32_t *table, int first, int len, int kh, int G, int KVH, int BS, int D) {
    if (D == 64 && !decode_item64_any(qs, ob, s, k_codes, v_codes, table, first, len, kh, G, KVH, BS, 1))
        return;  /* the AVX-512 form took it */
    if (D == 64)
        decode_item_q8(qs, ob, s, acc, k_codes, v_codes, table, first, len, kh, G, KVH, BS, 64);
    else if (D == 128)
        decode_item_q8(qs, ob, s, acc, k_codes, v_codes, table, first, len, kh, G, KVH, BS, 128);
    else
        decode_item_q8(qs, ob, s, acc, k_codes, v_codes, table, first, len, kh, G, KVH, BS, D);
}

/* The decode attention of both caches: float pages, or (q8) int8 rows of D codes + scale and zero
 * code, Hadamard-rotated where D is a power of two: then the scaled queries are rotated (H q / D)
 * before the item reads the rotated keys, and its output, a sum of rotated value rows, rotated back
 * (H o / D) after: (H q / D) . (H k) = q . k, H (sum p H v) / D = sum p v. */
static int decode_attention_pages(
    const float *q, int64_t q_stride, float *out, int64_t out_stride, const int64_t *rows,
    const void *k_pages, const void *v_pages, const int32_t *block_tables, int64_t bt_stride,
    const int32_t *seq_lens, int B, int H, int KVH, int D, int BS, float scale, int window, int q8) {
    const float *k_cache = k_pages, *v_cache = v_pages;
    const uint8_t *k_codes = k_pages, *v_codes = v_pages;
    const int G = H / KVH, rotate = q8 && q8_rotated(D);
    int failed = 0;
    int64_t work = 0;
    for (int b = 0; b < B; b++) work += window > 0 && seq_lens[b] > window ? window : seq_lens[b];
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (work * KVH > ATTN_PARALLEL_WORK) reduction(| : failed)
    for (int b = 0; b < B; b++) {
        for (int kh = 0; kh < KVH; kh++) {
            const int first = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
            const int len = seq_lens[b] - first;
            const int32_t *table = block_tables + (int64_t)b * bt_stride;
            const float *qb = q + rows[b] * q_stride + (int64_t)kh * G * D;
            float *ob = out + rows[b] * out_stride + (int64_t)kh * G * D;
            /* scores (G * len), acc (G * D), qs (G * D), then len floats for decode_item64 (Q8) */
            float *s = scratch((size_t)G * len + (size_t)G * D + (size_t)G * D + (size_t)len);
            if (s == NULL) { failed = 1; continue; }
            float *acc = s + (size_t)G * len, *qs = acc + (size_t)G * D;
            for (int i = 0; i < G * D; i++) qs[i] = qb[i] * scale;
            if (q8) {  /* int8 rows (pd_rope_write_kv_q8) */
                if (rotate) hadamard_rows(qs, G, D);
                decode_q8(qs, ob, s, acc, k_codes, v_codes, table, first, len, kh, G, KVH, BS, D);
                if (rotate) hadamard_rows(ob, G, D);
                continue;
            }
            if (D == 64 && !decode_item64_any(qs, ob, s, k_pages, v_pages, table, first, len, kh, G, KVH, BS, 0))
                continue;  /* the AVX-512 form took it */
            if (D == 64)
                (BS == 16 ? decode_item(qs, ob, s, acc, k_cache, v_cache, table, first, len, kh, G, KVH, 16, 64)
                         : decode_item(qs, ob, s, acc, k_cache, v_cache, table, first, len, kh, G, KVH, BS, 64));
            else if (D == 128)
                decode_item(qs, ob, s, acc, k_cache, v_cache, table, first, len, kh, G, KVH, BS, 128);
            else
                decode_item(qs, ob, s, acc, k_cache, v_cache, table, first, len, kh, G, KVH, BS, D);
        }
    }
    return failed;
}

/* Decode attention straight from the pages: one query token per sequence, no gather.
 *
 * q, out: row rows[b] of (T, H, D) with row stride q_stride / out_stride (floats).
 * k_cache, v_cache: (num_blocks, BS, KVH, D) contiguous. block_tables: (B, bt_stride) int32.
 * The sequence sees keys 0..seq_lens[b]-1, or with window > 0 only the last `window` of them
 * (transformers' sliding window: the query at position p sees keys p - window < k <= p). Work item = (sequence, kv head): the G = H / KVH
 * query heads that read one kv head share each key and value load. Returns 0, or 1 when a
 * scratch allocation failed (out then holds garbage for the failed items).
 */
int pd_paged_decode_attention(
    const float *q, int64_t q_stride, float *out, int64_t out_stride, const int64_t *rows,
    const float *k_cache, const float *v_cache, const int32_t *block_tables, int64_t bt_stride,
    const int32_t *seq_lens, int B, int H, int KVH, int D, int BS, float scale, int window) {
    return decode_attention_pages(q, q_stride, out, out_stride, rows, k_cache, v_cache, block_tables, bt_stride, seq_lens, B, H, KVH, D, BS, scale, window, 0);
}

/* pd_paged_decode_attention over an int8 cache (rows of D uint8 codes + scale and zero code, as pd_rope_write_kv_q8 writes). */
int pd_paged_decode_attention_q8(
    const float *q, int64_t q_stride, float *out, int64_t out_stride, const int64_t *rows,
    const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *block_tables, int64_t bt_stride,
    const int32_t *seq_lens, int B, int H, int KVH, int D, int BS, float scale, int window) {
    return decode_attention_pages(q, q_stride, out, out_stride, rows, k_cache, v_cache, block_tables, bt_stride, seq_lens, B, H, KVH, D, BS, scale, window, 1);
}
