"""Tensor parallelism (runtime.tp, runtime.tp_model, worker.tp_ranks): N gloo rank processes on
loopback run tiny random models of several head layouts, float and GGUF blocks; greedy tokens
equal the TP 1 engine's and each token's logprob is within LOGPROB_TOL of it (the sums of the
row-parallel layers are added in another order); each rank holds about 1/N of the weights. The
group's rendezvous is a private directory rank 0 removes on close, and a rank without its token
is refused by every peer (what listens is checked in tests/security/test_tp_listeners.py)."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import torch
import torch.distributed as dist

from pdserve.common.errors import NotSupportedError, UnsupportedModelError
from pdserve.kernels.quant import QuantTensor
from pdserve.runtime.config import EngineConfig, ModelConfig
from pdserve.runtime.engine import LLMEngine, build_model
from pdserve.runtime.kv_cache import allocate_kv_cache
from pdserve.runtime.tp import (
    TOKEN_FILE,
    HeadRoute,
    RankAuthError,
    RankGroup,
    StepPlan,
    batch_of,
    check_split,
    column_part,
    compute_backend,
    head_routes,
    kv_head_range,
    make_rendezvous,
    pair_proof,
    plan_of,
    rank_config,
    rank_devices,
    read_token,
    row_part,
    vocab_part,
)
from pdserve.runtime.weights import load_checkpoint
from pdserve.worker import tp_ranks
from pdserve_client.errors import InvalidRequestError
from pdserve_client.params import SamplingParams
from tests.helpers import run_in_child, save_tiny_model, tiny_engine, write_gguf

LOGPROB_TOL = 1e-4  # float weights
QUANT_LOGPROB_TOL = 1e-3  # GGUF blocks: the C kernels round activations per block and TP 1 runs the fused path
PROMPTS = [[1, 5, 9, 33, 2, 7], list(range(3, 40)), [4] * 17]

LAYOUTS = {  # name: (tensor parallel size, checkpoint overrides)
    "qwen2-bias-3": (3, dict(arch="qwen2", num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=192)),
    "mha-tied-odd-vocab-2": (2, dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, vocab_size=515)),
    # per-head q/k norms held whole by each rank, a sliding window on layers 1-2
    "qwen3-window8-2": (2, dict(arch="qwen3", head_dim=32, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # fused qkv_proj / gate_up_proj split at load, then sharded like Llama's; a window on every layer
    "phi3-window8-2": (2, dict(arch="phi3", sliding_window=8)),
    # Gemma: four norms a layer (whole on each rank, two of them after the all-reduces), soft-caps
    # (the final one on each rank's vocabulary columns), scaled embeddings, GeGLU, windows; Gemma 3's local RoPE
    "gemma2-softcap-window8-2": (2, dict(arch="gemma2", head_dim=32, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=4.0,
                                         final_logit_softcapping=4.0, tie_word_embeddings=True)),
    "gemma3-localrope-window8-2": (2, dict(arch="gemma3", head_dim=32, sliding_window=8,
                                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                           rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
    # mixture of experts: every expert on each rank at half its width, the router whole; Qwen2-MoE's
    # shared expert split as the dense MLP, a dense layer (decoder_sparse_step 2)
    "moe-mixtral-2": (2, dict(arch="mixtral")),
    "moe-qwen2-shared-sparse2-2": (2, dict(arch="qwen2_moe", decoder_sparse_step=2, num_hidden_layers=4)),
}


def tp_engine(model, n: int, **config):
    """(engine over rank 0's TPModel, the Ranks): ranks 1..n-1 are processes of their own."""
    econf = EngineConfig(**{"num_blocks": 64, "block_size": 8, "tensor_parallel_size": n, **config})
    cfg, tensors = load_checkpoint(str(model), progress=False, keep_quantized=econf.keep_quantized)
    ranks = tp_ranks.start(cfg, tensors, econf, econf.num_blocks, str(model), threads=1)
    pool = allocate_kv_cache(ranks.model.cfg, econf.num_blocks, econf.block_size, econf.torch_dtype)
    return LLMEngine(ranks.model, None, econf, kv_cache=pool), ranks


def compare(ref: LLMEngine, model, n: int, tol: float = LOGPROB_TOL, **config) -> tuple[int, int]:
    """Greedy tokens and logprobs of TP n against ref; returns (rank 0's, ref's) weight bytes."""
    engine, ranks = tp_engine(model, n, **config)
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
        wanted = ref.generate(PROMPTS, params)
        for want, got in zip(wanted, engine.generate(PROMPTS, params)):
            assert got.token_ids == want.token_ids
            assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < tol
        hits = engine.blocks.hits
        assert engine.generate(PROMPTS[1:2], params)[0].token_ids == wanted[1].token_ids  # its prefix cached on every rank
        assert engine.blocks.hits > hits or not engine.blocks.prefix_cache  # KV groups (sliding beside full layers): none
        assert engine.blocks.free_blocks == engine.blocks.num_blocks  # cached prefix blocks count as free
    finally:
        ranks.close()
    assert [p.returncode for p in ranks.procs] == [0] * (n - 1)  # they left on rank 0's stop
    assert not os.path.exists(ranks.group.rendezvous)  # rank 0 removed the private directory (its store and token)
    return ranks.model.weight_bytes(), ref.model.weight_bytes()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tp_equals_tp1(tmp_path, layout):
    n, overrides = LAYOUTS[layout]
    save_tiny_model(tmp_path, max_position_embeddings=128, **overrides)
    ref, _ = tiny_engine(tmp_path)
    # 16-token steps: a long prompt's middle chunks sample no row (every rank skips the logits' gather alike)
    mine, whole = compare(ref, tmp_path, n, max_num_batched_tokens=16)
    assert whole / n <= mine <= whole / n * 1.05 + 1024, (mine, whole)


@pytest.mark.parametrize("qtype,arch", [("Q8_0", "llama"), ("Q4_K_M", "llama"), ("Q8_0", "mixtral")])
def test_tp_quantized_blocks(tmp_path, qtype, arch):
    """GGUF blocks kept as blocks: column shards take whole rows, row shards whole blocks. Q4_K_M
    (rows of 64: Q5_0, and Q8_0 for layer 2's v) mixes types in layer 2's qkv, which stays in its
    blocks, one quantized linear per part (kernels.linear.SplitLinear), on every rank as at TP 1;
    it runs float activations (Q5_0's int16 rounding, per shard, moves logprobs by ~1.1e-3, before
    this split too). Mixtral: every rank holds its share of each expert (64 of 128 columns of
    down: two Q8_0 blocks) in blocks, so rank 0's weights are half of TP 1's, not float experts."""
    save_tiny_model(tmp_path, arch=arch, max_position_embeddings=128, hidden_size=64, intermediate_size=128)
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, tmp_path, qtype)  # Mixtral: llama.cpp's llama arch with expert stacks
    acts = {"quant_activations": "float"} if qtype == "Q4_K_M" else {}
    econf = EngineConfig(num_blocks=64, block_size=8, **acts)
    cfg, tensors = load_checkpoint(str(gguf), progress=False, keep_quantized=True)
    ref = LLMEngine(build_model(cfg, tensors, econf), None, econf)
    assert ref.model.quantized
    if qtype == "Q4_K_M":
        assert [ref.model.quantized[f"layers.2.self_attn.qkv_proj.parts.{i}.weight"].qtype for i in range(3)] == ["Q5_0", "Q5_0", "Q8_0"]
    mine, whole = compare(ref, gguf, 2, QUANT_LOGPROB_TOL, **acts)
    assert whole / 2 * 0.9 <= mine <= whole / 2 * 1.1, (mine, whole)


