"""The wire protocol between pdserve's own processes, as msgspec Structs: the worker-facing
messages. The client-facing ones (client <-> coordinator), their `Message` base and the codec
(`encode`, `decoder`) are in pdserve_client/protocol.py, the client distribution's one copy.

Lifecycle of one request (docs/architecture.md; coordinator/server.py holds its states):
  client  -> coordinator   GenerateRequest
  coord   -> decode        Admit            decode reserves KV blocks for the prompt
  decode  -> coord         Granted | AdmitRefused
  coord   -> prefill       Prefill          with the decode worker's block ids and kv endpoint
  prefill -> decode        KVConnect -> KVAccept once per destination: its pool, whatever the backend
  prefill -> decode        KVPart ... (streamed hand-off) each chunk's finished blocks as prefill computes them
  prefill -> decode        KVReady (+ raw block frames for tcp) on the decode worker's kv socket: the rest, last
  decode  -> coord         PromptLogprobs   (asked for only) the prompt's scores, before its first token's batch
  decode  -> coord         TokenBatch       every step's tokens; an entry with finish_reason ends it
  coord   -> client        Delta ... Final  (or ErrorReply at any point)
  colocated mode: coord -> worker Generate, then TokenBatch as above.
A launcher's NodeReport (restart counts) and DrainWorker (a scale-down) come on the worker port too,
with the worker keys (pdserve/launcher_link.py).
Each socket has one typed decoder over the union of what may arrive on it; tensors travel as
extra zero-copy frames after the msgpack body, never inside it. No pickle anywhere.
"""
from __future__ import annotations

import enum
from typing import Annotated, Union

import msgspec

from pdserve_client.params import SamplingParams
from pdserve_client.protocol import FinishReason, PromptLogprob
from pdserve_client.protocol import Message as _Msg

PROTOCOL_VERSION = 8  # 2: Admit, Granted and AdmitRefused carry the admission number; 3: typed roles and
# finish reasons, the destination pool described by KVAccept alone (not Hello, not Prefill); 4: grant numbers
# (Granted -> Prefill -> KVReady/KVFailed) and the writer named in Admit: fenced KV writes; 5: prefix-cache keys
# are 16-byte keyed BLAKE2b (Heartbeat), the secret comes in Welcome, Admit carries prefix tokens, not keys;
# 6: roles follow the load: Hello names the roles a worker can switch to, SetRole -> RoleSet; 7: prompt logprobs
# (SamplingParams.prompt_logprobs; KVReady carries them, PromptLogprobs and Delta bring them back); 8: streamed
# hand-offs (KVPart before KVReady, KVReady.streamed)
PrefixKey = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]  # a prefix-cache block key (runtime.prefix_hash)


class Role(enum.IntEnum):
    PREFILL = 0
    DECODE = 1
    COLOCATED = 2


# ------------------------------------------------------------------ worker <-> coordinator

class Hello(_Msg):
    version: int
    worker_id: str
    role: Role
    pid: int
    host: str
    boot_id: str  # two workers share memory only if host and boot id match
    model: str
    max_model_len: int
    num_blocks: int
    block_size: int
    kv_endpoint: str = ""  # decode/colocated: where prefill workers send KVReady (and ask KVConnect)
    profile: list[tuple[int, int, int, float]] = []  # start-up steps: (seqs, tokens, context tokens, seconds)
    engine: dict[str, str | int | float | bool | None] = {}  # its engine settings (EngineConfig.summary), shown in stats
    roles: list[Role] = []  # the roles it can take without a restart (SetRole); [] or [role]: only its own


class Welcome(_Msg):
    version: int
    # the coordinator's TPOT target in ms (the tightest of its classes), 0 without SLO control: how
    # long a decode worker may hold its streams while a prefill worker of its node runs (runtime.cores)
    tpot_ms: float = 0.0
    # the deployment's prefix-cache secret (runtime.prefix_hash): workers key their blocks with it, so the
    # keys their heartbeats report are the coordinator's; a new one empties a worker's prefix cache
    prefix_secret: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class Reject(_Msg):
    reason: str


