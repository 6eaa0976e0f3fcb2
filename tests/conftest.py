"""Shared pytest set-up: Triton runs in its interpreter on CPU-only machines; `gpu` tests skip without CUDA."""
import os

# Must precede the first `import triton` anywhere in the test process.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
