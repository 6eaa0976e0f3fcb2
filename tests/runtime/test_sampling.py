"""Tests of runtime.sampling: parameter validation, the batched sampler against its one-row reference,
seed determinism, the filters' limits, the empirical distribution, penalties, min_tokens and logprobs."""
import math

import msgspec
import pytest
import torch

from pdserve.runtime.sampling import SamplingRow, adjusted_logits, sample, sample_reference
from pdserve_client.errors import InvalidSamplingParams
from pdserve_client.params import SamplingParams

VOCAB = 256


def _logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=generator) * 3


def _row(prompt=(1, 2, 3), output=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output))


# --- validate ---------------------------------------------------------------------------------

INVALID = [
    ("max_tokens", 0),
    ("temperature", -0.1),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_k", -2),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("logprobs", -1),
    ("logprobs", 21),
    ("min_tokens", -1),
    ("min_tokens", 17),  # > max_tokens = 16
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("stop", ["ok", ""]),
    ("stop_token_ids", [-1]),
    ("cache_salt", ""),
    ("cache_salt", "x" * 257),
    ("cache_salt", 5),
]


@pytest.mark.parametrize("field,value", INVALID)
def test_validate_rejects_invalid_value_naming_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidSamplingParams) as info:
        params.validate()
    assert field in str(info.value)


def test_validate_accepts_defaults_and_edges():
    SamplingParams().validate()
    edges = dict(
        temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
        repetition_penalty=0.5, logprobs=20, min_tokens=16, seed=2**64 - 1, stop=["\n"], stop_token_ids=[0],
    )
    SamplingParams(**edges).validate()
    SamplingParams(top_k=-1, seed=-(2**63), logprobs=0).validate()
    SamplingParams(cache_salt="x" * 256).validate()
    SamplingParams(cache_salt="\u00e9").validate()


def test_params_travel_on_the_wire_with_defaults_omitted():
    params = SamplingParams(temperature=0.0, stop=["x"])
    wire = msgspec.json.encode(params)
    assert msgspec.json.decode(wire) == {"temperature": 0.0, "stop": ["x"]}
    assert msgspec.json.decode(wire, type=SamplingParams) == params
    assert SamplingParams().stop is not SamplingParams().stop  # no shared mutable default


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams().greedy


# --- greedy and the fast path against the reference ----------------------------------------------


def test_greedy_is_argmax():
    logits = _logits(8)
    rows = [_row(temperature=0.0) for _ in range(8)]
    out = sample(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8 and out.top_logprobs == [None] * 8


def _mixed_rows(generator: torch.Generator) -> list[SamplingRow]:
    """Greedy and seeded rows covering every stage, singly and combined."""
    variants = [
        dict(temperature=0.0),
        dict(temperature=0.0, repetition_penalty=1.3, logprobs=3),
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=5),
        dict(top_p=0.8),
        dict(temperature=0.9, min_p=0.1),
        dict(top_k=20, top_p=0.9, min_p=0.05, logprobs=5),
        dict(frequency_penalty=0.7, presence_penalty=-0.4),
        dict(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=1.5, top_p=0.95),
        dict(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0, logprobs=0),
        dict(min_tokens=50, stop_token_ids=[7, 8], temperature=0.5, logprobs=20),
        dict(min_tokens=50, temperature=0.0),
        dict(top_k=VOCAB + 10, top_p=1.0),
    ]
    rows = []
    for n in range(40):
        params = dict(variants[n % len(variants)])
        if not SamplingParams(**params).greedy:
            params["seed"] = int(torch.randint(0, 2**62, (1,), generator=generator))
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 30, (1,), generator=generator)),), generator=generator)
        output = torch.randint(0, VOCAB, (int(torch.randint(0, 30, (1,), generator=generator)),), generator=generator)
        rows.append(SamplingRow(SamplingParams(**params), prompt.tolist(), output.tolist()))
    return rows


