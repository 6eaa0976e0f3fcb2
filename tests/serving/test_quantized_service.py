"""The default model served quantized through `pdserve launch` (1 prefill + 1 decode worker,
the GGUF's Q4_1 / Q8_0 blocks kept as they are, the default): every worker says so in
`pdserve stats`, and the greedy output of 5 chat prompts equals the float32 path's (the same
file dequantized, in this process) token for token, up to a divergence at a near-tie of the
float path's logits (tests/helpers.py LOGIT_GAP_TOL). Both outputs are printed side by side
(`pytest -s`)."""
import signal
import subprocess

import pytest

from pdserve.common.tokenizer import render_chat
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.library import Client
from tests.helpers import assert_greedy_equal, free_port
from tests.runtime.test_quantized import greedy_scored
from tests.serving.test_launcher import pdserve, wait_ready

CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Give me three tips for staying focused while studying.",
         "Explain photosynthesis to a ten-year-old.", "List three prime numbers greater than 10."]


@pytest.mark.timeout(180)  # measured 20-70 s on 2 cores
@pytest.mark.slow
def test_quantized_service_answers_like_the_float_path(tmp_path):
    clients, workers = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = pdserve("launch", "--clients", clients, "--workers", workers, "--threads", "1", "--http-port", str(free_port()),
                   "--log-dir", str(tmp_path), "--kv-cache-mb", "64", "--no-slo")
    try:
        # the float path's answers while the service starts: greedy text and the logits that chose it, in one pass
        twin = LLMEngine.load(None, EngineConfig(num_blocks=256, quantization="none"), progress=False)
        prompts = [render_chat(twin.tokenizer, [{"role": "user", "content": c}]) for c in CHATS]
        float_seqs, float_logits = greedy_scored(twin.model, prompts, 32, twin.eos_ids)
        float_out = [s[len(p):] for s, p in zip(float_seqs, prompts)]
        stats = wait_ready(proc, clients, 2, timeout=300)
        assert sorted(w["role"] for w in stats["workers"]) == ["decode", "prefill"]
        assert all(w["engine"]["quantization"] == "auto" for w in stats["workers"])
        with Client(clients, timeout=120) as c:
            served = [c.generate(token_ids=p, max_tokens=32, temperature=0.0) for p in prompts]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    compared = 0
    for chat, f, logits, s in zip(CHATS, float_out, float_logits, served):
        print(f"\n{chat}\n  float32  : {twin.tokenizer.decode(f, skip_special_tokens=True)!r}\n  quantized: {s.text!r}")
        compared += assert_greedy_equal(s.token_ids, f, list(logits), chat)
    assert compared >= 0.9 * sum(len(f) for f in float_out)
    assert proc.returncode == 0
