"""The coordinator's latency model and SLO bookkeeping, and its admission deadline.

Lifecycle: the model/recorder tests are plain in-process checks. The admission tests start a
real `Coordinator` on this test's event loop, bound to loopback, with two stub workers speaking
the worker protocol on real DEALER sockets (a prefill worker, and a decode worker that answers
Admits late or never, as one whose bounded inbox dropped them would) and the real AsyncClient.
"""
import asyncio
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from pdserve.coordinator.placement import prefill_share
from pdserve.coordinator.server import Coordinator, CoordinatorConfig
from pdserve.coordinator.slo import (
    MAX_CLASSES,
    OTHER_CLASS,
    CoreShareSlowdown,
    LatencyWindow,
    SloRecorder,
    StepModel,
    StretchedModel,
    nonnegative_least_squares,
)
from pdserve.coordinator.state import Phase
from pdserve.wire.protocol import PROTOCOL_VERSION, Abort, Admit, CoordinatorToWorker, Generate, Granted, Hello, Prefill, Role, Welcome
from pdserve_client.library import AsyncClient, Overloaded
from pdserve_client.protocol import decoder, encode
from tests.helpers import free_port


def test_step_model_recovers_a_linear_step_time():
    a, b, c, d = 0.004, 0.0015, 0.0002, 0.03  # seconds: fixed, per sequence, per token, per 1000 context tokens
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(200):
        seqs = int(rng.integers(1, 32))
        tokens = seqs if rng.random() < 0.7 else int(rng.integers(seqs, 512))  # decode steps and prefill chunks
        ctx = int(rng.integers(tokens, 8000))
        samples.append((seqs, tokens, ctx, a + b * seqs + c * tokens + d * ctx / 1000))
    m = StepModel(samples)
    for seqs, tokens, ctx in [(8, 8, 3000), (32, 32, 6000), (4, 400, 900)]:  # inside the sampled range
        assert m.predict(seqs, tokens, ctx) == pytest.approx(a + b * seqs + c * tokens + d * ctx / 1000, rel=1e-3)
    prompts = [s for s in samples if s[1] > s[0]]  # a backlog drains at the prompt steps' rate
    assert m.tokens_per_second() == pytest.approx(sum(s[1] for s in prompts) / sum(s[3] for s in prompts))


def test_decode_steps_never_push_the_prompt_steps_out_of_the_fit():
    """A decode worker's profile prompts stay in the fit after any number of decode steps, so a
    prompt placed on it (the local path) is predicted at its own cost."""
    a, b, c = 0.004, 0.002, 0.001  # fixed, per sequence, per token
    step = lambda seqs, tokens: (seqs, tokens, tokens, a + b * seqs + c * tokens)  # noqa: E731
    m = StepModel([step(1, n) for n in (64, 128, 256, 512)], window=16)
    m.add([step(s, s) for s in range(1, 33)] * 10)  # 320 decode steps
    assert m.predict(1, 512, 512) == pytest.approx(a + b + c * 512, rel=0.05)
    assert m.tokens_per_second() == pytest.approx(sum((64, 128, 256, 512)) / sum(step(1, n)[3] for n in (64, 128, 256, 512)))


def test_step_model_window_follows_a_change_and_never_predicts_below_a_measured_step():
    m = StepModel([(1, 1, 10, 0.01)] * 10, window=16)
    m.add([(1, 1, 10, 0.05)] * 16)  # the worker became 5x slower: the old samples leave the window
    assert m.predict(1, 1, 10) == pytest.approx(0.05)
    assert StepModel().predict(8, 8, 100) == 0.0 and StepModel().tokens_per_second() == float("inf")
    falling = StepModel([(s, s, 0, 0.02) for s in range(1, 9)] + [(16, 16, 0, 0.005)])  # a negative slope fits
    assert falling.predict(64, 64, 0) >= 0.005  # clamped to the fastest measured step, never below 0


