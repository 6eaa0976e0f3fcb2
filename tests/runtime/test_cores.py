"""pdserve.runtime.cores: busy workers split the cores, idle ones give theirs up; flags shared through
the file between processes as the launcher sets them up."""
import os
import subprocess
import sys
import threading

import pytest
import torch

from pdserve.runtime.cores import CoreShare, StaticCores, create_share


@pytest.fixture
def share_path():
    path = create_share(3)
    yield path
    os.unlink(path)


def test_busy_workers_split_the_cores(share_path):
    before = torch.get_num_threads()
    try:
        a = CoreShare.open(f"{share_path}:0", cores=4)
        b = CoreShare.open(f"{share_path}:1", cores=4)
        assert a.busy() == 4 and torch.get_num_threads() == 4  # alone: every core
        assert b.busy() == 2  # two busy: half each
        assert a.busy() == 2 and torch.get_num_threads() == 2
        b.idle()
        assert a.busy() == 4
        b.close()
        assert a.busy_workers() == 1
    finally:
        torch.set_num_threads(before)


def test_a_share_among_workers_of_one_role_is_told_from_one_beside_a_busy_prefill_worker(share_path):
    """role_share: the threads of a step run on fewer than every core because busy workers of its
    own role share them (logged apart by the engine); 0 alone, and 0 for a decode worker stepping
    beside a busy prefill worker (past its stall cap: the coordinator models that as turns)."""
    before = torch.get_num_threads()
    try:
        a, b, p = (CoreShare.open(f"{share_path}:{i}", cores=2) for i in range(3))
        assert (a.busy(), a.role_share) == (2, 0)  # alone
        b.busy()
        assert (a.busy(), a.role_share) == (1, 1)  # two decode workers: one thread each, a role share
        b.idle()
        p.busy(prefill=True)
        assert (p.role_share, a.busy(), a.role_share) == (0, 1, 0)  # beside a prefill worker: not a role share
        assert StaticCores().role_share == 0
    finally:
        torch.set_num_threads(before)


def test_flags_are_shared_between_processes(share_path):
    code = (
        "import sys; from pdserve.runtime.cores import CoreShare; "
        f"s = CoreShare.open({share_path!r} + ':2', cores=2); s.busy(); print(s.busy_workers()); sys.stdout.flush()"
    )
    before = torch.get_num_threads()
    try:
        mine = CoreShare.open(f"{share_path}:0", cores=2)
        mine.busy()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=os.getcwd(),
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert out.stdout.strip() == "2", out.stderr
        assert mine.busy_workers() == 2 and mine.busy() == 1  # the other process's flag is still set
    finally:
        torch.set_num_threads(before)


