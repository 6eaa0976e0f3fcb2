"""The KV backends as a registry (kvtransfer/backends.py): every name a KVReady or --kv-backend
may carry is one class, auto's order is one tuple, and the module tree imports (and lists every
backend) in a process where cupy cannot be imported and no GPU is visible."""
import os
import subprocess
import sys

from pdserve.kvtransfer.backends import AUTO_ORDER, BY_NAME, Route
from pdserve.kvtransfer.transfer import BACKENDS, GPU_BACKENDS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_each_name_is_one_backend_and_auto_tries_them_all_tcp_last():
    assert {name: b.name for name, b in BY_NAME.items()} == {n: n for n in ("shm", "tcp", "cuda_ipc", "nccl")}
    assert (BACKENDS, GPU_BACKENDS) == (("shm", "tcp"), ("cuda_ipc", "nccl"))
    assert sorted(b.name for b in AUTO_ORDER) == sorted(BY_NAME) and AUTO_ORDER[-1] is BY_NAME["tcp"]
    apart = Route(same_machine=False, shm_path="")
    assert [b.name for b in AUTO_ORDER if b.reaches(apart)] == ["tcp"]  # nothing known of GPUs, no shared pool
    both = Route(same_machine=True, shm_path="/dev/shm/p", src_gpu=["cuda_ipc", "nccl"], dst_gpu=["cuda_ipc", "nccl"])
    assert [b.name for b in AUTO_ORDER if b.reaches(both)] == ["cuda_ipc", "nccl", "shm", "tcp"]


def test_the_backends_import_without_cupy_or_a_gpu():
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['cupy.cuda'] = None\n"
            "import torch; from pdserve.kvtransfer import transfer; from pdserve.kvtransfer.backends import BY_NAME\n"
            "print(sorted(BY_NAME), transfer.gpu_backends(torch.zeros(2, 2, 4, 16, 1, 8)))")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['cuda_ipc', 'nccl', 'shm', 'tcp'] []"
