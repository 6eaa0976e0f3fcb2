"""The CPU fast path's batched prefill attention (runtime.cpu_forward, kernels.torch_paged.attend_fresh):
adjacent prompts of one length with no cached prefix attend in one sdpa call, reading K/V from the
fused qkv rows instead of the pages; its twin is the per-prompt path (gather the pages, attend_one).
Both give the same logits and the same KV cache, bit for bit, in a step that also holds a prompt of
another length, a decode row and a chunk over a cached prefix (which keep the per-prompt path)."""
import pytest
import torch

from pdserve.kernels import cpu_native
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import load_model
from pdserve.runtime.kv_cache import allocate_kv_cache
from pdserve.runtime.model import ForwardBatch
from tests.helpers import save_tiny_model

pytestmark = pytest.mark.skipif(cpu_native.native() is None, reason="needs a C compiler for the fast path")
BLOCK = 16


def step(model, kv, spans):
    """One forward of sequences given as (token ids, first position computed now, owner): 4 pages each, by owner."""
    ids, pos, slots, starts, lens = [], [], [], [0], []
    for toks, first, i in spans:
        n = len(toks) - first
        ids += toks[first:]
        pos += range(first, len(toks))
        slots += [i * 4 * BLOCK + p for p in range(first, len(toks))]
        starts.append(starts[-1] + n)
        lens.append(len(toks))
    starts_t = torch.tensor(starts, dtype=torch.int32)
    batch = ForwardBatch(input_ids=torch.tensor(ids), positions=torch.tensor(pos), slot_mapping=torch.tensor(slots),
                         query_start_loc=starts_t, seq_lens=torch.tensor(lens, dtype=torch.int32),
                         block_tables=torch.tensor([[i * 4 + j for j in range(4)] for _, _, i in spans], dtype=torch.int32),
                         max_query_len=max(s - e for s, e in zip(starts[1:], starts)), logits_indices=torch.arange(starts[-1]))
    return model(batch, kv)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_fresh_prompts_equal_per_prompt_attention(tmp_path, arch, monkeypatch):
    save_tiny_model(tmp_path, arch=arch, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    _, model = load_model(tmp_path, EngineConfig(num_blocks=64))
    g = torch.Generator().manual_seed(0)
    seq = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (20, 20, 20, 9, 33, 40)]
    results, calls = [], []
    import pdserve.runtime.cpu_forward as cpu_forward

    batched_call = cpu_forward.attend_fresh
    monkeypatch.setattr(cpu_forward, "attend_fresh", lambda q, *a: calls.append(q.shape[:2]) or batched_call(q, *a))
    for batched in (True, False):
        model.fast.batch_fresh = batched
        kv = allocate_kv_cache(model.cfg, 6 * 4, BLOCK, torch.float32)
        step(model, kv, [(seq[4], 0, 4), (seq[5], 0, 5)])  # prompts of 33 and 40 tokens: alone, their KV cached
        spans = [(seq[0], 0, 0), (seq[1], 0, 1), (seq[2], 0, 2), (seq[3], 0, 3)]  # three of 20 tokens: one call; 9: alone
        logits = step(model, kv, spans + [(seq[4], 32, 4), (seq[5], 30, 5)])  # a decode row, a chunk over a cached prefix
        results.append((logits, kv))
    (a, kv_a), (b, kv_b) = results
    assert torch.equal(a, b) and torch.equal(kv_a, kv_b)
    assert calls == [(3, 20)] * model.cfg.num_layers  # the batched path ran once per layer, for the three, only when on
