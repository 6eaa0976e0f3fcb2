"""The command line of `pdserve bench`: its flags (`vllm bench serve`'s, so that a vLLM command line
runs unchanged) and their checks.

Lifecycle: `build_parser()` makes the parser: pdserve's flags, then (`add_vllm_flags`) vLLM's
that pdserve bench lacked (--host/--port, --label, --result-dir/--result-filename,
--save-detailed, --append-result, --metadata, --percentile-metrics, --metric-percentiles,
--served-model-name, the per-dataset length flags, the sampling penalties, --trust-remote-code).
After parsing, `resolve(args)` checks them and folds them into the run's own settings in place
(backend from the URL, dataset names, lengths, extra body), raising ValueError with the flag's
name on a bad value. Nothing here imports torch or the engine: `pdserve bench --help` stays fast.
"""
from __future__ import annotations

import argparse
import json

from pdserve.bench.backends import BACKENDS
from pdserve.bench.metrics import ALL_METRICS, PERCENTILES
from pdserve.bench.report import result_path
from pdserve.bench.workloads import DATASETS

DEFAULT_PLOT = "bench-sweep.png"
SAMPLING_EXTRAS = ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve bench", description="Benchmark online serving latency and throughput "
                                 "(flags and report follow `vllm bench serve`).")
    ap.add_argument("--backend", default=None, choices=(*BACKENDS, "vllm"),
                    help="pdserve: the msgspec client; openai(-chat): any OpenAI-compatible server (vllm: openai); "
                         "default: openai given an http URL, --host or --port, else pdserve")
    ap.add_argument("--base-url", default=None, help="tcp://127.0.0.1:5555 (pdserve) or http://127.0.0.1:8000 (openai)")
    ap.add_argument("--endpoint", default=None, help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    ap.add_argument("--model", default=None, help="model name sent to an OpenAI server (default: its first /v1/models entry)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer path (GGUF file or HF dir; default: the default model's)")
    ap.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", choices=DATASETS,
                    help="sharegpt, custom: the same reader as jsonl")
    ap.add_argument("--dataset-path", default=None, help="ShareGPT-style JSONL or JSON array (default: the prompt set shipped in pdserve/data)")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128, help="random: prompt tokens")
    ap.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None,
                    help="output tokens (random default 128; jsonl default: each reply's length)")
    ap.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                    help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals: 1 = Poisson, <1 burstier, >1 steadier")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--extra-body", default=None, help="openai: JSON merged into every request, e.g. '{\"repeat_penalty\": 1.0}'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", "--num-warmups", dest="warmup", type=int, default=0, help="untimed requests sent first")
    ap.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, e.g. --goodput ttft:500 tpot:50 (ttft, tpot, e2el)")
    ap.add_argument("--save-result", nargs="?", const=True, default=None, metavar="FILE.json",
                    help="alone (vLLM's form): write vLLM's result file (see --result-dir, --result-filename); with a path: "
                         "everything, per-request lists included, to that file")
    ap.add_argument("--sweep", default=None, metavar="RATE,RATE,...", help="run at each request rate; plot p99 TTFT, p99 TPOT, goodput")
    ap.add_argument("--plot", default=DEFAULT_PLOT, help=f"--sweep's PNG (default {DEFAULT_PLOT})")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--stub-coordinator", action="store_true",
                    help="measure coordinator overhead: a real coordinator, stub workers that answer at once, "
                         "--num-prompts requests with --max-concurrency in flight")
    add_vllm_flags(ap)
    return ap


