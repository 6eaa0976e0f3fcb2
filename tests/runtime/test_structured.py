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


# ---------------------------------------------------------------- counted repetitions (issue 38)

def _xgrammar_count(regex: str) -> int:
    """The slow twin of repeat_count: the largest count xgrammar's own parse of `regex` gives a
    repetition, multiplied through the rules that reference one another."""
    import xgrammar as xgr

    rules = {}
    for line in str(xgr.Grammar.from_regex(regex)).splitlines():
        name, body = line.split(" ::= ", 1)
        body = re.sub(r'"(\\.|[^"\\])*"', "", body)
        rules[name] = re.sub(r"\[(\\.|[^\]\\])*\]", "", body)

    def weight(name: str) -> int:
        refs = re.findall(r"(\w+)(?:\{(\d+), (-?\d+)\})?", rules[name])
        return max([1] + [(int(b) if b not in ("", "-1") else int(a or 1)) * weight(r) for r, a, b in refs if r in rules])

    return weight("root")


@pytest.mark.parametrize("regex", ["abc", "a{5}", "a{3,}", "a{2,9}", "(a{0,10}){5}", r"\{1000\}", "[{]{4}", r"[\]{1000}]",
                                   "(a|b{200})", "((ab){3}c){4}", "(a)(b){7}", ".{0,100000}", "[^x]{4}z{2}", r"\\{3}",
                                   r"(\d{3}-){2}\d{4}", "(?:x{2}){3}", "[a-z]{1,8}@[a-z]{2,6}"])
def test_repeat_count_matches_xgrammars_own_parse(regex):
    from pdserve.runtime.structured import repeat_count

    assert repeat_count(regex) == _xgrammar_count(regex)


@pytest.mark.parametrize("spec", [
    StructuredOutput("regex", ".{0,100000}"),
    StructuredOutput("regex", "(a{0,20}b){0,20}"),  # 400 through the nesting
    StructuredOutput("json", json.dumps({"type": "object", "properties": {"s": {"type": "string", "pattern": ".{0,200}"}}})),
    StructuredOutput("json", json.dumps({"type": "object", "patternProperties": {"^x{500}$": {"type": "integer"}}})),
], ids=["regex", "nested", "pattern", "patternProperties"])
def test_a_counted_repetition_past_the_limit_is_refused_before_compiling(engine, spec):
    """Before: accepted (its masks then took 15-25 ms a token, up to 1.25 s, for every row of the batch)."""
    from pdserve.runtime.structured import check

    t = time.monotonic()
    with pytest.raises(GrammarTooComplex.__mro__[1]) as refused:  # LimitExceededError
        check(spec)
    assert refused.value.code == "limit_exceeded" and "the limit is 128" in str(refused.value), refused.value
    assert time.monotonic() - t < 0.5  # refused before any compile (which took seconds)
    seq = engine.add_request([8, 9], SamplingParams(max_tokens=4, structured=spec))  # a worker refuses it too
    outs = [o for o in _drain(engine) if o.request_id == seq.request_id]
    assert outs[0].error.code == "limit_exceeded", outs
    assert engine.blocks.free_blocks == engine.blocks.num_blocks


def _mask_ms(compiled, tok, steps: int = 60) -> float:
    """The median time of filling one row's mask while a walk stays inside the grammar's string
    (each step takes the first allowed token that closes nothing)."""
    import xgrammar as xgr

    vocab = compiled.tokenizer_info.vocab_size
    matcher, mask, times = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab), []
    bits = torch.arange(32, dtype=torch.int32)
    for _ in range(steps):
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - t)
        allowed = torch.nonzero(((mask[0].unsqueeze(1) >> bits) & 1).flatten()[:vocab]).flatten().tolist()
        inside = [a for a in allowed[:2000] if a != tok.eos_token_id and not set(tok.decode([a])) & set('"]}')]
        assert matcher.accept_token((inside or allowed)[len(inside) // 2])
        if matcher.is_terminated():
            break
    return sorted(times)[len(times) // 2] * 1000


def test_masks_stay_cheap_at_the_limits_and_are_slow_past_them(engine):
    """maxLength 100000 (the issue's case) and a pattern's count at the limit cost what a plain string
    does; one count past the limit (xgrammar's unrolling stops at 128) costs 10x and more."""
    import xgrammar as xgr

    tok, grammars = engine.tokenizer, constrainer()
    vocab = engine.cfg.vocab_size

    def schema(s):
        return grammars.compile_now(StructuredOutput("json", json.dumps({"type": "object", "properties": {"s": s}, "required": ["s"]})),
                                    vocab, tok.eos_token_id)

    plain = _mask_ms(schema({"type": "string"}), tok)
    long = _mask_ms(schema({"type": "string", "minLength": 100000, "maxLength": 100000}), tok)
    at = _mask_ms(schema({"type": "string", "pattern": ".{0,128}"}), tok)
    over = _mask_ms(grammars.compiler.compile_json_schema(json.dumps({"type": "object", "properties": {"s": {
        "type": "string", "pattern": ".{0,200}"}}, "required": ["s"]}), any_whitespace=False), tok)
    assert isinstance(grammars.compiler, xgr.GrammarCompiler)
    assert long < max(1.0, 5 * plain) and at < max(1.0, 5 * plain), (plain, long, at)
    assert over > 10 * at, (at, over)  # why the limit: remove it when xgrammar's counter masks get cheap


# ---------------------------------------------------------------- a compile past its budget (issue 38)

def test_a_runaway_compile_is_killed_at_its_budget_and_the_next_grammar_compiles_at_once(engine, monkeypatch):
    """Before: the runaway (5.0 s of compiling alone on this CPU) kept the worker's one compile thread, so the next
    grammar waited behind it (CompilerBusy, then seconds). Now its probe process is killed at the budget."""
    grammars = constrainer()
    vocab, eos = engine.cfg.vocab_size, engine.tokenizer.eos_token_id
    monkeypatch.setattr(grammars.lane, "budget_ms", 1000)
    warm = grammars.submit(StructuredOutput("regex", "[a-z]{2}"), vocab, eos)  # imports and the probe process: outside any budget
    _wait(grammars.lane, warm, 120)
    grammars.release(warm)
    runaway = grammars.submit(StructuredOutput("regex", "(.{0,128})" * 40), vocab, eos)  # each count within the limit
    t = time.monotonic()
    with pytest.raises(GrammarTooComplex, match="1000 ms"):
        _wait(grammars.lane, runaway, 30)
    refused_s = time.monotonic() - t
    grammars.release(runaway)
    t = time.monotonic()
    nxt = grammars.submit(StructuredOutput("regex", "[0-9]{1,4}-next"), vocab, eos)
    assert _wait(grammars.lane, nxt, 30) is not None
    grammars.release(nxt)
    next_s = time.monotonic() - t
    assert refused_s < 1.0 + 0.25 and next_s < 1.0, (refused_s, next_s)
    with pytest.raises(GrammarTooComplex):  # remembered: a repeat is refused at once
        grammars.outcome(grammars.submit(StructuredOutput("regex", "(.{0,128})" * 40), vocab, eos))
