"""Does structured output slow down the requests that do not use it? Free (unconstrained)
requests run alone, then beside the same number of other requests, once free and once
constrained (a JSON schema, a regex); every other request outlasts the free ones (the schema asks
for 50 list items, the regex row may not end before its min_tokens; the free others ignore EOS),
so each free request shares every step of its life with them. It reports the free requests'
output tokens/s (median of --repeats runs) and the change against running beside free requests:
the issue's figure (the batch is the same size; only the constraint differs). "Alone" is shown
for scale: a smaller batch steps faster whatever the others are.

By default it launches the service (`pdserve launch`: coordinator, HTTP gateway, 1 prefill + 1
decode worker, default model, SLO control off) and sends every request through the gateway's
/v1/completions, as a client would; --base-url uses a running service instead; --in-process
runs one in-process engine (no processes, no HTTP: the engine's own cost alone). Every kind
runs once unmeasured first (the first constrained request loads xgrammar and the tokenizer's
table; each grammar compiles once per worker). Needs a quiet machine for figures.

    .venv/bin/python -m benchmarks.structured --free 8 --others 8 --tokens 64 --repeats 3
    .venv/bin/python -m benchmarks.structured --base-url http://127.0.0.1:8000/v1 --model SmolLM2-135M-Instruct
    .venv/bin/python -m benchmarks.structured --in-process
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 50}},
          "required": ["notes"], "additionalProperties": False}
REGEX = "[a-z ]+"  # always allows another token: with min_tokens = max_tokens the row runs its whole length
QUESTIONS = ("Write notes about Paris.", "Describe a cat.", "List facts about the sea.", "Tell me about trains.")


def other_length(tokens: int) -> int:
    """The other requests' length: long enough to outlast the free ones whatever order the
    requests reach the workers in (sent at once, a free request may be prefilled a few steps after
    an other one; with --tokens 4 a margin of tokens // 2 was two steps and lost that race in CI)."""
    return 2 * tokens + 16


def other_kinds(length: int) -> dict:
    """name -> the extra request fields of the other requests (OpenAI / vLLM extra body)."""
    return {
        "free": {"ignore_eos": True, "max_tokens": length},
        "json schema": {"structured_outputs": {"json": SCHEMA}, "max_tokens": length},
        "regex": {"structured_outputs": {"regex": REGEX}, "max_tokens": length, "min_tokens": length},
    }


# ------------------------------------------------------------------ through the HTTP gateway

async def http_run(base: str, model: str, free: int, others: int, tokens: int, other_body: dict | None) -> float:
    """Free requests' output tokens per second (all sent at once, with `others` beside them)."""
    import httpx

    async def one(client, i, extra):
        body = {"model": model, "prompt": QUESTIONS[i % len(QUESTIONS)], "temperature": 0, **extra}
        r = await client.post(f"{base}/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], time.perf_counter()

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=free + others + 4)) as client:
        t0 = time.perf_counter()
        free_jobs = [one(client, i, {"ignore_eos": True, "max_tokens": tokens}) for i in range(free)]
        other_jobs = [one(client, i, other_body) for i in range(others)] if other_body else []
        results = await asyncio.gather(*free_jobs, *other_jobs)
    done = results[:free]
    assert all(n == tokens for n, _ in done), [n for n, _ in done]
    assert all(t >= max(t for _, t in done) for _, t in results[free:]), "another request ended before the free ones"
    return free * tokens / (max(t for _, t in done) - t0)


def via_http(args) -> None:
    from pdserve.launch import Launcher, NodePlan
    from pdserve.ports import free_port

    launcher = None
    base, model = args.base_url, args.model
    if base is None:
        plan = NodePlan(prefill=0 if args.colocated else 1, decode=0 if args.colocated else 1, colocated=int(args.colocated),
                        model=args.model_path, client_addr=f"tcp://127.0.0.1:{free_port()}", worker_addr=f"tcp://127.0.0.1:{free_port()}",
                        coordinator_args=["--no-slo"], gateway=True, http_port=free_port(), engine_args=["--kv-cache-mb", "512"])
        launcher = Launcher(plan, log_dir=args.log_dir)
        launcher.start()
        print("launching the service (logs in %s)..." % args.log_dir, flush=True)
        launcher.wait_ready(600)
        base = f"{plan.http_url}/v1"
    try:
        import httpx

        model = model or httpx.get(f"{base}/models", timeout=30).json()["data"][0]["id"]
        length = other_length(args.tokens)
        report(args, {name: (lambda f, o, body=body: asyncio.run(http_run(base, model, f, o, args.tokens, body)))
                      for name, body in other_kinds(length).items()})
    finally:
        if launcher is not None:
            launcher.stop()


