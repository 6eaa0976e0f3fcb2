"""The servers benchmarks/ compares, started and stopped the same way for each: the peers (vLLM's
CPU build, llama.cpp's server, through the scripts in ../shared/peers) and `pdserve launch` run
through its CLI as a user runs it.

Lifecycle of one server (`run_server`): start its command in a session of its own (its output in
a log file), wait until its HTTP endpoint answers, run the workloads through the same OpenAI
streaming client (`run_workloads`: two short warm-up requests, then each `Workload` in turn,
Poisson arrivals at its rate), stop it (SIGTERM to its process group, or to `pdserve launch`
alone, which stops its roles; SIGKILL after a grace period). A peer's `setup` (creating its venv,
building it) runs first, outside the start-up time. Returns every workload's outputs and the
start-up seconds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdserve.ports import free_port

REPO = Path(__file__).resolve().parents[1]
PEERS_DIR = REPO.parent / "shared" / "peers"  # outside the repository: the scripts that install and serve the peers


@dataclasses.dataclass
class Peer:
    script: str  # in the peers directory: `setup` installs, `serve` serves on $PORT_VAR
    port_var: str
    name: str


PEERS = {"vllm": Peer("vllm_cpu.sh", "VLLM_PORT", "vLLM CPU 0.32 (float32)"),
         "llamacpp": Peer("llama_cpp.sh", "LLAMA_PORT", "llama.cpp server")}  # (the default model: its Q4_1 GGUF; --model FILE: that file)


@dataclasses.dataclass
class Workload:
    name: str
    requests: list
    max_concurrency: int | None
    rate: float = float("inf")  # requests/s, Poisson arrivals (inf: all at once); scripts/goodput's rates
    seed: int = 0  # of the arrival times


def add_server_flags(ap) -> None:
    """Flags scripts/goodput and scripts/overload_check share: the model, more `pdserve launch` flags, the peers dir, the seed."""
    ap.add_argument("--model", default=None, help="pdserve's model (default: SmolLM2-135M-Instruct GGUF); vLLM serves its HF copy")
    ap.add_argument("--extra-launch-arg", action="append", default=[], metavar="FLAGS",
                    help="more `pdserve launch` flags for the pdserve rows, split like a shell, repeatable: "
                         "--extra-launch-arg='--max-num-seqs 64'")
    add_peers_flag(ap)
    ap.add_argument("--seed", type=int, default=0)


def add_peers_flag(ap) -> None:
    ap.add_argument("--peers", default=str(PEERS_DIR), help="directory holding vllm_cpu.sh and llama_cpp.sh")
    for row in PEERS:
        ap.add_argument(f"--{row}-arg", action="append", default=[], metavar="FLAGS",
                        help=f"more flags for the {row} server, split like a shell, repeatable (e.g. --vllm-arg='--dtype bfloat16')")


def extra_launch_args(args) -> list[str]:
    return [a for text in args.extra_launch_arg for a in shlex.split(text)]


# ------------------------------------------------------------------ one server

def wait_http(url: str, proc, timeout: float = 300.0, ready=lambda answer: True) -> None:
    """Until url answers 200 and `ready(answer)` holds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before answering {url}")
        try:
            answer = httpx.get(url, timeout=2.0, trust_env=False)
            if answer.status_code == 200 and ready(answer):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no answer from {url} after {timeout:.0f}s")


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0, leader_only: bool = False) -> None:
    """Stop a server started in a session of its own: SIGTERM to its process group (leader_only: to
    the leader alone, which stops its children itself, as `pdserve launch` does), SIGKILL to the
    group after grace_s."""
    if leader_only:
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_workloads(base_url: str, workloads: list[Workload], tokenizer) -> dict:
    """{workload name: (outputs, seconds)} through one OpenAI streaming client, after two short warm-up requests."""
    from pdserve.bench.backends import OpenAIBackend, Sampling
    from pdserve.bench.runner import send_all

    async def go():
        async with OpenAIBackend(base_url, "/v1/completions", None, Sampling(ignore_eos=True), 3600.0, chat=False,
                                 tokenizer=tokenizer) as b:
            warm = [dataclasses.replace(r, output_len=4) for r in workloads[0].requests[:2]]
            await send_all(b, warm, float("inf"), 1.0, None, 0, False)
            return {w.name: await send_all(b, w.requests, w.rate, 1.0, w.max_concurrency, w.seed, False) for w in workloads}

    return asyncio.run(go())


