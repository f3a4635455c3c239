"""The request path on the shard itself (SPEC §22): on Citus the claim and the common finish
are functions delegated to the shard's node, whose statements run on the shard's own table
when it is there (statements_citus._WHERE_TO_RUN), under the lock on the shard's metadata that
every Citus write takes and that a shard move takes exclusively to block writes.

- A shard is moved (``citus_move_shard_placement``, non-blocking through logical replication,
  and blocking writes) while new keys of its tenant are claimed and finished, entering at the
  node the shard leaves: every key that answered ran its view once and is on the shard's new
  placement, each replays its stored answer afterwards, and a key that got no answer runs
  once when retried. Without the lock and the placement check the moved shard loses keys.
- A role that does not own the table (the lock is the owner's) claims through the
  distributed tables.
- A session that lost its prepared statements (``DISCARD ALL``) prepares them again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from flask import Flask, request
from flask.testing import FlaskClient

from flask_idempotency import current_idempotency
from flask_idempotency.store.postgres import PostgresStore
from flask_idempotency.testing.citus import CitusCluster
from tests.e2e.test_citus import init, query, table_names
from tests.support.helpers import wait_until

#: claims sent before the move begins, and at least after it ended
BEFORE, AFTER = 30, 30
#: how long the load may run in all (the move of a small shard takes a few seconds)
DEADLINE_SECONDS = 120.0


def counting_app(
    node_app: Callable[..., Flask], url: str, runs: Counter[str], **config: Any
) -> Flask:
    """An app on *url* whose ``POST /pay`` counts its runs by key; tenant from ``X-Tenant``."""
    app = node_app(url, **config)
    idempotency = app.extensions["idempotency"].extension
    idempotency.tenant_loader(lambda: request.headers.get("X-Tenant", ""))
    lock = threading.Lock()

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, str], int]:
        with lock:
            runs[current_idempotency.key] += 1
        return {"paid": current_idempotency.key}, 201

    return app


def routed_to(app: Flask, port: int) -> bool:
    """Whether *app*'s process sends the statements of tenants on the worker at *port* to
    that worker itself (IDEMPOTENCY_ROUTE_TO_SHARDS, its pool connected)."""
    nodes = app.extensions["idempotency"].store.nodes
    return nodes is not None and nodes.pool(("127.0.0.1", port)) is not None


def placement(url: str, table: str, tenant: str) -> tuple[int, int]:
    """The shard of *tenant*'s keys and the port of the node that holds it."""
    rows = query(
        url,
        "SELECT shardid, nodeport FROM citus_shards"
        " WHERE table_name = %s::regclass"
        "   AND shardid = get_shard_id_for_distribution_column(%s::regclass, %s::text)",
        table,
        table,
        tenant,
    )
    assert len(rows) == 1, rows
    return int(rows[0][0]), int(rows[0][1])


