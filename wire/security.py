"""CurveZMQ keys and the loopback rule for every pdserve socket.

Lifecycle: `pdserve keygen DIR` writes one keypair for the cluster's servers (the coordinator's
two ROUTERs and each decode worker's kv ROUTER), one for its clients (the gateway, client
programs) and one for its workers, and lists the client public key under DIR/authorized and
the worker's under DIR/authorized-workers. Every node gets a copy of DIR. Roles are
authenticated apart: each server socket names its ZAP domain (`clients` for the coordinator's
client port, `workers` for its worker port and the kv ports), and a process given `keys=DIR`
starts a ZAP authenticator that admits only the client keys in `clients` and only the worker
keys in `workers`, so a client key cannot register a worker.

Without --keys, `pdserve launch` (a node that runs its coordinator) makes a keys directory of
its own (`write_launch_keys`, in this user's 0700 run directory, pdserve_client/keys.py) and
hands it to every role as if the operator had: every port of the launch is CURVE, so no other
user's process registers a worker or sends a request (the client port too: the API key cannot be
bypassed), and a process that binds a port during a restart gap learns nothing (it cannot finish
a handshake without the server's secret key). The same user's client programs find it by the
coordinator's port (`launch_keys_for`). Such a directory holds a LOOPBACK_ONLY marker: with it a
bind beyond loopback is still refused (`check_bind`: its keys never leave the machine, so a
remote peer could not use that bind). The launcher removes it at stop; one whose launcher is gone
is removed by the next launch (`sweep_launch_keys`). A bind to anything but loopback without
keys is refused unless the operator said `insecure` explicitly. Reading a keypair and a
connecting socket's CURVE options is the client distribution's pdserve_client/keys.py.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
from pathlib import Path

import zmq
import zmq.auth

from pdserve_client.keys import CLIENT, SERVER, WORKER, InsecureBindError, client_options, keypair, launcher_alive, loopback_port, run_dir

CLIENTS, WORKERS = "clients", "workers"  # ZAP domains of the client port and of the worker-facing ports
LOOPBACK_ONLY = "LOOPBACK_ONLY"  # the marker of a launch's own keys directory


def is_loopback(addr: str) -> bool:
    """True for ipc://, inproc:// and tcp:// endpoints on 127.0.0.0/8, ::1 or localhost."""
    if not addr.startswith("tcp://"):
        return addr.startswith(("ipc://", "inproc://"))
    host = re.sub(r":[^:\]]*$", "", addr[len("tcp://"):]).strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or interface name: treat as exposed


def check_bind(addr: str, keys: str | None, insecure: bool) -> None:
    """InsecureBindError for a bind beyond loopback without the operator's keys (a launch's own do not count) or --insecure."""
    operators = keys is not None and not (Path(keys) / LOOPBACK_ONLY).exists()
    if not operators and not insecure and not is_loopback(addr):
        raise InsecureBindError(
            f"refusing to bind {addr} without CurveZMQ keys: create them with `pdserve keygen DIR` and pass --keys DIR "
            "on every node, or pass --insecure to accept unauthenticated, unencrypted traffic"
        )


def keygen(directory: str) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name in (SERVER, CLIENT, WORKER):
        for suffix in (".key", ".key_secret"):
            (d / f"{name}{suffix}").unlink(missing_ok=True)
        zmq.auth.create_certificates(str(d), name)
        os.chmod(d / f"{name}.key_secret", 0o600)
    for name, folder in ((CLIENT, "authorized"), (WORKER, "authorized-workers")):
        (d / folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(d / f"{name}.key", d / folder / f"{name}.key")
    return d


def server_options(keys: str | None, domain: str = CLIENTS) -> dict:
    """Options of a bound socket: CURVE with keys (its ZAP domain says whom it admits), none without."""
    if keys is None:
        return {}
    public, key = keypair(keys, SERVER)
    return {zmq.CURVE_SERVER: 1, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: key, zmq.ZAP_DOMAIN: domain.encode()}


def worker_options(keys: str | None) -> dict:
    """Options of a worker's connections (to the coordinator, to a decode worker's kv port)."""
    return client_options(keys, WORKER) if keys is not None else {}


def write_launch_keys(client_addrs: list[str]) -> str:
    """A launch's own keys directory, run_dir()/launch-<this pid> (0700, LOOPBACK_ONLY marked), linked
    as coordinator-<port> for each of its coordinators' client addresses on loopback; returns its path."""
    sweep_launch_keys()
    root = run_dir()
    d = root / f"launch-{os.getpid()}"
    d.mkdir(mode=0o700)
    keygen(str(d))
    (d / LOOPBACK_ONLY).write_text("the keys of one `pdserve launch`: they never leave this machine; binds stay on loopback\n")
    for port in filter(None, map(loopback_port, client_addrs)):
        link = root / f"coordinator-{port}"
        if not os.path.islink(link):  # (after the sweep a link is a live launch's: it holds the port, our coordinator fails to bind)
            os.symlink(d.name, link)
    return str(d)


def remove_launch_keys(keys: str) -> None:
    """Remove a launch's keys directory and the links to it."""
    root, name = Path(keys).parent, Path(keys).name
    for link in root.glob("coordinator-*"):
        if os.path.islink(link) and os.readlink(link) == name:
            link.unlink(missing_ok=True)
    shutil.rmtree(keys, ignore_errors=True)


def sweep_launch_keys() -> None:
    """Remove this user's launch keys directories whose launcher is gone, and links to nothing live."""
    root = run_dir()
    for d in root.glob("launch-*"):
        if not launcher_alive(d.name):
            remove_launch_keys(str(d))
    for link in root.glob("coordinator-*"):
        if os.path.islink(link) and not launcher_alive(os.readlink(link)):
            link.unlink(missing_ok=True)


def apply(sock: zmq.Socket, options: dict) -> None:
    for opt, value in options.items():
        sock.setsockopt(opt, value)


def start_authenticator(ctx: zmq.Context, keys: str | None):
    """A ZAP handler (None without keys) admitting the public keys in KEYS/authorized on the
    `clients` domain and those in KEYS/authorized-workers on `workers`. It runs on its own
    thread, so the handshakes never wait on a server's event loop."""
    if keys is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    workers = Path(keys) / "authorized-workers"
    if not workers.is_dir():
        raise InsecureBindError(f"no worker keys at {workers}: run `pdserve keygen {keys}` again (workers have their own keypair)")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain=CLIENTS, location=str(Path(keys) / "authorized"))
    auth.configure_curve(domain=WORKERS, location=str(workers))
    return auth
