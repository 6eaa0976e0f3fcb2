"""What the coordinator knows about each worker and each request, as plain dataclasses.

Lifecycle: a `WorkerState` is made when a worker's Hello is accepted, updated by its heartbeats
and by the coordinator's own placements (queued tokens, reserved blocks, requests placed), and
dropped when the worker leaves or falls silent; its `role` follows a switch the worker confirms
(RoleSet). A `RequestState` is made when a client's request is tokenized and moves through
`Phase` in order: NEW -> (PENDING: waiting for decode room) -> ADMITTING (Admit sent) ->
PREFILLING (Prefill sent) -> DECODING (tokens arrive); a request on a colocated worker, or on a
decode worker's LOCAL path (it prefills the prompt itself), goes NEW -> COLOCATED. A retry after
a lost worker sends it back to NEW. From ADMITTING on some worker may hold blocks for it, so
ending it then tells its workers to abort. `TRANSITIONS` is the one table of the moves allowed,
and `RequestState.move` the one way its phase changes (the coordinator reports a move outside the
table as a bug).
"""
from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field

from pdserve.common.prefix_hash import chain_hashes
from pdserve.common.tokenizer import IncrementalDetokenizer
from pdserve.coordinator.placement import ADMIT_WINDOW_S, WorkerSnapshot
from pdserve.coordinator.slo import CoreShareSlowdown, StepModel
from pdserve.wire.protocol import Heartbeat, Hello, Role
from pdserve_client.protocol import GenerateRequest

MAX_VIEW = 65536  # block keys kept per worker in the coordinator's view of its prefix cache


class Phase(enum.IntEnum):
    NEW = 0  # not placed (yet, or again after a lost worker)
    PENDING = 1  # waiting for a decode worker with room (no SLO control, or a retry)
    ADMITTING = 2  # Admit sent to the decode worker; from here on a worker may hold its blocks
    PREFILLING = 3  # granted; Prefill sent to the prefill worker
    COLOCATED = 4  # Generate sent to a colocated or decode worker (prompt and stream on one worker: the LOCAL path)
    DECODING = 5  # tokens are arriving from the decode worker

    @property
    def on_workers(self) -> bool:
        """Some worker may hold blocks or state for the request: ending it must tell them."""
        return self >= Phase.ADMITTING


TRANSITIONS: dict[Phase, frozenset[Phase]] = {  # phase -> the phases it may move to
    Phase.NEW: frozenset({Phase.PENDING, Phase.ADMITTING, Phase.COLOCATED}),  # placement: parked, or sent on its path
    Phase.PENDING: frozenset({Phase.NEW}),  # room may have freed: placed again
    Phase.ADMITTING: frozenset({Phase.PREFILLING, Phase.PENDING, Phase.NEW}),  # Granted; AdmitRefused; retried
    Phase.PREFILLING: frozenset({Phase.DECODING, Phase.NEW}),  # its first token; retried
    Phase.COLOCATED: frozenset({Phase.NEW}),  # retried (its tokens leave it COLOCATED)
    Phase.DECODING: frozenset({Phase.NEW}),  # retried
}


@dataclass
class WorkerState:
    hello: Hello
    identity: bytes
    last_seen: float
    beat: Heartbeat | None = None
    beats: int = 0  # heartbeats received
    requests: set = field(default_factory=set)
    queued_tokens: int = 0  # prefill and colocated: prompt tokens placed here and not yet through their first step
    reserved_blocks: int = 0  # decode: blocks asked for and not yet reported in a heartbeat
    model: StepModel = field(default_factory=StepModel)  # this worker's step time, fitted online
    slowdown: CoreShareSlowdown = field(default_factory=CoreShareSlowdown)  # its steps on a share of its node's cores
    admitted: collections.deque = field(default_factory=collections.deque)  # colocated: (time, prompt tokens) placed lately
    admitted_tokens: int = 0  # their sum
    prefix_view: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # block keys it is thought to hold
    role: Role | None = None  # its role now: Hello.role until it confirms a switch (RoleSet)

    def __post_init__(self):
        if self.role is None:
            self.role = Role(self.hello.role)

    @property
    def alone_threads(self) -> int:
        """Its threads when it is the only busy worker of its core share (Hello.engine "cores",
        runtime/cores.py); 0: it shares no cores, or its Hello did not say a sane count."""
        n = self.hello.engine.get("cores", 0)
        return n if isinstance(n, int) and 0 < n <= 65536 else 0

    def note_prefix(self, added: list[bytes], evicted: list[bytes] = ()) -> None:
        """Update the approximate view of its prefix cache: keys its heartbeat reported registered
        or evicted, or a placement's keys at once (it will hold them; the router inserts on
        routing as SGLang's does). Bounded: past MAX_VIEW keys the least recently noted go."""
        view = self.prefix_view
        for h in added:
            view[h] = None
            view.move_to_end(h)
        for h in evicted:
            view.pop(h, None)
        while len(view) > MAX_VIEW:
            view.popitem(last=False)

    def cached_tokens(self, hashes: list[bytes]) -> int:
        """Leading tokens of a request (its block keys) this worker is thought to hold."""
        n = 0
        for h in hashes:
            if h not in self.prefix_view:
                break
            n += 1
        return n * self.hello.block_size

    @property
    def can_switch(self) -> bool:
        """Whether it can take another role without a restart (Hello.roles names more than one)."""
        return len(set(self.hello.roles)) > 1

    @property
    def prefix_cache(self) -> bool:
        """Whether its prefix cache is on (EngineConfig.summary; a worker that does not say: on)."""
        return bool(self.hello.engine.get("prefix_cache", 1))

    @property
    def free_blocks(self) -> int:
        free = self.beat.free_blocks if self.beat else self.hello.num_blocks
        return free - self.reserved_blocks

    def note_placed(self, tokens: int, now: float) -> None:
        """Record a prompt placed on this worker (colocated, a decode worker's LOCAL prompt, or a
        prefill worker's: what it takes of a shared node), keeping only the last ADMIT_WINDOW_S."""
        self.admitted.append((now, tokens))
        self.admitted_tokens += tokens
        self.recent_prompt_tokens(now)

    def recent_prompt_tokens(self, now: float) -> int:
        """Prompt tokens placed here within the last ADMIT_WINDOW_S (older ones are forgotten)."""
        while self.admitted and now - self.admitted[0][0] > ADMIT_WINDOW_S:
            self.admitted_tokens -= self.admitted.popleft()[1]
        return self.admitted_tokens

    def snapshot(self, requests: list[RequestState], now: float, cached_tokens: int = 0) -> WorkerSnapshot:
        """What placement needs of this worker; `requests`: the live requests placed on it;
        cached_tokens: of the request being placed, the leading tokens it is thought to hold."""
        return WorkerSnapshot(
            self.hello.worker_id, self.model, self.free_blocks, self.hello.block_size, self.queued_tokens, len(requests),
            sum(r.num_tokens for r in requests), self.recent_prompt_tokens(now), cached_tokens,
            min((r.req.params.max_tokens for r in requests), default=0),
            chunk_tokens=int(self.hello.engine.get("max_num_batched_tokens") or 2048),
            max_seqs=int(self.hello.engine.get("max_num_seqs") or 0),
            kv_window=self.kv_window,
            kv_group_windows=self.kv_group_windows,
        )

    @property
    def kv_window(self) -> int:
        """Its model's sliding window on every layer (0: none), from its Hello's engine settings."""
        return int(self.hello.engine.get("kv_window") or 0)

    @property
    def kv_group_windows(self) -> tuple[int, ...]:
        """Its model's KV groups' windows (runtime.kv_groups; () for one group), from its Hello's engine settings."""
        return tuple(int(w) for w in str(self.hello.engine.get("kv_group_windows") or "").split(",") if w)


