"""What one request may carry, checked before any costly work (tokenizing, fan-out, matching).

Lifecycle: the coordinator and the HTTP gateway each hold one `RequestLimits`, built from the
same flags (`pdserve launch` hands them to both). `check_prompt_bytes` runs on the raw text
before it is tokenized, `check_sampling` on the stop lists, and `check_scheduling` on the
client's own priority and latency targets; each raises `LimitExceededError` (HTTP 400, code
`limit_exceeded`) or `InvalidRequestError` naming the bound and the flag that sets it. Every
check costs at most one pass over what the request already holds; none allocates.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from runtime.errors import InvalidRequestError, LimitExceededError

SCAN_FIRST_BYTES = 64 * 1024  # a larger GenerateRequest frame is scanned for oversized fields before it is decoded


class _RequestHead(msgspec.Struct, tag="GenerateRequest", array_like=True):
    """A GenerateRequest frame (wire/protocol.py) with its params and prompt left undecoded."""

    request_id: str
    params: msgspec.Raw
    prompt: msgspec.Raw = msgspec.Raw(b"")


class _StopRaw(msgspec.Struct):
    stop: msgspec.Raw = msgspec.Raw(b"")


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_bytes: int = 2**20  # UTF-8 bytes of a prompt, or of a chat's roles and contents, before tokenizing
    max_stop: int = 64  # stop strings per request (OpenAI allows 4)
    max_stop_length: int = 256  # characters of one stop string
    max_stop_token_ids: int = 1024
    max_client_priority: int = 0  # a request may ask for at most this priority class
    client_target_range: tuple[float, float] = (1.0, 1.0)  # own ttft_ms/tpot_ms allowed, as factors of the class targets

    def __post_init__(self):
        lo, hi = self.client_target_range
        if min(self.max_prompt_bytes, self.max_stop, self.max_stop_length, self.max_stop_token_ids) < 1:
            raise InvalidRequestError("request limits must be >= 1")
        if not 0 < lo <= hi:
            raise InvalidRequestError(f"client target range must be LO:HI with 0 < LO <= HI, got {lo}:{hi}")

    def oversized_frame(self, frame: bytes) -> tuple[str, str] | None:
        """(request id, why) if a GenerateRequest frame's prompt or stop list is over the limits
        by its msgpack length alone; scanning costs ~3 ms where decoding 200,000 stop strings on
        the coordinator's loop cost 20-140 ms. msgpack holds a string's UTF-8 bytes and a header
        of at most 5 bytes, so only what is certainly over is refused here."""
        try:
            head = msgspec.msgpack.decode(frame, type=_RequestHead)
            stop = msgspec.msgpack.decode(head.params, type=_StopRaw).stop
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # another message, or a bad one: the full decode says so
        if len(head.prompt) > self.max_prompt_bytes + 5:
            return head.request_id, f"the prompt is over {self.max_prompt_bytes} bytes (--max-prompt-bytes)"
        if len(stop) > 5 + self.max_stop * (4 * self.max_stop_length + 5):
            return head.request_id, (f"stop is over the limits of {self.max_stop} strings of {self.max_stop_length} characters "
                                     "(--max-stop, --max-stop-length)")
        return None

    def check_prompt_bytes(self, texts) -> None:
        """texts: the prompt, or each message's role and content."""
        n = 0
        for t in texts:
            n += len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass"))
            if n > self.max_prompt_bytes:
                raise LimitExceededError(f"the prompt is over {self.max_prompt_bytes} bytes (--max-prompt-bytes)")

    def check_sampling(self, stop, stop_token_ids) -> None:
        if len(stop) > self.max_stop:
            raise LimitExceededError(f"stop has {len(stop)} strings; the limit is {self.max_stop} (--max-stop)")
        if any(len(s) > self.max_stop_length for s in stop):
            raise LimitExceededError(f"a stop string is over {self.max_stop_length} characters (--max-stop-length)")
        if len(stop_token_ids) > self.max_stop_token_ids:
            raise LimitExceededError(f"stop_token_ids has {len(stop_token_ids)} ids; the limit is {self.max_stop_token_ids}")

    def check_scheduling(self, priority: int, ttft_ms: float, tpot_ms: float, class_ttft_ms: float, class_tpot_ms: float) -> None:
        """Priority at most max_client_priority; own targets within the range around the class's
        (a tighter one jumps queues, a looser one skips shedding). 0 means the class's own."""
        if priority > self.max_client_priority:
            raise InvalidRequestError(f"priority {priority} is above {self.max_client_priority}, the highest this server "
                                      "allows clients (--max-client-priority)")
        lo, hi = self.client_target_range
        for name, own, base in (("ttft_ms", ttft_ms, class_ttft_ms), ("tpot_ms", tpot_ms, class_tpot_ms)):
            if own and not lo * base <= own <= hi * base:
                raise InvalidRequestError(f"{name} {own:g} is outside [{lo * base:g}, {hi * base:g}], what this server allows "
                                          "for the request's class (--client-target-range)")
