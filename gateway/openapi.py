"""The gateway's OpenAPI 3.1 document (`GET /openapi.json`), built from the msgspec Structs the
routes decode and encode (msgspec.json.schema_components), so it cannot drift from the code.

Lifecycle: stateless; `openapi(title, version)` builds the document once per call (the gateway
caches it). Every route is described with its request body, its success response and each error
status it can answer, all errors in OpenAI's shape (`ErrorResponse`). The test suite fuzzes the
live gateway against this document with schemathesis (tests/gateway/test_openapi_fuzz.py).
"""
from __future__ import annotations

from typing import Literal

import msgspec

from pdserve.gateway.errors import ErrorResponse
from pdserve.gateway.responses import ResponseEvent, ResponseObject, ResponsesRequest
from pdserve.gateway.schema import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)
from pdserve.gateway.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)


class Health(msgspec.Struct, omit_defaults=True):
    """GET /health/ready (and /v2/health/ready): "ready" (200) once every worker the launch started has
    registered, while each model has a decode or colocated worker (or cold starts on), the workers
    counted over all models; else "unavailable" (503) with the reason. GET /health (and
    /v2/health/live) answers the same body with 200 while the gateway answers (liveness)."""

    status: Literal["ready", "unavailable"]
    workers: dict[str, int] = {}
    reason: str | None = None


ERRORS = {  # status -> when a route answers it
    400: "bad input: a wrong type or value (naming the field), a bound passed (code limit_exceeded), a prompt too long",
    401: "a missing or wrong API key (only when the gateway has one)",
    404: "an unknown model, or a response this gateway does not hold (previous_response_id, GET /v1/responses/{id})",
    408: "the request body did not arrive whole within the body read timeout (the connection is closed)",
    413: "a request body over the size limit",
    429: "shed: too many requests in flight or a latency target that cannot be met (Retry-After says when to retry)",
    503: "no worker can serve (none registered, or one was lost), the coordinator dropped this gateway's stream, or the "
         "gateway has no room for the body now (its body budget, its parse queue: Retry-After says when to retry)",
    504: "no answer from the coordinator in time",
}
_GENERATE = (400, 401, 404, 408, 413, 429, 503, 504)
_TOKENIZE = (400, 401, 404, 408, 413, 503)
_STRUCTS = [CompletionRequest, ChatCompletionRequest, CompletionResponse, ChatCompletionResponse, ChatCompletionChunk, ModelList,
            TokenizeCompletionRequest, TokenizeChatRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse, VersionResponse,
            Health, ErrorResponse, ResponsesRequest, ResponseObject, ResponseEvent]


def openapi(title: str, version: str) -> dict:
    refs, components = msgspec.json.schema_components(_STRUCTS, ref_template="#/components/schemas/{name}")
    ref = dict(zip([k.__name__ for k in _STRUCTS], refs))

    def json(schema: dict) -> dict:
        return {"application/json": {"schema": schema}}

    def errors(*statuses: int) -> dict:
        return {str(s): {"description": ERRORS[s], "content": json(ref["ErrorResponse"])} for s in statuses}

    def op(method: str, summary: str, ok: dict, statuses=(), body: dict | None = None, auth: bool = True, parameters=None, **extra) -> dict:
        spec = {"summary": summary, "responses": {"200": {"description": summary, "content": ok}, **errors(*statuses), **extra}}
        if parameters:
            spec["parameters"] = parameters
        if body is not None:
            spec["requestBody"] = {"required": True, "content": json(body)}
        if auth:
            spec["security"] = [{}, {"bearer": []}]  # the key is wanted only when the gateway has one
        return {method: spec}

    def generate(summary: str, body: str, whole: str, chunk: str) -> dict:
        # one server-sent event: a chunk (or, after the headers went out, an error) as JSON, the last `[DONE]`
        data = {"type": "string", "if": {"const": "[DONE]"}, "else": {
            "contentMediaType": "application/json", "contentSchema": {"anyOf": [ref[chunk], ref["ErrorResponse"]]}}}
        event = {"type": "object", "required": ["data"], "properties": {"data": data}}
        ok = {**json(ref[whole]), "text/event-stream": {"schema": event}}
        return op("post", f"{summary} (stream=true: server-sent {chunk} events ending in `data: [DONE]`)", ok, _GENERATE, ref[body])

    # a streamed response: named server-sent events, each a ResponseEvent (`type` names it; an error is type "error")
    event = {"type": "object", "required": ["data"], "properties": {"event": {"type": "string"}, "data": {
        "type": "string", "contentMediaType": "application/json", "contentSchema": ref["ResponseEvent"]}}}
    responses = {**json(ref["ResponseObject"]), "text/event-stream": {"schema": event}}
    response_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    tokenize_body = {"oneOf": [ref["TokenizeCompletionRequest"], ref["TokenizeChatRequest"]]}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": {
            "/v1/completions": generate("Text completion", "CompletionRequest", "CompletionResponse", "CompletionResponse"),
            "/v1/chat/completions": generate("Chat completion", "ChatCompletionRequest", "ChatCompletionResponse", "ChatCompletionChunk"),
            "/v1/responses": op("post", "Create a response (stream=true: server-sent Responses events, response.created to response.completed)",
                                responses, _GENERATE, ref["ResponsesRequest"]),
            "/v1/responses/{response_id}": op("get", "A response this gateway still holds (the newest 1,000, each for an hour)",
                                              json(ref["ResponseObject"]), (401, 404), parameters=response_id),
            "/v1/models": op("get", "The served model", json(ref["ModelList"]), (401,)),
            "/health": op("get", "Liveness: 200 while the gateway answers; the body says whether it is ready (open: no key wanted)",
                          json(ref["Health"]), auth=False),
            "/v2/health/live": op("get", "Liveness, as /health (KServe's name)", json(ref["Health"]), auth=False),
            "/health/ready": op("get", "Readiness: 200 when every model can serve (open: no key wanted)", json(ref["Health"]), auth=False,
                                **{"503": {"description": "not ready, or the coordinator does not answer", "content": json(ref["Health"])}}),
            "/v2/health/ready": op("get", "Readiness, as /health/ready (KServe's name)", json(ref["Health"]), auth=False,
                                   **{"503": {"description": "not ready, or the coordinator does not answer", "content": json(ref["Health"])}}),
            "/metrics": op("get", "Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}, (401,)),
            "/tokenize": op("post", "Token ids of a prompt, or of a chat rendered with the model's template (vLLM's shape)",
                            json(ref["TokenizeResponse"]), _TOKENIZE, tokenize_body),
            "/detokenize": op("post", "The text of token ids", json(ref["DetokenizeResponse"]), _TOKENIZE, ref["DetokenizeRequest"]),
            "/version": op("get", "This server's version", json(ref["VersionResponse"]), auth=False),
            "/openapi.json": op("get", "This document", json({"type": "object"}), auth=False),
        },
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
