"""New keys under HTTP load, this checkout's library beside other releases', in one run:

    python -m bench.releases --compare DIR [--compare DIR ...] [--rounds 5] [--seconds 8]

Each DIR is another checkout (``git worktree add DIR <commit>``). One throwaway durable
PostgreSQL (as ``bench.cost`` starts one) holds every release's table; a gunicorn
(``--workers`` sync workers) serves ``bench/app.py`` from each checkout; wrk (2 threads,
``--connections`` clients) sends new keys. The variants run in alternating rounds (each
first in turn): ``b`` of every release (``POST /idempotent``), and, from this checkout,
the hand-rolled code (``f``, ``/handrolled``) and the floor (``p``, ``/floor``), which do
not depend on the library. Printed per variant: the median requests a second and the CPU
time per request of gunicorn (the master and its workers) and of PostgreSQL (every
backend); then each release's b / f and b / p, by rate and by CPU per request. On a shared
machine trust the CPU figures (a stall of the disk moves the rate, not the CPU).

Each release has a keys table of its own (``idempotency_keys_<n>``, made by that release's
``flask idempotency-init``), so that each is measured on the layout it makes: an upgrade by
a later release would otherwise drop an earlier one's indexes. The shared tables (jobs,
audit, heartbeats) are made by the oldest: list ``--compare`` oldest first.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

import flask_idempotency
from bench.load import wrk_round
from bench.servers import (
    Gunicorn,
    Postgres,
    Processes,
    app_env,
    start_gunicorn,
    stop_gunicorn,
)

#: this checkout: the one whose bench/ runs and whose library this process imports
HERE = Path(flask_idempotency.__file__).resolve().parent.parent
PATHS = {"b": "/idempotent", "f": "/handrolled", "p": "/floor"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="new keys under load, releases side by side")
    parser.add_argument(
        "--compare", metavar="DIR", action="append", default=[], help="another checkout"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=8, help="per round")
    parser.add_argument("--workers", type=int, default=4, help="gunicorn's sync workers")
    parser.add_argument("--connections", type=int, default=32, help="wrk's clients")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    roots = {Path(d).resolve().name: Path(d).resolve() for d in args.compare}
    roots["this"] = HERE
    with tempfile.TemporaryDirectory(prefix="bench-releases-") as tmp:
        workdir = Path(tmp)
        processes = Processes(workdir / "pids")
        db = Postgres(workdir / "pg", processes)
        db.start(print)
        assert db.pid is not None
        servers: dict[str, Gunicorn] = {}
        try:
            for n, (name, root) in enumerate(roots.items()):
                table = f"idempotency_keys_{n}"
                env = app_env(db.url, workdir, PYTHONPATH=str(root), FLASK_IDEMPOTENCY_TABLE=table)
                db.prepare_app(env, root)
                servers[name] = start_gunicorn(
                    processes, workdir, f"releases-{name}", args.workers, env, root=root
                )
                print(f"{name}: flask_idempotency from {root}", flush=True)
            variants = [(name, "b") for name in servers] + [("this", "f"), ("this", "p")]
            for name, variant in variants:  # warm-up: every worker's pools and statements
                port = servers[name].port
                wrk_round(processes, port, PATHS[variant], f"w{name}{variant}", 2, 8, ())
            rates: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
            cpus: dict[tuple[str, str], list[list[float]]] = {v: [] for v in variants}
            for r in range(args.rounds):
                turn = r % len(variants)
                for name, variant in variants[turn:] + variants[:turn]:
                    server = servers[name]
                    rate, cpu = wrk_round(
                        processes,
                        server.port,
                        PATHS[variant],
                        f"{name}{variant}{r}{uuid.uuid4().hex[:6]}",
                        args.seconds,
                        args.connections,
                        (server.proc.pid, db.pid),
                    )
                    rates[name, variant].append(rate)
                    cpus[name, variant].append(cpu)
            report(rates, cpus)
        finally:
            for server in servers.values():
                stop_gunicorn(processes, server)
            db.stop()
    return 0


def report(
    rates: dict[tuple[str, str], list[float]], cpus: dict[tuple[str, str], list[list[float]]]
) -> None:
    medians: dict[tuple[str, str], tuple[float, float, float]] = {}
    for (name, variant), values in rates.items():
        app, server = (statistics.median(c) for c in zip(*cpus[name, variant], strict=True))
        medians[name, variant] = (statistics.median(values), app, server)
        rounds = ", ".join(f"{v:.0f}" for v in values)
        print(
            f"{variant} {name:12} {medians[name, variant][0]:7.0f} req/s (rounds {rounds})"
            f"  CPU per request {app + server:5.0f} us (gunicorn {app:.0f},"
            f" PostgreSQL {server:.0f}; medians)"
        )
    for name, variant in rates:
        if variant != "b":
            continue
        rate, app, server = medians[name, "b"]
        for base in ("f", "p"):
            base_rate, base_app, base_server = medians["this", base]
            print(
                f"{name:12} b/{base}: {rate / base_rate:.2f} by rate,"
                f" {(base_app + base_server) / (app + server):.2f} by CPU per request"
                f" (b's CPU {(app + server) / (base_app + base_server):.2f}x {base}'s)"
            )


if __name__ == "__main__":
    raise SystemExit(main())
