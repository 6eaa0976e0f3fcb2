"""CUDA graphs for decode steps: the model's forward captured once per padded batch size, then replayed.

Lifecycle: `enable(engine)` (an engine on a CUDA device) swaps the engine's ModelRunner for a
`GraphRunner` over the same model, KV pool and block manager. A step in which every sequence
decodes one token, with at most `max_batch` sequences, runs by replay: the eagerly prepared
inputs are copied into the static buffers of the smallest captured size that holds them, and
padding rows repeat row 0 (same token, position, slot and pages), so they rewrite row 0's slot
with the same values and their logits are dropped. Any other step (prefill, chunked or mixed
batches, more sequences) runs eagerly, exactly as before. A size is captured the first time it
is needed, after one eager warm-up run on a side stream (Triton compiles and loads its kernels
outside the capture); all graphs share one memory pool. The block table is padded to the width
that max_model_len needs, which the decode kernel reads only up to each sequence's length. A
model with KV groups (runtime.kv_groups: a block table per group) always runs eagerly: the
captured batch holds one table.
"""
from __future__ import annotations

import torch

from pdserve.common.errors import NotSupportedError
from pdserve.runtime.model import ForwardBatch
from pdserve.runtime.model_runner import ModelRunner
from pdserve.runtime.sampling import SamplingRow, sample


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (padding wastes at most 7 rows)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]


class _Graph:
    """One captured forward of `size` rows: static inputs (a ForwardBatch) and static logits."""

    def __init__(self, size: int, width: int, device: torch.device):
        def z(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.size = size
        self.batch = ForwardBatch(
            input_ids=z(size), positions=z(size), slot_mapping=z(size),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),  # one query token per row
            seq_lens=z(size, dtype=torch.int32), block_tables=z(size, width, dtype=torch.int32), max_query_len=1,
            logits_indices=torch.arange(size, dtype=torch.int64, device=device),
        )
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None  # (size, vocab) float32, written by every replay

    def load(self, b: ForwardBatch) -> None:
        """Copy a decode batch of n <= size rows in; rows n.. repeat row 0."""
        s, n = self.batch, b.input_ids.shape[0]
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            dst, src = getattr(s, name), getattr(b, name)
            dst[:n].copy_(src)
            dst[n:].copy_(src[:1].expand(self.size - n))
        width = b.block_tables.shape[1]
        s.block_tables[:n, :width].copy_(b.block_tables)
        s.block_tables[:n, width:].zero_()
        s.block_tables[n:].copy_(s.block_tables[:1].expand(self.size - n, -1))


class GraphRunner(ModelRunner):
    def __init__(self, model, kv_cache: torch.Tensor, blocks, eos_token_id: int | None, max_batch: int, max_blocks_per_seq: int):
        super().__init__(model, kv_cache, blocks, eos_token_id)
        self.sizes = capture_sizes(max_batch)
        self.width = max_blocks_per_seq
        self.graphs: dict[int, _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self.replays = 0  # steps that ran by replay (for tests and stats)

    def graphable(self, scheduled) -> bool:
        """Every sequence decodes exactly its last token, and the batch fits a capture size (one KV group)."""
        return (
            self.blocks.groups == 1 and 0 < len(scheduled) <= self.sizes[-1]
            and all(n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens and len(seq.block_table) <= self.width
                    for seq, n in scheduled)
        )

    def execute(self, scheduled):
        if not self.graphable(scheduled):
            return super().execute(scheduled)
        batch, samplers, _ = self.prepare(scheduled)  # decode: every sequence samples, rows in order; no prompt rows to score
        n = len(scheduled)
        size = next(s for s in self.sizes if s >= n)
        g = self.graphs.get(size) or self._capture(size, batch)
        g.load(batch)
        g.graph.replay()
        self.replays += 1
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids) for s in samplers]
        return samplers, sample(g.logits[:n], rows, eos_token_id=self.eos_token_id), []

    def _capture(self, size: int, batch: ForwardBatch) -> _Graph:
        g = _Graph(size, self.width, self.device)
        g.load(batch)  # real inputs: the warm-up rewrites this step's slots with the values the replay writes
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.model(g.batch, self.kv_cache)  # compiles and loads the kernels outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self.mempool):
            g.logits = self.model(g.batch, self.kv_cache)
        self.graphs[size] = g
        return g


def enable(engine, max_batch: int | None = None) -> GraphRunner:
    """Make `engine` replay CUDA graphs for its decode steps; returns the new runner."""
    r = engine.runner
    if not r.kv_cache.is_cuda:
        raise NotSupportedError(f"CUDA graphs need the engine on a CUDA device, not {r.kv_cache.device}")
    if isinstance(r, GraphRunner):
        return r
    width = engine.blocks.blocks_for(engine.max_model_len)
    engine.runner = GraphRunner(r.model, r.kv_cache, r.blocks, r.eos_token_id, max_batch or engine.config.max_num_seqs, width)
    return engine.runner
