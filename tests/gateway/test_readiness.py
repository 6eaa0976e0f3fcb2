"""The gateway's readiness rule on the coordinator's stats (gateway/server.py `readiness`, what
/health/ready and /v2/health/ready answer) and the HTTP bind rule (no bind beyond loopback
without an API key), as pure functions; tests/serving/test_readiness_launch.py watches them
through a real `pdserve launch`."""
import pytest

from pdserve.gateway.config import GatewayConfig, check_http_bind
from pdserve.gateway.server import readiness
from pdserve_client.keys import InsecureBindError


def stats(*roles: str, awaiting=(), cold_start_s=0.0) -> dict:
    return {"workers": [{"role": r} for r in roles], "startup": {"expected": 3, "awaiting": list(awaiting)}, "cold_start_s": cold_start_s}


def test_not_ready_before_every_worker_of_the_launch_registered_then_by_roles():
    h = readiness(stats("decode", "prefill", awaiting=["local-decode-1"]))
    assert h.status == "unavailable" and "local-decode-1" in h.reason and h.workers == {"decode": 1, "prefill": 1}
    assert readiness(stats("decode", "decode", "prefill")).status == "ready"
    assert readiness(stats("decode")).status == "ready"  # after the start: a decode worker prefills locally
    assert readiness(stats("colocated")).status == "ready"
    h = readiness(stats("prefill"))
    assert h.status == "unavailable" and "no decode or colocated worker" in h.reason
    assert readiness(stats(cold_start_s=7.5)).status == "ready"  # at zero with cold starts on: a request brings a worker
    assert readiness(stats(awaiting=["x"], cold_start_s=7.5)).status == "unavailable"
    assert readiness(None).status == "unavailable"
    assert readiness({"workers": [{"role": "decode"}]}).status == "ready"  # a coordinator that says nothing of its start


def test_no_http_bind_beyond_loopback_without_an_api_key():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_http_bind(host, None)
    check_http_bind("0.0.0.0", "k")
    for host in ("0.0.0.0", "::", "10.0.0.5", "pod.example"):
        with pytest.raises(InsecureBindError, match="PDSERVE_API_KEY"):
            check_http_bind(host, None)
    with pytest.raises(InsecureBindError):
        GatewayConfig(host="0.0.0.0")
    assert GatewayConfig(host="0.0.0.0", api_key="k").host == "0.0.0.0"
