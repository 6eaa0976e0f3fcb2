"""The gateway shares its in-flight slots fairly and bounds what a client may ask of the scheduler.
A launched service (coordinator, gateway, one prefill and one decode worker; real processes on
loopback) with `--max-inflight 8` at the gateway and `--max-client-requests 8` at the
coordinator: one streaming body with n=8 holds at most half the slots (its other choices start
as earlier ones end, and all 8 complete), so three other callers are served meanwhile, not 429.
`priority` in the HTTP body is used and bounded by `--max-client-priority`; a client's own
ttft_ms outside `--client-target-range` is refused; /metrics wants the API key, /health does not.
Each test ends with the pools whole."""
import concurrent.futures
import json

import httpx
import pytest

from pdserve_client.library import Client, InvalidRequest
from tests.helpers import free_port, save_tiny_served_model, start_cluster, wait_all_blocks_free

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=1024)
    launcher = start_cluster(d, tmp_path_factory.mktemp("logs"), engine_args=["--kv-cache-mb", "16"],
                             coordinator_args=["--no-slo", "--max-client-requests", "8", "--max-client-priority", "1"],
                             gateway=True, http_port=free_port(), api_key=KEY,
                             gateway_args=["--max-inflight", "8", "--max-client-priority", "1"])
    yield launcher, d.name
    launcher.stop()


def post(url, body, **kw):
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60, **kw)


def whole(launcher):
    with Client(launcher.plan.client_addr, timeout=30) as c:
        assert wait_all_blocks_free(c, timeout=15)["active_requests"] == 0


def test_one_body_cannot_take_every_slot(service):
    launcher, model = service
    url = launcher.plan.http_url
    big = {"model": model, "prompt": "Once upon a time", "n": 8, "max_tokens": 150, "temperature": 0, "ignore_eos": True, "stream": True}
    finish = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=big, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        with Client(launcher.plan.client_addr, timeout=30) as c:
            assert c.stats()["active_requests"] <= 4  # the big body holds at most 8 // (1 + 1) slots
        small = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            others = list(pool.map(lambda _: post(url, small), range(3)))
        assert [o.status_code for o in others] == [200] * 3, [o.text[:200] for o in others]
        for line in lines:
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    if ch["finish_reason"]:
                        finish[ch["index"]] = ch["finish_reason"]
    assert finish == {i: "length" for i in range(8)}  # every choice ran, the later ones as slots came back
    whole(launcher)


def test_priority_and_own_targets_are_bounded(service):
    launcher, model = service
    url = launcher.plan.http_url
    body = {"model": model, "prompt": "Hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    r = post(url, {**body, "priority": 2})
    assert r.status_code == 400 and "--max-client-priority" in r.json()["error"]["message"]
    assert post(url, {**body, "priority": 1}).status_code == 200
    with Client(launcher.plan.client_addr, timeout=30) as c:
        with pytest.raises(InvalidRequest, match="priority 5"):
            c.generate(prompt="Hi", max_tokens=2, priority=5)
        with pytest.raises(InvalidRequest, match="client-target-range"):
            c.generate(prompt="Hi", max_tokens=2, ttft_ms=1.0)  # would jump every queue
        with pytest.raises(InvalidRequest, match="client-target-range"):
            c.generate(prompt="Hi", max_tokens=2, tpot_ms=1e9)  # would skip shedding
    whole(launcher)


def test_metrics_want_the_key_and_health_does_not(service):
    launcher, _ = service
    url = launcher.plan.http_url
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    whole(launcher)
