"""Two releases serve one table at once, in both directions (SPEC §16 "Two releases side by
side"), with real processes: a previous release taken from git and this one, each under its own
gunicorn, on one PostgreSQL table of 100 000 keys made in the previous release's layout.

A deploy is never atomic: for minutes, old and new workers answer the same clients, and a
client's retry lands on whichever release the load balancer picks. What must hold throughout,
whichever release starts beside the other (an upgrade, or a rollback):

- no 5xx (schema work never blocks or fails serving), no answer other than the view's own;
- no key runs twice (the ``executions`` table the app writes before answering says so);
- a retry that crosses releases replays the first answer, byte for byte;
- a key either release marks ``unknown`` is seen by the new release (``flask idempotency-list``,
  the ``idempotency_stuck_keys`` gauge) and reconciled by its ``flask idempotency-reconcile``;
- no process start undoes the other release's DDL (retired indexes go only by an explicit
  ``flask idempotency-init``).

Contract violations are gathered (:class:`Findings`) and reported together at the end, so one
run tells everything that is wrong; the harness's own steps (the releases taken from git, the
code each server imports, the traffic reaching both, the executions recorded) are asserted as
they happen, so a failure is the product's, not the test's.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import TupleRow

import flask_idempotency
from flask_idempotency.testing.database import scratch_database
from tests.apps.release_app import create_tables
from tests.support.gunicorn_server import ROOT, GunicornServer, Response, post, wait_until
from tests.support.releases import extract

DB = psycopg.Connection[TupleRow]
APP = "tests.apps.release_app:create_app()"
CLI_APP = "tests.apps.release_app:create_app"
TABLE = "idempotency_keys"


@dataclass(frozen=True)
class OldRelease:
    """A previous release, and what it writes that a test must write the same way."""

    commit: str
    #: ``reconcile_due_at`` of a key this release marks ``unknown`` (f804229 left it NULL:
    #: "due now"; later releases set it)
    unknown_due_at: str


RELEASES = [
    OldRelease("f804229", "NULL"),
    OldRelease("9c9ab3e", "now()"),
    # the last release without owners (SPEC §20): its claims and takeovers leave the owner
    # columns as they were
    OldRelease("fe789f9", "now()"),
    # the last release with expiry_idx and created_idx on plain PostgreSQL (issue 48): while
    # it serves, its cleaner, sweeps and console read them; the new one builds ttl_created_idx
    OldRelease("5cf0171", "now()"),
    # 1.0.0: the last release with the CHECK on status, which the new one drops
    OldRelease("5c77fea", "now()"),
]

#: keys put in the old release's table by SQL, before any process serves it
BULK_KEYS = 100_000
#: one bulk key in so many is ``unknown`` (as the old release marks them)
BULK_UNKNOWN_EVERY = 2_000
#: the tenant of the keys made ``unknown`` by a killed worker
UNKNOWN_TENANT = "u"
#: traffic: client threads, and the most requests one of them sends (a bound, never reached)
CLIENTS = 3
MAX_REQUESTS = 4_000
#: the share of requests that are retries of a key already answered
RETRY_SHARE = 0.4
#: each scenario waits until this many retries have crossed releases each way
CROSSINGS = 20
CROSSED = f"{CROSSINGS} retries crossing releases each way"
#: how long a phase may take before the test says what it was waiting for (a few phases
#: fit in pytest's timeout of the test)
PHASE_TIMEOUT = 20.0
#: ... once one of them timed out
STUCK_TIMEOUT = 5.0

BULK = """
INSERT INTO {table} (tenant, key, fingerprint, status, attempt, generation, locked_until,
    response_status, response_headers, response_body, created_at, updated_at, expires_at,
    reconcile_due_at)
SELECT 'bulk' || (i % 10), 'bulk-' || i, sha256(('bulk-' || i)::bytea),
       CASE WHEN i % {unknown_every} = 0 THEN 'unknown'
            WHEN i % 50 = 7 THEN 'retryable' ELSE 'completed' END,
       1, 1000000 + i, NULL,
       CASE WHEN i % {unknown_every} = 0 THEN NULL ELSE 201 END,
       CASE WHEN i % {unknown_every} = 0 THEN NULL
            ELSE '[["Content-Type", "application/json"]]'::jsonb END,
       CASE WHEN i % {unknown_every} = 0 THEN NULL
            ELSE convert_to('{{"id": "' || i || '"}}', 'UTF8') END,
       now() - make_interval(secs => i * 0.8), now() - make_interval(secs => i * 0.8),
       now() + interval '1 day' - make_interval(secs => i * 0.8),
       CASE WHEN i % {unknown_every} = 0 THEN ({unknown_due_at})::timestamptz END