@dataclass
class RequestState:
    iid: str
    client: bytes
    client_rid: str
    prompt: list[int]
    req: GenerateRequest
    arrival: float
    detok: IncrementalDetokenizer
    prefill: str | None = None
    decode: str | None = None
    _phase: Phase = Phase.NEW  # read as .phase, changed by move() alone
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    reserved: int = 0
    attempts: int = 0
    admissions: int = 0  # Admits sent; a Granted/AdmitRefused for an older one is stale
    grant: int = 0  # the decode worker's number for its grant (Granted), named by the Prefill and a Release
    backlog: int = 0  # prompt tokens it adds to its prefill (or colocated) worker's queue until handed off (first token)
    predicted_ttft: float | None = None
    predicted_tpot: float | None = None
    # the highest TPOT admission predicted for its decode worker's batch while it was in it (its own
    # prediction, then each later admission's "with one more"): what its observed TPOT is judged against
    tpot_bound: float | None = None
    path: dict = field(default_factory=dict)  # the path chosen at its last placement and both ways' predictions (PathChoice.attributes)
    prefill_end: float = 0.0  # REMOTE: when its prefill worker began sending its KV (PrefillDone less its kv_seconds)
    first_token_at: float = 0.0  # REMOTE: when its first token came, until its hand-off is measured (Coordinator.note_handoff)
    _hashes: tuple | None = None  # (block size, tokens, secret, keys): prefix_hashes' last answer
    twin_key: tuple | None = None  # (client, cache salt, prompt) while it leads its twins (Coordinator.wait_for_twin)
    scored: bool = False  # its prompt logprobs reached the client (a retry's second copy is dropped)
    held_at: float = 0.0  # when it began to wait for a cold start (no worker could decode it: coordinator/cold_start.py)
    # seconds from its arrival to the registration that ended its cold start wait (0: none): its TTFT target counts from there
    cold_wait_s: float = 0.0

    @property
    def phase(self) -> Phase:
        return self._phase

    def move(self, to: Phase) -> bool:
        """Enter phase `to`; False if TRANSITIONS does not allow it from here (a bug for the caller
        to report; the request moves all the same, as it did before the table)."""
        allowed = to in TRANSITIONS[self._phase]
        self._phase = to
        return allowed

    @property
    def priority(self) -> int:
        return self.req.priority

    def prefix_hashes(self, block_size: int, secret: bytes) -> list[bytes]:
        """The chained keys (keyed with the deployment's secret, from its cache_salt's root) of its
        full blocks but the one holding its last token (what a prefix cache may hold for it), kept
        until its tokens or the block size change."""
        n = self.num_tokens
        if self._hashes is None or self._hashes[:3] != (block_size, n, secret):
            self._hashes = (block_size, n, secret, chain_hashes(self.prompt + self.tokens, block_size, secret, (n - 1) // block_size,
                                                                  salt=self.req.params.cache_salt))
        return self._hashes[3]

    def prefix_tokens(self, blocks: int, block_size: int) -> list[int]:
        """The tokens of its first `blocks` full blocks (an Admit's, for the decode worker's prefix cache)."""
        return (self.prompt + self.tokens)[:blocks * block_size]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def placed_on(self, wid: str) -> bool:
        """Whether worker wid holds this request now (its prefill or decode/colocated worker)."""
        return wid in (self.prefill, self.decode)
