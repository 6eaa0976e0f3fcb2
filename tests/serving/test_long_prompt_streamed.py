"""Long prompts stay exact through the streamed hand-off: a 6,000-token prompt on the default
model (SmolLM2-135M, 8k context, its GGUF dequantized: `--quantization none`, the path HF
transformers computes) prefilled on a prefill worker in chunks of 2,048 tokens, the first two
chunks' blocks streamed into the decode worker's grant while the next ones compute, the last
with the KVReady (shm). Its greedy tokens equal HF transformers' on the same file (up to a
divergence at a near-tie, tests/helpers.py LOGIT_GAP_TOL), and both pools are whole after.

Real processes on loopback: a coordinator, one prefill and one decode worker. HF's reference is
computed here while the service starts (a few output tokens: one 6,000-token forward).
"""
import functools

import pytest
import torch

from pdserve_client.library import Client
from tests.helpers import assert_greedy_equal, hf_greedy, start_cluster, wait_all_blocks_free

PROMPT_TOKENS = 6000
MAX_TOKENS = 4


def long_prompt(tokenizer) -> list[int]:
    """PROMPT_TOKENS token ids of plain English (a ledger of numbered lines), ending mid-sentence."""
    colours = ["red", "green", "blue", "yellow", "white", "black", "orange"]
    lines = [f"Line {i}: the {colours[i % 7]} box on shelf {i % 13} holds {(i * 37) % 101} stones." for i in range(1200)]
    ids = tokenizer.encode("\n".join(lines), add_special_tokens=False)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_a_6000_token_prompt_through_the_streamed_hand_off_is_greedy_equal_to_hf(tmp_path, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM

    from pdserve.common.tokenizer import load_tokenizer
    from pdserve.runtime.weights import default_model_path

    path = default_model_path()
    launcher = start_cluster(path, tmp_path, kv_backend="shm", threads=None, timeout=600,
                             engine_args=["--quantization", "none", "--kv-cache-mb", "512", "--max-num-batched-tokens", "2048"],
                             coordinator_args=["--no-slo"])  # a 6,000-token prefill on 2 cores is past any TTFT target
    try:
        prompt = long_prompt(load_tokenizer(None))
        # as tests/runtime/test_hf_equivalence.py loads it: the GGUF parsed once, not per module
        monkeypatch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        monkeypatch.undo()
        with torch.no_grad():
            ref, logits = hf_greedy(hf, prompt, MAX_TOKENS, eos=False)
        del hf
        with Client(launcher.plan.client_addr, timeout=600) as c:
            r = c.generate(token_ids=prompt, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            assert r.prompt_tokens == PROMPT_TOKENS and r.prefill_worker.startswith("t-prefill")
            assert assert_greedy_equal(r.token_ids, ref, logits, "6000-token prompt") >= 1
            stats = wait_all_blocks_free(c, timeout=30)
            assert all(w["fenced_blocks"] == 0 for w in stats["workers"])
            prefill = next(w for w in stats["workers"] if w["role"] == "prefill")
            kv_bytes = 30 * 2 * 3 * 64 * 4 * 16 * -(-PROMPT_TOKENS // 16)  # layers, k/v, kv heads, head dim, fp32, the prompt's blocks of 16
            assert prefill["kv_bytes_sent"] == kv_bytes  # every block moved once, streamed or with the KVReady
    finally:
        launcher.stop()