FROM generate_series(1, {rows}) AS i
"""


# -- the code of each release ---------------------------------------------------------------


@dataclass(frozen=True)
class Code:
    """One release's code: where ``import flask_idempotency`` finds it, for a server or a
    command started as its own process."""

    label: str  #: "old" or "new", recorded with every execution
    python_path: tuple[Path, ...]
    #: the processes' working directory: Python puts it before PYTHONPATH (``-m``)
    cwd: Path
    #: the ``flask_idempotency/__init__.py`` a process of this release must import
    init_file: Path

    def env(self, store_url: str, **settings: str) -> dict[str, str]:
        """The environment of a server or command of this release on the store."""
        env = {
            "PYTHONPATH": os.pathsep.join(map(str, self.python_path)),
            "PYTHONUNBUFFERED": "1",
            "RELEASE_NAME": self.label,
            "RELEASE_EXECUTIONS_URL": store_url,
            "FLASK_IDEMPOTENCY_DATABASE_URL": store_url,
        }
        env.update({f"FLASK_IDEMPOTENCY_{name.upper()}": value for name, value in settings.items()})
        return env

    def flask(self, env: dict[str, str], *args: str, timeout: float = 120) -> str:
        """``flask --app tests.apps.release_app:create_app ARGS`` as a fresh process of this
        release; its output (stdout and stderr). Fails the test on a non-zero exit."""
        done = self.flask_run(env, *args, timeout=timeout)
        assert done.returncode == 0, f"{self.label}: flask {' '.join(args)}:\n{done.stdout}"
        return done.stdout

    def check_imports(self) -> None:
        """Assert that a process started as this release's commands are started imports this
        release's code (the working directory and PYTHONPATH decide it, nothing else)."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "RELEASE_"))}
        done = subprocess.run(
            [sys.executable, "-c", "import flask_idempotency; print(flask_idempotency.__file__)"],
            cwd=self.cwd,
            env={**base, **self.env("")},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        imported = Path(done.stdout.strip()).resolve()
        assert imported == self.init_file, f"the {self.label} release's commands import {imported}"

    def flask_run(
        self, env: dict[str, str], *args: str, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        process = self.flask_start(env, *args)
        output, _ = process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(process.args, process.returncode, output)

    def flask_start(self, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
        """The command started (its output in ``communicate()``): one that can run while the
        test goes on."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "RELEASE_"))}
        return subprocess.Popen(
            [sys.executable, "-m", "flask", "--app", CLI_APP, *args],
            cwd=self.cwd,
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


@pytest.fixture
def list_unknown() -> Iterator[Callable[[Code, str], subprocess.Popen[str]]]:
    """``list_unknown(code, store)``: ``flask idempotency-list --status unknown`` of *code*,
    started (to run while the test goes on); one still running at teardown is killed."""
    started: list[subprocess.Popen[str]] = []

    def start(code: Code, store: str) -> subprocess.Popen[str]:
        args = ("idempotency-list", "--status", "unknown", "--limit", "10000")
        started.append(code.flask_start(code.env(store), *args))
        return started[-1]

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


def new_code() -> Code:
    """This release: the code the test process imports (the checkout, or in CI the wheel)."""
    init_file = Path(flask_idempotency.__file__ or "").resolve()
    return Code("new", (ROOT,), ROOT, init_file)


@pytest.fixture(scope="session")
def old_code(tmp_path_factory: pytest.TempPathFactory) -> Callable[[OldRelease], Code]:
    """``old_code(release)``: the release's ``flask_idempotency/`` taken from git (once per
    session), as a :class:`Code` that imports it."""
    taken: dict[str, Code] = {}

    def take(release: OldRelease) -> Code:
        if release.commit not in taken:
            root = extract(release.commit, tmp_path_factory.mktemp(f"release-{release.commit}"))
            init_file = (root / "flask_idempotency" / "__init__.py").resolve()
            code = taken[release.commit] = Code("old", (root, ROOT), root, init_file)
            code.check_imports()
        return taken[release.commit]

    return take


@pytest.fixture(scope="session")
def new_layout(database_url: str) -> Layout:
    """The indexes and columns this release gives a table it creates, read from a table it
    created (``flask idempotency-init`` in a scratch database), not from its source: what the
    upgrade of an old table must reach."""
    new_code().check_imports()
    with scratch_database(database_url, "releases_") as (url, _):
        new_code().flask(new_code().env(url), "idempotency-init")
        with psycopg.connect(url, autocommit=True) as conn:
            made = layout(conn)
    assert made.tables == frozenset(COMPANIONS), made.tables  # the upgrade must reach them
    assert made.checks == frozenset(), made.checks
    return made


@pytest.fixture(scope="session")
def old_tables(
    database_url: str, old_code: Callable[[OldRelease], Code]
) -> Iterator[Callable[[OldRelease], tuple[str, Layout]]]:
    """``old_tables(release)``: a database (the name) holding the table as *release* made it,
    filled (:func:`prepare_old_table`), and its layout; made once per session, and copied by
    each test (``CREATE DATABASE ... TEMPLATE``: far cheaper than making it again)."""
    made: dict[str, tuple[str, Layout]] = {}
    with ExitStack() as stack:

        def make(release: OldRelease) -> tuple[str, Layout]:
            if release.commit not in made:
                url, name = stack.enter_context(scratch_database(database_url, "releases_"))
                with psycopg.connect(url, autocommit=True) as db:
                    old_layout = prepare_old_table(db, url, old_code(release), release)
                made[release.commit] = (name, old_layout)
            return made[release.commit]

        yield make


@pytest.fixture
def store(
    database_url: str,
    release: OldRelease,
    old_tables: Callable[[OldRelease], tuple[str, Layout]],
) -> Iterator[tuple[str, Layout]]:
    """The URL of a fresh database for one test, holding the table as *release* made it
    (with BULK_KEYS keys), and that table's layout."""
    template, old_layout = old_tables(release)
    with scratch_database(database_url, "releases_", template) as (url, _):
        yield url, old_layout


# -- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The keys table's valid indexes, its columns and its CHECK constraints (as PostgreSQL
    shows them), and which of its companion tables (:data:`COMPANIONS`) exist."""

    indexes: frozenset[str]
    columns: frozenset[str]
    tables: frozenset[str] = frozenset()
    checks: frozenset[str] = frozenset()


#: the tables beside the keys table that a release may add (SPEC §24: the tombstones)
COMPANIONS = (f"{TABLE}_tombstones",)


def layout(db: DB) -> Layout:
    indexes = db.execute(
        "SELECT c.relname FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid"
        " WHERE i.indrelid = to_regclass(%s) AND i.indisvalid",
        (TABLE,),
    ).fetchall()
    columns = db.execute(
        "SELECT attname FROM pg_attribute"
        " WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
        (TABLE,),
    ).fetchall()
    tables = db.execute(
        "SELECT name FROM unnest(%s::text[]) AS name WHERE to_regclass(name) IS NOT NULL",
        (list(COMPANIONS),),
    ).fetchall()
    checks = db.execute(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
        " WHERE conrelid = to_regclass(%s) AND contype = 'c'",
        (TABLE,),
    ).fetchall()
    return Layout(
        frozenset(r[0] for r in indexes),
        frozenset(r[0] for r in columns),
        frozenset(r[0] for r in tables),
        frozenset(r[0] for r in checks),
    )


def prepare_old_table(db: DB, store: str, old: Code, release: OldRelease) -> Layout:
    """The table as the old release makes it (its own ``flask idempotency-init``), filled with
    BULK_KEYS keys in its column layout; the executions tables. The old layout."""
    output = old.flask(old.env(store), "idempotency-init")
    assert f"created table {TABLE}" in output, output
    made = layout(db)
    if release.commit == "f804229":  # its layout: indexes on columns the finish changes
        suffixes = ("expires_idx", "lease_idx", "unknown_idx", "complete_idx")
        assert {f"{TABLE}_{suffix}" for suffix in suffixes} <= made.indexes, made
    fill = sql.SQL(BULK).format(
        table=sql.Identifier(TABLE),
        rows=sql.Literal(BULK_KEYS),
        unknown_every=sql.Literal(BULK_UNKNOWN_EVERY),
        unknown_due_at=sql.SQL(release.unknown_due_at),
    )
    db.execute(fill)
    db.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(TABLE)))
    create_tables(store)
    return made


def bulk_unknown() -> set[tuple[str, str]]:
    """The bulk keys that are ``unknown`` (as the BULK statement makes them)."""
    return {
        (f"bulk{i % 10}", f"bulk-{i}")
        for i in range(BULK_UNKNOWN_EVERY, BULK_KEYS + 1, BULK_UNKNOWN_EVERY)
    }


# -- findings ---------------------------------------------------------------------------------


@dataclass
class Findings:
    """Violations of the contract, gathered so that one run reports all of them, and the
    run's timeline (seconds since the test began, step), printed with them."""

    items: list[str] = field(default_factory=list)
    timeline: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    timed_out: bool = False

    def add(self, message: str) -> None:
        self.items.append(message)

    def step(self, what: str) -> None:
        self.timeline.append(f"{time.monotonic() - self.started:.1f} s {what}")

    def wait(self, condition: Callable[[], Any], timeout: float, what: str) -> bool:
        """Wait (bounded) for a condition the product must reach; a finding if it does not.
        Once a wait timed out, the next ones are short: the product is stuck, and the test
        only goes on to find out what else is wrong, within pytest's timeout."""
        self.step(f"waiting for {what}")
        if self.timed_out:
            timeout = min(timeout, STUCK_TIMEOUT)
        try:
            wait_until(condition, timeout, what, step=0.05)
        except AssertionError as exc:
            self.timed_out = True
            self.add(str(exc))
            return False
        return True

    def check(self, traffic: Traffic, marked: Collection[str] = ()) -> None:
        self.step("checked")
        # what the run did, for -rA and for a failure's report
        print(
            f"{len(traffic.answers)} answers: {summary(traffic.answers)};"
            f" retries old->new {traffic.crossed('old', 'new')},"
            f" new->old {traffic.crossed('new', 'old')}; made unknown: {sorted(marked)}"
        )
        assert not self.items, "\n".join(f"- {item}" for item in self.items)


@pytest.fixture
def findings() -> Iterator[Findings]:
    """The test's findings; its timeline is printed at teardown (shown with a failure, also
    one that stopped the test before its end)."""
    found = Findings()
    yield found
    print("\n".join(["timeline:", *found.timeline, "findings:", *found.items]))


# -- serving ----------------------------------------------------------------------------------


@dataclass
class Serving:
    """One release under its own gunicorn."""

    code: Code
    server: GunicornServer

    @property
    def label(self) -> str:
        return self.code.label

    @property
    def port(self) -> int:
        return self.server.port


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def serve(
    start_gunicorn: Callable[..., GunicornServer],
    code: Code,
    store: str,
    findings: Findings,
    workers: int,
    **settings: str,
) -> Serving:
    """Start *code* under gunicorn on the store, and check that it imports that code."""
    findings.step(f"starting the {code.label} release")
    # --preload: the workers fork from a master that imported the app (no connection is
    # opened before the fork): they start, and a killed one comes back, without importing
    # everything again on a machine that the test already keeps busy
    server = start_gunicorn(
        APP,
        env=code.env(store, **settings),
        workers=workers,
        preload=True,
        ready_path="/health",
        cwd=code.cwd,
    )
    status, body = get(server.port, "/release")
    assert status == 200, body
    imported = Path(json.loads(body)["file"]).resolve()
    assert imported == code.init_file, f"the {code.label} server imports {imported}"
    findings.step(f"the {code.label} release serves")
    return Serving(code, server)


def stop(*servers: Serving) -> None:
    """Stop the servers together (each takes a moment to let its workers go)."""
    threads = [threading.Thread(target=s.server.stop) for s in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


# -- traffic ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One request of the traffic and what came back (status 0: no answer, see *kind*)."""

    tenant: str
    key: str
    release: str  #: the release that answered
    status: int
    body: bytes
    replayed: bool
    kind: str  #: the problem type's last part, or the error, or ""
    retry_of: str | None  #: for a retry: the release that gave the first answer


@dataclass(frozen=True)
class Sent:
    """A key answered fresh: what its retries send."""

    tenant: str
    key: str
    amount: int
    release: str


def problem_kind(status: int, headers: http.client.HTTPMessage, body: bytes) -> str:
    if not (headers.get("Content-Type") or "").startswith("application/problem+json"):
        return "" if status < 400 else body[:120].decode(errors="replace")
    try:
        return str(json.loads(body)["type"]).rsplit(":", 1)[-1].rsplit("/", 1)[-1]
    except (ValueError, KeyError):
        return body[:120].decode(errors="replace")


class Traffic:
    """Client threads sending new keys and retries of answered keys to every release that
    serves; a retry goes to another release than the one that answered first whenever two
    serve. Every answer is kept."""

    def __init__(self) -> None:
        self.servers: list[Serving] = []
        self.answers: list[Answer] = []
        #: keys answered fresh, by the release that answered
        self.answered: dict[str, list[Sent]] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True, name=f"client-{i}")
            for i in range(CLIENTS)
        ]

    def add(self, serving: Serving) -> None:
        with self.lock:
            self.servers.append(serving)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        assert not any(t.is_alive() for t in self.threads), "a client thread hangs"

    def count(self, condition: Callable[[Answer], bool]) -> int:
        with self.lock:
            return sum(1 for answer in self.answers if condition(answer))

    def crossed(self, first: str, then: str) -> int:
        """Retries sent to *then* of keys that *first* answered."""
        return self.count(lambda a: a.retry_of == first and a.release == then)

    def _client(self, index: int) -> None:
        rng = random.Random(index)
        for n in range(MAX_REQUESTS):
            if self.stop.is_set():
                return
            with self.lock:
                servers = list(self.servers)
                # a release first, then one of its keys: retries cross both ways as often,
                # however long each release has served
                answered = [keys for keys in self.answered.values() if keys]
                earlier = rng.choice(rng.choice(answered)) if answered else None
            if earlier is not None and rng.random() < RETRY_SHARE:
                others = [s for s in servers if s.label != earlier.release] or servers
                self._send(rng.choice(others), earlier, retry_of=earlier.release)
            else:
                tenant = rng.choice("abc")
                sent = Sent(tenant, f"k{index}-{n}-{uuid.uuid4().hex[:8]}", n, "")
                self._send(servers[n % len(servers)], sent, retry_of=None)
            self.stop.wait(0.005)

    def _send(self, serving: Serving, sent: Sent, retry_of: str | None) -> None:
        try:
            response = post(
                serving.port,
                "/pay",
                sent.key,
                {"amount": sent.amount},
                headers={"X-Tenant": sent.tenant},
                timeout=30,
            )
        except (OSError, http.client.HTTPException) as exc:
            answer = Answer(
                sent.tenant, sent.key, serving.label, 0, b"", False, repr(exc), retry_of
            )
        else:
            kind = problem_kind(response.status, response.headers, response.body)
            answer = Answer(
                sent.tenant,
                sent.key,
                serving.label,
                response.status,
                response.body,
                response.replayed,
                kind,
                retry_of,
            )
        with self.lock:
            self.answers.append(answer)
            if retry_of is None and answer.status == 201 and not answer.replayed:
                sent = Sent(sent.tenant, sent.key, sent.amount, serving.label)
                self.answered.setdefault(serving.label, []).append(sent)


