"""`vllm bench serve` command lines on `pdserve bench`: the flags it shares with vLLM, resolved
to pdserve's own, and the result file vLLM writes.

Lifecycle: `add_vllm_flags(parser)` adds vLLM's flags that pdserve bench lacked (--host/--port,
--label, --result-dir/--result-filename, --save-detailed, --append-result, --metadata,
--percentile-metrics, --metric-percentiles, --served-model-name, the per-dataset length flags,
the sampling penalties, --trust-remote-code); after parsing, `resolve(args)` checks
them and maps them onto the run (backend from the URL, dataset names, lengths, extra body),
raising ValueError with the flag's name on a bad value. The run builds its workload with
`build_workload` (random, sharegpt/jsonl/custom, prefix_repetition) and, once measured, writes
`--save-result` (a flag, vLLM's form) as vLLM does: the file name
`{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json` under --result-dir unless
--result-filename, flat keys (date, endpoint_type, backend, label, model_id, tokenizer_id,
num_prompts, metadata, request_rate, burstiness, max_concurrency, duration, completed, failed,
totals, throughputs, max_output_tokens_per_s, max_concurrent_requests, then
mean/median/std/pN of each selected metric), per-request lists only with --save-detailed.
`--save-result FILE.json` (pdserve's older form) still writes everything to FILE.json.
"""
from __future__ import annotations

import json
import os
import random

DATASETS = ("random", "sharegpt", "jsonl", "custom", "prefix_repetition", "chat_replay")
DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")
PDSERVE_ONLY_KEYS = ("e2els", "start_times", "goodput_slos_ms", "dataset", "input_len", "output_len", "ignore_eos", "seed", "base_url")
SAMPLING_EXTRAS = ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


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
    from pdserve.bench_metrics import ALL_METRICS

    if text is None:
        return list(ALL_METRICS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ALL_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics takes names from {','.join(ALL_METRICS)}, got {text!r}")
    return names


def _percentiles(text: str | None) -> list[float]:
    from pdserve.bench_metrics import PERCENTILES

    if text is None:
        return list(PERCENTILES)
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers separated by commas, got {text!r}") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {text!r}")
    return ps


# ------------------------------------------------------------------ workloads

def build_workload(args, tokenizer):
    from pdserve.bench_data import build_requests

    if args.dataset == "prefix_repetition":
        return prefix_repetition_requests(tokenizer, args.num_prompts, args.prefix_repetition_prefix_len,
                                          args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                          args.output_len or args.prefix_repetition_output_len, args.seed)
    if args.dataset == "chat_replay":
        from pdserve.bench_data import chat_replay_requests

        return chat_replay_requests(tokenizer, args.num_prompts, args.chat_turns, args.prefix_repetition_prefix_len, args.input_len,
                                    args.output_len or 128, args.seed)
    dataset = "jsonl" if args.dataset in ("sharegpt", "custom") else args.dataset
    return build_requests(dataset, tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                          args.dataset_path)


def prefix_repetition_requests(tokenizer, num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, seed: int):
    """vLLM's prefix_repetition: num_prefixes random prefixes of prefix_len tokens, each followed
    by num // num_prefixes random suffixes of suffix_len tokens, shuffled with seed."""
    from pdserve.bench_data import BenchRequest, random_prompt, word_tokens

    if min(prefix_len, suffix_len, num_prefixes, output_len) < 1 or num < num_prefixes:
        raise ValueError("--prefix-repetition-* lengths and --prefix-repetition-num-prefixes must be >= 1, "
                         f"and --num-prompts ({num}) at least the number of prefixes")
    rng = random.Random(seed)
    words = word_tokens(tokenizer)
    reqs = []
    for _ in range(num_prefixes):
        _, prefix = random_prompt(tokenizer, words, prefix_len, rng)
        for _ in range(num // num_prefixes):
            _, suffix = random_prompt(tokenizer, words, suffix_len, rng)
            ids = prefix + suffix
            text = tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)  # the prompt as a text backend sends it
            reqs.append(BenchRequest(text, len(ids), output_len, token_ids=ids))
    rng.shuffle(reqs)
    return reqs


# ------------------------------------------------------------------ the result file

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

