"""SPEC §22 on a real Citus 14 cluster (a coordinator and two workers, built from
its source tarball: the ``citus`` fixture of tests/e2e/conftest.py): the schema.

- ``flask idempotency-init`` on the coordinator makes the keys, jobs and audit tables
  distributed by tenant, co-located with each other (a statement that writes a key and its
  jobs or its audit row stays on one shard), their primary keys holding the tenant, and the
  heartbeats a reference table; the workers see them (queries may enter at any node).
- ``IDEMPOTENCY_COLOCATE_WITH`` puts them in the co-location group of the app's table.
- An app connected to a worker never makes tables local to that worker (the issue's bug: a
  second keys table there): it says to run the init against the coordinator, and serves
  on the coordinator's tables once they exist.
- The online upgrade steps run on the distributed tables (an index built concurrently).

The request path, under gunicorn on the coordinator and on a worker at once (requests may
enter at any node): a claim, its replay byte for byte, 422 for another body, 409 in
progress with ``Retry-After``; twins sent through both nodes at once run the view once; a
``transactional=True`` view writing the app's co-located table commits on one node (no
two-phase commit); a worker killed (``kill -9``) mid-view: the retry runs the view again
(its owner lock, SPEC §20: tests/e2e/test_citus_owner.py); ``IDEMPOTENCY_WAIT`` polls. The
plans of the request path's statements show one task each. Then the background commands and
the console on the distributed tables: ``flask idempotency-complete`` (a fresh process) finishes a
``complete=True`` route's abandoned claim and an ``asynchronous=True`` key deferred through a
worker; a phase advanced inside a view commits its write, its recovery point and its jobs;
two ``flask idempotency-dispatch`` processes at once hand each staged job over once (a key's
ordered jobs in order, a failed hand-over kept), one tenant's jobs a transaction.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from email.utils import formatdate
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask, request

from flask_idempotency import Idempotency, current_idempotency
from flask_idempotency.store.statement import Statement
from flask_idempotency.testing.citus import CitusCluster
from flask_idempotency.testing.proxy import TcpProxy
from tests.apps.e2e_app import create_tables, environment
from tests.support.gunicorn_server import GunicornServer, Response, post, wait_until
from tests.support.helpers import OWNER_LOCK_HELD


def table_names(letter: str) -> dict[str, str]:
    """The extension's table settings, named with *letter* and a random suffix (the
    cluster is the session's, each test or module has tables of its own)."""
    prefix = f"{letter}{uuid.uuid4().hex[:8]}"
    return {
        "IDEMPOTENCY_TABLE": f"{prefix}_keys",
        "IDEMPOTENCY_JOBS_TABLE": f"{prefix}_jobs",
        "IDEMPOTENCY_AUDIT_TABLE": f"{prefix}_audit",
        "IDEMPOTENCY_HEARTBEATS_TABLE": f"{prefix}_heartbeats",
    }


@pytest.fixture
def names() -> dict[str, str]:
    """Table names of the test's own (the cluster is the session's)."""
    return table_names("c")


def init(app: Flask) -> Any:
    return app.test_cli_runner().invoke(args=["idempotency-init"])


def query(url: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(statement, params or None)
        return cursor.fetchall() if cursor.description else []


def owner_lock_nodes(citus: CitusCluster, owner_id: int) -> list[str]:
    """The nodes (URLs) on which a session holds the owner lock *owner_id*."""
    held = []
    for url in (citus.url, *citus.worker_urls):
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(OWNER_LOCK_HELD, (owner_id,)).fetchone()
        if row and row[0]:
            held.append(url)
    return held


def pay_app(node_app: Callable[..., Flask], url: str, **config: Any) -> Flask:
    """An app on the node at *url* with ``POST /pay`` (answers its key), the tenant from
    ``X-Tenant``."""
    app = node_app(url, **config)
    idempotency = app.extensions["idempotency"].extension
    idempotency.tenant_loader(lambda: request.headers.get("X-Tenant", ""))

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, str], int]:
        return {"paid": current_idempotency.key}, 201

    return app


def partitions(url: str, names: dict[str, str]) -> dict[str, tuple[str, int]]:
    """Each table's Citus partition method ('h': hash, 'n': reference) and co-location id."""
    rows = query(
        url,
        "SELECT logicalrelid::text, partmethod, colocationid FROM pg_dist_partition"
        " WHERE logicalrelid::text = ANY(%s)",
        list(names.values()),
    )
    return {name: (method, colocation) for name, method, colocation in rows}


