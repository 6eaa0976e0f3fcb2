"""Bytes of expert weights a mixture-of-experts decode step reads per token, against the dense
equivalent (every expert), on a Mixtral-shaped model (8 experts, top 2; issue 39).

Lifecycle: one process. It builds a random Mixtral-shaped model scaled down to fit memory
(`--hidden` / `--inter`, Mixtral 8x7B's 4096 / 14336 ratio kept; `--layers` layers), loads it
through runtime.model / runtime.cpu_forward as a checkpoint would be, prefills one prompt and
runs `--steps` decode steps of one token on the fused CPU path with each MoE layer counting the
experts it reads (runtime.moe.MoEBlock.touched: the grouped path reads an expert's slices of the
stacks only when a token chose it). It prints, per decode token: the expert bytes read, the
dense equivalent (all experts of every MoE layer), their ratio, the same two figures scaled to
Mixtral 8x7B's real shape (the ratio does not depend on the shape: top-k / experts per layer), and
the step time of the grouped path against the dense twin (runtime.moe.experts_dense) on this
machine; first with float32 experts, then with the experts quantized (`--qtype`, default Q4_0:
kernels.quant.QuantExperts, as `--quantization auto` keeps a GGUF's ffn_*_exps, served per
expert from its blocks by the C kernels), whose bytes per token are the blocks' (a Q4_0 expert:
18 bytes per 32 weights, 1/7.1 of float32's). Run: `python -m benchmarks.moe_bytes [--hidden 1024
--inter 3584 --layers 4 --steps 16 --qtype Q4_0]`.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def pack_experts(tensors: dict, qtype: str) -> dict:
    """The float tensors with each expert stack quantized to `qtype` (gguf's quantizer: Q8_0, Q4_0,
    ...) as kernels.quant.QuantExperts, as a GGUF loaded with keep_quantized gives them."""
    import gguf

    from pdserve.kernels.quant import QuantExperts

    out = dict(tensors)
    for name, w in tensors.items():
        if ".mlp.experts." in name:
            raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
            out[name] = QuantExperts(torch.from_numpy(raw.reshape(w.shape[0], w.shape[1], -1)), qtype, tuple(w.shape))
    return out


def build(hidden: int, inter: int, layers: int, experts: int, top_k: int, qtype: str = "F32"):
    from pdserve.runtime.config import EngineConfig, ModelConfig
    from pdserve.runtime.engine import build_model

    cfg = ModelConfig(architecture="MixtralForCausalLM", vocab_size=1024, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                      num_heads=hidden // 128, num_kv_heads=max(1, hidden // 512), head_dim=128, max_position=4096,
                      num_experts=experts, experts_per_tok=top_k, moe_intermediate_size=inter, norm_topk_prob=True)
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    t = {"model.embed_tokens.weight": rand(cfg.vocab_size, hidden), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": rand(cfg.vocab_size, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": rand(cfg.q_size, hidden), p + "self_attn.k_proj.weight": rand(cfg.kv_size, hidden),
                  p + "self_attn.v_proj.weight": rand(cfg.kv_size, hidden), p + "self_attn.o_proj.weight": rand(hidden, cfg.q_size),
                  p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
                  p + "mlp.gate.weight": rand(experts, hidden) * 4, p + "mlp.experts.gate_proj": rand(experts, inter, hidden),
                  p + "mlp.experts.up_proj": rand(experts, inter, hidden), p + "mlp.experts.down_proj": rand(experts, hidden, inter)})
    if qtype != "F32":
        t = pack_experts(t, qtype)
    return cfg, build_model(cfg, t, EngineConfig(num_blocks=64, block_size=16))


def decode_steps(model, cfg, steps: int, dense: bool = False) -> tuple[list[float], list[list[int]]]:
    """Step times (s) and, per step, the experts each MoE layer read."""
    from pdserve.runtime.kv_cache import allocate_kv_cache
    from pdserve.runtime.model import ForwardBatch

    prompt = list(range(5, 37))
    n, block = len(prompt), 16
    blocks = -(-(n + steps) // block)
    kv = allocate_kv_cache(cfg, blocks, block, torch.float32)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    fast = model.fast
    for layer in fast.layers:
        layer.moe.dense = dense
    model(ForwardBatch(input_ids=torch.tensor(prompt), positions=torch.arange(n), slot_mapping=torch.arange(n),
                       query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
                       block_tables=table, max_query_len=n, logits_indices=torch.tensor([n - 1])), kv)
    times, reads, token = [], [], 7
    for s in range(steps):
        pos = n + s
        for layer in fast.layers:
            layer.moe.touched = []
        t0 = time.perf_counter()
        logits = model(ForwardBatch(input_ids=torch.tensor([token]), positions=torch.tensor([pos]), slot_mapping=torch.tensor([pos]),
                                    query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                                    seq_lens=torch.tensor([pos + 1], dtype=torch.int32), block_tables=table, max_query_len=1,
                                    logits_indices=torch.tensor([0])), kv)
        times.append(time.perf_counter() - t0)
        reads.append([len(layer.moe.touched) for layer in fast.layers])
        token = int(logits[0].argmax())
    for layer in fast.layers:
        layer.moe.touched, layer.moe.dense = None, False
    return times, reads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=3584)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--qtype", default="Q4_0", help="the packed model's expert type (gguf's quantizer: Q8_0, Q4_0, ...); F32: float only")
    a = ap.parse_args()
    print(f"Mixtral-shaped model: hidden {a.hidden}, experts' width {a.inter}, {a.layers} layers, {a.experts} experts, top {a.top_k}")
    for qtype in dict.fromkeys(["F32", a.qtype]):
        cfg, model = build(a.hidden, a.inter, a.layers, a.experts, a.top_k, qtype)
        per_expert = model.fast.layers[0].moe.expert_bytes()
        times, reads = decode_steps(model, cfg, a.steps)
        dense_times, _ = decode_steps(model, cfg, a.steps, dense=True)
        read = statistics.mean(sum(r) for r in reads) * per_expert
        dense = cfg.num_layers * cfg.num_experts * per_expert
        kind = "float32" if qtype == "F32" else f"{qtype} blocks (runtime.moe.PackedExperts)"
        print(f"[{kind}] one expert {per_expert / 2**20:.2f} MiB; weights {model.weight_bytes() / 2**20:.1f} MiB")
        print(f"  experts read per decode token per layer: {statistics.mean(x for r in reads for x in r):.2f} of {a.experts} "
              f"(min {min(min(r) for r in reads)}, max {max(max(r) for r in reads)})")
        print(f"  expert bytes read per decode token: {read / 2**20:.2f} MiB; dense equivalent (every expert): {dense / 2**20:.2f} MiB; "
              f"ratio {read / dense:.3f}")
        print(f"  decode step (min / median of {a.steps}): grouped {min(times) * 1e3:.1f} / {statistics.median(times) * 1e3:.1f} ms, "
              f"dense twin {min(dense_times) * 1e3:.1f} / {statistics.median(dense_times) * 1e3:.1f} ms")
        del model
    real = 32 * 3 * 4096 * 14336  # Mixtral 8x7B: per expert 3 matrices of 4096 x 14336, 32 layers
    for name, per_weight in (("bf16", 2.0), ("Q4_0", 18 / 32)):
        print(f"Mixtral 8x7B ({name}, 32 layers) at the same ratio: {real * per_weight * a.top_k / 2**30:.2f} GiB read per token vs "
              f"{real * per_weight * a.experts / 2**30:.2f} GiB dense")


if __name__ == "__main__":
    main()
