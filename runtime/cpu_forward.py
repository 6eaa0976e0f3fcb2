"""The CPU fast path of `LlamaModel.forward`: the same math in fewer, fused steps.

Lifecycle: `CpuForward.build(model)` is called once after the weights are loaded (by
`LlamaModel.enable_fast_path`); through runtime.layer.build_layers (its builder `_FusedParts`) it
packs every projection into a `pdserve.kernels.linear.PackedLinear`
and loads the fused C kernels (kernels.cpu_native); a weight the model keeps quantized
(kernels.quant.QuantTensor) becomes a quantized linear layer (a fused projection whose parts
differ in type, model.QuantRows, a kernels.linear.SplitLinear of one per part), and a quantized embedding is read
row by row. It returns None where the fast path cannot run (not float32 on the CPU, or no C
compiler), and the model keeps its module forward, which stays the slow twin this path is
tested against (for a quantized model, the twin is the same file loaded dequantized). `__call__(batch, kv_cache)` then replaces the
module forward for every step.

A decode-only step of a model whose projections are all quantized (the default model served
`--quantization auto`; a SplitLinear's parts each in its own type) makes one C call for all layers (kernels/csrc/step_ops.c: the same
kernels in the same order, so the same bits as the loop below, its twin). Otherwise it runs
runtime.layer's one decoder layer with `FusedOps`, the fused kernels for its parts; per layer
eight calls instead of about forty torch ops: RMSNorm fused with the
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
the C step is the Llama layer only). A quantized KV cache (kernels.kv_quant, --kv-cache-dtype):
int8 is written and read by the C kernels (the one-call step included); fp8 rows are written by
paged.write_kv from the C RoPE's float rows and read by kernels.torch_paged (decode rows
included), so an fp8 cache keeps a model off the one-call step. Gemma's options run here as in the module forward: the
embedding scale and the final soft-cap around the layers, each layer's own RoPE table (Gemma 3),
the attention output's and the MLP output's norms (`sandwich_norms`: the C RMSNorm without a
residual, then the usual fused add + norm), GeGLU in torch, and a soft-capped attention
(Gemma 2) through kernels.torch_paged's eager path for every row, decode rows included (the C
decode kernel has no soft-cap). A layer with a sliding window
(ModelConfig.window) passes it to every attention call: the C decode kernel reads only the last
`window` keys, the sdpa calls take transformers' sliding-window mask over the pages from the
first one the window reaches (kernels.torch_paged; those before may be freed, runtime.kv_cache).
A model with KV groups (runtime.kv_groups: sliding layers beside full ones) reads each layer's
pages through its group's slots and tables (`FusedOps.use_group`, ForwardBatch.group_slots /
group_tables) and never takes the one-call step, whose C loop holds one table for every layer
(`one_call_blocker`).
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

from pdserve.kernels import cpu_native, kv_quant, paged, quant, select
from pdserve.kernels.linear import PackedLinear, SplitLinear
from pdserve.kernels.torch_paged import attend_fresh, attend_one, decode_batched, gather_pages, soft_cap, window_page
from pdserve.runtime.blocks import QuantExpertStack, QuantRows
from pdserve.runtime.layer import MODULE_NAMES, GatedMLP, activation, build_layers, embedding_scale, kv_views, one_call_blocker, run_layers
from pdserve.runtime.moe import MoEBlock, PackedExperts

__all__ = ["CpuForward", "one_call_blocker"]


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
        self.embed_scale = embedding_scale(c, torch.float32)
        self.cos, self.sin = model.rope.cos.contiguous(), model.rope.sin.contiguous()
        self.layers = build_layers(c, _FusedParts(model, ops, linear_kind, activations))
        self.final_norm = model.norm.weight
        self.lm_head = PackedLinear(model.weight("embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"), None, linear_kind,
                                    activations=activations)
        # the step's scratch rows, in the layer's order: qkv, attention output, o, gate_up, silu * up, down
        self.widths = (c.q_size + 2 * c.kv_size, c.q_size, c.hidden_size, 2 * c.intermediate_size, c.intermediate_size, c.hidden_size)
        self._kv_key, self._kv = None, []
        # every projection quantized: a decode-only step runs all layers in one C call (step_ops.c);
        # fused_step False keeps the per-op loop, the twin it is tested against
        self.one_call_blocker = one_call_blocker(c)
        self.step_layers = None if self.one_call_blocker else _step_layers(self.layers, c.num_heads, activations, self.cos, self.sin)
        self.fused_step = self.step_layers is not None
        # one projection of each weight shape and type: back-ends are assigned per shape key (runtime.linear_plan), so
        # these answer for every layer's (a mixed-type file's layers differ in their parts' types) at each decode step
        self._step_kinds = list({select.shape_key(p.weight): p for layer in self.layers for p in packed_linears(layer)}.values())
        self.linear_table = None  # a kernels.select.Table once runtime.linear_plan installs one
        self.batch_fresh = True  # equal-length fresh prompts attend in one call (off: per prompt, the twin)
        shapes = {}  # one layer of each weight shape: oneDNN's primitives are per shape, not per weight
        for lin in [self.lm_head, *(x for layer in self.layers for x in packed_linears(layer))]:
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
        # outputs every layer overwrites (a quantized linear writes into them; other kinds allocate)
        bufs = tuple(torch.empty((tokens, w), dtype=h.dtype) for w in self.widths)
        if self.fused_step and not plan.prefills and not plan.fresh and tokens <= quant.DIRECT_ROWS and self._c_step(tokens) \
                and kv_cache.dtype in kv_quant.C_READABLE:  # an fp8 cache: the per-op loop (its attention is torch's)
            x = torch.empty_like(h)
            ops.rms_norm(h, self.layers[0].attn_norm, x, self.eps)
            ops.decode_layers(self.step_layers, kv_cache, h, x, bufs, batch.positions, batch.slot_mapping, plan.decode_rows,
                              plan.decode_tables, plan.decode_lens, self.scale, self.eps)
            delta = bufs[5]
        else:
            delta = run_layers(FusedOps(self, batch, plan, h, bufs), self.layers, h, self._kv_views(kv_cache))
        rows = batch.logits_indices
        last = torch.empty((rows.numel(), c.hidden_size), dtype=h.dtype)
        ops.rms_norm(delta[rows], self.final_norm, last, self.eps, residual=h[rows])
        return soft_cap(self.lm_head(last), c.final_softcap).float()  # (N, vocab)

    def _c_step(self, tokens: int) -> bool:
        """Whether the layers' back-ends at this many rows are the C kernel the one-call step runs."""
        c_kernel = ("rules", f"c-{self.activations}")
        return all(p.backend_at(tokens) in c_kernel for p in self._step_kinds)

    def _kv_views(self, kv_cache: torch.Tensor) -> list:
        """Each layer's (k_cache, v_cache) views (runtime.layer.kv_views), made once per pool instead of per step."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if self._kv_key != key:
            self._kv_key, self._kv = key, kv_views(self.cfg, kv_cache)
        return self._kv


class FusedOps:
    """runtime.layer's parts as the fused CPU kernels compute them, for one step: the C RMSNorm
    fused with the residual add (h updated in place), the packed projections writing into the
    step's scratch rows, Qwen3's per-head q / k norms in torch (the module form's RMSNorm modules,
    so the same bits), RoPE fused with the KV write, the attention of `_AttentionPlan`'s rows, the
    C silu * up (GeGLU: torch). Eight calls a layer instead of about forty torch ops."""

    __slots__ = ("f", "k", "batch", "plan", "x", "normed", "qkv_out", "attn_out", "o_out", "gate_up_out", "act_out", "down_out",
                 "groups", "plans")

    def __init__(self, fast: CpuForward, batch, plan: _AttentionPlan, h: torch.Tensor, bufs: tuple):
        self.f, self.k, self.batch, self.plan = fast, fast.ops, batch, plan
        self.x = torch.empty_like(h)  # each norm's output: the next projection's input
        self.qkv_out, self.attn_out, self.o_out, self.gate_up_out, self.act_out, self.down_out = bufs
        self.normed = torch.empty_like(h) if fast.layers[0].attn_out_norm is not None else None  # Gemma: an output's norm
        # KV groups (runtime.kv_groups): each group's batch (its slots and tables) and attention plan, made on first use
        self.groups = batch.group_batches()
        self.plans: list = [None] * len(self.groups)

    def use_group(self, g: int) -> None:
        """Point the KV write and attention at KV group g's slots and tables (a batch of one table
        for every layer, as runtime.linear_plan's timing batch: that one)."""
        if not self.groups:
            return
        if self.plans[g] is None:
            self.plans[g] = _AttentionPlan.of(self.groups[g], self.f.batch_fresh)
        self.batch, self.plan = self.groups[g], self.plans[g]

    def add_norm(self, p, delta, h, weight):
        if delta is None:
            self.k.rms_norm(h, weight, self.x, self.f.eps, check=p.check)
        else:
            self.k.rms_norm(delta, weight, self.x, self.f.eps, residual=h, check=p.check)
        return self.x

    def norm(self, p, x, weight):
        self.k.rms_norm(x, weight, self.normed, self.f.eps, check=p.check)
        return self.normed

    def qkv(self, p, x):
        return p.qkv(x, self.qkv_out)  # (T, q + 2 kv)

    def qk_norm(self, p, qkv):
        """Each head of q and k in the qkv rows RMS-normalised in place, before RoPE."""
        c, tokens = self.f.cfg, qkv.shape[0]
        q = qkv[:, : c.q_size].view(tokens, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size:c.q_size + c.kv_size].view(tokens, c.num_kv_heads, c.head_dim)
        q.copy_(p.q_norm(q))
        k.copy_(p.k_norm(k))
        return qkv

    def rope_write_kv(self, p, qkv, k_cache, v_cache):
        """RoPE and the KV write in one C call (a float32 or int8 cache); an fp8 cache: the C call
        writes the step's rows into float scratch, which paged.write_kv quantizes into the pages."""
        c, b = self.f.cfg, self.batch
        if k_cache.dtype not in kv_quant.C_READABLE:
            tokens = qkv.shape[0]
            k_rows = torch.empty((tokens, c.num_kv_heads, c.head_dim))
            v_rows = torch.empty_like(k_rows)
            self.k.rope_write_kv(qkv, b.positions, p.rope[0], p.rope[1], k_rows, v_rows, torch.arange(tokens), c.num_heads,
                                 c.num_kv_heads, check=p.check)
            paged.write_kv(k_cache, v_cache, k_rows, v_rows, b.slot_mapping)
            return qkv
        self.k.rope_write_kv(qkv, b.positions, p.rope[0], p.rope[1], k_cache, v_cache, b.slot_mapping, c.num_heads, c.num_kv_heads,
                             check=p.check)
        return qkv

    def attention(self, p, qkv, k_cache, v_cache):
        """Decode rows straight from the pages (C, all sequences in one call; a soft-capped layer:
        torch's eager path, the C kernel has no soft-cap), fresh prompts in one sdpa, the other
        prefills one by one over their pages."""
        c, plan, attn, scale, window, cap = self.f.cfg, self.plan, self.attn_out, self.f.scale, p.window, p.softcap
        if plan.decode_rows is not None and (cap or k_cache.dtype not in kv_quant.C_READABLE):  # soft-cap, or an fp8 cache
            q = qkv[plan.decode_rows, : c.q_size].view(-1, c.num_heads, c.head_dim)
            out = decode_batched(q, k_cache, v_cache, plan.decode_lens, plan.decode_tables, scale, window, cap)
            attn[plan.decode_rows] = out.reshape(-1, c.q_size)
        elif plan.decode_rows is not None:
            self.k.decode_attention(qkv, attn, plan.decode_rows, k_cache, v_cache, plan.decode_tables, plan.decode_lens, scale,
                                    check=p.check, window=window)
        for start, n, length in plan.fresh:  # n prompts of one length, no cached prefix: one sdpa, K/V straight from qkv
            rows = qkv[start:start + n * length]
            q = rows[:, : c.q_size].view(n, length, c.num_heads, c.head_dim)
            k = rows[:, c.q_size:c.q_size + c.kv_size].view(n, length, c.num_kv_heads, c.head_dim)
            v = rows[:, c.q_size + c.kv_size:].view(n, length, c.num_kv_heads, c.head_dim)
            attn[start:start + n * length] = attend_fresh(q, k, v, scale, window, cap).reshape(n * length, c.q_size)
        for start, end, table, seq_len in plan.prefills:
            q = qkv[start:end, : c.q_size].view(end - start, c.num_heads, c.head_dim)
            k, v = gather_pages(k_cache, v_cache, table, seq_len, window_page(seq_len, end - start, window, k_cache.shape[1]))
            attn[start:end] = attend_one(q, k, v, scale, window, cap).reshape(end - start, c.q_size)
        return attn

    def o(self, p, attn):
        return p.o(attn, self.o_out)

    @staticmethod
    def reduce(x):
        return x

    def gate_up(self, p, x):
        return p.gate_up(x, self.gate_up_out)

    def act_mul(self, p, gate_up):
        return p.act(gate_up, self.act_out, p.check)

    def down(self, p, a):
        return p.down(a, self.down_out)

    def moe(self, p, x):
        return p.moe(x)  # router, the chosen experts only (runtime.moe), Qwen2-MoE's shared expert


