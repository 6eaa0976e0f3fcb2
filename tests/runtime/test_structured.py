"""Constrained decoding in one engine (runtime/structured.py), tiny random model with the default
tokenizer: rows sharing one SamplingParams object keep their own grammar state; a row that
arrives with tokens already generated (a decode worker taking over) continues from the state
those tokens reach; free rows in the same batch are untouched. Grammars compile before a
request joins a batch, on the compile thread, never in a step; one past the time budget fails
its request (limit_exceeded) with every block freed; the compile lane's cache is bounded and a
lane whose thread is held by a runaway compile refuses what queues behind it (overloaded)."""
import json
import re
import threading
import time

import pytest
import torch

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.runtime.grammar_lane import LRU, CompileLane, CompilerBusy, GrammarTooComplex
from pdserve.runtime.sampling import SamplingRow, sample
from pdserve.runtime.structured import MAX_WHITESPACE, constrainer
from pdserve_client.params import SamplingParams, StructuredOutput
from pdserve_client.protocol import FinishReason
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
    grammars = constrainer()
    grammars.pin(rows[0].output_token_ids, grammars.compile_now(params.structured, vocab, tok.eos_token_id))
    try:
        out = sample(logits, rows, eos_token_id=tok.eos_token_id)
    finally:
        grammars.unpin(rows[0].output_token_ids)
    nxt = tok.decode(given + [out.token_ids[0]])
    assert any(c.startswith(nxt) for c in choices) and len(nxt) > len("alpha"), nxt
    assert out.token_ids[1] == tok.encode(" delta", add_special_tokens=False)[0]  # the free row is unconstrained


def _schema(fields: int, tag: str) -> str:
    """A JSON schema that compiles in ~7 ms per field (this CPU, this vocabulary); `tag` makes it new."""
    item = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]{1,8}"}, "b": {"type": "integer", "minimum": 0},
                                             "c": {"type": "array", "items": {"type": "number"}}}, "required": ["a", "b", "c"]}
    names = [f"{tag}_{i}" for i in range(fields)]
    return json.dumps({"type": "object", "properties": {n: item for n in names}, "required": names})


def _drain(engine, deadline_s: float = 60.0) -> list:
    outs, deadline = [], time.monotonic() + deadline_s
    while engine.has_work():
        assert time.monotonic() < deadline, "the engine did not finish"
        outs += engine.step()
    return outs


def test_a_step_never_compiles_and_runs_on_while_a_grammar_compiles(engine, monkeypatch):
    grammars = constrainer()
    lane = grammars.lane
    compiled_on = []
    real = lane.compile
    monkeypatch.setattr(lane, "compile", lambda key: compiled_on.append(threading.current_thread()) or real(key))
    free = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    spec = StructuredOutput("json", _schema(20, "step"))
    seq = engine.add_request([8, 9], SamplingParams(temperature=0, max_tokens=8, structured=spec))
    assert seq.request_id in engine.compiling and seq not in engine.scheduler.waiting
    steps_while_compiling = 0
    deadline = time.monotonic() + 60
    while seq.request_id in engine.compiling:
        assert time.monotonic() < deadline, "the grammar never compiled"
        scheduled_before = len(free.output_token_ids)
        engine.step()
        if seq.request_id in engine.compiling:
            assert seq not in engine.scheduler.running and not seq.output_token_ids  # not in a batch before its grammar
            steps_while_compiling += len(free.output_token_ids) > scheduled_before
    assert steps_while_compiling >= 1  # the free request's steps went on meanwhile
    engine.abort(free.request_id)
    _drain(engine)
    assert compiled_on and all(t is not threading.main_thread() for t in compiled_on), compiled_on
    assert seq.finish_reason is not None and seq.output_token_ids
    text = engine.tokenizer.decode(seq.output_token_ids)
    assert text.startswith("{"), text  # constrained: a JSON object begins
    assert engine.blocks.free_blocks == engine.blocks.num_blocks and not grammars.rows


def test_a_grammar_past_its_budget_fails_its_request_and_frees_its_blocks(engine, monkeypatch):
    monkeypatch.setattr(constrainer().lane, "budget_ms", 1)
    spec = StructuredOutput("json", _schema(30, "slow"))
    params = SamplingParams(temperature=0, max_tokens=8, structured=spec)
    seq = engine.add_request([8, 9, 10], params)
    # a hand-off: blocks already filled elsewhere join only once the grammar is compiled
    blocks = engine.blocks.allocate(1)
    first = engine.add_prefilled("handed-off", [1, 2, 3], [4], params, blocks, 3)
    assert first.error is None and first.token_id == 4
    outs = {o.request_id: o for o in _drain(engine)}
    for rid in (seq.request_id, "handed-off"):
        err = outs[rid].error
        assert isinstance(err, GrammarTooComplex) and err.code == "limit_exceeded" and "1 ms" in str(err), outs[rid]
        assert outs[rid].finish_reason == FinishReason.ABORT
    assert not engine.seqs and not engine.compiling and not constrainer().rows
    assert engine.blocks.free_blocks == engine.blocks.num_blocks


def test_an_invalid_spec_fails_its_request_with_a_typed_error(engine):
    seq = engine.add_request([8, 9], SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "[a-")))
    outs = [o for o in _drain(engine) if o.request_id == seq.request_id]
    assert outs[0].error.code == "invalid_request" and "invalid regex" in str(outs[0].error), outs
    assert engine.blocks.free_blocks == engine.blocks.num_blocks


