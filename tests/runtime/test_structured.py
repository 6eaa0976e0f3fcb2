"""Constrained decoding in one engine (runtime/structured.py), tiny random model with the default
tokenizer: rows sharing one SamplingParams object keep their own grammar state; a row that
arrives with tokens already generated (a decode worker taking over) continues from the state
those tokens reach; free rows in the same batch are untouched."""
import re

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.params import SamplingParams, StructuredOutput
from runtime.sampling import SamplingRow, sample
from tests.helpers import save_tiny_served_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return LLMEngine.load(d, EngineConfig(num_blocks=64, block_size=16), progress=False)


def test_rows_sharing_params_keep_their_own_state(engine):
    pattern = r"[0-9]{2}-[a-z]{3}-[0-9]"
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=30, structured=StructuredOutput("regex", pattern))
    prompts = [[10, 20, 30], [40, 50], [60, 70, 80, 90]]
    outs = engine.generate(prompts, params)
    assert all(re.fullmatch(pattern, o.text) for o in outs), [o.text for o in outs]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_row_taken_over_mid_output_continues_from_its_tokens(engine, device):
    """On the GPU too: the mask is filled on the CPU and applied beside the logits."""
    tok = engine.tokenizer
    choices = ("alpha beta", "alpha gamma")
    params = SamplingParams(temperature=0, max_tokens=10, structured=StructuredOutput("choice", choices=choices))
    given = tok.encode("alpha", add_special_tokens=False)
    vocab = engine.cfg.vocab_size
    logits = torch.zeros(2, vocab, device=device)
    logits[:, tok.encode(" delta", add_special_tokens=False)[0]] = 10.0  # what a free row picks
    rows = [SamplingRow(params, [1, 2], list(given)), SamplingRow(SamplingParams(temperature=0), [1, 2], list(given))]
    out = sample(logits, rows, eos_token_id=tok.eos_token_id)
    nxt = tok.decode(given + [out.token_ids[0]])
    assert any(c.startswith(nxt) for c in choices) and len(nxt) > len("alpha"), nxt
    assert out.token_ids[1] == tok.encode(" delta", add_special_tokens=False)[0]  # the free row is unconstrained
