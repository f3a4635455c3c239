"""The benchmark driver, started by ``bash bench/run`` (see docs/performance-history.md).

One run on this machine, against a throwaway *durable* PostgreSQL (``fsync``,
``synchronous_commit`` and ``full_page_writes`` on) and gunicorn on 127.0.0.1 (the app
reaches PostgreSQL over 127.0.0.1 TCP, or with ``--unix-socket`` over its Unix-domain
socket):

1. throughput and latency of the variants, measured in alternating rounds (a b c d e f
   g gr, then b c d e f g gr a, ...) and reported as medians, with the CPU each component spent per
   request and the database's commits and WAL flushes per request under load:

   a. ``POST /plain``: the view, no idempotency;
   b. ``POST /idempotent``: the same view under ``@idempotency.idempotent``, a new key
      per request;
   c. the same route, every request a replay of one key;
   d. the same route, 10 % of the requests reuse a recent key (duplicates, some of them
      while the first is still running);
   e. pgbench running the extension's own claim and finish SQL (``CLAIM``, ``FINISH``
      from flask_idempotency/queries.py) with random keys at the same concurrency: the
      database's ceiling for new keys;
   f. ``POST /handrolled``: the hand-rolled "seed-style" protection, a new key per request;
   g. ``POST /powertools``: the same view under AWS Lambda Powertools' idempotency with
      its Redis persistence layer, on a redis-server the benchmark starts, a new key per
      request; gr: the same, replays of one key (bench/peers.py);
   h. Flask-Idempotent (2015), measured only if it imports (it did not, last time);
   o, ot, oh. a view that inserts an order row: plain, ``@idempotent(transactional=True)``,
      hand-rolled;
   p, pt. the floor (``POST /floor``, ``/order-floor``): the least any library can do at
      the same durability, a claim ``INSERT ... ON CONFLICT DO NOTHING`` and a finish
      ``UPDATE`` in bare psycopg, as two commits (p) or with the order row in one (pt);

   then the latency at low load: one client, one connection, sequential requests, for
   every variant that sends new keys or replays;
2. round trips (through a counting proxy, TCP or Unix socket), statements
   (pg_stat_statements), commits (pg_stat_database), transaction ids, WAL flushes
   (pg_stat_io) and WAL bytes per new key and per replay, with sequential requests to a
   one-worker gunicorn;
3. a py-spy profile of one gunicorn worker during a new-key round and a replay round;
4. per-worker RSS before and after a long new-key run (100k requests by default);
5. double executions: keys whose view ran more than once (from the app's execution logs).

Run it as ``python -m bench`` (or ``python -m bench.bench``) from the repository root;
``bench/run`` does that. This module is the command line; the parts are:

- bench/driver.py   one run: the phases in order, the shared state, the cleanup
- bench/servers.py  starting and stopping PostgreSQL and gunicorn, bounded children
- bench/load.py     the load generators: wrk (bench/wrk.lua) and pgbench
- bench/meter.py    CPU per component and the database's counters around a run
- bench/phases.py   the alternating rounds, the long RSS run, double executions
- bench/counting.py round trips through a counting proxy, statements, WAL
- bench/profiles.py py-spy: record, sort each stack into a category, scale per request
- bench/report.py   the report, from results.json alone
- bench/system.py   the machine, /proc readers, which sources are measured
- bench/app.py      the Flask app every variant runs; bench/inprocess.py the in-process run
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from bench.common import BY_NAME, BenchError, parse_variants
from bench.driver import Bench


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds per variant (default 3)")
    p.add_argument("--seconds", type=float, default=10, help="seconds per round (default 10)")
    p.add_argument("--warmup", type=float, default=2, help="warm-up seconds per variant")
    p.add_argument("--workers", type=int, default=4, help="gunicorn sync workers (default 4)")
    p.add_argument("--threads", type=int, default=2, help="wrk/pgbench threads (default 2)")
    p.add_argument("--connections", type=int, default=32, help="wrk connections (default 32)")
    p.add_argument(
        "--variants",
        default=",".join(BY_NAME),
        help=f"which variants: letters (abcf) or names (a,b,gr); default {','.join(BY_NAME)}",
    )
    p.add_argument("--count-requests", type=int, default=500, help="sequential counted requests")
    p.add_argument("--profile-seconds", type=float, default=10)
    p.add_argument("--inprocess-requests", type=int, default=3000)
    p.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--cpu-profile-rate", type=int, default=500, help="same, in process")
    p.add_argument("--latency-rounds", type=int, default=2, help="low-load latency rounds")
    p.add_argument("--latency-seconds", type=float, default=5, help="seconds per variant")
    p.add_argument(
        "--redis-appendfsync",
        default="everysec",
        choices=("always", "everysec", "no"),
        help="redis-server's AOF flush for the Powertools variants (default everysec)",
    )
    p.add_argument(
        "--unix-socket",
        action="store_true",
        help="the app's pools, pgbench and the counted phase reach PostgreSQL over its"
        " Unix-domain socket instead of 127.0.0.1 TCP",
    )
    p.add_argument("--rss-requests", type=int, default=100_000)
    p.add_argument("--rss-max-seconds", type=float, default=200)
    p.add_argument("--settle", type=float, default=1.2, help="pause before reading statistics")
    p.add_argument(
        "--foreign-limit",
        type=float,
        default=0.15,
        help="repeat a round when other processes used more than this share of the CPU",
    )
    p.add_argument("--max-repeats", type=int, default=4, help="at most this many repeats")
    p.add_argument("--time-limit", type=int, default=1200, help="abort after this many seconds")
    p.add_argument("--quick", action="store_true", help="a short smoke run (about a minute)")
    p.add_argument("--workdir", help="scratch directory (default: a new one under /var/tmp)")
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument(
        "--out", default="bench/out", help="where the report goes (relative to the repository)"
    )
    p.add_argument("--repo", help="the git repository (default: the one holding this file)")
    soak = p.add_argument_group("soak (bench/soak.py; not with the other phases)")
    soak.add_argument("--soak", action="store_true", help="run the soak scenario instead")
    soak.add_argument("--soak-keys", type=int, default=10_000_000, help="keys bulk-loaded")
    soak.add_argument("--soak-claims", type=int, default=3000, help="timed claims per table")
    soak.add_argument("--soak-minutes", type=float, default=20, help="minutes at full rate")
    soak.add_argument("--soak-ttl", type=int, default=60, help="IDEMPOTENCY_TTL at full rate")
    soak.add_argument(
        "--soak-probe-ttl",
        type=int,
        help="the prober's keys' TTL (default: --soak-ttl; longer shows a mix of TTLs)",
    )
    soak.add_argument("--soak-clean-every", type=float, default=10, help="seconds between cleans")
    soak.add_argument("--soak-chunk", type=float, default=10, help="seconds per wrk chunk")
    soak.add_argument(
        "--soak-workers",
        action="store_true",
        help="also run idempotency-complete and idempotency-dispatch --loop 1 all along",
    )
    soak.add_argument(
        "--soak-plot", default="bench/out/soak.png", help="the PNG (repository-relative)"
    )
    args = p.parse_args(argv)
    if args.soak_probe_ttl is None:
        args.soak_probe_ttl = args.soak_ttl
    if args.soak and args.time_limit == 1200:  # the default: what the soak needs, and an hour
        args.time_limit = int(args.soak_minutes * 60 + 3600)
    if args.quick:
        args.rounds, args.seconds, args.warmup = 1, 3, 1
        args.count_requests, args.profile_seconds, args.inprocess_requests = 50, 3, 300
        args.rss_requests, args.rss_max_seconds = 3000, 10
        args.latency_rounds, args.latency_seconds = 1, 2
    try:
        args.variants = parse_variants(args.variants)
    except ValueError as exc:
        p.error(f"--variants: {exc}")
    if args.soak and args.unix_socket:
        p.error("--unix-socket: not with --soak (the soak connects over TCP)")
    if "b" not in args.variants:
        p.error("--variants: b is needed (the RSS run and the profiles use it)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def stop(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGALRM:
            raise BenchError(f"time limit of {args.time_limit} s reached")
        raise SystemExit(f"benchmark stopped by signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, stop)
    signal.alarm(args.time_limit)
    if args.soak:
        from bench import soak

        try:
            return soak.main(args)
        except BenchError as exc:
            print(f"soak failed: {exc}", file=sys.stderr)
            return 1
        finally:
            signal.alarm(0)
    bench = Bench(args)
    try:
        bench.run()
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # let the cleanup finish
        bench.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
