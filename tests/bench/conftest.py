"""One tiny served model (random Llama + the default tokenizer) for every benchmark test."""
import pytest

from tests.helpers import save_tiny_served_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return d
