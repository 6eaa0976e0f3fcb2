"""Structured outputs: constrained decoding through xgrammar (JSON schema, any JSON object, regex,
choice). xgrammar over llguidance: its token masks cost a fraction of llguidance's
(docs/performance.md, "Structured outputs").

Lifecycle:
- `check(spec)` compiles a spec without a tokenizer and raises InvalidRequestError naming the
  problem; the HTTP gateway calls it before a request leaves (a 400), on its own compile lane
  (gateway/structured.py): the first call imports xgrammar (and torch), seconds on a small CPU.
- Each process that samples has one `Constrainer` (module-level, `constrainer()`), told where
  its tokenizer comes from once (`configure(model=...)` by a worker, `configure(tokenizer=...)`
  by an in-process engine). Grammars are compiled before a request joins a batch, never in a
  step: the engine `submit`s a request's spec to the constrainer's compile lane
  (runtime/grammar_lane.py: one thread, a time budget, an LRU of compiled grammars bounded by
  count and bytes; the first compile also loads the tokenizer and xgrammar's vocabulary table,
  outside the budget), polls `outcome(job)` before each step, and `pin`s the compiled grammar
  to the sequence's output list when it is ready (a spec that does not compile, or not in
  budget, fails its request with the typed error); `unpin` when the sequence ends.
- Every step, `sample()` calls `constrain(logits, rows, eos)` only when a row carries a spec. A
  row's matcher is built from its pinned grammar, kept between steps, and caught up with the
  tokens the row generated since (so a decode worker taking over from a prefill worker, or a
  request recomputed elsewhere, rebuilds the state from the tokens); the row's logits outside
  the grammar's next tokens become -inf. A constrained row with no pinned grammar (a caller
  that skipped the engine) runs free, logged.
- A spec with `after` (a reasoning model's "</think>", set by the gateway's --reasoning-parser)
  leaves the row free until its output's text holds that marker; the grammar then holds from
  the token that completed it (found by decoding a few tokens at a time, each token once).
"""
from __future__ import annotations

import json
import logging
import re
import sys
import threading
from dataclasses import dataclass

import msgspec
import torch

from pdserve.common.errors import LimitExceededError
from pdserve.runtime.grammar_lane import LRU, CompileJob, CompileLane, Probe, serve_probes
from pdserve_client.errors import InvalidRequestError
from pdserve_client.params import StructuredOutput

log = logging.getLogger("pdserve.structured")

_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "json_object": "JSON object grammar"}

# characters of whitespace a JSON grammar allows between two tokens of the JSON (any kind, as vLLM's
# default): enough for a newline and the indentation of 7 levels; unbounded, the default model
# wrote newlines until max_tokens on one schema of five (vLLM does not bound them)
MAX_WHITESPACE = 16
# counts of a regex's (or a schema pattern's) counted repetitions {m,n}, multiplied through nesting: xgrammar
# unrolls up to 128 into its automaton; past that it keeps a counter whose masks it checks token by token at
# every step (on the default tokenizer, `.{0,200}` in a pattern: 20-25 ms a token, up to 250 ms; `.{0,100000}`
# as a regex: up to 1.25 s; `.{0,128}`: 0.05 ms), time every other row of that worker's batch waits for.
# A JSON schema's minLength/maxLength/minItems/maxItems are not counted: xgrammar's masks for them stay cheap
# (maxLength 100000: 0.06 ms a token, as a plain string)
MAX_REPEAT = 128
CACHE_ENTRIES = 128  # compiled grammars kept for reuse (an LRU), at most this many
CACHE_BYTES = 64 * 2**20  # ... and this many bytes (a 200-property schema compiles to ~12 MB)


def _message(e: Exception) -> str:
    """xgrammar's C++ error text without its timestamp, file and check prefix."""
    text = str(e).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text).strip()


def _grammar(spec: StructuredOutput):
    import xgrammar as xgr

    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(spec.spec, strict_mode=True, **_whitespace(spec))
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **_whitespace(spec))
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.spec)
    if spec.kind == "choice":
        return xgr.Grammar.from_regex("|".join(re.escape(c) for c in spec.choices))
    raise InvalidRequestError(f"unknown structured output kind {spec.kind!r}")


def _whitespace(spec: StructuredOutput) -> dict:
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE} if spec.any_whitespace else {"any_whitespace": False}


_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")


def repeat_count(regex: str) -> int:
    """The largest count of a counted repetition in `regex`, multiplied through its nesting
    (`(a{0,10}){5}`: 50; `a{3,}`: 3; none: 1). Escapes and character classes hold no counts."""
    levels, last, i = [1], 1, 0  # levels: the largest count inside each open group; last: the atom before i
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i, last = i + 2, 1
            continue
        if c == "[":
            j = i + 1 + (regex[i + 1:i + 2] == "^")
            while j < len(regex) and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        m = _COUNT.match(regex, i) if c == "{" else None
        if m:
            last *= max(int(m.group(3) or m.group(1)), 1)  # {n}, {m,}: n, m; {m,n}: n
            levels[-1] = max(levels[-1], last)
            i = m.end()
            continue
        if c == "(":
            levels.append(1)
        elif c == ")" and len(levels) > 1:
            last = levels.pop()
            levels[-1] = max(levels[-1], last)
            i += 1
            continue
        last = 1
        i += 1
    return max(levels)