def summary(answers: list[Answer]) -> str:
    counts = Counter((a.release, a.status, a.kind[:100]) for a in answers)
    return "; ".join(
        f"{n} × {status}{' ' + kind if kind else ''} from {r}"
        for (r, status, kind), n in counts.most_common()
    )


def check_answers(traffic: Traffic, findings: Findings) -> None:
    """No 5xx, nothing but the view's 201 and its replays, no key answered fresh twice, and
    every replay the first answer byte for byte, whichever release replays it."""
    answers = traffic.answers
    failed = [a for a in answers if a.status == 0 or a.status >= 500]
    if failed:
        findings.add(f"{len(failed)} of {len(answers)} answers 5xx or none: {summary(failed)}")
    odd = [a for a in answers if 0 < a.status < 500 and a.status != 201]
    if odd:
        findings.add(f"{len(odd)} answers neither the view's 201 nor its replay: {summary(odd)}")
    first: dict[tuple[str, str], Answer] = {}
    twice, differ = [], []
    for answer in answers:
        if answer.status != 201:
            continue
        key = (answer.tenant, answer.key)
        if not answer.replayed:
            if key in first:
                twice.append(answer)
            else:
                first[key] = answer
        elif key not in first or first[key].body != answer.body:
            differ.append(answer)
    if twice:
        findings.add(f"{len(twice)} keys answered fresh (not replayed) twice: {summary(twice)}")
    if differ:
        example = differ[0]
        findings.add(
            f"{len(differ)} replays differ from the first answer: {summary(differ)}; e.g."
            f" {example.key}: {example.body[:200]!r} vs"
            f" {first.get((example.tenant, example.key), example).body[:200]!r}"
        )