def test_start_up_profiles_run_one_at_a_time(share_path):
    """alone() excludes the other workers' alone() across processes, and a worker killed inside
    one does not block the rest (the kernel drops its lock)."""
    code = (
        "import sys; from pdserve.runtime.cores import CoreShare\n"
        f"s = CoreShare.open({share_path!r} + ':1', cores=2)\n"
        "with s.alone():\n    print('profiling', flush=True); sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    before = torch.get_num_threads()
    try:
        assert child.stdout.readline().strip() == "profiling"
        mine = CoreShare.open(f"{share_path}:0", cores=2)
        assert mine.busy_workers() == 1 and mine.flags[1] != 0  # the child is marked busy
        entered = threading.Event()

        def profile():
            with mine.alone():
                entered.set()

        with mine.alone(limit_s=0.2):  # a profile that never ends is waited for at most limit_s
            assert mine.flags[0] != 0
        t = threading.Thread(target=profile)
        t.start()
        assert not entered.wait(1.0)  # held off while the child profiles
        child.kill()
        child.wait(timeout=30)
        assert entered.wait(30)
        t.join(timeout=30)
        assert mine.flags[1] != 0 and mine.flags[0] == 0  # the killed child's flag stays set (slow, not oversubscribed); mine is idle again
    finally:
        if child.poll() is None:
            child.kill()
        torch.set_num_threads(before)


def test_bad_specs_are_refused(share_path):
    with pytest.raises(ValueError, match="PATH:SLOT"):
        CoreShare.open(share_path)
    with pytest.raises(ValueError, match="slot 3"):
        CoreShare.open(f"{share_path}:3")
    assert isinstance(CoreShare.open(None), StaticCores)


def test_a_decode_worker_defers_to_a_busy_prefill_worker_up_to_the_cap(share_path):
    from pdserve.runtime.cores import IDLE, WANTS_TURN

    before = torch.get_num_threads()
    try:
        decode = CoreShare.open(f"{share_path}:0", cores=2)
        prefill = CoreShare.open(f"{share_path}:1", cores=2)
        other_decode = CoreShare.open(f"{share_path}:2", cores=2)
        other_decode.busy()
        assert not decode.defer_to_prefill(0.0)  # another decode worker is busy: no deferring to it
        assert prefill.busy(prefill=True) == 2  # decode workers defer to it: it shares with prefill workers only
        assert other_decode.busy() == 1  # a decode worker still counts every busy worker
        assert decode.defer_to_prefill(0.0, 4.0) and decode.flags[0] == IDLE
        assert decode.defer_to_prefill(2.5, 4.0) and decode.flags[0] == WANTS_TURN  # past turn_after: asks for a turn
        assert not decode.defer_to_prefill(4.0, 4.0)  # the cap: a decode step is due whatever the prefill does
        assert not prefill.defer_to_prefill(0.0)  # a worker never defers to itself
        other_decode.idle()
        assert prefill.busy(prefill=True) == 2
        prefill.idle()
        assert not decode.defer_to_prefill(0.0)
        assert not StaticCores().defer_to_prefill(0.0)
    finally:
        torch.set_num_threads(before)


def test_prefill_and_decode_steps_take_turns_and_never_overlap(share_path):
    """The turn protocol, both sides in threads of this process (the flags are the same bytes
    other processes map): a decode worker that wants a turn gets one step between two prefill
    steps, and a prefill step never starts while a decode step runs."""
    import threading
    import time

    from pdserve.runtime.cores import PREFILLING, YIELDING

    before = torch.get_num_threads()
    try:
        decode = CoreShare.open(f"{share_path}:0", cores=2)
        prefill = CoreShare.open(f"{share_path}:1", cores=2)
        running, log, overlaps = set(), [], []

        def run(name, seconds):
            if running:
                overlaps.append(f"{name} began while {running} ran")
            running.add(name)
            log.append(name)
            time.sleep(seconds)
            running.discard(name)

        stop = threading.Event()

        def prefill_loop():
            while not stop.is_set():
                prefill.take_prefill_turn(limit_s=5)
                run("prefill", 0.05)
            prefill.idle()

        t = threading.Thread(target=prefill_loop)
        t.start()
        last = time.monotonic()
        decode_steps = 0
        try:
            while decode_steps < 3:
                if decode.defer_to_prefill(time.monotonic() - last, cap=30.0):  # never forced: only turns
                    time.sleep(0.001)
                    continue
                assert decode.busy() == 2  # its turn: every core (the yielding prefill worker holds none)
                assert prefill.flags[1] in (YIELDING, PREFILLING) and "prefill" not in running
                run("decode", 0.02)
                decode_steps += 1
                last = time.monotonic()
        finally:
            stop.set()
            t.join(10)
        assert not overlaps and not t.is_alive()
        assert log.count("decode") == 3 and log.count("prefill") >= 3
        assert "decode,decode" not in ",".join(log)  # one decode step per turn, prefill steps between
    finally:
        torch.set_num_threads(before)


def test_the_stall_cap_follows_the_coordinators_tpot_target():
    from pdserve.common.core_turns import DECODE_STALL_CAP_S, DECODE_TURN_AFTER_S, STALL_SHARE_OF_TPOT, stall_cap, turn_after

    assert stall_cap(0.0) == DECODE_STALL_CAP_S  # no SLO control: prefill first, up to the cap
    assert stall_cap(500.0) == pytest.approx(STALL_SHARE_OF_TPOT * 0.5)  # the default target: 0.2 s
    assert stall_cap(60_000.0) == DECODE_STALL_CAP_S  # never above the cap
    assert turn_after(stall_cap(500.0)) == pytest.approx(0.1)  # under SLO control: half the cap
    assert turn_after(stall_cap(0.0)) == DECODE_TURN_AFTER_S
