"""A `pdserve launch` with a tensor-parallel worker listens on loopback only (issue 38): every TCP
socket in LISTEN state owned by any process of the launch's tree (the launcher, coordinator,
gateway, workers and their rank processes), read from /proc (each process's socket inodes in
/proc/PID/fd, their addresses in /proc/net/tcp and tcp6), is bound to 127.0.0.0/8 or ::1, from
the ranks' start until the node serves and after a request. The TP rendezvous itself (a FileStore
in a private directory, gloo on 127.0.0.1, every connection proven with the group's token:
runtime/tp.py) is tested in tests/runtime/test_tp.py."""
from __future__ import annotations

import ipaddress
import os
import time

import pytest

from pdserve_client.library import Client, ClientError
from tests.faults.test_supervised_launch import Node
from tests.helpers import save_tiny_served_model, wait_all_blocks_free

LISTEN = "0A"  # the state column of /proc/net/tcp
TINY_TP3 = dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=192)  # splits 3 ways


def children(pid: int) -> list[int]:
    """pid's live children (each of its threads' /proc/PID/task/TID/children)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    found = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
    return found


def process_tree(root: int) -> list[int]:
    """root and every live descendant."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children(pid)
    return found


def socket_owners(pids: list[int]) -> dict[int, int]:
    """Socket inode -> the pid holding it, over pids' open files."""
    owners = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, PermissionError):
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except (FileNotFoundError, PermissionError):
                continue
            if link.startswith("socket:["):
                owners[int(link[8:-1])] = pid
    return owners


def hex_address(h: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6}'s address: 32-bit words in the host's byte order (little-endian here)."""
    raw = bytes.fromhex(h)
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def tcp_listeners() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket in this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == LISTEN:
                    addr, port = cols[1].split(":")
                    out[int(cols[9])] = (str(hex_address(addr)), int(port, 16))
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return " ".join(f.read().split("\0"))
    except FileNotFoundError:
        return "(gone)"


def tree_listeners(root: int) -> dict[tuple[str, int], str]:
    """(address, port) -> the owning process's command line, for every TCP listener of root's tree."""
    owners = socket_owners(process_tree(root))
    return {where: cmdline(owners[inode])[:160] for inode, where in tcp_listeners().items() if inode in owners}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp3")
    save_tiny_served_model(d, **TINY_TP3)
    return d


@pytest.mark.timeout(180)
def test_a_tp3_launch_listens_on_loopback_only(model, tmp_path):
    """`pdserve launch --decode-tp 3`: sampled every 0.1 s from launch until the TP 3 worker
    serves (its two rank processes started and joined), then after a request."""
    node = Node(model, tmp_path, "--decode-tp", "3", "--fixed-roles", "--engine-arg=--kv-cache-mb=8")
    seen: dict[tuple[str, int], str] = {}
    try:
        deadline = time.monotonic() + 150
        with Client(node.clients, timeout=2) as c:
            while True:
                assert node.proc.poll() is None, f"launcher exited: {node.stderr()}"
                seen.update(tree_listeners(node.proc.pid))
                try:
                    workers = c.stats(timeout=1)["workers"]
                except ClientError:
                    workers = []
                if sorted(w["engine"]["tensor_parallel_size"] for w in workers) == [1, 3]:
                    break
                assert time.monotonic() < deadline, f"the TP 3 node did not serve in time: {node.stderr()}"
                time.sleep(0.1)
        decode = next(w for w in workers if w["engine"]["tensor_parallel_size"] == 3)
        assert len([p for p in children(decode["pid"]) if "pdserve.worker.tp_ranks" in cmdline(p)]) == 2
        with Client(node.clients, timeout=60) as c:
            assert c.generate(token_ids=[5, 6, 7, 8], temperature=0, max_tokens=4, ignore_eos=True).completion_tokens == 4
            wait_all_blocks_free(c, timeout=10)
        seen.update(tree_listeners(node.proc.pid))
        assert seen, "no listener found: the coordinator's ports at least should be"
        outside = {f"{a}:{p}": who for (a, p), who in seen.items() if not is_loopback(a)}
        assert not outside, f"listening beyond loopback: {outside}"
    finally:
        assert node.stop() == 0