def _assert_same(fast, slow, rows):
    assert fast.token_ids == slow.token_ids
    for row, a, b, top_a, top_b in zip(rows, fast.logprobs, slow.logprobs, fast.top_logprobs, slow.top_logprobs):
        if row.params.logprobs is None:
            assert a is None and b is None and top_a is None and top_b is None
            continue
        assert a == pytest.approx(b, abs=1e-5)
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert [v for _, v in top_a] == pytest.approx([v for _, v in top_b], abs=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_batched_sample_equals_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    rows = _mixed_rows(generator)
    logits = _logits(len(rows), seed=seed)
    before = logits.clone()
    fast = sample(logits, rows, eos_token_id=3)
    slow = sample_reference(logits, rows, eos_token_id=3)
    assert torch.equal(logits, before)  # the caller's logits are not modified
    _assert_same(fast, slow, rows)


def test_reference_agrees_on_unseeded_greedy_rows_in_a_mixed_batch():
    rows = [_row(temperature=0.0), _row(), _row(temperature=0.0, top_k=3), _row(top_p=0.5)]
    logits = _logits(4)
    fast, slow = sample(logits, rows), sample_reference(logits, rows)
    assert fast.token_ids[0] == slow.token_ids[0] and fast.token_ids[2] == slow.token_ids[2]
    assert all(0 <= t < VOCAB for t in fast.token_ids)


def test_half_precision_logits_are_accepted():
    logits = _logits(3).to(torch.bfloat16)
    rows = [_row(temperature=0.0), _row(seed=1, logprobs=2), _row(seed=2, top_k=4)]
    _assert_same(sample(logits, rows), sample_reference(logits, rows), rows)


# --- seeds --------------------------------------------------------------------------------------


def _generate(position: int, batch: int, params: SamplingParams, steps: int, companions_seed: int) -> list[int]:
    """Tokens the row at `position` samples over `steps` steps, with random other rows around it."""
    generator = torch.Generator().manual_seed(companions_seed)
    row = SamplingRow(params, [5, 6, 7], [])
    for step in range(steps):
        logits = _logits(batch, seed=1000 + companions_seed * 100 + step)
        logits[position] = _logits(1, seed=step)[0]  # the tracked row's model output depends on the step only
        others = [_row(temperature=float(torch.rand(1, generator=generator)), top_k=int(torch.randint(0, 9, (1,), generator=generator)),
                       seed=int(torch.randint(0, 1000, (1,), generator=generator))) for _ in range(batch - 1)]
        batch_rows = others[:position] + [row] + others[position:]
        row.output_token_ids.append(sample(logits, batch_rows).token_ids[position])
    return row.output_token_ids


def test_same_seed_same_tokens_whatever_the_batch():
    params = SamplingParams(seed=1234, temperature=1.2, top_p=0.95)
    reference = _generate(0, 1, params, steps=12, companions_seed=0)
    assert _generate(3, 8, params, steps=12, companions_seed=1) == reference
    assert _generate(6, 7, params, steps=12, companions_seed=2) == reference
    assert _generate(0, 1, params, steps=12, companions_seed=0) == reference  # re-run


def test_different_seeds_give_different_sequences():
    sequences = {tuple(_generate(0, 1, SamplingParams(seed=s), steps=10, companions_seed=0)) for s in range(20)}
    assert len(sequences) == 20


def test_seeded_draw_changes_with_step():
    logits = torch.zeros(1, VOCAB)  # uniform: the token is decided by the draw alone
    tokens = [sample(logits, [_row(seed=7, output=[0] * step)]).token_ids[0] for step in range(20)]
    assert len(set(tokens)) > 15


# --- filters at their limits --------------------------------------------------------------------


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=1, top_p=0.5, min_p=0.5)])
def test_narrowest_filters_equal_greedy(params):
    logits = _logits(32)
    rows = [_row(seed=n, temperature=1.5, **params) for n in range(16)] + [_row(temperature=2.0, **params) for _ in range(16)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_p_set_reaching_exactly_top_p_is_enough():
    logits = torch.tensor([[0.0, -math.log(2), -math.log(2)]])  # probs exactly .5, .25, .25
    rows = [_row(seed=n, top_p=0.5) for n in range(64)]
    assert set(sample(logits.expand(64, -1).contiguous(), rows).token_ids) == {0}
    rows = [_row(seed=n, top_p=0.75) for n in range(64)]
    assert set(sample(logits.expand(64, -1).contiguous(), rows).token_ids) == {0, 1}
    rows = [_row(seed=n, top_p=0.76) for n in range(64)]
    assert set(sample(logits.expand(64, -1).contiguous(), rows).token_ids) == {0, 1, 2}


# --- distribution -------------------------------------------------------------------------------

SMALL = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])


def _frequencies(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=SMALL.numel()).float() / len(tokens)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_empirical_frequencies_match_softmax(temperature):
    draws = 20_000
    torch.manual_seed(0)  # the unseeded rows share the default generator
    rows = [_row(temperature=temperature) for _ in range(draws)]
    tokens = sample(SMALL.expand(draws, -1).contiguous(), rows).token_ids
    expected = torch.softmax(SMALL / temperature, -1)
    assert torch.allclose(_frequencies(tokens), expected, atol=0.012)


def test_seeded_rows_follow_softmax_too():
    draws = 4_000
    rows = [_row(seed=n) for n in range(draws)]
    tokens = sample(SMALL.expand(draws, -1).contiguous(), rows).token_ids
    assert torch.allclose(_frequencies(tokens), torch.softmax(SMALL, -1), atol=0.025)


