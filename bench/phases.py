"""The measured phases that load the main gunicorn: the alternating rounds of every
variant, the low-load latency, the long new-key run for memory, and the
double-execution check."""

from __future__ import annotations

import collections
import functools
import math
import time
from typing import TYPE_CHECKING, Any

import psycopg

from bench.common import BY_NAME, median
from bench.load import run_wrk
from bench.meter import DB_PER_REQUEST
from bench.servers import Gunicorn
from bench.system import rss_kib

if TYPE_CHECKING:
    from bench.context import Run

CPU_COMPONENTS = ("gunicorn", "postgres", "redis", "loadgen", "kernel", "other", "busy")


def rounds(bench: Run, server: Gunicorn) -> None:
    """Warm-up, then ``--rounds`` rounds of every variant in a rotating order; a round
    in which other processes used too much of the CPU is repeated."""
    a = bench.args
    names = list(a.variants)
    bench.log(f"warm-up: {a.warmup:g} s per variant")
    for name in names:
        if not BY_NAME[name].is_pgbench:
            bench.run_variant(server, BY_NAME[name], "w", a.warmup)
    bench.db.execute("CHECKPOINT")
    bench.results["rss_after_warmup_kib"] = {pid: rss_kib(pid) for pid in server.worker_pids}
    per_round: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(a.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            result = one_round(bench, server, name, r)
            per_round[name].append(result)
            extra = ""
            if BY_NAME[name].mode in ("replay", "mix"):
                extra = (
                    f" created {result['created']} replayed {result['replayed']}"
                    f" 409 {result['conflicts']} other {result['others']}"
                )
            bench.log(
                f"round {r + 1}/{a.rounds} {name}: {result['rps']:8.1f} req/s"
                f"  p50 {result['p50_ms']:6.2f} ms  p99 {result['p99_ms']:6.2f} ms"
                f"  errors {result['errors_total']}{extra}"
            )
    bench.results["rounds"] = per_round
    bench.results["discarded_rounds"] = bench.discarded
    bench.results["summary"] = {name: summarise(results) for name, results in per_round.items()}
    bench.results["rss_after_rounds_kib"] = {pid: rss_kib(pid) for pid in server.worker_pids}


def one_round(bench: Run, server: Gunicorn, name: str, r: int) -> dict[str, Any]:
    """One measured round of variant *name*, repeated while other processes disturb it
    (at most ``--max-repeats`` times over the whole run)."""
    a = bench.args
    variant = BY_NAME[name]
    attempt = 0
    while True:
        tag = f"{r}{'r' * attempt}"
        result = bench.meter.measured(
            functools.partial(bench.run_variant, server, variant, tag, a.seconds)
        )
        cpu = result["cpu_ms_per_request"]
        foreign = cpu["other"] / cpu["busy"] if cpu["busy"] > 0 else 0.0
        result["foreign_cpu_share"] = foreign
        if foreign <= a.foreign_limit or bench.repeats >= a.max_repeats:
            result["round"] = r
            return result
        bench.repeats += 1
        attempt += 1
        bench.discarded.append({"variant": name, **result})
        bench.log(
            f"round {r + 1}/{a.rounds} {name}: other processes used {foreign:.0%}"
            f" of the CPU time ({result['rps']:.1f} req/s); repeating the round"
        )


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over a variant's rounds."""
    return {
        "rps": median(r["rps"] for r in results),
        "p50_ms": median(r["p50_ms"] for r in results),
        "p99_ms": median(r["p99_ms"] for r in results),
        "errors": sum(r["errors_total"] for r in results),
        "requests": sum(r["requests"] for r in results),
        "rps_rounds": [r["rps"] for r in results],
        "cpu_ms_per_request": {
            k: median(r["cpu_ms_per_request"][k] for r in results) for k in CPU_COMPONENTS
        },
        "cpu_utilisation": median(r["cpu_utilisation"] for r in results),
        "db_per_request": {
            k: median(r["db_per_request"][k] for r in results) for k in DB_PER_REQUEST
        },
    }


def latency(bench: Run, server: Gunicorn) -> None:
    """Latency at low load: one wrk client on one connection, each request sent when the
    last one was answered, for every variant that sends new keys or replays (not the
    mix, not pgbench); ``--latency-rounds`` rounds of ``--latency-seconds`` each in a
    rotating order, medians of each round's p50 and p99.

    gunicorn's sync workers close the connection after every response, so wrk connects
    again before each request; its latency counts from the request's first byte sent to
    the response's last byte received, without the connect."""
    a = bench.args
    names = [n for n in a.variants if BY_NAME[n].mode in ("new", "replay")]
    per_round: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(a.latency_rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            variant = BY_NAME[name]
            prefix = f"{name}lat{r}x{bench.run_id}"
            bench.prefixes[name].append(prefix)
            result = run_wrk(
                bench.processes,
                server.port,
                variant.path,
                variant.mode,
                prefix,
                a.latency_seconds,
                threads=1,
                connections=1,
            )
            per_round[name].append(result)
    summary = {
        name: {
            "requests": sum(r["requests"] for r in results),
            "errors": sum(r["errors_total"] for r in results),
            "p50_ms": median(r["p50_us"] / 1000 for r in results),
            "p99_ms": median(r["p99_us"] / 1000 for r in results),
            "mean_ms": median(r["mean_us"] / 1000 for r in results),
        }
        for name, results in per_round.items()
    }
    bench.results["latency"] = summary
    bench.results["settings"]["latency"] = (
        f"wrk -t 1 -c 1 -d {a.latency_seconds:g}s, {a.latency_rounds} rounds, medians"
    )
    for name, figures in summary.items():
        bench.log(
            f"latency {name:2}: p50 {figures['p50_ms']:6.2f} ms  p99 {figures['p99_ms']:6.2f} ms"
            f"  ({figures['requests']} requests, {figures['errors']} non-2xx)"
        )


def rss_run(bench: Run, server: Gunicorn) -> None:
    """Per-worker RSS before and after ``--rss-requests`` new keys."""
    a = bench.args
    b = bench.results.get("summary", {}).get("b", {}).get("rps") or 500.0
    seconds = min(a.rss_max_seconds, math.ceil(a.rss_requests / b * 1.15) + 1)
    pids = server.worker_pids
    before = {pid: rss_kib(pid) for pid in pids}
    served_before = {pid: bench.exec_lines("idempotent", pid) for pid in pids}
    bench.log(
        f"RSS run: new keys for {seconds} s (aiming at {a.rss_requests} requests at ~{b:.0f} req/s)"
    )
    started = time.monotonic()
    result = bench.run_variant(server, BY_NAME["b"], "rss", seconds)
    chunk = 1
    while result["requests"] < a.rss_requests:  # slower than the rounds: carry on
        left = a.rss_max_seconds - (time.monotonic() - started)
        missing = a.rss_requests - result["requests"]
        more = min(left, math.ceil(missing / max(1.0, result["rps"]) * 1.15) + 1)
        if more < 2:
            break
        extra = bench.run_variant(server, BY_NAME["b"], f"rss{chunk}", more)
        chunk += 1
        total = result["requests"] + extra["requests"]
        elapsed = result["requests"] / max(1.0, result["rps"]) + extra["requests"] / max(
            1.0, extra["rps"]
        )
        result = {
            "requests": total,
            "rps": total / elapsed,
            "errors_total": result["errors_total"] + extra["errors_total"],
        }
    seconds = round(time.monotonic() - started)
    after = {pid: rss_kib(pid) for pid in server.worker_pids}
    served = {pid: bench.exec_lines("idempotent", pid) - served_before[pid] for pid in pids}
    warm = bench.results["rss_after_warmup_kib"]
    bench.results["rss"] = {
        "requests": result["requests"],
        "rps": result["rps"],
        "errors": result["errors_total"],
        "seconds": seconds,
        "workers": [
            {
                "pid": pid,
                "requests": served[pid],
                "rss_after_warmup_kib": warm.get(pid),
                "rss_before_kib": before[pid],
                "rss_after_kib": after.get(pid),
            }
            for pid in pids
        ],
        "same_workers": sorted(pids) == sorted(server.worker_pids) and sorted(pids) == sorted(warm),
    }
    bench.log(
        f"RSS run: {result['requests']} requests at {result['rps']:.0f} req/s,"
        f" {result['errors_total']} errors; RSS before -> after (KiB): "
        + ", ".join(f"{before[p]} -> {after.get(p)}" for p in pids)
    )


def executions(bench: Run, route: str) -> collections.Counter[str]:
    """How many times the view ran for each key on *route* (bench/app.py's logs)."""
    counts: collections.Counter[str] = collections.Counter()
    for path in bench.exec_dir.glob(f"exec-{route}-*.log"):
        counts.update(path.read_text().split())
    return counts


def double_executions(bench: Run) -> None:
    counts = executions(bench, "idempotent")
    hand = executions(bench, "handrolled")
    powertools = executions(bench, "powertools")
    floor = executions(bench, "floor") + executions(bench, "order-floor")
    mix_prefixes = tuple(p + "-" for p in bench.prefixes["d"])
    mix_keys = {k: c for k, c in counts.items() if k.startswith(mix_prefixes)}
    patterns = [p + "-%" for p in bench.prefixes["d"]]
    with psycopg.connect(bench.db.url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'completed'), count(*)"
            " FROM idempotency_keys WHERE key LIKE ANY(%s)",
            [patterns],
        ).fetchone()
    rows = [row or (0, 0)]
    d_rounds = bench.results.get("rounds", {}).get("d", []) + [
        r for r in bench.discarded if r["variant"] == "d"
    ]
    bench.results["duplicates"] = {
        "mix_requests": sum(r["requests"] for r in d_rounds),
        "mix_duplicates_sent": sum(r["duplicates_sent"] for r in d_rounds),
        "mix_created": sum(r["created"] for r in d_rounds),
        "mix_replayed": sum(r["replayed"] for r in d_rounds),
        "mix_conflicts_409": sum(r["conflicts"] for r in d_rounds),
        "mix_other_status": sum(r["others"] for r in d_rounds),
        "mix_keys_executed": len(mix_keys),
        "mix_executions": sum(mix_keys.values()),
        "mix_keys_executed_twice_or_more": sum(1 for c in mix_keys.values() if c > 1),
        "mix_rows_completed": rows[0][0],
        "mix_rows": rows[0][1],
        "all_idempotent_keys_executed": len(counts),
        "all_idempotent_executions": sum(counts.values()),
        "all_idempotent_double_executions": sum(1 for c in counts.values() if c > 1),
        "handrolled_keys_executed": len(hand),
        "handrolled_double_executions": sum(1 for c in hand.values() if c > 1),
        "floor_keys_executed": len(floor),
        "floor_double_executions": sum(1 for c in floor.values() if c > 1),
        "powertools_keys_executed": len(powertools),
        "powertools_double_executions": sum(1 for c in powertools.values() if c > 1),
    }
