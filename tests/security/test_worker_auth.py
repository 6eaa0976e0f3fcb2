"""Roles are authenticated apart. Without keys, the launcher's per-launch secret (a 0600 file
handed to the coordinator and the workers) is what lets a process register at the worker port:
a Hello without it never gets an answer, one with it is welcomed. With keys, a client keypair is
refused at the worker port while the worker keypair registers (the client port still takes the
client key): tests/security/test_curve.py checks that on its keyed cluster. Each test ends with
the workers' pools whole."""
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from pdserve.wire import security
from pdserve.wire.protocol import PROTOCOL_VERSION, CoordinatorToWorker, Hello, Role, Welcome
from pdserve_client.library import Client
from pdserve_client.protocol import decoder, encode
from tests.gateway.helpers import poll
from tests.helpers import save_tiny_served_model, start_cluster, wait_all_blocks_free


def say_hello(addr: str, options: dict, wid: str, wait_s: float, model: str = "m") -> bool:
    """Connect with options, say Hello as a decode worker of `model` (a worker of another model than
    the registered ones is refused whatever its credentials); True if a Welcome comes within wait_s."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    security.apply(s, options)
    s.connect(addr)
    dec = decoder(CoordinatorToWorker)
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                s.send(encode(Hello(PROTOCOL_VERSION, wid, int(Role.DECODE), 1, "h", "b", model, 16, 1, 16)), zmq.NOBLOCK)
            except zmq.Again:  # no connection has passed the handshake
                pass
            if s.poll(200) and isinstance(dec.decode(s.recv()), Welcome):
                return True
        return False
    finally:
        s.close()


def registered(c: Client) -> set[str]:
    return {w["id"] for w in c.stats()["workers"]}


def end_whole(launcher, ghost: str) -> None:
    with Client(launcher.plan.client_addr, timeout=30) as c:
        poll(lambda: ghost not in registered(c), timeout=15)  # the welcomed ghost stops heartbeating and is dropped
        assert c.generate(token_ids=[5, 6, 7], temperature=0, max_tokens=3, ignore_eos=True).completion_tokens == 3
        assert wait_all_blocks_free(c, timeout=10)["active_requests"] == 0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return d


def test_per_launch_secret_admits_only_its_holders(model, tmp_path):
    launcher = start_cluster(model, tmp_path / "logs", engine_args=["--kv-cache-mb", "8"], worker_secret=True)
    path = launcher.secret_file
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        addr = launcher.plan.worker_addr
        with ThreadPoolExecutor(2) as pool:  # both tries at once: each watches its own socket for a Welcome
            tries = [pool.submit(say_hello, addr, {}, "intruder", 3.0),
                     pool.submit(say_hello, addr, security.worker_options(None, "a guess"), "intruder-guess", 3.0)]
            assert [t.result() for t in tries] == [False, False]
        with Client(launcher.plan.client_addr, timeout=30) as c:
            assert not {"intruder", "intruder-guess"} & registered(c) and len(registered(c)) == 2  # the launch's own workers did register
        assert say_hello(addr, security.worker_options(None, security.read_secret(path)), "holder", 5.0, str(model))
        end_whole(launcher, "holder")
    finally:
        launcher.stop()
    assert not os.path.exists(path)


def test_a_secret_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_text("x")
    os.chmod(path, 0o644)
    with pytest.raises(security.InsecureBindError, match="chmod 600"):
        security.read_secret(str(path))
