"""``IDEMPOTENCY_ROUTE_TO_SHARDS`` (SPEC §22): a process whose store URL names the
coordinator sends a tenant's claims and common finishes to the worker that holds its shard.

- Once the tenant's worker is learned (its first request) and its pool has connected, the
  tenant's new keys, replays and refusals send nothing through the coordinator (a proxy in
  front of it counts the statements), each key runs once, and without the option every key
  goes through it.
- Twins entering through a routed process and through the coordinator run the view once.
- A worker the process cannot reach (its address closed) leaves its tenants to the
  coordinator: every request answered, none waits for that worker.
- A worker that goes away after its pool connected (a proxy in its place, stopped): the
  request that meets it fails at most, the worker is left out, later requests are answered,
  each key runs once; one that goes silent (the proxy frozen): the request that meets it
  answers 503 within the store's bounds, the next go through the coordinator, and its key
  runs once when retried.
- A shard moved while its tenant is routed: tests/e2e/test_citus_on_the_shard.py.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

from flask import Flask, request

from flask_idempotency import current_idempotency
from flask_idempotency.store.shard_hints import Shard
from flask_idempotency.testing.citus import CitusCluster
from flask_idempotency.testing.postgres import free_port
from flask_idempotency.testing.proxy import TcpProxy
from tests.e2e.test_citus import init, table_names
from tests.e2e.test_citus_on_the_shard import counting_app, placement, routed_to
from tests.support.helpers import wait_until

#: a tenant's name, with what a name may hold
TENANT = "acme 'routed' %s $1 \\ ünï"


def test_a_routed_tenant_s_keys_go_to_its_worker_and_not_through_the_coordinator(
    citus: CitusCluster, node_app: Callable[..., Flask]
) -> None:
    names = table_names("x")
    assert init(node_app(citus.url, **names)).exit_code == 0
    _, port = placement(citus.url, names["IDEMPOTENCY_TABLE"], TENANT)
    for route in (True, False):
        runs: Counter[str] = Counter()
        with TcpProxy.to_database(citus.url) as proxy:
            app = counting_app(
                node_app,
                proxy.url(citus.url),
                runs,
                IDEMPOTENCY_ROUTE_TO_SHARDS=route,
                IDEMPOTENCY_OWNER_DATABASE_URL=citus.url,  # its lock's session not counted
                **names,
            )
            through_coordinator, keys = _served(app, proxy, port, route)
        assert runs == Counter({f"{route}-first": 1, **{key: 1 for key in keys}})
        if route:
            assert through_coordinator == 0
        else:  # at least the claim of each new key and each replay's look
            assert through_coordinator >= 2 * len(keys)
        assert routed_to(app, port) is route


def _served(app: Flask, proxy: TcpProxy, port: int, route: bool) -> tuple[int, list[str]]:
    """A tenant's first key, then (once routed, if *route*) 20 new keys, their replays and
    three refusals of another body: the statements sent through *proxy* for the 20, and
    their keys."""
    client = app.test_client()

    def post(key: str, n: int) -> tuple[int, bool]:
        sent = client.post(
            "/pay", headers={"Idempotency-Key": key, "X-Tenant": TENANT}, json={"n": n}
        )
        return sent.status_code, sent.headers.get("Idempotent-Replayed") == "true"

    assert post(f"{route}-first", 0) == (201, False)
    if route:
        wait_until(lambda: routed_to(app, port))
    sent_before = proxy.statements
    keys = [f"{route}-{n}" for n in range(20)]
    assert [post(key, 1) for key in keys] == [(201, False)] * len(keys)
    assert [post(key, 1) for key in keys] == [(201, True)] * len(keys)
    assert [post(key, 2)[0] for key in keys[:3]] == [422] * 3
    return proxy.statements - sent_before, keys


def test_twins_through_a_routed_process_and_the_coordinator_run_the_view_once(
    citus: CitusCluster, node_app: Callable[..., Flask]
) -> None:
    names = table_names("y")
    assert init(node_app(citus.url, **names)).exit_code == 0
    _, port = placement(citus.url, names["IDEMPOTENCY_TABLE"], TENANT)
    runs: Counter[str] = Counter()
    started, release = threading.Event(), threading.Event()

    def slow_app(url: str, **config: object) -> Flask:
        app = node_app(url, **names, **config)
        idempotency = app.extensions["idempotency"].extension
        idempotency.tenant_loader(lambda: request.headers.get("X-Tenant", ""))

        @app.post("/slow")
        @idempotency.idempotent
        def slow() -> tuple[dict[str, str], int]:
            runs[current_idempotency.key] += 1
            started.set()
            assert release.wait(30)
            return {"ran": current_idempotency.key}, 201

        return app

    routed = slow_app(citus.url, IDEMPOTENCY_ROUTE_TO_SHARDS=True)
    plain = slow_app(citus.url)
    release.set()
    learned = routed.test_client().post(
        "/slow", headers={"Idempotency-Key": "learn", "X-Tenant": TENANT}
    )
    assert learned.status_code == 201
    wait_until(lambda: routed_to(routed, port))

    for first, twin in ((routed, plain), (plain, routed)):
        key = f"twin-{first is routed}"
        headers = {"Idempotency-Key": key, "X-Tenant": TENANT}
        started.clear()
        release.clear()
        answers: list[int] = []

        def send(
            app: Flask = first, sent: dict[str, str] = headers, out: list[int] = answers
        ) -> None:
            out.append(app.test_client().post("/slow", headers=sent).status_code)

        running = threading.Thread(target=send)
        running.start()
        assert started.wait(30)
        assert twin.test_client().post("/slow", headers=headers).status_code == 409
        release.set()
        running.join(30)
        assert answers == [201]
        again = twin.test_client().post("/slow", headers=headers)
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
        assert runs[key] == 1


def test_a_worker_the_process_cannot_reach_leaves_its_tenants_to_the_coordinator(
    citus: CitusCluster, node_app: Callable[..., Flask]
) -> None:
    """The metadata names an address this process cannot reach (here: a closed port in the
    learned place of the tenant's worker): its pool never connects, and every request goes
    through the coordinator's functions, answered, none waiting for that worker."""
    runs: Counter[str] = Counter()
    app, learned = _routed_app(citus, node_app, "z", runs, IDEMPOTENCY_POOL_TIMEOUT=30)
    closed = ("127.0.0.1", free_port())
    _learn_at(app, learned, closed)
    client = app.test_client()
    for n in range(10):
        headers = {"Idempotency-Key": f"k{n}", "X-Tenant": TENANT}
        assert client.post("/pay", headers=headers).status_code == 201
        again = client.post("/pay", headers=headers)
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert runs == Counter({"first": 1, **{f"k{n}": 1 for n in range(10)}})
    nodes = app.extensions["idempotency"].store.nodes
    assert nodes is not None and nodes.pool(closed) is None  # never connected


def test_a_routed_worker_that_goes_away_leaves_its_tenants_to_the_coordinator(
    citus: CitusCluster, node_app: Callable[..., Flask]
) -> None:
    """The tenant's worker is reached through a proxy (learned in its place) that stops
    once the pool connected: the request that meets it fails at most (503, its key not
    claimed), the worker is left out, and every later request is answered; each key runs
    once, retried or not."""
    runs: Counter[str] = Counter()
    app, learned = _routed_app(
        citus, node_app, "w", runs, IDEMPOTENCY_POOL_TIMEOUT=1, IDEMPOTENCY_STATEMENT_TIMEOUT=2
    )
    nodes = app.extensions["idempotency"].store.nodes
    assert nodes is not None and learned.node is not None
    client = app.test_client()

    def post(key: str) -> tuple[int, bool]:
        sent = client.post("/pay", headers={"Idempotency-Key": key, "X-Tenant": TENANT})
        return sent.status_code, sent.headers.get("Idempotent-Replayed") == "true"

    with TcpProxy(*learned.node) as proxy:
        through = ("127.0.0.1", proxy.port)
        _learn_at(app, learned, through)
        wait_until(lambda: nodes.pool(through) is not None)
        assert post("routed") == (201, False)
        assert proxy.statements >= 2  # its claim and its finish went through the proxy
    # the proxy stopped: the pool's connections ended, new ones are refused
    answers = [post(f"k{n}") for n in range(5)]
    assert answers[0] in ((201, False), (503, False)), answers
    assert answers[1:] == [(201, False)] * 4, answers
    assert nodes.pool(through) is None  # left out
    for n in range(5):
        assert post(f"k{n}")[0] == 201
    assert runs == Counter({"first": 1, "routed": 1, **{f"k{n}": 1 for n in range(5)}})


def test_a_routed_worker_that_answers_nothing_costs_one_request_its_bound(
    citus: CitusCluster, node_app: Callable[..., Flask]
) -> None:
    """The tenant's worker, reached through a proxy, goes silent (connections open, nothing
    answers): the request that meets it answers 503 within IDEMPOTENCY_POOL_TIMEOUT +
    IDEMPOTENCY_STATEMENT_TIMEOUT (a margin for a loaded machine), the next ones go through
    the coordinator. Once the proxy forwards again, the claim it held may commit after all;
    on Citus its owner hands no lost claim back, so it waits for its lease (3 s here; on one
    PostgreSQL the owner's late looks hand it back, tests/unit/test_lost_claim.py): the key
    that got 503 runs once when retried."""
    runs: Counter[str] = Counter()
    pool_timeout, statement_timeout = 1, 2
    app, learned = _routed_app(
        citus,
        node_app,
        "p",
        runs,
        IDEMPOTENCY_POOL_TIMEOUT=pool_timeout,
        IDEMPOTENCY_STATEMENT_TIMEOUT=statement_timeout,
        IDEMPOTENCY_LEASE=3,
    )
    nodes = app.extensions["idempotency"].store.nodes
    assert nodes is not None and learned.node is not None
    client = app.test_client()

    def post(key: str) -> int:
        sent = client.post("/pay", headers={"Idempotency-Key": key, "X-Tenant": TENANT})
        return sent.status_code

    with TcpProxy(*learned.node) as proxy:
        through = ("127.0.0.1", proxy.port)
        _learn_at(app, learned, through)
        wait_until(lambda: nodes.pool(through) is not None)
        assert post("routed") == 201
        proxy.freeze()
        started = time.monotonic()
        assert post("silent") == 503
        assert time.monotonic() - started < pool_timeout + statement_timeout + 2
        assert [post(f"k{n}") for n in range(3)] == [201] * 3  # through the coordinator
        proxy.thaw()
    wait_until(lambda: post("silent") == 201, 30)
    assert runs == Counter({"first": 1, "routed": 1, "silent": 1, "k0": 1, "k1": 1, "k2": 1})


def _routed_app(
    citus: CitusCluster,
    node_app: Callable[..., Flask],
    prefix: str,
    runs: Counter[str],
    **config: object,
) -> tuple[Flask, Shard]:
    """A routed app at the coordinator on tables of their own, after its first key of
    :data:`TENANT` (``first``): the shard it learned from the metadata."""
    names = table_names(prefix)
    assert init(node_app(citus.url, **names)).exit_code == 0
    app = counting_app(
        node_app, citus.url, runs, IDEMPOTENCY_ROUTE_TO_SHARDS=True, **config, **names
    )
    headers = {"Idempotency-Key": "first", "X-Tenant": TENANT}
    assert app.test_client().post("/pay", headers=headers).status_code == 201
    found = app.extensions["idempotency"].store._shards.on_this_node(TENANT)
    assert found is not None and found[0].node is not None  # learned from the metadata
    return app, found[0]


def _learn_at(app: Flask, learned: Shard, node: tuple[str, int]) -> None:
    """*app*'s process takes :data:`TENANT`'s shard as on the worker at *node* (the fault:
    the metadata naming an address other than the worker's own)."""
    hints = app.extensions["idempotency"].store._shards
    hints.forget(TENANT)
    hints.learn(TENANT, learned.keys, learned.graves, learned.shard, node)
