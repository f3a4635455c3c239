"""Flask-SQLAlchemy in the key's transaction (SPEC §17), and the Alembic hook that keeps
autogenerate away from the extension's tables.

``Idempotency(app, sqlalchemy=db)`` makes :class:`KeyTransactions` for the app. In a
``transactional=True`` view, ``db.session`` is a session of the key's transaction: an
SQLAlchemy ``Connection`` on the claim's own psycopg connection, joined in savepoint mode
(``join_transaction_mode="create_savepoint"``), so the view's flushes and its
``db.session.commit()`` go into the key's transaction and become durable only with the
stored answer; ``db.session.rollback()`` goes back to the savepoint. Outside such views
``db.session`` is the app's own, untouched.

How the join holds (each point a trap a hand-written join falls into):

- SQLAlchemy gets the claim's connection through a small DBAPI wrapper whose ``commit``,
  ``rollback`` and ``close`` do nothing: the pool's reset-on-return, a closed
  ``Connection`` and a ``NullPool`` would otherwise end or close the key's transaction.
  Its ``add_notice_handler`` does nothing either: the psycopg dialect adds one on every
  connect, and they would pile up on the pooled connection.
- The engine of the join is the app's URL with ``use_native_hstore=False`` (the dialect's
  hstore probe needs the bare psycopg connection) and a ``NullPool``; one per app and
  process, made on first use.
- Flask-SQLAlchemy's ``Session.get_bind`` ignores ``bind=``: the key's session maps the
  default engine to the key's connection, and leaves the other bind keys
  (``SQLALCHEMY_BINDS``) on their own engines.
- ``expire_on_commit`` is off in the key's session, so objects the view returns stay
  readable after its final commit.
- When the view returns, what it only flushed is committed into the key's transaction
  (a savepoint-mode session that is closed rolls its savepoint back).

What the join sends (``python -m bench.orm --counted``): the claim with its ``BEGIN``, the
view's statements, the finish with its ``COMMIT``; as many round trips as the view's own
statements plus two. The savepoints cost none of their own (the key engine's dialect,
:func:`_key_dialect_class`): a ``SAVEPOINT`` goes in the round trip of the first statement
that runs in it (psycopg's pipeline mode; one that nothing ran in is never sent), and once
the view has returned none is begun or released, nor rolled back to when the key rolls
back, since the key's own end (the ``COMMIT`` with the answer, or a ``ROLLBACK``) comes
next and decides for all of them. A savepoint the view releases (its own
``db.session.commit()``) is released at once, as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from flask import current_app, has_app_context

from .errors import ConfigError

if TYPE_CHECKING:
    import sqlalchemy as sa
    from sqlalchemy import orm

__all__ = ["KeyTransactions", "include_object"]

logger = logging.getLogger("flask_idempotency")

#: the claim's psycopg connection, wrapped, for the join's engine to hand to SQLAlchemy
_KEY_CONNECTION: contextvars.ContextVar[Any] = contextvars.ContextVar("idempotency_key_connection")
#: where the key's SQLAlchemy ``Connection`` keeps its :class:`_KeyConnection` (its ``info``)
_KEY_INFO = "flask_idempotency.key"

#: the tables' default names (SPEC §17: the hook skips these and the configured ones)
DEFAULT_TABLES = (
    "idempotency_keys",
    "idempotency_jobs",
    "idempotency_audit",
    "idempotency_heartbeats",
)
_TABLE_SETTINGS = (
    "IDEMPOTENCY_TABLE",
    "IDEMPOTENCY_JOBS_TABLE",
    "IDEMPOTENCY_AUDIT_TABLE",
    "IDEMPOTENCY_HEARTBEATS_TABLE",
)


class _KeyConnection:
    """The claim's psycopg connection as SQLAlchemy's DBAPI connection: everything passes
    through but what would end the key's transaction or pile up on the connection; and
    what the key's session's savepoints need sent, and when (:func:`_key_dialect_class`)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        #: the savepoints SQLAlchemy began that nothing ran in yet: (name, SQL), sent in
        #: the round trip of the next statement
        self.pending: list[tuple[str, str]] = []
        #: the savepoints begun after the view returned: never sent (nothing needs them)
        self.unsent: set[str] = set()
        #: True once the view returned: the key's own end follows (the ``COMMIT`` with the
        #: answer, or a ``ROLLBACK``) and ends every savepoint
        self.ending = False
        #: True once the key's transaction is known to roll back
        self.rolls_back = False
        #: True if something was rolled back to an unsent savepoint: only the key's
        #: ``ROLLBACK`` can undo it
        self.spoiled = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def commit(self) -> None:
        """The key's transaction commits with the stored answer, never here."""

    def rollback(self) -> None:
        """A view's rollback goes to its savepoint (SQL); the key's ends with the key."""

    def close(self) -> None:
        """The connection is the key's, and goes back to the extension's pool."""

    def add_notice_handler(self, handler: Any) -> None:
        """Not added: one would pile up on the pooled connection per request."""

    # -- savepoints ----------------------------------------------------------------------

    def begin_savepoint(self, name: str, command: str) -> None:
        """SQLAlchemy begins savepoint *name* (*command*, its SQL): sent with the next
        statement, or never once the view returned."""
        if self.ending:
            self.unsent.add(name)
        else:
            self.pending.append((name, command))

    @contextlib.contextmanager
    def pending_first(self) -> Iterator[None]:
        """A block whose statement goes in one round trip with the pending ``SAVEPOINT``
        commands (psycopg's pipeline mode: no answer is waited for until its end)."""
        if not self.pending:
            yield
            return
        pending, self.pending = self.pending, []
        with self._conn.pipeline():
            for _, command in pending:
                self._conn.execute(command, prepare=False)
            yield

    def release_needs_sql(self, name: str) -> bool:
        """True if releasing savepoint *name* must be sent: it was sent, and the view
        is still running (afterwards the key's own end ends it)."""
        return not self._forget(name) and not self.ending

    def rollback_needs_sql(self, name: str) -> bool:
        """True if rolling back to savepoint *name* must be sent: it was sent, and the
        key's transaction may still commit."""
        if name in self.unsent:
            self.spoiled = True
        return not self._forget(name) and not self.rolls_back

    def _forget(self, name: str) -> bool:
        """True if savepoint *name* was never sent (nothing ran in it, or it was begun
        after the view): it is forgotten, with those begun after it. Ending one that was
        sent ends those begun after it too."""
        if name in self.unsent:
            self.unsent.discard(name)
            return True
        names = [pending for pending, _ in self.pending]
        if name in names:
            del self.pending[names.index(name) :]
            return True
        self.pending.clear()
        return False


