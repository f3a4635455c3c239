"""The app's CPU per request, counted in instructions: what does not move with the machine.

CPU time per request moved by ±20 % between runs of the same code on the shared 2-core
machine (docs/performance-history.md); the number of instructions the app's process executes per
request does not (±0.5 % between runs). valgrind's callgrind counts them, for
``bench/inprocess.py`` (Flask's test client, sequential, against a throwaway durable
PostgreSQL, which runs outside valgrind and is not counted):

    python -m bench.instructions [--requests 300] [--compare DIR ...] [VARIANT ...]

VARIANT is ``plain``, ``new``, ``replay``, ``handrolled`` or ``floor`` (default: ``plain new
handrolled floor``). Each is run twice under callgrind, with 0 and with *requests* measured
requests after the same 100 warm-up requests; the difference over *requests* is the
instructions of one request, the process's start and warm-up cancelled out. Each DIR is
another checkout (``git worktree add DIR <commit>``), run from its own directory so that
its ``flask_idempotency`` and its ``bench/app.py`` are the ones imported; its variants are
printed beside this checkout's. callgrind runs the app about 50 times slower: the default
takes about 2 minutes a variant, two at a time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg

from bench.app import HANDROLLED_SCHEMA
from bench.common import ROOT, BenchError

VARIANTS = ("plain", "new", "replay", "handrolled", "floor")
_COLLECTED = re.compile(r"Collected : (\d+)")


def count(root: Path, url: str, exec_dir: Path, variant: str, requests: int) -> int:
    """Instructions of one run of bench/inprocess.py from *root* with *requests* requests."""
    out = Path(tempfile.mkdtemp(prefix="callgrind-")) / "callgrind.out"
    command = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        *(sys.executable, "-m", "bench.inprocess", url, str(exec_dir), variant),
        *("--requests", str(requests)),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["PYTHONPATH"] = str(root)
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=False)
    shutil.rmtree(out.parent, ignore_errors=True)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise BenchError(f"{root.name} {variant}: callgrind failed: {' | '.join(tail)}")
    return int(found[1])


def per_request(root: Path, url: str, exec_dir: Path, variant: str, requests: int) -> float | str:
    """Instructions per request of *variant*: two runs, the difference over *requests*;
    why not, if a run failed (an older checkout without the variant)."""
    try:
        base = count(root, url, exec_dir, variant, 1)
        more = count(root, url, exec_dir, variant, 1 + requests)
    except BenchError as exc:
        return str(exc)
    return (more - base) / requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="instructions per request, in process")
    parser.add_argument("variants", nargs="*", metavar="VARIANT", help=", ".join(VARIANTS))
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument(
        "--compare", metavar="DIR", action="append", default=[], help="another checkout"
    )
    args = parser.parse_args(argv)
    variants = args.variants or ["plain", "new", "handrolled", "floor"]
    for variant in variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}: choose from {', '.join(VARIANTS)}")
    if shutil.which("valgrind") is None:
        print("bench.instructions: valgrind is missing (apt install valgrind)", file=sys.stderr)
        return 1
    roots = {Path(d).resolve().name: Path(d).resolve() for d in args.compare}
    roots["this"] = ROOT
    from bench.servers import Postgres, Processes

    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        db = Postgres(Path(tmp) / "pg", Processes(Path(tmp) / "pids"))
        db.start(print)
        exec_dir = Path(tmp) / "exec"
        exec_dir.mkdir()
        try:
            with psycopg.connect(db.url, autocommit=True) as conn:
                conn.execute(HANDROLLED_SCHEMA)
            for root in roots.values():  # each release's table, oldest first
                init = [sys.executable, "-m", "flask", "--app", "bench.app", "idempotency-init"]
                env = {**os.environ, "BENCH_DATABASE_URL": db.url, "BENCH_EXEC_DIR": str(exec_dir)}
                subprocess.run(init, cwd=root, env=env, check=True, capture_output=True)
            jobs = [(name, root, v) for name, root in roots.items() for v in variants]
            with ThreadPoolExecutor(max_workers=2) as pool:
                found = pool.map(
                    lambda job: per_request(job[1], db.url, exec_dir, job[2], args.requests),
                    jobs,
                )
                results = dict(zip(((name, v) for name, _, v in jobs), found, strict=True))
        except BenchError as exc:
            print(f"bench.instructions: {exc}", file=sys.stderr)
            return 1
        finally:
            db.stop()
    counted = {job: n for job, n in results.items() if isinstance(n, float)}
    for (name, variant), instructions in results.items():
        if not isinstance(instructions, float):
            print(f"{variant:11} {name:10} not counted: {instructions}")
            continue
        plain = counted.get((name, "plain"))
        above = f"  (+{(instructions - plain) / 1e6:.3f} M above plain)" if plain else ""
        print(f"{variant:11} {name:10} {instructions / 1e6:6.3f} M instructions per request{above}")
    for name in roots:
        new = counted.get((name, "new"))
        for other in ("handrolled", "floor"):
            below = counted.get((name, other)) or counted.get(("this", other))
            if new and below:
                print(f"{name:10} new / {other} (this checkout's) {new / below:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
