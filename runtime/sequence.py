"""One request inside a worker: its tokens, its place in the KV cache, its state.

Lifecycle: WAITING (queued, nothing computed) -> RUNNING (blocks held; each step computes
`num_computed_tokens` further, a step that reaches the last token samples one more) ->
FINISHED. Its blocks are `block_tables`, one table per KV group of its model (one for most
models; runtime.kv_cache). Preemption sends a RUNNING sequence back to WAITING with its blocks freed and
`num_computed_tokens = 0`; its output so far is kept and recomputed by the next prefill, so
greedy output is unchanged. `num_computed_tokens` is the single progress counter: prefill,
chunked prefill, decode and recompute are all "compute tokens [computed, computed + n)".
"""
from __future__ import annotations

import enum
import time

from pdserve.common.prefix_hash import chain_hashes
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import FinishReason


class SeqStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "params", "status", "num_computed_tokens",
        "block_tables", "finish_reason", "arrival_time", "logprobs", "top_logprobs", "stop_text", "priority",
        "block_hashes", "hash_secret", "prompt_scores",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, output_token_ids: list[int] | None = None,
                 priority: int = 0):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self.params = params
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0
        self.block_tables: list[list[int]] = [[]]  # one per KV group (runtime.kv_cache; the scheduler sets as many as its pool has)
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.monotonic()
        self.logprobs: list[float | None] = []
        self.top_logprobs: list = []
        self.stop_text: str | None = None  # the stop string that ended it, if any
        self.priority = priority  # preemption takes the lowest priority, then the latest arrival
        self.block_hashes: list[bytes] = []  # chained keys of its full blocks so far (runtime.prefix_hash.chain_hashes)
        self.hash_secret = b""  # the secret they were made with
        # its prompt tokens' scores so far while it asks for prompt_logprobs and has not handed them out (runtime/scoring.py)
        self.prompt_scores: list | None = [] if params.prompt_logprobs is not None else None

    @property
    def block_table(self) -> list[int]:
        """Its first KV group's table: the only one of a model whose layers attend alike."""
        return self.block_tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def hashes(self, block_size: int, upto_blocks: int, secret: bytes) -> list[bytes]:
        """The chained keys of its first upto_blocks full blocks, keyed with secret, from its
        params' cache_salt's root (computed once, then extended; made again if the secret changes)."""
        if secret != self.hash_secret:
            self.block_hashes, self.hash_secret = [], secret
        if len(self.block_hashes) < upto_blocks:
            self.block_hashes = chain_hashes(self.tokens(0, upto_blocks * block_size), block_size, secret, upto_blocks, self.block_hashes,
                                             salt=self.params.cache_salt)
        return self.block_hashes[:upto_blocks]

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/{self.num_tokens})"