def _key_of(connection: Any) -> _KeyConnection | None:
    """The key's DBAPI connection under an SQLAlchemy ``Connection`` of the key's engine
    (None while :meth:`KeyTransactions.join` makes it: the dialect's first queries)."""
    try:
        key = connection.info.get(_KEY_INFO)
    except NotImplementedError:  # the ad hoc connection of the engine's first connect
        return None
    return key if isinstance(key, _KeyConnection) else None


def _pending_first(context: Any) -> contextlib.AbstractContextManager[None]:
    """The block of a statement of the key's session: its pending savepoints first."""
    key = _key_of(context.root_connection) if context is not None else None
    if key is None or not key.pending:
        return contextlib.nullcontext()
    return key.pending_first()


_DIALECT_CLASSES: dict[type, type] = {}


def _key_dialect_class(base: type) -> type:
    """*base* (the app's psycopg dialect), whose savepoints on the key's connection cost
    no round trip of their own: a ``SAVEPOINT`` waits for the first statement that runs in
    it and goes in its round trip (one nothing ran in is never sent, nor released, nor
    rolled back to). Once the view returned, the key's ``COMMIT`` or ``ROLLBACK`` comes
    next and decides for everything: no savepoint is begun (the final flush's: a failure
    there rolls the key back), none released, none rolled back to when the key rolls back.
    A savepoint released in the view is released at once: savepoints left open would nest,
    and past 64 a transaction's subtransactions slow every snapshot."""
    made = _DIALECT_CLASSES.get(base)
    if made is None:
        from sqlalchemy.sql.expression import SavepointClause

        class KeyDialect(base):  # type: ignore[misc]
            supports_statement_cache = True  # SQLAlchemy asks each subclass to say so

            def do_savepoint(self, connection: Any, name: str) -> None:
                key = _key_of(connection)
                if key is None:
                    super().do_savepoint(connection, name)
                else:
                    clause = SavepointClause(name)  # type: ignore[no-untyped-call]
                    command = str(clause.compile(dialect=self))
                    key.begin_savepoint(name, command)

            def do_release_savepoint(self, connection: Any, name: str) -> None:
                key = _key_of(connection)
                if key is None or key.release_needs_sql(name):
                    super().do_release_savepoint(connection, name)

            def do_rollback_to_savepoint(self, connection: Any, name: str) -> None:
                key = _key_of(connection)
                if key is None or key.rollback_needs_sql(name):
                    super().do_rollback_to_savepoint(connection, name)

            def do_execute(
                self, cursor: Any, statement: Any, parameters: Any, context: Any = None
            ) -> None:
                with _pending_first(context):
                    super().do_execute(cursor, statement, parameters, context)

            def do_executemany(
                self, cursor: Any, statement: Any, parameters: Any, context: Any = None
            ) -> None:
                with _pending_first(context):
                    super().do_executemany(cursor, statement, parameters, context)

            def do_execute_no_params(
                self, cursor: Any, statement: Any, context: Any = None
            ) -> None:
                with _pending_first(context):
                    super().do_execute_no_params(cursor, statement, context)

        made = _DIALECT_CLASSES[base] = KeyDialect
    return made


