"""A client's CurveZMQ socket options, read from the keys directory `pdserve keygen DIR` writes
(the engine's wire/security.py writes it and serves with its server keypair).

Lifecycle: read once, when a Client or AsyncClient is made with keys=DIR (or a worker connects:
wire/security.py reads its keypair the same way); nothing is kept open.

A launch's own keys: `pdserve launch` without --keys makes a keys directory for itself (loopback
only) in this user's run directory (`run_dir`, 0700) and names it, for each of its coordinators,
`coordinator-<port>` (a link to `launch-<launcher pid>`). A Client made without keys or curve
for a loopback address looks there (`launch_keys_for`): the same user's programs connect as
before, other users' are refused by the coordinator (they cannot read the client keypair), and an
impostor that binds the port while the coordinator restarts cannot pass the CURVE handshake (it
lacks the server's secret key). An entry whose launcher is gone is ignored.
"""
from __future__ import annotations

import os
import re
import stat
import tempfile
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


def run_dir() -> Path:
    """This user's run directory ($XDG_RUNTIME_DIR/pdserve, else <tmp>/pdserve-run-<uid>), made 0700
    if missing; PermissionError if it is a link, another user's, or open to others."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base, "pdserve") if base else Path(tempfile.gettempdir(), f"pdserve-run-{os.getuid()}")
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{path} must be a directory of this user's that only it can open (chmod 700)")
    return path


def launcher_alive(name: str) -> bool:
    """Whether the launcher whose keys directory is `launch-<pid>` still runs."""
    m = re.fullmatch(r"launch-(\d+)", name)
    if m is None:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the pid: not our launcher
        return False
    return True


def loopback_port(address: str) -> int | None:
    """The port of a tcp:// address on loopback (127.x.y.z, localhost, [::1]), else None."""
    m = re.fullmatch(r"tcp://(127\.\d+\.\d+\.\d+|localhost|\[::1\]):(\d+)", address)
    return int(m.group(2)) if m else None


def launch_keys_for(address: str) -> str | None:
    """The keys directory a running launch of this user made for its coordinator at `address`
    (a loopback tcp:// address), or None."""
    port = loopback_port(address)
    if port is None:
        return None
    try:
        link = run_dir() / f"coordinator-{port}"
        target = link.resolve(strict=True)
    except (OSError, PermissionError):
        return None
    if target.parent != link.parent.resolve() or not launcher_alive(target.name):
        return None
    return str(target)
