"""One rank's part of a Llama-family model under tensor parallelism (Megatron's layout).

Lifecycle: each of a worker's N rank processes builds `TPModel(cfg, shard(tensors), econf,
group)` once, through runtime.build.build_model (runtime.tp.shard gives its weights; the builder
`_RankParts` makes runtime.layer's parts of each layer from them); each projection is a kernels.linear
PackedLinear over the rank's shard (float or GGUF blocks; a fused qkv / gate_up whose parts differ
in type, a kernels.linear.SplitLinear of one per part). Rank 0's engine calls `forward(batch,
kv_cache)` as it calls runtime.model.LlamaModel's: it first broadcasts the step's plan, then
every rank runs `run` on it (the others from `follow`, their loop until rank 0 closes): runtime.layer's
one decoder layer with runtime.layer.TorchOps whose `reduce` is the group's all-reduce. Per
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
chosen experts, and one all-reduce sums them. A GGUF's expert stacks stay in their blocks as at
TP 1: runtime.tp.shard cuts each rank's share in whole blocks and the rank runs it as
runtime.moe.PackedExperts (one PackedLinear per expert over its share); a down stack whose share is
not whole blocks comes as float from the shard (logged there) and runs as a float stack.
The slow twin is the TP 1 model (runtime.model), which the tests compare this with.
On CUDA each rank runs on its own GPU (econf.device: runtime.tp.rank_devices), the all-reduces and
the logits' gather are NCCL's, and GGUF blocks are dequantized (the Triton block kernel is TP 1's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.linear import PackedLinear, SplitLinear
from pdserve.kernels.quant import QuantTensor
from pdserve.kernels.torch_paged import soft_cap
from pdserve.runtime.blocks import ExpertBlocks, _expert_stack
from pdserve.runtime.config import EngineConfig, ModelConfig
from pdserve.runtime.layer import GatedMLP, TorchOps, activation, build_layers, embedding_scale, kv_views, rope_tables, run_layers
from pdserve.runtime.model import MixedBlocks, RMSNorm, _stack_rows
from pdserve.runtime.moe import MoEBlock, PackedExperts, stack_bytes
from pdserve.runtime.rope import RotaryEmbedding
from pdserve.runtime.tp import RankGroup, StepPlan, batch_of, kv_head_range, plan_of, rank_config, vocab_range


def _norm(w: torch.Tensor, eps: float, dtype, device, cfg: ModelConfig | None = None) -> RMSNorm:
    """An RMSNorm over w; Gemma's (cfg.norm_plus_one) keeps its (1 + w) in float32, as runtime.model does."""
    gemma = cfg is not None and cfg.norm_plus_one
    n = RMSNorm(w.shape[0], eps, gemma)
    n.weight.data = w.to(torch.float32 if gemma else dtype).to(device).contiguous()
    return n


_HF = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
       "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}  # runtime.layer.PROJECTIONS in HF names


class _RankParts:
    """runtime.layer's builder for a rank: its shard's projections (rows of several stacked, as
    runtime.model fuses them: blocks stay blocks, side by side where their types differ), the
    norms every rank holds whole, the rank's share of every expert."""

    def __init__(self, model: TPModel, t: dict, linear):
        self.m, self.t, self.linear_of = model, t, linear

    def norm(self, i: int, name: str) -> RMSNorm:
        m = self.m
        return _norm(self.t[f"model.layers.{i}.{name}.weight"], m.cfg.rms_eps, m.dtype, m.device, m.cfg)

    head_norm = norm

    def linear(self, i: int, role: str):
        p = f"model.layers.{i}."
        names = _HF[role]
        bias = torch.cat([self.t[p + n + ".bias"] for n in names]) if p + names[0] + ".bias" in self.t else None
        return self.linear_of(_stack_rows([self.t[p + n + ".weight"] for n in names]), bias)

    def moe(self, i: int, shared: bool) -> MoEBlock:
        """This rank's share of every expert's width (runtime.moe); Qwen2-MoE's shared expert split likewise."""
        m, t, p = self.m, self.t, f"model.layers.{i}.mlp."
        expert = GatedMLP(self.linear_of(_stack_rows([t[p + "shared_expert.gate_proj.weight"], t[p + "shared_expert.up_proj.weight"]]), None),
                          self.linear_of(t[p + "shared_expert.down_proj.weight"], None), activation(m.cfg.activation)) if shared else None

        def dense(w):  # the router (a GGUF's in blocks: dequantized, as TP 1's), the shared expert's gate, a float stack
            return (w.dequantize() if isinstance(w, QuantTensor) else w).to(m.dtype).to(m.device).contiguous()

        def stack(parts):
            """gate + up (or down alone): shares in blocks stay blocks (PackedExperts), float otherwise."""
            joined = parts[0] if len(parts) == 1 and isinstance(parts[0], torch.Tensor) else _expert_stack(parts)
            return PackedExperts(joined.parts, m.activations) if isinstance(joined, ExpertBlocks) else dense(joined)

        return MoEBlock(m.cfg, dense(t[p + "gate.weight"]), stack([t[p + "experts.gate_proj"], t[p + "experts.up_proj"]]),
                        stack([t[p + "experts.down_proj"]]), expert, dense(t[p + "shared_expert_gate.weight"]) if shared else None)

    def rope(self, local: bool) -> RotaryEmbedding:
        return self.m.rope_local if local else self.m.rope

    def activation(self, name: str):
        return activation(name)


