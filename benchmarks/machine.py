"""What a benchmark prints about the machine it ran on, so that figures can be compared: the CPU,
cores, memory and software versions (`machine`), `lscpu`'s model name and flags (`cpu_line`),
the load average (`load_line`, at the start and the end of a run: was the machine shared?) and a
process's resident memory (`resident_mib`). Each reads /proc or asks the OS once, when called.
"""
from __future__ import annotations

import os
import platform
import subprocess


def machine() -> str:
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def cpu_line() -> str:
    """`lscpu`'s model name and flags (from /proc/cpuinfo without lscpu)."""
    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    except (OSError, subprocess.SubprocessError):
        pass
    if "model name" not in fields or "flags" not in fields:
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    fields.setdefault(k.strip().lower(), v.strip())
        except OSError:
            pass
    return f"Model name: {fields.get('model name', 'unknown')}; Flags: {fields.get('flags', 'unknown')}"


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average: {one:.2f}, {five:.2f}, {fifteen:.2f} ({os.cpu_count()} cores)"


def resident_mib(pid: int) -> float | None:
    """A process's resident memory (VmRSS), MiB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
