"""What scoring a prompt costs in the prefill pass (runtime/scoring.py): one engine (the default
model unless --model), prompts of --tokens random ids prefilled with max_tokens=1, without and with
prompt_logprobs=K; prints the median seconds of --repeats runs each and the ratio. Scoring computes
a vocabulary row per prompt token (the lm_head over every row, a log-softmax, a top-k) and chunks
the prompt by SCORE_CHUNK tokens, so it costs more than a plain prefill; this says how much.

    .venv/bin/python -m benchmarks.scoring --tokens 1024 --repeats 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--k", type=int, default=1, help="prompt_logprobs: top alternatives per prompt token")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    engine = LLMEngine.load(a.model, EngineConfig(max_num_batched_tokens=max(2048, a.tokens), prefix_cache=False), progress=False)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, engine.cfg.vocab_size, (a.tokens,), generator=g).tolist()
    times = {}
    for name, k in (("plain", None), (f"prompt_logprobs={a.k}", a.k)):
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
        engine.generate([prompt], params)  # warm
        runs = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            engine.generate([prompt], params)
            runs.append(time.perf_counter() - t0)
        times[name] = statistics.median(runs)
        print(f"{name:>20}: {times[name] * 1000:8.1f} ms median of {a.repeats} ({a.tokens} prompt tokens)")
    plain, scored = times.values()
    print(f"scoring costs {scored / plain:.2f}x a plain prefill")


if __name__ == "__main__":
    main()
