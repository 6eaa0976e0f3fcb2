"""Benchmark targets: how one request is sent and timed, per backend.

Lifecycle: a backend is opened once per run (`async with make_backend(...) as b`), then
`await b.request(req)` is called concurrently for every request; each call streams the answer
and returns a filled `RequestOutput` (timings from `time.perf_counter`, errors caught and
recorded, never raised). `pdserve` speaks the msgspec protocol through one `AsyncClient`;
`openai` / `openai-chat` stream `/v1/completions` / `/v1/chat/completions` over HTTP (server-sent
events, `stream_options.include_usage` for the token count) from any OpenAI-compatible server:
pdserve's gateway, llama.cpp's server, `transformers serve`; they need httpx (the `bench` extra).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from pdserve.bench import import_extra
from pdserve.bench.metrics import RequestOutput
from pdserve.bench.workloads import BenchRequest

BACKENDS = ("pdserve", "openai", "openai-chat")
DEFAULT_URLS = {"pdserve": "tcp://127.0.0.1:5555", "openai": "http://127.0.0.1:8000", "openai-chat": "http://127.0.0.1:8000"}
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)  # openai only: merged into every request body


class _Timer:
    """Stamps streamed chunks into a RequestOutput: the first is TTFT, later ones ITL gaps."""

    def __init__(self, out: RequestOutput):
        self.out = out
        self.start = time.perf_counter()
        self.last: float | None = None

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.out.ttft = now - self.start
        else:
            self.out.itl.append(now - self.last)
        self.last = now

    def done(self) -> None:
        self.out.latency = time.perf_counter() - self.start
        self.out.success = True


class PdserveBackend:
    def __init__(self, address: str, sampling: Sampling, timeout: float):
        self.address, self.sampling, self.timeout = address, sampling, timeout
        self.client = None

    async def __aenter__(self):
        from pdserve_client.library import AsyncClient

        self.client = AsyncClient(self.address, timeout=self.timeout)
        try:
            await self.client.stats(timeout=10.0)
        except TimeoutError:
            await self.client.close()
            raise ConnectionError(f"no pdserve coordinator answered at {self.address} (start one with scripts/serve)") from None
        return self

    async def __aexit__(self, *exc):
        await self.client.close()

    def prompt_kwargs(self, req: BenchRequest) -> dict:
        if req.messages is not None:
            return {"messages": req.messages}
        return {"token_ids": req.token_ids} if req.token_ids is not None else {"prompt": req.prompt}

    async def request(self, req: BenchRequest) -> RequestOutput:
        from pdserve_client.library import ClientError

        s = self.sampling
        out = RequestOutput(prompt_len=req.prompt_len)
        timer = _Timer(out)
        try:
            async for d in self.client.stream(**self.prompt_kwargs(req), max_tokens=req.output_len, temperature=s.temperature,
                                              top_p=s.top_p, top_k=s.top_k, ignore_eos=s.ignore_eos):
                if d.token_ids:
                    timer.chunk()
                out.generated_text += d.text
                if d.result is not None:
                    out.output_tokens = d.result.completion_tokens
                    out.prompt_len = d.result.prompt_tokens or out.prompt_len
            timer.done()
        except ClientError as e:
            out.error = f"{type(e).__name__}: {e}"
        return out


class OpenAIBackend:
    def __init__(self, base_url: str, endpoint: str, model: str | None, sampling: Sampling, timeout: float, chat: bool,
                 tokenizer=None, transport=None):
        self.base_url, self.endpoint, self.model = base_url.rstrip("/"), endpoint, model
        self.sampling, self.timeout, self.chat, self.tokenizer = sampling, timeout, chat, tokenizer
        self.transport = transport  # httpx transport; None: the network
        self.http = None

    async def __aenter__(self):
        httpx = import_extra("httpx", "--backend openai(-chat)")
        # Loopback benchmarking: no proxies from the environment, no cap on open streams.
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(self.timeout, connect=10.0), trust_env=False,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=None), transport=self.transport)
        if self.model is None:
            self.model = await self.first_model()
        return self

    async def __aexit__(self, *exc):
        await self.http.aclose()

    async def first_model(self) -> str:
        import httpx

        try:
            resp = await self.http.get("/v1/models")
            resp.raise_for_status()
            return resp.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            await self.http.aclose()
            raise ConnectionError(f"no model list at {self.base_url}/v1/models ({e}); is the server up? (or pass --model)") from None

    def body(self, req: BenchRequest) -> dict:
        s = self.sampling
        body = {"model": self.model, "max_tokens": req.output_len, "temperature": s.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if s.top_p != 1.0:
            body["top_p"] = s.top_p
        if s.top_k > 0:
            body["top_k"] = s.top_k
        if s.ignore_eos:
            # ignore_eos is vLLM's (and pdserve's) extension; min_tokens makes servers without it
            # (llama.cpp's) run to the same length.
            body["ignore_eos"] = True
            body["min_tokens"] = req.output_len
        body.update(s.extra_body)
        return body

    def chunk_text(self, choice: dict) -> str | None:
        """The text a choice carries; None for chunks that carry no token (a chat role header,
        a bare finish_reason terminator), which must not count as a token's arrival."""
        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
        if not text and (choice.get("finish_reason") is not None or self.chat):
            return None
        return text or ""

    async def request(self, req: BenchRequest) -> RequestOutput:
        import httpx

        out = RequestOutput(prompt_len=req.prompt_len)
        timer = _Timer(out)
        usage_tokens = None
        try:
            async with self.http.stream("POST", self.endpoint, json=self.body(req)) as resp:
                if resp.status_code != 200:
                    out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                    out.latency = time.perf_counter() - timer.start  # how fast the refusal came (a 429's time)
                    return out
                async for line in resp.aiter_lines():
                    data = line.strip()[5:].strip() if line.startswith("data:") else None
                    if not data:
                        continue
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        out.error = f"server error: {chunk['error']}"
                        return out
                    for choice in chunk.get("choices") or []:
                        text = self.chunk_text(choice)
                        if text is not None:
                            timer.chunk()
                            out.generated_text += text
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
            timer.done()
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            out.error = f"{type(e).__name__}: {e}"
            return out
        out.output_tokens = usage_tokens if usage_tokens is not None else self.count_tokens(out.generated_text)
        return out

    def count_tokens(self, text: str) -> int:
        """Without usage in the stream, vLLM's fallback: tokenize the text."""
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if self.tokenizer is not None else len(text.split())


def make_backend(name: str, base_url: str | None, sampling: Sampling, timeout: float, model: str | None = None,
                 endpoint: str | None = None, tokenizer=None):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} ({', '.join(BACKENDS)})")
    url = base_url or DEFAULT_URLS[name]
    if name == "pdserve":
        return PdserveBackend(url, sampling, timeout)
    endpoint = endpoint or DEFAULT_ENDPOINTS[name]
    if url.rstrip("/").endswith("/v1") and endpoint.startswith("/v1/"):
        url = url.rstrip("/")[:-3]  # --base-url http://host:8000/v1 works as well as without /v1
    return OpenAIBackend(url, endpoint, model, sampling, timeout, chat=name == "openai-chat", tokenizer=tokenizer)
