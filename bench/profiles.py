"""Where a request's time goes: py-spy profiles of a gunicorn worker under load (wall
clock) and of bench/inprocess.py (CPU), each sample's stack sorted into one category
(gunicorn, Flask, the view, the fingerprint, the claim and the finish, the rest of the
extension, the hand-rolled code) and scaled to microseconds per request."""

from __future__ import annotations

import collections
import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import ROOT, BenchError, Variant
from bench.load import start_wrk, wrk_command
from bench.servers import Gunicorn, check_library

if TYPE_CHECKING:
    from bench.context import Run

IDLE = "idle: waiting in accept() for the next connection"
GUNICORN_IO = "gunicorn: read and parse the request, write the response"
GUNICORN_CLOSE = "gunicorn: close_graceful (waits for the client's FIN)"
TEST_CLIENT = "werkzeug test client (stands in for gunicorn)"
FLASK = "Flask/werkzeug: request context, routing, response, JSON"
VIEW = "the view (parse body, uuid4, execution log, jsonify)"
FINGERPRINT = "extension: fingerprint (RFC 8785 + SHA-256)"
CLAIM_DB = "extension: claim, libpq/kernel: send, wait for PostgreSQL, receive"
CLAIM_PY = "extension: claim, Python: pool, psycopg query/params/result"
FINISH_DB = "extension: finish, libpq/kernel: send, wait for PostgreSQL, receive"
FINISH_PY = "extension: finish, Python: pool, psycopg query/params, Jsonb"
EXTENSION_REST = "extension: the rest (key, settings, signals, hooks, replay)"
HANDROLLED_DB = "hand-rolled: libpq/kernel: send, wait for PostgreSQL, receive"
HANDROLLED_PY = "hand-rolled: Python: pool, psycopg"
CATEGORIES = [
    IDLE,
    GUNICORN_IO,
    GUNICORN_CLOSE,
    TEST_CLIENT,
    FLASK,
    VIEW,
    FINGERPRINT,
    CLAIM_DB,
    CLAIM_PY,
    FINISH_DB,
    FINISH_PY,
    EXTENSION_REST,
    HANDROLLED_DB,
    HANDROLLED_PY,
]
#: Leaf frames where the thread is in libpq or the kernel (psycopg's C code has no frames).
IN_LIBPQ = (
    "Connection.wait (psycopg",
    "BaseCursor._send_query_prepared (psycopg",
    "BaseCursor._send_prepare (psycopg",
    "BaseCursor._execute_send (psycopg",
    # flask_idempotency/statement.py: its libpq send (the waits are Connection.wait)
    "_send (flask_idempotency",
    "_prepare (flask_idempotency",
)


def classify(frames: list[str]) -> str | None:
    """The category of one sampled stack; None for threads other than the request's."""
    joined = ";".join(frames)
    if "SyncWorker.run_for_one (" in joined:  # a gunicorn worker's main thread
        if "SyncWorker.handle (" not in joined:
            return IDLE
        if "close_graceful (" in joined:
            return GUNICORN_CLOSE
        if "Flask.wsgi_app (" not in joined:
            return GUNICORN_IO
    elif "Client.open (werkzeug" in joined:  # bench/inprocess.py
        if "Flask.wsgi_app (" not in joined:
            return TEST_CLIENT
    else:
        return None  # psycopg_pool's threads, the interpreter's start-up
    in_libpq = frames[-1].startswith(IN_LIBPQ)
    if "PostgresStore.claim (" in joined:
        return CLAIM_DB if in_libpq else CLAIM_PY
    if "PostgresStore.finish (" in joined:
        return FINISH_DB if in_libpq else FINISH_PY
    if "fingerprint (flask_idempotency" in joined:
        return FINGERPRINT
    if any(".work (" in f and "flask/" not in f for f in frames):
        return VIEW
    if any(".handrolled (" in f for f in frames) and "psycopg" in joined:
        return HANDROLLED_DB if in_libpq else HANDROLLED_PY
    if "flask_idempotency" in joined:
        return EXTENSION_REST
    return FLASK