class JoinedSession:
    """The key's session of one view, and how it ends."""

    def __init__(
        self,
        join: KeyTransactions,
        connection: sa.Connection,
        session: orm.Session,
        previous: orm.Session | None,
    ):
        self._join = join
        self.bound = connection
        self.session = session
        #: the app's session of this scope before the view, given back at the end
        self._previous = previous
        self._key = _key_of(connection)

    def commit(self) -> None:
        """Flush and commit the view's work into the key's transaction, once the view has
        returned; the key's ``COMMIT`` comes with the stored answer (and ends the
        savepoint, which is not released on its own).

        :raises Exception: the flush failed (a constraint, a type): the caller rolls the
            key's transaction back.
        """
        key = self._key
        if key is not None:
            key.ending = True
        self.session.commit()
        if key is not None and key.spoiled:
            raise RuntimeError(
                "the key's session rolled back to a savepoint after the view returned:"
                " only the key's transaction's rollback can undo what ran in it"
            )

    def close(self, key_commits: bool = True) -> None:
        """End the key's session (rolling back to its savepoint what was not committed,
        unless the key's transaction rolls back anyway: *key_commits* False) and give
        ``db.session`` back to the app. Never raises: the key's transaction ends anyway,
        on its own connection."""
        if self._key is not None and not key_commits:
            self._key.rolls_back = True
        try:
            self.session.close()
            self.bound.close()
        except Exception as exc:  # a connection that died under the view
            logger.debug("closing the key's SQLAlchemy session: %s", exc)
        finally:
            self._join.restore(self._previous)


