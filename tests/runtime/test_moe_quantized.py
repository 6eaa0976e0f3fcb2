"""A mixture of experts' GGUF expert stacks served from their blocks (issue 39): runtime.moe's
PackedExperts (CPU fast path: one quantized PackedLinear per expert over that expert's blocks)
and runtime.model.QuantExpertStack (module forward: that expert dequantized, F.linear; the Triton
kernel on CUDA), against the same file loaded dequantized.

- The grouped path over stacks in blocks (one type, and gate / up in different types) equals the
  dense twin over the dequantized stacks to float32 summation order.
- Tiny Mixtral and Qwen2-MoE (shared expert) GGUFs with Q8_0 / Q4_0 / Q4_K experts, float
  activations: all-position logits of the fast path and the module forward within 1e-4 of the
  largest logit of the dequantized twin's (test_kquant_model.py's bound), greedy tokens equal;
  the experts keep the file's bytes (weight_bytes counts them), 3.8x (Q8_0) to 7.1x (Q4_0, Q4_K)
  below the float model's experts.
- The packed path never reads an unchosen expert: those experts' blocks overwritten with 0xFF
  (fp16 scale NaN) leave the logits (fast path, default int16 activations; module forward)
  unchanged, while the dense twin's turn NaN.
- Tensor parallelism keeps them in blocks too: runtime.tp cuts each rank's share of every expert
  (gate / up rows, down columns) in whole blocks, which dequantize to the float shares; at TP 2
  (ranks as threads) each rank runs PackedExperts over half of TP 1's expert bytes (Q8_0, Q4_K)
  and its logits equal TP 1's packed model's; a down share that is not whole blocks is float,
  logged once per rank.
- The Triton kernel (CUDA's path) takes one expert's view of the stack's bytes.
"""
import logging

import pytest
import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.quant import QTYPES, QuantExperts, block_weights
from pdserve.runtime import moe
from pdserve.runtime.build import build_model
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import load_model
from pdserve.runtime.model import ExpertBlocks, QuantExpertStack
from pdserve.runtime.weights import load_checkpoint
from tests.helpers import TPRank, all_position_logits, in_tp_threads, quant_blocks, save_tiny_model, write_gguf
from tests.runtime.test_moe import logits_and_chosen_experts
from tests.runtime.test_quantized import greedy_scored

pytestmark = pytest.mark.skipif(cpu_native.native() is None, reason="needs a C compiler for the quantized kernels")

WIDTH = 256  # hidden and the experts' width: whole K-quant super-blocks in every expert row
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe"}


def random_stack(qtype: str, experts: int, rows: int, cols: int, seed: int) -> QuantExperts:
    raw = torch.stack([quant_blocks(qtype, rows, cols, seed * 100 + e).raw for e in range(experts)])
    return QuantExperts(raw, qtype, (experts, rows, cols))


