"""The CPU fast path of `LlamaModel.forward`: the same math in fewer, fused steps.

Lifecycle: `CpuForward.build(model)` is called once after the weights are loaded (by
`LlamaModel.enable_fast_path`); it packs every projection into a `pdserve.kernels.linear.PackedLinear`
and loads the fused C kernels (kernels.cpu_native); a weight the model keeps quantized
(kernels.quant.QuantTensor) becomes a quantized linear layer (a fused projection whose parts
differ in type, model.QuantRows, a kernels.linear.SplitLinear of one per part), and a quantized embedding is read
row by row. It returns None where the fast path cannot run (not float32 on the CPU, or no C
compiler), and the model keeps its module forward, which stays the slow twin this path is
tested against (for a quantized model, the twin is the same file loaded dequantized). `__call__(batch, kv_cache)` then replaces the
module forward for every step.

A decode-only step of a model whose projections are all quantized (the default model served
`--quantization auto`) makes one C call for all layers (kernels/csrc/step_ops.c: the same
kernels in the same order, so the same bits as the loop below, its twin). Otherwise, per layer
it makes eight calls instead of about forty torch ops: RMSNorm fused with the
residual add, the qkv GEMM, rotary embedding fused with the KV-cache write, attention, the o
GEMM, the second fused add + RMSNorm, the gate/up GEMM, silu * up, the down GEMM. Decode rows
(one query token) attend straight from the pages in C, all sequences in one call; a sequence
with a longer query (prefill, chunked prefill) runs the torch path's per-sequence sdpa, shaped
as transformers' so that a prompt's first token is computed as HF computes it; prompts of one
length with no cached prefix, adjacent in the step, attend in one sdpa call instead
(`batch_fresh`; the per-prompt path is its twin). With a measured back-end table
(runtime.linear_plan) each projection runs the back-end its row count was given, and the one-call
decode step runs only where that is the C kernel it calls. Qwen3's per-head q / k RMSNorm runs
between the qkv GEMM and the rotary call, in torch (the module forward's RMSNorm modules), so
such a model never takes the one-call step (`one_call_blocker` names what keeps a model off it:
the C step is the Llama layer only). Gemma's options run here as in the module forward: the
embedding scale and the final soft-cap around the layers, each layer's own RoPE table (Gemma 3),
the attention output's and the MLP output's norms (`sandwich_norms`: the C RMSNorm without a
residual, then the usual fused add + norm), GeGLU in torch, and a soft-capped attention
(Gemma 2) through kernels.torch_paged's eager path for every row, decode rows included (the C
decode kernel has no soft-cap). A layer with a sliding window
(ModelConfig.window) passes it to every attention call: the C decode kernel reads only the last
`window` keys, the sdpa calls take transformers' sliding-window mask over the pages from the
first one the window reaches (kernels.torch_paged; those before may be freed, runtime.kv_cache).
A mixture-of-experts layer (Mixtral, Qwen3-MoE, Qwen2-MoE) replaces the gate/up, SwiGLU and down
calls by runtime.moe.MoEBlock: the router, then per chosen expert its two GEMMs over the tokens
that chose it, reading only that expert's slice of the stacked weights (never the others'; a
stack kept in GGUF blocks, model.QuantExpertStack, runs as runtime.moe.PackedExperts: each
expert's PackedLinears over its own blocks, the C quantized kernels), and
Qwen2-MoE's shared expert through PackedLinears; such a model decodes through the per-op loop.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_native, quant
from pdserve.kernels.linear import PackedLinear, SplitLinear
from pdserve.kernels.torch_paged import attend_fresh, attend_one, decode_batched, gather_pages, soft_cap, window_page
from pdserve.runtime.blocks import QuantExpertStack, QuantRows
from pdserve.runtime.moe import MoEBlock, PackedExperts


class CpuForward:
    def __init__(self, model, ops: cpu_native.NativeOps, linear_kind: str = "auto", activations: str = "float"):
        c = model.cfg
        self.cfg = c
        self.ops = ops
        self.activations = activations
        self.eps = c.rms_eps
        self.scale = c.attention_scale
        embed = model.weight("embed_tokens.weight")
        self.embed = embed.rows_float if isinstance(embed, quant.QuantTensor) else lambda ids: F.embedding(ids, embed)
        self.embed_scale = torch.tensor(c.embed_scale, dtype=torch.float32) if c.embed_scale != 1.0 else None
        self.cos, self.sin = model.rope.cos.contiguous(), model.rope.sin.contiguous()
        self.layers = [_Layer(model, i, linear_kind, activations) for i in range(c.num_layers)]
        self.final_norm = model.norm.weight
        self.lm_head = PackedLinear(model.weight("embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"), None, linear_kind,
                                    activations=activations)
        # the step's scratch rows, in _layers' order: qkv, attention output, o, gate_up, silu * up, down
        self.widths = (c.q_size + 2 * c.kv_size, c.q_size, c.hidden_size, 2 * c.intermediate_size, c.intermediate_size, c.hidden_size)
        self._kv_key, self._kv = None, []
        # every projection quantized: a decode-only step runs all layers in one C call (step_ops.c);
        # fused_step False keeps the per-op loop, the twin it is tested against
        self.one_call_blocker = one_call_blocker(c)
        self.step_layers = None if self.one_call_blocker else _step_layers(self.layers, c.num_heads, activations, self.cos, self.sin,
                                                                          c.layer_windows)
        self.fused_step = self.step_layers is not None
        self.linear_table = None  # a kernels.select.Table once runtime.linear_plan installs one
        self.batch_fresh = True  # equal-length fresh prompts attend in one call (off: per prompt, the twin)
        shapes = {}  # one layer of each weight shape: oneDNN's primitives are per shape, not per weight
        for lin in [self.lm_head, *(x for layer in self.layers for x in layer.linears())]:
            shapes.setdefault((lin.out_features, lin.in_features, lin.bias is not None), lin)
        for lin in shapes.values():
            lin.warm()

    @classmethod
    def build(cls, model, linear_kind: str = "auto", activations: str = "float") -> CpuForward | None:
        if model.norm.weight.device.type != "cpu" or model.dtype != torch.float32:
            return None
        ops = cpu_native.native()
        return None if ops is None else cls(model, ops, linear_kind, activations)

    @torch.inference_mode()
    def __call__(self, batch, kv_cache: torch.Tensor) -> torch.Tensor:
        c, ops = self.cfg, self.ops
        tokens = batch.input_ids.numel()
        plan = _AttentionPlan.of(batch, self.batch_fresh)
        h = self.embed(batch.input_ids)  # (T, hidden): the residual stream, updated in place
        if self.embed_scale is not None:
            h.mul_(self.embed_scale)
        x = torch.empty_like(h)
        ops.rms_norm(h, self.layers[0].input_norm, x, self.eps)
        # outputs every layer overwrites (a quantized linear writes into them; other kinds allocate)
        bufs = tuple(torch.empty((tokens, w), dtype=h.dtype) for w in self.widths)
        if self.fused_step and not plan.prefills and not plan.fresh and tokens <= quant.DIRECT_ROWS and self._c_step(tokens):
            ops.decode_layers(self.step_layers, kv_cache, h, x, bufs, batch.positions, batch.slot_mapping, plan.decode_rows,
                              plan.decode_tables, plan.decode_lens, self.scale, self.eps)
            delta = bufs[5]
        else:
            delta = self._layers(batch, plan, kv_cache, h, x, bufs)
        rows = batch.logits_indices
        last = torch.empty((rows.numel(), c.hidden_size), dtype=h.dtype)
        ops.rms_norm(delta[rows], self.final_norm, last, self.eps, residual=h[rows])
        return soft_cap(self.lm_head(last), c.final_softcap).float()  # (N, vocab)

    def _c_step(self, tokens: int) -> bool:
        """Whether the layers' back-ends at this many rows are the C kernel the one-call step runs."""
        layer, c_kernel = self.layers[0], ("rules", f"c-{self.activations}")
        return all(lin.backend_at(tokens) in c_kernel for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))

    def _layers(self, batch, plan: _AttentionPlan, kv_cache, h, x, bufs) -> torch.Tensor:
        """Every decoder layer, eight calls each; returns the last layer's output (not yet added
        into the residual stream h)."""
        c, ops = self.cfg, self.ops
        qkv_out, attn, o_out, gate_up_out, act, down_out = bufs
        normed = torch.empty_like(o_out) if c.sandwich_norms else None  # Gemma: an output's norm before it joins h
        delta = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, self._kv_views(kv_cache))):
            check = i == 0  # every layer passes tensors of the same kinds and shapes: the first one checks them
            if delta is not None:
                ops.rms_norm(delta, layer.input_norm, x, self.eps, residual=h, check=check)
            qkv = layer.qkv(x, qkv_out)  # (T, q + 2 kv)
            if layer.q_norm is not None:
                self._qk_norm(layer, qkv)
            ops.rope_write_kv(qkv, batch.positions, layer.cos, layer.sin, k_cache, v_cache, batch.slot_mapping, c.num_heads,
                              c.num_kv_heads, check=check)
            self._attention(plan, qkv, attn, k_cache, v_cache, check, layer.window)
            o = layer.o(attn, o_out)
            if normed is not None:
                ops.rms_norm(o, layer.attn_out_norm, normed, self.eps, check=check)
                o = normed
            ops.rms_norm(o, layer.post_norm, x, self.eps, residual=h, check=check)
            if layer.moe is not None:  # router, the chosen experts only (runtime.moe), Qwen2-MoE's shared expert
                delta = layer.moe(x)
                continue
            gate_up = layer.gate_up(x, gate_up_out)
            if c.activation == "silu":
                ops.silu_mul(gate_up, act, check=check)
            else:  # GeGLU: gelu_pytorch_tanh(gate) * up, in torch
                torch.mul(F.gelu(gate_up[:, :c.intermediate_size], approximate="tanh"), gate_up[:, c.intermediate_size:], out=act)
            delta = layer.down(act, down_out)
            if normed is not None:
                ops.rms_norm(delta, layer.mlp_out_norm, normed, self.eps, check=check)
                delta = normed
        return delta

    def _qk_norm(self, layer: _Layer, qkv: torch.Tensor) -> None:
        """Qwen3: RMSNorm each head of q and k in the qkv rows, in place, before RoPE; the module
        forward's own RMSNorm modules, so the same bits as its twin and as transformers."""
        c, tokens = self.cfg, qkv.shape[0]
        q = qkv[:, : c.q_size].view(tokens, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size:c.q_size + c.kv_size].view(tokens, c.num_kv_heads, c.head_dim)
        q.copy_(layer.q_norm(q))
        k.copy_(layer.k_norm(k))

    def _kv_views(self, kv_cache: torch.Tensor) -> list:
        """Each layer's (k_cache, v_cache) views, made once per pool instead of per step."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if self._kv_key != key:
            self._kv_key, self._kv = key, [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(kv_cache.shape[0])]
        return self._kv

    def _attention(self, plan: _AttentionPlan, qkv, attn, k_cache, v_cache, check: bool = True, window: int = 0) -> None:
        c, cap = self.cfg, self.cfg.attn_softcap
        if plan.decode_rows is not None and cap:  # the C kernel has no soft-cap: torch's eager path
            q = qkv[plan.decode_rows, : c.q_size].view(-1, c.num_heads, c.head_dim)
            out = decode_batched(q, k_cache, v_cache, plan.decode_lens, plan.decode_tables, self.scale, window, cap)
            attn[plan.decode_rows] = out.reshape(-1, c.q_size)
        elif plan.decode_rows is not None:
            self.ops.decode_attention(qkv, attn, plan.decode_rows, k_cache, v_cache, plan.decode_tables, plan.decode_lens, self.scale,
                                      check=check, window=window)
        for start, n, length in plan.fresh:  # n prompts of one length, no cached prefix: one sdpa, K/V straight from qkv
            rows = qkv[start:start + n * length]
            q = rows[:, : c.q_size].view(n, length, c.num_heads, c.head_dim)
            k = rows[:, c.q_size:c.q_size + c.kv_size].view(n, length, c.num_kv_heads, c.head_dim)
            v = rows[:, c.q_size + c.kv_size:].view(n, length, c.num_kv_heads, c.head_dim)
            attn[start:start + n * length] = attend_fresh(q, k, v, self.scale, window, cap).reshape(n * length, c.q_size)
        for start, end, table, seq_len in plan.prefills:
            q = qkv[start:end, : c.q_size].view(end - start, c.num_heads, c.head_dim)
            k, v = gather_pages(k_cache, v_cache, table, seq_len, window_page(seq_len, end - start, window, k_cache.shape[1]))
            attn[start:end] = attend_one(q, k, v, self.scale, window, cap).reshape(end - start, c.q_size)


def one_call_blocker(cfg) -> str | None:
    """What in this model the one-call C decode step (kernels/csrc/step_ops.c, the Llama layer:
    norm, qkv, one RoPE table, C attention, o, add + norm, SwiGLU, down) does not compute, or
    None. Such a model decodes through the per-op loop, its twin. The attention scale, the
    embedding scale and the final soft-cap lie outside the layers' C code (an argument, or
    before and after it), so they do not block it."""
    if cfg.qk_norm:
        return "per-head q/k norms (Qwen3, Gemma 3)"
    if cfg.sandwich_norms:
        return "norms on the attention and MLP outputs (Gemma)"
    if cfg.activation != "silu":
        return f"the {cfg.activation} MLP activation (Gemma's GeGLU)"
    if cfg.attn_softcap:
        return "attention soft-capping (Gemma 2)"
    if any(cfg.local_rope(i) for i in range(cfg.num_layers)):
        return "a second RoPE table for the sliding layers (Gemma 3)"
    if cfg.num_experts:
        return "mixture-of-experts layers (Mixtral, Qwen-MoE; the C step's MLP is dense)"
    return None


def _step_layers(layers: list, heads: int, activations: str, cos, sin, windows: tuple = ()) -> cpu_native.DecodeLayers | None:
    """The C description of the layers for the one-call decode step, or None unless every
    projection is quantized (a float projection runs oneDNN, which C cannot call); the caller
    first rules out the models whose layer the C step does not compute (`one_call_blocker`)."""
    if not all(lin.quantized and lin.bias is None for layer in layers for lin in (layer.o, layer.gate_up, layer.down)) \
            or not all(layer.qkv.quantized for layer in layers):
        return None
    return cpu_native.DecodeLayers([(layer.input_norm, layer.post_norm, layer.qkv.bias, layer.qkv.weight, layer.o.weight,
                                     layer.gate_up.weight, layer.down.weight) for layer in layers], heads, activations, cos, sin, windows)


class _Layer:
    """One decoder layer's weights in fast-path form."""

    def __init__(self, model, i: int, kind: str, activations: str):
        layer, p = model.layers[i], f"layers.{i}."
        self.input_norm = layer.input_layernorm.weight
        # post_norm: the MLP input's norm (fused with the residual add); Gemma's sandwich adds the attention
        # output's (its post_attention_layernorm) and the MLP output's norms, applied without a residual
        if model.cfg.sandwich_norms:
            self.post_norm = layer.pre_feedforward_layernorm.weight
            self.attn_out_norm, self.mlp_out_norm = layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight
        else:
            self.post_norm = layer.post_attention_layernorm.weight
        self.q_norm, self.k_norm = layer.self_attn.q_norm, layer.self_attn.k_norm  # RMSNorm modules (Qwen3, Gemma 3), or None
        rope = model.layer_rope(i)  # Gemma 3's sliding layers: the local table
        self.cos, self.sin = rope.cos.contiguous(), rope.sin.contiguous()
        self.window = model.cfg.window(i)  # sliding window in keys (0: full attention), read once at build

        def linear(name, bias=None):
            module = model.get_submodule(p + name.removesuffix(".weight"))
            if isinstance(module, QuantRows):  # parts in different quantized types: one PackedLinear each
                return SplitLinear([PackedLinear(q.blocks, q.bias, kind, activations=activations) for q in module.parts])
            return PackedLinear(model.weight(p + name), bias, kind, activations=activations)

        self.qkv = linear("self_attn.qkv_proj.weight", layer.self_attn.qkv_proj.bias)
        self.o = linear("self_attn.o_proj.weight")
        self.moe = self.gate_up = self.down = self.shared_gate_up = self.shared_down = None
        if not model.cfg.moe(i):
            self.gate_up = linear("mlp.gate_up_proj.weight")
            self.down = linear("mlp.down_proj.weight")
            return
        # a mixture of experts: the stacks are the module's own tensors (read by expert, runtime.moe)
        mlp, shared = layer.mlp, None
        if mlp.shared_expert is not None:  # Qwen2-MoE: its shared expert runs as a dense MLP does here
            self.shared_gate_up, self.shared_down = linear("mlp.shared_expert.gate_up_proj.weight"), linear("mlp.shared_expert.down_proj.weight")
            ops = cpu_native.native()

            def shared(x):
                gate_up = self.shared_gate_up(x)
                act = torch.empty((x.shape[0], gate_up.shape[1] // 2), dtype=x.dtype)
                ops.silu_mul(gate_up.contiguous(), act)
                return self.shared_down(act)

        def stack(w):  # a float stack as it is; one kept in blocks: each expert's PackedLinears over its blocks
            return PackedExperts(w.parts, activations) if isinstance(w, QuantExpertStack) else w

        self.moe = MoEBlock(model.cfg, mlp.gate.weight, stack(mlp.experts_gate_up), stack(mlp.experts_down), shared,
                            None if mlp.shared_expert_gate is None else mlp.shared_expert_gate.weight)

    def linears(self) -> list:
        """This layer's PackedLinears (a SplitLinear's parts; a MoE layer's experts are not: they are read by expert)."""
        lins = [x for x in (self.qkv, self.o, self.gate_up, self.down, self.shared_gate_up, self.shared_down) if x is not None]
        return [part for x in lins for part in (x.parts if isinstance(x, SplitLinear) else (x,))]


class _AttentionPlan:
    """Which query rows decode (one token, C kernel, one call) and which sequences prefill (torch)."""

    __slots__ = ("decode_rows", "decode_tables", "decode_lens", "prefills", "fresh")

    @classmethod
    def of(cls, batch, batch_fresh: bool = True) -> _AttentionPlan:
        """batch_fresh: runs of adjacent prompts of one length with no cached prefix attend in one
        call (`fresh`: (first row, prompts, length)); off: each prompt alone (the twin)."""
        plan = cls()
        starts = batch.query_start_loc.tolist()
        lens = batch.seq_lens.tolist()
        decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
        prefill = [i for i in range(len(lens)) if starts[i + 1] - starts[i] > 1]
        runs: list[list[int]] = []  # adjacent prompts of one length, none with a cached prefix
        for i in prefill if batch_fresh else ():
            if lens[i] == starts[i + 1] - starts[i]:
                prev = runs[-1][-1] if runs else None
                if prev is not None and starts[prev + 1] == starts[i] and lens[prev] == lens[i]:
                    runs[-1].append(i)
                else:
                    runs.append([i])
        runs = [r for r in runs if len(r) > 1]  # a lone prompt keeps attend_one (HF's exact call)
        plan.fresh = [(starts[r[0]], len(r), lens[r[0]]) for r in runs]
        batched = {i for r in runs for i in r}
        plan.prefills = [(starts[i], starts[i + 1], batch.block_tables[i], lens[i]) for i in prefill if i not in batched]
        plan.decode_rows = plan.decode_tables = plan.decode_lens = None
        if len(decode) == len(lens):
            plan.decode_rows = batch.query_start_loc[:-1].long()
            plan.decode_tables, plan.decode_lens = batch.block_tables, batch.seq_lens
        elif decode:
            idx = torch.tensor(decode)
            plan.decode_rows = torch.tensor([starts[i] for i in decode], dtype=torch.int64)
            plan.decode_tables = batch.block_tables.index_select(0, idx).contiguous()
            plan.decode_lens = batch.seq_lens.index_select(0, idx).contiguous()
        return plan