def check_executions(db: DB, traffic: Traffic, findings: Findings) -> None:
    """No key ran twice; and (the harness) every key answered fresh has its execution."""
    twice = db.execute(
        "SELECT tenant, key, string_agg(release || ':' || attempt, ',' ORDER BY at)"
        " FROM executions GROUP BY tenant, key HAVING count(*) > 1 ORDER BY min(at)"
    ).fetchall()
    if twice:
        findings.add(f"{len(twice)} keys ran more than once (release:attempt): {twice[:10]}")
    executed = set(db.execute("SELECT tenant, key FROM executions").fetchall())
    fresh = {(a.tenant, a.key) for a in traffic.answers if a.status == 201 and not a.replayed}
    assert fresh, "the traffic got no fresh answer at all"
    assert fresh <= executed, f"executions not recorded: {sorted(fresh - executed)[:5]}"


# -- unknown keys -----------------------------------------------------------------------------


def make_unknown(db: DB, pairs: list[tuple[Serving, Serving]], findings: Findings) -> set[str]:
    """Keys left ``unknown``, one per (held, retry) pair, all at once: a request of the
    ``on_abandoned="unknown"`` route held in the view on *held*, its worker killed (``kill
    -9``), its one-second lease over, then a retry through *retry*, which must answer 409
    ``outcome-unknown``. The keys so marked."""
    findings.step("making keys unknown: " + ", ".join(f"{h.label}/{r.label}" for h, r in pairs))
    held = {f"unknown-{h.label}-{uuid.uuid4().hex[:8]}": (h, r) for h, r in pairs}
    answered: dict[str, Response] = {}  # a held request must not get an answer
    died: dict[str, BaseException] = {}

    def hold(key: str) -> None:
        headers = {"X-Tenant": UNKNOWN_TENANT, "X-Gate": key}
        try:
            answered[key] = post(
                held[key][0].port, "/risky", key, {"amount": 1}, headers=headers, timeout=60
            )
        except (OSError, http.client.HTTPException) as exc:
            died[key] = exc  # the worker died under it: what this is for

    threads = [threading.Thread(target=hold, args=(key,), daemon=True) for key in held]
    for thread in threads:
        thread.start()

    def in_the_view() -> dict[str, int]:
        rows = db.execute(
            "SELECT key, pid FROM executions WHERE tenant = %s AND key = ANY(%s)",
            (UNKNOWN_TENANT, list(held)),
        ).fetchall()
        return dict(rows)

    # every held request in its view, or answered without running it (the product's failure)
    wait_until(lambda: len(in_the_view().keys() | answered.keys()) == len(held), 30, "held views")
    pids = {key: pid for key, pid in in_the_view().items() if key not in answered}
    for key, answer in answered.items():
        findings.add(
            f"the request of {key} to {held[key][0].label}, to be held in its view, answered"
            f" {answer.status} {problem_kind(answer.status, answer.headers, answer.body)}"
        )
    for key, pid in pids.items():
        server = held[key][0].server
        assert pid in server.worker_pids(), (key, pid)  # only our own servers' workers
        os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(30)
    assert set(died) == set(pids), f"held requests answered: {set(pids) - set(died)}"
    for serving in {id(h): h for h, _ in pairs}.values():
        serving.server.wait_for_workers(timeout=30, exclude=set(pids.values()))
    keys = list(pids)

    def lease_over() -> bool:
        row = db.execute(
            sql.SQL(
                "SELECT count(*) FROM {} WHERE tenant = %s AND key = ANY(%s)"
                " AND status = 'processing' AND locked_until <= now()"
            ).format(sql.Identifier(TABLE)),
            (UNKNOWN_TENANT, keys),
        ).fetchone()
        return row is not None and row[0] == len(keys)

    wait_until(lease_over, 15, "the held keys' one-second lease to run out")
    marked = set()
    for key in keys:
        holder, retry = held[key]
        answer = post(retry.port, "/risky", key, {"amount": 1}, headers={"X-Tenant": "u"})
        kind = problem_kind(answer.status, answer.headers, answer.body)
        if answer.status == 409 and kind == "outcome-unknown":
            marked.add(key)
        else:
            findings.add(
                f"the retry of {key} (held on {holder.label}, killed) through {retry.label}"
                f" answered {answer.status} {kind}, not 409 outcome-unknown"
            )
    return marked


