"""`python -m benchmarks.batch_step --model FILE [--batches 1,4,16] [--threads N]`: the decode step's time at
each batch size, in-process, as the decode worker runs it.

Lifecycle: one run in this process. Loads the model into an `LLMEngine` (weights as the GGUF ships them, the engine's
defaults: int16 activations, the one-call C step where the model takes it), then for each batch size adds that many
random 128-token prompts, prefills them and times decode steps (benchmarks.roofline decode_step_seconds: median of
8 steps after 2 warm-up steps, schedule + forward + sample), and prints ms per step and tokens/s. Prints, never
asserts: on a shared machine the figures are noisy (two OpenMP threads on two busy cores wait out scheduler ticks).
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.machine import cpu_line
from benchmarks.roofline import decode_step_seconds


def main() -> None:
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the default model)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line(), f"torch threads {args.threads}")
    t0 = time.perf_counter()
    engine = LLMEngine.load(args.model, EngineConfig(max_num_seqs=128, kv_cache_bytes=1 << 30), progress=False, tokenizer=False)
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    for batch in (int(b) for b in args.batches.split(",")):
        step_s, _ = decode_step_seconds(engine, batch, args.prompt_len, 8, warmup=2)
        print(f"batch {batch:4d}: step {step_s * 1e3:7.1f} ms  {batch / step_s:7.1f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
