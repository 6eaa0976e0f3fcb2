"""Per-request sampling parameters: plain data that travels on the wire (msgspec), checked once.

Lifecycle: built by a client or the HTTP gateway, sent to the coordinator, which calls
`validate()` before anything is queued; workers trust them afterwards. Torch-free, so the
coordinator and clients import it without the model stack.
"""
from __future__ import annotations

import math

import msgspec

from pdserve_client.errors import InvalidSamplingParams

# Below this temperature a row is greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
_INT_MAX = 2**63 - 1  # every integer travels as msgpack int64; JSON may carry bigger ones
MAX_CACHE_SALT = 256  # characters of a cache_salt


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice")


class StructuredOutput(msgspec.Struct, omit_defaults=True, frozen=True):
    """A constraint on the output (runtime/structured.py): kind "json" (spec: a JSON schema as
    text, strict), "json_object" (any JSON object), "regex" (spec: the pattern) or "choice"
    (choices: the allowed outputs). JSON grammars let the model choose its whitespace, as vLLM's
    do, unless any_whitespace is False (vLLM's disable_any_whitespace: compact JSON)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    any_whitespace: bool = True
    after: str = ""  # the grammar holds only from the end of this text in the output (a reasoning block's "</think>")


class SamplingParams(msgspec.Struct, omit_defaults=True, frozen=False):
    """How to pick tokens for one request; field names and defaults follow vLLM / OpenAI."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 (below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; k = the sampled token's logprob + top-k alternatives
    min_tokens: int = 0
    structured: StructuredOutput | None = None  # constrained decoding; None = free
    # None = none; k = each prompt token's logprob (after the first), its rank and the top-k
    # alternatives, computed in the prefill pass (runtime/scoring.py; vLLM's prompt_logprobs)
    prompt_logprobs: int | None = None
    # None = the shared prefix cache; a salt = only requests with this same salt share its cached
    # blocks (common/prefix_hash.py: its chain starts from the salt's root; vLLM's cache_salt)
    cache_salt: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raise InvalidSamplingParams naming the first invalid field and its allowed range."""
        problem = _first_problem(self)
        if problem is not None:
            raise InvalidSamplingParams(problem)


def _first_problem(p: SamplingParams) -> str | None:
    # Comparisons are written so that NaN fails them.
    if not (isinstance(p.max_tokens, int) and 1 <= p.max_tokens <= _INT_MAX):
        return f"max_tokens must be an integer in [1, 2**63 - 1], got {p.max_tokens!r}"
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        return f"temperature must be a finite number >= 0, got {p.temperature!r}"
    if not (0 < p.top_p <= 1):
        return f"top_p must be in (0, 1], got {p.top_p!r}"
    if not (isinstance(p.top_k, int) and -1 <= p.top_k <= _INT_MAX):
        return f"top_k must be -1 or 0 (off) or an integer in [1, 2**63 - 1], got {p.top_k!r}"
    if not (0 <= p.min_p <= 1):
        return f"min_p must be in [0, 1], got {p.min_p!r}"
    if not (-2 <= p.presence_penalty <= 2):
        return f"presence_penalty must be in [-2, 2], got {p.presence_penalty!r}"
    if not (-2 <= p.frequency_penalty <= 2):
        return f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty!r}"
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        return f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty!r}"
    if p.seed is not None and not (isinstance(p.seed, int) and _SEED_MIN <= p.seed <= _SEED_MAX):
        return f"seed must be a 64-bit integer in [-2**63, 2**64 - 1], got {p.seed!r}"
    if any(not s for s in p.stop):
        return "stop must not contain empty strings"
    if any(not (isinstance(t, int) and 0 <= t <= _INT_MAX) for t in p.stop_token_ids):
        return f"stop_token_ids must be integers in [0, 2**63 - 1], got {p.stop_token_ids!r}"
    if p.logprobs is not None and not (isinstance(p.logprobs, int) and 0 <= p.logprobs <= MAX_LOGPROBS):
        return f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {p.logprobs!r}"
    if p.prompt_logprobs is not None and not (isinstance(p.prompt_logprobs, int) and 0 <= p.prompt_logprobs <= MAX_LOGPROBS):
        return f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {p.prompt_logprobs!r}"
    if not (isinstance(p.min_tokens, int) and 0 <= p.min_tokens <= p.max_tokens):
        return f"min_tokens must be an integer in [0, max_tokens={p.max_tokens}], got {p.min_tokens!r}"
    if p.cache_salt is not None and not (isinstance(p.cache_salt, str) and 0 < len(p.cache_salt) <= MAX_CACHE_SALT):
        got = f"{len(p.cache_salt)} characters" if isinstance(p.cache_salt, str) else type(p.cache_salt).__name__
        return f"cache_salt must be None or a non-empty string of at most {MAX_CACHE_SALT} characters, got {got}"
    s = p.structured
    if s is not None:
        if s.kind not in STRUCTURED_KINDS:
            return f"structured.kind must be one of {', '.join(STRUCTURED_KINDS)}, got {s.kind!r}"
        if s.kind in ("json", "regex") and not s.spec:
            return f"structured output of kind {s.kind} needs its {'schema' if s.kind == 'json' else 'pattern'}"
        if s.kind == "choice" and (not s.choices or any(not c for c in s.choices)):
            return "structured output of kind choice needs a non-empty list of non-empty choices"
    return None