def test_init_distributes_the_tables_by_tenant(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    result = init(node_app(citus.url, **names))
    assert result.exit_code == 0, result.output
    assert f"created table {names['IDEMPOTENCY_TABLE']}" in result.output

    keys, jobs, audit, heartbeats = names.values()
    found = partitions(citus.url, names)
    assert {name: method for name, (method, _) in found.items()} == {
        keys: "h",
        jobs: "h",
        audit: "h",
        heartbeats: "n",
    }
    assert found[keys][1] == found[jobs][1] == found[audit][1]  # co-located
    columns = query(
        citus.url,
        "SELECT logicalrelid::text, column_to_column_name(logicalrelid, partkey)"
        " FROM pg_dist_partition WHERE logicalrelid::text = ANY(%s) AND partmethod = 'h'",
        [keys, jobs, audit],
    )
    assert {column for _, column in columns} == {"tenant"}
    for table in (jobs, audit):  # a unique key on Citus holds the distribution column
        (key,) = query(
            citus.url,
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = %s::regclass AND contype = 'p'",
            table,
        )
        assert key == ("PRIMARY KEY (tenant, id)",)
    for worker in citus.worker_urls:  # the metadata reached every node
        assert partitions(worker, names) == found

    again = init(node_app(citus.url, **names))
    assert again.exit_code == 0, again.output
    assert "already exists" in again.output


def colocated_app(
    citus: CitusCluster,
    node_app: Callable[..., Flask],
    names: dict[str, str],
    tenant_type: str,
) -> Flask:
    """An app whose keys ``flask idempotency-init`` co-located with the app's own table,
    distributed by a tenant column of *tenant_type*; asserts the co-location."""
    accounts = f"{names['IDEMPOTENCY_TABLE']}_accounts"
    # 8 shards: another co-location group than Citus's default (32)
    query(citus.url, f"CREATE TABLE {accounts} (tenant {tenant_type} NOT NULL, balance integer)")
    query(citus.url, "SELECT create_distributed_table(%s, 'tenant', shard_count => 8)", accounts)
    app = node_app(citus.url, IDEMPOTENCY_COLOCATE_WITH=accounts, **names)
    result = init(app)
    assert result.exit_code == 0, result.output

    wanted = partitions(citus.url, {"accounts": accounts})[accounts][1]
    found = partitions(citus.url, names)
    assert [found[names[key]][1] for key in names if key != "IDEMPOTENCY_HEARTBEATS_TABLE"] == [
        wanted
    ] * 3
    return app


def test_colocated_with_the_apps_table(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    colocated_app(citus, node_app, names, "text")


def test_a_worker_makes_no_local_table(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    worker = citus.worker_urls[0]
    on_worker = node_app(worker, **names)
    idempotency = on_worker.extensions["idempotency"].extension

    @on_worker.post("/pay")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, int], int]:
        return {"paid": 1}, 201

    answer = on_worker.test_client().post("/pay", headers={"Idempotency-Key": "k1"})
    assert answer.status_code == 503  # the schema is not there: never served unprotected
    result = init(on_worker)
    assert result.exit_code == 1
    assert "Citus worker" in result.output and "coordinator" in result.output
    keys = names["IDEMPOTENCY_TABLE"]
    for url in (worker, citus.url):
        assert query(url, "SELECT to_regclass(%s)", keys) == [(None,)]

    assert init(node_app(citus.url, **names)).exit_code == 0
    served = node_app(worker, **names)  # the worker finds the coordinator's tables
    store = served.extensions["idempotency"].store
    with store.pool.connection() as conn:
        assert store.schema.present(conn)


def test_an_index_is_built_concurrently_on_the_distributed_table(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    app = node_app(citus.url, **names)
    assert init(app).exit_code == 0
    index = f"{names['IDEMPOTENCY_TABLE']}_pending_idx"
    query(citus.url, f"DROP INDEX {index}")

    result = init(app)
    assert result.exit_code == 0, result.output
    assert f"index {index}" in result.output
    keys = names["IDEMPOTENCY_TABLE"]
    (shell,) = query(citus.url, "SELECT count(*) FROM pg_index WHERE indrelid = %s::regclass", keys)
    on_shards = query(
        citus.url,
        "SELECT DISTINCT result FROM run_command_on_shards(%s,"
        " $$SELECT count(*) FROM pg_index WHERE indrelid = '%%s'::regclass$$)",
        keys,
    )
    assert on_shards == [(str(shell[0]),)]  # every shard has every index


# -- the request path under gunicorn, entering at the coordinator and at a worker ----------------


@dataclasses.dataclass
class Served:
    """The cluster's app under gunicorn twice: through the coordinator and through a worker."""

    citus: CitusCluster
    names: dict[str, str]
    payments: str
    coordinator: GunicornServer
    worker: GunicornServer
    #: the app's environment on the coordinator (for the background commands' processes)
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    def executions(self, key: str) -> list[tuple[int, int]]:
        """(attempt, pid) of each run of the view under *key*."""
        rows = query(
            self.citus.url,
            "SELECT attempt, pid FROM e2e_executions WHERE key = %s ORDER BY at",
            key,
        )
        return [(attempt, pid) for attempt, pid in rows]


#: the lease of the served apps: short, above the views' X-Delay
LEASE = 3


@pytest.fixture(scope="module")
def served(citus: CitusCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Keys co-located with the app's ``payments`` table; the app served by gunicorn on the
    coordinator and on a worker (two workers each), for the module; the worker's at
    ``IDEMPOTENCY_COMPATIBILITY = "1.1"`` (the common headers stored short), the
    coordinator's at the default."""
    names = table_names("s")
    payments = names["IDEMPOTENCY_TABLE"].removesuffix("_keys") + "_payments"
    query(citus.url, f"CREATE TABLE {payments} (tenant text NOT NULL, key text, amount integer)")
    query(citus.url, "SELECT create_distributed_table(%s, 'tenant')", payments)
    create_tables(citus.url)  # the executions and gates: local tables of the coordinator
    settings = {name.removeprefix("IDEMPOTENCY_").lower(): value for name, value in names.items()}
    # the completer reruns a stored request under its tenant: X-Tenant is stored with it
    settings.update(
        colocate_with=payments, lease=LEASE, stored_request_headers=["Content-Type", "X-Tenant"]
    )
    base = tmp_path_factory.mktemp("citus-gunicorn")
    servers: list[GunicornServer] = []
    envs: list[dict[str, str]] = []
    try:
        for n, url in enumerate((citus.url, citus.worker_urls[0])):
            compatibility = {"compatibility": "1.1"} if n == 1 else {}
            env = {
                **environment(url, citus.url, **settings, **compatibility),
                "CITUS_PAYMENTS_TABLE": payments,
            }
            envs.append(env)
            server = GunicornServer(
                "tests.apps.citus_app:create_app()",
                log_path=base / f"gunicorn-{n}.log",
                env=env,
                ready_path="/health",
                workers=2,
            )
            servers.append(server)
            if n == 0:  # the coordinator makes the tables (a worker makes none)
                app = Flask(__name__)
                app.config.update(IDEMPOTENCY_DATABASE_URL=url, **names)
                app.config["IDEMPOTENCY_COLOCATE_WITH"] = payments
                Idempotency(app)
                result = init(app)
                app.extensions["idempotency"].store.close()
                assert result.exit_code == 0, result.output
            server.start()
        yield Served(citus, names, payments, *servers, env=envs[0])
    finally:
        for server in servers:
            server.stop()


def test_claim_replay_mismatch_and_in_progress(served: Served) -> None:
    key = f"pay-{uuid.uuid4().hex}"
    first: list[Response] = []
    thread = threading.Thread(
        target=lambda: first.append(
            post(served.coordinator.port, "/pay", key, {"amount": 5}, headers={"X-Delay": "1"})
        )
    )
    thread.start()
    wait_until(lambda: served.executions(key), 10, "the view to start")
    # a duplicate while the first runs, entering at a worker: 409, with Retry-After
    busy = post(served.worker.port, "/pay", key, {"amount": 5})
    thread.join(30)
    assert busy.status == 409, busy.body
    assert busy.is_problem and busy.problem_type().endswith("request-in-progress")
    assert busy.headers["Retry-After"]

    (answer,) = first
    assert answer.status == 201 and not answer.replayed
    replay = post(served.worker.port, "/pay", key, {"amount": 5})
    assert replay.status == 201 and replay.replayed
    assert replay.body == answer.body  # byte for byte
    assert replay.stored_headers() == answer.stored_headers()

    reused = post(served.coordinator.port, "/pay", key, {"amount": 6})
    assert reused.status == 422 and reused.problem_type().endswith("key-reused")
    assert len(served.executions(key)) == 1


def test_short_headers_stored_through_a_worker_replay_through_the_coordinator(
    served: Served,
) -> None:
    """A key finished by the worker's app (``IDEMPOTENCY_COMPATIBILITY = "1.1"``) stores its
    JSON answer's headers as NULL on the shard; the coordinator's app (at the default)
    replays it with the same headers and body, and a key it finishes stores them in full.
    The transactional route (its payment and its answer committed together) answers the
    common JSON headers alone."""
    table = served.names["IDEMPOTENCY_TABLE"]
    stored = f"SELECT response_headers FROM {table} WHERE key = %s"
    paid = f"SELECT count(*) FROM {served.payments} WHERE key = %s"
    for writer, reader, headers in (
        (served.worker, served.coordinator, None),
        (served.coordinator, served.worker, [["Content-Type", "application/json"]]),
    ):
        key = f"short-{uuid.uuid4().hex}"
        answer = post(writer.port, "/transfer", key, {"amount": 7})
        assert answer.status == 201 and not answer.replayed, answer.body
        assert query(served.citus.url, stored, key) == [(headers,)]
        replay = post(reader.port, "/transfer", key, {"amount": 7})
        assert replay.status == 201 and replay.replayed
        assert replay.body == answer.body
        assert replay.stored_headers() == answer.stored_headers()
        assert query(served.citus.url, paid, key) == [(1,)]


def test_twins_through_the_coordinator_and_a_worker_run_once(served: Served) -> None:
    for _ in range(2):
        key = f"twin-{uuid.uuid4().hex}"
        ports = [served.coordinator.port, served.worker.port] * 2
        answers: list[Response | None] = [None] * len(ports)
        barrier = threading.Barrier(len(ports))

        def send(
            i: int, port: int, key: str, barrier: threading.Barrier, answers: list[Any]
        ) -> None:
            barrier.wait(10)
            answers[i] = post(port, "/pay", key, {"amount": 1}, headers={"X-Delay": "0.5"})

        threads = [
            threading.Thread(target=send, args=(i, p, key, barrier, answers))
            for i, p in enumerate(ports)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        statuses = sorted(
            (a.status, a.replayed) for a in answers if a is not None
        )  # one run; the others 409 or, once it finished, its replay
        assert len(statuses) == len(ports)
        assert statuses.count((201, False)) == 1, statuses
        assert {status for status, _ in statuses} <= {201, 409}
        assert len(served.executions(key)) == 1


def _two_phase_commits(citus: CitusCluster) -> int:
    """The two-phase commits every node has recorded (``pg_dist_transaction``: the
    coordinator of a distributed transaction records each prepared one), plus the prepared
    transactions still open on any node."""
    count = 0
    for url in (citus.url, *citus.worker_urls):
        count += query(url, "SELECT count(*) FROM pg_dist_transaction")[0][0]
        count += query(url, "SELECT count(*) FROM pg_prepared_xacts")[0][0]
    return count


def test_a_transactional_view_commits_on_one_node(served: Served) -> None:
    citus = served.citus
    before = _two_phase_commits(citus)
    keys = []
    for port, tenant in ((served.coordinator.port, "acme"), (served.worker.port, "globex")):
        key = f"transfer-{uuid.uuid4().hex}"
        keys.append(key)
        answer = post(port, "/transfer", key, {"amount": 7}, headers={"X-Tenant": tenant})
        assert answer.status == 201, answer.body
        replay = post(port, "/transfer", key, {"amount": 7}, headers={"X-Tenant": tenant})
        assert replay.replayed and replay.body == answer.body
    rows = query(
        citus.url,
        f"SELECT tenant, key, amount FROM {served.payments} WHERE key = ANY(%s) ORDER BY tenant",
        keys,
    )
    assert rows == [("acme", keys[0], 7), ("globex", keys[1], 7)]  # each once
    assert _two_phase_commits(citus) == before  # one node committed each

    # The probe sees a two-phase commit when there is one: a transaction writing tenants
    # on both workers.
    with psycopg.connect(citus.url) as conn:
        tenants = [f"probe-{n}" for n in range(16)]
        for tenant in tenants:
            conn.execute(f"INSERT INTO {served.payments} (tenant) VALUES (%s)", (tenant,))
    assert _two_phase_commits(citus) > before


def test_kill_9_mid_view_is_retried(served: Served) -> None:
    key = f"killed-{uuid.uuid4().hex}"
    gate = f"gate-{key}"
    first: list[BaseException | Response] = []

    def send() -> None:
        try:
            first.append(post(served.coordinator.port, "/pay", key, headers={"X-Gate": gate}))
        except OSError as exc:
            first.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    ((_, pid),) = wait_until(lambda: served.executions(key), 10, "the view to start")
    os.kill(pid, signal.SIGKILL)
    thread.join(30)
    assert isinstance(first[0], OSError) or first[0].status >= 500
    # the owner lock frees it (every node asked: tests/e2e/test_citus_owner.py), else the
    # lease would
    retried = wait_until(
        lambda: (r := post(served.worker.port, "/pay", key)).status != 409 and r,
        LEASE + 10,
        "the claim to be freed",
        step=0.2,
    )
    assert retried.status == 201 and not retried.replayed, retried.body
    assert retried.json()["attempt"] == 2
    assert [attempt for attempt, _ in served.executions(key)] == [1, 2]
    served.coordinator.wait_for_workers()


def test_a_waiting_duplicate_polls_for_the_replay(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    runs = []

    def app_on(url: str) -> Flask:
        app = node_app(url, IDEMPOTENCY_WAIT=10, **names)
        idempotency = app.extensions["idempotency"].extension
        idempotency.tenant_loader(lambda: "")

        @app.post("/slow")
        @idempotency.idempotent
        def slow() -> tuple[dict[str, int], int]:
            runs.append(1)
            time.sleep(1)
            return {"runs": len(runs)}, 201

        return app

    coordinator, worker = app_on(citus.url), app_on(citus.worker_urls[1])
    assert init(coordinator).exit_code == 0
    headers = {"Idempotency-Key": "waited"}
    first: list[Any] = []
    thread = threading.Thread(
        target=lambda: first.append(coordinator.test_client().post("/slow", headers=headers))
    )
    thread.start()
    wait_until(lambda: runs, 10, "the view to start")
    started = time.monotonic()
    waited = worker.test_client().post("/slow", headers=headers)
    thread.join(10)
    assert waited.status_code == 201 and waited.headers["Idempotent-Replayed"] == "true"
    assert waited.data == first[0].data
    # woken by its polls (the view takes 1 s), not at the end of its 10 s wait; the margin
    # is a loaded 2-core machine's
    assert time.monotonic() - started < 8
    assert runs == [1]


# -- the background commands as fresh processes, on the served app's tables ---------------------


def flask_command(served: Served, *args: str) -> subprocess.CompletedProcess[str]:
    """``flask --app tests.apps.citus_app:create_app() <args>`` in a process of its own,
    connected to the coordinator."""
    env = {**os.environ, **served.env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-m", "flask", "--app", "tests.apps.citus_app:create_app()"]
    return subprocess.run(
        [*command, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_completer_finishes_an_abandoned_claim_and_a_deferred_key(served: Served) -> None:
    citus = served.citus
    keys_table = served.names["IDEMPOTENCY_TABLE"]
    key, deferred_key = f"abandoned-{uuid.uuid4().hex}", f"deferred-{uuid.uuid4().hex}"
    gate = f"gate-{key}"
    query(citus.url, "INSERT INTO e2e_gates (name) VALUES (%s)", gate)
    acme, globex = {"X-Tenant": "acme"}, {"X-Tenant": "globex"}
    first: list[BaseException | Response] = []

    def send() -> None:
        try:
            first.append(
                post(served.coordinator.port, "/complete", key, headers={**acme, "X-Gate": gate})
            )
        except OSError as exc:
            first.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    ((_, pid),) = wait_until(lambda: served.executions(key), 10, "the view to start")
    os.kill(pid, signal.SIGKILL)  # its client gave up too: nobody retries this key
    thread.join(30)
    query(citus.url, "UPDATE e2e_gates SET open = true WHERE name = %s", gate)
    # asynchronous=True: handed to the background, entering at a worker
    accepted = post(served.worker.port, "/deferred", deferred_key, headers=globex)
    assert accepted.status == 202, accepted.body
    assert served.executions(deferred_key) == []
    # the claim's lease made a minute long: only its owner's death (every node asked) lets
    # the completer take it now
    ((owner_id,),) = query(
        citus.url,
        f"UPDATE {keys_table} SET locked_until = now() + interval '60 s' WHERE key = %s"
        " RETURNING owner_id",
        key,
    )
    assert owner_id is not None
    wait_until(lambda: not owner_lock_nodes(citus, owner_id), 10, "the owner lock to end")

    result = flask_command(served, "idempotency-complete", "--older-than", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [attempt for attempt, _ in served.executions(key)] == [1, 2], (
        result.stdout + result.stderr
    )
    left = query(citus.url, f"SELECT locked_until > now() FROM {keys_table} WHERE key = %s", key)
    assert left in ([(True,)], [(False,)])  # completed: its lease no longer read
    assert len(served.executions(deferred_key)) == 1
    replay = post(served.worker.port, "/complete", key, headers=acme)
    assert replay.status == 201 and replay.replayed and replay.json()["attempt"] == 2
    replay = post(served.coordinator.port, "/deferred", deferred_key, headers=globex)
    assert replay.status == 201 and replay.replayed, replay.body
    assert len(served.executions(deferred_key)) == 1
    served.coordinator.wait_for_workers()


def test_a_phase_and_its_jobs_dispatched_once_by_two_dispatchers(served: Served) -> None:
    citus = served.citus
    jobs_table = served.names["IDEMPOTENCY_JOBS_TABLE"]
    # a phase advanced inside the view, entering at a worker: its write, its recovery point
    # and its staged jobs commit together on the shard's node
    phased = {}
    for tenant in ("acme", "globex", "initech", "umbrella"):
        key = f"phased-{uuid.uuid4().hex}"
        answer = post(served.worker.port, "/phased", key, headers={"X-Tenant": tenant})
        assert answer.status == 201 and answer.json() == {"point": "charged"}, answer.body
        phased[tenant] = key
        assert (
            post(
                served.coordinator.port, "/pay", f"paid-{key}", headers={"X-Tenant": tenant}
            ).status
            == 201
        )
    rows = query(
        citus.url,
        f"SELECT k.tenant, k.recovery_point, p.amount FROM {served.names['IDEMPOTENCY_TABLE']} k"
        f" JOIN {served.payments} p USING (tenant, key) WHERE key = ANY(%s) ORDER BY 1",
        list(phased.values()),
    )
    assert rows == [(tenant, "charged", 1) for tenant in sorted(phased)]

    staged = query(citus.url, f"SELECT id::text, tenant, key, name, seq FROM {jobs_table}")
    assert len(staged) >= 4 * 4
    # two dispatchers at once, each in a process of its own: each job handed over once
    started = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flask",
                "--app",
                "tests.apps.citus_app:create_app()",
                "idempotency-dispatch",
                "--limit",
                "100",
            ],
            env={
                **os.environ,
                **served.env,
                "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for process in started:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, out + err

    handed = query(
        citus.url,
        "SELECT substr(key, 5), attempt FROM e2e_executions WHERE key = ANY(%s) ORDER BY at",
        [f"job:{job_id}" for job_id, *_ in staged],
    )
    order = [job_id for job_id, _ in handed]
    booms = {job_id for job_id, _, _, name, _ in staged if name == "boom"}
    assert sorted(order) == sorted(job_id for job_id, *_ in staged if job_id not in booms)
    for tenant, key in phased.items():  # a key's ordered jobs in their order
        steps = sorted((seq, job_id) for job_id, t, k, _, seq in staged if k == key and seq)
        assert [order.index(job_id) for _, job_id in steps] == sorted(
            order.index(job_id) for _, job_id in steps
        ), tenant
    left = query(citus.url, f"SELECT id::text, attempts, dead, last_error FROM {jobs_table}")
    assert {job_id for job_id, *_ in left} == booms  # the failed hand-overs are kept
    assert {(attempts, dead) for _, attempts, dead, _ in left} == {(1, False)}
    assert all("broker down" in error for *_, error in left)


def test_the_request_paths_plans_are_one_task(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    app = node_app(citus.url, **names)
    assert init(app).exit_code == 0
    state = app.extensions["idempotency"]
    store = state.store
    assert store.citus
    key = {"tenant": "acme", "key": "k1", "lock_id": 1}
    claim = {
        **key,
        "fingerprint": b"f",
        "lease": 60.0,
        "ttl": 3600.0,
        "on_abandoned": "retry",
        "request": None,
        "request_body": None,
        "owner": None,
        "owner_host": "h",
        "owner_pid": 1,
        "gone_owner": None,
        "tombstone_ttl": 30 * 24 * 3600.0,
        "stale": False,
    }
    fence = {**key, "attempt": 1, "generation": 1}
    response = {"response_status": 201, "response_headers": None, "response_body": b"{}"}
    finish = {**fence, "status": "completed", "ttl": 3600.0, **response}
    resolve = {**finish, "ttl": timedelta(hours=1), "attempt": None, "generation": None}
    statements = {
        "the claim function's call": (store._citus_call, claim),
        "first look (replay, a new key's lock)": (store._citus_first, claim),
        "first look, transactional": (store._citus_first_pinned, claim),
        "claim": (store._citus_claim, claim),
        "claim, transactional": (store._citus_claim_pinned, claim),
        "claim of a new key": (store._citus_claim_new, claim),
        "finish": (store._citus_finishes[False, False], finish),
        "finish, completed": (store._citus_finishes[True, False], finish),
        "release": (store._citus_forget, fence),
        "finished": (store._finished, fence),
        "key status": (store._key_status, key),
        "resolve": (state.operations._resolve_found, {**resolve, "looks": None}),
    }
    for name, (statement, params) in statements.items():
        explained = Statement("EXPLAIN (COSTS OFF) " + statement.named)
        plan = "\n".join(row[0] for row in store.fetch(explained, params, prepare=False).rows)
        assert "Task Count: 1\n" in plan + "\n", (name, plan)
        assert plan.count("Task Count") == 1 and "Subplan" not in plan, (name, plan)


# -- the background commands and the console on the distributed tables -------------------------


def test_cleaner_reconciler_cli_and_console_on_the_distributed_tables(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    app = node_app(citus.url, SECRET_KEY="test", PROPAGATE_EXCEPTIONS=False, **names)
    idempotency = app.extensions["idempotency"].extension
    idempotency.tenant_loader(lambda: request.headers.get("X-Tenant", ""))
    idempotency.init_console(app)
    idempotency.console_access(lambda: ("all", "ann"))
    failing = {"complete": True}

    @app.post("/complete")
    @idempotency.idempotent(complete=True, on_exception="release")
    def complete() -> tuple[dict[str, str], int]:
        if failing.pop("complete", False):
            raise RuntimeError("the first try fails")
        return {"completed": current_idempotency.key}, 201

    @app.post("/unknown")
    @idempotency.idempotent(on_exception="unknown")
    def unknown() -> Any:
        raise RuntimeError("the provider did not answer")

    @app.post("/staged")
    @idempotency.idempotent
    def staged() -> tuple[dict[str, bool], int]:
        current_idempotency.stage("receipt", {"key": current_idempotency.key})
        return {"staged": True}, 201

    @idempotency.reconciler
    def reconcile(key: Any) -> tuple[dict[str, str], int]:
        return {"settled": key.key}, 201

    assert init(app).exit_code == 0
    client, cli = app.test_client(), app.test_cli_runner()
    keys_table = names["IDEMPOTENCY_TABLE"]

    def send(path: str, key: str, tenant: str) -> Any:
        return client.post(path, headers={"Idempotency-Key": key, "X-Tenant": tenant})

    def status(tenant: str, key: str) -> list[tuple[Any, ...]]:
        return query(
            citus.url,
            f"SELECT status FROM {keys_table} WHERE tenant = %s AND key = %s",
            tenant,
            key,
        )

    # a job staged with the finish (dispatched: test_a_phase_and_its_jobs_dispatched_once…)
    assert send("/staged", "s1", "acme").status_code == 201
    jobs = query(citus.url, f"SELECT tenant, key, name FROM {names['IDEMPOTENCY_JOBS_TABLE']}")
    assert jobs == [("acme", "s1", "receipt")]

    # a retryable key of a complete=True route (left to the operators' CLI and the console
    # below; the completer's takeover: test_the_completer_finishes_an_abandoned_claim…)
    assert send("/complete", "c1", "globex").status_code == 500
    assert status("globex", "c1") == [("retryable",)]

    # the reconciler: an unknown key settled by @reconciler
    assert send("/unknown", "u1", "initech").status_code == 500
    assert status("initech", "u1") == [("unknown",)]
    result = cli.invoke(args=["idempotency-reconcile"])
    assert result.exit_code == 0, result.output
    replay = send("/unknown", "u1", "initech")
    assert replay.status_code == 201 and replay.json == {"settled": "u1"}

    # the cleaner: an expired key deleted, an abandoned claim settled
    query(
        citus.url, f"UPDATE {keys_table} SET expires_at = now() - interval '1 s' WHERE key = 's1'"
    )
    # past its expiry, before the cleaner: its row answers key-expired (SPEC §24)
    before = send("/staged", "s1", "acme")
    assert before.status_code == 409 and before.json["type"].endswith("key-expired")
    result = cli.invoke(args=["idempotency-clean"])
    assert result.exit_code == 0, result.output
    assert "left 1 tombstones" in result.output, result.output
    assert status("acme", "s1") == []
    # its tombstone, on the key's shard, answers for it (SPEC §24): never run again
    tombstones = names["IDEMPOTENCY_TABLE"] + "_tombstones"
    assert query(citus.url, f"SELECT key, first_status FROM {tombstones}") == [("s1", 201)]
    expired = send("/staged", "s1", "acme")
    assert expired.status_code == 409 and expired.json["first_status"] == 201, expired.json
    assert expired.json["type"].endswith("key-expired")
    other = client.post(
        "/staged", data=b"{}", headers={"Idempotency-Key": "s1", "X-Tenant": "acme"}
    )
    assert other.status_code == 422, other.json
    assert query(citus.url, f"SELECT count(*) FROM {names['IDEMPOTENCY_JOBS_TABLE']}") == [(1,)]

    # the operators' CLI and the console: pages, and a change with its audit row
    result = cli.invoke(args=["idempotency-list", "--tenant", "globex"])
    assert result.exit_code == 0 and "c1" in result.output, result.output
    result = cli.invoke(args=["idempotency-forget", "c1", "--tenant", "globex", "--actor", "ann"])
    assert result.exit_code == 0, result.output
    assert status("globex", "c1") == []
    audit = query(citus.url, f"SELECT actor, action, key FROM {names['IDEMPOTENCY_AUDIT_TABLE']}")
    assert audit == [("ann", "forget", "c1")]
    # an expired key's tombstone forgotten (SPEC §24), audited: the key may be used afresh
    result = cli.invoke(args=["idempotency-forget", "s1", "--tenant", "acme", "--actor", "ann"])
    assert result.exit_code == 0, result.output
    assert query(citus.url, f"SELECT count(*) FROM {tombstones}") == [(0,)]
    audit = query(
        citus.url,
        f"SELECT action, key, status_before FROM {names['IDEMPOTENCY_AUDIT_TABLE']}"
        " WHERE key = 's1'",
    )
    assert audit == [("forget", "s1", "expired")]
    assert send("/staged", "s1", "acme").status_code == 201
    for page in ("/", "/keys", "/key?tenant=initech&key=u1", "/jobs", "/audit"):
        answer = client.get("/idempotency/console" + page)
        assert answer.status_code == 200, (page, answer.get_data(as_text=True)[:2000])
    assert "u1" in client.get("/idempotency/console/keys").get_data(as_text=True)


def test_colocated_with_a_varchar_tenant_column(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    """Flask-SQLAlchemy's ``Mapped[str]`` makes ``character varying``: the extension's
    tenant columns take that type, so Citus co-locates them, and a key is claimed, replayed
    and refused with another body, each as one task on the shard's node."""
    app = colocated_app(citus, node_app, names, "varchar(64)")
    idempotency = app.extensions["idempotency"].extension
    idempotency.tenant_loader(lambda: "acme")

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, str], int]:
        return {"paid": str(uuid.uuid4())}, 201

    client = app.test_client()
    first = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "v1"})
    again = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "v1"})
    other = client.post("/pay", json={"a": 2}, headers={"Idempotency-Key": "v1"})
    assert first.status_code == 201 and again.get_data() == first.get_data()
    assert again.headers["Idempotent-Replayed"] == "true" and other.status_code == 422
    store = app.extensions["idempotency"].store
    assert store.schema.citus_claim  # the delegated claim, its tenant argument varchar(64)
    params = {"tenant": "acme", "key": "v1"}
    explained = Statement("EXPLAIN (COSTS OFF) " + store._key_status.named)
    plan = "\n".join(row[0] for row in store.fetch(explained, params, prepare=False).rows)
    assert "Task Count: 1\n" in plan + "\n", plan


def test_colocation_with_a_table_distributed_by_a_number_is_refused_before_anything_is_made(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    accounts = f"{names['IDEMPOTENCY_TABLE']}_accounts"
    query(citus.url, f"CREATE TABLE {accounts} (tenant_id bigint NOT NULL, balance integer)")
    query(citus.url, "SELECT create_distributed_table(%s, 'tenant_id')", accounts)
    app = node_app(citus.url, IDEMPOTENCY_COLOCATE_WITH=accounts, **names)
    result = init(app)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "tenant_id is bigint" in lines[0], result.output
    made = query(
        citus.url,
        "SELECT count(*) FROM pg_class WHERE relname = ANY(%s)",
        [name.rpartition(".")[2] for name in names.values()],
    )
    assert made == [(0,)]


@pytest.mark.parametrize(
    "name",
    ["no_such_table", 'x"; DROP TABLE y; --', "a\u00e9\x7f" * 3],
    ids=["missing", "sql", "bytes"],
)
def test_colocation_with_no_distributed_table_is_refused_in_one_line(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str], name: str
) -> None:
    app = node_app(citus.url, IDEMPOTENCY_COLOCATE_WITH=name, **names)
    result = init(app)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "no such distributed table" in lines[0], result.output


def test_a_new_key_takes_two_round_trips_and_a_replay_one(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    """Counted on the wire (a proxy in front of the coordinator), what cannot vary: a new
    key is the claim function's call (the first look and the new row, on the shard's node)
    and the finish; a replay is the call alone (the claim with its data-modifying CTEs is
    sent for neither)."""
    with TcpProxy.to_database(citus.url) as proxy:
        # the owner lock's own connection (its checks every 5 s) not through the proxy
        app = pay_app(
            node_app,
            proxy.url(citus.url),
            IDEMPOTENCY_POOL_MAX_SIZE=1,
            IDEMPOTENCY_OWNER_DATABASE_URL=citus.url,
            **names,
        )
        assert init(app).exit_code == 0
        client = app.test_client()

        def trips(keys: list[str]) -> float:
            before = proxy.round_trips
            for n, key in enumerate(keys):
                answer = client.post(
                    "/pay", headers={"Idempotency-Key": key, "X-Tenant": f"t{n % 7}"}
                )
                assert answer.status_code == 201, answer.get_data(as_text=True)
            return (proxy.round_trips - before) / len(keys)

        run = uuid.uuid4().hex
        trips([f"{run}-warm-{n}" for n in range(14)])  # connections made, statements prepared
        assert app.extensions["idempotency"].store.schema.citus_claim  # made by init
        assert trips([f"{run}-{n}" for n in range(14)]) == 2
        assert trips([f"{run}-{n}" for n in range(14)]) == 1  # the same keys: replays


#: the CHECK on status of the keys tables of releases up to 1.0.0
OLD_CHECK = "status IN ('processing', 'completed', 'retryable', 'unknown')"


def status_checks(citus: CitusCluster, table: str) -> list[int]:
    """On each node (the coordinator first), the CHECK constraints of the keys table (a
    worker's shell of it) or of its shards there."""
    counted = []
    for url in (citus.url, *citus.worker_urls):
        ((count,),) = query(
            url,
            "SELECT count(*) FROM pg_constraint WHERE contype = 'c'"
            " AND conrelid::regclass::text ~ %s",
            f"^{table}(_[0-9]+)?$",
        )
        counted.append(int(count))
    return counted


def test_the_claim_function_comes_with_the_upgrade(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    """A populated table of a release before the claim function (made now, the function
    dropped): a process serves it with the plain statements; ``flask idempotency-init``
    adds the function (delegated: one task), and a process started after it claims through
    it, the earlier keys replayed (SPEC §16); it drops the earlier release's CHECK on status,
    on the distributed table and on every shard."""

    def app_on(url: str) -> Flask:
        return pay_app(node_app, url, **names)

    table = names["IDEMPOTENCY_TABLE"]
    first = app_on(citus.url)
    assert init(first).exit_code == 0
    for made in ("_claim_v3", "_complete_v3"):  # as a release before them left the table
        query(citus.url, f"DROP FUNCTION {table}{made}")
    query(citus.url, f"ALTER TABLE {table} ADD CONSTRAINT {table}_status_check CHECK ({OLD_CHECK})")
    shards = query(
        citus.url, "SELECT count(*) FROM citus_shards WHERE table_name = %s::regclass", table
    )
    before = status_checks(citus, table)
    # the table on every node (the workers' shells of it) and every shard
    assert before[0] == 1 and sum(before) == len(before) + shards[0][0], before
    old = app_on(citus.worker_urls[0])
    client = old.test_client()
    for n in range(200):
        sent = client.post("/pay", headers={"Idempotency-Key": f"k{n}", "X-Tenant": f"t{n % 9}"})
        assert sent.status_code == 201, sent.get_data(as_text=True)
    assert not old.extensions["idempotency"].store.schema.citus_claim  # the statements

    result = init(first)
    assert result.exit_code == 0, result.output
    assert "claim function on Citus" in result.output, result.output
    assert "no CHECK on status" in result.output, result.output
    assert status_checks(citus, table) == [0, 0, 0]
    new = app_on(citus.worker_urls[1])
    client = new.test_client()
    fresh = client.post("/pay", headers={"Idempotency-Key": "fresh", "X-Tenant": "t1"})
    assert fresh.status_code == 201 and "Idempotent-Replayed" not in fresh.headers
    assert new.extensions["idempotency"].store.schema.citus_claim  # the function
    for n in range(0, 200, 37):
        replay = client.post("/pay", headers={"Idempotency-Key": f"k{n}", "X-Tenant": f"t{n % 9}"})
        assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
        assert replay.get_json() == {"paid": f"k{n}"}
    # and the process that served before it goes on with its statements, beside it
    again = old.test_client().post("/pay", headers={"Idempotency-Key": "k3", "X-Tenant": "t3"})
    assert again.headers["Idempotent-Replayed"] == "true"


def test_a_stale_first_sent_request_is_expired_never_claimed(
    citus: CitusCluster, node_app: Callable[..., Flask], names: dict[str, str]
) -> None:
    """``Repeatability-First-Sent`` on Citus (SPEC §24), through the delegated claim and a
    worker: a key with neither row nor tombstone whose client first sent it longer ago than
    its TTL is answered 409 key-expired and never inserted; a recent one is claimed."""
    app = pay_app(node_app, citus.worker_urls[0], **names)
    assert init(node_app(citus.url, **names)).exit_code == 0
    client = app.test_client()
    old = formatdate(time.time() - 3 * 24 * 3600, usegmt=True)  # past the 24 h TTL
    stale = client.post(
        "/pay",
        headers={"Idempotency-Key": "stale", "X-Tenant": "t", "Repeatability-First-Sent": old},
    )
    assert stale.status_code == 409 and stale.json["type"].endswith("key-expired"), stale.json
    assert stale.json["operation_state"] == "unknown"
    table = names["IDEMPOTENCY_TABLE"]
    assert query(citus.url, f"SELECT count(*) FROM {table} WHERE key = 'stale'") == [(0,)]
    recent = formatdate(time.time() - 60, usegmt=True)
    fresh = client.post(
        "/pay",
        headers={"Idempotency-Key": "fresh", "X-Tenant": "t", "Repeatability-First-Sent": recent},
    )
    assert fresh.status_code == 201, fresh.json
    assert app.extensions["idempotency"].store.schema.citus_claim  # through the function
