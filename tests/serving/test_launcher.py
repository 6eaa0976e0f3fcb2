"""`pdserve launch` as a user runs it: the whole node comes up, answers, and stops cleanly on
SIGTERM with no process left behind and its shared-memory pools unlinked; a cluster TOML starts
each node's roles, and `pdserve generate` / `pdserve stats` talk to it."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve_client.library import Client
from tests.helpers import free_port, pools_of, save_tiny_served_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return d


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def wait_ready(proc, address, n_workers, timeout=120):
    deadline = time.monotonic() + timeout
    with Client(address, timeout=2) as c:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "launcher exited early"
            try:
                stats = c.stats(timeout=1)
                if len(stats["workers"]) >= n_workers:
                    return stats
            except Exception:
                pass
            time.sleep(0.2)
    raise AssertionError("service not ready in time")


def pdserve(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "pdserve", *args], **kw)


def test_launch_serves_and_stops_cleanly_on_sigterm(model_dir, tmp_path):
    clients, workers = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = pdserve("launch", "--model", str(model_dir), "--clients", clients, "--workers", workers, "--threads", "1",
                   "--http-port", str(free_port()), "--log-dir", str(tmp_path), "--engine-arg=--kv-cache-mb=8", stderr=subprocess.PIPE, text=True)
    try:
        stats = wait_ready(proc, clients, 2)
        assert sorted(w["role"] for w in stats["workers"]) == ["decode", "prefill"]
        kids = children_of(proc.pid)
        assert len(kids) == 4  # coordinator, HTTP gateway, prefill, decode
        assert pools_of(*kids)
        out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "--coordinator", clients, "--raw", "--max-tokens", "6",
                              "--ignore-eos", "Once upon a time"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "[6 tokens, finish length" in out.stderr
        out = subprocess.run([sys.executable, "-m", "pdserve", "stats", "--coordinator", clients], capture_output=True, text=True, timeout=60)
        doc = json.loads(out.stdout)
        assert doc["requests"]["finished:length"] == 1 and len(doc["workers"]) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    assert all(not os.path.exists(f"/proc/{k}") for k in kids), "orphan processes left"
    assert not pools_of(*kids)


def test_cluster_toml_two_nodes(model_dir, tmp_path):
    cport, wport = free_port(), free_port()
    cfg = tmp_path / "cluster.toml"
    cfg.write_text(f"""
[cluster]
coordinator_host = "127.0.0.1"
client_port = {cport}
worker_port = {wport}
model = "{model_dir}"
kv_backend = "tcp"
kv_cache_mb = 8

[nodes.a]
host = "127.0.0.1"
coordinator = true
prefill = 1
threads = 1

[nodes.b]
host = "127.0.0.1"
decode = 1
threads = 1
""")
    a = pdserve("launch", "--config", str(cfg), "--node", "a", "--log-dir", str(tmp_path / "a"), "--http-port", str(free_port()),
                "--paths", "remote")  # the prompt is handed off across the nodes (auto would prefill this short one on b)
    b = pdserve("launch", "--config", str(cfg), "--node", "b", "--log-dir", str(tmp_path / "b"))
    try:
        stats = wait_ready(a, f"tcp://127.0.0.1:{cport}", 2)
        assert {w["id"] for w in stats["workers"]} == {"a-prefill-0", "b-decode-0"}
        with Client(f"tcp://127.0.0.1:{cport}") as c:
            r = c.generate(token_ids=[10, 20, 30, 40], temperature=0, max_tokens=5, ignore_eos=True)
            assert r.completion_tokens == 5
            assert c.stats()["kv_transfer"]["handoffs"] == 1
    finally:
        for p in (b, a):
            p.send_signal(signal.SIGTERM)
        for p in (b, a):
            p.wait(timeout=30)
    assert a.returncode == 0 and b.returncode == 0


def test_workers_start_as_workers_that_can_change_role_unless_fixed():
    """By default every worker is `pdserve worker --role ROLE`; --fixed-roles keeps the dedicated
    prefill worker and `pdserve decode`. Each command line parses with its role's own command."""
    from pdserve.cli import _usage_error
    from pdserve.launch import Launcher, NodePlan

    for fixed in (False, True):
        launcher = Launcher(NodePlan(kv_backend="tcp", fixed_roles=fixed))
        for role in ("prefill", "decode", "colocated"):
            args = launcher._role_command(role)
            want = [{"prefill": "prefill"}.get(role, "decode")] if fixed else ["worker", *args[1:-2], "--role", role]
            assert args[:len(want)] == want and ("--colocated" in args) == (fixed and role == "colocated")
            assert _usage_error(args[0], args[1:]) is None, args
        assert ("--kv-backend" in launcher._role_command("decode")) == (not fixed)  # a decode worker may become a prefill one


