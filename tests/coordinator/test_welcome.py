"""The coordinator's Welcome tells each worker its TPOT budget: the tightest TPOT target of its
priority classes, or 0 without SLO control, and the deployment's prefix-cache secret. A decode worker sharing a node with a prefill worker
holds its streams for at most a share of it (runtime.cores.stall_cap). Real coordinator
processes on loopback; the worker side is the WorkerLink every worker uses."""
import subprocess
import sys

import pytest
import zmq

from pdserve.wire.link import WorkerLink
from pdserve.wire.protocol import PROTOCOL_VERSION, Heartbeat, Hello, Role
from tests.helpers import free_port


@pytest.mark.parametrize("args,tpot_ms", [
    (["--tpot-p99-ms", "400", "--class-target", "1:2000:250", "--class-target", "2:9000:900"], 250.0),
    (["--no-slo", "--tpot-p99-ms", "400"], 0.0),
])
def test_the_welcome_names_the_tightest_tpot_target(tmp_path, args, tpot_ms):
    workers = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "coordinator", "--clients", f"tcp://127.0.0.1:{free_port()}",
                             "--workers", workers, *args], stdout=subprocess.DEVNULL, stderr=open(tmp_path / "coordinator.log", "w"))
    ctx = zmq.Context()
    hello = Hello(PROTOCOL_VERSION, "w", int(Role.DECODE), 1, "h", "b", "m", 2048, 64, 16)
    link = WorkerLink(ctx, workers, hello, heartbeat=lambda: Heartbeat("w", 64, 0, 0, 0), interval=0.1)
    link.start()
    try:
        assert link.registered.wait(120), (tmp_path / "coordinator.log").read_text()
        assert link.welcome is not None and link.welcome.tpot_ms == tpot_ms
        assert len(link.welcome.prefix_secret) == 32  # the deployment's prefix-cache secret (runtime.prefix_hash)
    finally:
        link.stop()
        ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(30)
