"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Lifecycle per step: `schedule()` decides, the runner executes, and the engine advances each
scheduled sequence's `num_computed_tokens` (`LLMEngine.execute`). Running sequences go first
(a decode costs one token of the step's budget); if the pool cannot hold a running sequence's
next token, the newest running sequence is preempted (blocks freed, back to the front of the
queue for re-prefill). Then waiting sequences are
admitted in arrival order while the token budget, the sequence cap and the pool allow; a long
prompt is cut into chunks over several steps (a prompt whose tokens are scored, into chunks of at
most runtime/scoring.py's SCORE_CHUNK, and never from the prefix cache). With the prefix cache on, an admitted sequence
first takes the cached blocks of its longest cached prefix (never its last token: that one's
logits are needed) and starts computing after them; if the rest does not fit, the match is
given back and the sequence keeps waiting (with a sliding window on every layer, the matched
blocks before its window are given back at once: runtime.kv_cache drop_outside_window). Every
block call takes a sequence's tables, one per KV group (runtime.kv_cache): a model with sliding
and full layers grows, preempts and frees all of them together. A sequence whose next uncached block another
sequence computes in the same step waits one step (keeping its place) and then finds it cached. The output is plain data, so it is tested on the
CPU without a model.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.runtime.kv_cache import BlockManager
from pdserve.runtime.scoring import SCORE_CHUNK
from pdserve.runtime.sequence import SeqStatus, Sequence
from pdserve_client.protocol import FinishReason


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended here: could never fit the pool


def _chunk(seq: Sequence, budget: int) -> int:
    """Tokens seq computes this step: what is left, within the budget (a scoring prompt: SCORE_CHUNK at most)."""
    n = min(seq.num_uncomputed, budget)
    return n if seq.prompt_scores is None else min(n, SCORE_CHUNK)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue in arrival order within a priority class, higher classes first."""
        seq.status = SeqStatus.WAITING
        if len(seq.block_tables) != self.blocks.groups and not any(seq.block_tables):
            seq.block_tables = self.blocks.new_tables()
        if not self.waiting or self.waiting[-1].priority >= seq.priority:
            self.waiting.append(seq)
            return
        at = next(i for i, s in enumerate(self.waiting) if s.priority < seq.priority)
        self.waiting.insert(at, seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already in its blocks (a prefill hand-off) to the batch."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kept: list[Sequence] = []
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            n = _chunk(seq, budget)
            while not self.blocks.ensure_tables(seq.block_tables, seq.num_computed_tokens + n):
                victim = min(queue + [seq], key=lambda s: (s.priority, -s.arrival_time))
                if victim is not seq:
                    queue.remove(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                kept.append(seq)
                out.scheduled.append((seq, n))
                budget -= n
        kept.extend(queue)  # running but out of budget this step
        self.running = kept
        if not out.preempted:  # admitting while preempting would just thrash
            self._admit(out, budget)
        if not self.running and self.waiting:
            self._drop_unfittable(out)
        return out

    def _drop_unfittable(self, out: SchedulerOutput) -> None:
        # With nothing running the whole pool is free: a head that still does not fit never will.
        seq = self.waiting[0]
        if self.blocks.table_blocks(seq.num_tokens, self.max_num_batched_tokens) > self.blocks.free_blocks:
            self.finish(seq, FinishReason.LENGTH)
            out.finished.append(seq)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        computing = self._computing(out.scheduled)
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._match_prefix(seq)
            self.blocks.drop_outside_windows(seq.block_tables, seq.num_computed_tokens)  # a long cached prefix: only its window kept
            if self._defer(seq, computing):
                self._unmatch(seq)
                deferred.append(self.waiting.popleft())
                continue
            n = _chunk(seq, budget)
            if not self.blocks.ensure_tables(seq.block_tables, seq.num_computed_tokens + n):
                if hit:
                    self._unmatch(seq)
                break
            if self.blocks.prefix_cache:
                self.blocks.count_lookup(seq.num_tokens, hit)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            computing.update(self._computing([(seq, n)]))
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # first in the next step, in their order

    def _computing(self, scheduled: list[tuple[Sequence, int]]) -> set[bytes]:
        """Keys of the blocks this step fills (registered after it): with the prefix cache on."""
        if not self.blocks.prefix_cache:
            return set()
        bs = self.blocks.block_size
        keys: set[bytes] = set()
        for seq, n in scheduled:
            first, full = seq.num_computed_tokens // bs, (seq.num_computed_tokens + n) // bs
            if full > first:
                keys.update(seq.hashes(bs, full, self.blocks.prefix_key)[first:])
        return keys

    def _defer(self, seq: Sequence, computing: set[bytes]) -> bool:
        """Whether seq's next uncached block is being computed in this step by another sequence
        (a burst of prompts sharing a prefix): admitted next step, it finds that block cached
        instead of computing it again (vLLM would compute it twice)."""
        if not computing:
            return False
        bs = self.blocks.block_size
        keys = seq.hashes(bs, (seq.num_tokens - 1) // bs, self.blocks.prefix_key)
        k = seq.num_computed_tokens // bs
        return k < len(keys) and keys[k] in computing

    def _unmatch(self, seq: Sequence) -> None:
        self.blocks.free_tables(seq.block_tables)
        seq.num_computed_tokens = 0

    def _match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with nothing computed the cached blocks of its prefix; tokens hit."""
        if not self.blocks.prefix_cache or seq.block_table or seq.prompt_scores is not None:
            return 0  # a scoring sequence computes every prompt row (runtime/scoring.py)
        bs = self.blocks.block_size
        n = (seq.num_tokens - 1) // bs
        seq.block_tables = [self.blocks.match(seq.hashes(bs, n, self.blocks.prefix_key), seq.tokens(0, n * bs))]  # one group (prefix_cache)
        seq.num_computed_tokens = len(seq.block_table) * bs
        return seq.num_computed_tokens

    def register_computed(self, seq: Sequence, before: int) -> None:
        """Register the blocks that became full of computed tokens (from `before` computed on)."""
        bs = self.blocks.block_size
        full = seq.num_computed_tokens // bs
        first = before // bs
        if self.blocks.prefix_cache and full > first:
            self.blocks.register(seq.block_table, seq.hashes(bs, full, self.blocks.prefix_key), first, seq.tokens(first * bs, full * bs))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.blocks.free_tables(seq.block_tables)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def hold(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch keeping its blocks (a prefill engine's
        sequence after its first token: the hand-off reads them, then `finish` frees them)."""
        self.running.remove(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take seq out of the scheduler (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_tables(seq.block_tables)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
