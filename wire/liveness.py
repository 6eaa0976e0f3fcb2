"""How a role tells its launcher that its main loop still runs: a liveness file it touches.

Lifecycle: `pdserve launch` gives each child the path of a file in the environment
(LIVENESS_ENV); the child's main loop calls `touch()` on every pass (the coordinator's
housekeeping task, the gateway's `beat()` task on its event loop, each worker's step/receive
loop), which updates the file's mtime at most every TOUCH_S. The launcher watches the mtime
from the first touch on: one that stops changing for longer than its --hang-timeout-s means the
loop is stuck (deadlocked, SIGSTOPped, a step that never ends), and the child is killed and
restarted. A process started by hand has no path and `touch()` does nothing. The I/O thread's
heartbeats to the coordinator are no proof: they go on while the loop is stuck.
"""
from __future__ import annotations

import os
import time

LIVENESS_ENV = "PDSERVE_LIVENESS_FILE"
TOUCH_S = 1.0  # the launcher's hang timeout must be well above this

_path = os.environ.get(LIVENESS_ENV) or None
_next = 0.0


def touch() -> None:
    """Say "the loop runs" (cheap: one utime a second at most)."""
    global _next
    now = time.monotonic()
    if _path is None or now < _next:
        return
    _next = now + TOUCH_S
    try:
        os.utime(_path)
    except FileNotFoundError:
        try:
            open(_path, "a").close()
        except OSError:
            pass  # the launcher's directory is gone: it is stopping
    except OSError:
        pass


async def beat() -> None:
    """An asyncio task that touches from the event loop: a blocked loop stops it."""
    import asyncio  # here: the launcher imports this module for LIVENESS_ENV

    while True:
        touch()
        await asyncio.sleep(TOUCH_S)
