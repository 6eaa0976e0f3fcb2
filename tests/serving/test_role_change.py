"""A role change on a running worker process (`pdserve worker`), with the test as its coordinator
(a ROUTER socket on loopback speaking the wire protocol): it says Hello in its initial role with
every role as one it can take, answers SetRole with RoleSet, then serves a Generate as a decode
worker with the single-process engine's tokens; after a coordinator restart its Hello names its
role now; its pool is whole at the end, and Shutdown ends it."""
import os
import subprocess
import sys
import time

import pytest
import zmq

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.wire.protocol import (
    PROTOCOL_VERSION,
    Generate,
    Heartbeat,
    Hello,
    Reject,
    Role,
    RoleSet,
    SetRole,
    Shutdown,
    TokenBatch,
    Welcome,
    WorkerToCoordinator,
)
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import decoder, encode
from tests.helpers import free_port, save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = list(range(5, 30))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model(d, max_position_embeddings=128)
    return d


class FakeCoordinator:
    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.address)
        self.dec = decoder(WorkerToCoordinator)
        self.peer = None

    def expect(self, kind, timeout: float = 60.0, where=lambda m: True):
        """The next message of `kind` from the worker that satisfies where(m), skipping others."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                self.peer, body = self.sock.recv_multipart()
                msg = self.dec.decode(body)
                if isinstance(msg, kind) and where(msg):
                    return msg
        raise AssertionError(f"no {kind.__name__} within {timeout:g} s")

    def send(self, msg) -> None:
        self.sock.send_multipart([self.peer, encode(msg)])

    def close(self):
        self.ctx.destroy(linger=0)


def test_a_running_worker_changes_role_and_serves_the_new_role(model_dir, tmp_path):
    coord = FakeCoordinator()
    log = open(tmp_path / "worker.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "worker", "--role", "prefill", "--coordinator", coord.address,
                             "--model", str(model_dir), "--num-blocks", "32", "--block-size", "8", "--threads", "1",
                             "--worker-id", "w-0", "--heartbeat-s", "0.1"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        hello = coord.expect(Hello)
        assert (hello.worker_id, hello.role, hello.roles) == ("w-0", Role.PREFILL, [Role.PREFILL, Role.DECODE, Role.COLOCATED])
        coord.send(Welcome(PROTOCOL_VERSION))
        coord.expect(Heartbeat)  # registered
        coord.send(SetRole(Role.DECODE, 5))
        assert coord.expect(RoleSet) == RoleSet("w-0", Role.DECODE, 5)
        coord.send(Generate("g", PROMPT, GREEDY))
        tokens, done = [], False
        while not done:
            for item in coord.expect(TokenBatch).items:
                tokens.append(item.token_id)
                done = item.finish_reason is not None
        want = LLMEngine.load(str(model_dir), EngineConfig(num_blocks=32, block_size=8), progress=False, tokenizer=False)
        assert tokens == want.generate([PROMPT], GREEDY)[0].token_ids
        coord.send(Reject("unregistered"))  # a restarted coordinator forgot it: it says Hello again, in its role now
        again = coord.expect(Hello)
        assert again.role == Role.DECODE and again.pid == hello.pid
        coord.send(Welcome(PROTOCOL_VERSION))
        coord.send(SetRole(Role.PREFILL, 6))
        assert coord.expect(RoleSet) == RoleSet("w-0", Role.PREFILL, 6)
        coord.expect(Heartbeat, where=lambda h: h.free_blocks == hello.num_blocks and h.running == 0)  # the pool whole
        coord.send(Shutdown())
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        coord.close()