def test_the_lru_is_bounded_by_count_and_bytes():
    lru = LRU(entries=2, nbytes=100, size=lambda key, value: value)
    lru.put("a", 10)
    lru.put("b", 10)
    assert lru.get("a") == 10  # a is now the most recent
    lru.put("c", 10)
    assert lru.get("b") is None and lru.get("a") == 10 and len(lru) == 2
    lru.put("d", 95)  # over the bytes: the older ones go
    assert len(lru) == 1 and lru.get("d") == 95 and lru.bytes == 95
    lru.put("huge", 101)  # larger than the whole cache: not kept
    assert lru.get("huge") is None and lru.get("d") == 95


def _wait(lane, job, deadline_s: float = 10.0):
    deadline = time.monotonic() + deadline_s
    while True:
        value = lane.outcome(job)
        if value is not None:
            return value
        assert time.monotonic() < deadline, "no outcome"
        time.sleep(0.002)


def test_the_compile_lane_caches_only_its_last_entries():
    calls = []
    lane = CompileLane(lambda key: calls.append(key) or key.upper(), threads=1, cache=LRU(2, 2**20, lambda k, v: len(k)))
    for key in ("a", "b", "c", "c", "a"):
        job = lane.submit(key)
        assert _wait(lane, job) == key.upper()
        lane.release(job)
    assert calls == ["a", "b", "c", "a"]  # c came from the cache; a had been evicted by c


def test_a_runaway_compile_is_refused_and_what_queues_behind_it_too():
    release = threading.Event()
    lane = CompileLane(lambda key: release.wait(30) and key, threads=1, cache=LRU(8, 2**20, lambda k, v: len(k)), budget_ms=50)
    try:
        runaway = lane.submit("runaway")
        queued = lane.submit("queued")
        with pytest.raises(GrammarTooComplex, match="50 ms"):
            _wait(lane, runaway)
        with pytest.raises(CompilerBusy) as busy:
            _wait(lane, queued)
        assert busy.value.code == "overloaded"
        lane.release(runaway)
        lane.release(queued)  # nobody waits for it: it is never compiled
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while lane.jobs:
        assert time.monotonic() < deadline, lane.jobs
        time.sleep(0.002)
    with pytest.raises(GrammarTooComplex):  # the late result is remembered as the refusal
        lane.outcome(lane.submit("runaway"))
    assert lane.cache.get("queued") is None


def test_a_grammar_after_a_marker_holds_only_once_the_output_has_it(engine):
    """A reasoning model's spec (after="</think>"): free while the output lacks the marker, held
    to the grammar from the token that completed it, also when a worker takes over mid-output."""
    tok = engine.tokenizer
    vocab = engine.cfg.vocab_size
    params = SamplingParams(temperature=0, max_tokens=10, structured=StructuredOutput("choice", choices=("yes", "no"), after="</think>"))
    free = tok.encode(" delta", add_special_tokens=False)[0]
    logits = torch.zeros(1, vocab)
    logits[0, free] = 10.0  # what a free row picks
    grammars = constrainer()
    compiled = grammars.compile_now(params.structured, vocab, tok.eos_token_id)
    thinking = tok.encode("Let me think </thi", add_special_tokens=False)
    done = tok.encode("Let me think </think>", add_special_tokens=False)
    for given, held in ((thinking, False), (done, True)):
        row = SamplingRow(params, [1, 2], list(given))
        grammars.pin(row.output_token_ids, compiled)
        try:
            token = sample(logits, [row], eos_token_id=tok.eos_token_id).token_ids[0]
        finally:
            grammars.unpin(row.output_token_ids)
        if held:
            assert token != free and any(c.startswith(tok.decode([token]).strip()) for c in ("yes", "no")), tok.decode([token])
        else:
            assert token == free
    # a row that grows token by token: free before the marker, held after (each token searched once)
    row = SamplingRow(params, [1, 2], [])
    grammars.pin(row.output_token_ids, compiled)
    try:
        for t in done:
            assert sample(logits, [row], eos_token_id=tok.eos_token_id).token_ids[0] == free
            row.output_token_ids.append(t)
        assert sample(logits, [row], eos_token_id=tok.eos_token_id).token_ids[0] != free
    finally:
        grammars.unpin(row.output_token_ids)


def test_any_whitespace_by_default_and_compact_on_request(engine):
    """JSON grammars let the model choose its whitespace (vLLM's default), at most MAX_WHITESPACE
    characters between two tokens of the JSON; any_whitespace=False
    (vLLM's disable_any_whitespace) holds it to xgrammar's compact form (", " and ": ", nothing else)."""
    import xgrammar as xgr

    tok = engine.tokenizer
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    grammars = constrainer()

    def accepts(spec, text):
        return xgr.GrammarMatcher(grammars.compile_now(spec, engine.cfg.vocab_size, tok.eos_token_id)).accept_string(text)

    for kind, spec in (("json", schema), ("json_object", "")):
        assert accepts(StructuredOutput(kind, spec), '{\n  "a": 1\n}') and accepts(StructuredOutput(kind, spec), '{"a":1}')
        gap = "\n" + " " * (MAX_WHITESPACE - 1)
        assert accepts(StructuredOutput(kind, spec), '{' + gap + '"a": 1}')
        assert not accepts(StructuredOutput(kind, spec), '{' + gap + ' "a": 1}')  # a run past the bound: small models loop on newlines
        assert not accepts(StructuredOutput(kind, spec, any_whitespace=False), '{\n  "a": 1\n}')
        assert not accepts(StructuredOutput(kind, spec, any_whitespace=False), '{"a":1}')
        assert accepts(StructuredOutput(kind, spec, any_whitespace=False), '{"a": 1}')
