"""pdserve-client: the client library for a pdserve coordinator, installable without the engine
(it needs pyzmq and msgspec only). `Client` (blocking) and `AsyncClient` (asyncio) send requests
and return a `Result` or a stream of `StreamDelta`; a refused or failed request raises a typed
`RequestError` (`InvalidRequest`, `Overloaded`, ...). The wire types live here once and the
engine imports them: `SamplingParams` (params.py), the client-port messages (protocol.py),
the base errors (errors.py) and CurveZMQ client keys (keys.py). The code is in library.py.
"""
from pdserve_client.library import *  # noqa: F401,F403  (the public names)
from pdserve_client.library import __all__ as _library_all
from pdserve_client.params import SamplingParams, StructuredOutput
from pdserve_client.protocol import ChatMessage, FinishReason, ToolCall

__all__ = [*_library_all, "ChatMessage", "FinishReason", "SamplingParams", "StructuredOutput", "ToolCall"]