def test_split_refused():
    cfg = ModelConfig("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16, 128)
    with pytest.raises(UnsupportedModelError, match="does not divide the model's 2 KV heads"):
        check_split(cfg, 4)
    with pytest.raises(UnsupportedModelError, match="does not divide the model's 4 attention heads"):
        check_split(cfg, 3)
    blocks = QuantTensor(torch.zeros(4, 3 * 34, dtype=torch.uint8), "Q8_0", (4, 96))
    with pytest.raises(UnsupportedModelError, match="not whole blocks"):
        row_part(blocks, 0, 2, "down_proj")
    assert row_part(blocks, 1, 3).shape == (4, 32)
    w = torch.randn(8, 6)
    for part in (column_part(w, 1, 2), row_part(w, 1, 2), vocab_part(w, 1, 3)):  # each owns its bytes, not a view of w
        assert part.untyped_storage().nbytes() == part.numel() * 4
    assert torch.equal(column_part(w, 1, 2), w[4:]) and torch.equal(row_part(w, 1, 2), w[:, 3:]) and torch.equal(vocab_part(w, 2, 3), w[6:])


def test_plan_round_trip(tiny):
    engine, _ = tiny_engine(tiny)
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=2))
    batch, _, _ = engine.runner.prepare(engine.scheduler.schedule().scheduled)
    back = batch_of(msgspec.msgpack.decode(msgspec.msgpack.encode(plan_of(batch)), type=StepPlan))
    for field in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "logits_indices"):
        assert torch.equal(getattr(back, field), getattr(batch, field)), field
    assert back.max_query_len == batch.max_query_len


