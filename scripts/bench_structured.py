"""Does structured output slow down the requests that do not use it? One in-process engine on
the default model runs a batch of free requests beside the same number of other requests, once
free and once constrained (a JSON schema, or a regex), every request the same length (ignore_eos
for the free ones; the constrained ones are made long enough to outlast them), and reports the
free requests' output tokens/s, median of --repeats runs each, and the drop.

    .venv/bin/python scripts/bench_structured.py --free 8 --others 8 --tokens 64
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import LLMEngine  # noqa: E402
from runtime.params import SamplingParams, StructuredOutput  # noqa: E402
from runtime.tokenizer import render_chat  # noqa: E402

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 50}},
          "required": ["notes"], "additionalProperties": False}


def run(eng, prompts, free: int, others: int, tokens: int, other_params) -> float:
    """Free requests' output tokens per second while `others` requests with other_params run beside them."""
    free_params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(free):
        eng.add_request(prompts[i % len(prompts)], free_params, request_id=f"free-{i}")
    for i in range(others):
        eng.add_request(prompts[i % len(prompts)], other_params, request_id=f"other-{i}")
    done, t0, end = 0, time.perf_counter(), None
    while eng.has_work():
        for out in eng.step():
            if out.request_id.startswith("free-") and out.token_id is not None:
                done += 1
                if done == free * tokens:
                    end = time.perf_counter()
        if end is not None:
            break
    for i in range(others):  # the rest of the others is not measured
        eng.abort(f"other-{i}")
    while eng.has_work():
        eng.step()
    return done / (end - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--free", type=int, default=8)
    ap.add_argument("--others", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    eng = LLMEngine.load(None, EngineConfig(kv_cache_bytes=256 * 2**20), progress=False)
    prompts = [render_chat(eng.tokenizer, [{"role": "user", "content": q}]) for q in
               ("Write notes about Paris.", "Describe a cat.", "List facts about the sea.", "Tell me about trains.")]
    long = args.tokens * 3
    kinds = {
        "free": SamplingParams(temperature=0, max_tokens=long, ignore_eos=True),
        "json schema": SamplingParams(temperature=0, max_tokens=long, structured=StructuredOutput("json", json.dumps(SCHEMA))),
        "regex": SamplingParams(temperature=0, max_tokens=long, structured=StructuredOutput("regex", r"[a-z ]{%d,%d}" % (long, long))),
    }
    run(eng, prompts, 2, 2, 4, kinds["json schema"])  # warm-up: loads xgrammar and the tokenizer table
    base = None
    for name, params in kinds.items():
        rates = [run(eng, prompts, args.free, args.others, args.tokens, params) for _ in range(args.repeats)]
        rate = statistics.median(rates)
        base = base or rate
        print(f"{args.free} free requests beside {args.others} {name} requests: {rate:.1f} free tok/s "
              f"({100 * (rate / base - 1):+.1f}% vs beside free ones; runs {', '.join(f'{r:.1f}' for r in rates)})", flush=True)


if __name__ == "__main__":
    main()
