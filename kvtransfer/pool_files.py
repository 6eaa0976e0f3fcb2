"""Where shared-memory KV pools live, what they are named, who may map them, and the sweep of
those whose owners are gone. Imports no torch (the launcher and the commands' flag parsing use it).

Lifecycle: every shared pool is a file in one per-user directory, /dev/shm/pdserve-<uid>/
($PDSERVE_SHM_DIR/pdserve-<uid>/ where that is set; `ensure_pool_dir`: made 0700 on first use;
on every use it must be a real directory, not a symlink, owned by this user with mode 0700, else `PoolDirError`). Its owner (the worker that
creates it, kvtransfer.pool.KVPool.create) names it `new_pool_path()`:
kv-<owner pid>-<owner start time>-<16 random hex digits>, opens it O_CREAT|O_EXCL|O_NOFOLLOW,
holds an flock on it while it lives and unlinks it at close. A SIGKILL of the owner, or of its
whole process group (OOM killer, docker kill, a supervisor's last resort), leaves the file;
`sweep_dead_pools` removes each pool whose owner is gone: no process runs with its pid and that
start time (so a reused pid cannot keep it) and nobody holds its flock (an owner alive in another
pid namespace sharing /dev/shm keeps it); and the pools an earlier pdserve left directly in
/dev/shm (pdserve-kv-<pid>: this user's, unlocked, that pid not running). The sweep runs when a
worker command starts (before it sizes its KV budget from /dev/shm's free space), when a pool is
created, when `pdserve launch` starts, and for a child's pid when the launcher reaps it.
A node-wide host KV tier (kvtransfer.host_tier: tier-<creator pid>-<start time>-<fingerprint>)
lives in the same directory and is swept by the same rule; its users hold shared flocks.
A pool path from a peer (KVAccept.shm_path, a TP rank's RankSpec.pool_path) is opened only by
`open_peer_pool`: canonical (realpath gives it back unchanged: no `..`, no symlink), a pool name
directly in this user's pool directory, opened O_NOFOLLOW, a regular file of this user of exactly
the expected size; anything else raises `PoolRefused` before anything is mapped.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import stat
import time

from pdserve.common.shm import SHM_DIR, shm_dir
from pdserve_client.errors import PdserveError

log = logging.getLogger("pdserve.kvpool")

POOL_NAME = re.compile(r"kv-(\d+)-(\d+)-[0-9a-f]{16}")
TIER_NAME = re.compile(r"tier-(\d+)-(\d+)-([0-9a-f]{16})")  # a node-wide host KV tier (kvtransfer.host_tier): swept as a pool is
LEGACY_NAME = re.compile(r"pdserve-kv-(\d+)")  # where pdserve before the pool directory put a worker's pool: /dev/shm/pdserve-kv-<pid>
CREATING_GRACE_S = 10.0  # an empty, unlocked pool younger than this may be one its owner is still creating


class PoolDirError(PdserveError):
    """This user's pool directory in /dev/shm is not a 0700 directory of this user (another user
    made it first, or a symlink stands there): no pool is created in it."""

    code = "shm_pool_dir"


class PoolRefused(PdserveError, ValueError):
    """A peer named a pool file that is not one of this user's pools of the expected size: nothing is mapped."""

    code = "kv_pool_refused"


def pool_dir() -> str:
    """This user's pool directory: /dev/shm/pdserve-<uid> (shm_dir), resolved (/dev/shm may be a symlink to /run/shm)."""
    return os.path.join(os.path.realpath(shm_dir()), f"pdserve-{os.geteuid()}")


def check_pool_dir(directory: str) -> None:
    """PoolDirError unless directory is a real directory (no symlink) of this user with mode 0700."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
        raise PoolDirError(f"{directory} is {kind} of uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}, not a 0700 "
                           f"directory of uid {os.geteuid()}: shared KV pools are not created there (remove it, or run as another user)")


def ensure_pool_dir() -> str:
    """This user's pool directory, made 0700 if absent and checked (PoolDirError)."""
    directory = pool_dir()
    try:
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)  # (mkdir's mode passes through the umask; /dev/shm's sticky bit keeps others from swapping it)
    except FileExistsError:
        pass
    check_pool_dir(directory)
    return directory


def existing_pool_dir() -> str | None:
    """This user's pool directory if it exists and passes check_pool_dir, else None."""
    directory = pool_dir()
    try:
        check_pool_dir(directory)
    except FileNotFoundError:
        return None
    except PoolDirError as e:
        log.warning("%s", e)
        return None
    return directory