def stuck_gauge(serving: Serving, state: str) -> float | str:
    """The ``idempotency_stuck_keys{state=...}`` gauge of *state* (``unknown``,
    ``dead_owner``) a worker of *serving* reports, or what it answered instead."""
    status, body = get(serving.port, "/metrics")
    line = rb'^idempotency_stuck_keys\{state="%s"\} (\S+)$' % re.escape(state.encode())
    match = re.search(line, body, re.M)
    if status != 200 or match is None:
        return f"{status} without the gauge: {body[-300:]!r}"
    return float(match.group(1))


def count_and_reconcile(
    db: DB,
    store: str,
    servers: list[Serving],
    marked: set[str],
    listing: subprocess.Popen[str],
    findings: Findings,
) -> None:
    """The new release sees every unknown key (*listing*: its ``flask idempotency-list
    --status unknown``, started once the last key was marked; its gauge), its reconciler
    command (a fresh process) settles all of them, and both releases then replay what it
    stored."""
    findings.step("counting unknown keys")
    new = next(s for s in servers if s.label == "new")
    expected = bulk_unknown() | {(UNKNOWN_TENANT, key) for key in marked}
    unknown = set(
        db.execute(
            sql.SQL("SELECT tenant, key FROM {} WHERE status = 'unknown'").format(
                sql.Identifier(TABLE)
            )
        ).fetchall()
    )
    if unknown != expected:
        findings.add(
            f"unknown keys: {len(unknown)} in the table, {len(expected)} made unknown"
            f" (extra: {sorted(unknown - expected)[:5]}, missing: {sorted(expected - unknown)[:5]})"
        )
    output, _ = listing.communicate(timeout=120)
    listed = {key for _, key in expected if key in output.split()}
    if listing.returncode != 0:
        findings.add(f"idempotency-list exited {listing.returncode}: {output[-1500:]}")
    elif listed != {key for _, key in expected}:
        missing = sorted({key for _, key in expected} - listed)
        findings.add(
            f"the new release's idempotency-list --status unknown misses {len(missing)} of"
            f" {len(expected)} unknown keys: {missing[:5]}"
        )
    gauge = stuck_gauge(new, "unknown")
    if gauge != len(expected):
        findings.add(
            f'the new release\'s idempotency_stuck_keys{{state="unknown"}} is {gauge},'
            f" {len(expected)} keys are unknown"
        )
    findings.step("reconciling")
    done = new.code.flask_run(new.code.env(store), "idempotency-reconcile", "--limit", "1000")
    if done.returncode != 0:
        findings.add(f"idempotency-reconcile exited {done.returncode}: {done.stdout[-1500:]}")
    left = db.execute(
        sql.SQL("SELECT tenant, key, reconcile_due_at FROM {} WHERE status = 'unknown'").format(
            sql.Identifier(TABLE)
        )
    ).fetchall()
    if left:
        findings.add(
            f"{len(left)} unknown keys left after the new release's idempotency-reconcile"
            f" (tenant, key, reconcile_due_at): {left[:5]}"
        )
    findings.step("replaying the reconciled keys")
    for key in sorted(marked - {key for _, key, _ in left}):
        bodies = set()
        for serving in servers:
            answer = post(serving.port, "/risky", key, {"amount": 1}, headers={"X-Tenant": "u"})
            if answer.status == 200 and answer.replayed and b"reconciled" in answer.body:
                bodies.add(answer.body)
            else:
                findings.add(
                    f"reconciled {key} through {serving.label}: {answer.status}"
                    f" replayed={answer.replayed} {answer.body[:200]!r}"
                )
        if len(bodies) > 1:
            findings.add(f"reconciled {key} replays differently by release: {bodies}")


def check_indexes(db: DB, kept: frozenset[str], whose: str, when: str, findings: Findings) -> None:
    gone = kept - layout(db).indexes
    if gone:
        findings.add(f"{when}, {whose} indexes are gone (or invalid): {sorted(gone)}")


def upgraded(db: DB, new_layout: Layout) -> Callable[[], bool]:
    """Whether the table has every index (valid), column and companion table (the
    tombstones, SPEC §24) of the new release's layout, and no CHECK it lacks (the CHECK on
    status of releases up to 1.0.0, issue 48)."""

    def check() -> bool:
        now = layout(db)
        return (
            new_layout.indexes <= now.indexes
            and new_layout.columns <= now.columns
            and new_layout.tables <= now.tables
            and now.checks <= new_layout.checks
        )

    return check


#: a statement of schema work (or of the upgrade's backfill of unknown keys)
SCHEMA_WORK = re.compile(r"\s*(CREATE|DROP|ALTER|UPDATE\s+\S+\s+SET\s+reconcile_due_at)", re.I)
#: how long no schema work may run before the schema counts as settled
SETTLED_FOR = 0.5


def settled(db: DB) -> Callable[[], bool]:
    """Whether no session of the store's database has run schema work, or waited for a lock,
    for SETTLED_FOR seconds: what a process start does to the table is over, whatever it is
    (a step of it may come after the new layout exists: the backfill, dropping indexes)."""
    quiet_since: list[float] = []

    def check() -> bool:
        rows = db.execute(
            "SELECT query, wait_event_type FROM pg_stat_activity WHERE datname ="
            " current_database() AND pid <> pg_backend_pid() AND state = 'active'"
        ).fetchall()
        if any(SCHEMA_WORK.match(query or "") or wait == "Lock" for query, wait in rows):
            quiet_since.clear()
            return False
        if not quiet_since:
            quiet_since.append(time.monotonic())
        return time.monotonic() - quiet_since[0] >= SETTLED_FOR

    return check


def crossed_both_ways(traffic: Traffic) -> Callable[[], bool]:
    """A condition: CROSSINGS retries have crossed releases each way."""
    return lambda: min(traffic.crossed("old", "new"), traffic.crossed("new", "old")) >= CROSSINGS


def start_traffic(first: Serving) -> Traffic:
    """Clients sending to *first* (and to each release added later), started."""
    traffic = Traffic()
    traffic.add(first)
    traffic.start()
    return traffic


