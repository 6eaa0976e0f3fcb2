"""vLLM's tokenizer endpoints on the HTTP gateway: POST /tokenize, POST /detokenize, GET /version.

Shapes follow vLLM's API server: /tokenize takes a completion body {model?, prompt,
add_special_tokens=true, return_token_strs=false} or a chat body {model?, messages,
add_generation_prompt=true, continue_final_message=false, add_special_tokens=false,
chat_template_kwargs?, tools?, return_token_strs=false} and answers {count, max_model_len, tokens,
token_strs}; /detokenize takes {model?, tokens} and answers {prompt}; /version answers
{version} (this package's version).

Lifecycle: `TokenizerRoutes(gateway)` is built once with the gateway and lends it three
routes; each request is authorized like /v1 (bearer key, when one is set), decoded into the
Structs here as the gateway decodes a completion (a large body scanned first; a wrong type or a
bad id is a 400 naming the field), checked against the table of bounds (wire/limits.py: the
prompt's bytes, messages and parts, token ids, and chat_template_kwargs, an allow-list of plain
values that never carries template source; 400 `limit_exceeded`), and answered from the
gateway's own tokenizer in a worker thread, which a client already gone never starts. Nothing goes to the coordinator but the stats
call that learns max_model_len from the workers; until a worker has said it, the model files'
own context length is answered. A chat body is rendered with the same chat
template the coordinator applies, so /tokenize's count for a chat equals the prompt_tokens a
chat completion of it reports.
"""
from __future__ import annotations

import asyncio
from importlib import metadata

import msgspec
from starlette.responses import Response
from starlette.routing import Route

from pdserve.common.model_path import model_context_len
from pdserve.common.tokenizer import template_message
from pdserve.gateway.errors import bad_request
from pdserve.gateway.schema import ChatMessageIn, chat_message, token_ids
from pdserve.gateway.stream import ClientGone, unless_disconnected
from pdserve.gateway.tools import Tool


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True):
    messages: list[ChatMessageIn]
    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False
    tools: list[Tool] | None = None  # shown to the template, as a chat completion's are


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str


def package_version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class TokenizerRoutes:
    def __init__(self, gateway):
        self.gw = gateway
        self.version = package_version()

    def routes(self) -> list[Route]:
        return [
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version_info, methods=["GET"]),
        ]

    async def tokenize(self, request):
        self.gw.authorize(request)
        req = await self.gw.decode_request(request, "tokenize")  # the chat or the completion shape, bounded (gateway/parse_lane.py)
        m = self.gw.model(request, req.model)
        if isinstance(req, TokenizeChatRequest):
            if req.add_generation_prompt and req.continue_final_message:
                raise bad_request("add_generation_prompt and continue_final_message cannot both be true", "continue_final_message")
            if not req.messages:
                raise bad_request("messages must not be empty", "messages")
            messages = [template_message(m) for m in map(chat_message, req.messages)]
            work = asyncio.to_thread(self._with_strs, self._chat_ids, m.tok, req, messages)
        else:
            work = asyncio.to_thread(self._with_strs, self._prompt_ids, m.tok, req)
        try:
            ids, strs = await unless_disconnected(request.receive, work)  # a client gone: its queued work is cancelled
        except ClientGone:
            return Response(status_code=400)  # never sent: nobody is listening
        return _json(TokenizeResponse(len(ids), await self._max_model_len(m), ids, strs))

    @staticmethod
    def _with_strs(tokenize, tok, req, *args) -> tuple[list[int], list[str] | None]:
        """tokenize's ids and, when asked, their token strings: both off the event loop (the strings
        of 131,072 ids take ~70 ms of Python, which a thread gives up every switch interval)."""
        ids = tokenize(tok, req, *args)
        return ids, tok.convert_ids_to_tokens(ids) if req.return_token_strs else None

    def _prompt_ids(self, tok, req: TokenizeCompletionRequest) -> list[int]:
        return list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))

    def _chat_ids(self, tok, req: TokenizeChatRequest, messages: list[dict]) -> list[int]:
        if tok.chat_template is None:
            raise bad_request("this model has no chat template; tokenize a plain prompt instead", "messages")
        try:
            tools = msgspec.to_builtins(req.tools) if req.tools else None  # as the coordinator renders them (gateway/tools.py)
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=req.add_generation_prompt, tokenize=False,
                                           continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}))
        except Exception as e:  # jinja errors, a final message to continue that is not the assistant's
            raise bad_request(f"cannot render the chat template: {e}", "messages") from None
        return list(tok.encode(text, add_special_tokens=req.add_special_tokens))

    async def _max_model_len(self, m) -> int:
        if m.max_model_len is None:
            await m.stats(self.gw.cfg.stats_timeout_s)  # learns it from the workers
        if m.max_model_len is not None:
            return m.max_model_len
        if m.model_context is None:
            m.model_context = await asyncio.to_thread(model_context_len, m.root)
        return m.model_context

    async def detokenize(self, request):
        self.gw.authorize(request)
        req = await self.gw.decode_request(request, DetokenizeRequest)
        m = self.gw.model(request, req.model)
        vocab = len(m.tok)
        if token_ids(req.tokens, vocab) is None and req.tokens:  # checked in C, on the loop
            bad = next(t for t in req.tokens if not 0 <= t < vocab)
            raise bad_request(f"token id {bad} is out of range [0, {vocab})", "tokens")
        text = await asyncio.to_thread(m.tok.decode, req.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return _json(DetokenizeResponse(text))

    async def version_info(self, request):
        return _json(VersionResponse(self.version))


class _Shape(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw(b"")


def _json(obj):
    return Response(msgspec.json.encode(obj), media_type="application/json")
