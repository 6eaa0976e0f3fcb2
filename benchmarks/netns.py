"""Hosts on one machine: a network namespace each, joined by veth pairs on a bridge of the host's,
with real addresses on a private subnet (nothing else is ever contacted), and optionally a link
rate: `tc` token-bucket shaping on a host's veth, both ways, as a link between nodes would be
(e.g. 1 Gbit/s). Used by tests/faults/test_multihost.py and benchmarks/handoff_cost.py
(`--link-gbit`). Needs root and iproute2.

Lifecycle: `with hosts(subnet, {"p": 2, "d": 3}, rate_gbit=1.0) as net:` creates the bridge
(SUBNET.254) and one namespace per host (SUBNET.N), `net.run(host, cmd)` prefixes a command with
`ip netns exec`, `net.cut(host)` / `net.restore(host)` take its link down and up; leaving the block
deletes the namespaces and the bridge. `drop_leftovers` first removes those of an earlier run
killed before its teardown (its bridge holds the same subnet, so the kernel would route this run's
packets to it).
"""
from __future__ import annotations

import contextlib
import re
import subprocess
import uuid
from dataclasses import dataclass


def sh(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def drop_leftovers() -> None:
    links = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
    for name in re.findall(r"^\d+: (pdbr[0-9a-f]{5})[:@]", links, re.M):
        subprocess.run(["ip", "link", "del", name], capture_output=True)
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in re.findall(r"^(pd[a-z][0-9a-f]{5})\b", spaces, re.M):
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Net:
    subnet: str
    names: dict[str, str]  # host -> its namespace
    tag: str

    def run(self, host: str, cmd: list[str]) -> list[str]:
        """cmd run inside host's namespace."""
        return ["ip", "netns", "exec", self.names[host], *cmd]

    def cut(self, host: str) -> None:
        sh("link", "set", f"b{host}{self.tag}", "down")

    def restore(self, host: str) -> None:
        sh("link", "set", f"b{host}{self.tag}", "up")


def shape(dev: str, rate_gbit: float, netns: str | None = None) -> None:
    """Token-bucket shaping of dev's egress at rate_gbit (burst: 1 ms of the rate, at least 64 KiB; 50 ms queue)."""
    burst = max(64 * 1024, int(rate_gbit * 1e9 / 8 / 1000))
    cmd = ["tc", *(["-n", netns] if netns else []), "qdisc", "replace", "dev", dev, "root", "tbf",
           "rate", f"{rate_gbit}gbit", "burst", str(burst), "latency", "50ms"]
    subprocess.run(cmd, check=True, capture_output=True)


@contextlib.contextmanager
def hosts(subnet: str, numbers: dict[str, int], rate_gbit: float = 0.0):
    """A namespace per host (host name: one lowercase letter), SUBNET.<its number>/24 on a bridge at
    SUBNET.254; with rate_gbit > 0 each host's link is shaped both ways (its veth's egress, and the
    bridge side's: what it receives)."""
    drop_leftovers()
    tag = uuid.uuid4().hex[:5]
    bridge = f"pdbr{tag}"
    names = {h: f"pd{h}{tag}" for h in numbers}
    sh("link", "add", bridge, "type", "bridge")
    sh("addr", "add", f"{subnet}.254/24", "dev", bridge)
    sh("link", "set", bridge, "up")
    try:
        for h, n in names.items():
            sh("netns", "add", n)
            sh("link", "add", f"v{h}{tag}", "type", "veth", "peer", "name", f"b{h}{tag}")
            sh("link", "set", f"v{h}{tag}", "netns", n)
            sh("link", "set", f"b{h}{tag}", "master", bridge, "up")
            sh("-n", n, "addr", "add", f"{subnet}.{numbers[h]}/24", "dev", f"v{h}{tag}")
            sh("-n", n, "link", "set", f"v{h}{tag}", "up")
            sh("-n", n, "link", "set", "lo", "up")
            if rate_gbit > 0:
                shape(f"v{h}{tag}", rate_gbit, netns=n)
                shape(f"b{h}{tag}", rate_gbit)
        yield Net(subnet, names, tag)
    finally:
        for n in names.values():
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
