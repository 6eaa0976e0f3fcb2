/* Every function the pdserve C kernels export, declared once: the .c files include this header,
 * and kernels/cpu_native.py's signature table (_SIGNATURES) mirrors it for ctypes.
 *
 * The same sources are compiled once per instruction-set level (kernels/native_build.py:
 * baseline x86-64, avx2 = x86-64-v3, avx512 = x86-64-v4 + VNNI), each into its own library with
 * these same symbol names; kernels/cpu_native.py asks pd_cpu_features (from the baseline library)
 * what the CPU and the OS support and loads the best variant.
 */
#ifndef PD_OPS_H
#define PD_OPS_H
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

/* float16 bits -> float, exactly (subnormals included): the GGUF blocks' scales (quant_ops.c) and the int8 KV rows'
 * (cpu_ops.c). Not exported: each .c file gets its own inline copy. */
static inline float pd_half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal half: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* isa_probe.c: what the CPU and the OS support, PD_CPU_* bits. */
enum {
    PD_CPU_AVX2 = 1,    /* AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE, and the OS saves YMM state (x86-64-v3) */
    PD_CPU_AVX512 = 2,  /* AVX-512 F/BW/CD/DQ/VL and VNNI, and the OS saves opmask and ZMM state */
    PD_CPU_AVX512_BF16 = 4,
    PD_CPU_AMX = 8,     /* AMX tile + int8 + bf16, and the OS granted tile data (arch_prctl) */
};
int pd_cpu_features(void);
/* The instruction-set level this library was compiled for: 0 baseline, 1 avx2, 2 avx512. */
int pd_build_isa(void);
/* The hash of the sources it was compiled from (kernels/native_build.py source_hash). */
const char *pd_source_hash(void);

/* The ggml type ids of the quantized weights (quant_ops.c, gemv16_ops.c: Q4_0 / Q4_1 / Q8_0 only),
 * how a small decode batch's activations meet them (quant_ops.c ACT_*: kernels/cpu_native.py
 * ACTIVATION_MODES), and the rows the 16-row GEMV takes (gemv16_ops.c; cpu_native.GEMV16_ROWS).
 * Q4_0..Q8_0 are blocks of 32 weights; the K-quants (Q4_K, Q5_K, Q6_K) super-blocks of 256. */
enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14 };
enum { ACT_FLOAT = 0, ACT_INT8 = 1, ACT_INT16 = 2 };
#define PD_GEMV16_ROWS 128
/* The K-quants' rows up to which pd_q_matmul rounds activations per 256 (quant_ops.c QK256_ROWS) where a weight has
 * no 16-row copy (no AVX-512 VNNI, rows not a multiple of 16) or with int8 activations; pd_q_gemv16 takes the
 * K-quants at every row count up to PD_GEMV16_ROWS, per 32 as pd_q_matmul's GEMM does above QK256_ROWS. */
#define PD_QK256_ROWS 4

/* cpu_ops.c */
int pd_paged_decode_attention(const float *q, int64_t q_stride, float *out, int64_t out_stride, const int64_t *rows,
                              const float *k_cache, const float *v_cache, const int32_t *block_tables, int64_t bt_stride,
                              const int32_t *seq_lens, int B, int H, int KVH, int D, int BS, float scale, int window);
void pd_rms_norm(const float *x, int64_t x_stride, float *residual, const float *w, float *out, int rows, int dim, float eps);
void pd_silu_mul(const float *gate_up, float *out, int rows, int inter);
void pd_rope_write_kv(float *qkv, int64_t qkv_stride, const int64_t *positions, const float *cos_t, const float *sin_t,
                      float *k_cache, float *v_cache, const int64_t *slots, int T, int H, int KVH, int D);
/* ... over an int8 KV cache (kernels/kv_quant.py rows: D uint8 codes of the Hadamard-rotated row, then its
 * float16 scale and int16 zero code) */
void pd_rope_write_kv_q8(float *qkv, int64_t qkv_stride, const int64_t *positions, const float *cos_t, const float *sin_t,
                         uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, int T, int H, int KVH, int D);
int pd_paged_decode_attention_q8(const float *q, int64_t q_stride, float *out, int64_t out_stride, const int64_t *rows,
                                 const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *block_tables, int64_t bt_stride,
                                 const int32_t *seq_lens, int B, int H, int KVH, int D, int BS, float scale, int window);