def start_time(pid: int) -> int | None:
    """When process pid started (clock ticks since boot, /proc/PID/stat field 22); None if it is
    gone or a zombie (its files are closed)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def new_pool_path(pid: int | None = None) -> str:
    """A fresh pool path in this user's pool directory for its owner pid (this process by default)."""
    pid = os.getpid() if pid is None else pid
    return os.path.join(ensure_pool_dir(), f"kv-{pid}-{start_time(pid) or 0}-{secrets.token_hex(8)}")


def owner_of(name: str) -> tuple[int, int] | None:
    """(pid, start time) a pool's file name records, or None if the name is not a pool's."""
    m = POOL_NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def tier_creator_of(name: str) -> tuple[int, int] | None:
    """(pid, start time) of the process that created a host KV tier, as its name records; None if
    the name is not a tier's. A tier is shared: the sweep removes it only when its creator is gone
    and no process holds its flock (every user of a tier holds one, shared)."""
    m = TIER_NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def owner_running(pid: int, started: int) -> bool:
    """Whether the pool's owner still runs: pid alive with the same start time (a reused pid is another process)."""
    return start_time(pid) == started


def sweep_dead_pools(pid: int | None = None) -> list[tuple[str, int]]:
    """Remove this user's pools whose owners are gone (only those of owner pid, if given);
    returns (path, bytes) of each one removed. Never raises: a directory that is not ours is skipped."""
    removed = sweep_legacy_pools() if pid is None else []
    directory = existing_pool_dir()
    if directory is None:
        return removed
    for entry in entries(directory):
        owner = owner_of(entry.name) or tier_creator_of(entry.name)
        if owner is None or (pid is not None and owner[0] != pid) or owner_running(*owner):
            continue
        size = remove_if_unheld(entry.path)
        if size is not None:
            log.warning("removed %s (%.1f MiB): a KV pool whose worker (pid %d) is gone", entry.path, size / 2**20, owner[0])
            removed.append((entry.path, size))
    return removed


def sweep_legacy_pools() -> list[tuple[str, int]]:
    """Remove the pools an earlier pdserve left directly in /dev/shm (pdserve-kv-<pid>) whose owner
    is gone: files of this user that no running process has that pid and nobody flocks."""
    removed = []
    for entry in entries(os.path.realpath(SHM_DIR)):
        m = LEGACY_NAME.fullmatch(entry.name)
        if m is None or start_time(int(m.group(1))) is not None:
            continue
        size = remove_if_unheld(entry.path)
        if size is not None:
            log.warning("removed %s (%.1f MiB): a KV pool an earlier pdserve's worker (pid %s) left", entry.path, size / 2**20, m.group(1))
            removed.append((entry.path, size))
    return removed


def entries(directory: str) -> list[os.DirEntry]:
    """The entries of directory ([] if it cannot be read: the sweep never raises)."""
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError:
        return []


def remove_if_unheld(path: str) -> int | None:
    """Unlink the pool file at path unless a process holds its flock, it is not a regular file of
    this user, or its owner may still be creating it; returns its size if removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # gone meanwhile, or not a plain file (nothing of ours makes one)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its owner lives (in another pid namespace)
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or (st.st_size == 0 and time.time() - st.st_ctime < CREATING_GRACE_S)):
            return None
        os.unlink(path)
        return st.st_size
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)


def create_pool_file(path: str) -> int:
    """Create the pool file at path (new_pool_path) for its owner: an fd opened O_EXCL|O_NOFOLLOW
    with mode 0600, flocked while the owner lives."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def open_peer_pool(path: str, nbytes: int) -> int:
    """An fd of the pool file a peer named, opened O_RDWR|O_NOFOLLOW, or PoolRefused: the path must be
    canonical and directly in this user's pool directory, the file a regular one of this user of nbytes."""
    directory = existing_pool_dir()
    real = os.path.realpath(path)
    if directory is None or real != path or os.path.dirname(real) != directory or owner_of(os.path.basename(real)) is None:
        raise PoolRefused(f"refusing to map {path!r}: not a KV pool in {pool_dir()}")
    try:
        fd = os.open(real, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        why = "a symlink" if e.errno == errno.ELOOP else e.strerror
        raise PoolRefused(f"refusing to map {path!r}: {why}") from None
    st = os.fstat(fd)
    problem = ("not a regular file" if not stat.S_ISREG(st.st_mode) else f"owned by uid {st.st_uid}" if st.st_uid != os.geteuid()
               else f"{st.st_size} bytes, expected {nbytes}" if st.st_size != nbytes else "")
    if problem:
        os.close(fd)
        raise PoolRefused(f"refusing to map {path!r}: {problem}")
    return fd