def wait_for_the_upgrade(
    db: DB, new_layout: Layout, old_layout: Layout, findings: Findings
) -> None:
    """Until the table has the new release's layout and its schema work is over; the old
    release's indexes must still be there."""
    findings.wait(upgraded(db, new_layout), PHASE_TIMEOUT, "the new release's layout")
    findings.wait(settled(db), PHASE_TIMEOUT, "the new release's schema work to end")
    check_indexes(
        db, old_layout.indexes, "the old release's", "once the new one upgraded", findings
    )


def check_the_end(
    db: DB,
    traffic: Traffic,
    findings: Findings,
    servers: list[Serving],
    unknown: tuple[str, set[str], subprocess.Popen[str]] | None = None,
) -> None:
    """What every scenario checks once its traffic is over: every answer, at most one
    execution a key; with *unknown* (the store's URL, the keys marked ``unknown``, the
    listing started after them), those keys counted and reconciled, and the executions
    checked again; then the servers stopped."""
    check_answers(traffic, findings)
    check_executions(db, traffic, findings)
    if unknown is not None:
        url, marked, listing = unknown
        count_and_reconcile(db, url, servers, marked, listing, findings)
        check_executions(db, traffic, findings)
    stop(*servers)


# -- the scenarios ------------------------------------------------------------------------------


@pytest.fixture(params=RELEASES, ids=[r.commit for r in RELEASES])
def release(request: pytest.FixtureRequest) -> OldRelease:
    release: OldRelease = request.param
    return release


@dataclass(frozen=True)
class Scenario:
    """A scenario's parts: the store (a copy of *release*'s populated table), both
    releases' code, the layouts to reach and to keep, and its findings."""

    url: str
    old_layout: Layout
    new_layout: Layout
    old: Code
    new: Code
    start_gunicorn: Callable[..., GunicornServer]
    findings: Findings

    def serve(self, code: Code, workers: int, **settings: str) -> Serving:
        """*code* under gunicorn on the store (see :func:`serve`)."""
        return serve(self.start_gunicorn, code, self.url, self.findings, workers, **settings)


@pytest.fixture
def scenario(
    release: OldRelease,
    old_code: Callable[[OldRelease], Code],
    new_layout: Layout,
    store: tuple[str, Layout],
    start_gunicorn: Callable[..., GunicornServer],
    findings: Findings,
) -> Scenario:
    url, old_layout = store
    return Scenario(
        url, old_layout, new_layout, old_code(release), new_code(), start_gunicorn, findings
    )


def test_upgrade_new_release_starts_beside_the_old_one(
    scenario: Scenario, list_unknown: Callable[[Code, str], subprocess.Popen[str]]
) -> None:
    """The old release serves its table under traffic; the new one starts beside it on the
    same table (4 workers, their first requests upgrade it) while retries cross releases;
    then the old release marks keys ``unknown``, beside the upgraded new one."""
    s, findings = scenario, scenario.findings
    with psycopg.connect(s.url, autocommit=True) as db:
        old = s.serve(s.old, workers=3)
        traffic = start_traffic(old)
        try:
            wait_until(lambda: traffic.count(lambda a: a.status == 201) >= 40, 30, "old answers")
            new = s.serve(s.new, workers=4)
            traffic.add(new)
            wait_for_the_upgrade(db, s.new_layout, s.old_layout, findings)
            marked = make_unknown(db, [(old, old), (old, old)], findings)
            listing = list_unknown(s.new, s.url)
            findings.wait(crossed_both_ways(traffic), PHASE_TIMEOUT, CROSSED)
        finally:
            traffic.finish()
        check_indexes(db, s.old_layout.indexes, "the old release's", "at the end", findings)
        check_indexes(db, s.new_layout.indexes, "the new release's", "at the end", findings)
        check_the_end(db, traffic, findings, [old, new], (s.url, marked, listing))
    findings.check(traffic, marked)


def test_rollback_old_release_starts_beside_the_new_one(
    scenario: Scenario, list_unknown: Callable[[Code, str], subprocess.Popen[str]]
) -> None:
    """The new release serves (it upgraded the old release's table on its first requests);
    the old one starts again beside it; both mark keys ``unknown``, and neither undoes the
    other's DDL."""
    s, findings = scenario, scenario.findings
    with psycopg.connect(s.url, autocommit=True) as db:
        new = s.serve(s.new, workers=4)
        traffic = start_traffic(new)
        try:
            wait_for_the_upgrade(db, s.new_layout, s.old_layout, findings)
            new_indexes = s.new_layout.indexes & layout(db).indexes  # those it has built
            old = s.serve(s.old, workers=3)
            traffic.add(old)
            findings.wait(settled(db), PHASE_TIMEOUT, "the old release's schema work to end")
            marked = make_unknown(db, [(new, new), (new, old), (old, old), (old, new)], findings)
            listing = list_unknown(s.new, s.url)
            findings.wait(crossed_both_ways(traffic), PHASE_TIMEOUT, CROSSED)
        finally:
            traffic.finish()
        check_indexes(
            db, new_indexes, "the new release's", "after the old release started again", findings
        )
        check_indexes(db, s.old_layout.indexes, "the old release's", "at the end", findings)
        check_the_end(db, traffic, findings, [old, new], (s.url, marked, listing))
    findings.check(traffic, marked)


def test_upgrade_with_fail_open_runs_nothing_twice(scenario: Scenario) -> None:
    """The upgrade's start again, both releases with IDEMPOTENCY_FAIL_OPEN: schema work that
    fails or waits must never count as an outage that runs views unprotected."""
    s, findings = scenario, scenario.findings
    with psycopg.connect(s.url, autocommit=True) as db:
        old = s.serve(s.old, workers=3, fail_open="true")
        traffic = start_traffic(old)
        try:
            wait_until(lambda: traffic.count(lambda a: a.status == 201) >= 40, 30, "old answers")
            new = s.serve(s.new, workers=4, fail_open="true")
            traffic.add(new)
            crossed = crossed_both_ways(traffic)
            findings.wait(
                lambda: upgraded(db, s.new_layout)() and crossed(),
                PHASE_TIMEOUT,
                f"the new release's layout and {CROSSED}",
            )
        finally:
            traffic.finish()
        check_the_end(db, traffic, findings, [old, new])
    findings.check(traffic)


# -- the owner columns (SPEC §20) ---------------------------------------------------------------

#: the old releases the owner scenario runs against: the last one without owners (the others
#: leave the owner columns alone the same way)
OWNERLESS = [r for r in RELEASES if r.commit == "fe789f9"]
#: the new release's lease in the owner scenario: the lease of its killed claim runs out soon
#: (the old release keeps its 60 s lease: its claims stay in their lease throughout)
OWNER_LEASE = 2
#: the tenant of the owner scenario's keys
OWNER_TENANT = "o"


