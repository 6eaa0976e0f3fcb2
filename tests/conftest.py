"""Shared pytest set-up: Triton runs in its interpreter on CPU-only machines; `gpu` tests skip
without CUDA; every test gets the `full` marker or not, which makes the suite's two tiers.

The tiers: `scripts/test --fast` runs the tests without `full` (pure and in-process ones: kernels,
runtime, the coordinator's and workers' logic with in-process links; under 5 minutes on 2 cores),
`scripts/test` runs everything (the `full` ones start real processes: `pdserve launch`, the
gateway, fault injection, benchmarks, a fresh install; under 20 minutes). A test module that
starts processes belongs in FULL_FOLDERS or FULL_MODULES below; tests needing something unusual
say so with their own marker (`install`, `multihost`: network namespaces; `ray`), all in the full tier.
`scripts/test` runs the suite two modules at a time (pytest-xdist `--dist loadfile`, with this file's
scheduler: `ModuleScheduling`) and then the `serial` ones (SERIAL_MODULES: timing bounds) alone.
"""
import os
from pathlib import Path

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton runs in its interpreter where there is no GPU; this must precede the first `import triton`.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A pytest-xdist worker (scripts/test runs two) computes on one thread: two workers of two OpenMP
# threads each on 2 cores made an in-process test 4x slower than alone (spinning threads), one each
# fills the cores. The processes a test starts choose their own threads (--threads).
if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("PDSERVE_TEST_THREADS_AS_IS"):
    torch.set_num_threads(1)


TESTS = Path(__file__).resolve().parent
FULL_FOLDERS = {"faults", "serving", "slo", "bench", "security", "install", "gateway"}
FAST_MODULES = {  # pure modules in a full folder
    "gateway/test_schema.py", "gateway/test_tool_parsers.py", "gateway/test_body_budget.py", "security/test_ray_credentials.py",
    "gateway/test_readiness.py",
}
FULL_MODULES = {  # modules that start processes, outside the full folders
    "coordinator/test_tracing.py", "coordinator/test_slow_client.py", "coordinator/test_welcome.py",
    "client/test_distribution.py", "client/test_cancel.py", "runtime/test_tp.py", "kernels/test_isa.py",
    "runtime/test_llamacpp_gguf.py",  # llama.cpp's converter in a child process: ~40 s of CPU
}
UNUSUAL = ("install", "multihost", "ray")
# Modules that run alone (`serial`), after the rest of the suite has run two at a time (scripts/test:
# pytest-xdist, one module per worker): they bound a latency, a gap or a shedding time (a second
# module's processes beside them on 2 cores would be what they measure). The others assert what
# does not depend on the machine's load. The Ray modules (RAY_MODULES) run in the parallel part as
# one unit, one after the other on one worker: a machine holds one Ray cluster at a time.
SERIAL_MODULES = {
    "slo/test_overload.py", "faults/test_hostile.py", "faults/test_no_stall.py", "faults/test_soak.py", "faults/test_multihost.py",
    "coordinator/test_slow_client.py", "gateway/test_cheap_health_and_slow_reader.py", "gateway/test_loop_gaps.py",
    "gateway/test_fairness.py", "gateway/test_body_bounds_http.py", "serving/test_paths.py", "serving/test_autoscaler.py",
    "serving/test_role_change.py",
    "gateway/test_openapi_fuzz.py",  # its last test checks what its schemathesis cases fuzzed in this process (one worker's collection differs)
}


def in_full_tier(item) -> bool:
    rel = Path(str(item.fspath)).resolve().relative_to(TESTS)
    if any(m in item.keywords for m in UNUSUAL):
        return True
    return rel.as_posix() in FULL_MODULES or (rel.parts[0] in FULL_FOLDERS and rel.as_posix() not in FAST_MODULES)


RAY_MODULES = {"faults/test_ray_launch.py", "security/test_ray_private_cluster.py"}  # every module with `ray` tests


def runs_alone(item) -> bool:
    return Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix() in SERIAL_MODULES


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()
        if "ray" in item.keywords and rel not in RAY_MODULES:
            raise pytest.UsageError(f"{rel} has Ray tests: add it to tests/conftest.py RAY_MODULES (they run one at a time)")
        if in_full_tier(item):
            item.add_marker(pytest.mark.full)
        if runs_alone(item):
            item.add_marker(pytest.mark.serial)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` as scripts/test runs it: a module's tests on one worker (its module-scoped
    service started once), the Ray modules together as one unit, and the units handed out longest
    first as far as a path tells (the Ray unit, then the modules that start processes, then the
    rest by their number of tests): xdist's own order, most tests first, left the few long process
    tests for the end, one worker running them while the other idled."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if path.removeprefix("tests/") in RAY_MODULES else path

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed and self.registered_collections:
                # xdist fills its work queue in collection order; keys put in first keep their place
                # (the tests' indexes stay each worker's own collection's)
                ids = next(iter(self.registered_collections.values()))
                count: dict[str, int] = {}
                for nodeid in ids:
                    scope = self._split_scope(nodeid)
                    count[scope] = count.get(scope, 0) + 1
                for scope in sorted(count, key=lambda s: (self._cost_rank(s), -count[s])):
                    self.workqueue[scope] = {}
                self.config.option.loadscopereorder = False
            super().schedule()

        def _cost_rank(self, scope: str) -> int:
            if scope == "ray":
                return 0
            rel = Path(scope.removeprefix("tests/"))
            full = rel.as_posix() in FULL_MODULES or (rel.parts[0] in FULL_FOLDERS and rel.as_posix() not in FAST_MODULES)
            return 1 if full else 2

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny random Llama checkpoint on disk (tests.helpers.save_tiny_model, 128 positions)."""
    from tests.helpers import save_tiny_model

    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model(d, max_position_embeddings=128)
    return d


@pytest.fixture
def own_shm_dir(monkeypatch):
    """$PDSERVE_SHM_DIR: a directory of this test's own on the shared-memory filesystem (the
    processes it starts inherit it), so no other test's worker sweeps or shares its pools and host
    KV tiers meanwhile."""
    import shutil
    import tempfile

    from pdserve.common.shm import SHM_DIR, SHM_DIR_ENV

    d = tempfile.mkdtemp(prefix="pdserve-test-", dir=SHM_DIR)
    monkeypatch.setenv(SHM_DIR_ENV, d)
    yield d
    shutil.rmtree(d, ignore_errors=True)
