"""Multiple hosts on one machine: coordinator, prefill and decode each in its own network
namespace (veth pairs on a bridge, real addresses, KV over tcp, CurveZMQ keys since nothing
binds loopback), each started with `pdserve launch --config cluster.toml --node NAME`.
Requests succeed; cutting the decode host's link ends its requests with a typed error within
5 s (as a kill does); restoring the link lets the worker rejoin, and requests succeed again."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.netns import hosts
from pdserve.wire.security import keygen
from pdserve_client.library import Client, RequestError
from tests.helpers import save_tiny_served_model, wait_all_blocks_free

pytestmark = [pytest.mark.multihost, pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 for network namespaces")]

SUBNET = "10.231.77"  # addresses of this test's own namespaces only; nothing else is ever contacted
HOSTS = {"c": 1, "p": 2, "d": 3}


@pytest.fixture(scope="module")
def net():
    with hosts(SUBNET, HOSTS) as n:
        yield n


def test_three_hosts_cut_and_restore_decode_link(net, tmp_path):
    model = tmp_path / "model"
    save_tiny_served_model(model)
    keys = keygen(str(tmp_path / "keys"))
    cfg = tmp_path / "cluster.toml"
    cfg.write_text(f"""
[cluster]
coordinator_host = "{SUBNET}.1"
client_port = 7555
worker_port = 7556
model = "{model}"
kv_backend = "tcp"
kv_cache_mb = 8
keys = "{keys}"

[nodes.c]
host = "{SUBNET}.1"
coordinator = true
threads = 1

[nodes.p]
host = "{SUBNET}.2"
prefill = 1
threads = 1

[nodes.d]
host = "{SUBNET}.3"
decode = 1
threads = 1
""")
    procs = {}
    for h in ("c", "p", "d"):
        procs[h] = subprocess.Popen(net.run(h, [sys.executable, "-m", "pdserve", "launch", "--config", str(cfg),
                                                "--node", h, "--no-gateway", "--log-dir", str(tmp_path / h),
                                                "--paths", "remote"]))  # every prompt crosses hosts (auto would prefill these short ones on d)
    address = f"tcp://{SUBNET}.1:7555"
    try:
        with Client(address, keys=str(keys), timeout=30) as c:
            deadline = time.monotonic() + 120
            # the first request waits in ZeroMQ's queue until the coordinator binds: three processes
            # importing torch on 2 busy cores took 61 s once, so it gets the same 120 s as registration
            while len(c.stats(timeout=120)["workers"]) < 2:
                assert time.monotonic() < deadline, "workers did not register across hosts"
                assert all(p.poll() is None for p in procs.values())
                time.sleep(0.3)
            r = c.generate(token_ids=[11, 12, 13, 14], temperature=0, max_tokens=6, ignore_eos=True)
            assert r.completion_tokens == 6 and c.stats()["kv_transfer"]["handoffs"] == 1

            # Cut the decode host's link in the middle of a long stream.
            stream = c.stream(token_ids=[21, 22, 23], temperature=0, max_tokens=900, ignore_eos=True)
            next(stream)
            net.cut("d")
            t_cut = time.monotonic()
            with pytest.raises(RequestError) as err:
                for _ in stream:
                    pass
            assert time.monotonic() - t_cut < 5.0
            assert err.value.code in ("worker_lost", "no_workers")

            net.restore("d")
            deadline = time.monotonic() + 30
            while "d-decode-0" not in {w["id"] for w in c.stats()["workers"]}:
                assert time.monotonic() < deadline, "decode worker did not rejoin"
                time.sleep(0.3)
            r = c.generate(token_ids=[31, 32, 33], temperature=0, max_tokens=5, ignore_eos=True)
            assert r.completion_tokens == 5
            wait_all_blocks_free(c, timeout=10)
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
