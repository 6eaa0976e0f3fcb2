"""Typed errors of the runtime. Each carries one message that names the problem.

Lifecycle: raised at the boundary where bad input is first seen (loading a model, validating a
request), before any state is touched, so a caller that catches one has nothing to clean up.
`code` is the stable machine-readable name that later travels on the wire. Their base classes
(PdserveError, InvalidRequestError) and InvalidSamplingParams live in the client distribution
(pdserve_client/errors.py), which sampling parameters need without the engine.
"""
from pdserve_client.errors import InvalidRequestError, PdserveError

EX_CONFIG = 78  # sysexits.h: a process that cannot start with its configuration exits with this; its launcher does not retry


class ModelLoadError(PdserveError):
    """The model path or file cannot be read as a model (missing, truncated, corrupt)."""

    code = "model_load_error"


class UnsupportedModelError(PdserveError):
    """The file is readable but asks for something pdserve does not implement."""

    code = "unsupported_model"


class ModelNotInstalledError(ModelLoadError):
    code = "model_not_installed"


class PromptTooLongError(InvalidRequestError):
    code = "prompt_too_long"


class LimitExceededError(InvalidRequestError):
    """A request carries more than the server's bounds allow (prompt bytes, stop strings, ...)."""

    code = "limit_exceeded"


class NotSupportedError(PdserveError):
    """A feature that exists in the interface but is not available on this build or device."""

    code = "not_supported"