def test_parallel_flags_refused_in_config():
    with pytest.raises(NotSupportedError, match="pipeline parallelism is not supported"):
        EngineConfig(pipeline_parallel_size=2)
    with pytest.raises(NotSupportedError, match="tensor parallelism on mps is not supported"):
        EngineConfig(device="mps", tensor_parallel_size=2)
    assert EngineConfig(device="cuda", tensor_parallel_size=3).tensor_parallel_size == 3  # NCCL: GPUs are counted at start
    assert EngineConfig(tensor_parallel_size=3).summary(128, 4, 1024)["tensor_parallel_size"] == 3


def test_head_routes_send_every_head_once():
    """Which rank of one worker sends which of its KV heads to which rank of the other: the one
    mapping (kv_head_range) the forward uses too."""
    assert [kv_head_range(6, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 6)]
    s = slice
    assert head_routes(3, 3, 1) == [HeadRoute(0, 0, s(0, 1), s(0, 1)), HeadRoute(1, 0, s(0, 1), s(1, 2)), HeadRoute(2, 0, s(0, 1), s(2, 3))]
    assert head_routes(3, 1, 3) == [HeadRoute(0, 0, s(0, 1), s(0, 1)), HeadRoute(0, 1, s(1, 2), s(0, 1)), HeadRoute(0, 2, s(2, 3), s(0, 1))]
    assert head_routes(6, 3, 3) == [HeadRoute(r, r, s(0, 2), s(0, 2)) for r in range(3)]
    for kvh, src_n, dst_n in [(12, 2, 3), (12, 4, 6), (8, 8, 2), (4, 1, 1)]:  # sizes that do not divide each other too
        got = {}
        for r in head_routes(kvh, src_n, dst_n):
            src0, dst0 = kv_head_range(kvh, r.src, src_n)[0], kv_head_range(kvh, r.dst, dst_n)[0]
            heads = range(src0 + r.src_heads.start, src0 + r.src_heads.stop)
            assert heads == range(dst0 + r.dst_heads.start, dst0 + r.dst_heads.stop)  # the same heads on both sides
            for h in heads:
                got[h] = got.get(h, 0) + 1
        assert got == {h: 1 for h in range(kvh)}, (kvh, src_n, dst_n)
    with pytest.raises(UnsupportedModelError, match="do not split 2 ways"):
        head_routes(3, 1, 2)


