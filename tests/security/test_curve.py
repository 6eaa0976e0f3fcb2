"""Security of the ZeroMQ sockets: binding beyond loopback needs CurveZMQ keys (or an explicit
--insecure); with keys, a client or worker without the right key can neither submit nor
register, while holders of the keys work as usual."""
import subprocess
import sys
import time

import pytest

from pdserve_client.library import Client, CoordinatorUnreachable, RequestTimeout
from pdserve_client.keys import InsecureBindError
from wire.security import check_bind, is_loopback, keygen
from tests.helpers import free_port, save_tiny_served_model, start_cluster


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
    with Client(launcher.plan.client_addr, timeout=3) as c:  # no keys at all
        with pytest.raises((RequestTimeout, CoordinatorUnreachable)):
            c.generate(token_ids=[1, 2, 3], max_tokens=2)
    wrong = keygen(str(root / "wrong-client"))
    with Client(launcher.plan.client_addr, keys=str(wrong), timeout=3) as c:  # keys of another cluster
        with pytest.raises((RequestTimeout, CoordinatorUnreachable)):
            c.generate(token_ids=[1, 2, 3], max_tokens=2)


def test_worker_without_the_right_key_cannot_register(secured):
    launcher, keys, model, root = secured
    wrong = keygen(str(root / "wrong-worker"))
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "decode", "--coordinator", launcher.plan.worker_addr, "--model", str(model),
                             "--worker-id", "intruder", "--kv-cache-mb", "8", "--threads", "1", "--keys", str(wrong)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Client(launcher.plan.client_addr, keys=str(keys), timeout=10) as c:
            deadline = time.monotonic() + 12  # the worker loads in a few seconds, then says Hello every 0.2 s
            while time.monotonic() < deadline:
                assert proc.poll() is None
                assert "intruder" not in {w["id"] for w in c.stats()["workers"]}
                time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(10)
