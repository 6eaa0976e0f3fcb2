"""Tensor parallelism's parts that are not the model: the split checks, the weight shards, the
rank group and the step plan rank 0 sends the other ranks.

Lifecycle: a worker with `--tensor-parallel-size N` checks its model with `check_split` (heads,
KV heads, the MLP width and, for GGUF blocks, the block boundaries must split N ways: a model
that does not is refused at start; KV heads are never replicated) and its devices with
`rank_devices` (CPU: every rank on the CPU; CUDA: one GPU per rank, more ranks than visible GPUs
refused at start), then each of its N rank processes opens a `RankGroup` (its compute group gloo
on the CPU, NCCL on CUDA: `compute_backend`; the rendezvous below) and takes
its `shard(tensors, rank, n)` of the HF-named checkpoint tensors: Megatron's layout, column
split (whole output rows) for q/k/v and gate/up, row split (whole GGUF blocks of the input dim)
for o and down, the vocabulary split for the embedding and the LM head; a mixture of experts'
stacks give every expert's gate / up rows and down columns (`expert_rows_part`, `expert_cols_part`),
GGUF expert stacks (kernels.quant.QuantExperts) in whole blocks too: always for gate / up (a row's
blocks lie along hidden), for down where a rank's share of the experts' width is whole blocks of
its type (32 weights, a K-quant's 256), else that down stack's share is dequantized to float
(one warning per shard, naming the width and the block). Every step rank 0 sends
the step's `StepPlan` (msgspec bytes broadcast over the plan group: no pickle) and every rank
runs the same forward (runtime.tp_model); `StepPlan(stop=True)` ends the other ranks' loop.

Two groups share the store: `plan` (always gloo: the plan is bytes on the host) waits without a
deadline-worth timeout (an idle worker's ranks wait there for the next step), `compute` carries
the forward's collectives with a short timeout, so a rank that stops answering mid-step fails
its peers' collective instead of hanging them; a rank that dies closes its sockets and its
peers' pending collective fails at once.

The rendezvous listens nowhere: rank 0 makes a private directory (`make_rendezvous`: mkdtemp,
0700) holding a random 32-byte token (0600) and the groups' FileStore, and gives the other ranks
its path (never the token) on their command line; every gloo socket listens and connects on
127.0.0.1 (`loopback_gloo`). A group is used only after every pair of ranks has swapped HMAC
proofs of the token over its own connection (`RankGroup.authenticate`, RankAuthError otherwise),
so only a process that can read the directory (this user's) can join, send a plan or read one.
Rank 0 removes the directory when it closes (`RankGroup.close`, from worker.tp_ranks.Ranks.close);
a rank 0 killed outright leaves it behind (a few bytes, still 0700). NCCL: `_nccl_group`.

Which KV heads a rank holds is `kv_head_range`, the one mapping: the forward reads and writes
those heads, and a hand-off between workers of different TP sizes follows `head_routes` (which
rank of one sends which of its heads to which rank of the other; kvtransfer.heads).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import tempfile
from typing import NamedTuple

import msgspec
import torch
import torch.distributed as dist

from pdserve.common.errors import NotSupportedError, UnsupportedModelError
from pdserve.kernels.quant import QuantExperts, QuantTensor, block_weights, row_bytes
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.layer import has_shared_expert, is_moe
from pdserve_client.errors import InvalidRequestError

PLAN_TIMEOUT_S = 7 * 24 * 3600  # ranks idle between steps wait this long for rank 0's next plan
COMPUTE_TIMEOUT_S = 10.0  # a collective inside a step: a peer silent this long has hung
STORE_TIMEOUT_S = 60.0  # a rank waits this long for what another puts in the store (its address, its pool)
AUTH_TIMEOUT_S = 60.0  # a peer whose proof has not come this long after the group formed has failed
AUTH_TAG = 0x7D5  # the proofs' tag on the gloo pairs (nothing else is sent point to point)
LOOPBACK = "127.0.0.1"  # every rank of a group is on this host: its sockets need no other address
STORE_FILE, TOKEN_FILE = "store", "token"  # in the rendezvous directory

log = logging.getLogger("pdserve.runtime")


def check_split(cfg: ModelConfig, n: int) -> None:
    """Refuse a model whose attention heads, KV heads or MLP width do not divide by n."""
    if n < 1:
        raise UnsupportedModelError(f"tensor parallel size must be >= 1, got {n}")
    widths = [("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads), ("MLP width", cfg.intermediate_size)]
    if cfg.num_experts:  # each rank holds every expert, a 1/n share of each one's width (and of the shared expert's)
        widths += [("experts' MLP width", cfg.moe_intermediate_size), ("shared expert's MLP width", cfg.shared_expert_intermediate_size)]
    for what, count in widths:
        if count % n:
            raise UnsupportedModelError(
                f"tensor parallel size {n} does not divide the model's {count} {what} "
                f"(heads {cfg.num_heads}, KV heads {cfg.num_kv_heads}: KV heads are split, never replicated)")


def rank_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """What one rank runs: its share of heads, KV heads and MLP width (its KV pool holds its KV
    heads); hidden size and vocabulary stay whole (the vocabulary split is the model's own)."""
    check_split(cfg, n)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                               intermediate_size=cfg.intermediate_size // n, moe_intermediate_size=cfg.moe_intermediate_size // n,
                               shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // n)


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
    if cols % block_weights(w.qtype):
        raise UnsupportedModelError(
            f"{name}: {w.qtype} blocks hold {block_weights(w.qtype)} weights; a {n}-way split of width {w.shape[1]} gives {cols} per rank, "
            f"not whole blocks (serve it with --quantization none, or another tensor parallel size)")
    width = row_bytes(w.qtype, cols)
    return QuantTensor(_own(w.raw[:, rank * width:(rank + 1) * width]), w.qtype, (w.shape[0], cols))


def vocab_part(w, rank: int, n: int):
    """Rank's rows of an embedding or LM head (vocab, hidden)."""
    start, end = vocab_range(w.shape[0], rank, n)
    if isinstance(w, QuantTensor):
        return QuantTensor(_own(w.raw[start:end]), w.qtype, (end - start, w.shape[1]))
    return _own(w[start:end])


def expert_rows_part(stack, rank: int, n: int):
    """Rank's share of every expert's rows of a gate or up stack (E, I, hidden) -> (E, I / n, hidden):
    float, or blocks (a row's blocks lie along hidden, so a row cut is always whole blocks)."""
    rows = stack.shape[1] // n
    if isinstance(stack, QuantExperts):
        return QuantExperts(_own(stack.raw[:, rank * rows:(rank + 1) * rows]), stack.qtype, (stack.shape[0], rows, stack.shape[2]))
    return _own(stack[:, rank * rows:(rank + 1) * rows])


def expert_cols_part(stack, rank: int, n: int):
    """Rank's share of every expert's columns of a down stack (E, hidden, I) -> (E, hidden, I / n):
    float, or blocks where I / n is whole blocks of the stack's type; None where it is not."""
    cols = stack.shape[2] // n
    if not isinstance(stack, QuantExperts):
        return _own(stack[:, :, rank * cols:(rank + 1) * cols])
    if cols % block_weights(stack.qtype):
        return None
    width = row_bytes(stack.qtype, cols)
    return QuantExperts(_own(stack.raw[:, :, rank * width:(rank + 1) * width]), stack.qtype, (stack.shape[0], stack.shape[1], cols))


def shard(cfg: ModelConfig, tensors: dict, rank: int, n: int) -> dict:
    """Rank's part of the HF-named checkpoint tensors (`lm_head.weight` only when untied)."""
    check_split(cfg, n)
    dense_downs = []  # MoE layers whose experts' down share is not whole blocks (dequantized)
    out = {"model.embed_tokens.weight": vocab_part(tensors["model.embed_tokens.weight"], rank, n),
           "model.norm.weight": tensors["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = vocab_part(tensors["lm_head.weight"], rank, n)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        moe = is_moe(cfg, i)
        mlp = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj") if moe and has_shared_expert(cfg) else \
            () if moe else ("mlp.gate_proj", "mlp.up_proj")
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", *mlp):
            out[p + name + ".weight"] = column_part(tensors[p + name + ".weight"], rank, n)
            if p + name + ".bias" in tensors:
                out[p + name + ".bias"] = column_part(tensors[p + name + ".bias"].unsqueeze(1), rank, n).squeeze(1)
        down = ("mlp.shared_expert.down_proj",) if moe and cfg.shared_expert_intermediate_size else () if moe else ("mlp.down_proj",)
        for name in ("self_attn.o_proj", *down):
            out[p + name + ".weight"] = row_part(tensors[p + name + ".weight"], rank, n, p + name)
        if moe:  # every expert on every rank, a 1/n share of its width: gate / up rows, down columns; the router whole
            e = p + "mlp.experts."
            for name in ("gate_proj", "up_proj"):
                out[e + name] = expert_rows_part(tensors[e + name], rank, n)
            out[e + "down_proj"] = expert_cols_part(tensors[e + "down_proj"], rank, n)
            if out[e + "down_proj"] is None:  # not whole blocks: this stack's share as float
                out[e + "down_proj"] = expert_cols_part(tensors[e + "down_proj"].dequantize(), rank, n)
                dense_downs.append(i)
            for name in ("mlp.gate.weight", "mlp.shared_expert_gate.weight"):
                if p + name in tensors:
                    out[p + name] = tensors[p + name]
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            if p + name + ".weight" in tensors:  # q_norm / k_norm (Qwen3, Gemma 3) and Gemma's other norms: whole on every rank
                out[p + name + ".weight"] = tensors[p + name + ".weight"]
    if dense_downs:
        down = tensors[f"model.layers.{dense_downs[0]}.mlp.experts.down_proj"]
        log.warning("tensor parallel size %d: each rank's share of the experts' width, %d, is not whole %s blocks (%d weights), so the "
                    "experts' down_proj stacks of %d layer(s) are dequantized to float on each rank (gate / up stay in blocks)",
                    n, down.shape[2] // n, down.qtype, block_weights(down.qtype), len(dense_downs))
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
    groups: int = 0  # a model with KV groups (runtime.kv_groups): how many; 0: one (no group fields)
    group_slots: bytes = b""  # ForwardBatch.group_slots, (groups, T) int64
    group_tables: bytes = b""  # ForwardBatch.group_tables, (groups, B, table_width) int32


_PLAN_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "logits_indices")
_PLAN_DTYPES = {"query_start_loc": torch.int32, "seq_lens": torch.int32, "block_tables": torch.int32}


def _raw(t: torch.Tensor) -> bytes:
    return t.cpu().contiguous().numpy().tobytes()


def plan_of(batch) -> StepPlan:
    grouped = {} if batch.group_slots is None else {
        "groups": batch.group_slots.shape[0], "group_slots": _raw(batch.group_slots), "group_tables": _raw(batch.group_tables)}
    return StepPlan(**{f: _raw(getattr(batch, f)) for f in _PLAN_FIELDS},
                    table_width=batch.block_tables.shape[1], max_query_len=batch.max_query_len, **grouped)


def batch_of(plan: StepPlan, device="cpu"):
    from pdserve.runtime.model import ForwardBatch

    fields = {f: torch.frombuffer(bytearray(getattr(plan, f)), dtype=_PLAN_DTYPES.get(f, torch.int64)).to(device) if getattr(plan, f)
              else torch.empty(0, dtype=_PLAN_DTYPES.get(f, torch.int64), device=device) for f in _PLAN_FIELDS}
    fields["block_tables"] = fields["block_tables"].view(-1, plan.table_width) if plan.table_width else fields["block_tables"].view(0, 0)
    if plan.groups:
        fields["group_slots"] = torch.frombuffer(bytearray(plan.group_slots), dtype=torch.int64).to(device).view(plan.groups, -1)
        fields["group_tables"] = torch.frombuffer(bytearray(plan.group_tables), dtype=torch.int32).to(device).view(
            plan.groups, -1, plan.table_width)
    return ForwardBatch(**fields, max_query_len=plan.max_query_len)


class RankAuthError(RuntimeError):
    """A peer of the rank group did not prove it knows the group's token: the group is not used."""


def make_rendezvous() -> str:
    """Rank 0: a private (0700) directory for one group's rendezvous, holding its random token
    (0600, written once); its path is what the other ranks are given (RankSpec.rendezvous)."""
    path = tempfile.mkdtemp(prefix="pdserve-tp-")  # 0700, made by this user
    fd = os.open(os.path.join(path, TOKEN_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return path


def read_token(path: str) -> bytes:
    with open(os.path.join(path, TOKEN_FILE), "rb") as f:
        return f.read()


def pair_proof(token: bytes, group: str, src: int, dst: int) -> bytes:
    """What rank src sends rank dst over their connection in `group`: bound to the pair and the
    group, so that no proof seen on one connection is worth anything on another."""
    return hmac.new(token, f"pdserve-tp {group} {src}->{dst}".encode(), hashlib.sha256).digest()


def loopback_gloo(store, rank: int, size: int, timeout: datetime.timedelta):
    """A gloo group whose sockets listen and connect on 127.0.0.1 only (gloo's default device binds
    the address the host's name resolves to)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


class RankGroup:
    """This rank's two groups over a FileStore in the private directory rank 0 made (`rendezvous`;
    "" on rank 0: make one): plan (gloo) and compute (gloo on the CPU, NCCL on `device` when it is
    a GPU: torch.cuda.set_device(device) first). Nothing here listens beyond loopback, and a group
    is used only once every connection in it has proven the directory's token (`connect`)."""

    def __init__(self, rank: int, size: int, rendezvous: str = "", compute_timeout_s: float = COMPUTE_TIMEOUT_S, device: str = "cpu"):
        self.rank, self.size = rank, size
        self.device, self.backend = device, compute_backend(device)
        self.compute_timeout_s = compute_timeout_s
        self.owns_rendezvous = not rendezvous  # rank 0 made it and removes it (close)
        self.rendezvous = rendezvous or make_rendezvous()
        self.token = read_token(self.rendezvous)
        self.store = dist.FileStore(os.path.join(self.rendezvous, STORE_FILE), size)
        self.store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        self._encode, self._decode = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepPlan)
        self.plan_group = self.compute = None

    def connect(self) -> RankGroup:
        """Join the groups (blocks until all ranks have called it) and check every gloo connection
        carries the token's proof (RankAuthError if not)."""
        td = datetime.timedelta
        self.plan_group = loopback_gloo(dist.PrefixStore("plan", self.store), self.rank, self.size, td(seconds=PLAN_TIMEOUT_S))
        self.authenticate(self.plan_group, "plan")
        compute = dist.PrefixStore("compute", self.store)
        if self.backend == "nccl":
            self.compute = _nccl_group(compute, self.rank, self.size, td(seconds=self.compute_timeout_s), self.device)
        else:
            self.compute = loopback_gloo(compute, self.rank, self.size, td(seconds=self.compute_timeout_s))
            self.authenticate(self.compute, "compute")
        return self

    def authenticate(self, group, name: str) -> None:
        """Each pair of ranks swaps proofs of the token over its own connection (gloo's send and
        recv use the pair's socket, the one every collective uses): a process that took a rank's
        place without the token fails its peers' check, and nothing else it sent is read."""
        sends, recvs = [], {}
        for peer in range(self.size):
            if peer == self.rank:
                continue
            proof = torch.frombuffer(bytearray(pair_proof(self.token, name, self.rank, peer)), dtype=torch.uint8)
            sends.append(group.send([proof], peer, AUTH_TAG))
            recvs[peer] = torch.zeros(len(proof), dtype=torch.uint8)
            sends.append(group.recv([recvs[peer]], peer, AUTH_TAG))
        for work in sends:
            work.wait(datetime.timedelta(seconds=AUTH_TIMEOUT_S))
        for peer, got in recvs.items():
            if not hmac.compare_digest(got.numpy().tobytes(), pair_proof(self.token, name, peer, self.rank)):
                raise RankAuthError(f"tensor-parallel rank {peer} of the {name} group did not prove the group's token")

    def close(self) -> None:
        """Rank 0: remove the rendezvous directory (its store and token); the others' groups are
        connected by then or fail."""
        if self.owns_rendezvous:
            shutil.rmtree(self.rendezvous, ignore_errors=True)

    def publish(self, key: str, value: bytes) -> None:
        """Put bytes in the group's store for another rank (a rank's KV pool export for rank 0)."""
        self.store.set(key, value)

    def fetch(self, key: str) -> bytes:
        """Wait (STORE_TIMEOUT_S at most) for what another rank published under key."""
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
    by the processes' own watches (worker.tp_ranks).

    Ranks 1..n-1 bootstrap on loopback (NCCL_SOCKET_IFNAME=lo); rank 0 on NCCL's interface (the one
    NCCL_SOCKET_IFNAME names, else NCCL's choice: NCCL fixes it once per process, and rank 0's
    process also runs the nccl KV backend's communicators, across nodes too), where its bootstrap
    root answers only a peer that presents the unique id's random magic; that id travels in the
    private store. NCCL's connections are its own, not proven with the token as the gloo groups'
    are (no plan travels on them)."""
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"  # read when the group is made
    if rank:  # rank 0's process keeps the operator's interface: its NCCL also carries hand-offs to other nodes
        os.environ["NCCL_SOCKET_IFNAME"] = "lo"  # read once per process, at NCCL's first init
    torch.cuda.set_device(device)  # lazy init binds the communicator to the current device
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)