def _patterns(node):
    """Every regex in a JSON schema: `pattern` strings and `patternProperties` keys, at any depth."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "pattern" and isinstance(v, str):
                yield v
            if k == "patternProperties" and isinstance(v, dict):
                yield from v
            yield from _patterns(v)
    elif isinstance(node, list):
        for v in node:
            yield from _patterns(v)


def check_repeats(spec: StructuredOutput, schema=None) -> None:
    """Raise LimitExceededError if a regex of the spec counts a repetition past MAX_REPEAT."""
    if spec.kind == "regex":
        regexes = [spec.spec]
    elif spec.kind == "json":
        regexes = _patterns(json.loads(spec.spec) if schema is None else schema)
    else:
        return
    for regex in regexes:
        n = repeat_count(regex)
        if n > MAX_REPEAT:
            raise LimitExceededError(f"a counted repetition {{m,n}} of {n} in {regex[:60]!r} (nested counts multiply); "
                                     f"the limit is {MAX_REPEAT}: a larger one makes every token's mask slow")


def check(spec: StructuredOutput) -> None:
    """Raise InvalidRequestError if the spec does not compile (an invalid schema or regex), or
    LimitExceededError (a subclass) if a regex of it counts a repetition past MAX_REPEAT."""
    schema = None
    if spec.kind == "json":
        try:
            schema = json.loads(spec.spec)
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError("the JSON schema must be a JSON object")
    check_repeats(spec, schema)
    try:
        _grammar(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidRequestError(f"invalid {_WHAT[spec.kind]}: {_message(e)}") from None


def spec_bytes(spec: StructuredOutput) -> int:
    return len(spec.spec) + sum(len(c) for c in spec.choices) + 64


def _compiled_bytes(key, outcome) -> int:
    compiled = outcome[0]
    return spec_bytes(key[0]) + (compiled.memory_size_bytes if compiled is not None else 0)


@dataclass
class _Row:
    owner: list  # the sequence's own output list the matcher follows (kept: its id is the key)
    compiled: object  # xgrammar.CompiledGrammar, compiled before the row joined a batch
    matcher: object | None = None  # None: not built yet, or a token left the grammar (the row runs free)
    accepted: int = 0  # output tokens fed to the matcher
    broken: bool = False  # a generated token did not fit the grammar: free from then on
    start: int | None = 0  # where in the output the grammar begins; None: its spec's `after` marker is not there yet
    scanned: int = 0  # output tokens already searched for that marker


class Constrainer:
    def __init__(self):
        self.model = None
        self.tokenizer = None
        self.generation = 0  # bumped by configure(): compiled grammars of another tokenizer never match a key
        self.compiler = None
        self.compiler_key = None  # (vocab, eos, generation) the compiler was built for
        self.rows: dict[int, _Row] = {}  # id(output list) -> its pinned grammar and matcher
        self.lock = threading.Lock()
        self.warned = False  # a row without a pinned grammar was seen (logged once)
        self.info_json = None  # the compiler's tokenizer table as xgrammar's JSON: what the probe process compiles with
        self.probe = Probe([sys.executable, "-P", "-c", "from pdserve.runtime.structured import _serve; _serve()"])
        self.lane = CompileLane(self._compile, threads=1, cache=LRU(CACHE_ENTRIES, CACHE_BYTES, _compiled_bytes),
                                prepare=self._prepare, probe=self._probe)

    def configure(self, model=None, tokenizer=None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.generation += 1

    # ------------------------------------------------------------------ compiling (the lane's thread)

    def submit(self, spec: StructuredOutput, vocab: int, eos: int | None) -> CompileJob:
        """Queue spec's grammar for this vocabulary; poll `outcome(job)`, `release(job)` if given up."""
        return self.lane.submit((spec, vocab, eos, self.generation))

    def outcome(self, job: CompileJob):
        """The compiled grammar, None while compiling, or raises the typed error (runtime/grammar_lane.py)."""
        return self.lane.outcome(job)

    def release(self, job: CompileJob) -> None:
        self.lane.release(job)

    def compile_now(self, spec: StructuredOutput, vocab: int, eos: int | None):
        """Compile on the calling thread (tests, tools); raises the typed error."""
        key = (spec, vocab, eos, self.generation)
        self._prepare(key)
        return self._compile(key)

    def _prepare(self, key) -> None:
        import xgrammar as xgr

        _, vocab, eos, generation = key
        if self.compiler_key != (vocab, eos, generation):
            if self.tokenizer is None:
                from pdserve.common.tokenizer import load_tokenizer

                self.tokenizer = load_tokenizer(self.model)
            stops = sorted({t for t in (eos, self.tokenizer.eos_token_id) if t is not None})
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=vocab, stop_token_ids=stops or None)
            # xgrammar's own cache is unbounded: the lane's LRU keeps what is reused
            self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self.compiler_key = (vocab, eos, generation)
            self.info_json = info.serialize_json()
        self.probe.start(self.info_json)  # a fresh helper process if it is not running (seconds: it imports xgrammar)

    def _probe(self, key, budget_s: float) -> bool:
        """Compile key's spec in the probe process (runtime/grammar_lane.py Probe): True in budget,
        False stopped at it; raises InvalidRequestError for a spec that does not compile."""
        check_repeats(key[0])
        status, text = self.probe.run(msgspec.msgpack.encode(key[0]), budget_s)
        if status == "invalid":
            raise InvalidRequestError(text)
        if status == "failed":
            raise RuntimeError(text)  # an internal failure: reported, not remembered
        return status == "ok"

    def _compile(self, key):
        spec, compiler = key[0], self.compiler
        check_repeats(spec)
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.spec, strict_mode=True, **_whitespace(spec))
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **_whitespace(spec))
            return compiler.compile_grammar(_grammar(spec))
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"invalid {_WHAT[spec.kind]}: {_message(e)}") from None

    # ------------------------------------------------------------------ rows (the engine's thread)

    def pin(self, output: list, compiled) -> None:
        """Constrain the row whose generated tokens are `output` (a sequence's own list) by `compiled`."""
        with self.lock:
            self.rows[id(output)] = _Row(output, compiled)

    def unpin(self, output: list) -> None:
        with self.lock:
            row = self.rows.get(id(output))
            if row is not None and row.owner is output:
                del self.rows[id(output)]

    def constrain(self, logits: torch.Tensor, rows, eos_token_id: int | None) -> torch.Tensor:
        """`logits` (B, V) float32 with every constrained row masked to its grammar (a copy)."""
        import xgrammar as xgr

        with self.lock:
            vocab = logits.shape[1]
            which = [i for i, r in enumerate(rows) if r.params.structured is not None]
            mask = xgr.allocate_token_bitmask(len(rows), vocab)
            masked = []
            for i in which:
                matcher = self._matcher(rows[i].output_token_ids, rows[i].params.structured.after)
                if matcher is None or matcher.is_terminated():
                    continue
                matcher.fill_next_token_bitmask(mask, i)
                masked.append(i)
        if not masked:
            return logits
        out = logits.clone()
        if out.device != mask.device:  # xgrammar fills on the CPU; its GPU kernel wants the mask beside the logits
            mask = mask.to(out.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(out, mask, indices=masked)
        return out

    def _matcher(self, out: list, after: str = ""):
        """The row's matcher caught up with its tokens; None: no pinned grammar, it left it, or
        the grammar does not hold yet (`after` not in the output)."""
        import xgrammar as xgr

        row = self.rows.get(id(out))
        if row is None or row.owner is not out:
            if not self.warned:
                log.warning("a structured row without a compiled grammar runs unconstrained (the engine compiles before a step)")
                self.warned = True
            return None
        if row.broken:
            return None
        if row.matcher is None or row.accepted > len(out):  # new, or preempted and recomputed with fewer tokens
            row.matcher, row.accepted = xgr.GrammarMatcher(row.compiled), 0
            row.start, row.scanned = (None, 0) if after else (0, 0)
        if row.start is None:
            row.start = self._marker_end(out, after, row)
            if row.start is None:
                return None
            row.accepted = row.start
        while row.accepted < len(out):
            if not row.matcher.accept_token(out[row.accepted]):
                log.warning("a generated token does not fit its grammar; the request runs unconstrained from here")
                row.broken = True
                return None
            row.accepted += 1
        return row.matcher


    def _marker_end(self, out: list, marker: str, row: _Row) -> int | None:
        """The output index just past the token that completed `marker` in the text, or None;
        each token is looked at once (a window of as many tokens as the marker has characters)."""
        window = len(marker)
        for i in range(row.scanned, len(out)):
            text = self.tokenizer.decode(out[max(0, i - window):i + 1], skip_special_tokens=False)
            if marker in text and marker not in self.tokenizer.decode(out[max(0, i - window):i], skip_special_tokens=False):
                return i + 1
        row.scanned = len(out)
        return None


def _serve() -> None:
    """The probe process (runtime/grammar_lane.py serve_probes): compiles specs for the tokenizer table
    its first frame carries."""
    import xgrammar as xgr

    def make(info_json):
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1, cache_enabled=False)
        constrainer = Constrainer.__new__(Constrainer)
        constrainer.compiler = compiler
        return lambda request: constrainer._compile((msgspec.msgpack.decode(request, type=StructuredOutput),))

    serve_probes(make)


_CONSTRAINER = Constrainer()


def constrainer() -> Constrainer:
    return _CONSTRAINER


def configure(model=None, tokenizer=None) -> None:
    _CONSTRAINER.configure(model, tokenizer)