# ------------------------------------------------------------------ one in-process engine

def in_process(args) -> None:
    from pdserve.common.tokenizer import render_chat
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine
    from pdserve_client.params import SamplingParams, StructuredOutput

    eng = LLMEngine.load(args.model_path, EngineConfig(kv_cache_bytes=256 * 2**20), progress=False)
    prompts = [render_chat(eng.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    length = other_length(args.tokens)
    kinds = {
        "free": SamplingParams(temperature=0, max_tokens=length, ignore_eos=True),
        "json schema": SamplingParams(temperature=0, max_tokens=length, structured=StructuredOutput("json", json.dumps(SCHEMA))),
        "regex": SamplingParams(temperature=0, max_tokens=length, min_tokens=length, structured=StructuredOutput("regex", REGEX)),
    }

    def run(free: int, others: int, other_params) -> float:
        free_params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        for i in range(free):
            eng.add_request(prompts[i % len(prompts)], free_params, request_id=f"free-{i}")
        for i in range(others if other_params else 0):
            eng.add_request(prompts[i % len(prompts)], other_params, request_id=f"other-{i}")
        done, t0, end = 0, time.perf_counter(), None
        while eng.has_work():
            for out in eng.step():
                if out.request_id.startswith("other-") and out.finish_reason is not None and end is None:
                    raise AssertionError("another request ended before the free ones")
                if out.request_id.startswith("free-") and out.token_id is not None:
                    done += 1
                    if done == free * args.tokens:
                        end = time.perf_counter()
            if end is not None:
                break
        for i in range(others):  # the rest of the others is not measured
            eng.abort(f"other-{i}")
        while eng.has_work():
            eng.step()
        return done / (end - t0)

    report(args, {name: (lambda f, o, p=p: run(f, o, p)) for name, p in kinds.items()})


# ------------------------------------------------------------------ both

def report(args, kinds: dict) -> None:
    """kinds: name -> run(free, others) -> free tok/s; "free" is the baseline beside which the others are compared."""
    alone = kinds["free"]  # with others=0 it runs the free requests alone
    for run in kinds.values():  # warm-up: xgrammar, the tokenizer's table, each grammar's compile
        run(min(2, args.free), min(2, args.others))
    rows = [("alone", lambda: alone(args.free, 0))] + [(f"beside {args.others} {name}", lambda run=run: run(args.free, args.others))
                                                      for name, run in kinds.items()]
    rates = {}
    for label, fn in rows:
        runs = [fn() for _ in range(args.repeats)]
        rates[label] = statistics.median(runs)
        base = rates.get(f"beside {args.others} free")
        vs = f" ({100 * (rates[label] / base - 1):+.1f}% vs beside free)" if base and label != f"beside {args.others} free" else ""
        print(f"{args.free} free requests {label}: {rates[label]:.1f} free tok/s{vs}; runs {', '.join(f'{r:.1f}' for r in runs)}", flush=True)
    base = rates[f"beside {args.others} free"]
    worst = min(v for k, v in rates.items() if k not in ("alone", f"beside {args.others} free"))
    print(f"FIGURE: free requests' throughput beside constrained ones: {100 * (worst / base - 1):+.1f}% vs beside free ones "
          f"(worst kind; goal: a drop under 5%); alone: {rates['alone']:.1f} free tok/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--free", type=int, default=8, help="free requests measured")
    ap.add_argument("--others", type=int, default=8, help="requests beside them (free or constrained)")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens of each free request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--in-process", action="store_true", help="one in-process engine instead of a launched service")
    ap.add_argument("--base-url", default=None, help="a running service's OpenAI base URL (default: launch one)")
    ap.add_argument("--model", default=None, help="with --base-url: the served model name (default: the first in /v1/models)")
    ap.add_argument("--model-path", default=None, help="the model to launch or load (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--colocated", action="store_true", help="launch one colocated worker instead of 1 prefill + 1 decode")
    ap.add_argument("--log-dir", default="/tmp/pdserve-bench-structured", help="the launched processes' logs")
    args = ap.parse_args()
    in_process(args) if args.in_process else via_http(args)


if __name__ == "__main__":
    main()
