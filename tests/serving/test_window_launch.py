"""A Mistral with a sliding window through `pdserve launch --model DIR` (real processes on
loopback, the shm hand-off): only the window's KV blocks are handed off, a decode pool far
smaller than the sequences serves them (blocks before the window freed as they grow), and the
greedy tokens equal HF's (tests/runtime/test_window_kv.py holds the same in one process)."""
import asyncio
import json

import pytest
import torch

from pdserve.runtime.config import ModelConfig
from pdserve_client.library import AsyncClient
from tests.helpers import assert_greedy_equal, hf_greedy, run_until_blocks_free, save_tiny_served_model, start_cluster

WINDOW, BS, NEW = 16, 4, 64
PROMPTS = [[100 + 37 * i + 11 * j for j in range(n)] for i, n in enumerate((5, 30, 60))]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("mistral-window")
    save_tiny_served_model(d, arch="mistral", sliding_window=WINDOW)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return d, [hf_greedy(hf, p, NEW, eos=False) for p in PROMPTS]


async def _generate(address):
    async with AsyncClient(address, timeout=60) as c:
        return await asyncio.gather(*(c.generate(token_ids=p, temperature=0.0, max_tokens=NEW, ignore_eos=True) for p in PROMPTS))


@pytest.mark.timeout(120)
def test_a_window_model_hands_off_and_holds_only_its_window(mistral, tmp_path):
    model_dir, refs = mistral
    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    assert cfg.kv_window == WINDOW
    # 24 blocks of 4 tokens: the three sequences (69 to 124 tokens) would need 73 blocks whole
    launcher = start_cluster(model_dir, tmp_path, prefill=1, decode=1, kv_backend="shm",
                             engine_args=["--num-blocks", "24", "--block-size", str(BS)])
    results, stats = run_until_blocks_free(launcher, _generate)
    for i, (r, (tokens, logits)) in enumerate(zip(results, refs)):
        assert assert_greedy_equal(r.token_ids, tokens, logits, f"prompt {i}") >= NEW - 8
    # each prompt's KV from the window of its last position on (runtime.kv_cache first_needed): 2, 5
    # and 4 blocks of the 2, 8 and 15 its tokens fill (25 without the window)
    block_bytes = cfg.num_layers * 2 * BS * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    assert stats["kv_transfer"]["handoffs"] == 3 and stats["kv_transfer"]["bytes"] == (2 + 5 + 4) * block_bytes, json.dumps(stats)
