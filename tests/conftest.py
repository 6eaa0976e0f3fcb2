"""Shared pytest set-up: Triton runs in its interpreter on CPU-only machines; `gpu` tests skip without CUDA."""
import os

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton runs in its interpreter where there is no GPU; this must precede the first `import triton`.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
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