def test_top_k_and_top_p_renormalise_over_the_kept_set():
    draws = 20_000
    torch.manual_seed(1)
    logits = SMALL.expand(draws, -1).contiguous()
    probs = torch.softmax(SMALL, -1)  # sorted: token 5 (.46), 0 (.17), 1 (.10), ...
    top2 = torch.zeros_like(probs)
    top2[[5, 0]] = probs[[5, 0]] / probs[[5, 0]].sum()
    assert torch.allclose(_frequencies(sample(logits, [_row(top_k=2)] * draws).token_ids), top2, atol=0.012)
    # top_p = 0.6: token 5 alone has mass .46 < .6, so 5 and 0 are kept (.63 >= .6).
    assert torch.allclose(_frequencies(sample(logits, [_row(top_p=0.6)] * draws).token_ids), top2, atol=0.012)
    # min_p = 0.3: keeps tokens with prob >= .3 * .46 = .14: tokens 5 and 0.
    assert torch.allclose(_frequencies(sample(logits, [_row(min_p=0.3)] * draws).token_ids), top2, atol=0.012)


# --- penalties and min_tokens -------------------------------------------------------------------


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    row = _row(prompt=[0, 1], output=[2, 3, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([[
        2.0 / 2,  # prompt token, positive: divided
        -1.0 * 2,  # prompt token, negative: multiplied
        0.5 / 2 - 0.5 * 1 - 0.25,  # output once
        3.0 / 2 - 0.5 * 2 - 0.25,  # output twice
        -2.0,  # unseen
        1.0,  # unseen
    ]])
    assert torch.allclose(adjusted_logits(logits, [row]), expected)
    # Frequency / presence count output tokens only; repetition counts the prompt too.
    only_prompt = _row(prompt=[0, 4], output=[], frequency_penalty=1.0, presence_penalty=1.0)
    assert torch.equal(adjusted_logits(logits, [only_prompt]), logits)


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    assert sample(logits, [_row(temperature=0.0, output=[0])]).token_ids == [0]
    assert sample(logits, [_row(temperature=0.0, output=[0], presence_penalty=0.5)]).token_ids == [1]
    assert sample(logits, [_row(temperature=0.0, prompt=[0], repetition_penalty=1.2)]).token_ids == [1]


def test_no_stage_used_leaves_logits_untouched():
    logits = _logits(2)
    assert adjusted_logits(logits, [_row(), _row(temperature=0.0)]) is logits


def test_min_tokens_blocks_eos_and_stop_tokens():
    eos = 4
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0, 8.0]])  # eos best, then stop token 5
    def greedy(output, **params):
        return sample(logits, [_row(temperature=0.0, output=output, **params)], eos_token_id=eos).token_ids[0]
    assert greedy([1, 1], min_tokens=3, stop_token_ids=[5]) == 3
    assert greedy([1, 1, 1], min_tokens=3, stop_token_ids=[5]) == eos
    assert greedy([1], min_tokens=3) == 5
    assert greedy([1], min_tokens=3, ignore_eos=True) == eos  # eos does not stop such a request
    seeded = [_row(seed=n, output=[1], min_tokens=2, stop_token_ids=[5]) for n in range(64)]
    tokens = sample(logits.expand(64, -1).contiguous(), seeded, eos_token_id=eos).token_ids
    assert eos not in tokens and 5 not in tokens


# --- logprobs -----------------------------------------------------------------------------------


def test_top_logprobs_are_the_raw_model_distribution():
    logits = _logits(4)
    rows = [
        _row(seed=1, logprobs=5, repetition_penalty=1.5, frequency_penalty=1.0, output=[3, 4], min_tokens=4, stop_token_ids=[9]),
        _row(temperature=0.0, logprobs=20),
        _row(seed=2, logprobs=0),
        _row(seed=3),
    ]
    out = sample(logits, rows, eos_token_id=2)
    raw = torch.log_softmax(logits, -1)
    for i, k in enumerate([5, 20, 0]):
        top = out.top_logprobs[i]
        assert len(top) == k
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        true = raw[i].topk(k)
        assert [t for t, _ in top] == true.indices.tolist()
        assert values == pytest.approx(true.values.tolist(), abs=1e-6)
        assert out.logprobs[i] == pytest.approx(float(raw[i, out.token_ids[i]]), abs=1e-6)
    assert out.logprobs[3] is None and out.top_logprobs[3] is None


def test_logprobs_larger_than_vocab():
    logits = _logits(1, vocab=4)
    out = sample(logits, [_row(temperature=0.0, logprobs=10)])
    assert len(out.top_logprobs[0]) == 4


def test_batch_shape_is_checked():
    with pytest.raises(ValueError):
        sample(_logits(2), [_row()])
