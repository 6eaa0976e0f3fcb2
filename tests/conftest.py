"""Shared pytest set-up: Triton runs in its interpreter on CPU-only machines; `gpu` tests skip
without CUDA; every test gets the `full` marker or not, which makes the suite's two tiers.

The tiers: `scripts/test --fast` runs the tests without `full` (pure and in-process ones: kernels,
runtime, the coordinator's and workers' logic with in-process links; under 5 minutes on 2 cores),
`scripts/test` runs everything (the `full` ones start real processes: `pdserve launch`, the
gateway, fault injection, benchmarks, a fresh install; under 20 minutes). A test module that
starts processes belongs in FULL_FOLDERS or FULL_MODULES below; tests needing something unusual
say so with their own marker (`install`, `multihost`: network namespaces; `ray`), all in the full tier.
"""
import os
from pathlib import Path

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton runs in its interpreter where there is no GPU; this must precede the first `import triton`.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


TESTS = Path(__file__).resolve().parent
FULL_FOLDERS = {"faults", "serving", "slo", "bench", "security", "install", "gateway"}
FAST_MODULES = {  # pure modules in a full folder
    "gateway/test_schema.py", "gateway/test_tool_parsers.py", "gateway/test_body_budget.py", "security/test_ray_credentials.py",
}
FULL_MODULES = {  # modules that start processes, outside the full folders
    "coordinator/test_tracing.py", "coordinator/test_slow_client.py", "coordinator/test_welcome.py",
    "client/test_distribution.py", "client/test_cancel.py", "runtime/test_tp.py", "kernels/test_isa.py",
    "runtime/test_llamacpp_gguf.py",  # llama.cpp's converter in a child process: ~40 s of CPU
}
UNUSUAL = ("install", "multihost", "ray")


def in_full_tier(item) -> bool:
    rel = Path(str(item.fspath)).resolve().relative_to(TESTS)
    if any(m in item.keywords for m in UNUSUAL):
        return True
    return rel.as_posix() in FULL_MODULES or (rel.parts[0] in FULL_FOLDERS and rel.as_posix() not in FAST_MODULES)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if in_full_tier(item):
            item.add_marker(pytest.mark.full)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny random Llama checkpoint on disk (tests.helpers.save_tiny_model, 128 positions)."""
    from tests.helpers import save_tiny_model

    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model(d, max_position_embeddings=128)
    return d
