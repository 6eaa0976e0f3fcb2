"""--kv-cache-dtype on the default model, in one run (issue 41's Must show): bytes per token and
blocks per GiB for auto (float32 on the CPU), int8 and fp8; greedy agreement with the float
cache (the first 64 greedy tokens identical, over the first 50 shipped chat prompts rendered with
the chat template); lone-stream TPOT at a long context (one prompt of --context random tokens,
then --steps decode steps, the median step).

    python -m benchmarks.kv_dtype [--prompts 50] [--tokens 64] [--context 4096] [--steps 32]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.machine import cpu_line
from pdserve.common.tokenizer import render_chat
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.params import SamplingParams

DTYPES = ("auto", "int8", "fp8")


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    path = Path(__file__).resolve().parents[1] / "pdserve" / "data" / "prompts.jsonl"
    texts = [json.loads(line)["conversations"][0]["value"] for line in path.read_text().splitlines() if line.strip()][:n]
    return [render_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def tpot(engine: LLMEngine, context: int, steps: int) -> float:
    """Median seconds of a lone stream's decode step after a prompt of `context` tokens."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (context,), generator=g).tolist()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True), request_id="tpot")
    times, last = [], None
    while engine.has_work():
        engine.step()
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    print(cpu_line(), f"torch threads {torch.get_num_threads()}")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ref, prompts = None, None
    for kv in DTYPES:
        conf = EngineConfig(kv_cache_dtype=kv, kv_cache_bytes=1 << 30, max_model_len=args.context + args.steps + 16)
        engine = LLMEngine.load(None, conf, progress=False)
        cfg = engine.cfg
        per_token = conf.kv_bytes_per_token(cfg)
        blocks_gib = (1 << 30) // (per_token * conf.block_size)
        prompts = prompts or chat_prompts(engine.tokenizer, args.prompts)
        t0 = time.perf_counter()
        outs = [c.token_ids for c in engine.generate(prompts, params)]
        gen_s = time.perf_counter() - t0
        if ref is None:
            ref = outs
        same = sum(o == r for o, r in zip(outs, ref))
        first_diff = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(o)) for o, r in zip(outs, ref)]
        step = tpot(engine, args.context, args.steps)
        print(f"kv-cache-dtype {kv:5s} ({engine.runner.kv_cache.dtype}): {per_token} B/token, {blocks_gib} blocks/GiB "
              f"({blocks_gib * conf.block_size} tokens); greedy {args.tokens} tokens identical to the float cache's on "
              f"{same}/{len(prompts)} prompts (mean first divergence at token {sum(first_diff) / len(first_diff):.1f}); "
              f"generate {gen_s:.1f} s; lone-stream TPOT at {args.context} context {step * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