class Heartbeat(_Msg):
    worker_id: str
    free_blocks: int
    running: int
    waiting: int
    queued_tokens: int
    kv_bytes_sent: int = 0
    kv_seconds_sent: float = 0.0
    kv_bytes_received: int = 0
    bad_messages: int = 0
    preemptions: int = 0
    steps: list[tuple[int, int, int, float]] = []  # steps since the last heartbeat, as Hello.profile
    # steps it ran on a share of its node's cores (fewer threads than its all-core steps in `steps`:
    # busy workers of its role beside it, runtime/cores.py), each with its thread count
    shared_steps: list[tuple[int, int, int, float, int]] = []
    inbox_dropped: int = 0  # messages the worker's link dropped because its inbox was full
    fenced_blocks: int = 0  # decode: blocks of given-up grants held until their writer answers or dies
    prefix_added: list[PrefixKey] = []  # block keys its prefix cache registered since the last heartbeat (bounded)
    prefix_evicted: list[PrefixKey] = []  # and evicted
    cached_blocks: int = 0  # blocks registered in its prefix cache now
    prefix_queries: int = 0  # prompt tokens looked up in its prefix cache, since start
    prefix_hits: int = 0  # of those, tokens found cached
    # the node's host-memory KV tier (kvtransfer.host_tier; all 0 when off), this worker's counters since start:
    host_tier_queries: int = 0  # tokens of full blocks past its prefix cache's hit looked up in the tier
    host_tier_hits: int = 0  # of those, tokens loaded from the tier
    host_tier_bytes_in: int = 0  # KV bytes it put into the tier (evicted blocks whose key was not there yet)
    host_tier_bytes_out: int = 0  # KV bytes it loaded from the tier
    host_tier_blocks: int = 0  # blocks the tier holds now (node-wide)
    host_tier_capacity: int = 0  # blocks it can hold (node-wide)


class Admit(_Msg):
    request_id: str
    num_tokens: int
    admission: int = 0  # counts this request's Admits; echoed so a late answer to an older one is ignored
    writer_pid: int = 0  # the prefill worker that will fill the grant (its Hello's pid, host and boot id): on the
    writer_host: str = ""  # decode worker's machine it may write into the pool directly (shm), so blocks of a grant
    writer_boot: str = ""  # given up before it answered stay fenced until it answers or its process is gone
    # the tokens of its full blocks the decode worker may already hold: it keys them itself and confirms a
    # cached block's tokens before reusing it (runtime.kv_cache); empty when its cache is not thought to hold any
    prefix_token_ids: list[int] = []
    cache_salt: str | None = None  # the request's params.cache_salt: the root its block keys chain from (common/prefix_hash.py)


class Granted(_Msg):
    request_id: str
    block_ids: list[int]
    admission: int = 0
    grant: int = 0  # the decode worker's number for this grant; Prefill, KVReady and KVFailed carry it on
    cached_blocks: int = 0  # the first block_ids already hold the prompt's KV (prefix cache): only the rest is sent


class AdmitRefused(_Msg):
    request_id: str
    reason: str
    admission: int = 0


class Prefill(_Msg):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    dest_worker: str
    dest_kv_endpoint: str
    dest_block_ids: list[int]  # the transport is the prefill worker's choice (KVConnect -> KVAccept)
    output_token_ids: list[int] = []  # tokens already generated (recompute after a failure)
    priority: int = 0
    grant: int = 0  # Granted.grant, echoed in the hand-off
    dest_cached_blocks: int = 0  # Granted.cached_blocks: the first dest blocks are not sent (KVReady names the rest)


class Generate(_Msg):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = []  # tokens already generated (recompute after a failure)
    priority: int = 0


class Abort(_Msg):
    request_id: str


class Release(_Msg):
    """Coordinator -> decode: free a grant whose prefill will never arrive."""

    request_id: str
    grant: int = 0  # 0: whatever grant request_id holds
    prefill_sent: bool = True  # False: no writer can touch its blocks (no Prefill was sent, or its writer reported PrefillDone)


