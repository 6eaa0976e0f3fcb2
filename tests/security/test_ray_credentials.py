"""What `pdserve launch --ray` hands each worker actor (pdserve/ray_credentials.py, RayLaunch.actor_args), without a
cluster: a worker gets the worker keypair and the server's public key, and the server keypair only when it binds a KV
port (not a fixed prefill worker); no worker gets the client keypair, the API key or the coordinator's and gateway's
flags. On a private cluster the arguments (which Ray keeps in its control store) hold no key material at all, only
paths into the launch's 0700 directory; on another cluster they hold the role's key files. Directories whose process
is gone are removed, the others kept."""
import atexit
import base64
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
import zmq.auth

from pdserve.launch import ConfigError, NodePlan
from pdserve.ray_credentials import LaunchFiles, copies_root, own_copy_dir, role_key_files, write_keys
from pdserve.wire.security import keygen

API_KEY = "sk-test-ray-credentials-0123456789"
ALWAYS = {"server.key", "worker.key", "worker.key_secret"}
KV_SERVER = {"server.key_secret", "authorized-workers/worker.key"}

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'pdserve[ray]')")


@pytest.fixture
def keys(tmp_path):
    return str(keygen(str(tmp_path / "keys")))


def secret_needles(keys: str, name: str) -> list[bytes]:
    """What would show a keypair's secret key in a byte string: the key (Z85), its file, the file in base64 (msgspec's bytes)."""
    path = os.path.join(keys, f"{name}.key_secret")
    data = open(path, "rb").read()
    return [zmq.auth.load_certificate(path)[1], data, base64.b64encode(data)]


@pytest.mark.parametrize("role,fixed,extra", [("decode", False, KV_SERVER), ("colocated", False, KV_SERVER),
                                              ("prefill", False, KV_SERVER), ("decode", True, KV_SERVER), ("prefill", True, set())])
def test_role_key_files_are_the_roles_only(keys, role, fixed, extra):
    assert set(role_key_files(keys, role, fixed)) == ALWAYS | extra  # an any-role prefill worker binds a KV port too


def test_keys_without_worker_keys_stop_the_launch_with_a_config_error(keys):
    shutil.rmtree(os.path.join(keys, "authorized-workers"))
    with pytest.raises(ConfigError, match="keygen"):
        role_key_files(keys, "decode", False)
    assert set(role_key_files(keys, "prefill", True)) == ALWAYS  # a fixed prefill worker admits no one


# the driver resolves each model's served name from its path (RayLaunch: per-model replica limits), so
# the path must exist: an empty directory named "m" (the actors' arguments are what these tests read)
_MODEL_ROOT = tempfile.mkdtemp(prefix="pdserve-ray-creds-")
atexit.register(shutil.rmtree, _MODEL_ROOT, True)
MODEL = str(Path(_MODEL_ROOT) / "m")
os.makedirs(MODEL)


def launch_args(keys: str, fixed_roles: bool) -> dict[str, dict]:
    """role -> the decoded arguments RayLaunch.actor_args makes for a one-worker actor of that role on a cluster given by
    address (the launch's own files out of its actors' reach)."""
    from pdserve.ray_config import RayConfig
    from pdserve.ray_launch import RayLaunch

    plan = NodePlan(coordinator=True, gateway=True, keys=keys, api_key=API_KEY, fixed_roles=fixed_roles, model=MODEL,
                    gateway_args=["--max-tokens-limit", "9"], coordinator_args=["--pending-timeout", "9"])
    launch = RayLaunch(plan, RayConfig(address="127.0.0.1:6379"))
    return {role: msgspec.json.decode(launch.actor_args(plan.models[0], role, f"ray{i}")) for i, role in enumerate(("prefill", "decode"))}


@needs_ray
@pytest.mark.parametrize("fixed_roles", [False, True])
def test_actor_args_on_another_cluster_carry_the_roles_keys_only(keys, fixed_roles):
    args = launch_args(keys, fixed_roles)
    for role, a in args.items():
        raw = msgspec.json.encode(a)
        assert a["plan"]["keys"] is None
        assert not any(n in raw for n in secret_needles(keys, "client")), role
        assert API_KEY.encode() not in raw and a["plan"]["api_key"] is None, role
        assert a["plan"]["gateway_args"] == [] and a["plan"]["coordinator_args"] == [], role
        has_server_secret = any(n in raw for n in secret_needles(keys, "server"))
        assert has_server_secret == (role == "decode" or not fixed_roles), role
        assert any(n in raw for n in secret_needles(keys, "worker")), role