def read_profile(raw: Path) -> tuple[collections.Counter[str], list[tuple[list[str], int]]]:
    """py-spy's raw (collapsed) output: samples per category, and the request's stacks."""
    by_category: collections.Counter[str] = collections.Counter()
    stacks = []
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = stack.split(";")
        category = classify(frames)
        if category is not None:
            by_category[category] += int(count_text)
            if category != IDLE:
                stacks.append((frames, int(count_text)))
    return by_category, stacks


def top_frames(stacks: list[tuple[list[str], int]], scale: float) -> list[str]:
    """The leaf frames with most samples, and the extension's and psycopg's functions."""
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    busy = 0
    for frames, count in stacks:
        busy += count
        self_time[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    busy = max(1, busy)
    lines = ["top self time (leaf frames; C code shows as its Python caller):"]
    lines += [f"  {c / busy:6.1%} {c * scale:8.1f} us  {f}" for f, c in self_time.most_common(25)]
    lines += ["", "inclusive time of the extension's, psycopg's and hashing functions:"]
    wanted = ("flask_idempotency/", "psycopg", "rfc8785", "xxhash", "hashlib", "blinker")
    chosen = [(f, c) for f, c in inclusive.most_common() if any(m in f for m in wanted)]
    lines += [f"  {c / busy:6.1%} {c * scale:8.1f} us  {f}" for f, c in chosen[:35]]
    return lines


def analyse_profile(
    raw: Path, rate: int, requests: int, how: str, variant: Variant, worker: int
) -> dict[str, Any]:
    """A wall-clock profile of one gunicorn worker (idle samples included)."""
    by_category, stacks = read_profile(raw)
    total = sum(by_category.values())
    requests = max(1, requests)
    us = 1e6 / rate / requests  # microseconds per request that one sample stands for
    busy = total - by_category[IDLE]
    rows = [
        {"category": c, "share": by_category[c] / max(1, total), "us_per_request": n * us}
        for c, n in ((c, by_category[c]) for c in CATEGORIES)
        if n
    ]
    lines = [
        f"py-spy (wall clock, idle included), gunicorn worker {worker} during variant"
        f" {variant.name} ({variant.label}): {total} samples of its main thread at {rate} Hz,"
        f" {requests} requests ({how})",
        f"wall time per request: {total * us / 1000:.3f} ms, of which the worker was handling"
        f" a request {busy * us / 1000:.3f} ms ({busy / max(1, total):.0%})",
        "",
        f"{'where':68} {'share':>6} {'us/req':>8}",
        *(f"{r['category']:68} {r['share']:6.1%} {r['us_per_request']:8.1f}" for r in rows),
        "",
        *top_frames(stacks, us),
    ]
    return {
        "kind": "wall",
        "worker": worker,
        "requests": requests,
        "requests_counted": how,
        "samples": total,
        "rate": rate,
        "wall_ms_per_request": total * us / 1000,
        "busy_ms_per_request": busy * us / 1000,
        "categories": rows,
        "text": "\n".join(lines) + "\n",
    }


def analyse_cpu_profile(raw: Path, cpu_us: float, variant: str) -> dict[str, Any]:
    """A CPU profile of bench/inprocess.py, scaled to its measured CPU per request."""
    by_category, stacks = read_profile(raw)
    total = max(1, sum(by_category.values()))
    us = cpu_us / total  # microseconds per request that one sample stands for
    rows = [
        {"category": c, "share": by_category[c] / total, "us_per_request": by_category[c] * us}
        for c in CATEGORIES
        if by_category[c]
    ]
    lines = [
        f"py-spy (CPU: samples of a running thread only), bench/inprocess.py {variant}:"
        f" {total} samples, scaled to the {cpu_us:.0f} us of CPU per request measured"
        " without the profiler",
        "",
        f"{'where':68} {'share':>6} {'us/req':>8}",
        *(f"{r['category']:68} {r['share']:6.1%} {r['us_per_request']:8.1f}" for r in rows),
        "",
        *top_frames(stacks, us),
    ]
    return {
        "kind": "cpu",
        "variant": variant,
        "cpu_us_per_request": cpu_us,
        "samples": total,
        "categories": rows,
        "text": "\n".join(lines) + "\n",
    }


# -- the runs ---------------------------------------------------------------------------------


def profile_worker(
    bench: Run, server: Gunicorn, variant: Variant, seconds: float
) -> dict[str, Any]:
    """py-spy on one worker (wall clock, idle included) while wrk runs the variant."""
    a = bench.args
    worker = server.worker_pids[0]
    raw = bench.outdir / f"profile-{variant.name}.collapsed.txt"
    prefix = f"{variant.name}pxx{bench.run_id}"
    bench.prefixes[variant.name].append(prefix)
    cmd = wrk_command(
        server.port, variant.path, variant.mode, prefix, seconds + 4, a.threads, a.connections
    )
    load = start_wrk(cmd)
    bench.processes.running.append(load)
    try:
        time.sleep(1.5)
        lines_before = bench.exec_lines("idempotent", worker)
        spy_cmd = [
            bench.py_spy,
            *("record", "--pid", str(worker), "--duration", f"{seconds:g}"),
            *("--rate", str(a.profile_rate), "--idle", "--nolineno"),
            *("--nonblocking", "--format", "raw", "-o", str(raw)),
        ]
        spy_started = time.monotonic()
        bench.processes.run(spy_cmd, timeout=seconds + 60)
        spy_elapsed = time.monotonic() - spy_started
        lines_after = bench.exec_lines("idempotent", worker)
        out, _ = load.communicate(timeout=seconds + 60)
    finally:
        if load.poll() is None:
            load.kill()
            load.communicate()
        bench.processes.running.remove(load)
    match = re.search(r"^BENCH_JSON (.*)$", out, re.M)
    wrk = json.loads(match.group(1)) if match else {"requests": 0, "duration_us": 1}
    if variant.mode == "new":  # every request ran the view once: exact
        requests = lines_after - lines_before
        how = "exact (view executions of this worker)"
    else:  # replays do not run the view: this worker's share of wrk's rate
        rps = wrk["requests"] / (wrk["duration_us"] / 1e6)
        requests = round(rps * spy_elapsed / server.workers)
        how = "estimated (wrk's rate / workers)"
    return analyse_profile(raw, a.profile_rate, requests, how, variant, worker)


def inprocess(bench: Run) -> None:
    """CPU per request of each route without HTTP (bench/inprocess.py), then CPU
    profiles of the new-key and replay runs."""
    n = bench.args.inprocess_requests
    env = bench.app_env(bench.app_url)
    measured: dict[str, Any] = {}

    def command(variant: str) -> list[str]:
        return [
            *(sys.executable, "-m", "bench.inprocess", bench.app_url, str(bench.exec_dir)),
            *(variant, "--requests", str(n)),
        ]

    def parse(out: str) -> dict[str, Any]:
        match = re.search(r"^BENCH_JSON (.*)$", out, re.M)
        if match is None:
            raise BenchError(f"no BENCH_JSON line from bench/inprocess.py:\n{out}")
        data: dict[str, Any] = json.loads(match.group(1))
        check_library("bench/inprocess.py", data["library"])
        return data

    for variant in ("plain", "new", "replay", "handrolled"):
        measured[variant] = parse(bench.processes.run(command(variant), 600, cwd=ROOT, env=env))
        m = measured[variant]
        bench.log(
            f"in process, {variant:10}: {m['cpu_us']:6.0f} us CPU per request"
            f" (user {m['user_us']:.0f}, system {m['sys_us']:.0f}), wall {m['wall_us']:.0f} us"
        )
    profiles: dict[str, Any] = {}
    bench.results["inprocess"] = measured
    bench.results["cpu_profiles"] = profiles
    for variant in ("new", "replay"):
        raw = bench.outdir / f"cpu-profile-{variant}.collapsed.txt"
        cmd = [
            bench.py_spy,
            *("record", "--rate", str(bench.args.cpu_profile_rate), "--nonblocking"),
            *("--nolineno", "--format", "raw", "-o", str(raw), "--", *command(variant)),
        ]
        try:
            parse(bench.processes.run(cmd, 600, cwd=ROOT, env=env))
        except BenchError as exc:
            bench.log(f"no CPU profile of {variant}: {exc}")
            continue
        profiles[variant] = analyse_cpu_profile(raw, measured[variant]["cpu_us"], variant)