def add_vllm_flags(ap) -> None:
    ap.add_argument("--host", default=None, help="with --port: the OpenAI server at http://HOST:PORT (vLLM's; default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=None, help="(vLLM's; default 8000)")
    ap.add_argument("--served-model-name", default=None, help="the model name sent in requests (default: --model)")
    ap.add_argument("--label", default=None, help="names the result file and its 'label' key (default: the backend)")
    ap.add_argument("--result-dir", default=None, help="where --save-result writes (default: here)")
    ap.add_argument("--result-filename", default=None, help="the result file's name (default: vLLM's pattern)")
    ap.add_argument("--save-detailed", action="store_true", help="keep the per-request lists in the result file")
    ap.add_argument("--append-result", action="store_true", help="append the result as one more JSON line to the file")
    ap.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", default=None, help="extra keys of the result file")
    ap.add_argument("--percentile-metrics", default=None,
                    help="comma-separated: which of ttft,tpot,itl,e2el the report and result carry (default: all four)")
    ap.add_argument("--metric-percentiles", default=None, help="comma-separated percentiles, e.g. 50,90,99 (default: 90,99)")
    ap.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt: output tokens (default: each reply's length)")
    ap.add_argument("--custom-output-len", type=int, default=None, help="custom: output tokens")
    ap.add_argument("--prefix-repetition-prefix-len", "--prefix-len", type=int, default=256,
                    help="prefix_repetition: the shared prefix's tokens; chat_replay: the shared system prompt's")
    ap.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    ap.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    ap.add_argument("--prefix-repetition-output-len", type=int, default=128)
    ap.add_argument("--chat-turns", type=int, default=4, help="chat_replay: turns per conversation (each resends the history and its replies)")
    for name in SAMPLING_EXTRAS:
        ap.add_argument(f"--{name.replace('_', '-')}", type=float, default=None, help="openai backends: sent in every request")
    ap.add_argument("--trust-remote-code", action="store_true", help="accepted for vLLM command lines; tokenizers load without remote code")


def _pairs(items, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def resolve(args) -> None:
    """Check the vLLM flags and fold them into the run's own settings (in place)."""
    if args.backend is None:  # vLLM's default is an OpenAI server; pdserve's the msgspec client
        http = (args.base_url or "").startswith(("http://", "https://")) or args.host is not None or args.port is not None
        args.backend = "openai" if http else "pdserve"
    if args.backend == "vllm":
        args.backend = "openai"  # vLLM's name for its OpenAI completions client
    if args.base_url is None and (args.host is not None or args.port is not None):
        host = args.host or "127.0.0.1"
        args.base_url = f"http://[{host}]:{args.port or 8000}" if ":" in host else f"http://{host}:{args.port or 8000}"
    args.metrics = tuple(_metric_names(args.percentile_metrics))
    args.percentiles = tuple(_percentiles(args.metric_percentiles))
    args.metadata_pairs = _pairs(args.metadata, "--metadata")
    extras = {k: getattr(args, k) for k in SAMPLING_EXTRAS if getattr(args, k) is not None}
    if extras and args.backend == "pdserve":
        raise ValueError(f"--{', --'.join(k.replace('_', '-') for k in extras)}: only with the openai backends (as in vLLM)")
    if extras:
        args.extra_body = json.dumps({**extras, **(json.loads(args.extra_body) if args.extra_body else {})})
    if args.dataset == "sharegpt" and args.output_len is None:
        args.output_len = args.sharegpt_output_len
    if args.dataset == "custom" and args.output_len is None:
        args.output_len = args.custom_output_len
    if args.stub_coordinator and args.save_result is True:
        args.save_result = result_path(args, "stub-coordinator", "", args.request_rate).replace("-.json", ".json")
    if args.dataset == "random" and args.backend != "pdserve":
        args.ignore_eos = True  # as vLLM: a random prompt runs to its requested length


def _metric_names(text: str | None) -> list[str]:
    if text is None:
        return list(ALL_METRICS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ALL_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics takes names from {','.join(ALL_METRICS)}, got {text!r}")
    return names


def _percentiles(text: str | None) -> list[float]:
    if text is None:
        return list(PERCENTILES)
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers separated by commas, got {text!r}") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {text!r}")
    return ps


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--sweep takes positive rates separated by commas (inf allowed), got {text!r}")
    return rates