@pytest.mark.parametrize("types", [("Q8_0", "Q8_0", "Q4_0"), ("Q4_K", "Q6_K", "Q5_K")])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_packed_experts_equal_the_dense_twin(types, tokens):
    """gate / up of one type: one stack (QuantExperts.cat); of two: side by side (a SplitLinear per
    expert). Both paths (PackedExperts, QuantExpertStack) equal experts_dense over the float stacks."""
    e, h, i = 6, WIDTH, WIDTH
    gate, up, down = random_stack(types[0], e, i, h, 1), random_stack(types[1], e, i, h, 2), random_stack(types[2], e, h, i, 3)
    joined = QuantExperts.cat([gate, up])
    assert (joined is None) == (types[0] != types[1])
    gate_up = ExpertBlocks((joined,) if joined is not None else (gate, up))
    float_gate_up, float_down = torch.cat([gate.dequantize(), up.dequantize()], 1), down.dequantize()
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=g)
    weights, ids = moe.route(x @ torch.randn(e, h, generator=g).T, 2, True, float_weights=True)
    ref = moe.experts_dense(x, weights, ids, float_gate_up, float_down)
    for stacks in ((moe.PackedExperts(gate_up.parts), moe.PackedExperts((down,))), (QuantExpertStack(gate_up), QuantExpertStack(ExpertBlocks((down,))))):
        touched = []
        got = moe.experts_grouped(x, weights, ids, *stacks, touched=touched)
        assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), type(stacks[0])
        assert sorted(touched) == sorted(set(ids.flatten().tolist()))
        assert torch.allclose(moe.experts_dense(x, weights, ids, *stacks), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def shape(arch: str, hidden: int = WIDTH, width: int = WIDTH) -> dict:
    """A tiny model's widths: hidden, and every MLP's (the experts', Qwen2-MoE's shared expert's) `width`."""
    if arch == "mixtral":
        return dict(hidden_size=hidden, intermediate_size=width)
    return dict(hidden_size=hidden, moe_intermediate_size=width, shared_expert_intermediate_size=width, intermediate_size=width)


def _gguf(tmp_path, arch: str, qtype: str, hidden: int = WIDTH, width: int = WIDTH, experts_qtype: str | None = None):
    save_tiny_model(tmp_path / "hf", arch=arch, num_hidden_layers=2, **shape(arch, hidden, width))
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", qtype, arch=GGUF_ARCH[arch], experts_qtype=experts_qtype)
    return tmp_path / "m.gguf"


def _stacks(model) -> list[QuantExpertStack]:
    return [m for m in model.modules() if isinstance(m, QuantExpertStack)]


@pytest.mark.parametrize("arch,qtype", [("mixtral", "Q4_K"), ("mixtral", "Q8_0"), ("qwen2_moe", "Q4_0"), ("qwen2_moe", "Q4_K")])
def test_packed_moe_gguf_equals_its_dequantized_twin(tmp_path, arch, qtype):
    path = _gguf(tmp_path, arch, qtype)
    cfg, quant = load_model(path, EngineConfig(num_blocks=64, block_size=8, quant_activations="float"))
    _, twin = load_model(path, EngineConfig(num_blocks=64, block_size=8, quantization="none"))
    stacks = _stacks(quant)
    assert len(stacks) == 2 * cfg.num_layers and not _stacks(twin)
    assert all(s.qtypes == [qtype] for s in stacks)  # gate and up joined into one stack of blocks per layer
    for layer in quant.fast.layers:
        assert isinstance(layer.moe.gate_up, moe.PackedExperts) and isinstance(layer.moe.down, moe.PackedExperts)
    # the experts hold the file's bytes: E experts x 3 matrices of WIDTH x WIDTH weights a layer, in blocks
    packed = sum(s.nbytes for s in stacks)
    assert packed == cfg.num_layers * cfg.num_experts * 3 * WIDTH * WIDTH // block_weights(qtype) * QTYPES[qtype][1]
    as_float = cfg.num_layers * cfg.num_experts * 3 * WIDTH * WIDTH * 4
    assert as_float / packed >= (3.7 if qtype == "Q8_0" else 7.0)
    assert quant.weight_bytes() <= twin.weight_bytes() - (as_float - packed) + 1024
    print(f"{arch} {qtype}: experts {packed / 2**20:.2f} MiB packed vs {as_float / 2**20:.2f} MiB float; "
          f"weights {quant.weight_bytes() / 2**20:.2f} vs {twin.weight_bytes() / 2**20:.2f} MiB")

    ids = list(range(3, 40))
    ref = all_position_logits(twin, ids, torch.float32)
    scale = float(ref.abs().max())
    assert float((all_position_logits(quant, ids, torch.float32) - ref).abs().max()) <= 1e-4 * scale
    fast, quant.fast = quant.fast, None  # the module forward: QuantExpertStack, each chosen expert dequantized
    assert float((all_position_logits(quant, ids, torch.float32) - ref).abs().max()) <= 1e-4 * scale
    quant.fast = fast
    prompts = [[5, 9, 12, 30, 7], [17], list(range(40, 60))]
    seqs_t, _ = greedy_scored(twin, prompts, 8, set())
    seqs_q, _ = greedy_scored(quant, prompts, 8, set())
    assert seqs_q == seqs_t


def test_packed_path_reads_only_the_chosen_experts(tmp_path, monkeypatch):
    """A lone token and a 3-token prompt: every expert no token chose has its blocks overwritten
    with 0xFF (each block's fp16 scale NaN), in every layer; the fast path rebuilt over them
    (default int16 activations, whose 16-row copies are made at build) and the module forward give
    the same logits as before, while the dense twin's turn NaN (it reads every expert)."""
    path = _gguf(tmp_path, "mixtral", "Q4_K")
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", "off")  # the blocks are overwritten below: private copies (the cache's maps are read-only)
    cfg, model = load_model(path, EngineConfig(num_blocks=64, block_size=8))
    acts = model.fast.activations
    assert acts == "int16"
    stacks = [(layer.mlp.experts_gate_up, layer.mlp.experts_down) for layer in model.layers]
    saved = [[p.raw.clone() for s in pair for p in s.parts] for pair in stacks]
    for ids in ([77], [5, 300, 41]):
        before, chosen = logits_and_chosen_experts(model, ids, monkeypatch)
        assert len(chosen) == cfg.num_layers
        fast, model.fast = model.fast, None
        before_modules = all_position_logits(model, ids, torch.float32)
        unread = 0
        with torch.inference_mode():  # in place: the module's buffers, which the fast path views
            for pair, used in zip(stacks, chosen):
                for e in set(range(cfg.num_experts)) - used:
                    for s in pair:
                        for p in s.parts:
                            p.raw[e] = 0xFF
                    unread += 1
        assert unread >= cfg.num_layers * (cfg.num_experts - cfg.experts_per_tok * len(ids))
        after_modules = all_position_logits(model, ids, torch.float32)
        assert torch.isfinite(after_modules).all() and torch.equal(after_modules, before_modules)
        assert model.enable_fast_path(activations=acts)  # rebuilt: PackedLinears (and their copies) over the corrupted stacks
        after = all_position_logits(model, ids, torch.float32)
        assert torch.isfinite(after).all() and torch.equal(after, before)
        for layer in model.fast.layers:
            layer.moe.dense = True
        assert torch.isnan(all_position_logits(model, ids, torch.float32)).all()
        with torch.inference_mode():
            for pair, raws in zip(stacks, saved):
                for p, raw in zip([p for s in pair for p in s.parts], raws):
                    p.raw.copy_(raw)
        assert model.enable_fast_path(activations=acts)
        del fast


@pytest.mark.parametrize("qtype,cols,whole,not_whole", [("Q8_0", 96, 3, 2), ("Q4_K", 512, 2, 4)])
def test_expert_shares_in_blocks_are_the_float_shares(qtype, cols, whole, not_whole):
    """runtime.tp's cuts of a stack in blocks: each rank's gate / up rows and down columns, still
    blocks (owning their bytes, 1/n of them), dequantize to the same slices of the dequantized
    stack; a down share that is not whole blocks (Q8_0: 48 of 32-weight blocks; Q4_K: 128 of 256) is None."""
    from pdserve.runtime.tp import expert_cols_part, expert_rows_part

    down, gate = random_stack(qtype, 3, 8, cols, 7), random_stack(qtype, 3, 6, cols, 8)  # (E, hidden, I), (E, I, hidden)
    for stack, cut, dim in ((down, expert_cols_part, 2), (gate, expert_rows_part, 1)):
        ref, n = stack.dequantize(), whole
        for rank in range(n):
            part = cut(stack, rank, n)
            assert isinstance(part, QuantExperts) and part.qtype == qtype and part.nbytes * n == stack.nbytes
            assert part.raw.untyped_storage().nbytes() == part.nbytes  # its own bytes, not a view keeping the whole stack
            assert torch.equal(part.dequantize(), ref.narrow(dim, rank * ref.shape[dim] // n, ref.shape[dim] // n))
    assert expert_cols_part(down, 0, not_whole) is None


def test_tensor_parallel_shard_cuts_expert_blocks(tmp_path):
    """runtime.tp.shard keeps the expert stacks in blocks (Q4_0, a 128-wide share of 256: whole
    blocks): each rank's share dequantizes to what the shard of the dequantized load gives."""
    from pdserve.runtime.tp import shard
    from pdserve.runtime.weights import dequantize_all

    path = _gguf(tmp_path, "qwen2_moe", "Q4_0")
    cfg, kept = load_checkpoint(path, progress=False, keep_quantized=True)
    assert isinstance(kept["model.layers.0.mlp.experts.down_proj"], QuantExperts)
    plain = dequantize_all(kept)
    for rank in range(2):
        got, want = shard(cfg, kept, rank, 2), shard(cfg, plain, rank, 2)
        names = [n for n in want if ".mlp.experts." in n]
        assert len(names) == 3 * cfg.num_layers
        for name in names:
            assert isinstance(got[name], QuantExperts) and torch.equal(got[name].dequantize(), want[name]), name


TP_CASES = {  # name: (arch, experts' type, experts' width); hidden WIDTH, the other matrices Q8_0 (a rank's o: 128 wide)
    "mixtral-Q8_0": ("mixtral", "Q8_0", WIDTH),  # a rank's share of the width, 128: four Q8_0 blocks
    "qwen2_moe-Q4_K": ("qwen2_moe", "Q4_K", 2 * WIDTH),  # 256: one Q4_K super-block; the shared expert beside them
}


def tp_and_tp1(path, ids: list[int], n: int = 2):
    """(TP 1 packed model's logits and layers' expert stacks, {rank: (its stacks, its logits)}) of one
    GGUF loaded in blocks, float activations (so that only the summation order differs)."""
    econf = EngineConfig(num_blocks=64, block_size=8, quant_activations="float")
    cfg, tensors = load_checkpoint(path, progress=False, keep_quantized=True)
    tp1 = build_model(cfg, tensors, econf)
    whole = [(layer.moe.gate_up, layer.moe.down) for layer in tp1.fast.layers]

    def run(model):
        return [(layer.moe.gate_up, layer.moe.down) for layer in model.layers], all_position_logits(TPRank(model), ids, torch.float32)

    return all_position_logits(tp1, ids, torch.float32), whole, in_tp_threads(cfg, tensors, econf, n, run)


@pytest.mark.parametrize("case", sorted(TP_CASES))
def test_tensor_parallel_ranks_keep_expert_blocks(tmp_path, case):
    """TP 2 over a GGUF's experts in blocks: each rank runs its share of every expert packed
    (runtime.moe.PackedExperts over blocks of the file's type, half of TP 1's expert bytes, not
    float) and its all-position logits equal TP 1's packed model's within float32 summation order."""
    arch, qtype, width = TP_CASES[case]
    hidden, ids = WIDTH, list(range(3, 40))
    ref, whole, ranks = tp_and_tp1(_gguf(tmp_path, arch, "Q8_0", hidden, width, experts_qtype=qtype), ids)
    scale = float(ref.abs().max())
    for rank, (stacks, logits) in ranks.items():
        for (gate_up, down), (whole_gate_up, whole_down) in zip(stacks, whole, strict=True):
            assert isinstance(gate_up, moe.PackedExperts) and isinstance(down, moe.PackedExperts), rank
            assert [p.qtype for p in (*gate_up.parts, *down.parts)] == [qtype, qtype]
            assert gate_up.shape == (whole_gate_up.shape[0], whole_gate_up.shape[1] // 2, hidden) and down.shape[2] == width // 2
            assert 2 * gate_up.nbytes == whole_gate_up.nbytes and 2 * down.nbytes == whole_down.nbytes
        err = float((logits - ref).abs().max())
        assert err <= 1e-4 * scale, f"rank {rank}: {err / scale:.2e} of the logits' scale off TP 1's"


def test_tensor_parallel_down_share_not_whole_blocks_is_float(tmp_path, caplog):
    """Experts 96 wide in Q8_0 at TP 2: a rank's down share, 48 columns, is not whole 32-weight
    blocks, so each rank's down stacks are float (its share, logged once per rank naming why), its
    gate / up stay packed; the logits still equal TP 1's."""
    ids = list(range(3, 40))
    with caplog.at_level(logging.WARNING, logger="pdserve.runtime"):
        ref, whole, ranks = tp_and_tp1(_gguf(tmp_path, "mixtral", "Q8_0", hidden=64, width=96), ids)
    scale = float(ref.abs().max())
    for rank, (stacks, logits) in ranks.items():
        for (gate_up, down), (whole_gate_up, whole_down) in zip(stacks, whole, strict=True):
            assert isinstance(gate_up, moe.PackedExperts) and 2 * gate_up.nbytes == whole_gate_up.nbytes
            assert isinstance(down, torch.Tensor) and down.dtype == torch.float32 and down.shape == (whole_down.shape[0], 64, 48)
        assert float((logits - ref).abs().max()) <= 1e-4 * scale
    said = [r.getMessage() for r in caplog.records if "not whole Q8_0 blocks" in r.getMessage()]
    assert len(said) == 2 and "48" in said[0] and "2 layer(s)" in said[0], said  # once per rank's shard, not per layer


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_triton_kernel_takes_one_experts_blocks(qtype):
    """CUDA's path (QuantExpertStack.linear on a CUDA tensor): the Triton weight-only kernel given
    expert e's QuantTensor, a view into the middle of the stack's bytes, multiplies that expert
    (under TRITON_INTERPRET=1 on the CPU; the kernel compiled for CUDA is test_triton_quant's gpu test)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU run of the Triton kernel needs TRITON_INTERPRET=1")
    from pdserve.kernels import triton_quant

    stack = random_stack(qtype, 4, 48, 96, 5)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    ref = stack.dequantize()
    for e in (0, 2, 3):
        got = triton_quant.matmul(x, stack.expert(e))
        assert float((got - x @ ref[e].T).abs().max()) <= 1e-5 * float(ref[e].abs().max() * x.abs().sum(-1).max())
