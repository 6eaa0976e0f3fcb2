"""Gemma 2 through `pdserve launch --model DIR` (real processes on loopback): a tiny random
checkpoint written by transformers, with its soft-caps, windows and norms acting (the configs of
tests/runtime/test_hf_equivalence.py), served colocated and through the shm hand-off, gives HF's
greedy tokens (the one allowed near-tie divergence: tests/helpers.py) for prompts past the window.
Gemma 3 (12 layers, five of each six sliding over 8 keys: KV groups, runtime.kv_groups) through
the shm hand-off in pools of blocks far fewer than one table for every layer would need: HF's
greedy tokens, each sliding group's blocks before its window neither sent nor kept, every block
back at the end."""
import asyncio
import json

import pytest
import torch

from pdserve.common.kv_window import first_needed_block
from pdserve.runtime.config import ModelConfig
from pdserve_client.library import AsyncClient
from tests.helpers import assert_greedy_equal, hf_greedy, run_until_blocks_free, save_tiny_served_model, start_cluster

GEMMA2 = dict(arch="gemma2", head_dim=32, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=4.0,
              final_logit_softcapping=4.0, tie_word_embeddings=True, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [[100 + 37 * i + 11 * j for j in range(n)] for i, n in enumerate((3, 12, 30))]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("gemma2")
    save_tiny_served_model(d, **GEMMA2)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return d, [hf_greedy(hf, p, 16, eos=False) for p in PROMPTS]


async def _generate(address, prompts=PROMPTS, new: int = 16):
    async with AsyncClient(address, timeout=60) as c:
        return await asyncio.gather(*(c.generate(token_ids=p, temperature=0.0, max_tokens=new, ignore_eos=True) for p in prompts))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["colocated", "handoff"])
def test_gemma2_served_equals_hf(gemma2, tmp_path, mode):
    model_dir, refs = gemma2
    layout = dict(colocated=1, prefill=0, decode=0) if mode == "colocated" else dict(prefill=1, decode=1, kv_backend="shm")
    launcher = start_cluster(model_dir, tmp_path, engine_args=["--kv-cache-mb", "16"], **layout)
    try:
        results = asyncio.run(_generate(launcher.plan.client_addr))
    finally:
        launcher.stop()
    for i, (r, (tokens, logits)) in enumerate(zip(results, refs)):
        assert assert_greedy_equal(r.token_ids, tokens, logits, f"gemma2 {mode} prompt {i}") >= 8


GEMMA3 = dict(arch="gemma3", head_dim=32, query_pre_attn_scalar=24, sliding_window=8, num_hidden_layers=12,
              layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2, final_logit_softcapping=4.0,
              num_attention_heads=4, num_key_value_heads=2)
GEMMA3_PROMPTS = [[100 + 37 * i + 11 * j for j in range(n)] for i, n in enumerate((12, 30, 45))]
BS, NEW = 4, 32


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("gemma3")
    save_tiny_served_model(d, **GEMMA3)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return d, [hf_greedy(hf, p, NEW, eos=False) for p in GEMMA3_PROMPTS]


@pytest.mark.timeout(180)
def test_gemma3_hands_off_and_keeps_only_its_sliding_groups_windows(gemma3, tmp_path):
    model_dir, refs = gemma3
    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    groups = cfg.kv_groups
    assert groups.windows == (0,) + (8,) * 5 and groups.size == 2
    # 120 blocks of 2 layers: the three sequences (44 to 77 tokens) hold 26 + 31 + 35 at their ends; one table for
    # every layer would hold 6 x (11 + 16 + 20) = 282
    launcher = start_cluster(model_dir, tmp_path, prefill=1, decode=1, kv_backend="shm",
                             engine_args=["--num-blocks", "120", "--block-size", str(BS)])
    results, stats = run_until_blocks_free(launcher, lambda addr: _generate(addr, GEMMA3_PROMPTS, NEW))
    for i, (r, (tokens, logits)) in enumerate(zip(results, refs)):
        assert assert_greedy_equal(r.token_ids, tokens, logits, f"gemma3 prompt {i}") >= NEW - 8
    # each prompt's full group's blocks and each sliding group's from the window of its last position on: 13, 23, 27
    # blocks of the 18, 48 and 72 its six tables fill
    sent = [sum(-(-len(p) // BS) - first_needed_block(len(p), w, BS) for w in groups.windows) for p in GEMMA3_PROMPTS]
    assert sent == [13, 23, 27]
    block_bytes = groups.size * 2 * BS * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    assert stats["kv_transfer"]["handoffs"] == 3 and stats["kv_transfer"]["bytes"] == sum(sent) * block_bytes, json.dumps(stats)
