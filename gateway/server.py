"""The OpenAI-compatible HTTP gateway (`pdserve gateway`): an ASGI app (starlette, served by
uvicorn on uvloop) in front of the coordinator.

Lifecycle: at start the gateway loads each served model's tokenizer (token text for logprobs and
the vocabulary size; never the weights); the app's lifespan opens one `AsyncClient` to each
model's coordinator, which every HTTP request for that model shares, and closes them at shutdown
(gateway/models.py: several models behind one gateway, routed by the request's `model`). A
completion request is authorized (bearer key, when one is set), decoded and checked
(gateway/schema.py) into one job per choice; a `Fanout` runs the jobs on its model's coordinator
(gateway/stream.py) and the results return as one JSON body or as server-sent events ending in `data: [DONE]` (gateway/format.py).
Every error leaves in OpenAI's JSON error shape with its status: 400 bad input or a prompt
longer than the context, 401 bad key, 404 unknown model, 408 a body that did not arrive in time
(the connection closed), 413 a body over 8 MiB, 429 shed (with Retry-After), 503 no workers
(with Retry-After while one starts: cold_start) or no room for a body (the body budget, the parse
lane's queue: gateway/bodies.py, gateway/parse_lane.py). A client that disconnects aborts its coordinator requests, so their KV blocks are
freed. /metrics wants the API key when one is set and asks every coordinator for its stats on
every call; the health routes never want it: /health (and KServe's /v2/health/live) is liveness,
200 while the process answers, and /health/ready (and /v2/health/ready) is readiness, 200 exactly
when every model can serve (`readiness`: its launch's workers all registered once, then a worker
that can decode, or cold starts on), else 503 with the reason. Both answer from a readiness summary
that a task of the lifespan refreshes from the stats every HEALTH_EVERY_S (faster while not ready),
so any number of probes cost each coordinator one stats build a second. /openapi.json describes every route
(gateway/openapi.py). /v1/responses runs through the same chat path (gateway/responses.py lends
its routes and its event stream to `run`); echo and prompt logprobs on /v1/completions are
gateway/scoring.py's. Every field of a request is checked against the table of bounds
(wire/limits.py) before its fan-out (a large body is scanned before it is decoded), and its
choices hold fair shares of the in-flight slots (gateway/slots.py). A chat's tools and the
server's reasoning parser shape its jobs and its answer (gateway/tools.py, gateway/reasoning.py;
its chat_template_kwargs go to the coordinator's template, and Qwen3's enable_thinking false turns
the qwen3 parser off for it).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import math
import time
import uuid

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Route

from pdserve.common.heap import freeze_startup_heap
from pdserve.common.model_path import served_name  # noqa: F401 (served_name re-exported)
from pdserve.gateway.bodies import BodyBudget
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import MAX_BODY_BYTES  # noqa: F401 (MAX_BODY_BYTES re-exported)
from pdserve.gateway.format import ChatFormatter, CompletionFormatter, usage
from pdserve.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from pdserve.gateway.models import ServedModel, ServedModels
from pdserve.gateway.openapi import Health, openapi
from pdserve.gateway.parse_lane import ParseLane
from pdserve.gateway.reasoning import REASONING_PARSERS
from pdserve.gateway.responses import ResponsesRoutes
from pdserve.gateway.schema import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelList,
    bounded,
    chat_jobs,
    checked_inputs,
    completion_jobs,
    structured_bounds,
)
from pdserve.gateway.scoring import echo_options
from pdserve.gateway.slots import Slots
from pdserve.gateway.stream import ClientGone, EventStream, Fanout, unless_disconnected
from pdserve.gateway.structured import check_jobs
from pdserve.gateway.tokenize import TokenizerRoutes, package_version
from pdserve.gateway.tools import tool_plan
from pdserve.wire import liveness
from pdserve.wire.limits import TRACE_HEADERS
from pdserve_client.library import ClientError, InvalidRequest, NoWorkers, Overloaded, RequestTimeout, WorkerLost

log = logging.getLogger("pdserve.gateway")
KEEP_ALIVE_S = 65  # an idle HTTP connection is kept this long (see serve())
HEALTH_EVERY_S = 1.0  # how often /health's summary is refreshed from the coordinator's stats while ready
HEALTH_NOT_READY_EVERY_S = 0.2  # and while not ready (a node coming up is seen ready within this)

# Coordinator error classes -> HTTP status; the first match wins (PromptTooLong is an InvalidRequest).
_STATUS = ((InvalidRequest, 400), (Overloaded, 429), (NoWorkers, 503), (WorkerLost, 503), (RequestTimeout, 504))
_CODE_STATUS = {"unknown_request": 503, "client_too_slow": 503}


def encode_json(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status, headers=headers, media_type="application/json")


def sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class Gateway:
    def __init__(self, cfg: GatewayConfig, tokenizer=None):
        self.cfg = cfg
        self.models = ServedModels(cfg, tokenizer)
        self.metrics = GatewayMetrics(*(m.name for m in self.models.all))
        self.slots = Slots(cfg.max_inflight)
        self.bodies = BodyBudget(cfg.body_budget_bytes, cfg.retry_after_s)  # request body bytes in flight (gateway/bodies.py)
        self.parse_lane = ParseLane(cfg.limits, cfg.parse_queue, cfg.retry_after_s)  # large bodies are decoded in its child process
        self.readiness = Health("unavailable", reason="the coordinator has not answered yet")  # what /health answers
        self.openapi_doc = msgspec.json.encode(openapi("pdserve OpenAI-compatible API", package_version()))

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),  # liveness: the process answers
            Route("/v2/health/live", self.health, methods=["GET"]),  # (KServe's name)
            Route("/health/ready", self.health_ready, methods=["GET"]),  # readiness: every model can serve
            Route("/v2/health/ready", self.health_ready, methods=["GET"]),  # (KServe's name)
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            *TokenizerRoutes(self).routes(),
            *ResponsesRoutes(self).routes(),
        ]
        handlers = {ApiError: self.on_api_error, HTTPException: self.on_http_error}
        return Starlette(routes=routes, exception_handlers=handlers, lifespan=self.lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.models.open(self.cfg.request_timeout_s, self.cfg.keys)
        self.parse_lane.start_early()  # its child imports while the gateway starts, not on the first large body
        self.readiness = self.ready(await self.stats())  # the first probe already has an answer (at most stats_timeout_s)
        tasks = [asyncio.ensure_future(self.watch_health()),
                 asyncio.ensure_future(liveness.beat())]  # the launcher's hang check (wire/liveness.py)
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.models.close()
            self.parse_lane.close()

    # ------------------------------------------------------------------ checks and errors

    def authorize(self, request) -> None:
        if self.cfg.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.cfg.api_key.encode()):
            raise ApiError(401, "missing or incorrect API key: send the header `Authorization: Bearer KEY`", "invalid_api_key")

    def model(self, request, name: str | None) -> ServedModel:
        """The served model a request names (None: the first), remembered for its error count; 404 model_not_found."""
        m = self.models.get(name)
        request.state.model_name = m.name
        return m

    async def decode_request(self, request, kind):
        """The request's body read within the body budget and its read timeout, decoded and
        bounded (decode); its bytes count in the budget until it is decoded."""
        async with self.bodies.read(request, MAX_BODY_BYTES, self.cfg.body_read_timeout_s) as body:
            return await self.decode(body, kind)

    async def decode(self, body: bytes, kind):
        """The body as `kind` (a request Struct, or parse_lane.TOKENIZE), each field within the
        table of bounds; a large one is prepared in the parse lane's child process, so the loop
        keeps streaming (gateway/parse_lane.py)."""
        return await self.parse_lane.parse(body, kind if isinstance(kind, str) else kind.__name__)

    def check_limits(self, request, req) -> dict:
        """The trace headers against the table of bounds (every field of the body was checked
        when it was decoded: parse_lane.prepare), before any fan-out; the coordinator checks each
        job again. Returns them (the coordinator's span joins them)."""
        trace = {k: request.headers[k] for k in TRACE_HEADERS if k in request.headers}
        bounded(self.cfg.limits.check_trace_headers, trace)
        return trace

    def api_error(self, e: Exception) -> ApiError:
        if isinstance(e, ApiError):
            return e
        if not isinstance(e, ClientError):
            return ApiError(500, "internal error in the gateway", "internal_error")
        status = next((s for cls, s in _STATUS if isinstance(e, cls)), _CODE_STATUS.get(e.code, 500))
        retry_after = math.ceil(getattr(e, "retry_after_s", 0.0)) or (self.cfg.retry_after_s if status == 429 else 0)
        headers = {"Retry-After": str(retry_after)} if retry_after else None
        return ApiError(status, getattr(e, "message", str(e)), e.code, headers=headers)

    async def on_api_error(self, request, e: ApiError) -> Response:
        self.metrics.error(e.code, getattr(request.state, "model_name", None))
        return encode_json(e.body(), e.status, e.headers)

    async def on_http_error(self, request, e: HTTPException) -> Response:
        return encode_json(ApiError(e.status_code, str(e.detail), None).body(), e.status_code, e.headers)

    # ------------------------------------------------------------------ completions

    async def completions(self, request) -> Response:
        self.authorize(request)
        req = await self.decode_request(request, CompletionRequest)
        m = self.model(request, req.model)
        trace = self.check_limits(request, req)
        inputs = await checked_inputs(req.prompt, len(m.tok), m.max_model_len)
        jobs = completion_jobs(req, len(m.tok), m.max_model_len, inputs)
        structured_bounds(jobs, self.cfg.limits)
        await check_jobs(jobs)
        fmt = CompletionFormatter(f"cmpl-{uuid.uuid4().hex}", int(time.time()), m.name, m.text, echo_options(req), jobs)
        return await self.run(request, m, req, jobs, fmt, trace)

    async def chat_completions(self, request) -> Response:
        self.authorize(request)
        req = await self.decode_request(request, ChatCompletionRequest)
        m = self.model(request, req.model)
        trace = self.check_limits(request, req)
        plan, reasoning = tool_plan(req, self.cfg.tools), REASONING_PARSERS.get(self.cfg.tools.reasoning_parser)
        reasoning = reasoning.for_request(req.chat_template_kwargs) if reasoning is not None else None  # Qwen3's enable_thinking
        jobs = chat_jobs(req, await m.context_len(self.cfg.stats_timeout_s), plan, reasoning)
        structured_bounds(jobs, self.cfg.limits)
        await check_jobs(jobs)
        fmt = ChatFormatter(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), m.name, m.text, plan, reasoning)
        return await self.run(request, m, req, jobs, fmt, trace)

    async def run(self, request, m: ServedModel, req, jobs, fmt, trace: dict, events=None) -> Response:
        """Run the jobs on model m's coordinator. events: what streams the fan-out's deltas (default:
        Gateway.events' chat and completion chunks)."""
        for job in jobs if trace else ():  # the coordinator's span joins the client's trace
            job.inputs = {**job.inputs, "trace_headers": trace}
        try:
            fanout = Fanout(m.client, jobs, fmt.id, self.metrics.of(m.name), self.cfg.request_timeout_s, self.slots,
                            self.cfg.stream_buffer_bytes)
        except ClientError as e:  # every slot is held: 429
            raise self.api_error(e) from None
        streaming = False
        try:
            if not req.stream:
                results = await unless_disconnected(request.receive, fanout.results_in_order(jobs))
                return encode_json(fmt.whole(jobs, results))
            await unless_disconnected(request.receive, fanout.first())
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            streaming = True  # from here the EventStream closes the fanout
            return EventStream((events or self.events)(fanout, fmt, jobs, include_usage), fanout.close)
        except ClientGone:
            return Response(status_code=400)  # never sent: nobody is listening
        except Exception as e:
            raise self.api_error(e) from None
        finally:
            if not streaming:
                await fanout.close()  # aborts whatever still runs (a disconnect, an error, a cancelled handler)

    async def events(self, fanout: Fanout, fmt, jobs, include_usage: bool):
        for chunk in fmt.opening(sorted(j.index for j in jobs)):
            yield sse(chunk)
        try:
            while (event := await fanout.next_event()) is not None:
                for chunk in fmt.chunks(*event):
                    yield sse(chunk)
            if include_usage:
                yield sse(fmt.usage_chunk(usage(jobs, [fanout.results[j.index] for j in jobs])))
        except Exception as e:  # headers are sent: the error travels as an event (the openai client raises it)
            err = self.api_error(e)
            fanout.metrics.error(err.code)
            yield sse(err.body())
        yield b"data: [DONE]\n\n"

    # ------------------------------------------------------------------ models, health, metrics

    async def list_models(self, request) -> Response:
        self.authorize(request)
        return encode_json(ModelList([m.card() for m in self.models.all]))

    async def stats(self) -> list[dict | None]:
        """Every model's coordinator stats, in the models' order (None: that one did not answer in time)."""
        return await self.models.stats(self.cfg.stats_timeout_s)

    async def watch_health(self) -> None:
        """Refresh the summary /health answers, for as long as the app runs."""
        while True:
            await asyncio.sleep(HEALTH_EVERY_S if self.readiness.status == "ready" else HEALTH_NOT_READY_EVERY_S)
            self.readiness = self.ready(await self.stats())

    async def health(self, request) -> Response:
        """Liveness: 200 while the process answers (a Kubernetes livenessProbe; restarting the gateway
        for missing workers would not bring them); the body is the readiness summary, for people."""
        return encode_json(self.readiness)

    async def health_ready(self, request) -> Response:
        """Readiness: 200 exactly when every model can serve (`readiness`), else 503 with the reason
        (a load balancer's health check, a Kubernetes readinessProbe)."""
        return encode_json(self.readiness, 200 if self.readiness.status == "ready" else 503)

    async def prometheus(self, request) -> Response:
        self.authorize(request)  # /health stays open (probes); /metrics shows traffic, so it wants the key when one is set
        return Response(self.metrics.render(*await self.stats()), media_type=CONTENT_TYPE)

    async def openapi(self, request) -> Response:
        return Response(self.openapi_doc, media_type="application/json")

    def ready(self, stats: list[dict | None]) -> Health:
        """/health's answer from every model's stats: ready while each model can serve, the workers
        counted over all of them; unavailable names the models that cannot."""
        if len(stats) == 1:
            return readiness(stats[0])
        each = [readiness(s) for s in stats]
        workers = dict(sum((collections.Counter(h.workers) for h in each), collections.Counter()))
        down = [f"{m.name}: {h.reason}" for m, h in zip(self.models.all, each) if h.status != "ready"]
        return Health("unavailable", workers, "; ".join(down)) if down else Health("ready", workers)


