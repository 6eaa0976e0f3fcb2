"""Token sampling: per-request sampling parameters and the batched sampler that turns logits into tokens.

Lifecycle: a request's `SamplingParams` arrive as plain data (they travel on the wire with msgspec)
and are checked once with `validate()` at the request boundary; the sampler trusts them afterwards.
Every decode step the engine calls `sample(logits, rows)` once for the whole batch, where each
`SamplingRow` pairs a request's params with its prompt and generated token lists (owned and
extended by the caller). The sampler is stateless (but for the grammar matchers of structured rows): it derives everything, including the random
draws of seeded rows, from its arguments, so the same seed gives the same tokens whatever else
is in the batch and on re-run. `sample_reference` is the slow one-row-at-a-time twin used by the
tests to check the fast path.

Processing order (as vLLM): logprobs of the raw logits, the grammar mask of rows with structured
output (runtime/structured.py keeps their matchers between steps), min_tokens masking, repetition /
frequency / presence penalties, then argmax for greedy rows, or temperature, top-k, top-p, min-p
and an exponential-race draw `argmax(probs / q)`, q ~ Exp(1), for the others.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve_client.params import SamplingParams

_U64 = 2**64 - 1
_NEG_INF = float("-inf")

class SamplingRow(NamedTuple):
    """One row of a batch. The lists are the caller's, read but never modified here."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(slots=True)
class SamplerOutput:
    """Per row of the batch, in row order."""

    token_ids: list[int]
    logprobs: list[float | None]  # the sampled token's logprob under the raw logits; None = not asked
    top_logprobs: list[list[tuple[int, float]] | None]  # (token, logprob), descending; None = not asked


# ---------------------------------------------------------------------------------------------
# Shared by both samplers: the random draws and the tokens min_tokens blocks.


