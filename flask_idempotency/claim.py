"""The claimed key of the running request, and the ``current_idempotency`` proxy."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from flask import g
from werkzeug.local import LocalProxy

from . import tracing
from .config import RouteSettings
from .jobs import StagedJob, staged_job
from .model import ClaimOutcome, KeyStatus, StoredResponse
from .owned_connection import OwnedConnection

if TYPE_CHECKING:
    import psycopg

    from .store.postgres import HeldTransaction, PostgresStore

_G_NAME = "_idempotency_claim"

#: what ends the process under a claimed view or ``run_once`` rather than fails it: gunicorn
#: raises SystemExit from its signal handlers, at its worker timeout (SIGABRT) and quick
#: shutdown (SIGINT, SIGQUIT), in whatever the view was doing; a worker's warm shutdown too.
#: Nothing is stored: the claim is left to the owner's death (SPEC §20).
PROCESS_ENDING = (SystemExit, KeyboardInterrupt)


class ClaimedKey:
    """The idempotency key held by the running view, as ``current_idempotency``."""

    def __init__(
        self,
        tenant: str,
        key: str,
        outcome: ClaimOutcome,
        settings: RouteSettings,
        store: PostgresStore,
        *,
        protected: bool = True,
        pinned: HeldTransaction | None = None,
        trace: tracing.RequestTrace = tracing.NO_TRACE,
    ) -> None:
        #: the tenant the key belongs to (``""`` without a tenant loader)
        self.tenant = tenant
        #: the idempotency key, unquoted
        self.key = key
        self.outcome = outcome
        self.settings = settings
        self.store = store
        #: False when the store was down and the view runs unprotected (fail-open)
        self.protected = protected
        #: set by :meth:`release`
        self.released = False
        #: an unhandled exception raised by the view, if any
        self.exception: BaseException | None = None
        #: the connection held for a ``transactional=True`` view, inside the claim's
        #: open transaction
        self.pinned = pinned
        #: what the view gets as :attr:`connection`: the pinned one, minus commit()
        self._owned = OwnedConnection(pinned.conn) if pinned is not None else None
        #: jobs staged outside any phase: they commit with the stored response
        self.jobs: list[StagedJob] = []
        #: jobs staged in the running phase: they commit with it
        self._phase_jobs: list[StagedJob] | None = None
        #: the key's ``expires_at`` once its attempt ended (None: not written)
        self.expires_at: datetime | None = None
        #: the request's spans (children of the span the request reached the view in)
        self.trace = trace
        #: ``db.session`` in the key's transaction (``flask_idempotency.sqlalchemy``), or None
        self.orm: Any = None

    @property
    def attempt(self) -> int:
        """1 on the first execution of the view for this key, n on the n-th takeover."""
        return self.outcome.attempt

    @property
    def recovery_point(self) -> str:
        """The name of the last committed phase (``"started"`` on a fresh key)."""
        return self.outcome.recovery_point

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """The claim's psycopg connection, inside its open transaction (views decorated
        with ``transactional=True`` only). The view's writes on it commit together with
        the stored response, once. Its transaction belongs to the key: ``commit()``,
        ``rollback()``, ``close()`` and setting ``autocommit`` raise an
        :class:`IdempotencyError`; savepoints (``connection.transaction()``) work."""
        if self._owned is None:
            raise RuntimeError(
                "current_idempotency.connection exists only in views decorated with"
                " @idempotency.idempotent(transactional=True); use"
                " current_idempotency.phase(name) for committed steps in other views."
            )
        return cast("psycopg.Connection[Any]", self._owned)

    @contextmanager
    def phase(self, name: str) -> Iterator[psycopg.Connection[Any]]:
        """Run a block in one transaction on a pooled connection that commits the
        block's writes together with ``recovery_point = name``, fenced by the attempt.

        An attempt that takes the key over after a crash sees the last committed
        :attr:`recovery_point` and can resume from there::

            if current_idempotency.recovery_point == "started":
                with current_idempotency.phase("payment_created") as conn:
                    conn.execute("INSERT INTO payments ...")

        :raises AttemptSuperseded: another attempt owns the key; nothing commits.
        """
        if self.pinned is not None:
            raise RuntimeError(
                "a transactional view is one transaction already; phases are for views"
                " without transactional=True"
            )
        if self._phase_jobs is not None:
            raise RuntimeError("phases do not nest: end the running phase first")
        jobs: list[StagedJob] = []
        self._phase_jobs = jobs
        try:
            with self.trace.span(tracing.PHASE, current=True, phase=name) as span:
                with self.store.phase(
                    self.tenant, self.key, self.outcome, name, lease=self.settings.lease, jobs=jobs
                ) as conn:
                    yield conn
                span.decided("committed", self.attempt)
        finally:
            self._phase_jobs = None
        self.outcome = dataclasses.replace(self.outcome, recovery_point=name)

    def stage(self, name: str, payload: Any = None, *, ordered: bool = False) -> str:
        """Record a job that becomes real exactly when the state it belongs to commits:
        with the stored response (or a transactional view's transaction), or, inside
        ``phase(...)``, with that phase. An attempt that rolls back, is released, raises
        or is fenced stages nothing. ``flask idempotency-dispatch`` hands committed jobs
        to the registered dispatcher.

        :param name: the job's name (a Celery task name, say): 1-255 printable characters.
        :param payload: any JSON-serialisable value.
        :param ordered: hand this job over only after every ordered job this key staged
            before it was handed over; while one of those fails (or is dead) this one
            waits. The order is the order the jobs committed in (a phase's jobs before
            the response's, attempt after attempt) and, within one commit, the order of
            the ``stage()`` calls. Unordered jobs never wait.
        :returns: the job's id, stable across hand-overs (the Celery task id).
        :raises TypeError: *payload* is not JSON-serialisable (NaN included), or
            *ordered* is not a bool, at once.
        """
        job = staged_job(name, payload, ordered)
        (self._phase_jobs if self._phase_jobs is not None else self.jobs).append(job)
        return job.id

    def release(self) -> None:
        """End this attempt as retryable: nothing happened, a retry may run the view
        again. The response is still sent, but not stored."""
        self.released = True

    def downstream_key(self, name: str) -> str:
        """A key derived from this claim, the same on every attempt, to pass to a
        payment provider or any other idempotent downstream API.

        Different *name*\\ s give different keys; a key used afresh after it expired
        gives new ones.
        """
        return derived_key(self.tenant, self.key, self.outcome.generation, name)

    def __repr__(self) -> str:
        return f"<ClaimedKey tenant={self.tenant!r} key={self.key!r} attempt={self.attempt}>"


def derived_key(tenant: str, key: str, generation: int, name: str) -> str:
    """The downstream key *name* of a key: the same on every attempt (and for its
    reconciler), new when the key is used afresh after it expired."""
    material = "\x00".join((tenant, key, str(generation), name))
    return hashlib.sha256(material.encode()).hexdigest()


def set_claim(claim: ClaimedKey, orm: Any = None) -> None:
    """Make *claim* the request's; with *orm* (the app's
    :class:`~.sqlalchemy.KeyTransactions`), a transactional view's ``db.session`` joins
    the key's transaction until the attempt ends."""
    if orm is not None and claim.pinned is not None:
        claim.orm = orm.join(claim.pinned.conn)
    setattr(g, _G_NAME, claim)


def peek_claim() -> ClaimedKey | None:
    """The claim of this request, if it holds one."""
    return cast("ClaimedKey | None", g.get(_G_NAME))


def pop_claim() -> ClaimedKey | None:
    """Take the claim off the request so that it is finished once only."""
    return cast("ClaimedKey | None", g.pop(_G_NAME, None))


def _current() -> ClaimedKey:
    claim = g.get(_G_NAME) if g else None
    if claim is None:
        raise RuntimeError(
            "current_idempotency is only available inside a view decorated with"
            " @idempotency.idempotent that received an idempotency key."
        )
    return cast(ClaimedKey, claim)


#: The :class:`ClaimedKey` of the running idempotent view.
current_idempotency: ClaimedKey = cast(ClaimedKey, LocalProxy(_current))


def finish_attempt(
    claim: ClaimedKey,
    status: KeyStatus,
    response: StoredResponse | None = None,
    *,
    jobs: Sequence[StagedJob] = (),
    pinned: HeldTransaction | None = None,
    commit: bool = False,
) -> bool:
    """End *claim*'s attempt with *status* (one fenced UPDATE, waking waiting twins when
    the route waits): False if a newer attempt owns the key. The key's new
    ``expires_at`` is kept in ``claim.expires_at`` (``Idempotency-Key-Expires``).
    With *pinned* and *commit*, the pinned transaction commits in the same round trip.

    :raises StoreError: the store failed.
    :raises EncryptionError: *response* could not be sealed; nothing was written.
    """
    claim.expires_at = claim.store.finish(
        claim.tenant,
        claim.key,
        claim.outcome,
        status,
        ttl=claim.settings.ttl,
        response=response,
        notify=claim.settings.wait > 0,
        jobs=jobs,
        pinned=pinned,
        commit=commit,
    )
    return claim.expires_at is not None


def forget_attempt(claim: ClaimedKey) -> bool:
    """End *claim*'s attempt, a fresh claim, by deleting its key: as if never used (a
    release status). False if fenced (a newer attempt owns the key).

    :raises StoreError: the store failed.
    """
    return claim.store.forget(
        claim.tenant, claim.key, claim.outcome, notify=claim.settings.wait > 0
    )
