"""HF transformers as a baseline row: the same requests through `generate`, greedy, every request
run to its output length, in this process.

Lifecycle: `load_hf` loads the model (GGUF or HF dir) in float32 on the given threads; `hf_run`
sends a workload either one request at a time or as one static left-padded batch, and turns the
step times a streamer records (`StepClock`) into the same `RequestOutput`s the serving
benchmark's back-ends fill (`timed_output`), so HF rows go through the same metrics.
"""
from __future__ import annotations

import time


class StepClock:
    """A generate() streamer that only stamps the time of each decoding step (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value) -> None:
        if self.seen_prompt:
            self.times.append(time.perf_counter())
        self.seen_prompt = True

    def end(self) -> None:
        pass


def load_hf(model: str | None, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.common.model_path import resolve_model_path

    torch.set_num_threads(threads)
    path = resolve_model_path(model)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[float]:
    """One generate() call on left-padded prompts, exactly new_tokens each; returns step times."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = StepClock()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=pad_id, streamer=clock)
    return clock.times


def timed_output(req, start: float, step_times: list[float], n: int, run_start: float):
    """A RequestOutput from the step times of a generate() call the request took part in."""
    from pdserve.bench.metrics import RequestOutput

    mine = step_times[:n]
    return RequestOutput(prompt_len=req.prompt_len, output_tokens=len(mine), success=len(mine) == n, ttft=mine[0] - start,
                         itl=[b - a for a, b in zip(mine, mine[1:])], latency=mine[-1] - start, start_time=start - run_start,
                         error="" if len(mine) == n else f"{len(mine)} of {n} tokens")


def hf_run(model, requests, serial: bool, pad_id: int) -> tuple[list, float]:
    """(outputs, seconds) of the requests: one generate() call each (serial) or one for all."""
    outputs, t0 = [], time.perf_counter()
    for group in ([[r] for r in requests] if serial else [requests]):
        start = time.perf_counter()
        times = hf_generate(model, [r.token_ids for r in group], max(r.output_len for r in group), pad_id)
        outputs += [timed_output(r, start, times, r.output_len, t0) for r in group]
    return outputs, time.perf_counter() - t0