@needs_ray
def test_actor_args_on_a_private_cluster_carry_paths_not_keys(keys):
    from pdserve.ray_config import RayConfig
    from pdserve.ray_launch import RayLaunch

    plan = NodePlan(coordinator=True, gateway=True, keys=keys, api_key=API_KEY, model=MODEL)
    launch = RayLaunch(plan, RayConfig(address="auto"))
    launch.files = LaunchFiles()
    try:
        a = msgspec.json.decode(launch.actor_args(plan.models[0], "decode", "ray1"))
        raw = msgspec.json.encode(a)
        for name in ("client", "server", "worker"):
            assert not any(n in raw for n in secret_needles(keys, name)), name
        assert API_KEY.encode() not in raw and a["key_files"] is None
        role_dir = a["plan"]["keys"]
        assert os.path.dirname(os.path.dirname(role_dir)) == launch.files.root
        listing = {os.path.relpath(os.path.join(d, f), role_dir) for d, _, fs in os.walk(role_dir) for f in fs}
        assert listing == ALWAYS | KV_SERVER
        for d, _, fs in os.walk(launch.files.root):
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
            for f in fs:
                assert stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) == 0o600, f
    finally:
        launch.files.remove()
    assert not os.path.exists(launch.files.root)


def test_a_start_removes_the_copies_of_processes_that_are_gone():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    root = copies_root()
    stale = os.path.join(root, gone.stdout.strip())
    os.makedirs(os.path.join(stale, "keys"), mode=0o700, exist_ok=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    kept = os.path.join(root, str(live.pid))
    try:
        os.makedirs(kept, mode=0o700, exist_ok=True)
        mine = own_copy_dir()
        assert not os.path.exists(stale) and os.path.isdir(kept) and mine == os.path.join(root, str(os.getpid()))
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700 and os.listdir(mine) == []
    finally:
        live.kill()
        live.wait()
        os.rmdir(kept)
        os.rmdir(os.path.join(root, str(os.getpid())))


@needs_ray
def test_the_command_line_ray_records_hides_the_api_key():
    from pdserve.ray_launch import without_secret_values

    argv = ["pdserve", "launch", "--api-key", API_KEY, f"--api-key={API_KEY}", "--keys", "/k", "--model", "m"]
    assert without_secret_values(argv) == ["pdserve", "launch", "--api-key", "***", "--api-key=***", "--keys", "/k", "--model", "m"]


@needs_ray
def test_without_keys_the_actors_get_the_launchs_own_and_bind_loopback_only():
    """Without --keys the local Launcher's own keys (wire/security.py write_launch_keys) are what a
    worker actor is handed, LOOPBACK_ONLY marker included: its KV port stays on loopback."""
    from pdserve.ray_config import RayConfig
    from pdserve.ray_launch import RayLaunch
    from pdserve.wire import security

    plan = NodePlan(coordinator=True, gateway=True, api_key=API_KEY, model=MODEL)
    launch = RayLaunch(plan, RayConfig(address="127.0.0.1:6379"))
    launch.local.own_keys = security.write_launch_keys([plan.client_addr])
    try:
        a = msgspec.json.decode(launch.actor_args(plan.models[0], "decode", "ray1"))
        assert set(a["key_files"]) == ALWAYS | KV_SERVER | {security.LOOPBACK_ONLY}
        assert not any(n in msgspec.json.encode(a) for n in secret_needles(launch.local.own_keys, "client"))
        role_keys = write_keys(own_copy_dir(), {k: base64.b64decode(v) for k, v in a["key_files"].items()})
        with pytest.raises(security.InsecureBindError):
            security.check_bind("tcp://0.0.0.0:7", role_keys, insecure=False)
    finally:
        security.remove_launch_keys(launch.local.own_keys)
        shutil.rmtree(os.path.join(copies_root(), str(os.getpid())), ignore_errors=True)
