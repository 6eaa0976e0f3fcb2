"""Fixtures the fault tests share for the session: the served tiny model that tests/faults/test_worker_death.py
and tests/faults/test_supervised_launch.py kill workers of, and its single-process greedy tokens for their
eight streams (computed once, at the longer of the two lengths: a shorter run's tokens are a prefix)."""
import pytest

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.params import SamplingParams
from tests.helpers import save_tiny_served_model, stream_prompts

KILL_MAX_TOKENS = 400  # the longest streams these tests run


@pytest.fixture(scope="session")
def kill_model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served-kill")
    save_tiny_served_model(d, hidden_size=128, intermediate_size=256, num_hidden_layers=4)
    return d


@pytest.fixture(scope="session")
def kill_expected(kill_model_dir) -> list[list[int]]:
    """Greedy tokens of stream_prompts(8), KILL_MAX_TOKENS each (ignore_eos): slice for fewer."""
    eng = LLMEngine.load(str(kill_model_dir), EngineConfig(num_blocks=1024), progress=False, tokenizer=False)
    params = SamplingParams(temperature=0, max_tokens=KILL_MAX_TOKENS, ignore_eos=True)
    return [c.token_ids for c in eng.generate(stream_prompts(8), params)]
