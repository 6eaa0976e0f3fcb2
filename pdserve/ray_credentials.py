"""What a `pdserve launch --ray` worker actor is handed to authenticate its worker, and the private
directories those files live in on each node. Nothing here imports ray (tested without a cluster).

A worker needs, of the `--keys` directory (wire/security.py): the worker keypair and the server's
public key (its connections to the coordinator and to decode workers' KV ports), and, unless it is
a fixed prefill worker, the server keypair and the admitted worker keys (its own KV port, a CURVE
server with a ZAP domain of workers); never the client keypair (`role_key_files`). Without --keys
these come from the keys the launch made for itself (wire/security.py), marker LOOPBACK_ONLY with them.

Lifecycle: every directory written here is `copies_root()/<pid>` (0700, in this user's 0700
folder in the node's temp directory), named by the process it belongs to: the launch's
(`LaunchFiles`: a private cluster's Ray token and each role's keys, read by its actors by path) or
a worker actor's (`own_copy_dir`: the key files it was handed as arguments). Its
owner removes it at stop; one whose process is gone (an actor Ray restarted, a launch killed) is
removed by the next launch or actor that starts on the node (`remove_stale_copies`).
"""
from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile

from pdserve.launch import ConfigError
from pdserve.wire.security import LOOPBACK_ONLY
from pdserve_client.keys import SERVER, WORKER

ADMITTED_WORKERS = "authorized-workers"  # the worker public keys a KV port admits
CLIENTS_ADMITTED = "authorized"  # the client public keys: a worker's authenticator wants the folder, it admits no client
TOKEN_NAME = "ray-token"


def role_key_files(keys: str, role: str, fixed_roles: bool) -> dict[str, bytes]:
    """{relative path: bytes} of the keys directory `keys` that a worker of `role` needs."""
    names = [f"{SERVER}.key", f"{WORKER}.key", f"{WORKER}.key_secret"]
    if os.path.exists(os.path.join(keys, LOOPBACK_ONLY)):  # a launch's own keys: its workers' binds stay on loopback too
        names.append(LOOPBACK_ONLY)
    folder = os.path.join(keys, ADMITTED_WORKERS)
    if not (fixed_roles and role == "prefill"):  # every other worker binds a KV port (worker/any_role.py)
        admitted = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        names += [f"{SERVER}.key_secret", *(f"{ADMITTED_WORKERS}/{n}" for n in admitted)]
    out = {}
    for name in names:
        try:
            with open(os.path.join(keys, name), "rb") as f:
                out[name] = f.read()
        except FileNotFoundError:
            raise ConfigError(f"no {name} in {keys}: run `pdserve keygen {keys}` again (workers have their own keypair)") from None
    if not (fixed_roles and role == "prefill") and not any(n.startswith(ADMITTED_WORKERS) for n in out):
        raise ConfigError(f"no worker keys in {folder}: run `pdserve keygen {keys}` again (workers have their own keypair)")
    return out


def write_keys(root: str, files: dict[str, bytes]) -> str:
    """`files` (role_key_files) as a keys directory root/keys; returns its path."""
    keys = os.path.join(root, "keys")
    for folder in (keys, os.path.join(keys, CLIENTS_ADMITTED), os.path.join(keys, ADMITTED_WORKERS)):
        os.mkdir(folder, 0o700)
    for name, data in files.items():
        write_private(os.path.join(keys, name), data)
    return keys


def write_private(path: str, data: bytes) -> str:
    """A new 0600 file (never an existing one, nor through a link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def copies_root() -> str:
    """This user's folder of launch and actor directories on this node, made 0700 if missing;
    PermissionError if it is a link, another user's, or open to others."""
    root = os.path.join(tempfile.gettempdir(), f"pdserve-ray-{os.getuid()}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{root} must be a directory of this user's that only its owner can open (mode 0700)")
    return root


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def remove_stale_copies(root: str) -> list[str]:
    """Remove the directories under root whose process is gone; returns their names."""
    gone = [name for name in os.listdir(root) if name.isdigit() and not alive(int(name))]
    for name in gone:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return gone


def own_copy_dir() -> str:
    """This process's directory (copies_root()/<pid>), empty, after the stale ones are removed."""
    root = copies_root()
    remove_stale_copies(root)
    path = os.path.join(root, str(os.getpid()))
    shutil.rmtree(path, ignore_errors=True)  # a dead process of the same pid left it
    os.mkdir(path, 0o700)
    return path


class LaunchFiles:
    """A private cluster's launch directory: Ray's token and each role's keys, read by path by its
    actors (they run on this node)."""

    def __init__(self):
        self.root = own_copy_dir()
        self.role_dirs: dict[str, str] = {}

    def write_token(self) -> str:
        """A fresh Ray authentication token (RAY_AUTH_TOKEN_PATH); returns its path."""
        return write_private(os.path.join(self.root, TOKEN_NAME), secrets.token_hex(32).encode())

    def role_keys(self, keys: str, role: str, fixed_roles: bool) -> str:
        """The keys directory of `role`'s workers (written once)."""
        if role not in self.role_dirs:
            folder = os.path.join(self.root, role)
            os.mkdir(folder, 0o700)
            self.role_dirs[role] = write_keys(folder, role_key_files(keys, role, fixed_roles))
        return self.role_dirs[role]

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
