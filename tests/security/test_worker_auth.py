"""Roles are authenticated apart. Without --keys, the keys a launch makes for itself (a 0700
directory in this user's run directory, wire/security.py) are what let a process register at the
worker port or send a request to the client port: a Hello in clear or under a keypair of its own
never gets an answer, the client keypair cannot register a worker, the launch's worker keypair is
welcomed, and only the worker keys drain a worker (a client key's DrainWorker is a bad
message); the same user's Client finds the keys by the port, a client in clear is never answered,
and an impostor bound on the port never sees a request. With the operator's keys the same rules
hold (tests/security/test_curve.py, on its keyed cluster). Each launch test ends with the
workers' pools whole."""
import os
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from pdserve.launcher_link import LauncherLink
from pdserve.wire import security
from pdserve.wire.protocol import PROTOCOL_VERSION, CoordinatorToWorker, DrainWorker, Hello, Role, Welcome
from pdserve_client.keys import launch_keys_for, run_dir
from pdserve_client.library import Client, CoordinatorUnreachable, RequestTimeout
from pdserve_client.protocol import CoordinatorToClient, ErrorReply, decoder, encode
from tests.gateway.helpers import poll
from tests.helpers import free_port, save_tiny_served_model, start_cluster, wait_all_blocks_free


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


def draining(c: Client, wid: str):
    return next(w["draining"] for w in c.stats()["workers"] if w["id"] == wid)