def readiness(stats: dict | None) -> Health:
    """Whether one model can serve, from its coordinator's stats (None: it did not answer): not before
    every worker its launch started has registered once (`startup.awaiting`: `pdserve launch` tells its
    coordinator their ids), then while a worker that can decode is registered (a decode worker prefills
    locally without a prefill worker, so no path needs more), or with none while cold starts are on
    (`cold_start_s` > 0: a request waits for the worker it brings)."""
    if stats is None:
        return Health("unavailable", reason="the coordinator does not answer")
    roles = collections.Counter(w["role"] for w in stats.get("workers", []))
    awaiting = (stats.get("startup") or {}).get("awaiting") or []
    if awaiting:
        return Health("unavailable", dict(roles), f"the launch's workers have not all registered yet: waiting for {', '.join(awaiting)}")
    if roles["colocated"] > 0 or roles["decode"] > 0:
        return Health("ready", dict(roles))
    if stats.get("cold_start_s"):  # workers start on demand (`pdserve launch --ray`, --min-replicas 0): a request brings one
        return Health("ready", dict(roles))
    return Health("unavailable", dict(roles), "no decode or colocated worker is registered (a decode worker prefills locally without a prefill worker)")


def build_app(cfg: GatewayConfig, tokenizer=None) -> Starlette:
    return Gateway(cfg, tokenizer).app()


def serve(cfg: GatewayConfig) -> None:
    import uvicorn

    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # uvloop is optional on platforms without it
        loop = "asyncio"
    app = build_app(cfg)
    freeze_startup_heap()
    log.info("gateway: http://%s:%d/v1 -> coordinator %s", cfg.host, cfg.port, cfg.coordinator)
    # Keep idle connections longer than clients do (httpx and aiohttp drop theirs after 5 s and
    # 15 s): with uvicorn's default of 5 s a client could send on a connection in the instant the
    # server closed it, and see a ReadError (1 request of 1,000 in the soak under a loaded suite).
    uvicorn.run(app, host=cfg.host, port=cfg.port, loop=loop, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=cfg.max_connections)