class TPModel:
    def __init__(self, full: ModelConfig, tensors: dict, econf: EngineConfig, group: RankGroup):
        """tensors: this rank's shard (runtime.tp.shard) of the HF-named checkpoint tensors."""
        self.full, self.group, self.dtype = full, group, econf.torch_dtype
        self.cfg = rank_config(full, group.size)  # heads, KV heads, MLP width: this rank's
        self.device, self.backend = econf.device, econf.attention_backend
        kind = econf.linear_kind if econf.fast_path else "torch"
        self.activations = econf.quant_activations  # how the C kernels take a small batch over blocks (kernels.quant)

        def linear(w, bias):
            if isinstance(w, MixedBlocks):  # parts in different quantized types: one PackedLinear each, the bias split among them
                ends = torch.tensor([p.shape[0] for p in w.parts]).cumsum(0).tolist()
                return SplitLinear([linear(p, None if bias is None else bias[e - p.shape[0]:e]) for p, e in zip(w.parts, ends)])
            w = w if isinstance(w, QuantTensor) else w.to(self.dtype).to(self.device)
            return PackedLinear(w, None if bias is None else bias.to(self.dtype).to(self.device), kind, activations=econf.quant_activations)

        self.rope, self.rope_local = rope_tables(full, self.device)  # rope_local: Gemma 3's sliding layers' (or None)
        self.layers = build_layers(self.cfg, _RankParts(self, tensors, linear))
        embed = tensors["model.embed_tokens.weight"]
        self.embed = embed if isinstance(embed, QuantTensor) else embed.to(self.dtype).to(self.device)
        self.vocab_start, self.vocab_end = vocab_range(full.vocab_size, group.rank, group.size)
        # tied: the LM head reads the embedding's own device copy (a second .to(device) would copy it again)
        self.lm_head = linear(self.embed if full.tie_embeddings else tensors["lm_head.weight"], None)
        self.norm = _norm(tensors["model.norm.weight"], full.rms_eps, self.dtype, self.device, full)
        self.kv_heads = slice(*kv_head_range(full.num_kv_heads, group.rank, group.size))  # this rank's KV heads in a whole worker's pool

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (blocks count as blocks; the norms, which every rank holds whole, too)."""
        def size(w):
            return w.nbytes if isinstance(w, QuantTensor) else w.numel() * w.element_size()

        lins = [self.lm_head, *(x for layer in self.layers for x in layer.linears())]
        lins = [part for x in lins for part in (x.parts if isinstance(x, SplitLinear) else (x,))]
        experts = sum(stack_bytes(w) for l in self.layers if l.moe is not None
                      for w in (l.moe.router, l.moe.gate_up, l.moe.down, l.moe.shared_gate) if w is not None)
        embed = 0 if self.lm_head.weight is self.embed else size(self.embed)  # tied: one copy, counted once
        norms = [self.norm, *(n for l in self.layers for n in (l.attn_norm, l.mlp_norm, l.q_norm, l.k_norm, l.attn_out_norm, l.mlp_out_norm)
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
        scale = embedding_scale(self.full, h.dtype)
        if scale is not None:
            h = h * scale.to(h.device)
        ops = TorchOps(self.cfg, batch, self.backend, self.group.all_reduce)  # every rank's partial o and MLP outputs summed
        delta = run_layers(ops, self.layers, h, kv_views(self.cfg, kv_cache))
        h = ops.final_norm(delta, h, batch.logits_indices, self.norm)  # (N, hidden)
        return self._logits(soft_cap(self.lm_head(h), self.full.final_softcap).float())

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