@pytest.mark.parametrize(
    ("mode", "entry"),
    [("force_logical", "source"), ("block_writes", "source"), ("force_logical", "routed")],
)
def test_keys_claimed_through_a_shard_move_run_once_and_move_with_it(
    citus: CitusCluster, node_app: Callable[..., Flask], mode: str, entry: str
) -> None:
    """*entry*: at the node the shard leaves, or ``routed``: at the coordinator with
    IDEMPOTENCY_ROUTE_TO_SHARDS (the process sends the tenant's statements to that node)."""
    names = table_names("m")
    table, tenant = names["IDEMPOTENCY_TABLE"], f"tenant-{mode}-{entry}"
    runs: Counter[str] = Counter()
    assert init(node_app(citus.url, **names)).exit_code == 0
    shard, source = placement(citus.url, table, tenant)
    (target,) = [w.port for w in citus.workers if w.port != source]
    source_url = next(w.url for w in citus.workers if w.port == source)
    if entry == "routed":
        app = counting_app(node_app, citus.url, runs, IDEMPOTENCY_ROUTE_TO_SHARDS=True, **names)
    else:
        app = counting_app(node_app, source_url, runs, **names)

    answers: dict[str, int] = {}
    moved = threading.Event()
    after_move = Counter[str]()
    failures: list[BaseException] = []

    def claim(worker: int) -> None:
        client = app.test_client()
        n = 0
        try:
            while time.monotonic() < deadline and (
                not moved.is_set() or after_move[str(worker)] < AFTER
            ):
                key = f"{mode}-{entry}-{worker}-{n}"
                sent = client.post("/pay", headers={"Idempotency-Key": key, "X-Tenant": tenant})
                answers[key] = sent.status_code
                if moved.is_set():
                    after_move[str(worker)] += 1
                n += 1
        except BaseException as exc:  # reported by the test below
            failures.append(exc)

    deadline = time.monotonic() + DEADLINE_SECONDS
    threads = [threading.Thread(target=claim, args=(worker,)) for worker in range(2)]
    for thread in threads:
        thread.start()
    while len(answers) < BEFORE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.extensions["idempotency"].store.schema.citus_claim  # the delegated functions
    if entry == "routed":  # by now the tenant's statements go to the source worker itself
        wait_until(lambda: routed_to(app, source))
    with psycopg.connect(citus.url, autocommit=True) as conn:
        conn.execute(
            "SELECT citus_move_shard_placement(%s, '127.0.0.1', %s, '127.0.0.1', %s,"
            " shard_transfer_mode => %s::citus.shard_transfer_mode)",
            (shard, source, target, mode),
        )
    moved.set()
    for thread in threads:
        thread.join(timeout=DEADLINE_SECONDS)
    assert not failures, failures
    assert placement(citus.url, table, tenant) == (shard, target)
    assert sum(after_move.values()) >= 2 * AFTER, after_move

    # What answered 201 ran once, and its row moved with the shard; nothing ran twice.
    answered = {key for key, status in answers.items() if status == 201}
    assert len(answered) >= BEFORE + 2 * AFTER - 2, Counter(answers.values())
    assert set(answers.values()) <= {201, 503}, Counter(answers.values())
    assert max(runs.values()) == 1, [key for key, count in runs.items() if count > 1]
    assert set(runs) == answered, set(runs) ^ answered
    stored = query(
        citus.url,
        f"SELECT key FROM {table} WHERE tenant = %s AND status = 'completed'",
        tenant,
    )
    assert {key for (key,) in stored} == answered

    # Each replays its answer through the node the shard left; a key without one runs once.
    client = app.test_client()
    for key, status in answers.items():
        again = client.post("/pay", headers={"Idempotency-Key": key, "X-Tenant": tenant})
        assert again.status_code == 201 and again.get_json() == {"paid": key}, key
        assert (again.headers.get("Idempotent-Replayed") == "true") == (status == 201), key
    assert max(runs.values()) == 1


def test_a_role_that_does_not_own_the_table_claims_through_the_distributed_tables(
    citus: CitusCluster, node_app: Callable[..., Flask]
) -> None:
    """The shard's metadata lock is its table owner's (Citus's check): an app whose role was
    granted the tables but does not own them claims, replays and is refused another body
    through the same functions, on the distributed tables, never failing on that lock."""
    names = table_names("r")
    assert init(node_app(citus.url, **names)).exit_code == 0
    role = f"app_{names['IDEMPOTENCY_TABLE'][:9]}"
    tables = ", ".join([*names.values(), f"{names['IDEMPOTENCY_TABLE']}_tombstones"])
    query(citus.url, f"CREATE ROLE {role} LOGIN")
    query(citus.url, f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables} TO {role}")
    runs: Counter[str] = Counter()
    entry = citus.worker_urls[0].replace("postgres@", f"{role}@", 1)
    app = counting_app(node_app, entry, runs, **names)
    client = app.test_client()
    for n in range(20):
        headers = {"Idempotency-Key": f"k{n}", "X-Tenant": f"t{n % 7}"}
        first = client.post("/pay", headers=headers, json={"n": n})
        assert first.status_code == 201, first.get_data(as_text=True)
        again = client.post("/pay", headers=headers, json={"n": n})
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
        other = client.post("/pay", headers=headers, json={"n": -n - 1})
        assert other.status_code == 422, other.get_data(as_text=True)
    assert app.extensions["idempotency"].store.schema.citus_claim
    assert set(runs.values()) == {1} and len(runs) == 20


