"""Fixtures the gateway tests share: `kind_service`, a launched service with the HTTP gateway on a
tiny random model (the default model's tokenizer, 1024 positions, 32 MiB of KV, no SLO control),
once on a (prefill, decode) pair and once on a colocated worker (its `kind`). tests/gateway/test_scoring.py
and tests/gateway/test_responses.py both run on it: one launch of each kind for the two modules.

Lifecycle: session-scoped, so pytest runs the tests of each kind together across both modules; the
hook below stops a kind's service after the last test that uses it (not at the session's end: an
idle service would otherwise sit beside every later test)."""
import pytest

from tests.helpers import free_port, save_tiny_served_model, start_cluster

SHARED = "kind_service"


@pytest.fixture(scope="session")
def served_1024(tmp_path_factory):
    d = tmp_path_factory.mktemp("served-1024")
    save_tiny_served_model(d, max_position_embeddings=1024)
    return d


@pytest.fixture(scope="session", params=["disaggregated", "colocated"])
def kind_service(request, served_1024, tmp_path_factory):
    counts = dict(prefill=0, decode=0, colocated=1) if request.param == "colocated" else dict(prefill=1, decode=1)
    launcher = start_cluster(served_1024, tmp_path_factory.mktemp("logs"), gateway=True, http_port=free_port(),
                             engine_args=["--kv-cache-mb", "32"], coordinator_args=["--no-slo"], **counts)
    launcher.kind = request.param
    yield launcher
    launcher.stop()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared service once the next test does not use it (pytest starts it again if a later one does)."""
    defs = item._fixtureinfo.name2fixturedefs.get(SHARED)
    if defs and (nextitem is None or SHARED not in getattr(nextitem, "fixturenames", ())):
        defs[-1].finish(item._request)
