"""The coordinator's tokenizing lanes (coordinator/tokenizing.py), in-process with a tokenizer
that blocks on demand: work whose request is gone never runs, a costly request never queues in
front of a short one, and identical inputs are tokenized once, even when one twin is cancelled."""
import asyncio
import threading

from pdserve.coordinator.tokenizing import SMALL_COST, OffLoopTokenizer
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import GenerateRequest


def gen(rid="r", **kw):
    return GenerateRequest(rid, SamplingParams(), **kw)


class SlowTok:
    """A tokenizer whose encode of "slow..." waits for `release`; records what it encoded."""

    def __init__(self):
        self.release = threading.Event()
        self.started = threading.Event()
        self.encoded = []

    def encode(self, text, add_special_tokens=True):
        if text.startswith("slow"):
            self.started.set()
            assert self.release.wait(10)
        self.encoded.append(text)
        return [len(text)]


async def until(cond, timeout=10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def test_cancelled_tokenizing_never_runs():
    async def go():
        tok = SlowTok()
        lanes = OffLoopTokenizer(tok)
        done = []
        try:
            lanes.submit(gen(prompt="slow"), 4, done.append)
            await until(tok.started.is_set)  # the small lane is busy
            gone = lanes.submit(gen(prompt="gone"), 4, done.append)
            lanes.cancel(gone)
            kept = lanes.submit(gen(prompt="kept"), 4, done.append)
            tok.release.set()
            await until(lambda: len(done) == 2)
            assert kept.work.future.result() == [4] and tok.encoded == ["slow", "kept"]  # "gone" never ran
            assert lanes.cancelled == 1 and lanes.work == {}
        finally:
            tok.release.set()
            lanes.close()

    asyncio.run(go())


def test_a_costly_request_never_queues_in_front_of_a_short_one():
    async def go():
        tok = SlowTok()
        lanes = OffLoopTokenizer(tok)
        done = []
        try:
            lanes.submit(gen(prompt="slow costly"), SMALL_COST + 1, lambda f: done.append("costly"))
            await until(tok.started.is_set)
            lanes.submit(gen(prompt="short"), 10, lambda f: done.append("short"))
            await until(lambda: done == ["short"])  # answered while the costly one still runs
            tok.release.set()
            await until(lambda: done == ["short", "costly"])
        finally:
            tok.release.set()
            lanes.close()

    asyncio.run(go())


def test_identical_inputs_share_one_tokenization_even_when_a_twin_is_cancelled():
    async def go():
        tok = SlowTok()
        lanes = OffLoopTokenizer(tok)
        got = {}
        try:
            lanes.submit(gen(prompt="slow"), 4, lambda f: None)
            await until(tok.started.is_set)
            twins = [lanes.submit(gen(f"c{i}", prompt="same"), 4, lambda f, i=i: got.__setitem__(i, f.result())) for i in range(4)]
            assert len({id(t.work) for t in twins}) == 1 and lanes.shared == 3
            lanes.cancel(twins[0])  # one choice's client aborted: the others still get the shared result
            tok.release.set()
            await until(lambda: len(got) == 3)
            assert got == {1: [4], 2: [4], 3: [4]} and tok.encoded.count("same") == 1
            other = lanes.submit(gen(prompt="same", add_special_tokens=False), 4, lambda f: got.__setitem__("other", 1))
            assert other.work is not twins[1].work  # different inputs never share
            await until(lambda: "other" in got)
        finally:
            tok.release.set()
            lanes.close()

    asyncio.run(go())
