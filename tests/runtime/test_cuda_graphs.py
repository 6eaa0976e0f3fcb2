"""CUDA graphs for decode steps: which steps replay (CPU, plain data), the refusal on the CPU, and
on a GPU the same tokens as eager execution with the replays counted."""
from types import SimpleNamespace

import pytest

from pdserve.common.errors import NotSupportedError
from pdserve.runtime import cuda_graphs
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.params import SamplingParams
from tests.helpers import save_tiny_model


def test_capture_sizes_cover_every_batch_with_little_padding():
    assert cuda_graphs.capture_sizes(1) == [1]
    assert cuda_graphs.capture_sizes(5) == [1, 2, 4, 5]
    sizes = cuda_graphs.capture_sizes(128)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 128 and sizes == sorted(set(sizes))
    for n in range(1, 129):
        assert next(s for s in sizes if s >= n) - n < 8
    with pytest.raises(ValueError):
        cuda_graphs.capture_sizes(0)


def seq(computed: int, total: int, blocks: int = 1):
    return SimpleNamespace(num_computed_tokens=computed, num_tokens=total, block_table=[0] * blocks)


def test_only_pure_decode_steps_that_fit_replay():
    runner = SimpleNamespace(sizes=[1, 2, 4], width=4, blocks=SimpleNamespace(groups=1))
    ok = cuda_graphs.GraphRunner.graphable
    assert ok(runner, [(seq(9, 10), 1), (seq(3, 4), 1)])
    assert not ok(SimpleNamespace(sizes=[1, 2, 4], width=4, blocks=SimpleNamespace(groups=2)), [(seq(9, 10), 1)])  # KV groups: eager
    assert not ok(runner, [])
    assert not ok(runner, [(seq(0, 10), 10)])  # prefill
    assert not ok(runner, [(seq(9, 10), 1), (seq(0, 5), 5)])  # mixed
    assert not ok(runner, [(seq(4, 10), 1)])  # a chunk of a prefill that samples nothing
    assert not ok(runner, [(seq(9, 10), 1)] * 5)  # larger than the largest capture
    assert not ok(runner, [(seq(9, 10, blocks=5), 1)])  # a block table wider than captured


def test_enable_refuses_a_cpu_engine(tmp_path):
    save_tiny_model(tmp_path, max_position_embeddings=64)
    eng = LLMEngine.load(str(tmp_path), EngineConfig(num_blocks=8, block_size=8), progress=False, tokenizer=False)
    with pytest.raises(NotSupportedError, match="CUDA"):
        cuda_graphs.enable(eng)


@pytest.mark.gpu
def test_graphs_give_the_eager_tokens(tmp_path):
    save_tiny_model(tmp_path, max_position_embeddings=256)
    prompts = [[3 + (i * 7 + j * 13) % 500 for j in range(n)] for i, n in enumerate([5, 40, 1, 23, 64, 9, 17])]
    lengths = [4, 24, 10, 24, 16, 24]  # the batch shrinks 7 -> 6 -> 5 -> 4: graphs of 8 and 4 rows
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    params.append(SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True))

    def run(graphs: bool):
        eng = LLMEngine.load(str(tmp_path), EngineConfig(num_blocks=96, block_size=16, device="cuda", dtype="float32", max_num_seqs=8),
                             progress=False, tokenizer=False)
        runner = cuda_graphs.enable(eng) if graphs else None
        out = [c.token_ids for c in eng.generate(prompts, params)]
        assert eng.blocks.free_blocks == eng.blocks.num_blocks
        return out, runner

    eager, _ = run(False)
    graphed, runner = run(True)
    assert runner.replays >= 20 and set(runner.graphs) <= set(runner.sizes)
    assert len(runner.graphs) >= 2
    assert [t[0] for t in graphed] == [t[0] for t in eager]  # first tokens come from the eager prefill
    assert sum(a == b for a, b in zip(graphed, eager)) >= len(eager) - 1
