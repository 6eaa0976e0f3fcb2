#!/usr/bin/env python
"""Runtime benchmark: pdserve's model runtime vs HF transformers on the same weights, same run.

Prints load seconds, prefill tokens/s at one prompt of --prompt-len tokens, and decode tokens/s
at each batch size (decode rate = batch * N / (time for N+1 tokens - time for 1 token), so
prefill is excluded the same way for both), with medians of --repeats runs and the ratios.
Usage: .venv/bin/python -m benchmarks.runtime_vs_hf [--batches 1,8,32] [--new-tokens 32]
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.timing import median_seconds
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.params import SamplingParams


def prompts(batch, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist() for _ in range(batch)]


def rates(args, run, vocab: int) -> tuple[float, dict]:
    """run(prompts, n) generates n tokens for each prompt: (prefill tok/s, {batch: decode tok/s})."""
    long = prompts(1, args.prompt_len, vocab)
    prefill = args.prompt_len / median_seconds(lambda: run(long, 1), args.repeats, warmup=1)
    decode = {}
    for b in args.batches:
        ps = prompts(b, args.decode_prompt_len, vocab, seed=b)
        t1 = median_seconds(lambda: run(ps, 1), args.repeats)
        tn = median_seconds(lambda: run(ps, args.new_tokens + 1), args.repeats)
        decode[b] = b * args.new_tokens / (tn - t1)
    return prefill, decode


def ours(args):
    t0 = time.perf_counter()
    eng = LLMEngine.load(args.model, EngineConfig(dtype="float32", kv_cache_bytes=1 << 30, max_num_batched_tokens=4096), progress=False)
    load = time.perf_counter() - t0
    run = lambda ps, n: eng.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))  # noqa: E731
    return (load, *rates(args, run, eng.cfg.vocab_size))


def hf(args):
    from benchmarks.hf import load_hf

    t0 = time.perf_counter()
    model = load_hf(args.model, torch.get_num_threads())
    load = time.perf_counter() - t0

    def run(ps, n):
        ids = torch.tensor(ps)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    return (load, *rates(args, run, model.config.vocab_size))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32")
    a = ours(args)
    b = hf(args)
    rows = [("load seconds", a[0], b[0]), (f"prefill tok/s (prompt {args.prompt_len})", a[1], b[1])]
    rows += [(f"decode tok/s (batch {k})", a[2][k], b[2][k]) for k in args.batches]
    print(f"{'metric':34s} {'pdserve':>10s} {'HF':>10s} {'ratio':>7s}")
    for name, x, y in rows:
        ratio = (y / x) if name.startswith("load") else (x / y)
        print(f"{name:34s} {x:10.2f} {y:10.2f} {ratio:6.2f}x")
    print("(ratio: pdserve's advantage; for load, HF seconds / pdserve seconds)")


if __name__ == "__main__":
    main()
