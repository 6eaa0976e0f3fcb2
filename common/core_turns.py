"""When a decode worker that defers to a busy prefill worker of its node (runtime/cores.py) asks
for a turn and when it steps regardless: plain functions of the coordinator's TPOT target, torch-
free so that the coordinator predicts the same turns (coordinator/paths.py) that the workers take.

Lifecycle: none; constants and two functions, read by runtime/cores.py and worker/any_role.py in
the workers and by the coordinator when it predicts a LOCAL prefill on a shared node.
"""
from __future__ import annotations

# A decode worker that defers to a busy prefill worker of its node asks for a turn (one step on
# every core, taken between two prefill steps: take_prefill_turn) once its last step ended
# `turn_after` ago, and steps whatever the prefill worker does once it ended the stall cap ago.
# Without SLO control: a turn after DECODE_TURN_AFTER_S, the cap DECODE_STALL_CAP_S only bounds a
# prefill worker that stopped answering (a flag left set by a killed one). With SLO control the
# coordinator's Welcome names its TPOT target: the cap is STALL_SHARE_OF_TPOT of it (0.2 s at the
# default 500 ms), the turn is asked for at half the cap, so held streams still meet the target.
# Measured on 2 cores (`scripts/vs_vllm --rows disagg`, 128/128), before turns existed (a decode
# step at the cap ran beside the prefill step, each slowing the other): a burst of 64 prompts had
# p99 TTFT 20.8 s with a 0.5 s cap and 15.9 s with 3 s (mean TPOT 293 against 279 ms); 32 prompts:
# 10.7 s at 0.2 s, 8.8 at 0.5, 8.6 at 2 s. vLLM's chunked prefill makes the same trade: each of its
# steps during a burst carries up to 2,048 prompt tokens, seconds here.
DECODE_STALL_CAP_S = 10.0
DECODE_TURN_AFTER_S = 1.0
STALL_SHARE_OF_TPOT = 0.4


def stall_cap(tpot_ms: float) -> float:
    """The decode worker's stall cap for the coordinator's TPOT target (0: no SLO control)."""
    return min(DECODE_STALL_CAP_S, STALL_SHARE_OF_TPOT * tpot_ms / 1000) if tpot_ms > 0 else DECODE_STALL_CAP_S


def turn_after(cap: float) -> float:
    """How long after its last step a deferring decode worker asks for a turn."""
    return min(DECODE_TURN_AFTER_S, cap / 2)