def test_nonnegative_least_squares_meets_its_optimality_conditions():
    """The subset search against the conditions that define the NNLS optimum (KKT): every
    coefficient >= 0, the residual's gradient 0 along the positive ones and >= 0 along the zeros;
    and on data a non-negative model generated, the plain least-squares answer."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        x, y = rng.random((30, 4)), rng.random(30) - 0.5 * rng.random()
        c = nonnegative_least_squares(x, y)
        grad = x.T @ (x @ c - y)
        assert (c >= 0).all()
        assert np.allclose(grad[c > 0], 0, atol=1e-4) and (grad[c == 0] >= -1e-4).all(), (c, grad)
    x = rng.random((50, 4))
    assert np.allclose(nonnegative_least_squares(x, x @ [0.5, 0.1, 0.0, 2.0]), [0.5, 0.1, 0.0, 2.0], atol=1e-4)


# a colocated worker's start-up profile on this machine (runtime/engine.py profile: batches 1, 4 and
# 16 of 64-token prompts with 4 decode steps each, then 4 x 256-token prompts), and decode steps
# measured after it in the same process: 32 x 128-token prompts, 8 x 400, 24 x 64 (64 tokens out)
PROFILE = [(1, 64, 64, 0.05373), (1, 1, 65, 0.0042), (1, 1, 66, 0.00392), (1, 1, 67, 0.00393), (1, 1, 68, 0.00374),
           (4, 256, 256, 0.20258), (4, 4, 260, 0.01131), (4, 4, 264, 0.01121), (4, 4, 268, 0.01085), (4, 4, 272, 0.01044),
           (16, 1024, 1024, 0.77521), (16, 16, 1040, 0.02372), (16, 16, 1056, 0.02375), (16, 16, 1072, 0.02392), (16, 16, 1088, 0.0239),
           (4, 1024, 1024, 0.84688), (4, 4, 1028, 0.01213), (4, 4, 1032, 0.01184), (4, 4, 1036, 0.01474), (4, 4, 1040, 0.01192)]
DECODE_MEASURED = [(32, 32, 4175, 0.04431), (32, 32, 5135, 0.04595), (32, 32, 6095, 0.05015), (8, 8, 3429, 0.03065),
                   (8, 8, 3669, 0.03126), (24, 24, 2136, 0.03955), (24, 24, 2856, 0.05457)]


def test_a_start_up_profile_predicts_decode_steps_outside_its_shapes_and_one_slow_step_moves_them_little():
    """Decode steps of other shapes than the profile's (more sequences, longer contexts) are
    predicted within 0.7-1.6x of their measured time (measured: 0.8-1.46x), after one slow
    step too: the fit weighs each step by its relative error (unweighted, the few long prompt
    steps decided it and it predicted decode steps at 2.8-4.6x, median) with every cost >= 0
    (unconstrained, one slow 128-token prompt after a profile without longer contexts made it
    trade -67 ms a sequence for +1 ms a context token and predict a 7-sequence step at 454 ms:
    measured on a fresh colocated worker, 26 of a 32-request burst shed for TPOT)."""
    for extra in ([], [(1, 128, 128, 0.195)], [(1, 10, 10, 0.05)]):
        m = StepModel(PROFILE + extra)
        assert (m._fit() >= 0).all()
        for seqs, tokens, ctx, seconds in DECODE_MEASURED:
            assert 0.7 <= m.predict(seqs, tokens, ctx) / seconds <= 1.6, (extra, seqs, ctx, m.predict(seqs, tokens, ctx))
        assert 0.8 <= m.predict(1, 128, 128) / 0.105 <= 1.3  # between the profile's 64-token prompt and its 256-token ones


def test_core_share_slowdown_is_linear_until_measured_then_follows_the_shared_steps():
    """A worker's steps on 1 of its 2 threads: the linear factor (2x) until MIN_STEPS shared
    steps were seen, then what they measured against the all-core model (here 1.5x), never under
    1x and at most 1.5x linear; StretchedModel applies it to predictions and throughput."""
    alone = StepModel([(s, s, 400 * s, 0.01 + 0.002 * s) for s in (1, 2, 4, 8, 16)] * 3)
    slow = CoreShareSlowdown()
    assert slow.factor(2, 1) == 2.0 and slow.factor(2, 2) == 1.0
    shared = [(s, s, 400 * s, 1.5 * alone.predict(s, s, 400 * s), 1) for s in (1, 2, 4, 8)]
    slow.add(shared * 3, alone, 2)
    assert slow.factor(2, 1) == 2.0  # 12 steps: fewer than MIN_STEPS
    slow.add(shared, alone, 2)
    assert slow.factor(2, 1) == pytest.approx(1.5)
    assert slow.factor(4, 1) == pytest.approx(3.0)  # the ratio to linear (0.75) holds at another share
    slow.add([(s, s, 400 * s, 9.0, 1) for s in (1, 2, 4, 8)] * 100, alone, 2)  # steps slowed by something else
    assert slow.factor(2, 1) == pytest.approx(3.0)  # at most 1.5x linear
    fast = CoreShareSlowdown()
    fast.add([(1, 1, 400, 0.001, 1)] * 20, alone, 2)
    assert fast.factor(2, 1) == 1.0  # never faster than alone
    ignored = CoreShareSlowdown()
    ignored.add([(1, 1, 400, 0.5, 2)] * 20, alone, 2)  # not fewer threads than alone: not a shared step
    assert len(ignored.steps) == 0
    stretched = StretchedModel(alone, 1.5)
    assert stretched.predict(4, 4, 1600) == pytest.approx(1.5 * alone.predict(4, 4, 1600))
    assert stretched.tokens_per_second() == pytest.approx(alone.tokens_per_second() / 1.5)


def test_latency_window_is_bounded_and_reports_percentiles():
    w = LatencyWindow(size=100)
    for v in range(1000):
        w.add(float(v))
    p = w.percentiles()
    assert p["count"] == 100 and p["p50"] == pytest.approx(949.5) and p["p99"] == pytest.approx(998.01)
    assert LatencyWindow().percentiles() == {"count": 0}


def test_recorder_keeps_a_bounded_number_of_priority_classes():
    r = SloRecorder()
    for prio in range(MAX_CLASSES + 50):  # any int is a valid priority: a client could send millions
        r.record(prio, 0.1, 0.01, 0.12)
        r.record_shed(prio)
    s = r.summary()
    assert len(s["classes"]) == MAX_CLASSES + 1 and str(OTHER_CLASS) in s["classes"]
    assert s["classes"][OTHER_CLASS]["ttft"]["count"] == 50 and s["shed"][OTHER_CLASS] == 50 and s["shed"]["0"] == 1
    assert s["ttft_prediction_error"]["p50"] == pytest.approx(0.2)


# ------------------------------------------------------------------ admission deadline, live sockets

class StubWorker:
    """A registered worker on a real socket that answers only what the test tells it to."""

    def __init__(self, ctx, addr: str, wid: str, role: Role):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.hello = Hello(PROTOCOL_VERSION, wid, int(role), 1, "stub-host", "stub-boot", "m", 256, 64, 16, kv_endpoint="tcp://127.0.0.1:1")
        self.dec = decoder(CoordinatorToWorker)

    async def register(self):
        await self.sock.send(encode(self.hello))
        assert isinstance(await self.recv(), Welcome)

    async def recv(self, timeout: float = 5.0):
        return self.dec.decode(await asyncio.wait_for(self.sock.recv(), timeout))

    async def recv_type(self, kind, timeout: float = 5.0):
        while True:
            msg = await self.recv(timeout)
            if isinstance(msg, kind):
                return msg


async def with_coordinator(body, roles=(("p0", Role.PREFILL), ("d0", Role.DECODE)), profile=(), **cfg):
    cfg = CoordinatorConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", worker_timeout_s=60, **{"slo": False, **cfg})
    coord = Coordinator(cfg, tokenizer=object())  # token-id prompts only: nothing to tokenize
    task = asyncio.create_task(coord.run())
    ctx = zmq.asyncio.Context()
    try:
        workers = [StubWorker(ctx, cfg.worker_addr, wid, role) for wid, role in roles]
        for w in workers:
            w.hello.profile = list(profile)
            await w.register()
        async with AsyncClient(cfg.client_addr, timeout=30) as client:
            await body(coord, client, *workers)
    finally:
        coord.stopping.set()
        await asyncio.wait_for(task, 10)
        ctx.destroy(linger=0)


def test_an_admission_never_answered_is_placed_again_then_refused_as_overloaded():
    async def body(coord, client, prefill, decode):
        t0 = time.monotonic()
        with pytest.raises(Overloaded, match="did not answer the admission"):
            await client.generate(token_ids=[5, 6, 7], max_tokens=2)
        elapsed = time.monotonic() - t0
        assert 0.4 <= elapsed < 3.0, elapsed  # two deadlines of 0.2 s each, then the typed error at once
        seen = []
        while len(seen) < 4:  # Admit 1, Abort, Admit 2, Abort, in that order
            seen.append(await decode.recv())
        assert [type(m) for m in seen] == [Admit, Abort, Admit, Abort]
        assert [m.admission for m in seen if isinstance(m, Admit)] == [1, 2]
        assert coord.counts["admission_timeouts"] == 2 and coord.counts["error:overloaded"] == 1 and coord.counts["illegal_transitions"] == 0
        assert not coord.requests and not coord.admitting and coord.workers["d0"].reserved_blocks == 0

    asyncio.run(with_coordinator(body, admit_timeout_s=0.2, max_attempts=2, paths="remote"))  # an admission: this short prompt would take the LOCAL path


def test_a_late_grant_for_an_older_admission_is_ignored():
    async def body(coord, client, prefill, decode):
        gen = asyncio.create_task(client.generate(token_ids=list(range(5, 25)), max_tokens=2))
        first = await decode.recv_type(Admit)
        second = await decode.recv_type(Admit)  # the first timed out and was placed again
        assert (first.admission, second.admission) == (1, 2) and first.request_id == second.request_id
        # the late answer to admission 1 arrives first; granting its blocks would hand the
        # prefill worker blocks the decode worker already freed on the Abort
        await decode.sock.send(encode(Granted(first.request_id, [7, 8], 1)))
        await decode.sock.send(encode(Granted(second.request_id, [3, 4], 2)))
        job = await prefill.recv_type(Prefill)
        assert job.request_id == second.request_id and job.dest_block_ids == [3, 4]
        assert coord.requests[job.request_id].phase == Phase.PREFILLING and not coord.admitting
        gen.cancel()

    asyncio.run(with_coordinator(body, admit_timeout_s=0.3, max_attempts=3, paths="remote"))  # an admission: this short prompt would take the LOCAL path


@pytest.mark.parametrize("step_s, shed", [(0.002, False), (3.0, True)])
def test_colocated_worker_under_slo_control_sheds_what_its_step_model_cannot_serve(step_s, shed):
    """The worker's start-up profile says one step takes step_s; with targets of 1 s TTFT the
    slow one's request is shed at once with slo_unattainable, the fast one's is placed."""
    async def body(coord, client, colocated):
        t0 = time.monotonic()
        task = asyncio.create_task(client.generate(token_ids=list(range(5, 37)), max_tokens=2))
        if shed:
            with pytest.raises(Overloaded) as e:
                await task
            assert e.value.code == "slo_unattainable" and "predicted TTFT" in e.value.message
            assert time.monotonic() - t0 < 1.0 and coord.slo.shed[0] == 1
            assert await colocated.sock.poll(100) == 0  # nothing was sent to the worker
        else:
            msg = await colocated.recv_type(Generate)
            st = coord.requests[msg.request_id]
            assert st.phase == Phase.COLOCATED and 0 < st.predicted_ttft < 0.8
            w = coord.workers["c0"]
            assert w.queued_tokens == 32 and w.admitted_tokens == 32  # the backlog until its first token; the window
            # 32 prompt tokens placed in the 10 s window at the profile's 2 ms per 32-token step
            assert prefill_share(w.snapshot([st], time.monotonic()), 32) == pytest.approx(32 * 0.002 / 32 / 10, rel=0.05)
            assert prefill_share(w.snapshot([st], time.monotonic() + 11), 32) == 0.0 and w.admitted_tokens == 0  # aged out
            task.cancel()

    profile = [(1, 32, 32, step_s), (4, 4, 200, step_s), (1, 1, 40, step_s), (8, 8, 400, step_s)]
    asyncio.run(with_coordinator(body, roles=(("c0", Role.COLOCATED),), profile=profile, slo=True, ttft_ms=1000, tpot_ms=500))
