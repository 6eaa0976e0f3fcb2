"""Structured outputs on the HTTP gateway: OpenAI's `response_format` (chat: `json_object`, and
`json_schema` as the openai SDK's `.parse()` sends it) and vLLM's extra-body `structured_outputs`
(`json`, `regex`, `choice`, `json_object`) and older `guided_json` / `guided_regex` /
`guided_choice`, turned into the `StructuredOutput` a request's sampling parameters carry.

Lifecycle: `structured_output(req)` runs while a request body becomes jobs (gateway/schema.py's
sampling_kwargs): it picks the one constraint the body asks for, or None, and raises a 400
naming the field for a malformed one. Before the jobs leave, `check_jobs(jobs)` compiles each
distinct spec once with xgrammar in a worker thread (runtime.structured.check; the first call
imports xgrammar) and raises a 400 naming the problem of an invalid schema or pattern. The
workers then mask every step's logits with the grammar (runtime/structured.py).
"""
from __future__ import annotations

import asyncio
import json

from gateway.errors import bad_request
from runtime.errors import InvalidRequestError
from runtime.params import StructuredOutput


def _bad(message: str, param: str):
    return bad_request(message, param)


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise _bad(f"{param}: the JSON schema is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise _bad(f"{param}: the JSON schema must be an object, got {type(schema).__name__}", param)
    return json.dumps(schema)


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


async def check_jobs(jobs) -> None:
    """400 unless every structured spec of these jobs compiles."""
    specs = {j.sampling["structured"] for j in jobs if j.sampling.get("structured") is not None}
    if not specs:
        return  # no import: runtime.structured brings torch and xgrammar (seconds of a first request)
    from runtime.structured import check

    for spec in specs:
        try:
            await asyncio.to_thread(check, spec)
        except InvalidRequestError as e:
            raise _bad(str(e), "response_format" if spec.kind in ("json", "json_object") else "structured_outputs") from None
