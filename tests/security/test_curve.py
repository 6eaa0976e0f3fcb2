"""Security of the ZeroMQ sockets: binding beyond loopback needs CurveZMQ keys (or an explicit
--insecure); with keys, a client or worker without the right key can neither submit nor
register, while holders of the keys work as usual; at the worker port, a client keypair is refused
and the worker keypair registers (the keyed half of tests/security/test_worker_auth.py, here to
share this module's keyed cluster)."""
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.wire import security
from pdserve.wire.liveness import LIVENESS_ENV
from pdserve.wire.security import check_bind, is_loopback, keygen
from pdserve_client.keys import InsecureBindError
from pdserve_client.library import Client, CoordinatorUnreachable, RequestTimeout
from tests.gateway.helpers import poll
from tests.helpers import free_port, save_tiny_served_model, start_cluster, wait_all_blocks_free
from tests.security.test_worker_auth import registered, say_hello


def test_loopback_rule():
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://[::1]:1") and is_loopback("tcp://localhost:2")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5") and not is_loopback("tcp://10.1.2.3:5")
    check_bind("tcp://127.0.0.1:5", None, False)
    check_bind("tcp://0.0.0.0:5", None, True)
    with pytest.raises(InsecureBindError, match="pdserve keygen"):
        check_bind("tcp://0.0.0.0:5", None, False)


def test_coordinator_refuses_exposed_bind_without_keys(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pdserve", "coordinator", "--clients", f"tcp://0.0.0.0:{free_port()}",
                          "--workers", f"tcp://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "without CurveZMQ keys" in out.stderr and "--insecure" in out.stderr


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("sec")
    model = root / "model"
    save_tiny_served_model(model)
    keys = keygen(str(root / "keys"))
    launcher = start_cluster(model, root / "logs", keys=keys, engine_args=["--kv-cache-mb", "8"])
    yield launcher, keys, model, root
    launcher.stop()


def test_holders_of_the_keys_work(secured):
    launcher, keys, _, _ = secured
    with Client(launcher.plan.client_addr, keys=str(keys), timeout=30) as c:
        r = c.generate(token_ids=[5, 6, 7, 8], temperature=0, max_tokens=4, ignore_eos=True)
        assert r.completion_tokens == 4
        assert len(c.stats()["workers"]) == 2


def test_client_without_the_right_key_cannot_submit(secured):
    launcher, _, _, root = secured
    wrong = keygen(str(root / "wrong-client"))

    def refused(keys) -> bool:
        with Client(launcher.plan.client_addr, keys=keys, timeout=3) as c:
            with pytest.raises((RequestTimeout, CoordinatorUnreachable)):
                c.generate(token_ids=[1, 2, 3], max_tokens=2)
        return True

    with ThreadPoolExecutor(2) as pool:  # no keys at all, and the keys of another cluster: both waits at once
        assert all(pool.map(refused, [None, str(wrong)]))


def test_worker_without_the_right_key_cannot_register(secured, tmp_path):
    launcher, keys, model, root = secured
    wrong = keygen(str(root / "wrong-worker"))
    alive = tmp_path / "intruder.alive"  # its loop touches this once it runs: its link says Hello from then on
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "decode", "--coordinator", launcher.plan.worker_addr, "--model", str(model),
                             "--worker-id", "intruder", "--kv-cache-mb", "8", "--threads", "1", "--keys", str(wrong)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, LIVENESS_ENV: str(alive)})
    try:
        with Client(launcher.plan.client_addr, keys=str(keys), timeout=10) as c:
            deadline = time.monotonic() + 120
            while not alive.exists():  # loading
                assert proc.poll() is None and time.monotonic() < deadline, "the intruder's loop never ran"
                time.sleep(0.05)
            watch = time.monotonic() + 3  # 15 Hellos (one every 0.2 s): a welcome would show at once
            while time.monotonic() < watch:
                assert proc.poll() is None
                assert "intruder" not in {w["id"] for w in c.stats()["workers"]}
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(10)


def test_client_key_is_refused_at_the_worker_port(secured):
    """A client keypair is refused at the worker port; the worker keypair registers there (the
    workers' side of tests/security/test_worker_auth.py, on this module's keyed cluster)."""
    launcher, keys, model, _ = secured
    addr = launcher.plan.worker_addr
    assert not say_hello(addr, security.client_options(str(keys)), "client-as-worker", 3.0)
    with Client(launcher.plan.client_addr, keys=str(keys), timeout=30) as c:
        assert "client-as-worker" not in registered(c)
    assert say_hello(addr, security.worker_options(str(keys)), "keyed-worker", 5.0, str(model))
    with Client(launcher.plan.client_addr, keys=str(keys), timeout=30) as c:
        poll(lambda: "keyed-worker" not in registered(c), timeout=15)
        assert c.generate(token_ids=[5, 6, 7], temperature=0, max_tokens=3, ignore_eos=True).completion_tokens == 3
        assert wait_all_blocks_free(c, timeout=10)["active_requests"] == 0
