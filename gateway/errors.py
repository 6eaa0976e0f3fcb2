"""HTTP errors in OpenAI's JSON shape, and the limit on one request body.

Lifecycle: stateless. A route raises `ApiError` (or `bad_request(...)`, a 400) anywhere while it
handles a request; the gateway's exception handler turns it into the status, its headers and
OpenAI's error body (`ErrorResponse`). Bodies are read against MAX_BODY_BYTES, the gateway's
budget of body bytes and its read timeout by gateway/bodies.py.
"""
from __future__ import annotations

import msgspec

MAX_BODY_BYTES = 8 * 2**20  # a longer request body is refused (413) as it arrives; well under the coordinator's message limit


class ApiError(Exception):
    """An HTTP error in OpenAI's JSON shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, code: str | None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, self.type, self.param, self.code))


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code, param)


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody
