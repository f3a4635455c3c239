"""The machine, its processes' CPU and memory (from /proc), and which code is measured."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any


def sources_hash(root: Path) -> str:
    """A hash of flask_idempotency/*.py under *root*."""
    digest = hashlib.sha256()
    for path in sorted((root / "flask_idempotency").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def library_state(repo: Path) -> dict[str, str]:
    """The repository's commit, whether flask_idempotency/ has uncommitted changes, and the
    hash of its sources."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, check=False
        ).stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD") or "?",
        "library_modified": "yes"
        if git("status", "--porcelain", "--", "flask_idempotency")
        else "no",
        "library_sha256": sources_hash(repo),
    }


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def process_cpu(pid: int, *, reaped: bool = False) -> float:
    """CPU seconds (user + system) of *pid*, plus its reaped children's if *reaped*."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def busy_cpu_seconds() -> tuple[float, float]:
    """Seconds all CPUs spent busy since boot (everything but idle and iowait), and of
    those the seconds in interrupts (irq, softirq: network and disk completions)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    ticks = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / ticks, (irq + softirq) / ticks


def kernel_threads_cpu_seconds() -> float:
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[1] in ("0", "2"):  # kthreadd and its children
                total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def machine(workdir: Path) -> dict[str, Any]:
    """The CPU, memory, kernel, versions, an fdatasync probe in *workdir*, and how busy
    the machine was just before the run."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    meminfo = Path("/proc/meminfo").read_text()
    mem = re.search(r"^MemTotal:\s*(\d+)", meminfo, re.M)
    probe = workdir / "fsync-probe"
    with probe.open("wb") as f:
        block = os.urandom(8192)
        t = time.perf_counter()
        for _ in range(200):
            f.write(block)
            f.flush()
            os.fdatasync(f.fileno())
        fdatasync_us = (time.perf_counter() - t) / 200 * 1e6
    probe.unlink()
    busy0, _ = busy_cpu_seconds()
    time.sleep(1)
    idle_busy = (busy_cpu_seconds()[0] - busy0) / (os.cpu_count() or 1)
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout
    versions = {name: metadata.version(name) for name in ("flask", "psycopg", "gunicorn")}
    return {
        "cpu": model[1] if model else platform.processor(),
        "cpus": os.cpu_count(),
        "memory_gib": round(int(mem[1]) / 1024 / 1024, 1) if mem else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "wrk": wrk_version.split("Copyright")[0].strip(),
        **versions,
        "fdatasync_8k_us": round(fdatasync_us),
        "busy_before_start": round(idle_busy, 3),
    }
