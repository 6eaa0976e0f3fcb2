"""CurveZMQ keys and the loopback rule for every pdserve socket.

Lifecycle: `pdserve keygen DIR` writes one keypair for the cluster's servers (the coordinator's
two ROUTERs and each decode worker's kv ROUTER), one for its clients (the gateway, client
programs) and one for its workers, and lists the client public key under DIR/authorized and
the worker's under DIR/authorized-workers. Every node gets a copy of DIR. Roles are
authenticated apart: each server socket names its ZAP domain (`clients` for the coordinator's
client port, `workers` for its worker port and the kv ports), and a process given `keys=DIR`
starts a ZAP authenticator that admits only the client keys in `clients` and only the worker
keys in `workers`, so a client key cannot register a worker. Without keys, `pdserve launch`
writes a per-launch secret into a 0600 file (`write_secret`) and hands its path to the
coordinator and its workers: the worker port and the kv ports then run ZMQ PLAIN, admitting
only connections that present the secret (over loopback; beyond it keys are required). A bind
to anything but loopback without keys is refused (`check_bind`) unless the operator said
`insecure` explicitly. Without keys or a secret nothing changes. Reading a keypair and a
connecting socket's CURVE options is the client distribution's pdserve_client/keys.py.
"""
from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

import zmq
import zmq.auth

from pdserve_client.keys import CLIENT, SERVER, WORKER, InsecureBindError, client_options, keypair

CLIENTS, WORKERS = "clients", "workers"  # ZAP domains of the client port and of the worker-facing ports
PLAIN_USER = b"pdserve-worker"


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
    if keys is None and not insecure and not is_loopback(addr):
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


def server_options(keys: str | None, domain: str = CLIENTS, secret: str | None = None) -> dict:
    """Options of a bound socket: CURVE with keys; PLAIN with a secret (the worker-facing ports)."""
    if keys is None:
        return {zmq.PLAIN_SERVER: 1, zmq.ZAP_DOMAIN: domain.encode()} if secret is not None else {}
    public, key = keypair(keys, SERVER)
    return {zmq.CURVE_SERVER: 1, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: key, zmq.ZAP_DOMAIN: domain.encode()}


def worker_options(keys: str | None, secret: str | None = None) -> dict:
    """Options of a worker's connections (to the coordinator, to a decode worker's kv port)."""
    if keys is None:
        return {zmq.PLAIN_USERNAME: PLAIN_USER, zmq.PLAIN_PASSWORD: secret.encode()} if secret is not None else {}
    return client_options(keys, WORKER)


def write_secret(value: str | None = None) -> str:
    """A per-launch secret (fresh, or `value`: one a launcher handed over) in a new 0600 file (in a
    0700 directory); returns its path."""
    path = os.path.join(tempfile.mkdtemp(prefix="pdserve-"), "worker-secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value or secrets.token_urlsafe(32))
    return path


def read_secret(path: str | None) -> str | None:
    """The secret in path (None for no path); refused unless only its owner can read it."""
    if path is None:
        return None
    mode = os.stat(path).st_mode
    if stat.S_IMODE(mode) & 0o077:
        raise InsecureBindError(f"the worker secret {path} must be readable by its owner only (chmod 600)")
    with open(path) as f:
        return f.read().strip()


def apply(sock: zmq.Socket, options: dict) -> None:
    for opt, value in options.items():
        sock.setsockopt(opt, value)


def start_authenticator(ctx: zmq.Context, keys: str | None, secret: str | None = None):
    """A ZAP handler (None without keys or secret) admitting, with keys, the public keys in
    KEYS/authorized on the `clients` domain and those in KEYS/authorized-workers on `workers`;
    with a secret, PLAIN connections presenting it on `workers`. It runs on its own thread, so
    the handshakes never wait on a server's event loop."""
    if keys is None and secret is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    if keys is not None:
        workers = Path(keys) / "authorized-workers"
        if not workers.is_dir():
            auth.stop()
            raise InsecureBindError(f"no worker keys at {workers}: run `pdserve keygen {keys}` again (workers have their own keypair)")
        auth.configure_curve(domain=CLIENTS, location=str(Path(keys) / "authorized"))
        auth.configure_curve(domain=WORKERS, location=str(workers))
    else:
        auth.configure_plain(domain=WORKERS, passwords={PLAIN_USER.decode(): secret})
    return auth
