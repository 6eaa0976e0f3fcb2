"""Long prompts stay exact through the streamed hand-off: a 6,000-token prompt on the default
model (SmolLM2-135M, 8k context, its GGUF dequantized: `--quantization none`, the path HF
transformers computes) prefilled on a prefill worker in chunks of 2,048 tokens, the first two
chunks' blocks streamed into the decode worker's grant while the next ones compute, the last
with the KVReady (shm). Its greedy tokens equal HF transformers' on the same file (up to a
divergence at a near-tie, tests/helpers.py LOGIT_GAP_TOL), and both pools are whole after.

Real processes on loopback: a coordinator, one prefill and one decode worker. HF's reference
(a few output tokens: one 6,000-token forward, ~60 s of one core) is the one this module wrote
with HF transformers on the same file (`python -m tests.serving.test_long_prompt_streamed`:
tests/serving/long_prompt_hf.json, keyed by the GGUF's sha256 and transformers' version); where
the service's tokens differ from it, or the key does not match, HF runs here and decides.
"""
import hashlib
import json
from pathlib import Path

import pytest
import torch

from pdserve_client.library import Client
from tests.helpers import assert_greedy_equal, hf_from_gguf, hf_greedy, start_cluster, wait_all_blocks_free

PROMPT_TOKENS = 6000
MAX_TOKENS = 4
REFERENCE = Path(__file__).with_name("long_prompt_hf.json")


def long_prompt(tokenizer) -> list[int]:
    """PROMPT_TOKENS token ids of plain English (a ledger of numbered lines), ending mid-sentence."""
    colours = ["red", "green", "blue", "yellow", "white", "black", "orange"]
    lines = [f"Line {i}: the {colours[i % 7]} box on shelf {i % 13} holds {(i * 37) % 101} stones." for i in range(1200)]
    ids = tokenizer.encode("\n".join(lines), add_special_tokens=False)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


def reference_key(path: Path) -> dict:
    import transformers

    return {"gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "transformers": transformers.__version__,
            "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS}


def hf_reference(path: Path, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """HF transformers' greedy tokens and logits on the default model's file, dequantized to float32."""
    hf = hf_from_gguf(path)
    with torch.no_grad():
        return hf_greedy(hf, prompt, MAX_TOKENS, eos=False)


def stored_reference(path: Path) -> list[int] | None:
    """The tokens REFERENCE holds for this file and transformers version (None: absent or another key)."""
    if not REFERENCE.exists():
        return None
    stored = json.loads(REFERENCE.read_text())
    return stored["tokens"] if stored["key"] == reference_key(path) else None


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_a_6000_token_prompt_through_the_streamed_hand_off_is_greedy_equal_to_hf(tmp_path):
    from pdserve.common.tokenizer import load_tokenizer
    from pdserve.runtime.weights import default_model_path

    path = default_model_path()
    launcher = start_cluster(path, tmp_path, kv_backend="shm", threads=None, timeout=600,
                             engine_args=["--quantization", "none", "--kv-cache-mb", "512", "--max-num-batched-tokens", "2048"],
                             coordinator_args=["--no-slo"])  # a 6,000-token prefill on 2 cores is past any TTFT target
    try:
        prompt = long_prompt(load_tokenizer(None))
        stored = stored_reference(path)
        with Client(launcher.plan.client_addr, timeout=600) as c:
            r = c.generate(token_ids=prompt, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            assert r.prompt_tokens == PROMPT_TOKENS and r.prefill_worker.startswith("t-prefill")
            if r.token_ids != stored:  # not HF's stored answer (or none for this file): HF decides here
                ref, logits = hf_reference(path, prompt)
                assert assert_greedy_equal(r.token_ids, ref, logits, "6000-token prompt") >= 1
            stats = wait_all_blocks_free(c, timeout=30)
            assert all(w["fenced_blocks"] == 0 for w in stats["workers"])
            prefill = next(w for w in stats["workers"] if w["role"] == "prefill")
            kv_bytes = 30 * 2 * 3 * 64 * 4 * 16 * -(-PROMPT_TOKENS // 16)  # layers, k/v, kv heads, head dim, fp32, the prompt's blocks of 16
            assert prefill["kv_bytes_sent"] == kv_bytes  # every block moved once, streamed or with the KVReady
    finally:
        launcher.stop()


if __name__ == "__main__":  # write REFERENCE: HF's greedy answer on the default model's file
    from pdserve.common.model_path import default_model_path
    from pdserve.common.tokenizer import load_tokenizer

    model = default_model_path()
    tokens, step_logits = hf_reference(model, long_prompt(load_tokenizer(None)))
    gaps = [float(lg.topk(2).values[0] - lg.topk(2).values[1]) for lg in step_logits]
    REFERENCE.write_text(json.dumps({"key": reference_key(model), "tokens": tokens, "top2_logit_gaps": gaps}, indent=1) + "\n")
    print(f"wrote {REFERENCE}: {tokens} (top-2 logit gaps {gaps})")
