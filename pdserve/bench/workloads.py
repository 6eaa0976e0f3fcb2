"""Benchmark workloads: the requests `pdserve bench` sends, built before the clock starts.

Lifecycle: `build_workload(args, tokenizer)` makes the whole list once, deterministically from
`--seed` (benchmarks/ calls `build_requests`): `random` draws prompts of whole-word tokens that
re-tokenize to exactly the same ids (so every backend, whether it takes token ids or text, sees
the same prompt and the same length), `jsonl` reads a ShareGPT-style file (the shipped
`pdserve/data/prompts.jsonl` by default) and keeps each first user turn as a chat request,
`chat_replay` makes conversations (a shared system prompt, then random user turns; each later
turn is sent once the previous answer is in, with that answer in its history: `next_turns`),
`prefix_repetition` makes vLLM's shared-prefix prompts. The run then only reads them.
`arrival_intervals` gives the gaps between sends (Poisson, or gamma with `--burstiness`), as in
`vllm bench serve`.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

DATASETS = ("random", "sharegpt", "jsonl", "custom", "prefix_repetition", "chat_replay")
SHIPPED_PROMPTS = "prompts.jsonl"
WORD_MARKERS = ("\u0120", "\u2581")  # byte-level BPE's "Ġ" and sentencepiece's "▁": a leading space


@dataclass
class BenchRequest:
    prompt: str  # the text a completions endpoint gets
    prompt_len: int  # tokens, as this tokenizer counts them
    output_len: int
    token_ids: list[int] | None = None  # exact prompt ids (pdserve backend, in-process rows)
    messages: list[dict] | None = None  # chat requests: what a chat endpoint gets
    extra: dict = field(default_factory=dict)
    next_turns: list[str] = field(default_factory=list)  # chat_replay: the user's later turns (`follow_up`)


def shipped_prompts_path() -> Path:
    return Path(str(resources.files("pdserve") / "data" / SHIPPED_PROMPTS))


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] around length, as vLLM's --random-range-ratio."""
    if not 0 <= ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {ratio}")
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


# ------------------------------------------------------------------ random

def word_tokens(tokenizer, limit: int = 4000) -> list[int]:
    """Ids of whole lower-case words with a leading space that encode back to themselves alone."""
    vocab = tokenizer.get_vocab()
    picks = []
    for piece, tid in sorted(vocab.items(), key=lambda kv: kv[1]):
        if len(piece) >= 4 and piece[0] in WORD_MARKERS and piece[1:].isascii() and piece[1:].isalpha() and piece[1:].islower():
            if tokenizer.encode(tokenizer.decode([tid]), add_special_tokens=False) == [tid]:
                picks.append(tid)
                if len(picks) >= limit:
                    break
    return picks


def random_prompt(tokenizer, words: list[int], n: int, rng: random.Random) -> tuple[str, list[int]]:
    """A prompt of about n tokens; returns (text, ids) with ids == encode(text) exactly."""
    ids = [rng.choice(words) for _ in range(n)] if words else [rng.randrange(1000, len(tokenizer) - 1) for _ in range(n)]
    text = tokenizer.decode(ids)
    back = tokenizer.encode(text, add_special_tokens=False)
    return text, back


