"""How much of the quantized KV cache's greedy disagreement is the criterion's own sensitivity,
and which 8-bit row form loses least: the default model's module forward (the float cache,
`fast_path=False`) with K and V rounded as they are written (kernels.paged.write_kv wrapped here,
nothing else changed), against the exact float cache, on issue 41's criterion (the first 64
greedy tokens identical, the first 50 shipped chat prompts, batched as benchmarks.kv_dtype runs
them). Roundings (each on K and V unless named -k / -v):
  bf16, fp16              16-bit controls
  int8                    what `--kv-cache-dtype int8` stores (kv_quant.pack, then unpack): each
                          (token, head) row Hadamard-rotated, asymmetric 8-bit codes, a float16
                          scale and an int16 zero code; int8-k / int8-v on K or V only
  int8-sym                what int8 stored before 2026-12-08: symmetric codes, a scale amax / 127
                          per row, unrotated; -k / -v; int8-g16, int8-k-g8: a scale per 16 (8) channels
  int8-rot                rotated, symmetric per row
  int8-asym               unrotated, asymmetric (exact float32 scale and minimum)
  int8-rot-asym           rotated, asymmetric, float32 scale and minimum (a W = D + 8 row)
  int8-rot-asym-half      the same with scale and minimum rounded to float16 (the minimum's
                          rounding is an offset of the whole row)
  fp8, fp8-rot            e4m3 with a scale per row (what fp8 stores), and rotated first

    python -m benchmarks.kv_rounding [--prompts 50] [--modes bf16,fp16,int8,int8-sym,...] [--errors 8]

Rotation here is kv_quant.hadamard, then H / D on the way back, as the cache does. --errors N
first prints each mode's error on the K and V rows the exact cache's run of the first N prompts
(16 tokens each) writes: the root mean square over rows of |rounded - x| / |x|, and of the
error's offset (its mean over a row's channels, which shifts every score of a key alike) — smooth
measures beside the chaotic greedy criterion.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.kv_dtype import chat_prompts
from benchmarks.machine import cpu_line
from pdserve.kernels import kv_quant, paged
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.params import SamplingParams


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as `--kv-cache-dtype int8` stores it (kv_quant.pack, then unpack)."""
    return kv_quant.unpack(kv_quant.pack(x, kv_quant.INT8))