class TokenOut(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    token_id: int = -1  # -1: no new token (the request ended on its own)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: FinishReason | None = None  # None: still running


class TokenBatch(_Msg):
    items: list[TokenOut]


class PromptLogprobs(_Msg):
    """Decode/colocated -> coordinator, just before the TokenBatch holding a request's first token
    (in its own message: a whole batch of them could outgrow the socket's message limit)."""

    request_id: str
    scores: list[PromptLogprob]


class PrefillDone(_Msg):
    """Prefill -> coordinator: the hand-off of request_id finished (for stats and placement); its
    writer is done with the grant, which the coordinator frees if its KVReady never arrived."""

    request_id: str
    num_tokens: int
    kv_bytes: int
    kv_seconds: float
    compute_seconds: float
    grant: int = 0  # Prefill.grant


class WorkerError(_Msg):
    request_id: str
    code: str
    message: str


class Shutdown(_Msg):
    pass


class SetRole(_Msg):
    """Coordinator -> worker: take `role` from now on (the planner drained its work of the old
    kind first). `change` numbers the planner's decisions; the worker echoes it in RoleSet."""

    role: Role
    change: int


class RoleSet(_Msg):
    """Worker -> coordinator: the answer to SetRole. `role` is the role it now has (its old one
    and `error` set if it cannot take the new one)."""

    worker_id: str
    role: Role
    change: int
    error: str = ""


class NodeReport(_Msg):
    """Launcher -> coordinator (worker port, every few seconds; pdserve/launcher_link.py): how often
    each role of its node was restarted, and how each last exited; shown by `pdserve stats` under `nodes`."""

    node: str
    restarts: dict[str, int]
    last_exit: dict[str, str] = {}


class DrainWorker(_Msg):
    """Launcher -> coordinator (worker port, no answer; pdserve/launcher_link.py): the launcher is
    about to remove this worker (an autoscaler's scale-down). The coordinator places nothing more on
    it, lets what is in flight there complete, and shows the drain in its stats (the worker's
    `draining`); the launcher stops it once nothing is in flight. Sent again every tick until then
    (idempotent: a restarted coordinator learns it again). On the worker port, so only a holder of
    the cluster's worker keys (a launcher, a worker) drains a worker, never a client-key holder."""

    worker_id: str


LauncherToCoordinator = (NodeReport, DrainWorker)  # accepted on the worker port from a peer not registered as a worker too
WorkerToCoordinator = Union[Hello, Heartbeat, Granted, AdmitRefused, TokenBatch, PromptLogprobs, PrefillDone, WorkerError, RoleSet,
                            NodeReport, DrainWorker]
CoordinatorToWorker = Union[Welcome, Reject, Admit, Prefill, Generate, Abort, Release, Shutdown, SetRole]


# ------------------------------------------------------------------ prefill -> decode (kv socket)

class KVReady(_Msg):
    """Sent after the KV of `num_computed` tokens is in the destination's granted blocks.
    block_ids: the granted blocks sent, i.e. all of them less the Granted.cached_blocks first.

    For tcp the block bytes follow as one extra frame per layer, each shaped
    (2, len(block_ids) - streamed, block_size, kv_heads, head_dim).
    streamed: the first `streamed` block_ids came before, in this grant's KVPart messages
    (a streamed hand-off); the bytes of the others come with this header.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the first sampled token (and any earlier ones)
    params: SamplingParams
    block_ids: list[int]
    num_computed: int
    backend: str  # how the blocks came: "shm" | "tcp" | "cuda_ipc" | "nccl" (set by the KVSender)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    priority: int = 0
    grant: int = 0  # Prefill.grant: which grant these blocks fill (0: the request's current one)
    prompt_logprobs: list[PromptLogprob] | None = None  # the prompt's scores, when params.prompt_logprobs asked
    streamed: int = 0


class KVPart(_Msg):
    """A streamed hand-off's part, sent as soon as a chunk of the prompt is computed: the blocks
    block_ids, which are the grant's sent blocks (KVReady.block_ids) from index `first` on, hold
    (shm, cuda_ipc) or bring (tcp frames, nccl sends: as for KVReady) their KV. Parts come in
    order (`first` is the count of blocks streamed before); the decode side starts nothing on
    them: KVReady, always last, names how many blocks were streamed."""

    request_id: str
    block_ids: list[int]
    first: int
    backend: str  # set by the KVSender, as KVReady's
    grant: int = 0


class KVFailed(_Msg):
    request_id: str
    reason: str
    grant: int = 0


class KVConnect(_Msg):
    """Prefill -> decode on the kv socket, before the first hand-off to that destination: describe
    your pool (no nccl_id), from which the prefill side picks the backend; then, for nccl only,
    join a communicator with the prefill side's ncclUniqueId (it joins as rank 0, the decode side as 1)."""

    sender_id: str
    nonce: int  # echoed in KVAccept, so a late answer to an abandoned attempt is never taken for this one
    nccl_id: bytes = b""


class KVAccept(_Msg):
    """Decode -> prefill on the kv socket, the answer to KVConnect: the one description of the
    destination pool, whatever the backend; `error` set means refused."""

    nonce: int
    kv_shape: list[int]  # (layers, 2, num_blocks, block_size, kv_heads, head_dim) of the decode pool
    kv_dtype: str
    host: str = ""  # with boot_id: two workers share memory only if both match
    boot_id: str = ""
    backends: list[str] = []  # what the pool can take besides tcp: "shm", "cuda_ipc", "nccl"
    shm_path: str = ""  # shm: the pool's file in /dev/shm
    device: str = ""  # PCI bus id of the pool's GPU (device ordinals differ between processes)
    ipc_handle: bytes = b""  # cuda_ipc: the cudaIpcMemHandle_t of the pool's allocation
    ipc_offset: int = 0  # cuda_ipc: bytes from the allocation's base to the pool's first byte
    # cuda_ipc, a tensor-parallel GPU worker's pool: (device, ipc_handle, ipc_offset) of each rank's
    # part in rank order, rank r holding KV heads [r * kv_heads / N, (r + 1) * kv_heads / N); the
    # fields above are then empty (kv_shape is the whole pool's)
    ipc_parts: list[tuple[str, bytes, int]] = []
    error: str = ""


PrefillToDecode = Union[KVReady, KVPart, KVFailed, KVConnect]

