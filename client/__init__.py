"""The client library for the coordinator: `Client` (blocking) and `AsyncClient` (asyncio), the
`Result` and `StreamDelta` they return, and typed errors. The code is in client/library.py."""
from client.library import *  # noqa: F401,F403  (the public names)
from client.library import __all__  # noqa: F401
