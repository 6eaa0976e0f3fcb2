#!/usr/bin/env python
"""Where a prefill step's time goes, and whole prefills under each quantized linear back-end.

Loads the default model (quantized, as a worker serves it) once, in this process, on --threads
torch threads. For each back-end of --backends (kernels/backends.py names, forced on every linear
layer above --small-rows rows; c-int16 at fewer, e.g. the LM head's one row), for each prompt length of --lens: the median of --repeats
prefills of one random prompt (a fresh KV pool each, the logits of the last row only, as the
engine asks for them), then one more prefill with every section timed by wrappers around the
calls runtime/cpu_forward.py makes: each linear layer by shape, attention, rope + KV write,
RMSNorm, SiLU*mul, the embedding and the LM head (the logits); "other" is what is left of the
forward. The back-ends alternate call by call in the whole-prefill timing; --cpu-time (with
--threads 1) times by the process's CPU time instead of the wall clock. With --gate it also runs runtime/linear_plan.py's teacher-forced check of each reduced
back-end against the exact one over the shipped conversations (top-1 agreement, mean KL).

Usage: .venv/bin/python -m benchmarks.prefill_profile [--threads 2] [--lens 128,512]
           [--backends c-int16,c-int8-vnni] [--repeats 5] [--gate]
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from benchmarks.isa import CLOCK, alternate, parse_timed
from pdserve.runtime import linear_plan
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import load_model
from pdserve.runtime.kv_cache import allocate_kv_cache
from pdserve.runtime.model import ForwardBatch

BLOCK = 16


def prefill(model, ids: list[int]) -> torch.Tensor:
    """One prompt's prefill in one step, into a fresh KV pool; the last row's logits."""
    n = len(ids)
    blocks = -(-n // BLOCK)
    kv = allocate_kv_cache(model.cfg, blocks, BLOCK, torch.float32)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None], max_query_len=n, logits_indices=torch.tensor([n - 1]),
    )
    return model(batch, kv)


def _timed(totals: dict, name: str, fn):
    def run(*args, **kwargs):
        t0 = CLOCK[0]()
        out = fn(*args, **kwargs)
        totals[name] += CLOCK[0]() - t0
        return out

    return run


def sections(model, ids: list[int]) -> dict[str, float]:
    """Seconds by section of one prefill (wrappers on the fast path's calls, removed after)."""
    fast, totals = model.fast, defaultdict(float)
    ops = fast.ops
    saved = {"lm_head": fast.lm_head, "embed": fast.embed}
    wrapped_layers = [(layer, {a: getattr(layer, a) for a in ("qkv", "o", "gate_up", "down")}) for layer in fast.layers]
    try:
        for layer, lins in wrapped_layers:
            for attr, lin in lins.items():
                setattr(layer, attr, _timed(totals, f"linear {attr} {lin.out_features}x{lin.in_features}", lin))
        fast.lm_head = _timed(totals, "LM head (logits)", saved["lm_head"])
        fast.embed = _timed(totals, "embedding", saved["embed"])
        fast._attention = _timed(totals, "attention", fast._attention)
        for name, label in (("rms_norm", "RMSNorm (+ residual)"), ("rope_write_kv", "rope + KV write"), ("silu_mul", "SiLU * mul")):
            setattr(ops, name, _timed(totals, label, getattr(ops, name)))
        t0 = CLOCK[0]()
        prefill(model, ids)
        totals["forward (whole)"] = CLOCK[0]() - t0
    finally:
        for layer, lins in wrapped_layers:
            for attr, lin in lins.items():
                setattr(layer, attr, lin)
        fast.lm_head, fast.embed = saved["lm_head"], saved["embed"]
        del fast._attention
        for name in ("rms_norm", "rope_write_kv", "silu_mul"):
            delattr(ops, name)
    return dict(totals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lens", default="128,512")
    ap.add_argument("--backends", default="c-int16,c-int8-vnni")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small-rows", type=int, default=8, help="calls of up to this many rows run c-int16 under every back-end")
    ap.add_argument("--gate", action="store_true", help="also the teacher-forced check of each non-int16 back-end")
    args = parse_timed(ap)
    _, model = load_model(None, EngineConfig())
    lins = linear_plan.linears(model.fast)
    g = torch.Generator().manual_seed(0)
    lens = [int(n) for n in args.lens.split(",")]
    prompts = {n: torch.randint(100, model.cfg.vocab_size - 100, (n,), generator=g).tolist() for n in lens}
    names = args.backends.split(",")

    def plan(name: str) -> list[tuple[int, str]]:  # decode-sized calls (the LM head's one row) stay on c-int16, as the selector has them
        return [(args.small_rows, "c-int16"), (1 << 62, name)]

    def under(name: str, ids: list[int]):
        def run():
            for lin in lins:
                lin.use(plan(name))
            prefill(model, ids)
        return run

    with torch.inference_mode():  # whole prefills, the back-ends alternating call by call (a shared machine's noise hits each alike)
        medians = {n: alternate({name: under(name, ids) for name in names}, args.repeats) for n, ids in prompts.items()}
    for name in names:
        for lin in lins:
            lin.use(plan(name))
        with torch.inference_mode():
            for n, ids in prompts.items():
                s = medians[n][name] / 1e3
                print(f"\n{name}: prefill of {n} tokens: {s * 1e3:.1f} ms median of {args.repeats} ({n / s:.0f} tok/s); one prefill by section:")
                parts = sections(model, ids)
                whole = parts.pop("forward (whole)")
                for label, sec in sorted(parts.items(), key=lambda kv: -kv[1]):
                    print(f"  {label:32s} {sec * 1e3:8.1f} ms {sec / whole:6.1%}")
                print(f"  {'other':32s} {(whole - sum(parts.values())) * 1e3:8.1f} ms; forward {whole * 1e3:.1f} ms")
        if args.gate and name != "c-int16":
            doc = linear_plan.teacher_forced_check(model, None, name, "int16")
            print(f"teacher-forced check of {name}: top-1 {doc['top1']:.2%} over {doc['positions']} positions, mean KL {doc['kl']:.5f}: "
                  f"{'passes' if doc['passed'] else 'fails'} (>= {linear_plan.MIN_TOP1:.0%}, <= {linear_plan.MAX_KL})")


if __name__ == "__main__":
    main()