def random_requests(tokenizer, num: int, input_len: int, output_len: int, ratio: float, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    words = word_tokens(tokenizer)
    in_lo, in_hi = length_range(input_len, ratio)
    out_lo, out_hi = length_range(output_len, ratio)
    reqs = []
    for _ in range(num):
        text, ids = random_prompt(tokenizer, words, rng.randint(in_lo, in_hi), rng)
        reqs.append(BenchRequest(text, len(ids), rng.randint(out_lo, out_hi), token_ids=ids))
    return reqs


# ------------------------------------------------------------------ ShareGPT-style JSONL

def first_exchange(row: dict) -> tuple[str, str | None] | None:
    """(first user turn, the reply after it) of a ShareGPT ("conversations": from/value),
    OpenAI ("messages": role/content) or plain ("prompt"[, "completion"]) row."""
    if "prompt" in row:
        return str(row["prompt"]), row.get("completion")
    turns = row.get("conversations") or row.get("messages") or []
    norm = [(t.get("from") or t.get("role"), t.get("value") if "value" in t else t.get("content")) for t in turns]
    for i, (who, text) in enumerate(norm):
        if who in ("human", "user") and text:
            reply = norm[i + 1][1] if i + 1 < len(norm) and norm[i + 1][0] in ("gpt", "assistant") else None
            return str(text), reply
    return None


def read_jsonl(path: str | Path) -> list[tuple[str, str | None]]:
    """One JSON object a line, or (ShareGPT's own file) one JSON array of them."""
    rows = []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    docs = json.loads(text) if text.lstrip().startswith("[") else (json.loads(line) for line in text.splitlines() if line.strip())
    for doc in docs:
        ex = first_exchange(doc)
        if ex is not None:
            rows.append(ex)
    if not rows:
        raise ValueError(f"{path}: no prompts found (expected ShareGPT 'conversations', 'messages' or 'prompt' rows)")
    return rows


def chat_prompt(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """The chat template as text (for completions endpoints) and as ids; plain text without a template."""
    if getattr(tokenizer, "chat_template", None) is None:
        text = messages[-1]["content"]
        return text, tokenizer.encode(text, add_special_tokens=False)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return text, list(ids)


def jsonl_requests(tokenizer, path: str | Path | None, num: int, output_len: int | None, seed: int) -> list[BenchRequest]:
    """num requests from the file, shuffled with seed and repeated if the file is shorter.
    output_len None: each reply's token count (at least 4), 128 where a row has no reply."""
    rows = read_jsonl(path or shipped_prompts_path())
    random.Random(seed).shuffle(rows)
    reqs = []
    for i in range(num):
        question, reply = rows[i % len(rows)]
        messages = [{"role": "user", "content": question}]
        text, ids = chat_prompt(tokenizer, messages)
        n_out = output_len or (max(4, len(tokenizer.encode(reply, add_special_tokens=False))) if reply else 128)
        reqs.append(BenchRequest(text, len(ids), n_out, token_ids=ids, messages=messages))
    return reqs


def build_requests(dataset: str, tokenizer, num: int, input_len: int, output_len: int | None, ratio: float, seed: int,
                   path: str | None = None) -> list[BenchRequest]:
    if num < 1:
        raise ValueError("--num-prompts must be >= 1")
    if dataset == "random":
        return random_requests(tokenizer, num, input_len, output_len or 128, ratio, seed)
    if dataset == "jsonl":
        return jsonl_requests(tokenizer, path, num, output_len, seed)
    raise ValueError(f"unknown dataset {dataset!r} (random, jsonl)")


# ------------------------------------------------------------------ vLLM's prefix_repetition

def prefix_repetition_requests(tokenizer, num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, seed: int):
    """vLLM's prefix_repetition: num_prefixes random prefixes of prefix_len tokens, each followed
    by num // num_prefixes random suffixes of suffix_len tokens, shuffled with seed."""
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


# ------------------------------------------------------------------ multi-turn chat replay

def chat_replay_requests(tokenizer, num: int, turns: int, system_len: int, user_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """num // turns conversations of `turns` turns: one shared system prompt of system_len tokens
    (none if 0), random user turns of user_len tokens. Each request is a conversation's first
    turn; the rest wait in its next_turns (sent by the run with the answers in the history)."""
    if turns < 1 or user_len < 1 or output_len < 1 or system_len < 0 or num < turns:
        raise ValueError(f"chat_replay needs --chat-turns >= 1, --input-len and --output-len >= 1, --prefix-len >= 0 and "
                         f"--num-prompts ({num}) at least --chat-turns ({turns})")
    rng = random.Random(seed)
    words = word_tokens(tokenizer)
    system = [{"role": "system", "content": random_prompt(tokenizer, words, system_len, rng)[0]}] if system_len else []
    reqs = []
    for _ in range(num // turns):
        users = [random_prompt(tokenizer, words, user_len, rng)[0] for _ in range(turns)]
        messages = system + [{"role": "user", "content": users[0]}]
        text, ids = chat_prompt(tokenizer, messages)
        reqs.append(BenchRequest(text, len(ids), output_len, token_ids=ids, messages=messages, next_turns=users[1:]))
    return reqs


def follow_up(tokenizer, req: BenchRequest, answer: str) -> BenchRequest:
    """The next turn of req's conversation: its history, the answer it got, the next user turn."""
    messages = req.messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": req.next_turns[0]}]
    text, ids = chat_prompt(tokenizer, messages)
    return BenchRequest(text, len(ids), req.output_len, token_ids=ids, messages=messages, next_turns=req.next_turns[1:])


# ------------------------------------------------------------------ the command's workload

def build_workload(args, tokenizer) -> list[BenchRequest]:
    """The requests of `pdserve bench`'s --dataset (sharegpt and custom: the jsonl reader)."""
    if args.dataset == "prefix_repetition":
        return prefix_repetition_requests(tokenizer, args.num_prompts, args.prefix_repetition_prefix_len,
                                          args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                          args.output_len or args.prefix_repetition_output_len, args.seed)
    if args.dataset == "chat_replay":
        return chat_replay_requests(tokenizer, args.num_prompts, args.chat_turns, args.prefix_repetition_prefix_len, args.input_len,
                                    args.output_len or 128, args.seed)
    dataset = "jsonl" if args.dataset in ("sharegpt", "custom") else args.dataset
    return build_requests(dataset, tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                          args.dataset_path)


# ------------------------------------------------------------------ arrivals

def arrival_intervals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait after each send: 0 at rate inf; else gamma(shape=burstiness,
    scale=1/(rate*burstiness)), whose mean is 1/rate (burstiness 1 = Poisson arrivals)."""
    if rate == float("inf"):
        return [0.0] * n
    if not rate > 0 or not burstiness > 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]
