"""The coordinator (`pdserve coordinator`): one asyncio loop (uvloop) owning two ROUTERs, read
and written through `SocketIO` (wire/loop_io.py: no future per message).

Lifecycle of a request here: a client's GenerateRequest is checked against the request limits
(wire/limits.py: every field, before anything else) and validated, then tokenized off the loop
(coordinator/tokenizing.py: the request waits in `tokenizing`, in a lane chosen by its cost,
sharing the work of identical inputs; an abort or a lost client ends it and cancels its queued
work), then placed on the path that serves it best (coordinator/paths.py; counted `path:*` and
`path_reason:*`, both ways' predictions in its trace): REMOTE on a (prefill, decode) pair -> Admit
to the decode worker, whose Granted triggers Prefill to the prefill worker (AdmitRefused parks it
in `pending`, retried as blocks free); LOCAL -> Generate to the decode worker, which prefills it in
its own steps (its blocks reserved until its first token); or, with no decode worker but a
colocated one, Generate to that. TokenBatch items from the decode side
are detokenized incrementally (stop strings end the request and abort it on the worker) and
streamed to the client as Delta, then Final. A client AbortRequest, a worker error or a lost
worker ends it with Final(abort) or ErrorReply, and the workers are told to free its blocks.

Workers register with a versioned Hello and heartbeat; one silent for `worker_timeout_s` is
dropped and every request it held is placed again or ends with a clear error. The ids handed to
workers carry this coordinator's epoch (random per start), so a late message from before a
restart never names a request of this one; and a worker's message about a request counts only
if the request is placed on that worker (others are dropped and counted: wrong_worker_messages).
No message can outgrow its socket: a request whose worker messages (Prefill, Generate, KVReady:
its token ids and params) could pass MAX_CONTROL_MESSAGE less a margin is refused (limit_exceeded)
before any worker sees it. A hand-off whose KVReady was lost on the way is not left fenced: once
its prefill worker reports PrefillDone (the writer is done with the grant), a request its decode
worker has not started within `handoff_timeout_s` fails (kv_transfer_failed) and that grant is
released without a writer (Release(prefill_sent=False)), whether the request still lives or not.
Roles follow the load (SLO control on, some worker's Hello.roles naming more than one role):
every `PlannerConfig.window_s` the planner (coordinator/planner.py) sees the window's outcomes per
phase and loads; a change it starts drains the worker (placement gives it no new work of its
role), then SetRole tells it its new role and its RoleSet switches `WorkerState.role` (an error
there, or no answer, and it keeps its role for good). Admission targets are the targets less a
headroom that follows the measured prediction error (coordinator/calibration.py: predictions are
recorded against what each finished request saw). Launchers report their roles' restart counts
(NodeReport, on the worker port with the worker keys: pdserve/launcher_link.py), shown under `nodes`
in the stats. Bad frames on either port are counted and dropped
(clients get an ErrorReply "bad_message"). The coordinator never loads a model: only the tokenizer.
With cold starts on (--cold-start-s > 0: workers started on demand) a request that finds no worker
able to decode is held (coordinator/cold_start.py: bounded in count, prompt bytes and time, its prompt
checked first against the model's context as its files state it) until one registers; that
registration is the measured cold start (stats `cold_start`, the Retry-After of a refusal) and the
point its TTFT target counts from (RequestState.cold_wait_s). A launcher removing a worker (a
scale-down: DrainWorker, on the worker port: a client key cannot drain a worker) first has it drained: placement skips it (`alive`), its requests in flight
complete there, and the stats show the drain (the worker's `draining`) until the launcher, seeing
nothing in flight, stops it; its disappearance then counts `workers_removed`, not `workers_lost`,
and places nothing again. The launch's worker ids
(--expect-worker) are awaited once: the stats' `startup.awaiting` lists those not yet registered
(the gateway's readiness).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import math
import os
import time
from dataclasses import dataclass

import msgspec
import zmq

from pdserve.common.core_turns import stall_cap
from pdserve.common.errors import LimitExceededError, PromptTooLongError
from pdserve.common.heap import freeze_startup_heap
from pdserve.common.model_path import model_context_len, served_name
from pdserve.common.prefix_hash import new_secret
from pdserve.common.tokenizer import IncrementalDetokenizer, load_tokenizer
from pdserve.coordinator import placement
from pdserve.coordinator.calibration import Calibration, HandoffTimes
from pdserve.coordinator.cold_start import ColdStarts
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.counts import Count, Counts
from pdserve.coordinator.outbox import Outbox, Sent
from pdserve.coordinator.paths import Path, PathChoice, PathRule, choose_path, share_node, share_role_cores
from pdserve.coordinator.placement import Decision, Outcome, RequestView
from pdserve.coordinator.planner import Planner, Stage, Tally, WorkerLoad, phase_loads
from pdserve.coordinator.slo import SloRecorder, SloTargets, StepModel
from pdserve.coordinator.state import Phase, RequestState, WorkerState
from pdserve.coordinator.tokenizing import OffLoopTokenizer, Ticket, prompt_texts
from pdserve.coordinator.tracing import RequestTracer
from pdserve.wire import liveness, security
from pdserve.wire.limits import SCAN_FIRST_BYTES
from pdserve.wire.loop_io import SocketIO
from pdserve.wire.phase_metrics import PhaseTracker
from pdserve.wire.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Admit,
    AdmitRefused,
    Generate,
    Granted,
    Heartbeat,
    Hello,
    LauncherToCoordinator,
    NodeReport,
    Prefill,
    PrefillDone,
    PromptLogprobs,
    Reject,
    Release,
    Role,
    RoleSet,
    SetRole,
    TokenBatch,
    Welcome,
    WorkerError,
    WorkerToCoordinator,
)
from pdserve_client.errors import InvalidRequestError, PdserveError
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import (
    MAX_CONTROL_MESSAGE,
    AbortRequest,
    ClientToCoordinator,
    Delta,
    ErrorReply,
    Final,
    FinishReason,
    GenerateRequest,
    StatsReply,
    StatsRequest,
    StatusRequest,
    decoder,
    encode,
)

log = logging.getLogger("pdserve.coordinator")

MAX_NODES = 256  # launchers whose NodeReport is kept
MAX_NODE_ROLES = 64  # roles kept per report, each name and exit text cut to MAX_NODE_TEXT characters
MAX_NODE_TEXT = 64
WORKER_MESSAGE_MARGIN = 64 * 1024  # bytes of a worker message besides its ids and params: names, endpoints, logprobs, CURVE
GONE_WRITER_KEEP_S = 30.0  # a Prefill's writer record is kept this long after its request ended, for a late PrefillDone
SET_ROLE_RESEND_S = 1.0  # a SetRole not answered by then is sent again (the worker's inbox may have dropped it)
MAX_REMOVALS = 1024  # drains for removal kept (DrainWorker): the oldest is forgotten past this


@dataclass
class Removal:
    """A worker its launcher is removing (DrainWorker): nothing more is placed on it."""

    started: float  # when the drain started (monotonic)
    inflight_at_start: int  # requests on it then: they complete there
    placed_since: int = 0  # requests placed on it since: always 0 (`alive` skips it); counted to show it


@dataclass
class Writer:
    """A Prefill sent: `prefill` may write grant `grant` of `decode` until it reports PrefillDone."""

    prefill: str
    decode: str
    grant: int
    since: float = 0.0  # when PrefillDone came (handed_off)
    gone_at: float = 0.0  # when its request was first seen ended or re-granted (writers are forgotten later)


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig, tokenizer=None):
        self.cfg = cfg
        self.tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
        if cfg.chat_template is not None:
            self.tok.chat_template = cfg.chat_template
        for addr in (cfg.client_addr, cfg.worker_addr):
            security.check_bind(addr, cfg.keys, cfg.insecure)
        self.ctx = zmq.Context()  # plain sockets read from the loop by SocketIO (wire/loop_io.py)
        self.auth = security.start_authenticator(self.ctx, cfg.keys)
        self.workers: dict[str, WorkerState] = {}
        self.prefix_secret = new_secret()  # keys prefix-cache blocks: this view's and (told in Welcome) every worker's
        self.requests: dict[str, RequestState] = {}
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.tokenizing: dict[tuple[bytes, str], tuple[GenerateRequest, Ticket]] = {}  # waiting for their token ids (off the loop)
        self.tokenizer = OffLoopTokenizer(self.tok)
        self.pending: list[str] = []  # waiting for decode room; served earliest deadline first
        self.phases = PhaseTracker()  # per-phase time of each request (wire/phase_metrics.py)
        self.tracer = RequestTracer.otlp(cfg.otlp_traces_endpoint, cfg.otlp_traces_protocol) if cfg.otlp_traces_endpoint else None
        self.model_name = cfg.served_model_name or served_name(cfg.model)  # in its traces and stats
        self.admitting: dict[str, float] = {}  # iid -> when its Admit went out; oldest first (admission_timeouts)
        self.writers: dict[str, Writer] = {}  # iid -> its last Prefill's writer, until it reports PrefillDone
        self.handed_off: dict[str, Writer] = {}  # iid -> writer done, no token yet; oldest first (handoff_timeouts)
        self.next_writer_sweep = 0.0
        self.twins: dict[tuple, str] = {}  # (client, cache salt, prompt) -> the request prefilling it; its twins wait (wait_for_twin)
        self.slo = SloRecorder()
        self.calibration = Calibration()  # prediction errors -> admission headroom (coordinator/calibration.py)
        self.handoff_times = HandoffTimes()  # a hand-off's cost beyond its predicted first step, per decode worker
        self.path_rule = PathRule(local_tokens=cfg.local_prefill_tokens)
        # roles follow the load only against targets: without them there is no attainment to plan by
        self.planner = Planner(cfg.planner) if cfg.planner is not None and cfg.slo else None
        self.tally = Tally()
        self.next_window = 0.0
        self.role_changes = itertools.count(1)
        self.announced: dict[str, list] = {}  # worker id -> [change number, role, when last sent]: SetRole awaiting its RoleSet
        self.counts = Counts()  # events by name: the stats' "requests" (coordinator/counts.py)
        self.kv = collections.Counter()
        self._ids = itertools.count()
        self.epoch = os.urandom(4).hex()  # in every request id: ids never repeat across restarts
        self.nodes: dict[str, dict] = {}  # launcher reports: node -> restarts per role
        # cold starts on (--cold-start-s > 0): requests that find no worker wait for one, the cold start measured (coordinator/cold_start.py)
        self.cold = (ColdStarts(cfg.cold_start_s, cfg.cold_start_timeout_s, cfg.max_held_requests, cfg.max_held_bytes)
                     if cfg.cold_start_s > 0 else None)
        self.files_context: int | None = None  # the model's context as its files state it (read at the first need: context_limit)
        self.awaiting = set(cfg.expected_workers)  # the launch's workers not yet registered once (the stats' `startup`)
        self.removing: dict[str, Removal] = {}  # worker id -> its drain before its launcher removes it (DrainWorker), oldest first
        self.client_sock = self._router(cfg.client_addr, security.server_options(cfg.keys, security.CLIENTS))
        self.worker_sock = self._router(cfg.worker_addr, security.server_options(cfg.keys, security.WORKERS))  # roles apart
        self.client_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone or full client fails (send_client)
        self.client_io, self.worker_io = SocketIO(self.client_sock), SocketIO(self.worker_sock)
        self.by_ident: dict[bytes, str] = {}  # worker socket identity -> worker id
        self.client_load = collections.Counter()  # client identity -> its requests in flight
        self.outbox = Outbox(cfg.client_send_budget)  # bytes queued per client, bounded (send_client)
        self.client_dec = decoder(ClientToCoordinator)
        self.worker_dec = decoder(WorkerToCoordinator)
        self.stopping = asyncio.Event()

    def _router(self, addr: str, options: dict):
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.SNDHWM, self.cfg.send_hwm)
        security.apply(sock, options)
        sock.bind(addr)
        return sock

    # ------------------------------------------------------------------ loops

    async def run(self) -> None:
        self.client_io.start()
        self.worker_io.start()
        tasks = [asyncio.create_task(t) for t in (self._client_loop(), self._worker_loop(), self._housekeeping())]
        try:
            await self.stopping.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.release_sockets()
            if self.tracer is not None:
                self.tracer.shutdown()

    def release_sockets(self) -> None:
        """Stop reading, close both ROUTERs, stop the authenticator and end the context."""
        self.client_io.stop()
        self.worker_io.stop()
        self.tokenizer.close()
        self.client_sock.close(linger=0)
        self.worker_sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()

    async def _client_loop(self) -> None:
        async for frames in self.client_io.messages():
            if len(frames) != 2:
                self.counts.add(Count.BAD_CLIENT_MESSAGES)
                continue
            ident, body = frames
            if len(body) > SCAN_FIRST_BYTES and (over := self.cfg.limits.oversized_frame(body)) is not None:
                self.counts.error("limit_exceeded")  # refused before decoding: see RequestLimits.oversized_frame
                self.send_client(ident, ErrorReply(over[0], "limit_exceeded", over[1]))
                continue
            try:
                msg = self.client_dec.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.counts.add(Count.BAD_CLIENT_MESSAGES)
                self.send_client(ident, ErrorReply("", "bad_message", f"undecodable message: {e}"))
                continue
            try:
                self.on_client(ident, msg)
            except Exception:  # one bad request must never take the coordinator down
                log.exception("error handling a client message")
                self.counts.add(Count.INTERNAL_ERRORS)

    async def _worker_loop(self) -> None:
        async for frames in self.worker_io.messages():
            if len(frames) != 2:
                self.counts.add(Count.BAD_WORKER_MESSAGES)
                continue
            ident, body = frames
            try:
                msg = self.worker_dec.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.counts.add(Count.BAD_WORKER_MESSAGES)
                continue
            try:
                self.on_worker(ident, msg)
            except Exception:
                log.exception("error handling a worker message")
                self.counts.add(Count.INTERNAL_ERRORS)

    async def _housekeeping(self) -> None:
        pruned = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            liveness.touch()  # the launcher's hang check (wire/liveness.py)
            now = time.monotonic()
            for wid in [w for w, s in self.workers.items() if now - s.last_seen > self.cfg.worker_timeout_s]:
                self.drop_worker(wid, "worker stopped answering")
            self.retry_pending(now)
            self.admission_timeouts(now)
            self.handoff_timeouts(now)
            self.plan_roles(now)
            if now - pruned > 1.0:
                self.outbox.prune(self.client_load.__contains__)
                pruned = now

    # ------------------------------------------------------------------ clients

    def send_client(self, ident: bytes, msg, request: str | None = None, last: bool = False) -> None:
        """Queue msg for a client. request: the in-flight request whose message it is: over the
        client's budget only that request ends (client_too_slow) and the client's others go on
        (the gateway is one client for all its HTTP requests: one large result, a prompt's scores
        say, must not end everyone's); any other message over budget ends all the client's
        requests. last: a request's final message (Final, ErrorReply), which may use the notices'
        overdraft."""
        sent = self.outbox.send(self.client_io, ident, encode(msg), idle=ident not in self.client_load, notice=last)
        if sent is Sent.OVER_BUDGET:  # the client does not read: its queued bytes are at client_send_budget
            self.counts.add(Count.CLIENT_OVER_BUDGET_MESSAGES)
            if request is not None and request in self.requests:
                self.end_too_slow(ident, self.close(request))
            else:
                self.drop_client(ident, over_budget=True)
        elif sent is Sent.FAILED:  # gone (EHOSTUNREACH) or not reading (EAGAIN at send_hwm)
            self.counts.add(Count.CLIENT_SEND_FAILURES)
            self.drop_client(ident)

    def drop_client(self, ident: bytes, over_budget: bool = False) -> None:
        """End every request of a client that can no longer be reached, or (over_budget) that
        does not read what is queued for it: each is told client_too_slow if the budget's
        overdraft holds the notice. Their blocks are freed."""
        for (who, _), iid in list(self.by_client.items()):
            st = self.close(iid) if who == ident else None
            if st is None:
                continue
            if over_budget:
                self.end_too_slow(ident, st)
            else:
                self.counts.finished(FinishReason.ABORT)
                self.counts.add(Count.CLIENT_GONE_ABORTS)
        for key in [k for k in self.tokenizing if k[0] == ident]:
            self.forget_tokenizing(key)
            self.counts.add(Count.CLIENT_GONE_ABORTS)

    def end_too_slow(self, ident: bytes, st: RequestState) -> None:
        """Tell the client its (closed) request st ended client_too_slow, if the overdraft holds the notice."""
        self.counts.error("client_too_slow")
        notice = ErrorReply(st.client_rid, "client_too_slow", f"aborted: over {self.cfg.client_send_budget} bytes "
                            "are queued for this client, which does not read them (--client-send-budget-kb)")
        self.outbox.send(self.client_io, ident, encode(notice), idle=ident not in self.client_load, notice=True)

    def on_client(self, ident: bytes, msg) -> None:
        if isinstance(msg, (AbortRequest, StatusRequest)) and len(msg.request_id) > self.cfg.limits.max_name_length:
            self.counts.add(Count.OVERSIZED_IDS_DROPPED)  # no request has such an id; echoing it would cost its bytes again
            return
        if isinstance(msg, GenerateRequest):
            self.on_generate(ident, msg)
        elif isinstance(msg, AbortRequest):
            iid = self.by_client.get((ident, msg.request_id))
            if iid is not None:
                self.finish(iid, FinishReason.ABORT)
            elif self.forget_tokenizing((ident, msg.request_id)):
                self.counts.finished(FinishReason.ABORT)
                self.send_client(ident, Final(msg.request_id, FinishReason.ABORT, 0, 0, 0.0, [], None, None, None))
        elif isinstance(msg, StatsRequest):
            self.send_client(ident, StatsReply(json.dumps(self.stats()).encode()))
        elif isinstance(msg, StatusRequest):
            if (ident, msg.request_id) not in self.by_client and (ident, msg.request_id) not in self.tokenizing:
                self.send_client(ident, ErrorReply(msg.request_id, "unknown_request", "the coordinator does not know this request (it may have restarted)"))

    def on_launcher(self, msg) -> None:
        """A launcher's NodeReport or DrainWorker: on the worker port, whose peers hold the cluster's worker
        keys (a client key cannot send them: the client port's decoder does not know them)."""
        if isinstance(msg, NodeReport):
            self.on_node_report(msg)
        else:
            self.drain_for_removal(msg.worker_id[:self.cfg.limits.max_name_length])

    def drain_for_removal(self, wid: str) -> None:
        """Its launcher will remove worker wid (a scale-down): from now on placement skips it (`alive`), and
        what is in flight there completes there; the launcher stops it once its stats show nothing in flight.
        Kept by id (a worker restarted under it stays drained), whether registered yet or not; idempotent."""
        if wid in self.removing:
            return
        w = self.workers.get(wid)
        self.removing[wid] = Removal(time.monotonic(), len(w.requests) if w is not None else 0)
        while len(self.removing) > MAX_REMOVALS:
            del self.removing[next(iter(self.removing))]
        log.info("draining worker %s for its removal: %d requests in flight there complete, none more is placed there",
                 wid, self.removing[wid].inflight_at_start)
        self.counts.add(Count.DRAINS)

    def on_node_report(self, msg: NodeReport) -> None:
        if msg.node not in self.nodes and len(self.nodes) >= MAX_NODES:
            self.counts.add(Count.NODE_REPORTS_DROPPED)
            return
        cut = lambda d: {str(k)[:MAX_NODE_TEXT]: v if isinstance(v, int) else str(v)[:MAX_NODE_TEXT]  # noqa: E731
                         for k, v in list(d.items())[:MAX_NODE_ROLES]}
        self.nodes[msg.node[:MAX_NODE_TEXT]] = {"restarts": cut(msg.restarts), "last_exit": cut(msg.last_exit)}

    def max_model_len(self) -> int | None:
        lens = [w.hello.max_model_len for w in self.workers.values()]
        return min(lens) if lens else None

    def context_limit(self) -> int | None:
        """The context a prompt is checked against: the registered workers' (max_model_len), or with none
        registered and cold starts on, the model's own as its files state it (a request is checked before it
        is held for a cold start: the workers that start cannot take more); None: nothing to check against."""
        limit = self.max_model_len()
        if limit is not None or self.cold is None:
            return limit
        if self.files_context is None:
            self.files_context = model_context_len(self.cfg.model)
        return self.files_context

    def on_generate(self, ident: bytes, req: GenerateRequest) -> None:
        key = (ident, req.request_id)
        try:
            cost = self.check_request(req)  # first: even a refusal for load echoes only a bounded id
        except PdserveError as e:
            self.counts.error(e.code)
            self.send_client(ident, ErrorReply(req.request_id, e.code, str(e)))
            return
        active = len(self.requests) + len(self.tokenizing)
        if active >= self.cfg.max_active_requests or self.client_load[ident] >= self.cfg.max_client_requests:
            mine = active < self.cfg.max_active_requests
            n, limit = (self.client_load[ident], self.cfg.max_client_requests) if mine else (active, self.cfg.max_active_requests)
            self.counts.error("overloaded")
            self.send_client(ident, ErrorReply(req.request_id, "overloaded",
                                               f"{'this client' if mine else 'the coordinator'} has {n} requests in flight (limit {limit}); retry later"))
            return
        if key in self.by_client or key in self.tokenizing:
            self.send_client(ident, ErrorReply(req.request_id, "invalid_request", f"request id {req.request_id!r} is already running"))
            return
        if req.token_ids is not None:
            self.start_request(ident, req, list(req.token_ids))
            return
        self.client_load[ident] += 1
        ticket = self.tokenizer.submit(req, cost, lambda fut: self.tokenized(key, req, fut))
        self.tokenizing[key] = (req, ticket)

    def check_request(self, req: GenerateRequest) -> int:
        """The table of bounds first (wire/limits.py: each costs one pass over what the request
        holds), then the parameters; returns the prompt's cost (bytes plus message overhead),
        by which its tokenizing lane is chosen."""
        limits, p = self.cfg.limits, req.params
        limits.check_name("request_id", req.request_id)
        limits.check_trace_headers(req.trace_headers)
        limits.check_params(p)
        base = self.cfg.class_targets.get(req.priority, (self.cfg.ttft_ms, self.cfg.tpot_ms))
        limits.check_scheduling(req.priority, req.ttft_ms, req.tpot_ms, *base)
        if sum(x is not None for x in (req.prompt, req.messages, req.token_ids)) != 1:
            raise InvalidRequestError("give exactly one of prompt, messages, token_ids")
        if req.token_ids is not None:
            limits.check_token_ids(len(req.token_ids), "token_ids")
        if req.messages is not None:
            limits.check_messages(len(req.messages))
            limits.check_tool_calls(max((len(m.tool_calls or ()) for m in req.messages), default=0))
            limits.check_template_kwargs(req.chat_template_kwargs)
        elif req.chat_template_kwargs:
            raise InvalidRequestError("chat_template_kwargs is for messages; a prompt is not rendered with the chat template")
        cost = limits.check_prompt_bytes(prompt_texts(req) if req.token_ids is None else [], len(req.messages or ()),
                                         "messages" if req.messages is not None else "prompt")
        p.validate()
        return cost

    def forget_tokenizing(self, key: tuple[bytes, str]) -> bool:
        """Drop a request still being tokenized (aborted, or its client gone): its queued work is
        cancelled unless a twin waits for it too, and its result never arrives."""
        entry = self.tokenizing.pop(key, None)
        if entry is None:
            return False
        self.tokenizer.cancel(entry[1])
        self.unload(key[0])
        return True

    def unload(self, ident: bytes) -> None:
        self.client_load[ident] -= 1
        if self.client_load[ident] <= 0:
            del self.client_load[ident]

    def tokenized(self, key: tuple[bytes, str], req: GenerateRequest, fut) -> None:
        """Back on the loop with req's token ids (or the error tokenizing raised)."""
        entry = self.tokenizing.get(key)
        if entry is None or entry[0] is not req or not self.forget_tokenizing(key):
            return  # aborted or its client gone meanwhile
        try:
            prompt = list(fut.result())  # its own copy: twins share the work's result
        except PdserveError as e:
            self.counts.error(e.code)
            self.send_client(key[0], ErrorReply(req.request_id, e.code, str(e)))
            return
        except Exception as e:  # a template that fails on this input, a tokenizer bug: this request only
            log.warning("tokenizing %r failed: %r", req.request_id, e)
            self.counts.error("invalid_request")
            self.send_client(key[0], ErrorReply(req.request_id, "invalid_request", f"the prompt could not be tokenized: {e}"))
            return
        try:
            self.start_request(key[0], req, prompt)
        except Exception:  # as in _client_loop: one request must never take the coordinator down
            log.exception("starting %r failed", req.request_id)
            self.counts.add(Count.INTERNAL_ERRORS)

    def start_request(self, ident: bytes, req: GenerateRequest, prompt: list[int]) -> None:
        key = (ident, req.request_id)
        try:
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            limit = self.context_limit()
            if limit is not None and len(prompt) >= limit:
                raise PromptTooLongError(f"prompt has {len(prompt)} tokens; this model's context is {limit} tokens (prompt + output)")
            if limit is not None:
                check_worker_message_size(len(prompt), req.params, limit)
        except PdserveError as e:
            self.counts.error(e.code)
            self.send_client(ident, ErrorReply(req.request_id, e.code, str(e)))
            return
        iid = f"r{next(self._ids)}-{self.epoch}"
        st = RequestState(iid, ident, req.request_id, prompt, req, time.monotonic(), IncrementalDetokenizer(self.tok, prompt, req.params.stop))
        self.requests[iid] = st
        self.by_client[key] = iid
        self.client_load[ident] += 1
        self.counts.add(Count.REQUESTS)
        try:
            self.place(st)
        except Exception:  # a bug in placement must not leave the request (and its client) waiting forever
            log.exception("placing %s failed", iid)
            self.counts.add(Count.INTERNAL_ERRORS)
            self.error(iid, "internal_error", "the coordinator failed to place this request")

    # ------------------------------------------------------------------ placement

    def alive(self, role: Role) -> list[WorkerState]:
        """Workers of `role` that may be given new work of it: not one the planner drains or switches, nor
        one its launcher is removing (drain_for_removal)."""
        return [w for w in self.workers.values()
                if w.role == role and (self.planner is None or self.planner.takes(w.hello.worker_id, role))
                and w.hello.worker_id not in self.removing]

    def place(self, st: RequestState, parked: bool = False) -> None:
        """Choose st's path over the live workers (`choose`): REMOTE on a (prefill, decode) pair
        (Admit), LOCAL on a decode worker (Generate: it prefills the prompt itself); without decode
        workers, a colocated worker. Park it if no decode worker has room yet (or every worker is
        changing role); shed it at once if its targets cannot be met (never once parked)."""
        st.attempts += 1
        now = time.monotonic()
        prefills, decodes = self.alive(Role.PREFILL), self.alive(Role.DECODE)
        colocated = self.alive(Role.COLOCATED)
        if not decodes and not colocated:
            if any(w.role != Role.PREFILL for w in self.workers.values()):
                self.park(st)  # its decode workers are all changing role: one takes work again soon
                return
            if self.cold is not None:
                self.hold_for_cold_start(st, now)
                return
            self.error(st.iid, "no_workers", "no decode or colocated worker is registered (a decode worker prefills locally without a prefill worker)")
            return
        if prefills and decodes and self.cfg.paths != "local" and self.wait_for_twin(st, decodes[0].hello.block_size):
            self.park(st)
            return
        req = RequestView(st.num_tokens, st.req.params.max_tokens, now - st.arrival - st.cold_wait_s, parked)  # TTFT from when it could be taken
        if decodes:
            choice = self.choose(req, prefills, decodes, st, now)
        else:
            choice = self.choose_colocated(req, colocated, st, now)
        decision = choice.decision
        if decision.outcome is Outcome.WAIT:
            self.park(st)
        elif decision.outcome is Outcome.SHED:
            self.shed(st, decision)
        else:
            st.path = choice.attributes()
            self.counts.placed(choice.path.value, choice.reason)
            log.debug("%s takes the %s path (%s): %s", st.iid, choice.path.value, choice.reason, choice.detail)
            if decision.prefill is not None:
                self.admit(st, self.workers[decision.prefill], self.workers[decision.worker], decision)
            else:
                self.generate_on(st, self.workers[decision.worker], decision, now)

    def choose_colocated(self, req: RequestView, colocated: list[WorkerState], st: RequestState, now: float) -> PathChoice:
        """A colocated worker for st. Under SLO control a new request is admitted by the default
        launch's LOCAL rule (coordinator/paths.py choose_path with no prefill worker): a place in a
        batch whose streams bear the prompt's step, and its streams' steps stretched by this prompt
        too. One rule for a prompt prefilled where it decodes, whichever launch: before, `--colocated`
        left both out and admitted more than its targets allow (measured 2026-12-03, goodput at 16
        req/s: p99 TPOT 264, 249 and 249 ms at a 250 ms target in three rounds). Without targets, or
        parked, the worker with most room queues it (place_colocated)."""
        snaps = self.snapshots(colocated, now, st)
        if not self.cfg.slo or req.parked:
            d = placement.place_colocated(req, snaps, None)  # (a parked request is placed there with or without targets)
            return PathChoice(d, Path.LOCAL if d.outcome is Outcome.PLACED else None, "colocated")
        targets = self.admission_targets(st, Path.LOCAL)
        choice = choose_path(req, [], snaps, targets, self.path_rule, targets)
        return dataclasses.replace(choice, reason="colocated") if choice.path is not None else choice

    def hold_for_cold_start(self, st: RequestState, now: float) -> None:
        """No worker can decode st and cold starts are on (an orchestrator starts workers on demand:
        `pdserve launch --ray` with --min-replicas 0): st waits for one (parked, up to --cold-start-timeout-s:
        retry_pending), whatever its TTFT target, which counts from the registration that ends its wait
        (st.cold_wait_s); refused with `cold_start` and Retry-After the expected (measured) cold start only
        when the held-requests bound is full (ColdStarts.hold)."""
        if st.iid in self.cold.held:
            self.park(st)  # still waiting
            return
        why = self.cold.hold(st.iid, len(st.prompt), now, bounded=st.attempts <= 1)  # a retry (its worker lost) always waits
        if why is not None:
            self.counts.add(Count.COLD_START_REFUSED)
            self.refuse_cold(st, why)
            return
        st.held_at = now
        self.counts.add(Count.COLD_START_WAITS)
        self.park(st)

    def refuse_cold(self, st: RequestState, why: str) -> None:
        expected = self.cold.expected_s()
        how = "measured" if self.cold.to_registered else "estimated: --cold-start-s, none measured yet"
        self.error(st.iid, "cold_start", f"no worker is running and {why}: retry after the cold start, about {expected:.1f} s ({how})",
                   retry_after_s=expected)

    def choose(self, req: RequestView, prefills: list[WorkerState], decodes: list[WorkerState], st: RequestState,
               now: float) -> PathChoice:
        """st's path (coordinator/paths.py: by headroom with targets, Dynamo's rule without);
        `--paths remote` keeps every request on a pair while one exists, `--paths local` on its decode worker.
        The snapshots carry what a node's shared cores cost each worker (share_node) and each decode
        worker's measured hand-off cost; each path is held to the headroom its own errors call for."""
        p = self.snapshots(prefills, now, st) if self.cfg.paths != "local" else []
        d = [dataclasses.replace(s, handoff_s=self.handoff_times.extra_s(s.worker_id)) for s in self.snapshots(decodes, now, st)]
        p, d = share_node(p, d, self.core_groups(), stall_cap(self.tightest_tpot_ms()))
        targets = self.admission_targets(st, Path.REMOTE) if self.cfg.slo else None
        if self.cfg.paths == "remote" and p:
            decision = placement.place_pair(req, p, d, targets)
            return PathChoice(decision, Path.REMOTE if decision.outcome is Outcome.PLACED else None, "fixed", remote=decision)
        local_targets = self.admission_targets(st, Path.LOCAL) if self.cfg.slo else None
        return choose_path(req, p, d, targets, self.path_rule, local_targets)

    def core_groups(self) -> dict[str, str]:
        """Worker id -> the cores it shares (runtime/cores.py: the workers one `pdserve launch` started
        on its node share one file, named in Hello.engine); a worker without a share is left out."""
        return {wid: f"{w.hello.host}/{w.hello.boot_id}/{share}" for wid, w in self.workers.items()
                if (share := w.hello.engine.get("core_share"))}

    def wait_for_twin(self, st: RequestState, block_size: int) -> bool:
        """n choices of one request (the same prompt from the same client at once, at least a
        full block long): the first is prefilled and handed off alone, the others wait (parked)
        until its KV is on its decode worker. Then they find the prompt's full blocks cached on
        both sides: the decode worker shares them and each choice gets its own copy of the last
        partial block, the only one sent. Without the prefix cache nothing waits, nor does a
        scoring request (it computes its whole prompt whatever is cached; it may lead)."""
        if st.tokens or len(st.prompt) <= block_size or not all(w.prefix_cache for w in self.workers.values()):
            return False
        key = (st.client, st.req.params.cache_salt, tuple(st.prompt))  # a twin of another salt would find nothing cached
        lead = self.requests.get(self.twins.get(key, ""))
        if lead is None or lead is st:
            self.twins[key] = st.iid
            st.twin_key = key
            return False
        return lead.phase <= Phase.PREFILLING and st.req.params.prompt_logprobs is None

    def snapshots(self, workers: list[WorkerState], now: float, st: RequestState) -> list[placement.WorkerSnapshot]:
        """What placement sees of `workers` (workers of one role), for st; where several share one
        node's cores, each with its steps stretched for the busy others (share_role_cores)."""
        snaps = [w.snapshot([self.requests[i] for i in w.requests if i in self.requests], now, self.cached_on(w, st)) for w in workers]
        if len(workers) < 2:
            return snaps
        cores = {w.hello.worker_id: w.alone_threads for w in workers}
        return share_role_cores(snaps, self.core_groups(), cores, lambda wid, alone, threads: self.workers[wid].slowdown.factor(alone, threads))

    def cached_on(self, w: WorkerState, st: RequestState) -> int:
        """Leading tokens of st that w's prefix cache is thought to hold and st may use (0 with its
        cache off). A scoring request (prompt_logprobs) gets none: it computes every prompt row
        (runtime/scoring.py), so its prediction, backlog and blocks count its whole prompt."""
        if not w.prefix_cache or st.req.params.prompt_logprobs is not None:
            return 0
        return w.cached_tokens(st.prefix_hashes(w.hello.block_size, self.prefix_secret))

    def note_placed_prefix(self, st: RequestState, *workers: WorkerState) -> None:
        """The workers st goes to will hold its prefix: say so in their views at once, so the
        next request with that prefix finds it before their heartbeats tell it."""
        for w in workers:
            if w.prefix_cache:
                w.note_prefix(st.prefix_hashes(w.hello.block_size, self.prefix_secret))

    def admit(self, st: RequestState, p: WorkerState, d: WorkerState, decision: Decision) -> None:
        """Reserve st's blocks on d (Admit); its Granted sends the Prefill to p (on_granted)."""
        held = self.cached_on(d, st)
        need = placement.handoff_need(st.num_tokens, held, d.hello.block_size, d.kv_window, d.kv_group_windows)  # what d lacks
        backlog = st.num_tokens - self.cached_on(p, st)  # the tokens p will compute
        st.prefill, st.decode, st.reserved, st.backlog = p.hello.worker_id, d.hello.worker_id, need, backlog
        self.move(st, Phase.ADMITTING)
        st.predicted_ttft, st.predicted_tpot = decision.predicted_ttft, decision.predicted_tpot
        self.bound_tpot(d, st)
        d.reserved_blocks += need
        p.queued_tokens += backlog
        p.note_placed(backlog, time.monotonic())  # its recent prompts: what it takes of a shared node (share_node)
        self.note_placed_prefix(st, p, d)
        d.requests.add(st.iid)
        p.requests.add(st.iid)
        self.note_placed_on_removing(p, d)
        self.admitting.pop(st.iid, None)
        self.admitting[st.iid] = time.monotonic()  # re-inserted: the dict stays oldest first
        st.admissions += 1
        bs = d.hello.block_size  # d confirms the blocks it holds against their tokens: sent if it is thought to hold some
        self.send_worker(d, Admit(st.iid, st.num_tokens, st.admissions, p.hello.pid, p.hello.host, p.hello.boot_id,
                                  st.prefix_tokens((st.num_tokens - 1) // bs, bs) if held else [], st.req.params.cache_salt))

    def generate_on(self, st: RequestState, w: WorkerState, decision: Decision, now: float) -> None:
        """Generate on w (a colocated worker, or a decode worker: the LOCAL path). The blocks w
        lacks for st are reserved until its first token: until the worker schedules the prompt its
        heartbeats do not show them taken, and the next placement must not count them free."""
        held = self.cached_on(w, st)
        st.decode, st.backlog = w.hello.worker_id, st.num_tokens - held
        self.move(st, Phase.COLOCATED)
        st.reserved = placement.computed_blocks(st.num_tokens - held, w.hello.block_size, w.kv_group_windows)
        w.reserved_blocks += st.reserved
        if decision.predicted_ttft is not None:  # a parked request keeps its first prediction
            st.predicted_ttft, st.predicted_tpot = decision.predicted_ttft, decision.predicted_tpot
            self.bound_tpot(w, st)
        w.queued_tokens += st.backlog  # until its first token (on_token)
        self.note_placed_prefix(st, w)
        w.note_placed(st.num_tokens, now)
        w.requests.add(st.iid)
        self.note_placed_on_removing(w)
        self.send_worker(w, Generate(st.iid, st.prompt, st.req.params, list(st.tokens), st.priority))

    def note_placed_on_removing(self, *workers: WorkerState) -> None:
        """Count a placement on a worker being removed (never: `alive` skips them; the stats show the count)."""
        for w in workers:
            r = self.removing.get(w.hello.worker_id)
            if r is not None:
                r.placed_since += 1

    def bound_tpot(self, w: WorkerState, st: RequestState) -> None:
        """st joins w's batch predicted at st.predicted_tpot "with one more": the TPOT every stream
        already there is now predicted to stay under. A stream's TPOT error is judged against the
        highest such bound of its life (calibration): against its own prediction alone, a stream
        admitted into a small batch that later admissions grew (up to the admission limit, under
        overload) reads as under-predicted, and that error tightened the limit for nothing."""
        st.tpot_bound = st.predicted_tpot  # none from an earlier placement carries over
        if st.predicted_tpot is None:
            return
        for iid in w.requests:
            other = self.requests.get(iid)
            if other is not None and other is not st and other.decode == w.hello.worker_id and other.tpot_bound is not None:
                other.tpot_bound = max(other.tpot_bound, st.predicted_tpot)

    def admission_targets(self, st: RequestState, path: Path) -> SloTargets:
        """st's targets less the headroom (`path`'s own once its errors are known): what a
        prediction on that path must meet for st to be admitted."""
        return self.calibration.targets(self.request_targets(st), self.cfg.ttft_headroom, self.cfg.tpot_headroom, path.value)

    def shed(self, st: RequestState, decision: Decision) -> None:
        log.info("shed %s (priority %d, %d tokens): %s", st.iid, st.priority, st.num_tokens, decision.detail)
        self.slo.record_shed(st.priority)
        if decision.reason is not None and self.planner is not None:
            self.tally.shed(decision.reason)
        self.error(st.iid, "slo_unattainable", decision.detail)

    def move(self, st: RequestState, to: Phase) -> None:
        """The one place a request's phase changes (coordinator/state.py's TRANSITIONS): a move
        the table does not allow is a bug, logged and counted (illegal_transitions)."""
        was = st.phase
        if not st.move(to):
            self.counts.add(Count.ILLEGAL_TRANSITIONS)
            log.error("bug: request %s moved %s -> %s, which TRANSITIONS (coordinator/state.py) does not allow", st.iid, was.name, to.name)

    def park(self, st: RequestState) -> None:
        if st.phase != Phase.PENDING:
            self.move(st, Phase.PENDING)
            self.pending.append(st.iid)

    def admission_timeouts(self, now: float) -> None:
        """Place again a request whose decode worker never answered its Admit: a worker drops
        messages past its inbox bound (counted in its heartbeat) rather than grow, so without
        this the request would wait for its client's timeout and keep its reservation."""
        while self.admitting:
            iid, sent = next(iter(self.admitting.items()))
            if now - sent < self.cfg.admit_timeout_s:
                return
            del self.admitting[iid]
            st = self.requests.get(iid)
            if st is not None and st.phase == Phase.ADMITTING:
                self.counts.add(Count.ADMISSION_TIMEOUTS)
                self.retry(st, f"decode worker {st.decode} did not answer the admission within {self.cfg.admit_timeout_s:g} s",
                           code="overloaded")

    def retry_pending(self, now: float) -> None:
        if not self.pending:
            return
        waiting = [self.requests[i] for i in self.pending if i in self.requests and self.requests[i].phase == Phase.PENDING]
        self.pending = []
        # earliest deadline first, higher priority classes before lower
        waiting.sort(key=lambda r: (-r.priority, r.arrival + r.cold_wait_s + self.cfg.targets(r.priority, r.req.ttft_ms, r.req.tpot_ms).ttft_s))
        for st in waiting:
            if st.iid not in self.requests:
                continue  # ended meanwhile: its client went away (drop_client)
            if self.cold is not None and st.iid in self.cold.held:
                if now - st.held_at > self.cold.timeout_s:
                    self.counts.add(Count.COLD_START_TIMEOUTS)
                    self.refuse_cold(st, f"none registered within --cold-start-timeout-s {self.cold.timeout_s:g}")
                    continue
            elif now - st.arrival - st.cold_wait_s > self.cfg.pending_timeout_s:
                self.error(st.iid, "overloaded", "no decode worker had room for this request in time" if self.workers else
                           f"no worker started within {self.cfg.pending_timeout_s:g} s")
                continue
            self.move(st, Phase.NEW)
            st.attempts -= 1  # waiting for room is not a new attempt
            self.place(st, parked=True)

    # ------------------------------------------------------------------ roles

    def can_switch(self) -> bool:
        """Whether any worker can change role without a restart: the planner acts only then."""
        return any(w.can_switch for w in self.workers.values())

    def plan_roles(self, now: float) -> None:
        """The planner's clock (coordinator/planner.py): every window its measurements go in and a
        role change may start (the worker drains: placement gives it no new work); every tick the
        drains advance, and a drained worker is told its new role (SetRole, again every
        SET_ROLE_RESEND_S until its RoleSet; none by max_drain_s: it keeps its role)."""
        if self.planner is None:
            return
        if now >= self.next_window:
            self.next_window = now + self.planner.cfg.window_s
            window = self.tally.close(now, *self.phase_loads(now), self.worker_loads())
            if self.can_switch():
                change = self.planner.observe(window)
                if change is not None:
                    log.info("role change: worker %s (node %s) %s -> %s, draining: %s", change.worker_id, change.node,
                             change.old.name.lower(), change.new.name.lower(), change.reason)
        draining = {wid for wid, r in self.planner.workers.items() if r.stage is Stage.DRAINING and wid in self.workers}
        if draining:
            for r in self.planner.progress({wid: len(self.workers[wid].requests) for wid in draining}, now):
                self.announced[r.worker_id] = [next(self.role_changes), r.role, 0.0, now]
        for wid, a in list(self.announced.items()):
            w = self.workers.get(wid)
            if w is None:
                del self.announced[wid]
            elif now - a[3] > self.planner.cfg.max_drain_s:
                self.keep_role(w, w.role, f"no answer to SetRole within {self.planner.cfg.max_drain_s:g} s", now)
            elif now - a[2] >= SET_ROLE_RESEND_S:
                a[2] = now
                self.send_worker(w, SetRole(a[1], a[0]))

    def on_role_set(self, w: WorkerState, msg: RoleSet) -> None:
        """A worker's answer to SetRole: it serves the new role from now on (placement follows),
        or it could not switch and keeps the role it names."""
        wid, now = w.hello.worker_id, time.monotonic()
        a = self.announced.get(wid)
        if self.planner is None or a is None or msg.change != a[0]:
            self.counts.add(Count.STALE_ROLE_SETS)
            return
        if msg.error or msg.role != a[1]:
            self.keep_role(w, Role(msg.role), msg.error or f"it answered role {Role(msg.role).name.lower()}", now)
            return
        del self.announced[wid]
        self.planner.confirm(wid, Role(msg.role), now)
        self.planner.counts["confirmed"] += 1
        log.info("worker %s now serves as %s (was %s)", wid, Role(msg.role).name.lower(), w.role.name.lower())
        w.role = Role(msg.role)

    def keep_role(self, w: WorkerState, role: Role, why: str, now: float) -> None:
        """w did not take the role announced: it serves `role` and the planner never moves it again."""
        wid = w.hello.worker_id
        self.announced.pop(wid, None)
        log.warning("worker %s keeps role %s: %s", wid, role.name.lower(), why)
        self.planner.counts["refused"] += 1
        self.planner.join(wid, w.hello.host, role, now, roles={role})
        w.role = role

    def phase_loads(self, now: float) -> tuple[float, float]:
        """(prefill, decode) load of the planner's window, against priority class 0's targets."""
        snaps = {Role.PREFILL: [], Role.DECODE: []}
        for w in self.workers.values():
            snaps[Role.PREFILL if w.role == Role.PREFILL else Role.DECODE].append(
                w.snapshot([self.requests[i] for i in w.requests if i in self.requests], now))
        return phase_loads(snaps[Role.PREFILL], snaps[Role.DECODE], self.cfg.targets(0))

    def worker_loads(self) -> list[WorkerLoad]:
        """The planner's view of the workers: not those being removed (none of them changes role)."""
        return [WorkerLoad(wid, w.queued_tokens, len(w.requests)) for wid, w in self.workers.items() if wid not in self.removing]

    # ------------------------------------------------------------------ workers

    def send_worker(self, w: WorkerState, msg) -> None:
        if not self.worker_io.send([w.identity, encode(msg)]):  # its queue is full (EAGAIN at send_hwm): counted
            self.counts.add(Count.WORKER_SEND_FAILURES)

    def on_worker(self, ident: bytes, msg) -> None:
        if isinstance(msg, Hello):
            self.on_hello(ident, msg)
            return
        if isinstance(msg, LauncherToCoordinator):  # a launcher's (pdserve/launcher_link.py): worker keys, no Hello
            self.on_launcher(msg)
            return
        w = self.worker_by_ident(ident)
        if w is None:
            self.worker_io.send([ident, encode(Reject("unregistered"))])
            return
        w.last_seen = time.monotonic()
        if not numbers_ok(msg):
            self.counts.add(Count.INVALID_WORKER_MESSAGES)
            return
        if isinstance(msg, Heartbeat):
            w.beat = msg
            w.beats += 1
            w.note_prefix(msg.prefix_added, msg.prefix_evicted)
            w.slowdown.add(msg.shared_steps, w.model, w.alone_threads)
            w.model.add(msg.steps)
            w.reserved_blocks = sum(self.requests[i].reserved for i in w.requests if i in self.requests and self.requests[i].reserved
                                    and self.requests[i].phase in (Phase.ADMITTING, Phase.COLOCATED))
        elif isinstance(msg, Granted):
            self.on_granted(w, msg)
        elif isinstance(msg, AdmitRefused):
            st = self.request_on(w, msg.request_id)
            if st is not None and st.phase == Phase.ADMITTING and msg.admission == st.admissions:
                self.unplace(st)
                self.park(st)
        elif isinstance(msg, TokenBatch):
            for item in msg.items:
                if self.request_on(w, item.request_id) is not None:
                    if self.handed_off:
                        self.handed_off.pop(item.request_id, None)  # its decode worker took the hand-off
                    self.on_token(item)
        elif isinstance(msg, PromptLogprobs):
            self.on_prompt_logprobs(w, msg)
        elif isinstance(msg, PrefillDone):
            self.writer_done(w, msg)
            st = self.requests.get(msg.request_id)
            if st is not None and self.request_on(w, msg.request_id) is None:
                return  # about a request placed elsewhere
            if st is not None:  # (a request that ended meanwhile still counts in the transfer totals)
                self.release_backlog(st)
                st.prefill_end = time.monotonic() - msg.kv_seconds  # when its KV send began
                self.note_handoff(st)
            # (a request that ended before its PrefillDone came has its phases observed now: PhaseTracker.late)
            self.phases.prefill_done(msg.request_id, msg.compute_seconds, msg.kv_seconds, msg.kv_bytes)
            w.requests.discard(msg.request_id)
            self.kv["bytes"] += msg.kv_bytes
            self.kv["seconds"] += msg.kv_seconds
            self.kv["handoffs"] += 1
        elif isinstance(msg, WorkerError):
            if self.request_on(w, msg.request_id) is not None:
                self.error(msg.request_id, msg.code, msg.message)
        elif isinstance(msg, RoleSet):
            self.on_role_set(w, msg)

    def request_on(self, w: WorkerState, iid: str) -> RequestState | None:
        """The live request iid if it is placed on w; a message from any other worker about it (a
        late one from before a retry, or a confused or hostile worker) is dropped and counted."""
        st = self.requests.get(iid)
        if st is None:
            return None
        if not st.placed_on(w.hello.worker_id):
            self.counts.add(Count.WRONG_WORKER_MESSAGES)
            return None
        return st

    def worker_by_ident(self, ident: bytes) -> WorkerState | None:
        wid = self.by_ident.get(ident)
        return self.workers.get(wid) if wid is not None else None

    def on_hello(self, ident: bytes, h: Hello) -> None:
        problem = f"protocol version {h.version} != {PROTOCOL_VERSION}" if h.version != PROTOCOL_VERSION else hello_problem(h)
        if problem is None:
            problem = handoff_mismatch(h, [w.hello for w in self.workers.values()])
        if problem is None and h.worker_id not in self.workers and len(self.workers) >= self.cfg.max_workers:
            problem = f"{len(self.workers)} workers are registered (limit {self.cfg.max_workers})"
        if problem is not None:
            self.counts.add(Count.REJECTED_WORKERS)
            self.worker_io.send([ident, encode(Reject(problem))])
            return
        old = self.workers.get(h.worker_id)
        if old is not None and old.identity != ident:
            self.drop_worker(h.worker_id, "worker re-registered")
            old = None
        if old is None:
            now = time.monotonic()
            self.workers[h.worker_id] = WorkerState(h, ident, now, model=StepModel(h.profile))
            self.by_ident[ident] = h.worker_id
            if self.planner is not None:  # Hello.roles [] : only its own
                self.planner.join(h.worker_id, h.host, Role(h.role), now, roles={Role(h.role), *h.roles})
            log.info("worker %s (%s, pid %d, %s) registered", h.worker_id, Role(h.role).name.lower(), h.pid, h.host)
            self.awaiting.discard(h.worker_id)
            if self.cold is not None and Role(h.role) != Role.PREFILL:
                self.end_cold_start(now)
        else:
            old.last_seen = time.monotonic()
        self.worker_io.send([ident, encode(Welcome(PROTOCOL_VERSION, self.tightest_tpot_ms(), self.prefix_secret))])

    def end_cold_start(self, now: float) -> None:
        """A worker that can decode registered: the cold start under way is measured, and the requests
        held for it stop waiting (their TTFT targets count from now; they are placed at the next retry)."""
        measuring = self.cold.started is not None
        for iid in self.cold.registered(now):
            st = self.requests.get(iid)
            if st is not None:
                st.cold_wait_s = now - st.arrival
        if measuring:
            log.info("cold start measured: %.2f s from the first request held to a worker registered", self.cold.to_registered[-1])

    def tightest_tpot_ms(self) -> float:
        """The lowest TPOT target of any class (0 without SLO control), told to every worker."""
        if not self.cfg.slo:
            return 0.0
        return min([self.cfg.tpot_ms, *(t for _, t in self.cfg.class_targets.values())])

    def on_granted(self, d: WorkerState, msg: Granted) -> None:
        st = self.requests.get(msg.request_id)
        if st is not None and not st.placed_on(d.hello.worker_id):
            self.counts.add(Count.WRONG_WORKER_MESSAGES)
            st = None  # not this worker's to fill: it frees its own grant
        stale = st is not None and msg.admission != st.admissions  # answers an admission that was retried
        if stale and not msg.grant:
            return  # unnumbered: a Release would name the request's newer grant
        # Every numbered grant gets either its Prefill or this Release: a grant no Prefill was sent
        # for has no writer, so the decode worker frees it at once (even if it fenced it meanwhile).
        if st is None or stale or st.phase != Phase.ADMITTING:
            self.send_worker(d, Release(msg.request_id, msg.grant, prefill_sent=False))
            return
        self.admitting.pop(st.iid, None)
        self.unreserve(st)
        p = self.workers.get(st.prefill)
        if p is None:
            self.send_worker(d, Release(msg.request_id, msg.grant, prefill_sent=False))
            self.retry(st, "its prefill worker was lost")
            return
        st.grant = msg.grant
        self.move(st, Phase.PREFILLING)
        self.send_worker(p, Prefill(
            st.iid, st.prompt, st.req.params, d.hello.worker_id, d.hello.kv_endpoint, msg.block_ids, list(st.tokens), st.priority,
            msg.grant, msg.cached_blocks,
        ))
        self.writers.pop(st.iid, None)
        self.writers[st.iid] = Writer(p.hello.worker_id, d.hello.worker_id, msg.grant)  # re-inserted: oldest first
        self.phases.prefill_sent(st.iid)

    def writer_done(self, p: WorkerState, msg: PrefillDone) -> None:
        """p has finished writing msg's grant: from now on handoff_timeouts watches for its start."""
        h = self.writers.get(msg.request_id)
        if h is not None and h.prefill == p.hello.worker_id and h.grant == msg.grant:
            del self.writers[msg.request_id]
            h.since = time.monotonic()
            self.handed_off.pop(msg.request_id, None)
            self.handed_off[msg.request_id] = h

    def handoff_timeouts(self, now: float) -> None:
        """A hand-off done handoff_timeout_s ago whose request got no token from its decode worker
        was lost on the way (dropped by the kv socket, a full inbox, a bad header): its writer is done,
        so the grant is released without fencing; the request, if it still waits for it, fails."""
        while self.handed_off:
            iid, h = next(iter(self.handed_off.items()))
            if now - h.since < self.cfg.handoff_timeout_s:
                break
            del self.handed_off[iid]
            d = self.workers.get(h.decode)
            if d is not None:  # frees the grant or its fence; one the decode worker took is untouched
                self.send_worker(d, Release(iid, h.grant, prefill_sent=False))
            st = self.requests.get(iid)
            if st is not None and st.phase == Phase.PREFILLING and (st.decode, st.grant) == (h.decode, h.grant):
                self.counts.add(Count.LOST_HANDOFFS)
                log.warning("hand-off of %s never reached decode worker %s: grant %d released", iid, h.decode, h.grant)
                self.error(iid, "kv_transfer_failed", f"the prefill worker handed off this request's KV but decode worker "
                                                      f"{h.decode} never received it within {self.cfg.handoff_timeout_s:g} s")
        if now >= self.next_writer_sweep:
            self.next_writer_sweep = now + 1.0
            self.forget_gone_writers(now)

    def forget_gone_writers(self, now: float) -> None:
        """Writer records of requests that ended (or were granted again) before their PrefillDone:
        an aborted prefill job never reports, so each is forgotten GONE_WRITER_KEEP_S after."""
        for iid, h in list(self.writers.items()):
            st = self.requests.get(iid)
            if st is not None and (st.decode, st.grant) == (h.decode, h.grant):
                continue
            if not h.gone_at:
                h.gone_at = now
            elif now - h.gone_at > GONE_WRITER_KEEP_S or h.prefill not in self.workers:
                del self.writers[iid]

    def unreserve(self, st: RequestState | None) -> None:
        if st is not None and st.reserved and st.decode in self.workers:
            self.workers[st.decode].reserved_blocks -= st.reserved
        if st is not None:
            st.reserved = 0

    def drop_worker(self, wid: str, why: str) -> None:
        """Forget a worker; each request it held is placed again (recomputing the tokens the
        client already has) or, past max_attempts or with nowhere to go, ends with worker_lost."""
        w = self.workers.pop(wid, None)
        if w is None:
            return
        if self.by_ident.get(w.identity) == wid:
            del self.by_ident[w.identity]
        if wid in self.removing and not w.requests:
            log.info("worker %s removed after its drain (%s)", wid, why)
            self.counts.add(Count.WORKERS_REMOVED)
        else:
            log.warning("dropping worker %s: %s", wid, why)
            self.counts.add(Count.WORKERS_LOST)
        self.announced.pop(wid, None)
        self.handoff_times.forget(wid)
        if self.planner is not None:
            self.planner.leave(wid)
        for iid in list(w.requests):
            st = self.requests.get(iid)
            if st is not None:
                self.retry(st, f"worker {wid} was lost ({why})")

    def retry(self, st: RequestState, why: str, code: str = "worker_lost") -> None:
        """Take st off its workers (freeing what they hold for it) and place it again."""
        if st.phase == Phase.PREFILLING and st.decode in self.workers and st.prefill not in self.workers:
            self.send_worker(self.workers[st.decode], Release(st.iid, st.grant))  # a lost prefill sends no KV: free (or fence) the grant
        else:
            self.tell_workers(st, Abort(st.iid))  # each live worker frees what it holds
        self.unplace(st)
        if st.attempts >= self.cfg.max_attempts:
            self.error(st.iid, code, f"{why}; gave up after {st.attempts} attempts")
            return
        self.counts.add(Count.RETRIES)
        log.info("retrying %s (%d tokens done): %s", st.iid, len(st.tokens), why)
        self.move(st, Phase.NEW)
        self.place(st, parked=True)  # an admitted request is never shed on a retry

    def release_backlog(self, st: RequestState) -> None:
        p = self.workers.get(st.prefill if st.prefill is not None else st.decode)  # a colocated worker queues its own prompts
        if p is not None and st.backlog:
            p.queued_tokens = max(0, p.queued_tokens - st.backlog)
        st.backlog = 0

    def unplace(self, st: RequestState) -> None:
        """Undo the coordinator's own accounting of st on its workers."""
        self.admitting.pop(st.iid, None)
        self.unreserve(st)
        self.release_backlog(st)
        for wid in (st.prefill, st.decode):
            if wid in self.workers:
                self.workers[wid].requests.discard(st.iid)
        st.prefill = st.decode = None

    # ------------------------------------------------------------------ tokens and endings

    def on_token(self, item) -> None:
        st = self.requests.get(item.request_id)
        if st is None:
            return
        now = time.monotonic()
        if st.phase != Phase.COLOCATED:
            if not st.tokens and st.phase == Phase.PREFILLING:
                st.first_token_at = now
                self.note_handoff(st)
            if st.phase != Phase.DECODING:
                self.move(st, Phase.DECODING)
        elif st.backlog:
            self.release_backlog(st)  # its prompt is done: its blocks are in the worker's next heartbeat
            self.unreserve(st)
        text = ""
        new = []
        if item.token_id >= 0:
            st.tokens.append(item.token_id)
            st.token_times.append(now - st.arrival)
            if len(st.token_times) == 1:
                self.calibration.record_ttft(st.predicted_ttft, st.token_times[0] - st.cold_wait_s, st.path.get("path"), self.request_targets(st))
                if self.cold is not None:
                    self.cold.first_token(st.iid, now)
            new.append(item.token_id)
            text = st.detok.step(item.token_id)
        reason = item.finish_reason
        if st.detok.stopped_by is not None and reason is None:
            reason = FinishReason.STOP
            self.tell_workers(st, Abort(st.iid))
        if reason is not None:
            text += st.detok.flush()
        if new or text:
            st_lp = [item.logprob] if item.logprob is not None and new else None
            st_top = [item.top_logprobs] if item.top_logprobs is not None and new else None
            self.send_client(st.client, Delta(st.client_rid, new, text, st_lp, st_top), request=st.iid)
        if reason is not None:
            self.finish(st.iid, reason, tell=False)

    def request_targets(self, st: RequestState) -> SloTargets:
        """st's own p99 targets (its class's, or the ones it asked for)."""
        return self.cfg.targets(st.priority, st.req.ttft_ms, st.req.tpot_ms)

    def note_handoff(self, st: RequestState) -> None:
        """Once both ends of st's hand-off are known (its PrefillDone and its first token come in
        either order): what it took, against the first step placement predicted (HandoffTimes)."""
        if st.prefill_end and st.first_token_at and st.decode is not None and st.predicted_tpot is not None:
            self.handoff_times.record(st.decode, max(0.0, st.first_token_at - st.prefill_end), st.predicted_tpot)
            st.prefill_end = st.first_token_at = 0.0

    def on_prompt_logprobs(self, w: WorkerState, msg: PromptLogprobs) -> None:
        """The prompt's scores go to the client once, with its token ids, before its first token."""
        st = self.request_on(w, msg.request_id)
        if st is None or st.scored:
            return
        if st.req.params.prompt_logprobs is None or len(msg.scores) != len(st.prompt) - 1:
            self.counts.add(Count.INVALID_WORKER_MESSAGES)
            return
        st.scored = True
        self.counts.add(Count.SCORED_PROMPTS)
        self.counts.add(Count.SCORED_PROMPT_TOKENS, len(st.prompt))
        self.send_client(st.client, Delta(st.client_rid, [], "", prompt_token_ids=st.prompt, prompt_logprobs=msg.scores), request=st.iid)

    def tell_workers(self, st: RequestState, msg) -> None:
        for wid in {st.prefill, st.decode}:
            if wid in self.workers:
                self.send_worker(self.workers[wid], msg)

    def close(self, iid: str, tell: bool = True) -> RequestState | None:
        """Forget request iid: workers that may hold it are told to abort, accounting undone."""
        st = self.requests.pop(iid, None)
        self.phases.forget(iid)
        if st is None:
            return None
        self.by_client.pop((st.client, st.client_rid), None)
        if self.cold is not None:
            self.cold.forget(iid)
        if st.twin_key is not None and self.twins.get(st.twin_key) == iid:
            del self.twins[st.twin_key]
        self.unload(st.client)
        if tell and st.phase.on_workers:
            self.tell_workers(st, Abort(iid))
        names = st.prefill, st.decode
        self.unplace(st)
        st.prefill, st.decode = names  # kept for the Final message
        return st

    def finish(self, iid: str, reason: FinishReason, tell: bool = True) -> None:
        ended = time.monotonic()
        split = None
        if reason != FinishReason.ABORT and iid in self.requests:
            split = self.phases.finished(iid, self.requests[iid].arrival, self.requests[iid].token_times)
        st = self.close(iid, tell)
        if st is None:
            return
        self.counts.finished(reason)
        times = st.token_times
        ttft = times[0] if times else 0.0
        if times and reason != FinishReason.ABORT:
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            ttft_held = ttft - st.cold_wait_s  # against its target: from when a worker could take it (after a cold start)
            self.slo.record(st.priority, ttft_held, tpot, st.predicted_ttft)
            targets = self.request_targets(st)
            self.calibration.record_tpot(st.tpot_bound, tpot, st.path.get("path"), targets)
            if self.planner is not None:
                self.tally.served(ttft_held, tpot, targets)
        self.send_client(st.client, Final(
            st.client_rid, reason, len(st.prompt), len(st.tokens), ttft, times, st.detok.stopped_by, st.prefill, st.decode,
        ), last=True)
        if self.tracer is not None:
            # its end in the trace: its last token (vLLM's e2e latency), or now for an abort
            end = st.arrival + times[-1] if times and reason != FinishReason.ABORT else ended
            self.tracer.ended(st, reason.name.lower(), split, self.model_name, end=end)

    def error(self, iid: str, code: str, message: str, retry_after_s: float = 0.0) -> None:
        st = self.close(iid)
        if st is None:
            return
        self.counts.error(code)
        self.send_client(st.client, ErrorReply(st.client_rid, code, message, retry_after_s), last=True)
        if self.tracer is not None:
            self.tracer.ended(st, "error", None, self.model_name, f"{code}: {message}")

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        workers = []
        for w in self.workers.values():
            b = w.beat
            workers.append({
                "id": w.hello.worker_id, "role": w.role.name.lower(), "roles": sorted(r.name.lower() for r in {w.role, *w.hello.roles}),
                "pid": w.hello.pid, "host": w.hello.host,
                "queue": b.waiting if b else 0, "running": b.running if b else 0, "queued_tokens": b.queued_tokens if b else 0,
                "free_blocks": b.free_blocks if b else w.hello.num_blocks, "total_blocks": w.hello.num_blocks,
                "block_size": w.hello.block_size, "max_model_len": w.hello.max_model_len, "kv_bytes_sent": b.kv_bytes_sent if b else 0,
                "kv_seconds_sent": b.kv_seconds_sent if b else 0.0, "kv_bytes_received": b.kv_bytes_received if b else 0,
                "bad_messages": b.bad_messages if b else 0, "preemptions": b.preemptions if b else 0, "inflight": len(w.requests),
                "kv_endpoint": w.hello.kv_endpoint, "inbox_dropped": b.inbox_dropped if b else 0, "heartbeats": w.beats,
                "fenced_blocks": b.fenced_blocks if b else 0, "engine": w.hello.engine, "prefix_cache": prefix_stats(b),
                "host_tier": host_tier_stats(b),
                "core_share": {"shared_steps": len(w.slowdown.steps), "ratio_to_linear": round(w.slowdown.ratio(), 3)},
                "draining": self.removal_stats(w.hello.worker_id),
            })
        return {
            "model": self.model_name,
            "workers": workers,
            "kv_transfer": {"bytes": self.kv["bytes"], "seconds": self.kv["seconds"], "handoffs": self.kv["handoffs"]},
            "phases": self.phases.snapshot(),
            "requests": self.counts.snapshot(),
            "epoch": self.epoch,
            "nodes": self.nodes,
            "active_requests": len(self.requests),
            "pending": len(self.pending),
            "cold_start_s": self.cold.expected_s() if self.cold is not None else 0.0,  # > 0: cold starts on (the expected one)
            "cold_start": self.cold.summary() if self.cold is not None else None,
            "startup": {"expected": len(self.cfg.expected_workers), "awaiting": sorted(self.awaiting)},
            "loads": dict(zip(("prefill", "decode"), self.phase_loads(time.monotonic()))),  # > 1: the phase is short (planner.phase_loads)
            "slo": {"enabled": self.cfg.slo, "ttft_ms": self.cfg.ttft_ms, "tpot_ms": self.cfg.tpot_ms, **self.slo.summary()},
            "calibration": self.calibration.summary(self.cfg.ttft_headroom, self.cfg.tpot_headroom),
            "handoff": self.handoff_times.summary(),
            "planner": {"enabled": self.planner is not None, "active": self.planner is not None and self.can_switch(),
                        **(self.planner.summary() if self.planner is not None else {})},
        }


    def removal_stats(self, wid: str) -> dict | None:
        """A worker's drain for its removal (None: not being removed): for how long, what was in flight at its start, and
        what was placed there since (0)."""
        r = self.removing.get(wid)
        if r is None:
            return None
        return {"for_s": round(time.monotonic() - r.started, 3), "inflight_at_start": r.inflight_at_start,
                "placed_since": r.placed_since}


def check_worker_message_size(prompt_tokens: int, params: SamplingParams, max_model_len: int) -> None:
    """LimitExceededError if a Prefill, Generate or KVReady of this request could exceed a worker
    socket's MAX_CONTROL_MESSAGE: each carries its params and at most the model's context in token
    ids plus as many block ids, 9 bytes each at most in msgpack, and the prompt's scores when asked; the rest fits the margin."""
    tokens = min(prompt_tokens + params.max_tokens, max_model_len)
    params_bytes = len(encode(params))
    limit = MAX_CONTROL_MESSAGE - WORKER_MESSAGE_MARGIN
    if params.prompt_logprobs is not None:  # KVReady and PromptLogprobs carry a score per prompt token: 24 bytes + 15 per top id
        params_bytes += prompt_tokens * (24 + 15 * params.prompt_logprobs)
    if params_bytes + 18 * (tokens + 1) > limit:
        raise LimitExceededError(f"the request's messages to workers would be over {limit} bytes, what a worker link takes "
                                 f"(its sampling parameters alone are {params_bytes} bytes)")


def prefix_stats(b: Heartbeat | None) -> dict:
    """A worker's prefix cache as its last heartbeat told it: blocks cached, tokens looked up and hit."""
    queries, hits = (b.prefix_queries, b.prefix_hits) if b else (0, 0)
    return {"cached_blocks": b.cached_blocks if b else 0, "queries": queries, "hits": hits,
            "hit_rate": round(hits / queries, 4) if queries else 0.0}


def host_tier_stats(b: Heartbeat | None) -> dict:
    """A worker's use of its node's host KV tier as its last heartbeat told it: tokens looked up
    there and loaded, bytes put and loaded, the tier's blocks (node-wide); zeros when it has none."""
    if b is None:
        return {"queries": 0, "hits": 0, "hit_rate": 0.0, "bytes_in": 0, "bytes_out": 0, "blocks": 0, "capacity": 0}
    q, h = b.host_tier_queries, b.host_tier_hits
    return {"queries": q, "hits": h, "hit_rate": round(h / q, 4) if q else 0.0, "bytes_in": b.host_tier_bytes_in,
            "bytes_out": b.host_tier_bytes_out, "blocks": b.host_tier_blocks, "capacity": b.host_tier_capacity}


def hello_problem(h: Hello) -> str | None:
    """Why a Hello cannot describe a worker (None if it can): checked before any state changes,
    since a registered worker's fields drive placement (a role outside Role or a block size of 0
    would fail every later placement)."""
    if h.role not in {int(r) for r in Role}:
        return f"invalid hello: role {h.role} is not one of {sorted(int(r) for r in Role)}"
    if not 0 < len(h.worker_id) <= 256:
        return "invalid hello: worker_id must have 1 to 256 characters"
    if h.block_size < 1 or h.max_model_len < 1 or h.num_blocks < 0:
        return "invalid hello: block_size and max_model_len must be >= 1 and num_blocks >= 0"
    if any(not all(math.isfinite(v) and v >= 0 for v in step) for step in h.profile):
        return "invalid hello: profile steps must be finite and >= 0"
    return None


def handoff_mismatch(h: Hello, registered: list[Hello]) -> str | None:
    """Why h's KV blocks could not be handed to or from a registered worker (None if they can):
    a hand-off moves whole blocks between pools of one model, block size, KV dtype and KV cache
    dtype (--kv-cache-dtype: int8 / fp8 blocks are not float ones), whatever
    the tensor parallel size of either side; refused at registration, not mid-request."""
    for o in registered:
        if o.worker_id == h.worker_id:
            continue
        for what, mine, theirs in (("model", h.model, o.model), ("block size", h.block_size, o.block_size),
                                   ("KV dtype", h.engine.get("dtype"), o.engine.get("dtype")),
                                   ("KV cache dtype", _kv_cache_dtype(h), _kv_cache_dtype(o))):
            if mine is not None and theirs is not None and mine != theirs:  # (a worker that does not say is not refused for it)
                return f"not supported: KV hand-offs between workers of another {what} ({mine!r} here, {theirs!r} on {o.worker_id})"
    return None


def _kv_cache_dtype(h: Hello) -> str | None:
    """A worker's --kv-cache-dtype (fp8 and fp8_e4m3 are one storage), None if it does not say."""
    kv = h.engine.get("kv_cache_dtype")
    return "fp8_e4m3" if kv == "fp8" else kv


def numbers_ok(msg) -> bool:
    """A worker's counters and timings must be finite and >= 0: they feed sums, the latency model
    and the stats JSON, where one NaN would break every later answer."""
    if isinstance(msg, Heartbeat):
        values = [msg.free_blocks, msg.running, msg.waiting, msg.queued_tokens, msg.kv_bytes_sent, msg.kv_seconds_sent,
                  msg.kv_bytes_received, msg.bad_messages, msg.preemptions, msg.inbox_dropped, msg.fenced_blocks,
                  *(v for s in msg.steps for v in s), *(v for s in msg.shared_steps for v in s),
                  msg.cached_blocks, msg.prefix_queries, msg.prefix_hits, msg.host_tier_queries, msg.host_tier_hits,
                  msg.host_tier_bytes_in, msg.host_tier_bytes_out, msg.host_tier_blocks, msg.host_tier_capacity]
    elif isinstance(msg, PrefillDone):
        values = [msg.num_tokens, msg.kv_bytes, msg.kv_seconds, msg.compute_seconds]
    else:
        return True
    return all(math.isfinite(v) and v >= 0 for v in values)


def serve(cfg: CoordinatorConfig) -> None:
    import signal

    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # uvloop is optional on platforms without it
        loop_factory = None

    async def main():
        coord = Coordinator(cfg)
        freeze_startup_heap()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, coord.stopping.set)
        log.info("coordinator: clients at %s, workers at %s", cfg.client_addr, cfg.worker_addr)
        await coord.run()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