@dataclass
class Held:
    """A request of the owner scenario held in its view at a gate of its own."""

    serving: Serving
    key: str
    attempt: int  #: the attempt it runs as
    gate: str
    pid: int  #: the worker running it
    thread: threading.Thread
    #: what came back (an answer, or the error of a killed worker)
    outcome: list[Response | BaseException]

    def open(self, db: DB) -> Response | BaseException | None:
        """Open its gate; what it answered (None: nothing within 30 s)."""
        db.execute(
            "INSERT INTO gates (name, open) VALUES (%s, true)"
            " ON CONFLICT (name) DO UPDATE SET open = true",
            (self.gate,),
        )
        self.thread.join(30)
        return self.outcome[0] if self.outcome else None

    def kill(self) -> None:
        """``kill -9`` its worker; the request must die with it."""
        assert self.pid in self.serving.server.worker_pids(), (self.key, self.pid)
        os.kill(self.pid, signal.SIGKILL)
        self.thread.join(30)
        assert self.outcome and isinstance(self.outcome[0], BaseException), self.outcome
        self.serving.server.wait_for_workers(timeout=30, exclude={self.pid})


def hold(db: DB, serving: Serving, key: str, attempt: int) -> Held:
    """A request of *key* to *serving*, held in its view as *attempt* (the harness fails
    when it is answered instead, or runs as another attempt)."""
    gate = f"{key}-{attempt}"
    outcome: list[Response | BaseException] = []

    def send() -> None:
        headers = {"X-Tenant": OWNER_TENANT, "X-Gate": gate}
        try:
            outcome.append(post(serving.port, "/pay", key, {"amount": 1}, headers=headers))
        except (OSError, http.client.HTTPException) as exc:
            outcome.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()

    def running() -> tuple[int, int] | Response | BaseException | None:
        row = db.execute(
            "SELECT attempt, pid FROM executions WHERE tenant = %s AND key = %s"
            " ORDER BY at DESC LIMIT 1",
            (OWNER_TENANT, key),
        ).fetchone()
        if row is not None and row[0] >= attempt:
            return row[0], row[1]
        return outcome[0] if outcome else None

    found = wait_until(running, 30, f"{key} in its view as attempt {attempt}")
    assert isinstance(found, tuple), f"{key} to {serving.label} answered instead: {found}"
    assert found[0] == attempt, f"{key} runs as attempt {found[0]}, not {attempt}"
    return Held(serving, key, attempt, gate, found[1], thread, outcome)


@dataclass(frozen=True)
class Owned:
    """What a key's row says of its claim's owner."""

    status: str
    attempt: int
    owner_id: int | None
    owner_pid: int | None
    #: owner_claim = generation + attempt: the recorded owner made the claim in flight
    current: bool
    #: seconds left of its lease
    lease_left: float
    #: a session holds the owner's lock
    alive: bool


def owned(db: DB, key: str) -> Owned:
    row = db.execute(
        sql.SQL(
            "SELECT status, attempt, owner_id, owner_pid,"
            " coalesce(owner_claim = generation + attempt, false),"
            " coalesce(extract(epoch FROM locked_until - now()), 0)::float8,"
            " EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1"
            "         AND (classid::bigint << 32 | objid::bigint) = owner_id)"
            " FROM {} WHERE tenant = %s AND key = %s"
        ).format(sql.Identifier(TABLE)),
        (OWNER_TENANT, key),
    ).fetchone()
    assert row is not None, key
    return Owned(*row)


def lease_runs_out(db: DB, key: str) -> None:
    """Until the lease of *key*'s claim is over."""
    wait_until(lambda: owned(db, key).lease_left <= 0, 15, f"the lease of {key} to run out")


def executions_of(db: DB, key: str) -> list[str]:
    """release:attempt of each execution of *key*, in order."""
    rows = db.execute(
        "SELECT release || ':' || attempt FROM executions WHERE tenant = %s AND key = %s"
        " ORDER BY at",
        (OWNER_TENANT, key),
    ).fetchall()
    return [r[0] for r in rows]


