"""One rank's part of a Llama-family model under tensor parallelism (Megatron's layout).

Lifecycle: each of a worker's N rank processes builds `TPModel(cfg, shard(tensors), econf,
group)` once (runtime.tp.shard gives its weights); each projection is a kernels.linear
PackedLinear over the rank's shard (float or GGUF blocks; a fused qkv / gate_up whose parts differ
in type, a kernels.linear.SplitLinear of one per part). Rank 0's engine calls `forward(batch,
kv_cache)` as it calls runtime.model.LlamaModel's: it first broadcasts the step's plan, then
every rank runs `run` on it (the others from `follow`, their loop until rank 0 closes). Per
layer: column-parallel q/k/v (this rank's heads and KV heads: its KV pool holds its KV heads, or
it reads and writes only those of its worker's whole pool, `my_heads`),
attention over them (Qwen3's per-head q / k norms, held whole by every rank, first), row-parallel o and one all-reduce; column-parallel gate/up, row-parallel
down and one all-reduce (Gemma: each of the two sums is normalised after its all-reduce, by norms
every rank holds whole; GeGLU, soft-caps, the embedding scale and Gemma 3's local RoPE table as
runtime.model has them). The embedding and the LM head are split by vocabulary: partial
embeddings (zero rows for ids another rank holds) are all-reduced, partial logits gathered.
A mixture-of-experts layer (runtime.moe) holds every expert on every rank, each cut to a 1/N
share of its width (gate / up rows, down columns; Qwen2-MoE's shared expert as the dense MLP),
and the router whole: every rank routes its identical input alike, computes its share of the
chosen experts, and one all-reduce sums them. A GGUF's expert stacks, which TP 1 keeps in their
blocks (runtime.moe.PackedExperts), are dequantized to float here (runtime.tp.shard): cutting
each expert's width per rank in whole blocks is not done yet.
The slow twin is the TP 1 model (runtime.model), which the tests compare this with.
On CUDA each rank runs on its own GPU (econf.device: runtime.tp.rank_devices), the all-reduces and
the logits' gather are NCCL's, and GGUF blocks are dequantized (the Triton block kernel is TP 1's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import paged
from pdserve.kernels.linear import PackedLinear, SplitLinear
from pdserve.kernels.quant import QuantExperts, QuantTensor
from pdserve.kernels.torch_paged import soft_cap
from pdserve.runtime.config import EngineConfig, ModelConfig, RopeScaling
from pdserve.runtime.model import MixedBlocks, RMSNorm, _stack_rows, activation
from pdserve.runtime.moe import MoEBlock
from pdserve.runtime.rope import RotaryEmbedding
from pdserve.runtime.tp import RankGroup, StepPlan, batch_of, kv_head_range, plan_of, rank_config, shard, vocab_range


def _norm(w: torch.Tensor, eps: float, dtype, device, cfg: ModelConfig | None = None) -> RMSNorm:
    """An RMSNorm over w; Gemma's (cfg.norm_plus_one) keeps its (1 + w) in float32, as runtime.model does."""
    gemma = cfg is not None and cfg.norm_plus_one
    n = RMSNorm(w.shape[0], eps, gemma)
    n.weight.data = w.to(torch.float32 if gemma else dtype).to(device).contiguous()
    return n


def _fused(parts: list):
    """Rows of several shards stacked (q/k/v, gate/up): blocks stay blocks, side by side where
    their types differ (runtime.model._stack_rows)."""
    return _stack_rows(parts)


