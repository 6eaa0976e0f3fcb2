/* A whole decode step's decoder layers in one C call, for a model whose projections are all
 * GGUF-quantized (kernels/quant.py): the same kernels, in the same order, with the same
 * arguments as kernels.cpu_forward's per-op loop, without the Python round trip (argument
 * checks, ctypes marshalling) of each of the 8 calls per layer. Built into the same library as
 * cpu_ops.c and quant_ops.c; called by kernels/cpu_native.py NativeOps.decode_layers.
 *
 * Because every op is the same C function on the same buffers, the result equals the per-op
 * loop bit for bit; that loop stays the twin (tests/runtime/test_quantized.py compares them).
 */
#include "pd_ops.h"

/* x (M, w->k) times weight w into out (M, w->n), its rows ld apart. */
static int q_mm(const pd_qweight *w, const float *x, int M, float *out, int64_t ld, int i8) {
    if (w->w16 && i8 == ACT_INT16 && M <= PD_GEMV16_ROWS)  /* 16 rows a vector (gemv16_ops.c): the bound linear's path */
        return pd_q_gemv16(x, w->k, w->w16, w->qt, M, w->n, w->k, out, ld);
    return pd_q_matmul(x, w->k, w->w, w->row_bytes, w->qt, M, w->n, w->k, out, ld, i8);
}

/* The output width of a fused projection's parts (n == 0 ends them). */
static int parts_width(const pd_qweight *parts, int count) {
    int w = 0;
    for (int i = 0; i < count && parts[i].n; i++) w += parts[i].n;
    return w;
}

/* A fused projection's parts into their columns of out (M, ld). */
static int q_mm_parts(const pd_qweight *parts, int count, const float *x, int M, float *out, int64_t ld, int i8) {
    for (int i = 0, col = 0; i < count && parts[i].n; col += parts[i].n, i++)
        if (q_mm(parts + i, x, M, out + col, ld, i8)) return 1;
    return 0;
}

/* T decode rows (one query token per sequence, B = T sequences, row b is sequence b) through L
 * layers. h (T, hidden): the residual stream; x: layer 0's normalised input on entry. Scratch
 * rows: qkv (T, qkv.n), attn (T, H*D), o_out (T, hidden), gate_up (T, 2*inter), act (T, inter),
 * down (T, hidden): on return down holds the last layer's output, not yet added into h (the
 * caller's final norm adds it). Layer l's k cache is kv + l * kv_layer_stride bytes, its v cache
 * kv_half_stride bytes further; kv_int8: the pool is an int8 cache (kernels/kv_quant.py rows: uint8 codes
 * of the Hadamard-rotated row + float16 scale + int16 zero code), written and read by the _q8 kernels, else float32. Returns nonzero if a scratch allocation failed. */
int pd_decode_layers(const pd_layer *layers, int L, char *kv, int64_t kv_layer_stride, int64_t kv_half_stride,
                     float *h, float *x, float *qkv, float *attn, float *o_out, float *gate_up, float *act, float *down, int T,
                     const int64_t *positions, const int64_t *slots, const float *cos_t, const float *sin_t, const int64_t *rows,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int H, int KVH, int D, int BS,
                     int hidden, int inter, float scale, float eps, int activations, int kv_int8) {
    for (int l = 0; l < L; l++) {
        const pd_layer *ly = layers + l;
        char *k_cache = kv + l * kv_layer_stride, *v_cache = k_cache + kv_half_stride;
        if (l > 0) pd_rms_norm(down, hidden, h, ly->input_norm, x, T, hidden, eps);
        const int qkv_n = parts_width(ly->qkv, PD_QKV_PARTS);
        if (q_mm_parts(ly->qkv, PD_QKV_PARTS, x, T, qkv, qkv_n, activations)) return 1;
        if (ly->qkv_bias)
            for (int t = 0; t < T; t++)
                for (int j = 0; j < qkv_n; j++) qkv[(int64_t)t * qkv_n + j] += ly->qkv_bias[j];
        if (kv_int8) {
            pd_rope_write_kv_q8(qkv, qkv_n, positions, cos_t, sin_t, (uint8_t *)k_cache, (uint8_t *)v_cache, slots, T, H, KVH, D);
            if (pd_paged_decode_attention_q8(qkv, qkv_n, attn, (int64_t)H * D, rows, (const uint8_t *)k_cache, (const uint8_t *)v_cache,
                                             block_tables, bt_stride, seq_lens, T, H, KVH, D, BS, scale, (int)ly->window))
                return 1;
        } else {
            pd_rope_write_kv(qkv, qkv_n, positions, cos_t, sin_t, (float *)k_cache, (float *)v_cache, slots, T, H, KVH, D);
            if (pd_paged_decode_attention(qkv, qkv_n, attn, (int64_t)H * D, rows, (const float *)k_cache, (const float *)v_cache,
                                          block_tables, bt_stride, seq_lens, T, H, KVH, D, BS, scale, (int)ly->window))
                return 1;
        }
        if (q_mm(&ly->o, attn, T, o_out, ly->o.n, activations)) return 1;
        pd_rms_norm(o_out, hidden, h, ly->post_norm, x, T, hidden, eps);
        if (q_mm_parts(ly->gate_up, PD_GATE_UP_PARTS, x, T, gate_up, 2 * inter, activations)) return 1;
        pd_silu_mul(gate_up, act, T, inter);
        if (q_mm(&ly->down, act, T, down, ly->down.n, activations)) return 1;
    }
    return 0;
}
