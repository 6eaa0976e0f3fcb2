"""A free loopback port, for whatever starts servers on this machine without a fixed port: the
benchmark harness (`pdserve bench --stub-coordinator`), benchmarks/ and the tests.

Lifecycle: `free_port()` binds 127.0.0.1:0, reads the port the kernel chose and closes the
socket at once; the caller then hands the number to the process that will bind it (another
process may take it meanwhile, which loopback tests and benchmarks accept).
"""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