class _Layer:
    def __init__(self, t: dict, i: int, cfg: ModelConfig, linear, dtype: torch.dtype, device):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = torch.cat([t[a + n + ".bias"] for n in ("q_proj", "k_proj", "v_proj")]) if a + "q_proj.bias" in t else None
        self.qkv = linear(_fused([t[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")]), bias)
        self.o = linear(t[a + "o_proj.weight"], None)
        self.gate_up = self.down = self.moe = None
        if cfg.moe(i):  # this rank's share of every expert's width (runtime.moe); Qwen2-MoE's shared expert split likewise
            m = p + "mlp."
            shared = None
            if cfg.shared_expert_intermediate_size:
                s_gate_up = linear(_fused([t[m + "shared_expert.gate_proj.weight"], t[m + "shared_expert.up_proj.weight"]]), None)
                s_down = linear(t[m + "shared_expert.down_proj.weight"], None)
                act = activation(cfg.activation)

                def shared(x):
                    gate, up = s_gate_up(x).split(cfg.shared_expert_intermediate_size, dim=-1)
                    return s_down(act(gate) * up)

            def dense(w):
                return (w.dequantize() if isinstance(w, (QuantTensor, QuantExperts)) else w).to(dtype).to(device).contiguous()

            self.moe = MoEBlock(cfg, dense(t[m + "gate.weight"]), torch.cat([dense(t[m + "experts.gate_proj"]), dense(t[m + "experts.up_proj"])], 1),
                                dense(t[m + "experts.down_proj"]), shared, dense(t[m + "shared_expert_gate.weight"]) if shared else None)
            self.moe_linears = [s_gate_up, s_down] if shared else []
        else:
            self.gate_up = linear(_fused([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]), None)
            self.down = linear(t[p + "mlp.down_proj.weight"], None)
        def norm(name):
            return _norm(t[p + name + ".weight"], cfg.rms_eps, dtype, device, cfg)

        self.in_norm = norm("input_layernorm")
        self.window = cfg.window(i)  # sliding window in keys (0: full attention)
        self.local_rope = cfg.local_rope(i)  # Gemma 3's sliding layers rotate by the local table
        qk = cfg.qk_norm  # Qwen3, Gemma 3: per-head q / k RMSNorm (every rank holds them whole)
        self.q_norm = norm("self_attn.q_norm") if qk else None
        self.k_norm = norm("self_attn.k_norm") if qk else None
        # post_norm: the MLP input's; Gemma's attn_out_norm / mlp_out_norm normalise the all-reduced outputs
        self.post_norm = norm("pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm")
        self.attn_out_norm = norm("post_attention_layernorm") if cfg.sandwich_norms else None
        self.mlp_out_norm = norm("post_feedforward_layernorm") if cfg.sandwich_norms else None


class TPModel:
    def __init__(self, full: ModelConfig, tensors: dict, econf: EngineConfig, group: RankGroup):
        """tensors: this rank's shard (runtime.tp.shard) of the HF-named checkpoint tensors."""
        self.full, self.group, self.dtype = full, group, econf.torch_dtype
        self.cfg = rank_config(full, group.size)  # heads, KV heads, MLP width: this rank's
        self.device, self.backend = econf.device, econf.attention_backend
        kind = econf.linear_kind if econf.fast_path else "torch"

        def linear(w, bias):
            if isinstance(w, MixedBlocks):  # parts in different quantized types: one PackedLinear each, the bias split among them
                ends = torch.tensor([p.shape[0] for p in w.parts]).cumsum(0).tolist()
                return SplitLinear([linear(p, None if bias is None else bias[e - p.shape[0]:e]) for p, e in zip(w.parts, ends)])
            w = w if isinstance(w, QuantTensor) else w.to(self.dtype).to(self.device)
            return PackedLinear(w, None if bias is None else bias.to(self.dtype).to(self.device), kind, activations=econf.quant_activations)

        self.layers = [_Layer(tensors, i, self.cfg, linear, self.dtype, self.device) for i in range(full.num_layers)]
        embed = tensors["model.embed_tokens.weight"]
        self.embed = embed if isinstance(embed, QuantTensor) else embed.to(self.dtype).to(self.device)
        self.vocab_start, self.vocab_end = vocab_range(full.vocab_size, group.rank, group.size)
        # tied: the LM head reads the embedding's own device copy (a second .to(device) would copy it again)
        self.lm_head = linear(self.embed if full.tie_embeddings else tensors["lm_head.weight"], None)
        self.norm = _norm(tensors["model.norm.weight"], full.rms_eps, self.dtype, self.device, full)
        self.rope = RotaryEmbedding(full.head_dim, full.max_position, full.rope_theta, full.rope_scaling).to(self.device)
        self.rope_local = RotaryEmbedding(full.head_dim, full.max_position, full.rope_local_theta, RopeScaling()).to(self.device) \
            if any(layer.local_rope for layer in self.layers) else None
        self.scale = full.attention_scale
        self.act = activation(full.activation)
        self.kv_heads = slice(*kv_head_range(full.num_kv_heads, group.rank, group.size))  # this rank's KV heads in a whole worker's pool

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (blocks count as blocks; the norms, which every rank holds whole, too)."""
        def size(w):
            return w.nbytes if isinstance(w, QuantTensor) else w.numel() * w.element_size()

        lins = [self.lm_head, *(x for l in self.layers for x in (l.qkv, l.o, l.gate_up, l.down) if x is not None),
                *(x for l in self.layers if l.moe is not None for x in l.moe_linears)]
        lins = [part for x in lins for part in (x.parts if isinstance(x, SplitLinear) else (x,))]
        experts = sum(size(w) for l in self.layers if l.moe is not None
                      for w in (l.moe.router, l.moe.gate_up, l.moe.down, l.moe.shared_gate) if w is not None)
        embed = 0 if self.lm_head.weight is self.embed else size(self.embed)  # tied: one copy, counted once
        norms = [self.norm, *(n for l in self.layers for n in (l.in_norm, l.post_norm, l.q_norm, l.k_norm, l.attn_out_norm, l.mlp_out_norm)
                              if n is not None)]
        return embed + experts + sum(size(x.weight) for x in lins) + sum(size(n.weight) for n in norms)

    def __call__(self, batch, kv_cache: torch.Tensor) -> torch.Tensor:
        return self.forward(batch, kv_cache)

    def forward(self, batch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Rank 0: send the step's plan, then run it here too; (N, vocab) float32 logits."""
        self.group.send_plan(plan_of(batch))
        return self.run(batch, kv_cache)

    def follow(self, kv_cache: torch.Tensor) -> None:
        """Another rank: run rank 0's steps until it sends stop (or its group fails)."""
        while True:
            plan = self.group.recv_plan()
            if plan.stop:
                return
            self.run(batch_of(plan, self.device), kv_cache)

    def stop_followers(self) -> None:
        self.group.send_plan(StepPlan(stop=True))

    def my_heads(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """This rank's KV heads, (layers, 2, num_blocks, block_size, KVH / N, D): kv_cache is either
        this rank's own pool or the worker's whole pool (every rank maps it; a view of its heads)."""
        return kv_cache[..., self.kv_heads, :] if kv_cache.shape[-2] == self.full.num_kv_heads and self.group.size > 1 else kv_cache

    @torch.inference_mode()
    def run(self, batch, kv_cache: torch.Tensor) -> torch.Tensor:
        kv_cache = self.my_heads(kv_cache)
        h = self._embed(batch.input_ids)  # (T, hidden)
        if self.full.embed_scale != 1.0:  # Gemma, as runtime.model
            h = h * torch.tensor(self.full.embed_scale, dtype=torch.float32).to(h.dtype)
        for i, layer in enumerate(self.layers):
            a = self.group.all_reduce(self._attention(layer, layer.in_norm(h), batch, kv_cache[i, 0], kv_cache[i, 1]))
            h = h + (a if layer.attn_out_norm is None else layer.attn_out_norm(a))
            if layer.moe is not None:  # every rank routes the same (whole) input alike; its experts' partial sums
                m = self.group.all_reduce(layer.moe(layer.post_norm(h)))
            else:
                gate, up = layer.gate_up(layer.post_norm(h)).split(self.cfg.intermediate_size, dim=-1)
                m = self.group.all_reduce(layer.down(self.act(gate) * up))
            h = h + (m if layer.mlp_out_norm is None else layer.mlp_out_norm(m))
        h = self.norm(h[batch.logits_indices])  # (N, hidden)
        return self._logits(soft_cap(self.lm_head(h), self.full.final_softcap).float())

    def _attention(self, layer: _Layer, x, batch, k_cache, v_cache) -> torch.Tensor:
        c = self.cfg
        T = x.shape[0]
        q, k, v = layer.qkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.reshape(T, c.num_heads, c.head_dim)  # (T, H / N, D)
        k = k.reshape(T, c.num_kv_heads, c.head_dim)  # (T, KVH / N, D)
        v = v.reshape(T, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = (self.rope_local if layer.local_rope else self.rope)(batch.positions, q, k)
        paged.write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        out = paged.paged_attention(
            q, k_cache, v_cache, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, block_tables=batch.block_tables,
            max_query_len=batch.max_query_len, scale=self.scale, backend=self.backend, window=layer.window, softcap=self.full.attn_softcap)
        return layer.o(out.reshape(T, c.q_size).contiguous())  # (T, hidden): this rank's partial sum

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: this rank's rows, zeros for the others', summed over ranks."""
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, 0)
        if isinstance(self.embed, QuantTensor):
            rows = self.embed.rows_float(local).to(self.dtype)
        else:
            rows = F.embedding(local, self.embed)
        return self.group.all_reduce(rows * mine.unsqueeze(1).to(rows.dtype))

    def _logits(self, part: torch.Tensor) -> torch.Tensor:
        """(N, vocab / N) on each rank -> (N, vocab): every rank's columns, padded to one width."""
        per = -(-self.full.vocab_size // self.group.size)
        if part.shape[0] == 0:  # a step that samples nothing (a prompt's middle chunk): every rank runs the same plan, none gathers
            return part.new_empty(0, self.full.vocab_size)
        if part.shape[1] < per:
            part = F.pad(part, (0, per - part.shape[1]))
        return torch.cat(self.group.all_gather(part), dim=1)[:, :self.full.vocab_size]


def build_tp_model(cfg: ModelConfig, tensors: dict, econf: EngineConfig, group: RankGroup) -> TPModel:
    """This rank's model from the whole checkpoint's tensors (the rest is dropped by the caller);
    GGUF blocks stay blocks where TP 1 would keep them on the CPU (runtime.engine), else (and
    always on CUDA) are dequantized."""
    from pdserve.runtime.engine import _why_not_quantized, check_attention_backend
    from pdserve.runtime.weights import dequantize_all

    check_attention_backend(cfg, econf)
    part = shard(cfg, tensors, group.rank, group.size)
    if any(isinstance(v, QuantTensor) for v in part.values()) and (econf.device.startswith("cuda") or _why_not_quantized(econf)):
        part = dequantize_all(part)
    return TPModel(cfg, part, econf, group)
