"""The coordinator's event counters, by name: the names are what `pdserve stats` shows under
"requests" and what /metrics and dashboards read, so each is written once, here.

Lifecycle: one `Counts` per coordinator, only ever added to. `add(Count.X)` counts an event of a
fixed name (`add(Count.X, n)`: n of them, tokens say); `error(code)`, `finished(reason)` and
`placed(path, reason)` count the named families ("error:<code>", "finished:<reason>",
"path:<path>" and "path_reason:<reason>"). `snapshot()` is the stats' "requests" object: the
counters that have counted, by name; `counts["name"]` reads one (0 if it never counted).
"""
from __future__ import annotations

import collections
import enum

from pdserve_client.protocol import FinishReason


class Count(enum.StrEnum):
    """Counters of a fixed name (their value is the name shown)."""

    REQUESTS = "requests"  # started: tokenized and checked, given an id
    COLD_START_WAITS = "cold_start_waits"  # held while no worker could decode it, until one registers (coordinator/cold_start.py)
    COLD_START_REFUSED = "cold_start_refused"  # refused for a cold start: the held-requests bound was full
    COLD_START_TIMEOUTS = "cold_start_timeouts"  # held longer than --cold-start-timeout-s: refused
    RETRIES = "retries"  # placed again after a lost worker or an unanswered Admit
    ADMISSION_TIMEOUTS = "admission_timeouts"
    LOST_HANDOFFS = "lost_handoffs"  # a hand-off done whose decode worker never started the request
    WORKERS_LOST = "workers_lost"
    DRAINS = "drains"  # workers drained for their removal (DrainWorker: a launcher's scale-down)
    WORKERS_REMOVED = "workers_removed"  # of those, gone once drained (nothing in flight: nothing placed again)
    REJECTED_WORKERS = "rejected_workers"  # Hellos refused
    CLIENT_GONE_ABORTS = "client_gone_aborts"
    CLIENT_OVER_BUDGET_MESSAGES = "client_over_budget_messages"
    CLIENT_SEND_FAILURES = "client_send_failures"
    WORKER_SEND_FAILURES = "worker_send_failures"
    BAD_CLIENT_MESSAGES = "bad_client_messages"
    BAD_WORKER_MESSAGES = "bad_worker_messages"
    INVALID_WORKER_MESSAGES = "invalid_worker_messages"  # decoded, but numbers or scores that cannot be right
    WRONG_WORKER_MESSAGES = "wrong_worker_messages"  # about a request placed on another worker
    OVERSIZED_IDS_DROPPED = "oversized_ids_dropped"
    NODE_REPORTS_DROPPED = "node_reports_dropped"
    STALE_ROLE_SETS = "stale_role_sets"
    INTERNAL_ERRORS = "internal_errors"  # a handler raised: a bug, logged with its traceback
    ILLEGAL_TRANSITIONS = "illegal_transitions"  # a phase change state.TRANSITIONS does not allow: a bug, logged
    SCORED_PROMPTS = "scored_prompts"  # prompts whose logprobs were computed and sent (prompt_logprobs)
    SCORED_PROMPT_TOKENS = "scored_prompt_tokens"  # their tokens: each computed, never taken from the prefix cache


class Counts:
    def __init__(self):
        self._n: collections.Counter = collections.Counter()

    def add(self, name: Count, n: int = 1) -> None:
        self._n[name.value] += n

    def error(self, code: str) -> None:
        """A request ended with ErrorReply `code` (or was refused before it started)."""
        self._n[f"error:{code}"] += 1

    def finished(self, reason: FinishReason) -> None:
        self._n[f"finished:{reason.name.lower()}"] += 1

    def placed(self, path: str, reason: str) -> None:
        """A placement took `path` (coordinator/paths.py's Path value) for `reason`."""
        self._n[f"path:{path}"] += 1
        self._n[f"path_reason:{reason}"] += 1

    def __getitem__(self, name: str) -> int:
        return self._n[name]

    def snapshot(self) -> dict[str, int]:
        return dict(self._n)
