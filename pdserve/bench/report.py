"""What a `pdserve bench` run leaves: the report it prints, the result files, the sweep plot.

Lifecycle: once every rate has run, `print_runs` reduces each run's outputs to vLLM's figures
(`metrics`), prints them with the traffic description (and, for the pdserve back-end, the KV
hand-off and prefix-cache figures) and returns one result dict per rate; `save_results` then
writes `--save-result` and `plot_sweep` draws `--sweep`'s PNG. `--save-result` alone (vLLM's
form, or with `--append-result`) writes one file per rate as vLLM does: the file name
`{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json` under --result-dir unless
--result-filename, flat keys (date, endpoint_type, backend, label, model_id, tokenizer_id,
num_prompts, metadata, request_rate, burstiness, max_concurrency, duration, completed, failed,
totals, throughputs, max_output_tokens_per_s, max_concurrent_requests, then
mean/median/std/pN of each selected metric), per-request lists only with --save-detailed.
`--save-result FILE.json` (pdserve's older form) writes everything, per-request lists included,
to FILE.json.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import datetime

from pdserve.bench import import_extra
from pdserve.bench.metrics import compute_metrics, format_metrics, parse_goodput, result_dict

DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")
PDSERVE_ONLY_KEYS = ("e2els", "start_times", "goodput_slos_ms", "dataset", "input_len", "output_len", "ignore_eos", "seed", "base_url")


def config_dict(args, tokenizer_id: str, rate: float) -> dict:
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "base_url": args.base_url, "model_id": args.model,
        "tokenizer_id": tokenizer_id, "dataset": args.dataset, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "request_rate": rate if rate != float("inf") else "inf", "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "seed": args.seed,
    }


def describe_traffic(args, rate: float) -> str:
    kind = "Poisson process" if args.burstiness == 1.0 else "gamma distribution"
    return (f"Traffic request rate: {rate}\nBurstiness factor: {args.burstiness} ({kind})\n"
            f"Maximum request concurrency: {args.max_concurrency}")


def print_runs(args, runs, tokenizer_id: str) -> list[dict]:
    slos = parse_goodput(args.goodput)
    results = []
    for i, (rate, outputs, duration) in enumerate(runs):
        m = compute_metrics(outputs, duration, slos, args.max_concurrency, args.metrics, args.percentiles)
        print(describe_traffic(args, rate))
        print(format_metrics(m))
        moved = (getattr(args, "kv_moved", None) or [None] * len(runs))[i]
        if moved:
            rate_hit = moved["prefix_cache_hits"] / moved["prefix_cache_queries"] if moved["prefix_cache_queries"] else 0.0
            print(f"KV hand-offs: {moved['kv_handoffs']}, {moved['kv_handoff_bytes']} bytes; prefix cache hit rate {rate_hit:.1%} "
                  f"({moved['prefix_cache_hits']} of {moved['prefix_cache_queries']} prompt tokens, all workers)")
            if moved.get("host_tier_queries"):
                print(f"host KV tier hit rate {moved['host_tier_hits'] / moved['host_tier_queries']:.1%} ({moved['host_tier_hits']} of "
                      f"{moved['host_tier_queries']} prompt tokens looked up past the prefix cache); {moved['host_tier_bytes_in']} bytes "
                      f"put, {moved['host_tier_bytes_out']} loaded")
        errors = sorted({o.error for o in outputs if not o.success})
        for e in errors[:5]:
            print(f"error: {e}", file=sys.stderr)
        results.append(result_dict(m, outputs, {**config_dict(args, tokenizer_id, rate), "goodput_slos_ms": slos, **(moved or {})}))
    return results


def plot_sweep(results: list[dict], path: str) -> None:
    """p99 TTFT, p99 TPOT and goodput (request throughput without SLOs) against the offered rate."""
    matplotlib = import_extra("matplotlib", "--sweep's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["request_rate"]) for r in results]
    x = list(range(len(results)))  # categorical: "inf" has no place on a numeric axis
    slos = results[0]["goodput_slos_ms"]
    good = "goodput (req/s; " + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()) + ")"
    panels = [("p99_ttft_ms", "p99 TTFT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)"),
              ("request_goodput", good) if slos else ("request_throughput", "throughput (req/s; no --goodput SLOs)")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, title) in zip(axes, panels):
        ax.plot(x, [r[key] for r in results], marker="o")
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.suptitle(f"pdserve bench: {results[0]['backend']}, {results[0]['num_prompts']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_results(args, results: list[dict], tokenizer_id: str) -> None:
    """--save-result: vLLM's one file per rate (alone or with --append-result), else everything to the file named."""
    if args.save_result is True or args.append_result:
        for result in results:
            print(f"result written to {save_vllm_result(args, result, args.model_id, tokenizer_id)}")
    elif args.save_result:
        path = os.path.join(args.result_dir, args.save_result) if args.result_dir else args.save_result
        with open(path, "w") as f:
            json.dump({"sweep": results} if args.sweep else results[0], f, indent=1)
        print(f"result written to {path}")


def vllm_result(args, result: dict, model_id: str | None, tokenizer_id: str) -> dict:
    """One run's result with vLLM's keys, in vLLM's order."""
    doc = {"date": result["date"], "endpoint_type": args.backend, "backend": args.backend, "label": args.label,
           "model_id": model_id, "tokenizer_id": tokenizer_id, "num_prompts": args.num_prompts, **args.metadata_pairs,
           "request_rate": result["request_rate"], "burstiness": args.burstiness, "max_concurrency": args.max_concurrency}
    skip = set(doc) | set(PDSERVE_ONLY_KEYS) | (set() if args.save_detailed else set(DETAIL_KEYS))
    doc.update({k: v for k, v in result.items() if k not in skip})
    return doc


def result_path(args, model_id: str | None, date: str, rate) -> str:
    """vLLM's file name; the rate as Python prints it: 4.0qps, infqps."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or f"{args.label or args.backend}-{rate}qps{concurrency}-{(model_id or 'pdserve').split('/')[-1]}-{date}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def save_vllm_result(args, result: dict, model_id: str | None, tokenizer_id: str) -> str:
    doc = vllm_result(args, result, model_id, tokenizer_id)
    path = result_path(args, model_id, result["date"], float(result["request_rate"]))
    with open(path, "a+" if args.append_result else "w", encoding="utf-8") as f:
        if args.append_result and f.tell() != 0:
            f.write("\n")
        json.dump(doc, f)
    return path
