"""A Coordinator whose sends are recorded instead of leaving on sockets, for in-process tests
of its request and worker handling (messages in through on_worker / on_client, out in lists)."""
from coordinator.server import Coordinator
from runtime.tokenizer import load_tokenizer


class Recorded(Coordinator):
    def __init__(self, cfg):
        super().__init__(cfg, tokenizer=load_tokenizer(None))
        self.to_workers, self.to_clients = [], []

    def send_worker(self, w, msg):
        self.to_workers.append((w.hello.worker_id, msg))

    def send_client(self, ident, msg):
        self.to_clients.append(msg)

    def taken(self, kind):
        return [(wid, m) for wid, m in self.to_workers if isinstance(m, kind)]
