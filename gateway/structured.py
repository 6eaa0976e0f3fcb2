"""Structured outputs on the HTTP gateway: OpenAI's `response_format` (chat: `json_object`, and
`json_schema` as the openai SDK's `.parse()` sends it) and vLLM's extra-body `structured_outputs`
(`json`, `regex`, `choice`, `json_object`) and older `guided_json` / `guided_regex` /
`guided_choice`, turned into the `StructuredOutput` a request's sampling parameters carry.

Lifecycle: `structured_output(req)` runs while a request body becomes jobs (gateway/schema.py's
sampling_kwargs): it picks the one constraint the body asks for, or None, and raises a 400
naming the field for a malformed one; `whitespace(spec, structured_outputs)` then keeps vLLM's
default (JSON with any whitespace) unless the body asks for `disable_any_whitespace`. Before the jobs leave, `check_jobs(jobs)` checks each
distinct spec with xgrammar (runtime.structured.check; the first call imports xgrammar, off the
event loop and outside the budget) on the gateway's compile lane (runtime/grammar_lane.py):
CHECK_THREADS threads, so hostile specs hold at most that many and never the executor the
tokenizer uses; an LRU of outcomes, so a repeated spec is not compiled again; and the budget: a
check past it is abandoned (a 400 limit_exceeded; its thread runs on and its late result is
remembered as that refusal), and with every thread held by such a check a new spec is refused
with a 429 (overloaded). An invalid schema or pattern is a 400 naming the problem. The workers
compile the spec again for their vocabulary before the request joins a batch
(runtime/structured.py).
"""
from __future__ import annotations

import asyncio
import json
import sys

import msgspec

from pdserve.gateway.errors import ApiError, bad_request
from pdserve_client.params import StructuredOutput


def _bad(message: str, param: str):
    return bad_request(message, param)


def _schema_text(schema, param: str) -> str:
    """The schema as JSON text (its nesting is bounded as the spec's: RequestLimits.check_structured);
    one nested too deep for json's recursion is a 400 limit_exceeded."""
    try:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise _bad(f"{param}: the JSON schema is not valid JSON: {e}", param) from None
        if not isinstance(schema, dict):
            raise _bad(f"{param}: the JSON schema must be an object, got {type(schema).__name__}", param)
        return json.dumps(schema)
    except RecursionError:
        raise bad_request(f"{param}: the JSON schema nests too deep", param, "limit_exceeded") from None


def _from_response_format(rf: dict) -> StructuredOutput | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise _bad("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}", "response_format")
        return StructuredOutput("json", _schema_text(js["schema"], "response_format"))
    raise _bad(f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format")


def _from_vllm(so: dict, param: str) -> StructuredOutput | None:
    given = {k: v for k, v in so.items() if v not in (None, False)}
    unsupported = sorted(set(given) - {"json", "regex", "choice", "json_object", "disable_any_whitespace", "disable_fallback",
                                       "disable_additional_properties", "whitespace_pattern"})
    kinds = [k for k in ("json", "regex", "choice", "json_object") if k in given]
    if unsupported:
        raise _bad(f"{param}: {', '.join(unsupported)} not supported (json, regex, choice, json_object are)", param)
    if len(kinds) > 1:
        raise _bad(f"{param}: give one of json, regex, choice, json_object; got {', '.join(kinds)}", param)
    if not kinds:
        return None
    kind, value = kinds[0], given[kinds[0]]
    if kind == "json":
        return StructuredOutput("json", _schema_text(value, param))
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise _bad(f"{param}: regex must be a non-empty string", param)
        return StructuredOutput("regex", value)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _bad(f"{param}: choice must be a non-empty list of non-empty strings", param)
    return StructuredOutput("choice", choices=tuple(value))


def whitespace(spec: StructuredOutput, options: dict | None) -> StructuredOutput:
    """Any whitespace in JSON, as vLLM's default, unless structured_outputs says
    {"disable_any_whitespace": true} (vLLM's option: compact JSON); also for response_format and forced tool calls."""
    if options and options.get("disable_any_whitespace") is True and spec.kind in ("json", "json_object"):
        return msgspec.structs.replace(spec, any_whitespace=False)
    return spec


def structured_output(req) -> StructuredOutput | None:
    """The constraint a completion or chat body asks for (at most one), or None."""
    found = []
    rf = getattr(req, "response_format", None)
    if rf:
        found.append(("response_format", _from_response_format(rf)))
    if req.structured_outputs:
        found.append(("structured_outputs", _from_vllm(req.structured_outputs, "structured_outputs")))
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice}
    if any(v is not None for v in guided.values()):
        found.append(("guided_*", _from_vllm(guided, "guided_json")))
    found = [(name, spec) for name, spec in found if spec is not None]
    if len(found) > 1:
        raise _bad(f"give one structured output constraint, got {' and '.join(n for n, _ in found)}", found[1][0])
    return found[0][1] if found else None


CHECK_THREADS = 2  # specs the gateway checks at once
CHECK_CACHE_ENTRIES = 1024  # outcomes remembered (an LRU), at most this many
CHECK_CACHE_BYTES = 16 * 2**20  # ... holding this many bytes of specs

_LANE = None


def _lane():
    global _LANE
    if _LANE is None:
        from pdserve.runtime.grammar_lane import LRU, CompileLane
        from pdserve.runtime.structured import check, spec_bytes

        outcomes = LRU(CHECK_CACHE_ENTRIES, CHECK_CACHE_BYTES, lambda spec, _: spec_bytes(spec))
        _LANE = CompileLane(lambda spec: check(spec) or True, CHECK_THREADS, outcomes, name="grammar-check")
    return _LANE


def _import_xgrammar() -> None:
    import xgrammar  # noqa: F401

    import pdserve.runtime.structured  # noqa: F401 (torch)


async def check_jobs(jobs) -> None:
    """400 unless every structured spec of these jobs compiles (in budget); 429 if the checks are all held."""
    specs = {j.sampling["structured"] for j in jobs if j.sampling.get("structured") is not None}
    if not specs:
        return  # no import: runtime.structured brings torch and xgrammar (seconds of a first request)
    if "xgrammar" not in sys.modules or "pdserve.runtime.structured" not in sys.modules:
        await asyncio.to_thread(_import_xgrammar)  # once per process; outside the budget
    from pdserve_client.errors import PdserveError

    for spec in specs:
        try:
            await _checked(_lane(), spec)
        except PdserveError as e:
            param = "response_format" if spec.kind in ("json", "json_object") else "structured_outputs"
            if e.code == "overloaded":
                raise ApiError(429, str(e), e.code, param) from None
            raise bad_request(str(e), param, e.code) from None


async def _checked(lane, spec) -> None:
    """Wait, without blocking the loop, until lane's check of spec answers or runs out of budget."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    job = lane.submit(spec)
    job.future.add_done_callback(lambda _: loop.is_closed() or loop.call_soon_threadsafe(done.set))
    try:
        while lane.outcome(job) is None:  # raises the typed error
            try:
                await asyncio.wait_for(done.wait(), lane.next_check(job))
            except TimeoutError:
                pass
    finally:
        lane.release(job)