def test_rank_devices_and_refusals():
    assert rank_devices("cpu", 3, 0) == ["cpu"] * 3
    assert rank_devices("cuda", 3, 4) == ["cuda:0", "cuda:1", "cuda:2"]
    assert rank_devices("cuda:1", 2, 4) == ["cuda:1", "cuda:2"]
    assert rank_devices("cuda:3", 1, 0) == ["cuda:3"]  # TP 1 counts nothing
    with pytest.raises(InvalidRequestError, match="needs 3 GPUs .* sees 2"):
        rank_devices("cuda", 3, 2)
    with pytest.raises(InvalidRequestError, match=r"cuda:2 to cuda:3\) but this process sees 3"):
        rank_devices("cuda:2", 2, 3)
    with pytest.raises(InvalidRequestError, match="expected cuda or cuda:<index>"):
        rank_devices("cuda:x", 2, 4)
    with pytest.raises(NotSupportedError, match="tensor parallelism on mps"):
        rank_devices("mps", 2, 0)
    assert compute_backend("cpu") == "gloo"
    if dist.is_nccl_available():
        assert compute_backend("cuda:0") == "nccl"
    else:  # a CPU build of torch
        with pytest.raises(NotSupportedError, match="needs NCCL"):
            compute_backend("cuda")


def test_more_ranks_than_gpus_refused_before_any_rank_starts(monkeypatch):
    assert tp_ranks.visible_gpus("cpu") == 0  # torch.cuda is not asked for a CPU worker
    cfg = ModelConfig("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16, 128)
    started = []
    monkeypatch.setattr(tp_ranks.subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(tp_ranks, "visible_gpus", lambda device: 1)
    with pytest.raises(InvalidRequestError, match="tensor parallel size 2 needs 2 GPUs"):
        tp_ranks.start(cfg, {}, EngineConfig(device="cuda", tensor_parallel_size=2, num_blocks=8), 8)
    assert started == []


def connect_in_threads(values: dict[int, int], rendezvous: str, tokens: dict[int, bytes] | None = None) -> dict:
    """RankGroup(r, len(values), rendezvous).connect().agree_min(values[r]) for every rank, each on
    a thread of its own (gloo's sockets are real); rank r's answer, or the exception it raised.
    tokens: a rank's token replaced by another (one that did not read the directory's)."""
    got = {}

    def rank(r: int):
        try:
            group = RankGroup(r, len(values), rendezvous)
            group.token = (tokens or {}).get(r, group.token)
            got[r] = group.connect().agree_min(values[r])
        except Exception as e:  # what the test compares
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in values]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return got


def test_ranks_agree_on_the_least_value():
    """RankGroup.agree_min: what sizes a CUDA worker's per-rank pools (each rank's budget buys its
    own blocks; all take the least so that a block id is a block on every rank). Gloo here."""
    rendezvous = make_rendezvous()
    try:
        assert connect_in_threads({0: 70, 1: 50, 2: 90}, rendezvous) == {0: 50, 1: 50, 2: 50}
    finally:
        shutil.rmtree(rendezvous)


def test_a_rank_without_the_groups_token_is_refused():
    """Rank 2 joins with a token of its own: every connection to it fails its peer's proof check,
    and its own checks fail, so no rank takes a plan from it or sends it one (issue 38)."""
    rendezvous = make_rendezvous()
    try:
        got = connect_in_threads({0: 1, 1: 2, 2: 3}, rendezvous, tokens={2: secrets.token_bytes(32)})
    finally:
        shutil.rmtree(rendezvous)
    assert sorted(got) == [0, 1, 2] and all(isinstance(e, RankAuthError) for e in got.values()), got
    assert "rank 2 of the plan group" in str(got[0]) and "rank 2 of the plan group" in str(got[1])


def test_the_rendezvous_is_private_and_rank_0_removes_it():
    """Rank 0's group makes the directory (0700: its store and a 32-byte 0600 token) that its spec
    names to the other ranks, and removes it on close; nothing of it listens."""
    group = RankGroup(0, 2)
    path = group.rendezvous
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700 and os.stat(path).st_uid == os.getuid()
        token = os.path.join(path, TOKEN_FILE)
        assert stat.S_IMODE(os.stat(token).st_mode) == 0o600 and len(read_token(path)) == 32 == len(group.token)
        assert RankGroup(1, 2, path).token == group.token
    finally:
        group.close()
    assert not os.path.exists(path)
    assert pair_proof(b"k", "plan", 0, 1) != pair_proof(b"k", "plan", 1, 0) != pair_proof(b"k", "compute", 1, 0)


def test_a_ranks_pool_gets_the_blocks_its_own_budget_buys():
    """The budget is per pool: a CUDA rank's pool holds 1/N of the KV heads, so the same budget
    buys N times the blocks of the whole pool (per GPU, as vLLM's); --num-blocks is taken as it is."""
    cfg = ModelConfig("LlamaForCausalLM", 512, 96, 192, 2, 6, 3, 16, 128)
    econf = EngineConfig(kv_cache_bytes=3 * 2**20, block_size=8)
    whole = econf.blocks_for_budget(cfg)
    assert econf.blocks_for_budget(rank_config(cfg, 3)) == 3 * whole == 3 * 2**20 // (2 * 2 * 8 * 3 * 16 * 4) * 3
    assert EngineConfig(num_blocks=7).blocks_for_budget(rank_config(cfg, 3)) == 7


def test_the_pool_is_sized_once_the_weights_are_loaded(tiny, monkeypatch):
    """--gpu-memory-utilization measures what the device has left after the weights: load_model
    builds the model first, then asks the budget (spies on the real functions; TP 1 here)."""
    from pdserve.kvtransfer.pool import KVPool
    from pdserve.runtime.config import WorkerConfig

    calls, build, blocks = [], tp_ranks.build_model, EngineConfig.blocks_for_budget
    monkeypatch.setattr(tp_ranks, "build_model", lambda *a, **k: calls.append("weights") or build(*a, **k))
    monkeypatch.setattr(EngineConfig, "blocks_for_budget", lambda self, m: calls.append("budget") or blocks(self, m))
    model, pool, ranks = tp_ranks.load_model(EngineConfig(num_blocks=8, block_size=8), WorkerConfig(model=str(tiny)),
                                             lambda shape, shared: KVPool.create(shape, torch.float32, shared))
    assert calls == ["weights", "budget"] and ranks is None and pool.tensor.shape[2] == 8


def stuck_or_closing_child(closes: str) -> None:
    """A worker's rank 0 whose other rank has died (a process that exits at once): its watch sends
    SIGTERM; the main thread then closes (closes="1"), or waits on as a step waits in an NCCL
    collective for the dead rank (closes="0"). Prints how it ended."""
    from pdserve.worker.tp_ranks import Ranks

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # as worker.process.serve: the loop's flag
    ranks = Ranks(None, [subprocess.Popen([sys.executable, "-c", "pass"])])
    ranks.watch(ranks.stop_worker)
    if closes == "1":
        stop.wait(30)
        ranks.closing = True  # what Ranks.close does first (its model's stop is for live ranks)
        time.sleep(tp_ranks.STOP_GRACE_S + 0.5)  # the watch's grace passes: it must not end a closing worker
        print(json.dumps({"ended": "closed"}), flush=True)
        os._exit(0)
    threading.Event().wait(60)  # never set: the host blocked in a sync no signal ends
    print(json.dumps({"ended": "waited"}), flush=True)


@pytest.mark.parametrize("closes", [True, False])
def test_a_dead_rank_ends_its_worker_even_when_its_step_never_returns(closes):
    t0 = time.monotonic()
    child = run_in_child(__file__, "stuck_or_closing_child", int(closes))
    out, _ = child.communicate(timeout=60)
    if closes:
        assert child.returncode == 0 and json.loads(out.strip().splitlines()[-1]) == {"ended": "closed"}
    else:  # ended by the watch STOP_GRACE_S after the SIGTERM, not by the 60 s wait
        assert child.returncode == 1 and "waited" not in out
        assert time.monotonic() - t0 < 20
