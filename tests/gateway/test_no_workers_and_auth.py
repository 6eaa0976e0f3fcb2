"""The gateway of a service with no workers yet (coordinator and gateway only, real processes
on loopback) and an API key: /health/ready says 503 (/health, liveness, 200), requests are 503 `no_workers`, a missing or wrong
bearer key is 401, /health stays open without the key and /metrics wants it
(tests/gateway/test_fairness.py checks the 401)."""
import httpx
import openai
import pytest

from tests.gateway.helpers import scrape, start_gateway_cluster, value
from tests.helpers import save_tiny_served_model

KEY = "test-key-0f3a"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)  # the coordinator and the gateway read only its tokenizer
    return d


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):
    launcher = start_gateway_cluster(model_dir, tmp_path_factory.mktemp("logs"), prefill=0, decode=0, api_key=KEY)
    yield launcher
    launcher.stop()


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir.name


def client(service, key=KEY):
    return openai.OpenAI(base_url=f"{service.plan.http_url}/v1", api_key=key, max_retries=0, timeout=30)


def test_not_ready_without_workers_and_alive(service):
    for path in ("/health/ready", "/v2/health/ready"):  # readiness
        r = httpx.get(f"{service.plan.http_url}{path}", timeout=10)
        assert r.status_code == 503
        assert r.json()["status"] == "unavailable" and "no decode or colocated worker" in r.json()["reason"]
    for path in ("/health", "/v2/health/live"):  # liveness: the gateway answers
        r = httpx.get(f"{service.plan.http_url}{path}", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "unavailable"
    samples, _ = scrape(service.plan.http_url, {"Authorization": f"Bearer {KEY}"})
    assert value(samples, "pdserve_coordinator_up") == 1 and value(samples, "pdserve_num_workers") == 0


def test_requests_are_503_without_workers(service, model):
    with client(service) as c:
        assert [m.id for m in c.models.list().data] == [model]
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as e:
                c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=stream)
            assert e.value.status_code == 503 and e.value.code == "no_workers"
    samples, _ = scrape(service.plan.http_url, {"Authorization": f"Bearer {KEY}"})
    assert value(samples, "pdserve_request_errors_total", error_type="no_workers") == 2


def test_api_key_is_required(service, model):
    with client(service, key="wrong") as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.completions.create(model=model, prompt="hi", max_tokens=1)
        assert e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    r = httpx.post(f"{service.plan.http_url}/v1/completions", json={"model": model, "prompt": "hi"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{service.plan.http_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200


def test_the_launched_gateway_gets_the_key_in_its_environment_not_its_command_line(service):
    """`ps` shows every user a process's arguments: the launcher hands its gateway the key in
    $PDSERVE_API_KEY (its /proc environ is readable by its owner only)."""
    (gateway,) = [proc for name, proc in service.procs if name == "gateway"]
    assert KEY.encode() not in open(f"/proc/{gateway.pid}/cmdline", "rb").read()
    assert f"PDSERVE_API_KEY={KEY}".encode() in open(f"/proc/{gateway.pid}/environ", "rb").read().split(b"\0")


def test_pdserve_launch_takes_the_key_from_the_environment(model_dir, tmp_path):
    """Through the entry point users run: PDSERVE_API_KEY alone (no --api-key) guards /v1, and no
    process of the launch carries the key in its arguments."""
    import os
    import subprocess
    import sys
    import time

    from tests.helpers import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "launch", "--model", str(model_dir), "--prefill", "0", "--decode", "0",
                             "--clients", f"tcp://127.0.0.1:{free_port()}", "--workers", f"tcp://127.0.0.1:{free_port()}",
                             "--http-port", str(port), "--log-dir", str(tmp_path)],
                            env={**os.environ, "PDSERVE_API_KEY": KEY}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url, deadline, r = f"http://127.0.0.1:{port}", time.monotonic() + 60, None
        while time.monotonic() < deadline and r is None:
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text() if (tmp_path / "gateway.log").exists() else "launch exited"
            try:
                r = httpx.get(f"{url}/v1/models", timeout=2)
            except httpx.TransportError:
                time.sleep(0.2)
        assert r is not None and r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
        kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(kids) == 2  # coordinator, gateway
        for pid in [proc.pid, *map(int, kids)]:
            assert KEY.encode() not in open(f"/proc/{pid}/cmdline", "rb").read(), pid
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def test_connections_past_max_connections_are_answered_503_at_once(model_dir, tmp_path):
    """`pdserve launch --max-connections 4`: four connections that stall mid-headers hold the
    gateway's four places; a fifth request is answered 503 at once (not queued, not held), and once
    they close the gateway answers again."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from tests.helpers import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "launch", "--model", str(model_dir), "--prefill", "0", "--decode", "0",
                             "--clients", f"tcp://127.0.0.1:{free_port()}", "--workers", f"tcp://127.0.0.1:{free_port()}",
                             "--http-port", str(port), "--log-dir", str(tmp_path), "--max-connections", "4"],
                            env={**os.environ, "PDSERVE_API_KEY": KEY}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, stalled = f"http://127.0.0.1:{port}", []
    try:
        deadline, r = time.monotonic() + 60, None
        while time.monotonic() < deadline and r is None:
            assert proc.poll() is None, "launch exited"
            try:
                r = httpx.get(f"{url}/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.2)
        assert r is not None and r.status_code in (200, 503)
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never end
            stalled.append(s)
        deadline = time.monotonic() + 10
        while True:  # until the server has taken the four (accepting is asynchronous)
            t0 = time.monotonic()
            over = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
            if over.status_code == 503:
                break
            assert time.monotonic() < deadline, f"never refused past 4 connections: {over.status_code}"
            time.sleep(0.05)
        assert time.monotonic() - t0 < 2.0  # answered at once, not queued
        for s in stalled:
            s.close()
        stalled.clear()
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the gateway did not answer again after the connections closed"
            time.sleep(0.1)
    finally:
        for s in stalled:
            s.close()
        proc.terminate()
        assert proc.wait(timeout=60) == 0