/* quant_ops.c */
void pd_q_dequant(const uint8_t *w, int64_t row_bytes, int qt, int K, const int64_t *rows, int n, float *out);
int pd_q_matmul(const float *x, int64_t xs, const uint8_t *w, int64_t row_bytes, int qt, int M, int N, int K, float *out,
                int64_t os, int activations);
int pd_f_matmul(const float *x, int64_t xs, const float *wf, int M, int N, int K, float *out, int64_t os);

/* The int8-activation GEMM (ACT_INT8 products, any row count) on AVX-512 VNNI (vpdpbusd);
 * returns 2 where not built (the avx2 and baseline variants: callers never offer it there), 3 for
 * a type it does not take (the K-quants). */
int pd_q_gemm_i8(const float *x, int64_t xs, const uint8_t *w, int64_t row_bytes, int qt, int M, int N, int K, float *out,
                 int64_t os);

/* gemv16_ops.c: a quantized weight's copy with 16 rows interleaved (the layout and its size are
 * described there, kernels/cpu_native.py gemv16_shape; N % 16 == 0; returns 1 for a shape or type it
 * does not take), and up to PD_GEMV16_ROWS int16-activation rows times it (per row the same bits as
 * pd_q_matmul's int16 path one row at a time for Q4_0 / Q4_1 / Q8_0; the K-quants per 32);
 * AVX-512 VNNI only: the other variants return 2 (3: a shape it does not take). */
int pd_q_repack16(const uint8_t *w, int64_t row_bytes, int qt, int N, int K, uint8_t *out);
int pd_q_gemv16(const float *x, int64_t xs, const uint8_t *w16, int qt, int M, int N, int K, float *out, int64_t os);
/* quant_ops.c (AVX2 and up), shared with gemv16_ops.c, not called through ctypes: rows of x
 * rounded to int16 per 32-wide block (codes xq, scales dx, block sums xsum). */
void pd_q16_activations(const float *x, int64_t xs, int M, int K, int16_t *xq, float *dx, float *xsum);
/* ... and a K-quant super-block spelled out (every variant): 256 codes c, scales s (Q6_K: 16, one a half block;
 * else 8) and offsets m (8; not Q6_K), exact float32, w = s * c (+ m) as gguf dequantizes it. */
void pd_qk_unpack(const uint8_t *blk, int qt, int16_t *c, float *s, float *m);
/* ... and a Q4_K / Q5_K super-block's 6-bit scale and min of block j (q: its 12 packed scale bytes, at offset 4). */
void pd_qk_scale_min(const uint8_t *q, int j, int *sc, int *mn);

/* peak_ops.c: `iters` rounds of independent multiply-adds on `threads` threads (kind 0 fp32 FMA,
 * 1 int16 pairs, 2 int8 quads, at this variant's widest instruction); returns the operations done
 * (2 per product) and, in *cpu_seconds (if not NULL), the longest CPU time a thread took. */
int64_t pd_peak_loop(int kind, int64_t iters, int threads, double *cpu_seconds);

/* step_ops.c: one quantized weight, N rows of K/32 GGUF blocks, row_bytes apart ... */
typedef struct {
    const uint8_t *w;
    int64_t row_bytes;
    int32_t qt, n, k, pad;
    const uint8_t *w16;  /* its pd_q_repack16 copy, or NULL: a step of <= PD_GEMV16_ROWS rows with int16 activations then runs pd_q_gemv16 */
} pd_qweight;

/* ... and one decoder layer: its two norm weights, an optional qkv bias (NULL: none), its weights
 * and its sliding window (0: full attention; pd_paged_decode_attention's window). A fused
 * projection whose parts differ in type (a Q4_K_M file's Q4_K q / k and Q6_K v) is up to
 * PD_QKV_PARTS (PD_GATE_UP_PARTS) weights, each writing its columns of the fused output; n == 0
 * ends the list. */
#define PD_QKV_PARTS 3
#define PD_GATE_UP_PARTS 2
typedef struct {
    const float *input_norm, *post_norm, *qkv_bias;
    pd_qweight qkv[PD_QKV_PARTS], o, gate_up[PD_GATE_UP_PARTS], down;
    int64_t window;
} pd_layer;

int pd_decode_layers(const pd_layer *layers, int L, char *kv, int64_t kv_layer_stride, int64_t kv_half_stride,
                     float *h, float *x, float *qkv, float *attn, float *o_out, float *gate_up, float *act, float *down, int T,
                     const int64_t *positions, const int64_t *slots, const float *cos_t, const float *sin_t, const int64_t *rows,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int H, int KVH, int D, int BS,
                     int hidden, int inter, float scale, float eps, int activations, int kv_int8);
#endif