def test_a_session_that_lost_its_prepared_statements_prepares_them_again(
    citus: CitusCluster, node_app: Callable[..., Flask]
) -> None:
    """The functions prepare their statements once per session (``DISCARD ALL``, a pooler's
    reset, drops them): a call after it prepares them again, on the shard (entering at its
    node) and off it (at the coordinator inside a transaction, where Citus does not delegate
    the call: the distributed tables)."""
    names = table_names("d")
    table = names["IDEMPOTENCY_TABLE"]
    assert init(node_app(citus.url, **names)).exit_code == 0
    shard, port = placement(citus.url, table, "t")
    shard_url = next(w.url for w in citus.workers if w.port == port)
    call = (
        f"SELECT decision, attempt FROM {table}_claim_v3(%s, %s, '\\x01'::bytea, %s, false, 0,"
        " 60, 86400, NULL, NULL, 'retry', NULL, NULL, NULL)"
    )
    prepared = "SELECT name FROM pg_prepared_statements WHERE name LIKE 'idem2%%'"
    for url, where, transaction in ((shard_url, f"_{shard}_", False), (citus.url, "_0_", True)):
        with psycopg.connect(url, autocommit=True) as conn:
            for n in range(3):
                key = f"{where}{n}"
                with conn.transaction() if transaction else contextlib.nullcontext():
                    row = conn.execute(call, ("t", key, n)).fetchone()
                    again = conn.execute(call, ("t", key, n)).fetchone()
                assert row == ("claimed", 1), row
                assert again is not None and again[0] is None  # in flight: the caller's CLAIM
                names_now = [name for (name,) in conn.execute(prepared).fetchall()]
                assert names_now and all(where in name for name in names_now), names_now
                conn.execute("DISCARD ALL")
                assert conn.execute(prepared).fetchall() == []


#: keys and tenants that a statement built by quoting would get wrong: quotes, backslashes,
#: format() and parameter markers, SQL, a key of the longest length, non-ASCII tenants
NASTY = [
    ("t'1", "k');DROP_TABLE_x;--"),
    ("t\\2", "k\\x01\\\\"),
    ("%I%L%s", "%1$s%2$L"),
    ("$1", "$1$2"),
    ("tenant\u00e9\u00ff", "E'\\''"),
    ("", "k" * 255),
]


@pytest.mark.parametrize("entry", ["shard", "other"])
def test_hostile_keys_and_tenants_through_the_functions(
    citus: CitusCluster, node_app: Callable[..., Flask], entry: str
) -> None:
    """Tenants and keys are passed to the functions' prepared statements as quoted literals
    (%L): whatever they hold, each key is claimed once, stored as sent, replayed, and refused
    another body, entering at a node with the shard and at one without it."""
    names = table_names("h")
    table = names["IDEMPOTENCY_TABLE"]
    assert init(node_app(citus.url, **names)).exit_code == 0
    runs: Counter[str] = Counter()
    for tenant, key in NASTY:
        _, port = placement(citus.url, table, tenant)
        url = next(w.url for w in citus.workers if (w.port == port) == (entry == "shard"))
        app = counting_app(node_app, url, runs, **names)
        client = app.test_client()
        headers = {"Idempotency-Key": key, "X-Tenant": tenant}
        first = client.post("/pay", headers=headers, json={"a": 1})
        assert first.status_code == 201 and first.get_json() == {"paid": key}, first.get_json()
        again = client.post("/pay", headers=headers, json={"a": 1})
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
        other = client.post("/pay", headers=headers, json={"a": 2})
        assert other.status_code == 422, other.get_json()
        assert app.extensions["idempotency"].store.schema.citus_claim
    stored = query(citus.url, f"SELECT tenant, key, status FROM {table}")
    assert sorted(stored) == sorted((t, k, "completed") for t, k in NASTY)
    assert set(runs.values()) == {1} and len(runs) == len(NASTY)


@dataclasses.dataclass
class Learned:
    """A process at the node of *tenant*'s shard that has learned the shard: its first key
    went through the functions, the next two were sent to the shard's tables."""

    table: str
    shard: int
    port: int
    runs: Counter[str]
    client: FlaskClient
    store: PostgresStore


