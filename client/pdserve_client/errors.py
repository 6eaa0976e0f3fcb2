"""The typed errors that sampling parameters and a client's keys raise, and the base of every
pdserve error. Each carries one message that names the problem; `code` is the stable
machine-readable name that travels on the wire (ErrorReply.code).

Lifecycle: raised where bad input is first seen (SamplingParams.validate, a missing key file),
before any state is touched, so a caller that catches one has nothing to clean up. The engine's
own errors (runtime/errors.py: model loading, prompt and size limits, features not built) derive
from these; the client library turns an ErrorReply into its own RequestError (library.py).
"""


class PdserveError(Exception):
    code = "internal_error"


class InvalidRequestError(PdserveError, ValueError):
    """A request's parameters are invalid (the client's fault)."""

    code = "invalid_request"


class InvalidSamplingParams(InvalidRequestError):
    code = "invalid_sampling_params"
