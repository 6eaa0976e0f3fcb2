"""The models one gateway serves, each behind a coordinator of its own (`pdserve launch --model
PATH[=NAME]`, repeated): a request's `model` field picks one by its name (or its files' path, as
vLLM answers to both), an unknown name is OpenAI's 404 `model_not_found`, and a request that may
leave `model` out (/tokenize, /detokenize) goes to the first.

Lifecycle: `ServedModels(cfg)` is built with the gateway: the first model from --model,
--served-model-name and --coordinator, one more per --more-model, each loading its tokenizer (never
the weights). The app's lifespan calls `open` (one AsyncClient per coordinator, which every HTTP
request for that model shares) and `close` at shutdown. Each model learns its workers'
max_model_len from its own coordinator's stats.
"""
from __future__ import annotations

import asyncio
import time

from pdserve.common.model_path import resolve_model_path, served_name
from pdserve.common.tokenizer import load_tokenizer
from pdserve.gateway.config import GatewayConfig, ModelRoute
from pdserve.gateway.format import TokenText
from pdserve.gateway.schema import ApiError, Model
from pdserve_client.errors import InvalidRequestError
from pdserve_client.library import AsyncClient, ClientError

DEFAULT_CHAT_MAX_TOKENS = 4096  # chat without max_tokens runs to the end of the context; this if no worker says how long


class ServedModel:
    """One model: its name, tokenizer, the client to its coordinator and its workers' context."""

    def __init__(self, route: ModelRoute, tokenizer, chat_template: str | None):
        self.route, self.name, self.tok = route, route.name, tokenizer
        if chat_template is not None:
            self.tok.chat_template = chat_template  # /tokenize counts what the coordinator renders
        self.root = route.path
        self.text = TokenText(self.tok)
        self.text.fill()  # before it serves: no response decodes ids one by one on the loop
        self.created = int(time.time())
        self.client: AsyncClient | None = None
        self.max_model_len: int | None = None  # learnt from the coordinator's stats
        self.model_context: int | None = None  # its files' context, while no worker has said max_model_len (/tokenize)

    async def stats(self, timeout: float) -> dict | None:
        """Its coordinator's stats, or None if it does not answer in time."""
        try:
            s = await self.client.stats(timeout=timeout)
        except (TimeoutError, ClientError):
            return None
        lens = [w["max_model_len"] for w in s.get("workers", []) if w.get("max_model_len")]
        if lens:
            self.max_model_len = min(lens)
        return s

    async def context_len(self, timeout: float) -> int:
        """Tokens a chat without max_tokens may use: the workers stop at the end of the context."""
        if self.max_model_len is None:
            await self.stats(timeout)
        return self.max_model_len or DEFAULT_CHAT_MAX_TOKENS

    def card(self) -> Model:
        """Its entry in /v1/models; `root` is its served name too (vLLM shows the --model argument,
        here a path on the server's disk, which clients have no business knowing)."""
        return Model(self.name, self.created, self.name, self.max_model_len)


class ServedModels:
    """Every model of the gateway, in the order given; the first is the default."""

    def __init__(self, cfg: GatewayConfig, tokenizer=None):
        first = ModelRoute(cfg.served_model_name or served_name(cfg.model), str(cfg.model or resolve_model_path(None)), cfg.coordinator)
        self.all = [ServedModel(first, tokenizer if tokenizer is not None else load_tokenizer(cfg.model), cfg.chat_template)]
        self.all += [ServedModel(r, load_tokenizer(r.path), cfg.chat_template) for r in cfg.more_models]
        if len({m.name for m in self.all}) < len(self.all):
            raise InvalidRequestError(f"two models share a name: {', '.join(m.name for m in self.all)}")
        # a name, or else the first model's path that matches
        self.by_name = {m.root: m for m in reversed(self.all)} | {m.name: m for m in self.all}

    @property
    def first(self) -> ServedModel:
        return self.all[0]

    def get(self, name: str | None) -> ServedModel:
        """The model a request names (None: the first); an unknown name is a 404 model_not_found."""
        if name is None:
            return self.first
        m = self.by_name.get(name)
        if m is None:
            raise ApiError(404, f"The model `{name}` does not exist.", "model_not_found", "model")
        return m

    def open(self, timeout: float, keys: str | None) -> None:
        for m in self.all:
            m.client = AsyncClient(m.route.coordinator, timeout=timeout, keys=keys)

    async def close(self) -> None:
        for m in self.all:
            await m.client.close()

    async def stats(self, timeout: float) -> list[dict | None]:
        """Every model's coordinator stats, in the models' order (None: that one did not answer)."""
        return list(await asyncio.gather(*(m.stats(timeout) for m in self.all)))
