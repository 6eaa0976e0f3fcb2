"""A client's CurveZMQ socket options, read from the keys directory `pdserve keygen DIR` writes
(the engine's wire/security.py writes it and serves with its server keypair).

Lifecycle: read once, when a Client or AsyncClient is made with keys=DIR (or a worker connects:
wire/security.py reads its keypair the same way); nothing is kept open.
"""
from __future__ import annotations

from pathlib import Path

import zmq
import zmq.auth

from pdserve_client.errors import PdserveError

SERVER, CLIENT, WORKER = "server", "client", "worker"  # the keypairs in a keys directory: DIR/<name>.key(_secret)


class InsecureBindError(PdserveError):
    code = "insecure_bind"


def keypair(keys: str, name: str) -> tuple[bytes, bytes]:
    """(public, secret) of the keypair `name` in the directory keys."""
    path = Path(keys) / f"{name}.key_secret"
    if not path.is_file():
        raise InsecureBindError(f"no {name} keypair at {path}: run `pdserve keygen {keys}`")
    public, secret = zmq.auth.load_certificate(str(path))
    return public, secret


def client_options(keys: str | None, name: str = CLIENT) -> dict:
    """The CURVE options of a socket connecting with the keypair `name` to the servers of keys ({} without keys)."""
    if keys is None:
        return {}
    public, secret = keypair(keys, name)
    server_public, _ = zmq.auth.load_certificate(str(Path(keys) / f"{SERVER}.key"))
    return {zmq.CURVE_SERVERKEY: server_public, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}