def only_worker_keys_drain(launcher, keys: str, wid: str) -> None:
    """A DrainWorker under the client keys (any application's) is a bad message on the client port and drains
    nothing; the launcher's, on the worker port under the worker keys (pdserve/launcher_link.py), drains wid."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    security.apply(s, security.client_options(keys))
    s.connect(launcher.plan.client_addr)
    try:
        s.send(encode(DrainWorker(wid)))
        assert s.poll(10_000), "no answer to a client's DrainWorker"
        reply = decoder(CoordinatorToClient).decode(s.recv())
        assert isinstance(reply, ErrorReply) and reply.code == "bad_message", reply
    finally:
        s.close()
    with Client(launcher.plan.client_addr, timeout=30) as c:
        assert draining(c, wid) is None
        link = LauncherLink(launcher.plan.client_addr, launcher.plan.worker_addr, keys)
        try:
            poll(lambda: link.drain_worker(wid) and draining(c, wid) is not None, timeout=10)
        finally:
            link.close()


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


def test_a_launch_makes_its_own_keys_and_admits_only_their_holders(model, tmp_path):
    launcher = start_cluster(model, tmp_path / "logs", engine_args=["--kv-cache-mb", "8"], launch_keys=True)
    keys = launcher.own_keys
    try:
        assert stat.S_IMODE(os.stat(keys).st_mode) == 0o700 and stat.S_IMODE(os.stat(os.path.join(keys, "client.key_secret")).st_mode) == 0o600
        assert os.path.exists(os.path.join(keys, security.LOOPBACK_ONLY))
        assert launch_keys_for(launcher.plan.client_addr) == keys  # what this user's clients find
        stranger = security.keygen(str(tmp_path / "stranger"))  # a keypair of its own, with the launch's server key
        stranger_options = {**security.worker_options(str(stranger)), zmq.CURVE_SERVERKEY: security.keypair(keys, security.SERVER)[0]}
        addr = launcher.plan.worker_addr
        with ThreadPoolExecutor(3) as pool:  # the tries at once: each watches its own socket for a Welcome
            tries = [pool.submit(say_hello, addr, {}, "intruder", 3.0),
                     pool.submit(say_hello, addr, stranger_options, "intruder-key", 3.0),
                     pool.submit(say_hello, addr, security.client_options(keys), "intruder-client-key", 3.0)]
            assert [t.result() for t in tries] == [False, False, False]
        with Client(launcher.plan.client_addr, timeout=2, curve={}) as plain:  # a local process in clear: never answered
            with pytest.raises((CoordinatorUnreachable, RequestTimeout)):
                plain.stats()
        with Client(launcher.plan.client_addr, timeout=30) as c:  # this user's client: the launch's keys, found by the port
            assert not {"intruder", "intruder-key", "intruder-client-key"} & registered(c) and len(registered(c)) == 2
        assert say_hello(addr, security.worker_options(keys), "holder", 5.0, str(model))
        only_worker_keys_drain(launcher, keys, "holder")
        end_whole(launcher, "holder")
    finally:
        launcher.stop()
    assert not os.path.exists(keys) and launch_keys_for(launcher.plan.client_addr) is None


def test_an_impostor_on_the_client_port_sees_no_request(tmp_path):
    """A process that binds the coordinator's port while it restarts (plain, or CURVE with a keypair
    of its own) never receives a client's request: the client wants the launch's server key."""
    port = free_port()
    keys = security.write_launch_keys([f"tcp://127.0.0.1:{port}"])
    try:
        impostor_keys = str(security.keygen(str(tmp_path / "impostor")))
        for options in ({}, security.server_options(impostor_keys)):
            ctx = zmq.Context()
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            security.apply(router, {k: v for k, v in options.items() if k != zmq.ZAP_DOMAIN})
            router.bind(f"tcp://127.0.0.1:{port}")
            try:
                with Client(f"tcp://127.0.0.1:{port}", timeout=1.5) as c:
                    with pytest.raises((CoordinatorUnreachable, RequestTimeout)):
                        c.stats()
                assert not router.poll(500)
            finally:
                ctx.destroy(linger=0)
    finally:
        security.remove_launch_keys(keys)


def test_launch_keys_bind_loopback_only_and_a_dead_launchs_are_swept(tmp_path):
    keys = security.write_launch_keys(["tcp://127.0.0.1:1"])
    try:
        security.check_bind("tcp://127.0.0.1:5", keys, insecure=False)
        with pytest.raises(security.InsecureBindError):
            security.check_bind("tcp://0.0.0.0:5", keys, insecure=False)  # its keys never leave the machine
        operators = str(security.keygen(str(tmp_path / "ops")))
        security.check_bind("tcp://0.0.0.0:5", operators, insecure=False)
    finally:
        security.remove_launch_keys(keys)
    assert not os.path.lexists(run_dir() / "coordinator-1")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = run_dir() / f"launch-{dead.stdout.strip()}"  # a launch killed with SIGKILL left its keys
    security.keygen(str(stale))
    os.symlink(stale.name, run_dir() / "coordinator-2")
    assert launch_keys_for("tcp://127.0.0.1:2") is None  # a client never uses a dead launch's keys
    security.sweep_launch_keys()
    assert not stale.exists() and not os.path.lexists(run_dir() / "coordinator-2")


def test_a_run_directory_others_can_open_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "pdserve").mkdir(mode=0o755)
    os.chmod(tmp_path / "pdserve", 0o755)
    with pytest.raises(PermissionError, match="chmod 700"):
        run_dir()
    assert launch_keys_for("tcp://127.0.0.1:5555") is None  # a client falls back to no keys (and is refused by a keyed port)


def test_a_client_made_before_its_launch_finds_the_launchs_keys():
    """A Client of a loopback port made before the launch wrote its keys (a script that starts the
    launch, then waits on stats) looks again before each request and then speaks CURVE."""
    port = free_port()
    c = Client(f"tcp://127.0.0.1:{port}", timeout=1)
    keys = security.write_launch_keys([f"tcp://127.0.0.1:{port}"])
    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        security.apply(server, {k: v for k, v in security.server_options(keys).items() if k != zmq.ZAP_DOMAIN})
        server.bind(f"tcp://127.0.0.1:{port}")
        with pytest.raises(RequestTimeout):  # nobody answers: the server only reads
            c.stats(timeout=0.5)
        assert server.poll(3000), "the request did not arrive under the launch's keys"
        assert c.endpoint.keys == keys
    finally:
        c.close()
        ctx.destroy(linger=0)
        security.remove_launch_keys(keys)
