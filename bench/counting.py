"""Round trips, statements, commits, transaction ids and WAL per request, counted with
sequential requests to a one-worker gunicorn whose pools connect through a proxy (the test
suite's :class:`~flask_idempotency.testing.proxy.TcpProxy`, which counts round trips: each
time a client sends after its server last spoke, so a statement's Parse/Bind/Execute/Sync
sent together are one)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bench.common import DATABASE, BenchError, get_json, percentile, post
from bench.meter import LAGGING, window
from bench.servers import unix_socket_url
from flask_idempotency.testing.proxy import TcpProxy

if TYPE_CHECKING:
    from bench.context import Run

#: (name, label, path, which replay key or None for a new key per request)
CASES = [
    ("b", "new key, @idempotent", "/idempotent", None),
    ("c", "replay, @idempotent", "/idempotent", "/idempotent"),
    ("f", "new key, hand-rolled", "/handrolled", None),
    ("f-replay", "replay, hand-rolled", "/handrolled", "/handrolled"),
    ("p", "new key, floor", "/floor", None),
    ("p-replay", "replay, floor", "/floor", "/floor"),
    ("a", "plain view", "/plain", None),
    ("o", "order view, plain", "/order-plain", None),
    ("ot", "order, transactional", "/order-transactional", None),
    ("oh", "order, hand-rolled", "/order-handrolled", None),
    ("pt", "order, floor", "/order-floor", None),
]
#: the routes the counting server's warm-up sends to (new keys and replays)
WARM_ROUTES = ("/idempotent", "/handrolled", "/floor", "/plain")
REPLAYED_ROUTES = ("/idempotent", "/handrolled", "/floor")
#: the port number in the name of the proxy's Unix-domain socket (only a name: libpq
#: connects to <directory>/.s.PGSQL.<port>)
PROXY_SOCKET_PORT = 5432
PER_REQUEST = (
    "commits",
    "xids",
    "wal_flushes",
    "wal_flushes_all",
    "wal_bytes",
    "updates",
    "hot_updates",
)


def statement_calls(bench: Run) -> list[tuple[Any, ...]]:
    return bench.db.query(
        """
        SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 70), calls, wal_records,
               mean_exec_time * 1000, wal_bytes
        FROM pg_stat_statements
        WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s)
        ORDER BY calls DESC, 1
        """,
        [DATABASE],
    )


def counting_proxy(bench: Run) -> tuple[TcpProxy, str]:
    """The proxy in front of the server and the URL of the bench database through it: on a
    free 127.0.0.1 port to the server's, or with ``--unix-socket`` from the Unix-domain
    socket ``<workdir>/proxy/.s.PGSQL.5432`` to the server's socket, so that the counted
    requests use the same transport as the measured ones."""
    if not bench.args.unix_socket:
        proxy = TcpProxy("127.0.0.1", bench.db.port)
        return proxy, f"postgresql://postgres@127.0.0.1:{proxy.port}/{DATABASE}"
    directory = bench.workdir / "proxy"
    url = unix_socket_url(directory, PROXY_SOCKET_PORT)  # checks the path's length
    directory.mkdir(parents=True, exist_ok=True)
    listen_path = directory / f".s.PGSQL.{PROXY_SOCKET_PORT}"
    return TcpProxy(str(bench.db.socket_dir), bench.db.port, listen_path=listen_path), url


def count_round_trips(bench: Run) -> None:
    """Sequential requests to a one-worker gunicorn whose pools go through a proxy."""
    proxy, url = counting_proxy(bench)
    proxy.start()
    server = bench.start_gunicorn("count", 1, url)
    try:
        prefix = f"count{bench.run_id}"
        replay_key = {path: f"{prefix}-replay{path[1:]}" for path in REPLAYED_ROUTES}
        # Warm-up: open the pools, check the schema, prepare the statements on every
        # pooled connection (the pool hands its connections out in turn).
        for i in range(20):
            for path in WARM_ROUTES:
                post(server.port, path, f"{prefix}-warm-{path[1:]}-{i}")
            for path, key in replay_key.items():
                post(server.port, path, key)

        def poke() -> None:
            if get_json(server.port, "/flush-stats") is None:
                raise BenchError("GET /flush-stats failed on the counting server")

        # No autovacuum meanwhile: its transactions would count as commits.
        bench.db.autovacuum(False)
        bench.db.execute("CHECKPOINT")
        # The main server's backends still hold statistics of the phases before (the
        # latency phase's last requests): make them report now, not inside a case.
        if bench.main is not None:
            bench.meter.settled(bench.poke_main)
        # What the pokes themselves add to a window (their statements commit), to take off.
        first = bench.meter.settled(poke)
        poke_cost = window(first, bench.meter.settled(poke))
        counted: dict[str, Any] = {}
        for name, label, path, replay_of in CASES:
            key = replay_key[replay_of] if replay_of else f"{prefix}-{name}-{{}}"
            counted[name] = count_case(bench, proxy, server.port, poke, poke_cost, label, path, key)
        bench.results["counted"] = counted
        bench.results["counted_poke_cost"] = {k: poke_cost[k] for k in LAGGING}
    finally:
        bench.db.autovacuum(True)
        bench.stop_gunicorn(server)
        proxy.stop()


def count_case(
    bench: Run,
    proxy: TcpProxy,
    port: int,
    poke: Callable[[], None],
    poke_cost: dict[str, float],
    label: str,
    path: str,
    key: str,
) -> dict[str, Any]:
    """Sequential requests with *key*: the same key (replays), or a new one per request if
    *key* has a ``{}`` for the request's number."""
    n = bench.args.count_requests
    before = bench.meter.settled(poke)
    bench.db.query("SELECT pg_stat_statements_reset()")
    trips0, conns0 = proxy.round_trips, proxy.connections
    statuses: collections.Counter[str] = collections.Counter()
    latencies = []
    for i in range(n):
        t = time.perf_counter()
        status, replayed = post(port, path, key.format(i))
        latencies.append((time.perf_counter() - t) * 1000)
        statuses[f"{status}{' replayed' if replayed else ''}"] += 1
    trips1, conns1 = proxy.round_trips, proxy.connections
    statements = statement_calls(bench)
    delta = window(before, bench.meter.settled(poke))
    c = {
        "label": label,
        "requests": n,
        "statuses": dict(statuses),
        "round_trips": (trips1 - trips0) / n,
        "new_connections": conns1 - conns0,
        "statements": sum(row[1] for row in statements) / n,
        # WAL written by the statements themselves (pg_stat_statements); the LSN
        # difference in wal_bytes also has the server's background records
        "statement_wal_bytes": sum(float(row[4]) for row in statements) / n,
        **{k: (delta[k] - poke_cost[k]) / n for k in PER_REQUEST},
        "sequential_latency_ms_p50": percentile(latencies, 50),
        "statement_calls": [
            {
                "query": q,
                "calls": calls,
                "wal_records": w,
                "wal_bytes": int(b),
                "mean_exec_us": round(t, 1),
            }
            for q, calls, w, t, b in statements
        ],
    }
    bench.log(
        f"counted {label:22}: {c['round_trips']:.2f} round trips,"
        f" {c['statements']:.2f} statements, {c['commits']:.2f} commits,"
        f" {c['xids']:.2f} xids, {c['wal_flushes']:.2f} WAL flushes"
        f" ({c['wal_flushes_all']:.2f} with background processes),"
        f" {c['wal_bytes']:.0f} WAL bytes per request; {dict(statuses)}"
    )
    return c