def learn_a_shard(
    citus: CitusCluster, node_app: Callable[..., Flask], prefix: str, tenant: str
) -> Learned:
    names = table_names(prefix)
    table = names["IDEMPOTENCY_TABLE"]
    assert init(node_app(citus.url, **names)).exit_code == 0
    shard, port = placement(citus.url, table, tenant)
    runs: Counter[str] = Counter()
    app = counting_app(
        node_app, next(w.url for w in citus.workers if w.port == port), runs, **names
    )
    client = app.test_client()
    store = app.extensions["idempotency"].store
    for n in range(3):
        sent = client.post("/pay", headers={"Idempotency-Key": f"k{n}", "X-Tenant": tenant})
        assert sent.status_code == 201, sent.get_json()
    assert store._shards.on_this_node(tenant) is not None
    return Learned(table, shard, port, runs, client, store)


def test_a_tenant_whose_shard_moved_and_was_dropped_goes_through_the_functions(
    citus: CitusCluster, node_app: Callable[..., Flask]
) -> None:
    """A process that entered at a shard's node sends that tenant's statements to the shard's
    tables itself (shard_hints). The shard moves away and its old table is dropped at once
    (``citus_cleanup_orphaned_resources``) while the process still takes it as there: its next
    claim finds no table, forgets the tenant and goes through the functions, which answer
    (a new key runs once, an earlier one replays)."""
    tenant = "gone"
    process = learn_a_shard(citus, node_app, "g", tenant)
    client, store, runs = process.client, process.store, process.runs
    shard, source = process.shard, process.port
    (target,) = [w.port for w in citus.workers if w.port != source]
    with psycopg.connect(citus.url, autocommit=True) as conn:
        conn.execute(
            "SELECT citus_move_shard_placement(%s, '127.0.0.1', %s, '127.0.0.1', %s,"
            " shard_transfer_mode => 'block_writes')",
            (shard, source, target),
        )
        conn.execute("CALL citus_cleanup_orphaned_resources()")
    fresh = client.post("/pay", headers={"Idempotency-Key": "fresh", "X-Tenant": tenant})
    assert fresh.status_code == 201 and "Idempotent-Replayed" not in fresh.headers
    assert store._shards.on_this_node(tenant) is None  # forgotten: the functions now
    replay = client.post("/pay", headers={"Idempotency-Key": "k1", "X-Tenant": tenant})
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert runs == Counter({"k0": 1, "k1": 1, "k2": 1, "fresh": 1})


def test_a_tenant_isolated_to_a_new_shard_goes_through_the_functions(
    citus: CitusCluster, node_app: Callable[..., Flask]
) -> None:
    """The tenant is isolated to a shard of its own (``isolate_tenant_to_new_shard``: the
    old shard split on the same node, its table left for the cleanup) while the process
    still sends its statements to the old shard's tables. The check they ask first
    (HERE_FUNCTION) finds the old shard no longer the tenant's, before asking Citus for the
    lock of a shard it no longer knows (an error, which made this a 500 when the check was
    left out): the process forgets the tenant and goes through the functions, which learn
    the new shard. A new key runs once and is on it; earlier ones replay."""
    tenant = "split"
    process = learn_a_shard(citus, node_app, "s", tenant)
    client, store, runs = process.client, process.store, process.runs
    table, shard, port = process.table, process.shard, process.port
    query(
        citus.url,
        "SELECT isolate_tenant_to_new_shard(%s, %s::text, 'CASCADE', 'block_writes')",
        table,
        tenant,
    )
    isolated, still = placement(citus.url, table, tenant)
    assert isolated != shard and still == port
    fresh = client.post("/pay", headers={"Idempotency-Key": "fresh", "X-Tenant": tenant})
    assert fresh.status_code == 201 and "Idempotent-Replayed" not in fresh.headers
    learned = store._shards.on_this_node(tenant)  # forgotten, and learned again
    assert learned is not None and learned[0].shard == isolated
    rows = query(citus.url, f"SELECT key, status FROM {table} WHERE tenant = %s", tenant)
    assert sorted(rows) == [
        ("fresh", "completed"),
        ("k0", "completed"),
        ("k1", "completed"),
        ("k2", "completed"),
    ]
    for n in range(3):
        replay = client.post("/pay", headers={"Idempotency-Key": f"k{n}", "X-Tenant": tenant})
        assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert runs == Counter({"k0": 1, "k1": 1, "k2": 1, "fresh": 1})