def sym_rows(group: int = 0):
    """Symmetric int8 with one scale amax / 127 per row, or per `group` channels (int8's rows before 2026-12-08)."""
    def rounded(x: torch.Tensor) -> torch.Tensor:
        y = x.reshape(*x.shape[:-1], x.shape[-1] // group, group) if group else x
        scale = y.abs().amax(-1, keepdim=True) / 127
        safe = torch.where(scale > 0, scale, 1.0)
        return (torch.round(y / safe).clamp(-127, 127) * scale).reshape(x.shape)
    return rounded


def asym_rows(half: bool = False):
    """Asymmetric 8-bit codes: lo = the row's minimum, scale = (max - min) / 255 (float32, or both rounded to float16)."""
    def rounded(y: torch.Tensor) -> torch.Tensor:
        lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        scale = (hi - lo) / 255
        if half:
            lo, scale = lo.half().float(), scale.half().float()
        safe = torch.where(scale > 0, scale, 1.0)
        return torch.round((y - lo) / safe).clamp(0, 255) * scale + lo
    return rounded


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    return kv_quant.unpack(kv_quant.pack(x, kv_quant.FP8))


def rotated(rounding):
    """rounding applied to the Hadamard-rotated row, rotated back."""
    return lambda x: kv_quant.hadamard(rounding(kv_quant.hadamard(x))) / x.shape[-1]


def relative_errors(rounding, x: torch.Tensor) -> str:
    """Over rows x (..., D): sqrt(mean of |e|^2 / |x|^2) for e = rounding(x) - x, and the same of the
    rows' offsets, D mean(e)^2 / |x|^2 (the part of e common to a row's channels); - where x stays exact."""
    if rounding is None:
        return "-       -      "
    e, norm = rounding(x) - x, x.pow(2).sum(-1).clamp_min(1e-30)
    return f"{(e.pow(2).sum(-1) / norm).mean().sqrt().item():.5f} {(e.mean(-1).pow(2) * x.shape[-1] / norm).mean().sqrt().item():.5f}"


def cast(dtype):
    return lambda x: x.to(dtype).float()


MODES = {  # name: (K's rounding, V's rounding)
    "bf16": (cast(torch.bfloat16), cast(torch.bfloat16)), "fp16": (cast(torch.float16), cast(torch.float16)),
    "int8": (int8_rows, int8_rows), "int8-k": (int8_rows, None), "int8-v": (None, int8_rows),
    "int8-sym": (sym_rows(), sym_rows()), "int8-sym-k": (sym_rows(), None), "int8-sym-v": (None, sym_rows()),
    "int8-g16": (sym_rows(16), sym_rows(16)), "int8-k-g8": (sym_rows(8), sym_rows()),
    "int8-rot": (rotated(sym_rows()), rotated(sym_rows())),
    "int8-asym": (asym_rows(), asym_rows()),
    "int8-rot-asym": (rotated(asym_rows()), rotated(asym_rows())),
    "int8-rot-asym-half": (rotated(asym_rows(True)), rotated(asym_rows(True))),
    "fp8": (fp8_rows, fp8_rows), "fp8-rot": (rotated(fp8_rows), rotated(fp8_rows)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--errors", type=int, default=0, help="first the modes' relative errors on the KV rows of this many prompts")
    args = ap.parse_args()
    print(cpu_line(), f"torch threads {torch.get_num_threads()}")
    exact_write = paged.write_kv
    mode = [None]
    written: list | None = None  # (k, v) of every write while --errors collects them

    def write_kv(k_cache, v_cache, k, v, slot_mapping):
        if written is not None:
            written.append((k.float().clone(), v.float().clone()))
        round_k, round_v = MODES[mode[0]] if mode[0] else (None, None)
        k = round_k(k.float()).to(k.dtype) if round_k else k
        v = round_v(v.float()).to(v.dtype) if round_v else v
        exact_write(k_cache, v_cache, k, v, slot_mapping)

    paged.write_kv = write_kv
    # no prefix cache: every run computes (and rounds) its prompts' KV, none reads blocks an earlier run cached
    engine = LLMEngine.load(None, EngineConfig(fast_path=False, kv_cache_bytes=1 << 29, prefix_cache=False), progress=False)
    prompts = chat_prompts(engine.tokenizer, args.prompts)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    if args.errors:
        written = []
        engine.generate(chat_prompts(engine.tokenizer, args.errors), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        k_rows, v_rows = (torch.cat([w[i] for w in written]) for i in (0, 1))
        written = None
        print(f"relative error (rms, rms of the rows' offsets) on the {k_rows.shape[0] * k_rows.shape[1]} K and as many V rows "
              f"of {args.errors} prompts:")
        for name in args.modes.split(","):
            errs = [relative_errors(f, x) for f, x in zip(MODES[name], (k_rows, v_rows))]
            print(f"  {name:18s}: K {errs[0]}  V {errs[1]}", flush=True)
    if not prompts:
        return
    ref = [c.token_ids for c in engine.generate(prompts, params)]
    for name in args.modes.split(","):
        mode[0] = name
        outs = [c.token_ids for c in engine.generate(prompts, params)]
        first = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(o)) for o, r in zip(outs, ref)]
        print(f"KV rounded as {name:18s}: greedy {args.tokens} tokens identical to the exact cache's on "
              f"{sum(o == r for o, r in zip(outs, ref))}/{len(prompts)} prompts (mean first divergence at token "
              f"{sum(first) / len(first):.1f})", flush=True)


if __name__ == "__main__":
    main()
