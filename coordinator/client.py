"""The client library's old import path (`from coordinator.client import Client`), kept for
programs written against it; the library itself is client/library.py."""
from client.library import *  # noqa: F401,F403
from client.library import __all__  # noqa: F401