class _FusedParts:
    """runtime.layer's builder for the CPU form: the model's norm weights, its projections packed
    (kernels.linear.PackedLinear; a fused projection whose parts differ in quantized type,
    model.QuantRows, a SplitLinear of one per part), each layer's RoPE table as (cos, sin)."""

    def __init__(self, model, ops: cpu_native.NativeOps, kind: str, activations: str):
        self.model, self.ops, self.kind, self.activations = model, ops, kind, activations

    def norm(self, i: int, name: str) -> torch.Tensor:
        return self.model.get_parameter(f"layers.{i}.{name}.weight")

    def head_norm(self, i: int, name: str):
        return self.model.get_submodule(f"layers.{i}.{name}")  # its RMSNorm module (FusedOps.qk_norm)

    def linear(self, i: int, role: str):
        return self._packed(f"layers.{i}.{MODULE_NAMES[role]}")

    def _packed(self, name: str):
        module = self.model.get_submodule(name)
        if isinstance(module, QuantRows):  # parts in different quantized types: one PackedLinear each
            return SplitLinear([PackedLinear(q.blocks, q.bias, self.kind, activations=self.activations) for q in module.parts])
        return PackedLinear(self.model.weight(name + ".weight"), module.bias, self.kind, activations=self.activations)

    def moe(self, i: int, shared: bool) -> MoEBlock:
        """The module's stacks as they are (float, or each expert's PackedLinears over its blocks: PackedExperts)."""
        mlp, p = self.model.layers[i].mlp, f"layers.{i}.mlp.shared_expert."
        expert = GatedMLP(self._packed(p + "gate_up_proj"), self._packed(p + "down_proj"), activation(self.model.cfg.activation)) \
            if shared else None

        def stack(w):
            return PackedExperts(w.parts, self.activations) if isinstance(w, QuantExpertStack) else w

        return MoEBlock(self.model.cfg, mlp.gate.weight, stack(mlp.experts_gate_up), stack(mlp.experts_down), expert,
                        None if mlp.shared_expert_gate is None else mlp.shared_expert_gate.weight)

    def rope(self, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.model.rope_local if local else self.model.rope
        return rope.cos.contiguous(), rope.sin.contiguous()

    def activation(self, name: str):
        """act(gate_up, out, check) -> out: the C silu * up, or GeGLU's gelu_pytorch_tanh(gate) * up in torch."""
        if name == "silu":
            silu_mul = self.ops.silu_mul

            def act(gate_up, out, check):
                silu_mul(gate_up, out, check=check)
                return out
            return act
        gelu = activation(name)

        def act(gate_up, out, check):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.mul(gelu(gate), up, out=out)
        return act


def packed_linears(layer) -> list:
    """A layer's PackedLinears (a SplitLinear's parts; a MoE layer's experts are not: they are read by expert)."""
    return [part for x in layer.linears() for part in (x.parts if isinstance(x, SplitLinear) else (x,))]


def _step_layers(layers: list, heads: int, activations: str, cos, sin) -> cpu_native.DecodeLayers | None:
    """The C description of the layers for the one-call decode step, or None unless every
    projection is quantized (a float projection runs oneDNN, which C cannot call); the caller
    first rules out the models whose layer the C step does not compute (`one_call_blocker`)."""
    def parts(lin) -> list:  # a SplitLinear's (parts of different types, in column order), or the one
        return lin.parts if isinstance(lin, SplitLinear) else [lin]

    def joined_bias(lin):  # one vector over every part's columns (a part without one: zeros), or None
        ps = parts(lin)
        if all(p.bias is None for p in ps):
            return None
        return ps[0].bias if len(ps) == 1 else torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in ps])

    if not all(p.quantized for layer in layers for p in packed_linears(layer)) \
            or any(p.bias is not None for layer in layers for lin in (layer.o, layer.gate_up, layer.down) for p in parts(lin)):
        return None
    return cpu_native.DecodeLayers([(layer.attn_norm, layer.mlp_norm, joined_bias(layer.qkv), [p.weight for p in parts(layer.qkv)],
                                     layer.o.weight, [p.weight for p in parts(layer.gate_up)], layer.down.weight) for layer in layers],
                                    heads, activations, cos, sin, tuple(layer.window for layer in layers))


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
