"""Turns a SchedulerOutput into model inputs, runs the forward pass, and samples.

Lifecycle: built once per worker over a model and its KV pool; `execute(scheduled)` is called
once per step. It flattens the scheduled tokens of all sequences into one varlen batch (no
padding), maps each token to its cache slot (a table's entries freed before a sliding window
become block 0, which attention never reads: runtime.kv_cache; a model with KV groups gets
every group's slots and tables, ForwardBatch.group_slots / group_tables), and samples one token for every sequence whose
computed range reaches its last token (prefill done, or decode); for a sequence that asks for
prompt logprobs it also scores the chunk's prompt rows (runtime/scoring.py: their logits follow
the sampling rows). It does not change sequence state: the engine applies the sampled tokens and
the scores.
"""
from __future__ import annotations

import torch

from pdserve.runtime.kv_cache import NULL_BLOCK, BlockManager
from pdserve.runtime.model import ForwardBatch, LlamaModel
from pdserve.runtime.sampling import SamplerOutput, SamplingRow, sample
from pdserve.runtime.scoring import PromptScore, score, score_positions
from pdserve.runtime.sequence import Sequence


def _table_row(table: list[int], width: int) -> list[int]:
    """A block table as the kernels take it: width entries, padding and freed entries
    (NULL_BLOCK, before a sliding window, never read) as block 0, so any index stays in the pool."""
    row = table + [0] * (width - len(table))
    if row and row[0] == NULL_BLOCK:  # freed entries lead the table (runtime.kv_cache.drop_outside_window)
        row = [0 if b == NULL_BLOCK else b for b in row]
    return row


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, blocks: BlockManager, eos_token_id: int | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.blocks = blocks
        self.eos_token_id = eos_token_id
        self.device = kv_cache.device

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> tuple[ForwardBatch, list[Sequence], list[tuple[Sequence, range]]]:
        """The step's batch, the sequences that sample (their logits rows first, in order) and
        the (sequence, positions) whose prompt rows are scored (their rows after, in order)."""
        bs, groups = self.blocks.block_size, self.blocks.groups
        ids, pos, qsl, lens, logit_rows, samplers, score_rows, scoring = [], [], [0], [], [], [], [], []
        slots: list[list[int]] = [[] for _ in range(groups)]
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            end = start + n
            ids.extend(seq.tokens(start, end))
            pos.extend(range(start, end))
            for g, table in enumerate(seq.block_tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + n)
            lens.append(end)
            if end == seq.num_tokens:
                logit_rows.append(qsl[-1] - 1)
                samplers.append(seq)
            scored = score_positions(seq, start, end) if seq.prompt_scores is not None else range(0)
            if scored:
                score_rows.extend(qsl[-2] + p - start for p in scored)
                scoring.append((seq, scored))
        width = max(len(seq.block_table) for seq, _ in scheduled)  # every group's table is as long as the first's
        tables = [[_table_row(seq.block_tables[g], width) for seq, _ in scheduled] for g in range(groups)]
        dev = self.device
        group_slots = torch.tensor(slots, dtype=torch.int64, device=dev) if groups > 1 else None
        group_tables = torch.tensor(tables, dtype=torch.int32, device=dev) if groups > 1 else None
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            slot_mapping=group_slots[0] if groups > 1 else torch.tensor(slots[0], dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=group_tables[0] if groups > 1 else torch.tensor(tables[0], dtype=torch.int32, device=dev),
            max_query_len=max(n for _, n in scheduled),
            logits_indices=torch.tensor(logit_rows + score_rows, dtype=torch.int64, device=dev),
            group_slots=group_slots,
            group_tables=group_tables,
        )
        return batch, samplers, scoring

    def execute(self, scheduled: list[tuple[Sequence, int]]) \
            -> tuple[list[Sequence], SamplerOutput | None, list[tuple[Sequence, list[PromptScore]]]]:
        """Run one step; returns the sequences that sampled and their samples (row-aligned), and
        the new prompt scores of each scoring sequence."""
        batch, samplers, scoring = self.prepare(scheduled)
        logits = self.model(batch, self.kv_cache)  # (len(samplers) + scored rows, vocab)
        scores = self.score(logits[len(samplers):], scoring) if scoring else []
        if not samplers:
            return [], None, scores
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids) for s in samplers]
        return samplers, sample(logits[:len(samplers)], rows, eos_token_id=self.eos_token_id), scores

    @staticmethod
    def score(logits: torch.Tensor, scoring: list[tuple[Sequence, range]]) -> list[tuple[Sequence, list[PromptScore]]]:
        targets = [seq.prompt_token_ids[p + 1] for seq, scored in scoring for p in scored]
        ks = [seq.params.prompt_logprobs for seq, scored in scoring for _ in scored]
        flat = score(logits, targets, ks)
        out, at = [], 0
        for seq, scored in scoring:
            out.append((seq, flat[at:at + len(scored)]))
            at += len(scored)
        return out
