"""CurveZMQ keys and the loopback rule for every pdserve socket.

Lifecycle: `pdserve keygen DIR` writes one keypair for the cluster's servers (the coordinator's
two ROUTERs and each decode worker's kv ROUTER) and one for its clients (workers, the gateway,
client programs), and lists the client public key as authorized. Every node gets a copy of DIR.
A process given `keys=DIR` starts a ZAP authenticator that admits only authorized client keys,
and puts CURVE options on each socket it binds (`server_options`) or connects (`client_options`).
A bind to anything but loopback without keys is refused (`check_bind`) unless the operator
said `insecure` explicitly. Without keys and on loopback nothing changes.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
from pathlib import Path

import zmq
import zmq.auth

from runtime.errors import PdserveError

SERVER, CLIENT = "server", "client"


class InsecureBindError(PdserveError):
    code = "insecure_bind"


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
    authorized = d / "authorized"
    authorized.mkdir(parents=True, exist_ok=True)
    for name in (SERVER, CLIENT):
        for suffix in (".key", ".key_secret"):
            (d / f"{name}{suffix}").unlink(missing_ok=True)
        zmq.auth.create_certificates(str(d), name)
    os.chmod(d / f"{SERVER}.key_secret", 0o600)
    os.chmod(d / f"{CLIENT}.key_secret", 0o600)
    shutil.copy(d / f"{CLIENT}.key", authorized / f"{CLIENT}.key")
    return d


def _pair(keys: str, name: str) -> tuple[bytes, bytes]:
    path = Path(keys) / f"{name}.key_secret"
    if not path.is_file():
        raise InsecureBindError(f"no {name} keypair at {path}: run `pdserve keygen {keys}`")
    public, secret = zmq.auth.load_certificate(str(path))
    return public, secret


def server_options(keys: str | None) -> dict:
    if keys is None:
        return {}
    public, secret = _pair(keys, SERVER)
    return {zmq.CURVE_SERVER: 1, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}


def client_options(keys: str | None) -> dict:
    if keys is None:
        return {}
    public, secret = _pair(keys, CLIENT)
    server_public, _ = zmq.auth.load_certificate(str(Path(keys) / f"{SERVER}.key"))
    return {zmq.CURVE_SERVERKEY: server_public, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}


def apply(sock: zmq.Socket, options: dict) -> None:
    for opt, value in options.items():
        sock.setsockopt(opt, value)


def start_authenticator(ctx: zmq.Context, keys: str | None):
    """A ZAP handler admitting only the public keys in KEYS/authorized (None without keys); it
    runs on its own thread, so the CurveZMQ handshakes never wait on a server's event loop."""
    if keys is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(Path(keys) / "authorized"))
    return auth
