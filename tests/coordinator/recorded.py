"""A Coordinator whose sends are recorded instead of leaving on sockets, for in-process tests
of its request and worker handling (messages in through on_worker / on_client, out in lists).
It is strict about phases: a move outside coordinator/state.py's TRANSITIONS fails the test."""
from pdserve.common.tokenizer import load_tokenizer
from pdserve.coordinator.server import Coordinator


class Recorded(Coordinator):
    def __init__(self, cfg):
        super().__init__(cfg, tokenizer=load_tokenizer(None))
        self.to_workers, self.to_clients = [], []

    def send_worker(self, w, msg):
        self.to_workers.append((w.hello.worker_id, msg))

    def send_client(self, ident, msg, request=None, last=False):
        self.to_clients.append(msg)

    def taken(self, kind):
        return [(wid, m) for wid, m in self.to_workers if isinstance(m, kind)]

    def move(self, st, to):
        was = st.phase
        super().move(st, to)
        assert self.counts["illegal_transitions"] == 0, f"{st.iid} moved {was.name} -> {to.name}: not in TRANSITIONS"
