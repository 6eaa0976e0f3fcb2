"""Tensor parallelism's parts that are not the model: the split checks, the weight shards, the
rank group and the step plan rank 0 sends the other ranks.

Lifecycle: a worker with `--tensor-parallel-size N` checks its model with `check_split` (heads,
KV heads, the MLP width and, for GGUF blocks, the block boundaries must split N ways: a model
that does not is refused at start; KV heads are never replicated) and its devices with
`rank_devices` (CPU: every rank on the CPU; CUDA: one GPU per rank, more ranks than visible GPUs
refused at start), then each of its N rank processes opens a `RankGroup` (rendezvous on rank 0's
TCPStore on loopback; its compute group gloo on the CPU, NCCL on CUDA: `compute_backend`) and takes
its `shard(tensors, rank, n)` of the HF-named checkpoint tensors: Megatron's layout, column
split (whole output rows) for q/k/v and gate/up, row split (whole GGUF blocks of the input dim)
for o and down, the vocabulary split for the embedding and the LM head. Every step rank 0 sends
the step's `StepPlan` (msgspec bytes broadcast over the plan group: no pickle) and every rank
runs the same forward (runtime.tp_model); `StepPlan(stop=True)` ends the other ranks' loop.

Two groups share the store: `plan` (always gloo: the plan is bytes on the host) waits without a
deadline-worth timeout (an idle worker's ranks wait there for the next step), `compute` carries
the forward's collectives with a short timeout, so a rank that stops answering mid-step fails
its peers' collective instead of hanging them; a rank that dies closes its sockets and its
peers' pending collective fails at once.

Which KV heads a rank holds is `kv_head_range`, the one mapping: the forward reads and writes
those heads, and a hand-off between workers of different TP sizes follows `head_routes` (which
rank of one sends which of its heads to which rank of the other; kvtransfer.heads).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from typing import NamedTuple

import msgspec
import torch
import torch.distributed as dist

from pdserve.common.errors import NotSupportedError, UnsupportedModelError
from pdserve.kernels.quant import BLOCK, QTYPES, QuantTensor
from pdserve.runtime.config import ModelConfig
from pdserve_client.errors import InvalidRequestError

PLAN_TIMEOUT_S = 7 * 24 * 3600  # ranks idle between steps wait this long for rank 0's next plan
COMPUTE_TIMEOUT_S = 10.0  # a collective inside a step: a peer silent this long has hung


def check_split(cfg: ModelConfig, n: int) -> None:
    """Refuse a model whose attention heads, KV heads or MLP width do not divide by n."""
    if n < 1:
        raise UnsupportedModelError(f"tensor parallel size must be >= 1, got {n}")
    for what, count in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads), ("MLP width", cfg.intermediate_size)):
        if count % n:
            raise UnsupportedModelError(
                f"tensor parallel size {n} does not divide the model's {count} {what} "
                f"(heads {cfg.num_heads}, KV heads {cfg.num_kv_heads}: KV heads are split, never replicated)")


def rank_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """What one rank runs: its share of heads, KV heads and MLP width (its KV pool holds its KV
    heads); hidden size and vocabulary stay whole (the vocabulary split is the model's own)."""
    check_split(cfg, n)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                               intermediate_size=cfg.intermediate_size // n)


def kv_head_range(num_kv_heads: int, rank: int, n: int) -> tuple[int, int]:
    """The KV heads [start, end) (of the model's) that rank of n holds: its KV pool's, its forward's."""
    if num_kv_heads % n:
        raise UnsupportedModelError(f"{num_kv_heads} KV heads do not split {n} ways (KV heads are split, never replicated)")
    per = num_kv_heads // n
    return rank * per, (rank + 1) * per


class HeadRoute(NamedTuple):
    """One piece of a hand-off between a worker of TP src_n and one of TP dst_n: rank `src` of the
    sender sends its heads `src_heads` (a slice of its own KV heads) into rank `dst`'s `dst_heads`."""

    src: int
    dst: int
    src_heads: slice
    dst_heads: slice


def head_routes(num_kv_heads: int, src_n: int, dst_n: int) -> list[HeadRoute]:
    """Each pair of ranks whose KV heads overlap, and the overlap: every head travels once, from
    the rank that holds it to the rank that will (3 -> 1: three routes into rank 0; 1 -> 3: rank 0's
    heads split three ways; equal sizes: rank r to rank r)."""
    routes = []
    for s in range(src_n):
        s0, s1 = kv_head_range(num_kv_heads, s, src_n)
        for d in range(dst_n):
            d0, d1 = kv_head_range(num_kv_heads, d, dst_n)
            lo, hi = max(s0, d0), min(s1, d1)
            if lo < hi:
                routes.append(HeadRoute(s, d, slice(lo - s0, hi - s0), slice(lo - d0, hi - d0)))
    return routes


def rank_devices(device: str, n: int, visible_gpus: int) -> list[str]:
    """Each of a worker's n ranks' device: all on the CPU, or on CUDA one GPU per rank, rank r on
    cuda:(k + r) for `--device cuda:k` (`cuda`: k = 0; CUDA_VISIBLE_DEVICES chooses which GPUs are
    seen). More ranks than GPUs from k on is refused at start, before any rank starts."""
    if device.startswith("cpu"):
        return [device] * n
    if not device.startswith("cuda"):
        raise NotSupportedError(f"tensor parallelism on {device} is not supported (cpu: gloo, cuda: NCCL)")
    base = device.partition(":")[2]
    if base and not base.isdigit():
        raise InvalidRequestError(f"device {device!r}: expected cuda or cuda:<index>")
    base = int(base or 0)
    if n > 1 and base + n > visible_gpus:
        raise InvalidRequestError(
            f"tensor parallel size {n} needs {n} GPUs (one per rank, cuda:{base} to cuda:{base + n - 1}) but this process sees "
            f"{visible_gpus} (CUDA_VISIBLE_DEVICES chooses which; --device cuda:k starts at k)")
    return [f"cuda:{base + r}" for r in range(n)]


def compute_backend(device: str) -> str:
    """The compute group's torch.distributed backend: gloo on the CPU, NCCL on CUDA."""
    if not device.startswith("cuda"):
        return "gloo"
    if not dist.is_nccl_available():
        raise NotSupportedError("tensor parallelism on CUDA needs NCCL, which this torch build lacks (a CUDA build of torch has it)")
    return "nccl"


def vocab_range(vocab: int, rank: int, n: int) -> tuple[int, int]:
    """The rows [start, end) of the embedding and LM head rank holds (the last may hold fewer)."""
    per = -(-vocab // n)
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a slice: a view (even a contiguous one) would keep the whole matrix alive."""
    return t.clone(memory_format=torch.contiguous_format)


def column_part(w, rank: int, n: int):
    """Rank's whole output rows of w (out, in): a float slice, or the rows of GGUF blocks."""
    rows = w.shape[0] // n
    if isinstance(w, QuantTensor):
        return QuantTensor(_own(w.raw[rank * rows:(rank + 1) * rows]), w.qtype, (rows, w.shape[1]))
    return _own(w[rank * rows:(rank + 1) * rows])


def row_part(w, rank: int, n: int, name: str = "weight"):
    """Rank's share of w's input dim (out, in / n); GGUF blocks split only on block boundaries."""
    cols = w.shape[1] // n
    if w.shape[1] % n:
        raise UnsupportedModelError(f"{name}: input width {w.shape[1]} does not split {n} ways")
    if not isinstance(w, QuantTensor):
        return _own(w[:, rank * cols:(rank + 1) * cols])
    if cols % BLOCK:
        raise UnsupportedModelError(
            f"{name}: {w.qtype} blocks hold {BLOCK} weights; a {n}-way split of width {w.shape[1]} gives {cols} per rank, "
            f"not whole blocks (serve it with --quantization none, or another tensor parallel size)")
    width = cols // BLOCK * QTYPES[w.qtype][1]
    return QuantTensor(_own(w.raw[:, rank * width:(rank + 1) * width]), w.qtype, (w.shape[0], cols))


def vocab_part(w, rank: int, n: int):
    """Rank's rows of an embedding or LM head (vocab, hidden)."""
    start, end = vocab_range(w.shape[0], rank, n)
    if isinstance(w, QuantTensor):
        return QuantTensor(_own(w.raw[start:end]), w.qtype, (end - start, w.shape[1]))
    return _own(w[start:end])


def shard(cfg: ModelConfig, tensors: dict, rank: int, n: int) -> dict:
    """Rank's part of the HF-named checkpoint tensors (`lm_head.weight` only when untied)."""
    check_split(cfg, n)
    out = {"model.embed_tokens.weight": vocab_part(tensors["model.embed_tokens.weight"], rank, n),
           "model.norm.weight": tensors["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = vocab_part(tensors["lm_head.weight"], rank, n)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            out[p + name + ".weight"] = column_part(tensors[p + name + ".weight"], rank, n)
            if p + name + ".bias" in tensors:
                out[p + name + ".bias"] = column_part(tensors[p + name + ".bias"].unsqueeze(1), rank, n).squeeze(1)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            out[p + name + ".weight"] = row_part(tensors[p + name + ".weight"], rank, n, p + name)
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            if p + name + ".weight" in tensors:  # q_norm / k_norm: Qwen3's, over the head dim, whole on every rank
                out[p + name + ".weight"] = tensors[p + name + ".weight"]
    return out


class StepPlan(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step of the forward, as rank 0 scheduled it: runtime.model.ForwardBatch's tensors as
    raw little-endian bytes (int64, or int32 where the batch holds int32)."""

    input_ids: bytes = b""
    positions: bytes = b""
    slot_mapping: bytes = b""
    query_start_loc: bytes = b""
    seq_lens: bytes = b""
    block_tables: bytes = b""
    table_width: int = 0
    max_query_len: int = 0
    logits_indices: bytes = b""
    stop: bool = False  # the worker is closing: the other ranks leave their loop


_PLAN_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "logits_indices")
_PLAN_DTYPES = {"query_start_loc": torch.int32, "seq_lens": torch.int32, "block_tables": torch.int32}


def plan_of(batch) -> StepPlan:
    return StepPlan(**{f: getattr(batch, f).cpu().contiguous().numpy().tobytes() for f in _PLAN_FIELDS},
                    table_width=batch.block_tables.shape[1], max_query_len=batch.max_query_len)


def batch_of(plan: StepPlan, device="cpu"):
    from pdserve.runtime.model import ForwardBatch

    fields = {f: torch.frombuffer(bytearray(getattr(plan, f)), dtype=_PLAN_DTYPES.get(f, torch.int64)).to(device) if getattr(plan, f)
              else torch.empty(0, dtype=_PLAN_DTYPES.get(f, torch.int64), device=device) for f in _PLAN_FIELDS}
    fields["block_tables"] = fields["block_tables"].view(-1, plan.table_width) if plan.table_width else fields["block_tables"].view(0, 0)
    return ForwardBatch(**fields, max_query_len=plan.max_query_len)


class RankGroup:
    """This rank's two groups over the TCPStore rank 0 serves on loopback: plan (gloo) and compute
    (gloo on the CPU, NCCL on `device` when it is a GPU: torch.cuda.set_device(device) first)."""

    def __init__(self, rank: int, size: int, port: int = 0, compute_timeout_s: float = COMPUTE_TIMEOUT_S, device: str = "cpu"):
        self.rank, self.size = rank, size
        self.device, self.backend = device, compute_backend(device)
        self.compute_timeout_s = compute_timeout_s
        # rank 0 serves the store (port 0: any free port; `port` tells the others where)
        self.store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        self.port = self.store.port
        self._encode, self._decode = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepPlan)
        self.plan_group = self.compute = None

    def connect(self) -> RankGroup:
        """Join the groups (blocks until all ranks have called it)."""
        td = datetime.timedelta
        self.plan_group = dist.ProcessGroupGloo(dist.PrefixStore("plan", self.store), self.rank, self.size, td(seconds=PLAN_TIMEOUT_S))
        compute = dist.PrefixStore("compute", self.store)
        if self.backend == "nccl":
            self.compute = _nccl_group(compute, self.rank, self.size, td(seconds=self.compute_timeout_s), self.device)
        else:
            self.compute = dist.ProcessGroupGloo(compute, self.rank, self.size, td(seconds=self.compute_timeout_s))
        return self

    def publish(self, key: str, value: bytes) -> None:
        """Put bytes in the group's store for another rank (a rank's KV pool export for rank 0)."""
        self.store.set(key, value)

    def fetch(self, key: str) -> bytes:
        """Wait (the store's 60 s at most) for what another rank published under key."""
        return self.store.get(key)

    def agree_min(self, value: int) -> int:
        """The least of every rank's value (all ranks call it at the same point, before the first
        plan): on CUDA the KV blocks each rank's own budget buys, so that one block id is a block on every rank."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.plan_group.allreduce([t], opts).wait()
        return int(t)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.compute.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [[torch.empty_like(t) for _ in range(self.size)]]
        self.compute.allgather(out, [t.contiguous()]).wait()
        return out[0]

    def send_plan(self, plan: StepPlan) -> None:
        """Rank 0: the step's plan to every other rank."""
        self._bcast(bytearray(self._encode.encode(plan)))

    def recv_plan(self) -> StepPlan:
        """Another rank: wait for rank 0's next plan."""
        return self._decode.decode(self._bcast(None))

    def _bcast(self, data: bytearray | None) -> bytes:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self.plan_group.broadcast([size], opts).wait()
        buf = torch.frombuffer(data, dtype=torch.uint8) if data is not None else torch.empty(int(size), dtype=torch.uint8)
        self.plan_group.broadcast([buf], opts).wait()
        return buf.numpy().tobytes()


def _nccl_group(store, rank: int, size: int, timeout: datetime.timedelta, device: str):
    """The compute group on NCCL (CUDA only: never called on the CPU, where the class is absent).

    An NCCL collective whose peer is gone does not fail: its kernel waits on the GPU, and `wait()`
    only orders the current stream after it. What ends it is torch's watchdog thread: a collective
    older than `timeout` makes it take the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=3,
    torch's default since 2.2, set here so that an inherited setting cannot turn it off), so no
    rank waits in a collective longer than COMPUTE_TIMEOUT_S. A rank that dies is noticed sooner
    by the processes' own watches (worker.tp_ranks)."""
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"  # read when the group is made
    torch.cuda.set_device(device)  # lazy init binds the communicator to the current device
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)
