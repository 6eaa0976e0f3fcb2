"""Gateway test helpers: a cluster with the HTTP gateway started by the Launcher, Prometheus
scrapes as {(sample name, labels): value}, the rules `promtool check metrics` holds an exposition
to (checked here without it, and by it when it is on PATH), and polling with a deadline."""
from __future__ import annotations

import re
import shutil
import subprocess
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


SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}  # sample names beside the family's


def exposition_problems(text: str) -> list[str]:
    """What promtool's lint refuses in a text exposition, checked without promtool: a colon in a
    name (kept for recording rules), a `_created` series, a sample whose family has no HELP or
    TYPE, a counter not named `_total`, a `quantile` label off a summary or an `le` off a histogram."""
    problems, helps, types = [], set(), {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helps.add(line.split(" ", 3)[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            name = SAMPLE_NAME.match(line).group(0)
            family = next((name[:-len(x)] for t, xs in SUFFIXES.items() for x in xs
                           if name.endswith(x) and types.get(name[:-len(x)]) == t), name)
            problems += [f"{name}: {why}" for why, bad in (
                ("metric names should not contain ':'", ":" in name), ("a _created series", name.endswith("_created")),
                ("no HELP for its family", family not in helps), ("no TYPE for its family", family not in types),
                ("counter not named _total", types.get(family) == "counter" and not family.endswith("_total"))) if bad]
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "quantile" in s.labels and fam.type != "summary":
                problems.append(f"{s.name}: non-summary metrics should not have a quantile label")
            if "le" in s.labels and fam.type != "histogram":
                problems.append(f"{s.name}: non-histogram metrics should not have an le label")
    return sorted(set(problems))


def promtool_check(text: str) -> tuple[int, str]:
    """`promtool check metrics` over an exposition: (its exit status, what it printed)."""
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is not on PATH"
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


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
