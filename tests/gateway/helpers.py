"""Gateway test helpers: a cluster with the HTTP gateway started by the Launcher, Prometheus
scrapes as {(sample name, labels): value}, and polling with a deadline."""
from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import free_port, start_cluster


def start_gateway_cluster(model_dir, log_dir, prefill=1, decode=1, engine_args=(), coordinator_args=(), api_key=None,
                          timeout=120.0):
    """Coordinator, gateway and workers as real processes on loopback; returns once the
    workers are registered and the gateway answers /health."""
    return start_cluster(model_dir, log_dir, prefill=prefill, decode=decode, engine_args=engine_args,
                         coordinator_args=coordinator_args, timeout=timeout, gateway=True, http_port=free_port(), api_key=api_key)


def scrape(url: str, headers: dict | None = None) -> tuple[dict, dict]:
    """GET /metrics, parsed by prometheus_client: ({(sample, sorted label items): value}, {family: type})."""
    r = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples, types = {}, {}
    for fam in text_string_to_metric_families(r.text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def value(samples: dict, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def poll(check, timeout: float = 5.0, every: float = 0.05):
    """Call check() until it returns a true value; fail with its last value after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met in {timeout}s (last: {got!r})")
        time.sleep(every)
