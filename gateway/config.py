"""The gateway's settings (`pdserve gateway`'s flags, and those `pdserve launch` passes on to it):
GatewayConfig, its ToolConfig and the ModelRoute of each model served besides the first,
validated when constructed; each field a flag sets declares
that flag (common/flags.py), so pdserve/cli.py builds both commands' options from it.

Lifecycle: built once from the command line (or by tests), handed to `Gateway`, then only read.
Importing it loads neither starlette nor the model code (the CLI reads it for `--help`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.flags import flag, keys_flag
from pdserve.gateway.errors import MAX_BODY_BYTES
from pdserve.gateway.reasoning import REASONING_PARSERS
from pdserve.gateway.tool_parsers import PARSERS
from pdserve.wire.limits import RequestLimits
from pdserve_client.errors import InvalidRequestError
from pdserve_client.keys import InsecureBindError
from pdserve_client.library import DEFAULT_ADDRESS

API_KEY_ENV = "PDSERVE_API_KEY"  # the HTTP API key when --api-key is not given (as vLLM reads VLLM_API_KEY)


def check_http_bind(host: str, api_key: str | None) -> None:
    """InsecureBindError for an HTTP bind beyond loopback (0.0.0.0, a pod's address) without an API key:
    whoever reaches the port could use the service. Kubernetes: the key from a Secret through the
    environment (PDSERVE_API_KEY), docs/operations.md."""
    import ipaddress

    if api_key is not None or host == "localhost":
        return
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return
    except ValueError:
        pass  # a host name: taken as exposed
    raise InsecureBindError(f"refusing to serve HTTP on {host} without an API key: set ${API_KEY_ENV} (from a Kubernetes Secret, "
                            "say) or --api-key, or bind 127.0.0.1")
STREAM_BUFFER_BYTES = 4 * 2**20  # events one HTTP request may leave unread (GatewayConfig.stream_buffer_bytes)
BODY_BUDGET_BYTES = 128 * 2**20  # request body bytes held at once, all requests together (GatewayConfig.body_budget_bytes)


@dataclass(frozen=True)
class ModelRoute:
    """A model behind the gateway besides the first (`--more-model NAME=PATH@COORDINATOR`):
    requests whose `model` is `name` go to the coordinator at `coordinator`; `path` holds its
    tokenizer and context length (gateway/models.py)."""

    name: str
    path: str
    coordinator: str

    @classmethod
    def parse(cls, spec: str) -> ModelRoute:
        """NAME=PATH@COORDINATOR (the name ends at the first '=', the address starts after the last '@')."""
        name, _, rest = spec.partition("=")
        path, at, coordinator = rest.rpartition("@")
        if not (name and path and at and coordinator):
            raise InvalidRequestError(f"--more-model wants NAME=PATH@COORDINATOR, got {spec!r}")
        return cls(name, path, coordinator)

    def spec(self) -> str:
        return f"{self.name}={self.path}@{self.coordinator}"


@dataclass(frozen=True)
class ToolConfig:
    """Tool calling and reasoning output (gateway/tools.py, gateway/reasoning.py): vLLM's flags."""

    auto_tool_choice: bool = flag(False, group="HTTP gateway", name="enable_auto_tool_choice", launch=True,
                                  help='serve tool_choice "auto" (needs --tool-call-parser)')
    tool_parser: str | None = flag(None, group="HTTP gateway", name="tool_call_parser", choices=tuple(sorted(PARSERS)), launch=True,
                                   help="how the model writes tool calls, for tool_choice auto")
    reasoning_parser: str | None = flag(None, group="HTTP gateway", choices=tuple(sorted(REASONING_PARSERS)), launch=True,
                                        help="split the model's <think> block into reasoning_content")

    def __post_init__(self):
        if self.tool_parser is not None and self.tool_parser not in PARSERS:
            raise InvalidRequestError(f"unknown tool call parser {self.tool_parser!r}; choose one of {', '.join(PARSERS)}")
        if self.auto_tool_choice and self.tool_parser is None:
            raise InvalidRequestError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise InvalidRequestError(f"unknown reasoning parser {self.reasoning_parser!r}; choose one of {', '.join(REASONING_PARSERS)}")


@dataclass
class GatewayConfig:
    coordinator: str = flag(DEFAULT_ADDRESS, group="network", help="the coordinator's client address (its --clients)")
    # `pdserve launch` names the HTTP address --http-host / --http-port (its --clients and --workers are the coordinator's)
    host: str = flag("127.0.0.1", group="HTTP gateway", launch_name="http_host", launch=True, help="the address the HTTP server binds")
    port: int = flag(8000, group="HTTP gateway", launch_name="http_port", launch=True, help="the HTTP server's port")
    model: str | None = flag(None, group="model and weights",  # whose tokenizer to load; also names the served model
                             help="the served model, for its tokenizer and name (default: SmolLM2-135M-Instruct)")
    served_model_name: str | None = flag(None, group="HTTP gateway", launch=True,
                                         help="the model name the HTTP API answers to (default: the model's file or directory name)")
    api_key: str | None = flag(None, group="security", launch=True,
                               help=f"require `Authorization: Bearer KEY` on /v1 requests (better: set ${API_KEY_ENV}, which `ps` does not show)")
    request_timeout_s: float = flag(600.0, group="HTTP gateway", name="request_timeout", help="seconds one request may take")
    retry_after_s: int = 1  # told to clients of a shed request (429)
    stats_timeout_s: float = 2.0
    keys: str | None = keys_flag()  # CurveZMQ keys directory for the coordinator connection
    # coordinator requests in flight for all HTTP requests (gateway/slots.py)
    max_inflight: int = flag(1024, group="HTTP gateway", min=1, launch=True,
                             help="coordinator requests in flight for all HTTP requests (keep <= the coordinator's "
                             "--max-client-requests); one HTTP request holds at most a fair share of them")
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may carry (wire/limits.py)
    # events one HTTP request may leave unread before its streams are aborted
    stream_buffer_bytes: int = flag(STREAM_BUFFER_BYTES, group="HTTP gateway", name="stream_buffer_kb", scale=1024, min=16,
                                    help="KiB of events one HTTP request may leave unread, past which its streams are aborted "
                                    "(client_too_slow)")
    # request bodies in flight (gateway/bodies.py): bytes held at once, the time one body has to arrive; the parse lane's queue
    body_budget_bytes: int = flag(BODY_BUDGET_BYTES, group="HTTP gateway", name="body_budget_mb", scale=2**20, min=8, launch=True,
                                  help="MiB of request bodies over 64 KiB the gateway holds at once, all requests together (at "
                                  "least one 8 MiB body); a body that does not fit waits its turn, at most --body-read-timeout "
                                  "(then a 503 with Retry-After)")
    body_read_timeout_s: float = flag(30.0, group="HTTP gateway", name="body_read_timeout", min=0.1, launch=True,
                                      help="seconds a request body has to arrive whole once the gateway reads it: past it a 408 "
                                      "and the connection closed")
    max_connections: int = flag(2048, group="HTTP gateway", min=1, launch=True,
                                help="HTTP connections and requests in progress at once; one more is answered 503 at once "
                                "(each connection holds ~64-320 KiB while its body arrives)")
    parse_queue: int = flag(32, group="HTTP gateway", min=1, launch=True,
                            help="bodies over 256 KiB waiting for the gateway's parse lane; one more is a 503 with Retry-After")
    tools: ToolConfig = field(default_factory=ToolConfig)  # tool calling and reasoning (gateway/tools.py)
    # the models served besides the first (--model, --served-model-name, --coordinator): `pdserve launch --model` twice or more
    more_models: tuple[ModelRoute, ...] = flag(factory=tuple, group="HTTP gateway", name="more_model", multiple=True,
                                                help="NAME=PATH@COORDINATOR: also serve model NAME (its tokenizer and context from PATH) "
                                                "through the coordinator at COORDINATOR; repeatable")
    chat_template: str | None = None  # --chat-template's text, instead of the model's own (the coordinator renders with it too)

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise InvalidRequestError(f"port must be in [0, 65535], got {self.port}")
        if self.request_timeout_s <= 0 or self.stats_timeout_s <= 0 or self.retry_after_s < 0 or self.max_inflight < 1:
            raise InvalidRequestError("request_timeout_s and stats_timeout_s must be > 0, retry_after_s >= 0, max_inflight >= 1")
        if self.stream_buffer_bytes < 16 * 1024:
            raise InvalidRequestError(f"stream_buffer_bytes must be >= 16 KiB, got {self.stream_buffer_bytes}")
        if self.body_budget_bytes < MAX_BODY_BYTES or self.body_read_timeout_s <= 0 or self.parse_queue < 1:
            raise InvalidRequestError(f"body_budget_bytes must be >= one largest body ({MAX_BODY_BYTES >> 20} MiB), "
                                      "body_read_timeout_s > 0 and parse_queue >= 1")
        if self.api_key == "":
            raise InvalidRequestError("api_key must not be empty (leave it unset for no key)")
        check_http_bind(self.host, self.api_key)