def test_several_models_whose_derived_ports_collide_are_refused():
    """Model i takes the --clients and --workers ports + 2i: a --workers port two above --clients
    would be model 1's clients port, refused before anything starts."""
    from pdserve.launch import ConfigError, NodePlan

    plan = NodePlan(client_addr="tcp://127.0.0.1:6000", worker_addr="tcp://127.0.0.1:6002", more_models=[("/m", None)])
    with pytest.raises(ConfigError, match="collide"):
        plan.models
    ok = NodePlan(client_addr="tcp://127.0.0.1:6000", worker_addr="tcp://127.0.0.1:6001", more_models=[("/m", None)])
    assert [m.client_addr for m in ok.models] == ["tcp://127.0.0.1:6000", "tcp://127.0.0.1:6002"]


def test_workers_on_cuda_get_gpus_of_their_own():
    """`--device cuda`: each worker takes as many GPUs as its tensor-parallel size, in start order
    (prefill workers first), from --base-gpu-id on; one placed by hand (cuda:K) or on the CPU is
    left alone; too few for one set each: they share them; a worker wider than the node is refused."""
    from pdserve.launch import ConfigError, flag_value, plan_gpus

    assert flag_value(["--device", "cpu", "--device=cuda", "-tp", "3"], ("--device",)) == "cuda"
    assert flag_value(["-tp", "3"], ("--tensor-parallel-size", "-tp")) == "3" and flag_value([], ("--device",)) is None
    cuda = ["--device", "cuda"]
    workers = [("prefill-0", ["worker", *cuda, "--tensor-parallel-size", "3"]), ("prefill-1", ["worker", *cuda, "--device", "cuda:7"]),
               ("decode-0", ["worker", *cuda, "--tensor-parallel-size=2"]), ("decode-1", ["decode", *cuda]), ("decode-2", ["decode"])]
    assert plan_gpus(workers, 6) == {"prefill-0": "cuda:0", "decode-0": "cuda:3", "decode-1": "cuda:5"}
    assert plan_gpus(workers, 8, base=2) == {"prefill-0": "cuda:2", "decode-0": "cuda:5", "decode-1": "cuda:7"}
    # too few for one set each: they share from the base on (each worker's ranks still on GPUs of their own)
    assert plan_gpus(workers, 4) == {"prefill-0": "cuda:0", "decode-0": "cuda:0", "decode-1": "cuda:0"}
    pair = [("prefill-0", ["worker", *cuda]), ("decode-0", ["worker", *cuda])]
    assert plan_gpus(pair, 1) == {"prefill-0": "cuda:0", "decode-0": "cuda:0"}  # the default launch on a one-GPU machine
    with pytest.raises(ConfigError, match=r"needs 3 GPUs from cuda:2 on \(prefill-0: 3 GPUs, decode-0: 2 GPUs, decode-1: 1 GPU\) but this node sees 4"):
        plan_gpus(workers, 4, base=2)
    assert plan_gpus(workers[4:], 0, base=3) == {}  # nothing on cuda: nothing counted


def test_launch_refuses_cuda_workers_before_anything_starts_when_the_node_lacks_gpus(tmp_path):
    """`pdserve launch --device cuda` on a node without enough GPUs (here: none) stops at once with
    exit status 1 and says what each worker would take; no coordinator or worker was started."""
    import torch

    if torch.cuda.device_count() >= 4:
        pytest.skip("this node has the GPUs: the launch would start")
    run = subprocess.run([sys.executable, "-m", "pdserve", "launch", "--device", "cuda", "--prefill-tp", "3", "--no-gateway",
                          "--clients", f"tcp://127.0.0.1:{free_port()}", "--workers", f"tcp://127.0.0.1:{free_port()}",
                          "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "a worker on --device cuda needs 3 GPUs from cuda:0 on (prefill-0: 3 GPUs, decode-0: 1 GPU) but this node sees" in run.stderr
    assert not list(tmp_path.glob("*.log"))  # no child ever started