@pytest.mark.parametrize("release", OWNERLESS, ids=[r.commit for r in OWNERLESS])
def test_a_dead_owner_never_speaks_for_an_old_release_s_claim(scenario: Scenario) -> None:
    """The owner columns beside a release without owners (SPEC §20): a key's row carries an
    owner of the new release, whose process is killed (``kill -9``: its lock is free), while
    the old release runs a later claim of that key (its takeover left the owner columns as
    they were). A retry through the new release must judge that claim by its lease: 409 in
    progress, never a takeover; the old release's answer is then replayed by both.

    Two keys, both ways: one first claimed by the new release (its fresh claim's owner), one
    first claimed by the old release and taken over by the new one (its takeover's owner),
    each then taken over by the old release after the new one's owner was killed."""
    s, findings = scenario, scenario.findings
    tenant = {"X-Tenant": OWNER_TENANT}
    with psycopg.connect(s.url, autocommit=True) as db:
        new = s.serve(s.new, workers=2, lease=str(OWNER_LEASE))
        first = post(new.port, "/pay", f"owner-first-{uuid.uuid4().hex[:8]}", {"amount": 1})
        assert first.status == 201, first  # and its schema step adds the owner columns
        wait_for_the_upgrade(db, s.new_layout, s.old_layout, findings)
        old = s.serve(s.old, workers=3)  # two views held at once, one worker answers
        by_new = f"owner-new-{uuid.uuid4().hex[:8]}"  # first claimed by the new release
        by_old = f"owner-old-{uuid.uuid4().hex[:8]}"  # first claimed by the old release

        findings.step("the first claims held, their workers killed")
        new_first, old_first = hold(db, new, by_new, 1), hold(db, old, by_old, 1)
        assert owned(db, by_new).owner_pid == new_first.pid, owned(db, by_new)
        assert owned(db, by_old).owner_id is None, owned(db, by_old)
        new_first.kill()
        old_first.kill()
        # the old release's 60 s lease ends now, as it would (the test does not wait for it)
        db.execute(
            sql.SQL(
                "UPDATE {} SET locked_until = now() WHERE tenant = %s AND key = %s"
                " AND status = 'processing' AND attempt = 1"
            ).format(sql.Identifier(TABLE)),
            (OWNER_TENANT, by_old),
        )
        findings.step("the new release takes over the old release's key, is killed")
        new_takeover = hold(db, new, by_old, 2)
        row = owned(db, by_old)
        assert (row.owner_pid, row.current) == (new_takeover.pid, True), row
        new_takeover.kill()

        findings.step("the old release takes both keys over once their leases ran out")
        lease_runs_out(db, by_new)
        lease_runs_out(db, by_old)
        old_claims = [hold(db, old, by_new, 2), hold(db, old, by_old, 3)]
        for claim, killed in zip(old_claims, (new_first, new_takeover), strict=True):
            row = owned(db, claim.key)
            # what the scenario is about: the killed owner is still recorded, its lock is
            # free, the claim in flight is the old release's, in its lease
            assert row.owner_pid == killed.pid and not row.current and not row.alive, row
            assert row.lease_left > 30, row

        findings.step("retries while the old release's claims run")
        for claim in old_claims:
            for serving in (new, old, new):
                answer = post(serving.port, "/pay", claim.key, {"amount": 1}, headers=tenant)
                kind = problem_kind(answer.status, answer.headers, answer.body)
                if (answer.status, kind) != (409, "request-in-progress"):
                    findings.add(
                        f"a retry of {claim.key} through {serving.label} while the old"
                        f" release runs attempt {claim.attempt} (its recorded owner of the new"
                        f" release dead) answered {answer.status} {kind or answer.body[:200]!r},"
                        " not 409 request-in-progress"
                    )
            if owned(db, claim.key).attempt != claim.attempt:
                findings.add(f"{claim.key} was taken over: {owned(db, claim.key)}")
        dead_owner = stuck_gauge(new, "dead_owner")
        if dead_owner != 0:
            findings.add(
                f'the new release\'s idempotency_stuck_keys{{state="dead_owner"}} is {dead_owner}'
                " while the old release's claims run (their recorded owner is not theirs)"
            )

        findings.step("the old release answers; both replay it")
        for claim in old_claims:
            answer = claim.open(db)
            if not isinstance(answer, Response) or answer.status != 201 or answer.replayed:
                findings.add(f"attempt {claim.attempt} of {claim.key} answered {answer!r}")
                continue
            for serving in (new, old):
                replay = post(serving.port, "/pay", claim.key, {"amount": 1}, headers=tenant)
                if (replay.status, replay.replayed, replay.body) != (201, True, answer.body):
                    findings.add(
                        f"the retry of {claim.key} through {serving.label} after the old"
                        f" release's answer: {replay.status} replayed={replay.replayed}"
                        f" {replay.body[:200]!r}, not the replay of {answer.body[:200]!r}"
                    )
        ran = {key: executions_of(db, key) for key in (by_new, by_old)}
        expected = {by_new: ["new:1", "old:2"], by_old: ["old:1", "new:2", "old:3"]}
        if ran != expected:
            findings.add(f"executions (release:attempt): {ran}, expected {expected}")
        stop(new, old)
    findings.step("checked")
    assert not findings.items, "\n".join(f"- {item}" for item in findings.items)


#: the release a table at IDEMPOTENCY_COMPATIBILITY = "1.1" may roll back to: 1.0.0
ONE_ZERO = [r for r in RELEASES if r.commit == "5c77fea"]


def rollback_rewrite() -> str:
    """The statement docs/howto/upgrading.md gives for a rollback to 1.0 from
    ``IDEMPOTENCY_COMPATIBILITY = "1.1"`` (its one ``sql`` block that names the short form)."""
    page = (ROOT / "docs" / "howto" / "upgrading.md").read_text(encoding="utf-8")
    blocks = [
        textwrap.dedent(b)
        for b in re.findall(r"```sql\n(.*?)```", page, re.S)
        if "response_headers IS NULL" in b
    ]
    assert len(blocks) == 1, blocks
    return blocks[0]


@pytest.mark.parametrize("release", ONE_ZERO, ids=[r.commit for r in ONE_ZERO])
def test_a_rollback_from_short_headers_replays_alike_once_rewritten(scenario: Scenario) -> None:
    """The new release at ``IDEMPOTENCY_COMPATIBILITY = "1.1"`` stores the JSON answers'
    headers as NULL; 1.0.0, served beside it afterwards, replays such a key as ``text/html``
    (what the how-to warns of), and, once the how-to's statement has run, every other such
    key with the headers and body of its first answer. The new release replays them alike
    throughout."""
    s, findings = scenario, scenario.findings
    headers = {"X-Tenant": OWNER_TENANT}  # executions_of's
    with psycopg.connect(s.url, autocommit=True) as db:
        new = s.serve(s.new, workers=2, compatibility="1.1")
        keys = [f"short-{n}-{uuid.uuid4().hex[:8]}" for n in range(4)]
        first = {key: post(new.port, "/pay", key, {"amount": 1}, headers=headers) for key in keys}
        assert all(a.status == 201 and not a.replayed for a in first.values()), first
        stored = db.execute(
            sql.SQL(
                "SELECT count(*) FROM {} WHERE key = ANY(%s) AND response_headers IS NULL"
            ).format(sql.Identifier(TABLE)),
            (keys,),
        ).fetchone()
        assert stored == (len(keys),), stored  # the short form, as the setting asks
        old = s.serve(s.old, workers=1)

        findings.step("1.0.0 replays a short-form key before the rewrite")
        unwritten = post(old.port, "/pay", keys[0], {"amount": 1}, headers=headers)
        assert (unwritten.status, unwritten.replayed) == (201, True), unwritten
        assert unwritten.body == first[keys[0]].body
        assert unwritten.headers["Content-Type"].startswith("text/html"), unwritten.headers

        findings.step("the how-to's rewrite, then 1.0.0 and the new release replay")
        rewritten = db.execute(rollback_rewrite()).rowcount
        assert rewritten >= len(keys) - 1, rewritten
        for key in keys[1:]:
            for serving in (old, new):
                replay = post(serving.port, "/pay", key, {"amount": 1}, headers=headers)
                if (replay.status, replay.replayed, replay.body) != (
                    201,
                    True,
                    first[key].body,
                ) or replay.stored_headers() != first[key].stored_headers():
                    findings.add(
                        f"{key} through {serving.label}: {replay.status} {replay.headers!r}"
                        f" {replay.body[:200]!r}, not the replay of {first[key]!r}"
                    )
        ran = {key: executions_of(db, key) for key in keys}
        if any(runs != ["new:1"] for runs in ran.values()):
            findings.add(f"executions (release:attempt): {ran}")
        stop(new, old)
    findings.step("checked")
    assert not findings.items, "\n".join(f"- {item}" for item in findings.items)
