"""The single-process engine: model, KV pool, scheduler, runner and sampler in one loop.

Lifecycle: `LLMEngine.load(model, config)` reads weights and tokenizer and allocates the KV
pool once. `add_request` validates a request (typed errors, nothing queued on failure) and
queues it; each `step()` is schedule -> execute -> postprocess and returns what every sequence
produced; `abort` ends a request at any point. Finished or aborted sequences free their blocks
at once. A request with a structured-output spec waits in `compiling` (not in the scheduler)
while its grammar compiles on the constrainer's compile thread (runtime/structured.py); each
step first joins the requests whose grammar is ready and fails, with the typed error
(StepOutput.error) and its blocks freed, those whose spec does not compile or not within the
budget: a step never compiles. With only compiles pending (`runnable()` False), a step waits a
few ms for one and computes nothing. `generate()` drives the loop to completion for a list of
prompts. The colocated worker and the reference outputs of the disaggregated tests both run
this engine.

A model whose every layer slides (ModelConfig.kv_window) frees each sequence's blocks wholly
before its window after every step it computes and when it joins (runtime.kv_cache
drop_outside_windows): a long generation holds about window / block_size + 1 blocks; a held
prefill keeps only its window's blocks for the hand-off. A model whose sliding layers sit beside
full-attention ones (ModelConfig.kv_groups: Gemma 2 / 3) holds one block table per KV group and
frees each sliding group's blocks before its window the same way, the full groups keeping every
block (logged at start, with the prefix cache off: runtime.kv_cache).

Prefill mode (`prefill_only=True`, the prefill worker): a sequence leaves the batch as soon as
its prompt is computed and its first token sampled; that step's output carries the token, and
the sequence's blocks stay allocated (`seqs[request_id].block_tables`) until `release(request_id)`,
so the worker can hand them off first. Stop conditions are left to the engine that decodes.
The same per sequence (`add_request(..., hold=True)`): a worker that decodes its other sequences
prefills this one in its steps and holds it, blocks and all, until its hand-off and `release`
(or `abort`), which frees them.
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from pdserve.common.errors import PromptTooLongError
from pdserve.common.tokenizer import IncrementalDetokenizer, eos_token_ids, load_tokenizer
from pdserve.runtime import structured
from pdserve.runtime.build import build_model, check_attention_backend, load_model  # noqa: F401 (re-exported: where callers found them)
from pdserve.runtime.config import EngineConfig, ModelConfig
from pdserve.runtime.kv_cache import BlockManager, allocate_kv_cache, deinterleave
from pdserve.runtime.model import LlamaModel
from pdserve.runtime.model_runner import ModelRunner
from pdserve.runtime.scheduler import Scheduler
from pdserve.runtime.sequence import Sequence
from pdserve_client.errors import InvalidRequestError, PdserveError
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import FinishReason

log = logging.getLogger("pdserve.runtime")

COMPILE_WAIT_S = 0.005  # a step with nothing to run but grammars compiling waits this long for one (no busy loop)


@dataclass
class StepOutput:
    request_id: str
    token_id: int | None  # None when the request ended without a new token (abort, too long)
    text: str = ""
    logprob: float | None = None
    top_logprobs: list | None = None
    finish_reason: FinishReason | None = None
    error: PdserveError | None = None  # the request failed (its grammar did not compile): report it, not a finish
    prompt_logprobs: list | None = None  # with its first token, when asked: a runtime.scoring.PromptScore per prompt token after the first


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None  # runtime.scoring.PromptScore per prompt token after the first, when asked


def context_that_fits(cfg: ModelConfig, config: EngineConfig, num_blocks: int) -> int:
    """The context length (prompt + output) this engine serves, checked at start against its KV pool
    (issue 40: never first at a long request): an explicit --max-model-len one sequence could not
    hold in `num_blocks` is a clear error (vLLM's start-up check); without one, the model's own
    context is lowered to what the pool holds, with a warning (vLLM refuses that too, so that a
    default launch of a long-context model on the default pool would not start). A model whose
    every layer slides holds only its window's blocks however long it grows (ModelConfig.kv_window),
    so only its prompts are bounded by the pool (validate); one with KV groups (ModelConfig.kv_groups)
    holds its full groups' blocks for every token, its sliding groups' only for their windows."""
    want = min(config.max_model_len or cfg.max_position, cfg.max_position)
    holds = _tokens_one_sequence_holds(cfg, num_blocks, config.block_size)
    if want <= holds:
        return want
    if cfg.kv_window and num_blocks >= -(-cfg.kv_window // config.block_size) + 2:
        return want  # every layer slides: a sequence holds only its window's blocks as it grows (a prompt must fit whole: validate)
    per_token = config.kv_bytes_per_token(cfg)
    need_mb = -(-want * per_token // 2**20)
    if config.max_model_len is not None:
        raise InvalidRequestError(
            f"max_model_len {want} does not fit the KV pool: one sequence of {want} tokens needs {need_mb} MiB of KV "
            f"({per_token} bytes a token), the pool holds {holds} tokens ({num_blocks} blocks of {config.block_size}); "
            f"raise --kv-cache-mb to at least {need_mb} or lower --max-model-len to {holds}")
    log.warning("the model's context of %d tokens does not fit the KV pool (%d tokens, %d blocks; %d MiB would hold it): "
                "serving a context of %d tokens; raise --kv-cache-mb for more", want, holds, num_blocks, need_mb, holds)
    return holds


def _tokens_one_sequence_holds(cfg: ModelConfig, num_blocks: int, block_size: int) -> int:
    """The longest context one sequence can have in a pool of num_blocks blocks: every block one
    table's, or with KV groups what is left for the full groups' tables once each sliding group
    holds its window's blocks (its window / block_size + 2: runtime.kv_cache first_needed)."""
    groups = cfg.kv_groups
    if not groups.split:
        return num_blocks * block_size
    sliding = sum(-(-w // block_size) + 2 for w in groups.windows if w)
    return max(0, num_blocks - sliding) // groups.windows.count(0) * block_size


class LLMEngine:
    def __init__(self, model: LlamaModel, tokenizer, config: EngineConfig, kv_cache: torch.Tensor | None = None,
                 prefill_only: bool = False):
        self.model = model
        self.prefill_only = prefill_only
        self.cfg = model.cfg
        self.config = config
        self.tokenizer = tokenizer
        if tokenizer is not None:
            structured.configure(tokenizer=tokenizer)  # the grammar of a structured request needs the vocabulary
        if config.max_model_len is not None and config.max_model_len > self.cfg.max_position:
            raise InvalidRequestError(f"max_model_len {config.max_model_len} is longer than the model's context ({self.cfg.max_position} tokens)")
        num_blocks = config.blocks_for_budget(self.cfg) if kv_cache is None else kv_cache.shape[2]
        self.max_model_len = context_that_fits(self.cfg, config, num_blocks)
        if kv_cache is None:
            kv_cache = allocate_kv_cache(self.cfg, num_blocks, config.block_size, config.kv_torch_dtype, config.device)
        groups = self.cfg.kv_groups
        self.blocks = BlockManager(num_blocks, config.block_size, prefix_cache=config.prefix_cache, window=self.cfg.kv_window,
                                   group_windows=groups.windows)
        if self.cfg.kv_window:
            log.info("sliding window %d on every layer: a sequence's KV blocks wholly before its window are freed as it grows",
                     self.cfg.kv_window)
        elif groups.split:
            log.info("sliding-window layers beside full-attention ones (%d of %d layers slide): %d KV groups of %d layers "
                     "(windows %s), one block table each; a sliding group's blocks before its window are freed as a "
                     "sequence grows; prefix cache off", sum(1 for w in self.cfg.layer_windows if w), self.cfg.num_layers,
                     groups.count, groups.size, groups.windows)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.eos_ids = eos_token_ids(tokenizer, self.cfg.eos_token_ids) if tokenizer is not None else set(self.cfg.eos_token_ids)
        self.runner = ModelRunner(model, kv_cache, self.blocks, eos_token_id=min(self.eos_ids) if self.eos_ids else None)
        self.seqs: dict[str, Sequence] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        # request id -> (sequence, its grammar's compile job, how it joins the scheduler once compiled)
        self.compiling: dict[str, tuple[Sequence, object, object]] = {}
        self.holding: set[str] = set()  # request ids held after their prefill (add_request(hold=True)) until release
        self._ids = itertools.count()
        # (sequences, tokens computed, context tokens, seconds) of recent steps: the coordinator's
        # latency model is fitted from these (read by the worker's I/O thread; deque ops are atomic)
        self.step_log: collections.deque[tuple[int, int, int, float]] = collections.deque(maxlen=256)
        # a worker on a core share (runtime/cores.py) sets core_share: a step it ran on fewer threads
        # because busy workers of its own role share the cores (its role_share: those threads) is
        # logged apart, with its thread count, so that the model of its all-core steps stays one model
        # and the coordinator learns what sharing costs (coordinator/slo.py CoreShareSlowdown)
        self.core_share = None
        self.shared_step_log: collections.deque[tuple[int, int, int, float, int]] = collections.deque(maxlen=256)

    @classmethod
    def load(cls, model=None, config: EngineConfig | None = None, progress: bool = True, tokenizer: bool = True) -> LLMEngine:
        config = config or EngineConfig()
        _, built = load_model(model, config, progress)
        tok = load_tokenizer(model) if tokenizer else None
        return cls(built, tok, config)

    # ------------------------------------------------------------------ requests

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if any(not (0 <= t < self.cfg.vocab_size) for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if n >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {n} tokens; this model's context is {self.max_model_len} tokens (prompt + output)")
        if self.blocks.table_blocks(n + 1, self.config.max_num_batched_tokens) > self.blocks.num_blocks:
            raise PromptTooLongError(f"prompt has {n} tokens; the KV pool holds {self.blocks.num_blocks * self.blocks.block_size}")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    output_token_ids: list[int] | None = None, priority: int = 0, hold: bool = False) -> Sequence:
        """Queue a request; output_token_ids (already generated elsewhere) are recomputed, not resampled.
        hold: stop it after its prefill as prefill mode does (its first token sampled, its blocks
        kept until `release`)."""
        self.validate(list(prompt_token_ids) + list(output_token_ids or ()), params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        seq = Sequence(rid, prompt_token_ids, params, output_token_ids, priority)
        self.seqs[rid] = seq
        if hold:
            self.holding.add(rid)
        if self.tokenizer is not None:
            self.detoks[rid] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop)
        self._enter(seq, self.scheduler.add)
        return seq

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int], params: SamplingParams,
                      block_table: list[int], num_computed: int, logprob=None, top_logprobs=None, priority: int = 0,
                      prompt_logprobs: list | None = None) -> StepOutput:
        """Join a request prefilled elsewhere: its KV for num_computed tokens is in block_table
        (owned from now on by this engine; with KV groups every group's table, runtime.kv_cache
        interleave's order), its last output token is new (with the prompt's
        scores, when it asked for them). Returns that token's output, already checked against
        the stop conditions."""
        seq = Sequence(request_id, prompt_token_ids, params, output_token_ids[:-1], priority)
        seq.prompt_scores = prompt_logprobs
        seq.block_tables = deinterleave(block_table, self.blocks.groups)
        seq.num_computed_tokens = num_computed
        self.scheduler.register_computed(seq, 0)  # its prompt's full blocks join this worker's prefix cache (none past a freed one)
        self.blocks.drop_outside_windows(seq.block_tables, num_computed)
        self.seqs[request_id] = seq
        self._enter(seq, self.scheduler.add_running)
        return self._append(seq, output_token_ids[-1], logprob, top_logprobs)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT)
        return True

    def release(self, request_id: str) -> None:
        """Prefill mode or a held sequence: free a handed-off sequence's blocks and forget it."""
        self._finish(self.seqs[request_id], FinishReason.STOP)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.compiling)

    def runnable(self) -> bool:
        """Whether a step would compute: False while the only work is grammars compiling (a
        worker then claims no cores for its steps)."""
        return self.scheduler.has_work()

    def queued_tokens(self) -> int:
        """Tokens compiling, queued or running and not yet computed (a prefill worker's backlog)."""
        sched = self.scheduler
        return sum(s.num_uncomputed for s in [*(c[0] for c in self.compiling.values()), *sched.waiting, *sched.running])

    # ------------------------------------------------------------------ grammars

    def _enter(self, seq: Sequence, join) -> None:
        """Join seq to the scheduler (`join`), at once or, with a spec, once its grammar is compiled."""
        spec = seq.params.structured
        if spec is None:
            join(seq)
            return
        job = structured.constrainer().submit(spec, self.cfg.vocab_size, self.runner.eos_token_id)
        self.compiling[seq.request_id] = (seq, job, join)

    def _take_compiled(self) -> list[StepOutput]:
        """Join the sequences whose grammar is ready; fail those refused (typed error, blocks freed)."""
        outs = []
        grammars = structured.constrainer()
        for rid, (seq, job, join) in list(self.compiling.items()):
            try:
                compiled = grammars.outcome(job)
            except PdserveError as e:
                log.warning("request %s: %s", rid, e)
                self._finish(seq, FinishReason.ABORT)  # releases the job
                outs.append(StepOutput(rid, None, finish_reason=FinishReason.ABORT, error=e))
                continue
            if compiled is not None:
                del self.compiling[rid]
                grammars.release(job)
                grammars.pin(seq.output_token_ids, compiled)
                join(seq)
        return outs

    def _wait_compiling(self, timeout: float) -> None:
        futures = [job.future for _, job, _ in self.compiling.values()]
        concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[StepOutput]:
        outs = []
        if self.compiling:
            runnable = self.runnable()
            if not runnable:
                self._wait_compiling(COMPILE_WAIT_S)
            outs = self._take_compiled()
            if not runnable:
                return outs  # what joined computes in the next step, once the worker has claimed cores for it
        sched = self.scheduler.schedule()
        outs += [self._finish(seq, FinishReason.LENGTH, already=True) for seq in sched.finished]
        if not sched.scheduled:
            return outs
        samplers, sampled = self.execute(sched.scheduled)
        for i, seq in enumerate(samplers):
            outs.append(self._append(seq, sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i]))
        return outs

    def execute(self, scheduled: list[tuple[Sequence, int]]):
        """Run one scheduled step, advance num_computed_tokens, and log the step's size and time."""
        t0 = time.perf_counter()
        samplers, sampled, scores = self.runner.execute(scheduled)
        dt = time.perf_counter() - t0
        for seq, new in scores:
            seq.prompt_scores.extend(new)
        ctx = 0
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            ctx += seq.num_computed_tokens
            self.scheduler.register_computed(seq, seq.num_computed_tokens - n)
            self.blocks.drop_outside_windows(seq.block_tables, seq.num_computed_tokens)  # every layer slides, or a sliding KV group
        sample = (len(scheduled), sum(n for _, n in scheduled), ctx, dt)
        threads = self.core_share.role_share if self.core_share is not None else 0
        if threads:
            self.shared_step_log.append((*sample, threads))
        else:
            self.step_log.append(sample)
        return samplers, sampled

    def profile(self, batches=(1, 4, 16), prompt_len: int = 64, decode_steps: int = 4,
                long_prompts: tuple[int, int] = (4, 256)) -> list[tuple[int, int, int, float]]:
        """Time a few prefill and decode steps on random tokens (before serving), so the
        coordinator's latency model has data from the first request on. The first batch runs
        twice and is timed the second time (a process's first steps pay one-time costs: thread
        pools, scratch buffers). Then `long_prompts` = (batch, tokens) longer prompts (tokens <=
        prompt_len: none): without them every decode step profiled holds ~prompt_len context
        tokens a sequence, so the model cannot tell a step's cost per context token from its cost
        per sequence (collinear). A batch, not one prompt: a lone stream's attention takes another
        path (both threads on one sequence) whose context costs next to nothing.
        Frees everything, the prefix cache's blocks and counters included."""
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
        cap = self.max_model_len - decode_steps - 2
        runs = [(b, min(prompt_len, cap)) for b in (*batches[:1], *batches)]
        runs += [(long_prompts[0], min(long_prompts[1], cap))] if long_prompts[1] > prompt_len else []
        self.step_log.clear()
        for i, (b, n) in enumerate(runs):
            if i == 1:
                self.step_log.clear()
            if self.blocks.table_blocks(n + decode_steps + 1) * b > self.blocks.num_blocks:
                break
            prompts = [torch.randint(0, self.cfg.vocab_size, (n,), generator=g).tolist() for _ in range(b)]
            self.generate(prompts, params)
        samples = list(self.step_log)
        self.step_log.clear()
        self.blocks.reset_prefix_cache()
        return samples

    def _append(self, seq: Sequence, token: int, logprob, top) -> StepOutput:
        seq.output_token_ids.append(token)
        if seq.params.logprobs is not None:
            seq.logprobs.append(logprob)
            seq.top_logprobs.append(top)
        out = StepOutput(seq.request_id, token, logprob=logprob, top_logprobs=top)
        if seq.prompt_scores is not None:  # its prompt is all scored: handed out once (runtime/scoring.py)
            out.prompt_logprobs, seq.prompt_scores = seq.prompt_scores, None
        if self.prefill_only or seq.request_id in self.holding:
            self.scheduler.hold(seq)  # its blocks wait for release()
            return out
        detok = self.detoks.get(seq.request_id)
        if detok is not None:
            out.text = detok.step(token)
        reason = self.stop_reason(seq, token, detok)
        if reason is not None:
            out.finish_reason = reason
            if detok is not None:
                out.text += detok.flush()
            self._finish(seq, reason)
        return out

    def stop_reason(self, seq: Sequence, token: int, detok: IncrementalDetokenizer | None) -> FinishReason | None:
        p = seq.params
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens and ((not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids):
            return FinishReason.STOP
        if detok is not None and detok.stopped_by is not None:
            seq.stop_text = detok.stopped_by
            return FinishReason.STOP
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason, already: bool = False) -> StepOutput:
        if not already:
            self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        self.detoks.pop(seq.request_id, None)
        self.holding.discard(seq.request_id)
        if seq.params.structured is not None:
            compiling = self.compiling.pop(seq.request_id, None)
            if compiling is not None:
                structured.constrainer().release(compiling[1])
            structured.constrainer().unpin(seq.output_token_ids)
        return StepOutput(seq.request_id, None, finish_reason=reason)

    # ------------------------------------------------------------------ convenience

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt, add_special_tokens=True)

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts (text or token ids) to completion, batched; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        done: dict[str, Completion] = {}
        order = []
        for prompt, p in zip(prompts, plist):
            seq = self.add_request(self.encode(prompt), p)
            order.append(seq.request_id)
            done[seq.request_id] = Completion(seq.request_id, seq.prompt_token_ids)
        while any(c.finish_reason is None for c in done.values()):
            for out in self.step():
                c = done.get(out.request_id)
                if c is None:
                    continue
                if out.token_id is not None:
                    c.token_ids.append(out.token_id)
                    c.logprobs.append(out.logprob)
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                c.text += out.text
                if out.finish_reason is not None:
                    c.finish_reason = out.finish_reason
                elif self.prefill_only and out.token_id is not None:
                    self.release(out.request_id)  # prefill mode: the first token is all it makes
                    c.finish_reason = FinishReason.LENGTH
        return [done[rid] for rid in order]

def drain_steps(engine, shared: bool = False) -> list[tuple]:
    """Take the step samples logged since the last call (for the worker's heartbeat): its
    all-core steps, or (shared) those run on a share of its node's cores, with their threads."""
    out = []
    log = engine.shared_step_log if shared else engine.step_log
    while log:
        out.append(log.popleft())
    return out


def prefix_report(engine) -> dict:
    """The heartbeat's prefix-cache fields: key changes since the last call (bounded by
    kv_cache.MAX_CHANGES), blocks cached now, and the lookup counters; with a host KV tier
    attached (BlockManager.tier), its counters too."""
    blocks = engine.blocks
    added, evicted = blocks.take_changes()
    return {"prefix_added": added, "prefix_evicted": evicted, "cached_blocks": blocks.cached_blocks,
            "prefix_queries": blocks.queries, "prefix_hits": blocks.hits,
            **(blocks.tier.report() if blocks.tier is not None else {})}  # the host KV tier's (kvtransfer.host_tier)
