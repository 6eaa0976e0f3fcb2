"""Gemma 2 through `pdserve launch --model DIR` (real processes on loopback): a tiny random
checkpoint written by transformers, with its soft-caps, windows and norms acting (the configs of
tests/runtime/test_hf_equivalence.py), served colocated and through the shm hand-off, gives HF's
greedy tokens (the one allowed near-tie divergence: tests/helpers.py) for prompts past the window."""
import asyncio

import pytest
import torch

from pdserve_client.library import AsyncClient
from tests.helpers import assert_greedy_equal, hf_greedy, save_tiny_served_model, start_cluster

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


async def _generate(address):
    async with AsyncClient(address, timeout=60) as c:
        return await asyncio.gather(*(c.generate(token_ids=p, temperature=0.0, max_tokens=16, ignore_eos=True) for p in PROMPTS))


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