class KeyTransactions:
    """Joins an app's Flask-SQLAlchemy ``db.session`` (or a ``scoped_session``) to the
    key's transaction of ``transactional=True`` views.

    :raises ConfigError: *target* is neither, or its engine is not psycopg 3.
    """

    def __init__(self, target: Any, url: sa.URL) -> None:
        from sqlalchemy.orm import scoped_session

        self._db = target if hasattr(type(target), "engines") else None
        scoped = target.session if self._db is not None else target
        if not isinstance(scoped, scoped_session):
            raise ConfigError(
                "sqlalchemy= takes a Flask-SQLAlchemy SQLAlchemy object or a SQLAlchemy"
                f" scoped_session, not {type(target).__name__}."
            )
        self._scoped: scoped_session[Any] = scoped
        if url.get_backend_name() != "postgresql" or url.get_driver_name() != "psycopg":
            raise ConfigError(
                "the SQLAlchemy engine must use psycopg 3 to share the key's transaction:"
                f" its URL uses {url.drivername!r}; write 'postgresql+psycopg://...'"
                " (pip install 'psycopg[binary]')."
            )
        self._url = url
        self._engine: sa.Engine | None = None

    @classmethod
    def for_app(cls, app: Any, target: Any) -> KeyTransactions:
        """The join for *app*; the engine's URL read from its config (Flask-SQLAlchemy's
        ``SQLALCHEMY_DATABASE_URI``) or from the ``scoped_session``'s bind."""
        from sqlalchemy.engine import make_url

        if hasattr(type(target), "engines"):
            uri = app.config.get("SQLALCHEMY_DATABASE_URI")
            if not uri:
                raise ConfigError(
                    "sqlalchemy=db needs SQLALCHEMY_DATABASE_URI in the app's config"
                    " (a 'postgresql+psycopg://' URL)."
                )
            return cls(target, make_url(uri))
        bind = getattr(target, "session_factory", None)
        engine = bind.kw.get("bind") if bind is not None else None
        if engine is None:
            raise ConfigError("sqlalchemy= got a scoped_session without a bind engine.")
        return cls(target, engine.url)

    def _key_engine(self) -> sa.Engine:
        if self._engine is None:
            from sqlalchemy import create_engine
            from sqlalchemy.pool import NullPool

            engine = create_engine(
                self._url,
                creator=lambda: _KEY_CONNECTION.get(),
                poolclass=NullPool,
                use_native_hstore=False,
            )
            engine.dialect.__class__ = _key_dialect_class(type(engine.dialect))
            self._engine = engine
        return self._engine

    def join(self, conn: Any) -> JoinedSession:
        """Make ``db.session`` a session of the key's transaction on *conn* (the claim's
        psycopg connection, in its open transaction) until the view ends."""
        key = _KeyConnection(conn)
        _KEY_CONNECTION.set(key)
        connection = self._key_engine().connect()
        connection.info[_KEY_INFO] = key
        connection.begin()  # no SQL: the key's transaction is open already
        default = self._default_engine()
        factory = self._scoped.session_factory
        options = {**factory.kw, "join_transaction_mode": "create_savepoint"}
        options["expire_on_commit"] = False
        session = _key_session_class(factory.class_)(
            key_connection=connection, default_engine=default, **options
        )
        registry = self._scoped.registry
        joined = JoinedSession(self, connection, session, registry() if registry.has() else None)
        registry.set(session)
        return joined

    def restore(self, previous: orm.Session | None) -> None:
        """Give ``db.session`` back: the app's session from before the view, or none."""
        registry = self._scoped.registry
        if previous is not None:
            registry.set(previous)
        else:
            registry.clear()

    def _default_engine(self) -> Any:
        if self._db is not None:
            return self._db.engines.get(None)
        return self._scoped.session_factory.kw.get("bind")


_SESSION_CLASSES: dict[type, type] = {}


def _key_session_class(base: type) -> type:
    """*base* (the app's session class), with the default engine mapped to the key's
    connection: Flask-SQLAlchemy's ``get_bind`` picks engines by bind key and ignores
    ``bind=``."""
    made = _SESSION_CLASSES.get(base)
    if made is None:

        class KeySession(base):  # type: ignore[misc]
            def __init__(self, *args: Any, key_connection: Any, default_engine: Any, **kw: Any):
                super().__init__(*args, **kw)
                self._key_connection = key_connection
                self._key_default = default_engine

            def get_bind(self, *args: Any, **kw: Any) -> Any:
                chosen = super().get_bind(*args, **kw)
                if chosen is self._key_default or self._key_default is None:
                    return self._key_connection
                return chosen  # another bind key's engine: not the key's transaction

        made = _SESSION_CLASSES[base] = KeySession
    return made


# -- Alembic ---------------------------------------------------------------------------


def include_object(
    object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """An Alembic ``include_object`` hook: False for the extension's tables (the default
    names, and the names the current app configures) and their indexes, so that
    ``flask db migrate`` / ``alembic revision --autogenerate`` proposes nothing for them::

        from flask_idempotency.sqlalchemy import include_object
        context.configure(connection=connection, target_metadata=target_metadata,
                          include_object=include_object)
    """
    if type_ == "table":
        return not _ours(name, getattr(object, "schema", None))
    table = getattr(object, "table", None)
    if (
        type_ in ("index", "unique_constraint", "column", "foreign_key_constraint")
        and table is not None
    ):
        return not _ours(table.name, table.schema)
    return True


#: what autogenerate compares inside a table: skipped with the table
_TABLE_PARTS = ("index", "unique_constraint", "column", "foreign_key_constraint")


def _ours(name: str | None, schema: str | None) -> bool:
    if name is None:
        return False
    names = set(DEFAULT_TABLES)
    if has_app_context():
        config: Mapping[str, Any] = current_app.config
        names.update(str(config[key]) for key in _TABLE_SETTINGS if config.get(key))
    qualified = f"{schema}.{name}" if schema else name
    return name in names or qualified in names