def run_server(cmd: list[str], url: str, ready_path: str, log_path: str, workloads, tokenizer, env=None, timeout: float = 600,
               leader_only: bool = False, ready=lambda answer: True) -> tuple[dict, float]:
    """Start cmd, wait until url + ready_path answers (and `ready` holds of the answer), run the
    workloads, stop it: (results, start-up seconds)."""
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_http(url + ready_path, proc, timeout, ready)
            startup = time.perf_counter() - t0
            return run_workloads(url, workloads, tokenizer), startup
        finally:
            stop_group(proc, leader_only=leader_only)


def peer_row(args, row: str, workloads, tokenizer, log_dir: str) -> tuple[dict, float]:
    """A peer server (`PEERS[row]`): its `setup`, then `serve` measured like any server."""
    peer = PEERS[row]
    script = Path(args.peers) / peer.script
    if not script.exists():
        raise FileNotFoundError(f"{script} not found (pass --peers DIR)")
    env = {**os.environ, "PROJECT_PY": sys.executable, peer.port_var: str(free_port())}
    subprocess.run(["bash", str(script), "setup"], check=True, env=env, cwd=REPO)
    # llama.cpp serves the GGUF pdserve serves when that is one (a later -m wins over the script's default model)
    model = getattr(args, "model", None)
    extra = ["-m", str(model)] if row == "llamacpp" and model and str(model).endswith(".gguf") else []
    extra += [a for text in getattr(args, f"{row}_arg", None) or [] for a in shlex.split(text)]  # --vllm-arg, --llamacpp-arg
    return run_server(["bash", str(script), "serve", *extra], f"http://127.0.0.1:{env[peer.port_var]}", "/v1/models",
                      os.path.join(log_dir, f"{row}.log"), workloads, tokenizer, env=env, timeout=900)


def launch_command(args, launch_flags: list[str], log_dir: str, http_port: int) -> list[str]:
    """`pdserve launch` as a user runs it, on free loopback ports, its roles' logs in log_dir."""
    return [sys.executable, "-P", "-m", "pdserve", "launch", "--http-port", str(http_port),
            "--clients", f"tcp://127.0.0.1:{free_port()}", "--workers", f"tcp://127.0.0.1:{free_port()}", "--log-dir", log_dir,
            *(["--model", args.model] if args.model else []), *launch_flags]


def launch_pdserve(args, launch_flags: list[str], workloads, tokenizer, log_dir: str, name: str) -> tuple[dict, float]:
    """`pdserve launch LAUNCH_FLAGS` measured like any server (the launcher's own output in
    LOG_DIR/NAME.log, its roles' in LOG_DIR/NAME/), ready when its gateway's /health counts every
    worker the launch starts (`launch_workers`: /health is ready with a decode worker alone, and
    a worker still starting takes the cores from those serving); stopped by SIGTERM to the
    launcher, which stops its roles."""
    port, expected = free_port(), launch_workers(launch_flags)
    cmd = launch_command(args, launch_flags, os.path.join(log_dir, name), port)
    return run_server(cmd, f"http://127.0.0.1:{port}", "/health", os.path.join(log_dir, f"{name}.log"), workloads, tokenizer,
                      leader_only=True, ready=lambda answer: sum(answer.json().get("workers", {}).values()) >= expected)


def launch_workers(launch_flags: list[str]) -> int:
    """The workers `pdserve launch LAUNCH_FLAGS` starts on one node: 1 with --colocated, else
    --prefill + --decode (1 each by default)."""
    if "--colocated" in launch_flags:
        return 1
    counts = {"--prefill": 1, "--decode": 1}
    for i, flag in enumerate(launch_flags[:-1]):
        if flag in counts:
            counts[flag] = int(launch_flags[i + 1])
    return sum(counts.values())


def report_errors(name: str, results: dict, ignore=lambda output: False) -> None:
    """Errors of {workload: (outputs, seconds)} (but those `ignore` accepts), one line per workload, on stderr."""
    for workload, (outs, _) in results.items():
        errors = sorted({o.error for o in outs if not o.success and not ignore(o)})
        if errors:
            print(f"{name} / {workload}: {len(errors)} kind(s) of error, first: {errors[0][:200]}", file=sys.stderr)
