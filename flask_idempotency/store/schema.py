"""The tables and their indexes: names, what exists, creating them, upgrading them online.

A missing table is created; a table made by an earlier release is upgraded by
:attr:`Schema.steps`, each step online: ``ADD COLUMN`` without a volatile default (a
catalog change) under a short ``lock_timeout``, retried, so it never queues claims
behind a long transaction; ``CREATE INDEX CONCURRENTLY`` outside any transaction. A
later feature adds its own :class:`Step`, of one of three kinds:

- :data:`SERVE`: this release cannot serve without it (tables, columns: a moment's
  catalog change). A process's first request makes them (:meth:`Schema.prepare`).
- :data:`BUILD`: this release serves better with it (indexes built concurrently,
  storage settings). The first request leaves them to a background thread
  (:meth:`Schema.build`) and is served at once, on the layout that is there.
- :data:`RETIRE`: an earlier release's indexes, which that release needs while it
  still serves beside this one: only ``flask idempotency-init`` drops them
  (:meth:`Schema.create`, which runs every kind).

One process at a time changes the schema of a table, holding a session advisory lock.
No process ever *waits* for that lock inside a statement: a waiting statement holds a
snapshot, a ``CREATE INDEX CONCURRENTLY`` of the holder waits for every older snapshot,
and PostgreSQL would call it a deadlock. A process that wants the lock asks with
``pg_try_advisory_lock`` (a statement of a moment) and asks again after a pause.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors, sql

from ..errors import StoreError
from ..keys import lock_id
from .ddl import (
    ADD_COLUMN,
    AUDIT_KEY,
    AUDIT_KEY_DISTRIBUTED,
    CITUS_ONLY_INDEXES,
    CITUS_STATE,
    COLOCATED_TENANT,
    CREATE_INDEX,
    CREATE_INDEX_CONCURRENTLY,
    DISTRIBUTE,
    DISTRIBUTE_FUNCTION,
    DROP_CONSTRAINT,
    DROP_INDEX_CONCURRENTLY,
    INDEXES,
    JOBS_KEY,
    JOBS_KEY_DISTRIBUTED,
    JOBS_ORDER_INDEX,
    JOBS_SCHEMA,
    JOBS_SEQ_COLUMN,
    LOCK_TIMEOUT,
    MARK_UNKNOWN_DUE,
    PLAIN_ONLY_INDEXES,
    PROPAGATE_FUNCTION,
    REFERENCE,
    RETIRED_INDEXES,
    SCHEMA_STATE,
    SET_STORAGE,
    STATUS_CHECK,
    STORAGE,
    TABLE,
    TENANT_TYPE,
    TOMBSTONES,
    UPGRADE_COLUMNS,
    UPGRADE_JOB_COLUMNS,
)
from .statements_citus import CLAIM_FUNCTION, COMPLETE_FUNCTION, HERE_FUNCTION
from .statements_console import AUDIT_SCHEMA, HEARTBEATS_SCHEMA

logger = logging.getLogger("flask_idempotency")

#: how long one ``ADD COLUMN`` waits for its lock before it gives up and tries again
LOCK_TIMEOUT_SECONDS = 1.0
#: how many times it tries
LOCK_TRIES = 60
#: the pause between two asks for the schema lock, on the request path (short: a first
#: request waits for it) and in the background
POLL_SECONDS = 0.05
BUILD_POLL_SECONDS = 0.5

#: the kinds of :class:`Step` (see the module's docstring)
SERVE, BUILD, RETIRE = "serve", "build", "retire"
ALL_KINDS = frozenset({SERVE, BUILD, RETIRE})

#: another process creates the same shared table at the same moment (``CREATE TABLE IF
#: NOT EXISTS`` is not safe against that): it exists now
_CREATED_MEANWHILE = (errors.UniqueViolation, errors.DuplicateTable, errors.DuplicateObject)


class SchemaBusy(Exception):
    """Another process held the schema lock (or a table's lock) for longer than a first
    request may wait; nothing was changed."""


class SchemaElsewhere(SchemaBusy):
    """The schema lacks something that this node cannot make: a Citus worker, where a
    table created would be a local table of that node, invisible to the others (SPEC §22).
    The coordinator makes them (``flask idempotency-init`` against it, or a process
    connected to it); until then, a request through the worker is answered as when the
    schema is busy (503), never served unprotected."""


@dataclasses.dataclass(frozen=True)
class SchemaState:
    """What exists of the schema objects, as :data:`~.ddl.SCHEMA_STATE` reads it."""

    #: the to_regclass names of the objects that do not exist
    missing: frozenset[str]
    #: the keys table's columns
    columns: frozenset[str]
    #: indexes of the keys table whose concurrent build failed
    invalid: frozenset[str]
    #: the keys table's storage parameters, as ``name=value``
    options: frozenset[str]
    #: whether this role may change them (owns the table)
    owned: bool
    #: the jobs table's columns
    job_columns: frozenset[str] = frozenset()
    #: the database has the citus extension (SPEC §22)
    citus: bool = False
    #: this node may create tables (always, without Citus; on Citus, the coordinator)
    coordinator: bool = True
    #: the to_regclass names of the tables that are distributed (or reference) tables
    distributed: frozenset[str] = frozenset()
    #: on Citus: the claim function exists, delegated to the shard's node
    claim_function: bool = False
    #: the names of an earlier release's CHECK constraints on status (ddl.STATUS_CHECK)
    status_checks: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Step:
    """One online upgrade step: whether a table lacks it, and how to add it."""

    name: str
    needed: Callable[[SchemaState], bool]
    #: runs on an autocommit connection, outside any transaction
    apply: Callable[[psycopg.Connection[Any]], None]
    #: :data:`SERVE`, :data:`BUILD` or :data:`RETIRE`
    kind: str = SERVE


class Schema:
    """The schema objects of the table named *table* (``name`` or ``schema.name``)."""

    def __init__(
        self,
        table: str,
        jobs_table: str = "idempotency_jobs",
        audit_table: str = "idempotency_audit",
        heartbeats_table: str = "idempotency_heartbeats",
        colocate_with: str | None = None,
    ) -> None:
        self.name = table
        #: on Citus: the app's distributed table the keys are co-located with (None:
        #: Citus's default co-location group)
        self.colocate_with = colocate_with
        #: the database has the citus extension, as the last look said (None: not looked
        #: yet): the store then sends the request path's statements of Citus
        self.citus: bool | None = None
        parts = table.split(".")
        #: the table, quoted as needed
        self.table = sql.Identifier(*parts)
        name = parts[-1]
        prefix = _quoted(parts[0]) + "." if len(parts) == 2 else ""
        #: index name → its definition after ``ON`` (those of plain PostgreSQL and of Citus)
        self.indexes = {f"{name}_{suffix}": INDEXES[suffix] for suffix in INDEXES}
        #: the indexes only a table on Citus has, and those only one on plain PostgreSQL has
        self._citus_only = {f"{name}_{suffix}" for suffix in CITUS_ONLY_INDEXES}
        self._plain_only = {f"{name}_{suffix}" for suffix in PLAIN_ONLY_INDEXES}
        #: the keys table has the indexes of plain PostgreSQL, valid, and no Citus, as the
        #: last look said (None: not looked yet): the statements that find keys by time walk
        #: them (statements_by_class)
        self.ttl_classes: bool | None = None
        #: indexes of earlier releases that the upgrade drops (once the new ones exist)
        self.retired = [f"{name}_{suffix}" for suffix in RETIRED_INDEXES]
        jobs_parts = jobs_table.split(".")
        #: the staged jobs' table (README "Work that outlives the request"), quoted as needed
        self.jobs = sql.Identifier(*jobs_parts)
        self._jobs_index = f"{jobs_parts[-1]}_due_idx"
        #: the index of ordered jobs (stage(..., ordered=True)) by key and place
        self._jobs_order_index = f"{jobs_parts[-1]}_order_idx"
        self._jobs_schema = jobs_parts[0] if len(jobs_parts) == 2 else None
        jobs_prefix = _quoted(jobs_parts[0]) + "." if len(jobs_parts) == 2 else ""
        audit_parts, heartbeats_parts = audit_table.split("."), heartbeats_table.split(".")
        #: the audit trail and the heartbeats of the background commands
        self.audit = sql.Identifier(*audit_parts)
        self.heartbeats = sql.Identifier(*heartbeats_parts)
        self._audit_index = f"{audit_parts[-1]}_key_idx"
        #: what is left of the keys whose answer expired (SPEC §24), beside the keys table
        tombstones_table = ".".join([*parts[:-1], f"{name}_tombstones"])
        self.tombstones = sql.Identifier(*parts[:-1], f"{name}_tombstones")
        self._tombstones_index = f"{name}_tombstones_expiry_idx"
        audit_prefix = _quoted(audit_parts[0]) + "." if len(audit_parts) == 2 else ""
        # to_regclass() parses its argument as SQL would: every part quoted
        self._regclass = {
            "table": ".".join(map(_quoted, parts)),
            "jobs": ".".join(map(_quoted, jobs_parts)),
            "jobs_index": jobs_prefix + _quoted(self._jobs_index),
            "jobs_order_index": jobs_prefix + _quoted(self._jobs_order_index),
            "audit": ".".join(map(_quoted, audit_parts)),
            "audit_index": audit_prefix + _quoted(self._audit_index),
            "heartbeats": ".".join(map(_quoted, heartbeats_parts)),
            "tombstones": prefix + _quoted(f"{name}_tombstones"),
            "tombstones_index": prefix + _quoted(self._tombstones_index),
            **{index: prefix + _quoted(index) for index in [*self.indexes, *self.retired]},
        }
        #: the LISTEN/NOTIFY channel that announces finished keys (see waiting.py)
        self.channel = f"{name}_finished"[:63]
        #: on Citus, the new-key claim and the common finish delegated to the shard's node
        #: (their names, quoted as needed; None: a table name too long to add a suffix to).
        #: _v3 runs on the shard itself; the _v1 claim of 1.0 is left alone (_v2, of no release,
        #: asked the shard's placement without the node's group).
        function_name = f"{name}_claim_v3"
        complete_name = f"{name}_complete_v3"
        fits = len(complete_name) <= 63
        self._function_name = function_name if fits else None
        self._complete_name = complete_name if fits else None
        self._here_name = f"{name}_here_v3" if fits else None
        self.claim_function_name = sql.Identifier(*parts[:-1], function_name) if fits else None
        self.complete_function_name = sql.Identifier(*parts[:-1], complete_name) if fits else None
        #: whether a shard is on this node (HERE_FUNCTION), made on every node
        self.here_function_name = (
            sql.Identifier(*parts[:-1], self._here_name) if self._here_name else None
        )
        #: on Citus: whether the claim function exists, as the last look said
        self.citus_claim = False
        #: the steps the last :meth:`create` ran on an existing table
        self.upgraded: list[str] = []
        #: the tables the last :meth:`create` made (the others existed already)
        self.created: list[str] = []
        #: every table of the extension: keys, jobs, audit, heartbeats, tombstones
        self.tables = (table, jobs_table, audit_table, heartbeats_table, tombstones_table)
        self._table_regclass = dict(
            zip(self.tables, ("table", "jobs", "audit", "heartbeats", "tombstones"), strict=True)
        )
        #: the upgrade of a table made by an earlier release, in order
        #: the to_regclass name of an earlier release's index of unknown keys: while it
        #: exists, such a release may serve beside this one and make unknown keys
        #: without ``reconcile_due_at`` (statements_background.MARK_UNKNOWN_DUE)
        self.retired_unknown_index = self._regclass[f"{name}_unknown_idx"]
        self._jobs_lock = lock_id("schema", jobs_table)
        self.steps: list[Step] = [
            # on Citus, before anything else: a step after it runs on the distributed table
            Step("distributed by tenant", self._lacks_distribution, self._distribute),
            Step("columns", self._lacks_columns, self._add_columns),
            Step("jobs table", self._lacks_jobs, self._create_jobs),
            Step("jobs columns", self._lacks_job_columns, self._add_job_columns),
            Step("ordered jobs", self._lacks_job_seq, self._add_job_seq),
            Step("audit and heartbeats tables", self._lacks_console, self._create_console),
            Step("tombstones table", self._lacks_tombstones, self._create_tombstones),
            Step(
                "claim function on Citus",
                self._lacks_claim_function,
                self._add_claim_function,
                BUILD,
            ),
            Step("ordered jobs index", self._lacks_job_order, self._add_job_order, BUILD),
            Step("autovacuum settings", self._lacks_storage, self._set_storage, BUILD),
            Step("no CHECK on status", self._has_status_check, self._drop_status_check, BUILD),
            *(
                Step(f"index {index}", self._lacks_index(index), self._index_builder(index), BUILD)
                for index in self.indexes
            ),
            # on plain PostgreSQL, the two timestamp indexes of earlier releases (issue 48)
            *(
                Step(
                    f"drop index {index}",
                    self._has_index(index, citus=False),
                    self._index_dropper(index),
                    RETIRE,
                )
                for index in sorted(self._citus_only)
            ),
            # before the old unknown_idx goes: it finds the rows to mark
            Step(
                "unknown keys due",
                self._has_index(f"{name}_unknown_idx"),
                self._mark_unknown,
                RETIRE,
            ),
            *(
                Step(
                    f"drop index {index}",
                    self._has_index(index),
                    self._index_dropper(index),
                    RETIRE,
                )
                for index in self.retired
            ),
        ]
        #: on the request path: when the lock-polling gives up, and the ``ADD COLUMN``
        #: retries with it (None: ``flask idempotency-init``, which waits as long as needed)
        self._deadline: float | None = None

    # -- looking -------------------------------------------------------------------

    def regclass(self, part: str) -> str:
        """The name of *part* (``table``, ``tombstones``, ...) as ``::regclass`` reads it:
        every part quoted."""
        return self._regclass[part]

    def state(self, conn: psycopg.Connection[Any]) -> SchemaState:
        """What exists now (one query)."""
        params: dict[str, Any] = {
            "names": list(self._regclass.values()),
            "table": self._regclass["table"],
            "jobs": self._regclass["jobs"],
            "status_check": STATUS_CHECK,
        }
        row = conn.execute(SCHEMA_STATE, params, prepare=False).fetchone()
        assert row is not None
        missing, columns, job_columns, invalid, options, owned, citus, status_checks = row
        self.citus = citus
        self.ttl_classes = not citus and all(
            self._regclass[index] not in missing and index not in invalid
            for index in self._plain_only
        )
        coordinator, distributed, claim_function = True, [], False
        if citus:
            names = [self._regclass[part] for part in self._table_regclass.values()]
            params = {
                "names": names,
                "function": self._function_name,
                "table": self._regclass["table"],
            }
            found = conn.execute(CITUS_STATE, params, prepare=False).fetchone()
            assert found is not None
            coordinator, distributed, claim_function = found
        self.citus_claim = bool(claim_function)
        return SchemaState(
            frozenset(missing),
            frozenset(columns),
            frozenset(invalid),
            frozenset(options),
            owned,
            frozenset(job_columns),
            citus,
            coordinator,
            frozenset(distributed),
            bool(claim_function),
            frozenset(status_checks),
        )

    def present(self, conn: psycopg.Connection[Any]) -> bool:
        """True if every table, column and index exists (and every index is valid), and
        no earlier release's index is left."""
        return not self._work(self.state(conn))

    def _work(self, state: SchemaState, kinds: frozenset[str] = ALL_KINDS) -> list[Step]:
        if not state.coordinator:
            # A Citus worker changes nothing: what it lacks to serve, the coordinator
            # makes (_apply says so); indexes and settings are the coordinator's too.
            kinds = kinds & {SERVE}
        return [step for step in self.steps if step.kind in kinds and step.needed(state)]

    def _missing(self, state: SchemaState) -> bool:
        return self._regclass["table"] in state.missing

    # -- creating and upgrading ----------------------------------------------------

    def create(self, conn: psycopg.Connection[Any]) -> bool:
        """Create the tables and indexes, or upgrade a table made by an earlier release,
        dropping that release's indexes (``flask idempotency-init``: every kind of
        step); True if DDL ran. Safe to run from several processes at once: it waits
        (asking again and again) while another process changes the schema.

        Looks first: ``CREATE INDEX IF NOT EXISTS`` takes a lock on the table even
        when the index exists, which would queue behind live claims.
        """
        self.upgraded, self.created = [], []
        self._deadline = None
        if self.present(conn):
            return False
        with _autocommit(conn), self._exclusive(conn, None):
            return self._apply(conn, self.state(conn), ALL_KINDS)

    def prepare(self, conn: psycopg.Connection[Any], deadline: float) -> bool:
        """What a process's first request needs: the tables and columns this release
        reads and writes (:data:`SERVE` steps), made now if they are missing; True if
        :data:`BUILD` steps remain for :meth:`build`. Never drops anything.

        :raises SchemaBusy: another process held the lock past *deadline*
            (``time.monotonic()``) while this one still needed a step.
        """
        self.upgraded = []
        self._deadline = deadline
        serve = frozenset({SERVE})
        with _autocommit(conn):
            while True:
                state = self.state(conn)
                if not (self._missing(state) or self._work(state, serve)):
                    return bool(self._work(state, frozenset({BUILD})))
                # Looks again after each ask: the process holding the lock may have added
                # what this one needs, then gone on to build indexes for a long while.
                if _try_lock(conn, self._lock):
                    try:
                        self._apply(conn, self.state(conn), serve)
                    finally:
                        _unlock(conn, self._lock)
                elif time.monotonic() >= deadline:
                    raise SchemaBusy(f"another process is changing the schema of table {self.name}")
                else:
                    time.sleep(POLL_SECONDS)

    def build(self, conn: psycopg.Connection[Any], stop: threading.Event) -> None:
        """The :data:`BUILD` steps (indexes built concurrently, storage settings), on a
        connection of their own, outside any request: until none is needed (another
        process may have done them) or *stop* is set. Never drops anything."""
        self._deadline = None
        with _autocommit(conn):
            while not stop.is_set():
                if not self._work(self.state(conn), frozenset({BUILD})):
                    return
                if _try_lock(conn, self._lock):
                    try:
                        self._apply(conn, self.state(conn), frozenset({BUILD}), stop)
                    finally:
                        _unlock(conn, self._lock)
                else:
                    stop.wait(BUILD_POLL_SECONDS)

    def _apply(
        self,
        conn: psycopg.Connection[Any],
        state: SchemaState,
        kinds: frozenset[str],
        stop: threading.Event | None = None,
    ) -> bool:
        """Run the needed steps of *kinds* (holding the schema lock); True if DDL ran."""
        if not state.coordinator:
            raise SchemaElsewhere(
                f"table {self.name} (or one of its companions, or one of their columns) is"
                " missing, and this node is a Citus worker: tables made here would be local"
                " to it. Run flask idempotency-init against the coordinator."
            )
        created = self._missing(state)
        if created and state.citus:
            self._tenant_type(conn)  # a refusal before anything is made: all or nothing
        if created:
            self._create_all(conn, state)
            self.created = [
                name
                for name, part in self._table_regclass.items()
                if self._regclass[part] in state.missing
            ]
            # a shared table another app made with an earlier release: its upgrade too
            state = self.state(conn)
        work = self._work(state, kinds)
        for step in work:
            if stop is not None and stop.is_set():
                return True
            logger.info("upgrading table %s: %s", self.name, step.name)
            step.apply(conn)
            self.upgraded.append(step.name)
        if work:
            logger.info("upgraded table %s: %s", self.name, ", ".join(s.name for s in work))
        return created or bool(work)

    def _create_all(self, conn: psycopg.Connection[Any], state: SchemaState) -> None:
        with conn.transaction():
            storage = _storage(STORAGE)
            conn.execute(sql.SQL(TABLE).format(table=self.table, storage=storage), prepare=False)
            for index, definition in self.indexes.items():
                if self._wanted(index, state.citus):
                    conn.execute(self._index_sql(CREATE_INDEX, index, definition), prepare=False)
        if self._regclass["jobs"] in state.missing:
            self._create_jobs(conn)
        self._create_console(conn)
        self._create_tombstones(conn)
        logger.info("created table %s and its indexes", self.name)

    @property
    def _lock(self) -> int:
        return lock_id("schema", self.name)

    @contextmanager
    def _exclusive(self, conn: psycopg.Connection[Any], deadline: float | None) -> Iterator[None]:
        """One process at a time creates or upgrades a table (the others ask again, then
        find it done), until *deadline* (None: for as long as it takes).

        A session-level lock, because ``CREATE INDEX CONCURRENTLY`` cannot run in a
        transaction; released in any case, and with the connection if it breaks.
        """
        _poll_lock(conn, self._lock, deadline, f"table {self.name}")
        try:
            yield
        finally:
            _unlock(conn, self._lock)

    # -- the steps -------------------------------------------------------------------

    def _lacks_columns(self, state: SchemaState) -> bool:
        return any(column not in state.columns for column, _ in UPGRADE_COLUMNS)

    def _add_columns(self, conn: psycopg.Connection[Any]) -> None:
        self._add_columns_to(conn, self.table, UPGRADE_COLUMNS)

    def _add_columns_to(
        self,
        conn: psycopg.Connection[Any],
        table: sql.Identifier,
        columns: Sequence[tuple[str, str]],
    ) -> None:
        """``ALTER TABLE table ADD COLUMN IF NOT EXISTS ...`` for each of *columns* (name,
        definition), in one statement under a short lock timeout (:meth:`_alter`)."""
        parts = [
            sql.SQL(ADD_COLUMN).format(column=sql.Identifier(column)) + sql.SQL(definition)
            for column, definition in columns
        ]
        self._alter(conn, sql.SQL("ALTER TABLE {} ").format(table) + sql.SQL(", ").join(parts))

    def _missing_storage(self, state: SchemaState) -> dict[str, str]:
        """The autovacuum settings the table lacks (those it has are the operator's)."""
        present = {option.split("=", 1)[0] for option in state.options}
        return {name: value for name, value in STORAGE.items() if name not in present}

    def _lacks_storage(self, state: SchemaState) -> bool:
        # Only the owner may change them; an app whose role has DML only goes on
        # without (flask idempotency-init, run by the owner, sets them).
        return state.owned and bool(self._missing_storage(state))

    def _set_storage(self, conn: psycopg.Connection[Any]) -> None:
        # SHARE UPDATE EXCLUSIVE: claims go on; it only waits for a running VACUUM,
        # which gives way to it.
        missing = self._missing_storage(self.state(conn))
        storage = _storage(missing)
        self._alter(conn, sql.SQL(SET_STORAGE).format(table=self.table, storage=storage))

    def _has_status_check(self, state: SchemaState) -> bool:
        # the owner's to drop, as the storage settings are theirs to set
        return state.owned and bool(state.status_checks)

    def _drop_status_check(self, conn: psycopg.Connection[Any]) -> None:
        # ACCESS EXCLUSIVE for a moment (a catalog change, nothing is scanned), under a
        # short lock timeout like ADD COLUMN; on Citus, propagated to the shards.
        for name in sorted(self.state(conn).status_checks):
            drop = sql.SQL(DROP_CONSTRAINT).format(table=self.table, name=sql.Identifier(name))
            self._alter(conn, drop)

    def _alter(self, conn: psycopg.Connection[Any], alter: sql.Composed) -> None:
        """Run *alter* under a short lock timeout, trying again while a long
        transaction holds the table, rather than queueing every claim behind it (on
        the request path, until its deadline)."""
        for tries_left in range(LOCK_TRIES - 1, -1, -1):
            try:
                with conn.transaction():
                    timeout = f"{int(LOCK_TIMEOUT_SECONDS * 1000)}ms"
                    conn.execute(LOCK_TIMEOUT, {"timeout": timeout}, prepare=False)
                    conn.execute(alter, prepare=False)
                return
            except errors.LockNotAvailable:
                late = self._deadline is not None and time.monotonic() > self._deadline
                if not tries_left or late:
                    raise
                logger.warning(
                    "upgrading table %s: a long transaction holds it; trying again", self.name
                )
                time.sleep(0.1)

    def _citus(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the database has the citus extension (the tables are made for it)."""
        return self.state(conn).citus

    def _lacks_distribution(self, state: SchemaState) -> bool:
        return bool(self._undistributed(state))

    def _undistributed(self, state: SchemaState) -> list[str]:
        """On Citus, the tables that exist and are not distributed yet, keys first (the
        others are co-located with it); [] without Citus."""
        if not state.citus:
            return []
        names = [self._regclass[part] for part in self._table_regclass.values()]
        return [n for n in names if n not in state.missing and n not in state.distributed]

    def _distribute(self, conn: psycopg.Connection[Any]) -> None:
        """The keys, jobs and audit tables distributed by tenant, the keys co-located
        with ``IDEMPOTENCY_COLOCATE_WITH`` (or in Citus's default group) and the other two
        with the keys; the heartbeats a reference table (SPEC §22)."""
        state = self.state(conn)
        table, jobs, audit, heartbeats, tombstones = (
            self._regclass[part] for part in ("table", "jobs", "audit", "heartbeats", "tombstones")
        )
        colocate = {
            table: self.colocate_with or "default",
            jobs: self._regclass["table"],
            audit: self._regclass["table"],
            tombstones: self._regclass["table"],
        }
        tenant_type = self._tenant_type(conn)
        for name in self._undistributed(state):
            if name == heartbeats:
                conn.execute(REFERENCE, {"table": name}, prepare=False)
                continue
            if tenant_type is not None:
                # the name is the regclass text of _regclass: every part quoted already;
                # the type is format_type()'s, as PostgreSQL writes it
                alter = f"ALTER TABLE {name} ALTER COLUMN tenant TYPE {tenant_type}"
                conn.execute(sql.SQL(alter), prepare=False)
            conn.execute(DISTRIBUTE, {"table": name, "with": colocate[name]}, prepare=False)
            logger.info("distributed table %s on Citus", name)

    def _tenant_type(self, conn: psycopg.Connection[Any]) -> str | None:
        """The type the tenant columns take to be co-located with
        ``IDEMPOTENCY_COLOCATE_WITH`` on Citus: its distribution column's, when that is
        another type of text than ``text`` (``varchar(64)``, what Flask-SQLAlchemy's
        ``Mapped[str]`` makes; Citus co-locates only columns of one type), else None.

        :raises StoreError: the table is not a distributed table, or its distribution
            column is not text: one line naming it, before anything is made.
        """
        if self.colocate_with is None or self.colocate_with in ("default", "none"):
            return None
        row = conn.execute(COLOCATED_TENANT, {"table": self.colocate_with}, prepare=False)
        found = row.fetchone()
        if found is None:
            raise StoreError(
                f"IDEMPOTENCY_COLOCATE_WITH = {self.colocate_with!r}: no such distributed table"
                " (create_distributed_table it first, by its tenant column)",
                outage=False,
            )
        column, type_name, category = found
        if category != "S":
            raise StoreError(
                f"IDEMPOTENCY_COLOCATE_WITH = {self.colocate_with!r}: its distribution column"
                f" {column} is {type_name}, and the extension's tenant column is text; Citus"
                " co-locates only columns of one type: distribute that table by a text"
                " column, or leave IDEMPOTENCY_COLOCATE_WITH unset. Nothing was created.",
                outage=False,
            )
        return None if type_name == "text" else str(type_name)

    def _lacks_claim_function(self, state: SchemaState) -> bool:
        # the tables exist (distributed by the step before it, if they are not yet)
        return (
            state.citus
            and self._function_name is not None
            and not state.claim_function
            and not {self._regclass["table"], self._regclass["tombstones"]} & state.missing
        )

    def _add_claim_function(self, conn: psycopg.Connection[Any]) -> None:
        """On Citus, the shard's check (statements_citus.HERE_FUNCTION, on every node),
        then the common finish and the new-key claim as functions delegated to the shard's
        node (COMPLETE_FUNCTION and CLAIM_FUNCTION), their tenant argument of the tenant
        column's type, co-located with the keys. The claim's is made last: it is the one a
        look finds (CITUS_STATE), so all three exist once it does."""
        table = self._regclass["table"]
        row = conn.execute(TENANT_TYPE, {"table": table}, prepare=False).fetchone()
        assert row is not None and self.claim_function_name is not None
        here = sql.SQL(HERE_FUNCTION).format(
            function=self.here_function_name,
            table_name=sql.Literal(self._regclass["table"]),
            tenant_type=sql.SQL(row[0]),
        )
        conn.execute(here, prepare=False)
        params = {"function": self._here_name, "table": table}
        conn.execute(PROPAGATE_FUNCTION, params, prepare=False)
        made = (
            (COMPLETE_FUNCTION, self.complete_function_name, self._complete_name),
            (CLAIM_FUNCTION, self.claim_function_name, self._function_name),
        )
        for text, function, name in made:
            create = sql.SQL(text).format(
                function=function,
                table_name=sql.Literal(self._regclass["table"]),
                tombstones_name=sql.Literal(self._regclass["tombstones"]),
                tenant_type=sql.SQL(row[0]),
                here_function=self.here_function_name,
            )
            conn.execute(create, prepare=False)
            params = {"function": name, "table": table}
            conn.execute(DISTRIBUTE_FUNCTION, params, prepare=False)
        logger.info("created the claim and finish functions of table %s on Citus", self.name)

    def _lacks_jobs(self, state: SchemaState) -> bool:
        return bool({self._regclass["jobs"], self._regclass["jobs_index"]} & state.missing)

    def _create_jobs(self, conn: psycopg.Connection[Any]) -> None:
        # Shared by every app of the database: another app may create it right now.
        # With its index of ordered jobs, built at once on the new (empty) table.
        # (An earlier release's table keeps its layout here: its steps upgrade it.)
        order_index = sql.Identifier(self._jobs_order_index)
        with _unless_created_meanwhile(), conn.transaction():
            row = conn.execute(
                "SELECT to_regclass(%s) IS NULL", [self._regclass["jobs"]], prepare=False
            ).fetchone()
            conn.execute(
                sql.SQL(JOBS_SCHEMA).format(
                    jobs=self.jobs,
                    jobs_due_index=sql.Identifier(self._jobs_index),
                    jobs_key=sql.SQL(JOBS_KEY_DISTRIBUTED if self._citus(conn) else JOBS_KEY),
                ),
                prepare=False,
            )
            if row is not None and row[0]:
                create = sql.SQL(CREATE_INDEX).format(name=order_index)
                order = sql.SQL(JOBS_ORDER_INDEX).format(jobs=self.jobs)
                conn.execute(create + order, prepare=False)

    def _lacks_job_columns(self, state: SchemaState) -> bool:
        if self._regclass["jobs"] in state.missing:
            return False  # the jobs table step creates it with them
        return any(column not in state.job_columns for column, _ in UPGRADE_JOB_COLUMNS)

    def _add_job_columns(self, conn: psycopg.Connection[Any]) -> None:
        # Claims that stage jobs insert into this table: the same short lock timeout.
        self._add_columns_to(conn, self.jobs, UPGRADE_JOB_COLUMNS)

    def _lacks_job_seq(self, state: SchemaState) -> bool:
        if self._regclass["jobs"] in state.missing:
            return False  # the jobs table step creates it with it
        return "seq" not in state.job_columns

    def _add_job_seq(self, conn: psycopg.Connection[Any]) -> None:
        """The ``seq`` column of ordered jobs (a catalog change, under a short lock timeout)."""
        self._alter(conn, sql.SQL(JOBS_SEQ_COLUMN).format(jobs=self.jobs))

    def _lacks_job_order(self, state: SchemaState) -> bool:
        index = self._jobs_order_index
        return self._regclass["jobs_order_index"] in state.missing or index in state.invalid

    def _add_job_order(self, conn: psycopg.Connection[Any]) -> None:
        """The ``seq`` column and its index, built concurrently (a failed build's invalid
        index dropped first). The jobs table is shared by every app of the database:
        one process of them at a time builds it (two concurrent builds of one table
        would wait for each other)."""
        self._add_job_seq(conn)
        _poll_lock(conn, self._jobs_lock, self._deadline, "the jobs table")
        try:
            if not self._lacks_job_order(self.state(conn)):
                return  # another app's process built it meanwhile
            index = sql.Identifier(self._jobs_order_index)
            schema = self._jobs_schema
            qualified = sql.Identifier(schema, self._jobs_order_index) if schema else index
            conn.execute(sql.SQL(DROP_INDEX_CONCURRENTLY).format(name=qualified), prepare=False)
            create = sql.SQL(CREATE_INDEX_CONCURRENTLY).format(name=index)
            conn.execute(create + sql.SQL(JOBS_ORDER_INDEX).format(jobs=self.jobs), prepare=False)
        finally:
            _unlock(conn, self._jobs_lock)

    def _lacks_console(self, state: SchemaState) -> bool:
        names = ("audit", "audit_index", "heartbeats")
        return bool({self._regclass[name] for name in names} & state.missing)

    def _create_console(self, conn: psycopg.Connection[Any]) -> None:
        # New tables only: nothing else waits on them. Shared by every app of the
        # database: another app may create them right now.
        with _unless_created_meanwhile(), conn.transaction():
            audit = sql.SQL(AUDIT_SCHEMA).format(
                audit=self.audit,
                audit_key_index=sql.Identifier(self._audit_index),
                audit_key=sql.SQL(AUDIT_KEY_DISTRIBUTED if self._citus(conn) else AUDIT_KEY),
            )
            conn.execute(audit, prepare=False)
            heartbeats = sql.SQL(HEARTBEATS_SCHEMA).format(heartbeats=self.heartbeats)
            conn.execute(heartbeats, prepare=False)

    def _lacks_tombstones(self, state: SchemaState) -> bool:
        names = ("tombstones", "tombstones_index")
        return bool({self._regclass[name] for name in names} & state.missing)

    def _create_tombstones(self, conn: psycopg.Connection[Any]) -> None:
        # A new table: nothing waits on it (a claim of this release reads it once it
        # exists; the step is SERVE, so it exists before this release serves).
        with _unless_created_meanwhile(), conn.transaction():
            tombstones = sql.SQL(TOMBSTONES).format(
                tombstones=self.tombstones,
                tombstones_index=sql.Identifier(self._tombstones_index),
            )
            conn.execute(tombstones, prepare=False)
            # on Citus, co-located with the keys at once if they are distributed already (an
            # upgrade); else the step that distributes the keys does it
            if self._regclass["table"] in self.state(conn).distributed:
                regclass = self._regclass["tombstones"]
                with_keys = {"table": regclass, "with": self._regclass["table"]}
                conn.execute(DISTRIBUTE, with_keys, prepare=False)

    def _wanted(self, index: str, citus: bool) -> bool:
        """Whether a table of this kind (on Citus or not) has *index*."""
        return index not in (self._plain_only if citus else self._citus_only)

    def _lacks_index(self, index: str) -> Callable[[SchemaState], bool]:
        return lambda state: (
            self._wanted(index, state.citus)
            and (self._regclass[index] in state.missing or index in state.invalid)
        )

    def _has_index(self, index: str, citus: bool | None = None) -> Callable[[SchemaState], bool]:
        """A step's test: *index* exists (and the table is on Citus or not, if *citus* says)."""
        return lambda state: (
            self._regclass[index] not in state.missing and (citus is None or state.citus == citus)
        )

    def _mark_unknown(self, conn: psycopg.Connection[Any]) -> None:
        # Unknown keys of an earlier release have no reconcile_due_at (NULL meant "due
        # now"); unknown_due_idx finds only those with one. One short UPDATE: unknown
        # keys are few, and the old unknown_idx finds them.
        with conn.transaction():
            conn.execute(sql.SQL(MARK_UNKNOWN_DUE).format(table=self.table), prepare=False)

    def _index_dropper(self, index: str) -> Callable[[psycopg.Connection[Any]], None]:
        def drop(conn: psycopg.Connection[Any]) -> None:
            # Concurrently: claims and finishes go on while it waits for them.
            conn.execute(self._index_sql(DROP_INDEX_CONCURRENTLY, index, ""), prepare=False)

        return drop

    def _index_builder(self, index: str) -> Callable[[psycopg.Connection[Any]], None]:
        def build(conn: psycopg.Connection[Any]) -> None:
            # A failed concurrent build leaves an invalid index under the name.
            conn.execute(self._index_sql(DROP_INDEX_CONCURRENTLY, index, ""), prepare=False)
            statement = self._index_sql(CREATE_INDEX_CONCURRENTLY, index, self.indexes[index])
            conn.execute(statement, prepare=False)

        return build

    def _index_sql(self, head: str, index: str, definition: str) -> sql.Composed:
        # CREATE INDEX names the index bare (it lives in its table's schema); DROP
        # INDEX needs the schema.
        schema = self.name.split(".")[0] if "." in self.name else None
        if schema is not None and head.startswith("DROP"):
            name = sql.Identifier(schema, index)
        else:
            name = sql.Identifier(index)
        return sql.SQL(head).format(name=name) + sql.SQL(definition).format(table=self.table)


def _try_lock(conn: psycopg.Connection[Any], lock: int) -> bool:
    row = conn.execute("SELECT pg_try_advisory_lock(%s)", [lock], prepare=False).fetchone()
    return bool(row and row[0])


def _unlock(conn: psycopg.Connection[Any], lock: int) -> None:
    if not conn.closed and not conn.broken:
        conn.execute("SELECT pg_advisory_unlock(%s)", [lock], prepare=False)


def _poll_lock(conn: psycopg.Connection[Any], lock: int, deadline: float | None, what: str) -> None:
    """Take the session advisory lock *lock*, asking again after a pause while another
    process holds it (never waiting inside a statement), until *deadline*.

    :raises SchemaBusy: not granted by *deadline*.
    """
    said = False
    while not _try_lock(conn, lock):
        if deadline is not None and time.monotonic() >= deadline:
            raise SchemaBusy(f"another process is changing the schema of {what}")
        if deadline is None and not said:
            logger.info("waiting for another process changing the schema of %s", what)
            said = True
        time.sleep(POLL_SECONDS if deadline is not None else BUILD_POLL_SECONDS)


@contextmanager
def _unless_created_meanwhile() -> Iterator[None]:
    """``CREATE TABLE IF NOT EXISTS`` of a table that another process creates at the same
    moment fails on the catalog's unique index: then it exists, which is what was asked."""
    try:
        yield
    except _CREATED_MEANWHILE as exc:
        logger.info("created by another process meanwhile: %s", " ".join(str(exc).split()))


@contextmanager
def _autocommit(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """*conn* in autocommit while the block runs (a pool passed in by the app may not be)."""
    if conn.autocommit:
        yield
        return
    conn.commit()
    conn.autocommit = True
    try:
        yield
    finally:
        if not conn.closed:
            conn.autocommit = False


def _storage(options: dict[str, str]) -> sql.Composed:
    """``name = value, ...`` of a ``WITH`` or ``SET`` (names and values are constants)."""
    return sql.SQL(", ").join(sql.SQL(f"{name} = {value}") for name, value in options.items())


def _quoted(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'
