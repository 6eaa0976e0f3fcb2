"""Scoring on /v1/completions: `echo`, `logprobs` over the prompt, and vLLM's `prompt_logprobs`,
as evaluation harnesses call them (lm-evaluation-harness's local-completions back-end sends
echo=true, max_tokens=1 (or 0), logprobs=1, temperature=0 and reads token_logprobs and
top_logprobs over the prompt).

Lifecycle: `echo_options(req)` reads a request once into an `Echo` (what to echo, whether the
one token sampled for max_tokens=0 is dropped, how many top alternatives each prompt token gets
in vLLM's field) and `prompt_logprobs_asked` says what the workers compute: the prompt's
logprobs come from the prefill pass (runtime/scoring.py) and come back once, before the first
token, with the prompt's token ids (client StreamDelta / Result). A scoring pass computes every
prompt token (no prefix-cache credit: the coordinator's cached_on), so each distinct prompt of a
request is scored once: `share_prompt_scores` leaves prompt_logprobs on its first choice only,
and the fan-out hands those scores to the others (its n - 1 siblings, the same prompt given
again; gateway/stream.py), so every choice's prompt_logprobs are equal, as vLLM returns them.
What the prompts of one request may ask to prefill at all is the table's
max_request_prefill_tokens, and what their scores make in the answer (prompt tokens x n x
(1 + k), each choice repeating them) its max_scored_entries (wire/limits.py; gateway/schema.py's
request_bounds checks both before any fan-out). The
completion formatter (gateway/format.py) then prepends the prompt to each choice: its text
(`echo_text`) and, with logprobs, its tokens (`prompt_logprobs_part`: the first token's logprob
is null, as OpenAI and vLLM give it); `prompt_logprobs_field` builds vLLM's per-token list for
`prompt_logprobs`.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pdserve.gateway.errors import bad_request


class PromptTokenLogprob(msgspec.Struct):
    """One entry of vLLM's prompt_logprobs: the token's logprob, its rank (1 = most likely), its text."""

    logprob: float
    rank: int
    decoded_token: str


@dataclass(frozen=True)
class Echo:
    echo: bool = False  # prepend the prompt to each choice's text (and to its logprobs, when asked)
    drop_output: bool = False  # max_tokens 0: one token is sampled (the prefill pass does) and dropped
    prompt_k: int | None = None  # vLLM's prompt_logprobs: top alternatives per prompt token in the choice's prompt_logprobs


def echo_options(req) -> Echo:
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 needs echo: true (only the prompt is scored)", "max_tokens")
    return Echo(req.echo, req.echo and req.max_tokens == 0, req.prompt_logprobs)


def prompt_logprobs_asked(req, echo: Echo) -> int | None:
    """prompt_logprobs for the workers: echo with logprobs asks the same k for the prompt as for the output."""
    ks = [k for k in (echo.prompt_k, req.logprobs if echo.echo else None) if k is not None]
    return max(ks) if ks else None


def share_prompt_scores(jobs: list) -> list:
    """Each distinct prompt is scored once: the first choice of a prompt (by its inputs) keeps
    prompt_logprobs, the others (its n - 1 siblings, the same prompt given again) ask for none and
    name that choice in `scores_from`; the gateway's fan-out starts them once its scores are back
    and hands them the same scores (gateway/stream.py). Returns the jobs."""
    scorer: dict[tuple, int] = {}
    for job in jobs:
        if job.sampling.get("prompt_logprobs") is None:
            continue
        first = scorer.setdefault(prompt_key(job.inputs), job.index)
        if first != job.index:
            job.sampling = {k: v for k, v in job.sampling.items() if k != "prompt_logprobs"}
            job.scores_from = first
    return jobs


def prompt_key(inputs: dict) -> tuple:
    """What makes two completions prompts the same prompt: the same text, or the same token ids."""
    return ("prompt", inputs["prompt"]) if "prompt" in inputs else ("token_ids", tuple(inputs["token_ids"]))


def echo_text(inputs: dict, tokenizer) -> str:
    """The prompt as a choice echoes it: the string given, or the token ids given, decoded."""
    if "prompt" in inputs:
        return inputs["prompt"]
    return tokenizer.decode(inputs["token_ids"], skip_special_tokens=False)


def prompt_logprobs_part(ids: list[int], scores: list, k: int, text) -> tuple[list[str], list, list]:
    """(tokens, token_logprobs, top_logprobs) of the prompt in OpenAI's completions form: the first
    token's are null; each other's top_logprobs holds the top k and the token itself (as vLLM's)."""
    tokens = [text(t) for t in ids]
    logprobs: list = [None] + [s[0] for s in scores]
    tops: list = [None]
    for t, (lp, _, top) in zip(ids[1:], scores):
        alts = {text(a): alp for a, alp in top[:k]}
        alts.setdefault(text(t), lp)
        tops.append(alts)
    return tokens, logprobs, tops


def prompt_logprobs_field(ids: list[int], scores: list, k: int, text) -> list:
    """vLLM's prompt_logprobs: None for the first token, then {token id: PromptTokenLogprob} holding
    the token itself and its top k."""
    out: list = [None]
    for t, (lp, rank, top) in zip(ids[1:], scores):
        entry = {str(a): PromptTokenLogprob(alp, r, text(a)) for r, (a, alp) in enumerate(top[:k], 1)}
        entry.setdefault(str(t), PromptTokenLogprob(lp, rank, text(t)))
        out.append(entry)
    return out