def row_seed(seed: int, step: int) -> int:
    """Seed of a seeded row's draw at generation step `step` (= tokens generated so far).

    splitmix64 of (seed, step) so neighbouring steps and seeds get unrelated streams.
    """
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _exponential(vocab: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    # (V,) draws q ~ Exp(1); clamped away from 0 so probs / q never makes 0/0 = NaN.
    q = torch.empty(vocab, dtype=torch.float32, device=device).exponential_(generator=generator)
    return q.clamp_(min=torch.finfo(torch.float32).tiny)


def _seeded_exponential(row: SamplingRow, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(row_seed(row.params.seed, len(row.output_token_ids)))
    return _exponential(vocab, device, generator)


def _min_tokens_blocked(row: SamplingRow, eos_token_id: int | None, vocab: int) -> list[int]:
    """Tokens forbidden this step because the row has not yet produced min_tokens tokens.

    eos is blocked only when it would stop the request (not with ignore_eos), as in vLLM.
    """
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return []
    blocked = set(p.stop_token_ids)
    if eos_token_id is not None and not p.ignore_eos:
        blocked.add(eos_token_id)
    return sorted(t for t in blocked if 0 <= t < vocab)


def _check_batch(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be (B, V) with B = len(rows) = {len(rows)}, got {tuple(logits.shape)}")


# ---------------------------------------------------------------------------------------------
# The fast path.


def sample(logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | None = None) -> SamplerOutput:
    """Pick one token per row of `logits` (B, V); each row follows its own params.

    `logits` is not modified. Stages that no row uses are skipped.
    """
    _check_batch(logits, rows)
    logits = logits.float()
    asks = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits[_index(asks, logits)], dim=-1) if asks else None
    if any(r.params.structured is not None for r in rows):  # grammar masks (runtime/structured.py); free rows pay this check only
        from pdserve.runtime.structured import constrainer

        logits = constrainer().constrain(logits, rows, eos_token_id)
    tokens = _choose_tokens(adjusted_logits(logits, rows, eos_token_id), rows)
    return _output(tokens, rows, asks, raw_logprobs)


def adjusted_logits(logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | None = None) -> torch.Tensor:
    """(B, V) float32 logits after min_tokens masking and the penalties: what greedy rows argmax over.

    Returns `logits` itself when no row needs either stage; never modifies it in place.
    """
    x = _apply_min_tokens(logits.float(), rows, eos_token_id)
    return _apply_penalties(x, rows)


def _index(indices: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(indices, dtype=torch.long, device=like.device)


def _row_params(values: list, like: torch.Tensor) -> torch.Tensor:
    # (n, 1) float32 column so it broadcasts over the vocabulary.
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)


def _apply_min_tokens(x: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | None) -> torch.Tensor:
    vocab = x.shape[1]
    blocked = [_min_tokens_blocked(r, eos_token_id, vocab) for r in rows]
    if not any(blocked):
        return x
    row_ids, token_ids = _flatten(range(len(rows)), blocked, x)
    return x.index_put((row_ids, token_ids), torch.tensor(_NEG_INF, device=x.device))


def _flatten(row_numbers, lists: list[list[int]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of all tokens of `lists`, `lists[j]` belonging to row `row_numbers[j]`.

    Token ids outside the vocabulary are dropped.
    """
    tokens = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long)
    lengths = torch.tensor([len(t) for t in lists], dtype=torch.long)
    rows = torch.repeat_interleave(torch.tensor(list(row_numbers), dtype=torch.long), lengths)
    inside = (tokens >= 0) & (tokens < like.shape[1])
    return rows[inside].to(like.device), tokens[inside].to(like.device)


def _apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        x = _apply_repetition_penalty(x, rows, rep)
    freq = [i for i, r in enumerate(rows) if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
    if freq:
        x = _apply_frequency_presence(x, rows, freq)
    return x


def _apply_repetition_penalty(x: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> torch.Tensor:
    """HF semantics over prompt + output tokens: a seen token's logit is divided by p if positive, else times p."""
    row_ids, token_ids = _flatten(which, [rows[i].prompt_token_ids + rows[i].output_token_ids for i in which], x)
    seen = torch.zeros_like(x, dtype=torch.bool)
    seen[row_ids, token_ids] = True
    penalty = _row_params([r.params.repetition_penalty for r in rows], x)  # (B, 1); 1.0 for rows without
    penalised = torch.where(x > 0, x / penalty, x * penalty)
    return torch.where(seen, penalised, x)


def _apply_frequency_presence(x: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> torch.Tensor:
    """OpenAI semantics over output tokens only: logit -= frequency * count, then -= presence * (count > 0)."""
    row_ids, token_ids = _flatten(which, [rows[i].output_token_ids for i in which], x)
    counts = torch.zeros_like(x)  # (B, V) float32 occurrence counts
    counts.index_put_((row_ids, token_ids), torch.ones_like(token_ids, dtype=x.dtype), accumulate=True)
    frequency = _row_params([r.params.frequency_penalty for r in rows], x)
    presence = _row_params([r.params.presence_penalty for r in rows], x)
    x = x - frequency * counts
    return x - presence * (counts > 0).to(x.dtype)


def _choose_tokens(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """(B,) token ids: argmax for greedy rows, a random draw for the others."""
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not sampled:
        return x.argmax(dim=-1)
    if len(sampled) == len(rows):
        return _sample_rows(x, rows)
    tokens = x.argmax(dim=-1)
    index = _index(sampled, x)
    tokens[index] = _sample_rows(x[index], [rows[i] for i in sampled])
    return tokens


def _sample_rows(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """(n,) draws for non-greedy rows; x is (n, V) penalised logits of exactly these rows."""
    params = [r.params for r in rows]
    if any(p.temperature != 1.0 for p in params):
        x = x / _row_params([p.temperature for p in params], x)
    if any(0 < p.top_k < x.shape[1] for p in params):
        x = _apply_top_k(x, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        x = _apply_top_p(x, [p.top_p for p in params])
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        probs = _apply_min_p(probs, [p.min_p for p in params])
    q = _exponential_draws(rows, x)
    return (probs / q).argmax(dim=-1)


def _apply_top_k(x: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep logits >= the row's k-th largest (ties at the k-th kept); rows with k off keep all."""
    vocab = x.shape[1]
    on = [0 < k < vocab for k in top_k]
    k_max = max(k for k, o in zip(top_k, on) if o)
    largest = x.topk(k_max, dim=-1).values  # (n, k_max), descending
    kth = largest.gather(1, _index([k - 1 if o else 0 for k, o in zip(top_k, on)], x).unsqueeze(1))
    on_column = torch.tensor(on, dtype=torch.bool, device=x.device).unsqueeze(1)
    threshold = torch.where(on_column, kth, torch.full_like(kth, _NEG_INF))
    return x.masked_fill(x < threshold, _NEG_INF)


def _apply_top_p(x: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep the smallest most-probable set with mass >= top_p: drop a token if the mass before it is >= top_p.

    The top token has 0 mass before it, so it is always kept. Rows with top_p = 1 keep all
    (a threshold of inf, so float rounding of the cumulative sum cannot drop the tail).
    """
    probs = torch.softmax(x, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    threshold = _row_params([p if p < 1.0 else math.inf for p in top_p], x)
    drop = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, mass_before >= threshold)
    return x.masked_fill(drop, _NEG_INF)


def _apply_min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Zero tokens whose prob < min_p * the row's max prob (the ratio needs no renormalisation)."""
    threshold = _row_params(min_p, probs) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def _exponential_draws(rows: list[SamplingRow], like: torch.Tensor) -> torch.Tensor:
    """(n, V) q ~ Exp(1): a per-row generator for seeded rows, one shared default-generator draw for the rest."""
    n, vocab = like.shape
    seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
    if not seeded:
        q = torch.empty(n, vocab, dtype=torch.float32, device=like.device).exponential_()
        return q.clamp_(min=torch.finfo(torch.float32).tiny)
    q = torch.empty(n, vocab, dtype=torch.float32, device=like.device)
    unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
    if unseeded:
        shared = torch.empty(len(unseeded), vocab, dtype=torch.float32, device=like.device).exponential_()
        q[_index(unseeded, like)] = shared.clamp_(min=torch.finfo(torch.float32).tiny)
    for i in seeded:
        q[i] = _seeded_exponential(rows[i], vocab, like.device)
    return q


def _output(
    tokens: torch.Tensor, rows: list[SamplingRow], asks: list[int], raw_logprobs: torch.Tensor | None
) -> SamplerOutput:
    token_ids = tokens.tolist()
    logprobs: list[float | None] = [None] * len(rows)
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * len(rows)
    if raw_logprobs is not None:
        index = _index(asks, raw_logprobs)
        chosen = raw_logprobs.gather(1, tokens[index].unsqueeze(1)).squeeze(1).tolist()
        k_max = min(max(rows[i].params.logprobs for i in asks), raw_logprobs.shape[1])
        top = raw_logprobs.topk(k_max, dim=-1) if k_max > 0 else None
        top_values = top.values.tolist() if top is not None else [[] for _ in asks]
        top_ids = top.indices.tolist() if top is not None else [[] for _ in asks]
        for j, i in enumerate(asks):
            k = rows[i].params.logprobs
            logprobs[i] = chosen[j]
            top_logprobs[i] = list(zip(top_ids[j][:k], top_values[j][:k]))
    return SamplerOutput(token_ids, logprobs, top_logprobs)


# ---------------------------------------------------------------------------------------------
# The reference: one row at a time, plain code, the same float32 arithmetic and seeded draws.


def sample_reference(
    logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | None = None
) -> SamplerOutput:
    """Slow twin of `sample`; identical tokens for greedy and seeded rows."""
    _check_batch(logits, rows)
    out = SamplerOutput([], [], [])
    for i, row in enumerate(rows):
        raw = logits[i].float()
        x = _ref_min_tokens(raw.clone(), row, eos_token_id)
        x = _ref_penalties(x, row)
        token = int(x.argmax()) if row.params.greedy else _ref_draw(x, row)
        logprob, top = _ref_logprobs(raw, token, row.params.logprobs)
        out.token_ids.append(token)
        out.logprobs.append(logprob)
        out.top_logprobs.append(top)
    return out


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _ref_min_tokens(x: torch.Tensor, row: SamplingRow, eos_token_id: int | None) -> torch.Tensor:
    for t in _min_tokens_blocked(row, eos_token_id, x.shape[0]):
        x[t] = _NEG_INF
    return x


def _ref_penalties(x: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    vocab = x.shape[0]
    if p.repetition_penalty != 1.0:
        penalty = _f32(p.repetition_penalty)
        for t in set(row.prompt_token_ids) | set(row.output_token_ids):
            if 0 <= t < vocab:
                x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        for t, count in Counter(row.output_token_ids).items():
            if 0 <= t < vocab:
                x[t] = x[t] - _f32(p.frequency_penalty) * _f32(count)
                x[t] = x[t] - _f32(p.presence_penalty)
    return x


def _ref_draw(x: torch.Tensor, row: SamplingRow) -> int:
    p = row.params
    vocab = x.shape[0]
    x = x / _f32(p.temperature)
    if 0 < p.top_k < vocab:
        kth = x.topk(p.top_k).values[-1]
        x = x.masked_fill(x < kth, _NEG_INF)
    if p.top_p < 1.0:
        sorted_probs, order = torch.softmax(x, dim=0).sort(descending=True, stable=True)
        mass_before = sorted_probs.cumsum(dim=0) - sorted_probs
        x = x.clone()
        x[order[mass_before >= _f32(p.top_p)]] = _NEG_INF
    probs = torch.softmax(x, dim=0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < _f32(p.min_p) * probs.max(), 0.0)
    if p.seed is not None:
        q = _seeded_exponential(row, vocab, x.device)
    else:
        q = _exponential(vocab, x.device, None)
    return int((probs / q).argmax())


def _ref_logprobs(raw: torch.Tensor, token: int, k: int | None) -> tuple[float | None, list | None]:
    if k is None:
        return None, None
    logprobs = torch.log_softmax(raw, dim=0)
    top = logprobs.topk(min(k, raw.shape[0]))
    return float(logprobs[token]), list(zip(top.indices.tolist(), top.values.tolist()))
