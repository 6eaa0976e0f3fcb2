"""What the prefill and the decode worker share: their Hello, their link, their process.

Lifecycle: a worker's `build` loads its engine and KV pool, then asks `hello(...)` for what the
coordinator learns about it (role, the roles it can change to, model limits, pool size, start-up
profile, its kv endpoint) and `connect(...)` for a `WorkerLink` that will say that Hello (started by the worker's
`run`, with its heartbeat); a worker that changes role (SetRole) has `announce_role` make the
Hello said on a reconnect name its new one; each pass of its loop keys its prefix cache with the secret the
coordinator's Welcome names (`adopt_prefix_secret`). `build_or_exit(build)` ends the process with EX_CONFIG when the
build fails with a typed error (a model it cannot load, a KV pool /dev/shm cannot hold): its
launcher then stops the node if that was the worker's first start (a restart that fails so is
retried with a back-off). `serve(worker)` freezes the start-up heap, turns SIGTERM and SIGINT
into `worker.running = False`, and runs the worker's loop until then; each pass of the loop
touches the launcher's liveness file (wire/liveness.py), so a loop stuck longer than the
launcher's hang timeout gets the worker killed and restarted; the loop's own `finally` closes
what the worker holds.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec
import torch
import zmq

from pdserve.common.errors import EX_CONFIG
from pdserve.common.heap import freeze_startup_heap
from pdserve.kvtransfer.pool import host_identity
from pdserve.runtime.config import WorkerConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.runtime.kv_cache import BlockManager
from pdserve.wire import security
from pdserve.wire.link import WorkerLink
from pdserve.wire.protocol import PROTOCOL_VERSION, Hello, Role
from pdserve_client.errors import PdserveError


def worker_id(role: Role, wcfg: WorkerConfig) -> str:
    return wcfg.worker_id or f"{role.name.lower()}-{os.getpid()}"


def hello(role: Role, wid: str, wcfg: WorkerConfig, engine: LLMEngine, pool: torch.Tensor, profile: list,
          kv_endpoint: str = "", roles: list[Role] | None = None) -> Hello:
    """The worker's Hello. pool: its KV pool, (layers, 2, num_blocks, block_size, KVH, D); how to
    reach it is asked on kv_endpoint (KVConnect), never told to the coordinator. roles: those it
    can take without a restart (SetRole); none: only its own."""
    host, boot = host_identity()
    return Hello(
        PROTOCOL_VERSION, wid, role, os.getpid(), host, boot, str(wcfg.model or "default"), engine.max_model_len,
        pool.shape[2], pool.shape[3], kv_endpoint, profile,
        engine={**engine.config.summary(engine.max_model_len, pool.shape[2], pool.nbytes), "linear_table": linear_table(engine),
                "core_share": (wcfg.core_share or "").rpartition(":")[0],  # the workers it shares its cores with share this
                "cores": getattr(engine.core_share, "cores", 0),  # its threads alone on them (CoreShare.cores; 0: no share)
                "kv_window": engine.cfg.kv_window,  # its grants leave the blocks before the window out (runtime.kv_cache)
                # KV groups (runtime.kv_groups): a table per group, a sliding group's grant from its window on ("0,8,8": each
                # group's window; "": one group)
                "kv_group_windows": ",".join(map(str, engine.blocks.group_windows)) if engine.blocks.groups > 1 else "",
                "prefix_cache": int(engine.blocks.prefix_cache)},  # off with KV groups whatever was asked (runtime.kv_cache)
        roles=list(roles or []),
    )


LINEAR_TABLE_CHARS = 4000  # the Hello's copy of the chosen back-end table (a few lines per linear shape)


def linear_table(engine: LLMEngine) -> str:
    """The measured linear back-end table (runtime.linear_plan) as text, for `pdserve stats`."""
    table = getattr(getattr(engine.model, "fast", None), "linear_table", None)  # a TP model has no fused fast path
    return "" if table is None else table.text()[:LINEAR_TABLE_CHARS]


def announce_role(link, role: Role) -> None:
    """Make the Hello that link says on a (re)connect (a restarted coordinator) name `role`, the
    worker's role now (the link's I/O thread reads it: one attribute, replaced whole)."""
    h = getattr(link, "hello", None)
    if h is not None:
        link.hello = msgspec.structs.replace(h, role=role)


def connect(ctx: zmq.Context, wcfg: WorkerConfig, h: Hello) -> WorkerLink:
    """The link to the coordinator that says h; the worker starts it with its heartbeat."""
    curve = security.worker_options(wcfg.keys)  # the worker's own credential
    return WorkerLink(ctx, wcfg.coordinator, h, interval=wcfg.heartbeat_s, curve=curve)


def adopt_prefix_secret(link, blocks: BlockManager) -> None:
    """Key the prefix cache with the secret of the coordinator's last Welcome (a new coordinator's
    empties it; without one the worker keeps its own random secret). The model loop calls this
    after draining its inbox and before handling what it drained: every message it took came
    after the Welcome it sees here."""
    welcome = getattr(link, "welcome", None)
    if welcome is not None and welcome.prefix_secret:
        blocks.set_prefix_key(welcome.prefix_secret)


def build_or_exit(build):
    """build(), or exit with EX_CONFIG and the error's message if it raises a PdserveError."""
    try:
        return build()
    except PdserveError as e:
        logging.getLogger("pdserve.worker").error("cannot start: %s", e)
        print(f"pdserve: cannot start: {e}", file=sys.stderr, flush=True)
        sys.exit(EX_CONFIG)


def serve(worker) -> None:
    """Run worker (anything with `running` and `run()`) until SIGTERM or SIGINT."""
    freeze_startup_heap()

    def stop(*_):
        worker.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run()
