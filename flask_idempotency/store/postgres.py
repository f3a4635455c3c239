"""PostgresStore: the request path's statements of :mod:`.statements_request`.

A new key costs two statements, each its own transaction: the *claim* (read the row;
when the view must run, take a transaction-scoped advisory lock and insert the
``processing`` row: one round trip, no lock outlives it, PgBouncer-safe) and the *finish*
(one UPDATE fenced by the attempt). A replay is the claim alone. The claim's first look
(CLAIM_FIRST) decides a new or settled key; a key in flight, retryable, unknown or expired
is decided by a second statement (CLAIM), which takes it over when it must.
What a request does with the answers is :mod:`..handler`'s and :mod:`..ending`'s; the
pool and the execution path are :mod:`.execution`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from ..config import RouteSettings, Settings
from ..errors import AttemptSuperseded, StoreError
from ..jobs import StagedJob
from ..keys import lock_id
from ..model import ClaimOutcome, KeyStatus, StoredResponse
from ..stored_request import StoredRequest
from .execution import Execution, HeldTransaction, bounded_transaction
from .owner import GRACE_SECONDS, AnswerKept, Claiming, Owner
from .pool import bounded, is_connection_lost, store_errors
from .records import job_params
from .rows import claim_outcome
from .sealing import refused, unreadable
from .shard_hints import DirectStatements, Shard, ShardHints
from .statement import Statement, execute
from .statements_citus import CLAIM as CLAIM_CITUS
from .statements_citus import (
    CLAIM_CALL,
    CLAIM_NEW,
    COMPLETE_CALL,
    DIRECT_COMPLETE,
    DIRECT_FIRST,
    FINISH_CITUS,
    LOCK_IS_MINE_CITUS,
    OWNER_FREE,
    RENEW_CITUS,
    SHARD_NODE,
    owners_since,
)
from .statements_citus import CLAIM_FIRST as CLAIM_FIRST_CITUS
from .statements_request import (
    ADVANCE,
    ASYNC_CLAIM,
    ASYNC_COMMIT,
    CLAIM,
    CLAIM_FIRST,
    COMPLETE,
    DEFER,
    DISOWN,
    FINISH,
    FINISHED,
    FORGET,
    KEY_STATUS,
    STAGE_JOBS,
)

__all__ = ["HeldTransaction", "KeyAnswer", "PinnedClaim", "PostgresStore", "store_errors"]

logger = logging.getLogger("flask_idempotency")


@dataclasses.dataclass(frozen=True)
class PinnedClaim:
    """A transactional view's claim: what it decided, and the transaction it holds
    when it owns the key (else None: the connection went back at once)."""

    outcome: ClaimOutcome
    held: HeldTransaction | None


@dataclasses.dataclass(frozen=True)
class KeyAnswer:
    """What a key's ``Location`` answers: its status, stored response (opened if
    sealed) and expiry."""

    status: KeyStatus
    response: StoredResponse | None
    expires_at: datetime | None


class PostgresStore(Execution):
    """The request path's statements, on :class:`~.execution.Execution`'s pool."""

    def __init__(self, settings: Settings, pool: ConnectionPool[Any] | None = None) -> None:
        super().__init__(settings, pool)
        # The request path's statements, composed once: psycopg re-renders a Composed
        # on every execute, but caches the parsing of a plain string.
        notify = self._wake_twins()
        # A transactional view's claim joins the view's transaction, whose commit is
        # the view's own: it never commits asynchronously.
        self._claim_pinned_statement = Statement(self.render(CLAIM, commit_mode=sql.SQL("")))
        self._claim = (
            self._claim_pinned_statement
            if settings.synchronous_claim
            else Statement(self.render(CLAIM, commit_mode=sql.SQL(ASYNC_CLAIM)))
        )
        #: a claim's first look (CLAIM_FIRST), pinned or not, as the claim's
        self._claim_first_pinned = self.statement(CLAIM_FIRST, commit_mode=sql.SQL(""))
        self._claim_first = (
            self._claim_first_pinned
            if settings.synchronous_claim
            else self.statement(CLAIM_FIRST, commit_mode=sql.SQL(ASYNC_CLAIM))
        )
        commit_mode = sql.SQL("" if settings.synchronous_finish else ASYNC_COMMIT)
        #: the finish, by (completed?, notify waiting twins?, insert staged jobs?)
        self._finishes = {
            (completed, wake, staging): Statement(
                self.render(
                    _staging(finish) if staging else finish,
                    notify=notify if wake else sql.SQL("1"),
                    commit_mode=commit_mode,
                )
            )
            for completed, finish in ((False, FINISH), (True, COMPLETE))
            for wake in (False, True)
            for staging in (False, True)
        }
        self._advances = {
            staging: Statement(self.render(_staging(ADVANCE) if staging else ADVANCE))
            for staging in (False, True)
        }
        #: the forgetting of a fresh claim, by "notify waiting twins?"
        self._forgets = {
            wake: Statement(self.render(FORGET, notify=notify if wake else sql.SQL("1")))
            for wake in (False, True)
        }
        self._notify = Statement(sql.SQL("SELECT {}").format(notify).as_string())
        self._defers = {
            staging: self.statement(_staging(DEFER) if staging else DEFER)
            for staging in (False, True)
        }
        self._key_status = self.statement(KEY_STATUS)
        self._finished = self.statement(FINISHED)
        # On Citus (SPEC §22, statements_citus): the claim's first look, the claim, the new
        # key's insert; the finish without a NOTIFY or an asynchronous commit.
        self._citus_claim_pinned = self.statement(CLAIM_CITUS, commit_mode=sql.SQL(""))
        self._citus_claim = (
            self._citus_claim_pinned
            if settings.synchronous_claim
            else self.statement(CLAIM_CITUS, commit_mode=sql.SQL(ASYNC_CLAIM))
        )
        self._citus_claim_new = self.statement(CLAIM_NEW)
        self._citus_first_pinned = self.statement(CLAIM_FIRST_CITUS, commit_mode=sql.SQL(""))
        self._citus_first = (
            self._citus_first_pinned
            if settings.synchronous_claim
            else self.statement(CLAIM_FIRST_CITUS, commit_mode=sql.SQL(ASYNC_CLAIM))
        )
        #: by (completed?, insert staged jobs?): COMPLETE as Citus takes it (no CASE to plan)
        self._citus_finishes = {
            (completed, staging): self.statement(
                _staging(finish) if staging else finish,
                notify=sql.SQL("1"),
                commit_mode=sql.SQL(""),
            )
            for completed, finish in ((False, FINISH_CITUS), (True, COMPLETE))
            for staging in (False, True)
        }
        self._citus_forget = self.statement(FORGET, notify=sql.SQL("1"))
        self._citus_owner_free = self.statement(OWNER_FREE)
        function = self.schema.claim_function_name
        complete = self.schema.complete_function_name
        #: the first look and a new key's claim in one delegated call (None: no function)
        self._citus_call = (
            self.statement(CLAIM_CALL, claim_function=function)
            if function is not None and settings.synchronous_claim
            else None
        )
        #: the common finish in one delegated call (None: no function)
        self._citus_complete = (
            self.statement(COMPLETE_CALL, complete_function=complete)
            if complete is not None
            else None
        )
        #: the tenants whose shard is on the node the connections enter at (shard_hints)
        self._shards = ShardHints(self._direct_statements)
        #: a tenant's shard and the worker that holds it (IDEMPOTENCY_ROUTE_TO_SHARDS)
        self._shard_node = Statement(SHARD_NODE)
        #: the background's owners statements on Citus, by their plain text (dead_owners)
        self._citus_owners: dict[str, Statement] = {}
        #: IDEMPOTENCY_TOMBSTONE_TTL in seconds, as the claims take it
        self.tombstone_seconds = settings.tombstone_ttl.total_seconds()

    # -- Citus (SPEC §22) ------------------------------------------------------------

    @property
    def citus(self) -> bool:
        """The database has the citus extension: the request path sends the statements of
        :mod:`.statements_citus`, and a claim's owner is looked for on every node
        (:meth:`owner_free_on_citus`). Known from the schema check of the process's first
        statement (else looked at once)."""
        if self.schema.citus is None:
            with self._pooled() as conn, bounded(conn, self.settings.statement_timeout):
                if self.schema.citus is None:  # the schema check did not look
                    self.schema.state(conn)
        return bool(self.schema.citus)

    @property
    def ttl_classes(self) -> bool:
        """The keys table has ``ttl_created_idx`` and ``legacy_expiry_idx`` (plain
        PostgreSQL): the statements that find keys by time walk them one TTL class at a
        time (:mod:`.statements_by_class`); else (Citus, or an upgraded table whose indexes
        are still being built) they read ``expiry_idx`` and ``created_idx``. Known from the
        schema's last look."""
        citus = self.citus  # looks at the schema if no check did: it learns both
        return not citus and bool(self.schema.ttl_classes)

    def _new_owner(self) -> Owner:
        """As :meth:`.Execution._new_owner`; on Citus, its renewals one claim each (one shard
        each), its lock counted only on a node of the cluster's metadata (where the other
        nodes look), and no hand-back (a claim whose answer was lost is left to its lease)."""
        if not self.citus:
            return super()._new_owner()
        return Owner(
            self._owner_connection,
            self.run,
            self.statement(RENEW_CITUS),
            Statement(self.render(DISOWN)),
            self.settings.statement_timeout,
            None,
            LOCK_IS_MINE_CITUS,
            renew_each=True,
        )

    def owner_free_on_citus(self, owner: int, since: datetime) -> bool:
        """Whether no node of the Citus cluster holds the owner lock *owner*, and none
        started after *since* (the claim's last write): asked of every node at once, from
        the node this process entered at (:data:`~.statements_citus.OWNER_FREE`). A node
        that does not answer, or a store that fails, makes it held: the claim waits for its
        lease."""
        try:
            _, row = self.run(self._citus_owner_free, {"owner": owner, "since": since})
        except StoreError as exc:
            logger.info(
                "owner %d: the cluster could not be asked (%s); judged by its lease", owner, exc
            )
            return False
        return bool(row and row[0])

    def dead_owners(self, owners: Statement) -> list[int]:
        """As :meth:`.Execution.dead_owners`; on Citus every node is asked of each owner
        (:meth:`owner_free_on_citus`, since its earliest claim's last write), twice,
        GRACE_SECONDS apart."""
        if not self.citus:
            return super().dead_owners(owners)
        statement = self._citus_owners.get(owners.named)
        if statement is None:
            statement = self._citus_owners[owners.named] = Statement(owners_since(owners.named))
        found = self.fetch(statement, {}).rows
        free = [(owner, since) for owner, since in found if self.owner_free_on_citus(owner, since)]
        if not free:
            return []
        time.sleep(GRACE_SECONDS)
        return [owner for owner, since in free if self.owner_free_on_citus(owner, since)]

    # -- the request path ----------------------------------------------------------

    def claim(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        terms: RouteSettings,
        request: StoredRequest | None = None,
        pinned: HeldTransaction | None = None,
        gone_owner: int | None = None,
        *,
        stale: bool = False,
    ) -> ClaimOutcome:
        """Decide what this request does with *key*, and claim it if the view must run,
        under the lease, TTL and abandoned-claim policy of *terms*. A *stale* request (its
        client first sent it longer ago than the TTL: ``Repeatability-First-Sent``) whose
        key has no row is expired, never claimed (SPEC §24).

        With *pinned*, the claim joins that connection's open transaction: its lock
        and row last until that transaction ends (:class:`HeldTransaction`). A claim in
        flight whose owner lock is free is looked at again :data:`~.owner.GRACE_SECONDS`
        later (*gone_owner*: the owner found free), and abandoned if it is still free.
        """
        if pinned is None:  # claim_pinned asked before it took its connection
            self.replication.ensure()
        with refused("the request could not be stored"):
            stored = self.at_rest.request_params(tenant, key, request)
        params = {
            "tenant": tenant,
            "key": key,
            "fingerprint": fingerprint,
            "lock_id": lock_id(tenant, key),
            "lease": terms.lease.total_seconds(),
            "ttl": terms.ttl.total_seconds(),
            "on_abandoned": terms.on_abandoned,
            "tombstone_ttl": self.tombstone_seconds,
            "stale": stale,
            **self.owner_mark().params(),
            "gone_owner": gone_owner,
            **stored,
        }
        with self.claiming(tenant, key, params, pinned) as sent:
            if self.citus:
                row = self._claim_on_citus(params, pinned)
            else:
                row = self._claim_here(params, pinned, sent)
            assert row is not None
            with unreadable():
                outcome = claim_outcome(row, fingerprint, self.at_rest, tenant, key)
            sent.owns = outcome.owns_key
            if outcome.owns_key and pinned is None:
                self.renew_while_held(tenant, key, outcome, terms.lease.total_seconds())
        if pinned is None and outcome.free_owner is not None:
            # The owner's session ended: dead, or reconnecting. Asked again a moment later,
            # holding nothing: still free, it is dead.
            time.sleep(GRACE_SECONDS)
            return self.claim(tenant, key, fingerprint, terms, request, None, outcome.free_owner)
        return outcome

    def claiming(
        self, tenant: str, key: str, params: dict[str, Any], pinned: HeldTransaction | None
    ) -> AbstractContextManager[Claiming]:
        """The owner's watch over a claim (or a completer's takeover) whose *params* record
        it (:meth:`.Owner.claiming`): one whose answer is lost is handed back when the
        database answers (SPEC §20). Not one in *pinned*'s transaction: that ends with its
        connection, uncommitted (a claim sends no COMMIT)."""
        owner = self._live_owner() if pinned is None and params["owner"] is not None else None
        return nullcontext(Claiming()) if owner is None else owner.claiming(tenant, key)

    def _claim_here(
        self, params: dict[str, Any], pinned: HeldTransaction | None, sent: Claiming
    ) -> tuple[Any, ...] | None:
        """The claim's row on one PostgreSQL: its first look (CLAIM_FIRST: a new key claimed,
        a settled one answered), then CLAIM when the first look decided nothing. A look
        again at a free owner (*gone_owner*) is CLAIM's alone.

        :raises StoreError: the store failed; or, in *pinned*'s transaction, a twin's row
            committed under the first look (:func:`raced`: that transaction is aborted).
        """
        if params["gone_owner"] is None:
            first = self._claim_first if pinned is None else self._claim_first_pinned
            try:
                _, row = self.run(first, params, pinned, on_lost=sent.lose)
            except StoreError as exc:
                if pinned is not None or not raced(exc):
                    raise
                row = None  # a twin's row committed meanwhile: CLAIM sees it
            if row is not None and row[0] is not None:
                return row
        claim = self._claim if pinned is None else self._claim_pinned_statement
        _, row = self.run(claim, params, pinned, on_lost=sent.lose)
        return row

    def _claim_on_citus(
        self, params: dict[str, Any], pinned: HeldTransaction | None
    ) -> tuple[Any, ...] | None:
        """The claim's row on Citus: in autocommit, the claim function's call (delegated to
        the shard's node: a settled key answered, a new key's row made), else the first look
        (one task, writing nothing: a settled key answered, a new key's lock taken); when
        neither decided, the decision (one task); then the insert of a new key whose lock
        the first look took (one task, in *pinned*'s transaction when there is one).

        A claim in flight that an owner speaks for names it (``free_owner``), and every node
        is asked whether its lock is free (:meth:`owner_free_on_citus`); held, the claim is
        in progress. Asked again with *gone_owner* (the caller waited
        :data:`~.owner.GRACE_SECONDS`), the claim is read, the nodes asked once more, and
        only if the same owner is still free is the claim sent naming it, to take it over."""
        gone = params["gone_owner"]
        claim = self._citus_claim if pinned is None else self._citus_claim_pinned
        row = None
        if gone is None and pinned is None and self._citus_call and self.schema.citus_claim:
            # the first look and a new key's row on the shard's tables, if it is on this
            # node; else in one call, on the shard's node
            row = self._claim_on_shard(params)
            if row is None:
                _, called = self.run(self._citus_call, params)
                if called is not None:
                    self._shards.learn(params["tenant"], *called[16:19])
                    if called[18] is None:  # delegated: run on another node
                        self._learn_node(params["tenant"])
                row = None if called is None else (*called[:16], False)
        elif gone is None:  # the first look: a settled key answered, a new key's lock taken
            first = self._citus_first if pinned is None else self._citus_first_pinned
            _, row = self.run(first, params, pinned)
        if row is None or row[0] is None:
            _, row = self.run(claim, {**params, "gone_owner": None}, pinned)
        if row is not None and row[14] is not None:
            if not self.owner_free_on_citus(row[14], row[15]):
                row = (*row[:14], None, *row[15:])
            elif row[14] == gone:
                _, row = self.run(claim, params, pinned)
        if row is None or not row[16]:
            return row
        _, inserted = self.run(self._citus_claim_new, params, pinned)
        # no row inserted: a twin's row is there (it won the unique key): in progress
        return (row[0], *(inserted or (None, None, None)), *row[4:16])

    def renew_while_held(
        self, tenant: str, key: str, outcome: ClaimOutcome | Any, lease: float
    ) -> None:
        """The owner renews the claim *outcome* (its attempt and generation) until it
        ends (:meth:`finish`, :meth:`forget`, :meth:`defer`)."""
        owner = self._live_owner()
        if owner is not None:
            owner.hold(_fence(tenant, key, outcome), lease)

    def leave_to_death(self, tenant: str, key: str, outcome: ClaimOutcome) -> None:
        """The process ends under the claim *outcome* (``SystemExit``: gunicorn's worker
        timeout, a shutdown): nothing is stored and the owner stops renewing it, so the
        owner lock frees it when the process is gone (or its lease, should it live on)."""
        owner = self._live_owner()
        if owner is not None:
            owner.let_go(_fence(tenant, key, outcome))

    def claim_pinned(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        terms: RouteSettings,
        request: Any = None,
        *,
        stale: bool = False,
    ) -> PinnedClaim:
        """Claim on a connection held for a transactional view; the transaction is
        returned only when this request owns the key (else it ends at once).

        Tried again once after a failure that ran nothing (:meth:`_recoverable`) or a
        twin's row committed under it (:func:`raced`), and on another connection while the
        one it took died under it (a pooled connection whose backend was terminated, or
        restarted, while it waited in the pool), until ``IDEMPOTENCY_POOL_TIMEOUT +
        IDEMPOTENCY_STATEMENT_TIMEOUT`` from the start, as a plain statement is: the claim
        never commits on its own, so a dead connection took all of it with it. A try after a
        dead connection waits for its connection, and for each statement, at most what is
        left of that bound."""
        self.replication.ensure()
        args = (tenant, key, fingerprint, terms, request)
        deadline = time.monotonic() + self.settings.pool_timeout + self.settings.statement_timeout
        recovered = False
        within: float | None = None  # the first try: the pool's and the statements' own
        while True:
            try:
                return self._claim_pinned(*args, stale=stale, within=within)
            except StoreError as exc:
                if not recovered and (self._recoverable(exc.__cause__) or raced(exc)):
                    recovered = True
                    continue
                within = deadline - time.monotonic()
                if not is_connection_lost(exc.__cause__) or within <= 0:
                    raise
                logger.warning("a connection died under a claim (%s): claiming again", exc)

    def _claim_pinned(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        terms: RouteSettings,
        request: Any,
        gone_owner: int | None = None,
        *,
        stale: bool = False,
        within: float | None = None,
    ) -> PinnedClaim:
        held = self.hold(within)
        try:
            outcome = self.claim(
                tenant, key, fingerprint, terms, request, held, gone_owner, stale=stale
            )
        except BaseException:
            held.roll_back()
            raise
        held.within = None  # the view's statements and the finish: their own bounds
        if outcome.owns_key:
            return PinnedClaim(outcome, held)
        held.commit()
        if outcome.free_owner is not None and gone_owner is None:
            time.sleep(GRACE_SECONDS)  # as claim() does, holding nothing
            return self._claim_pinned(tenant, key, fingerprint, terms, request, outcome.free_owner)
        return PinnedClaim(outcome, None)

    def finish(
        self,
        tenant: str,
        key: str,
        outcome: ClaimOutcome,
        status: KeyStatus,
        *,
        ttl: timedelta,
        response: StoredResponse | None = None,
        notify: bool = False,
        jobs: Sequence[StagedJob] = (),
        pinned: HeldTransaction | None = None,
        commit: bool = False,
    ) -> datetime | None:
        """End the attempt *outcome* with *status*: the key's new ``expires_at`` (None: fenced).

        *jobs* are inserted in the same statement, only if the key changed. With *pinned*,
        the UPDATE joins that transaction, and with *commit* the transaction commits in
        the same round trip (its ``commit()`` then only returns the connection). An
        unsealable *response* raises EncryptionError.
        """
        params = {
            "tenant": tenant,
            "key": key,
            "attempt": outcome.attempt,
            "generation": outcome.generation,
            "status": status.value,
            "ttl": ttl.total_seconds(),
            **self.at_rest.response_params(tenant, key, response),
            "lock_id": lock_id(tenant, key),
        }
        if jobs:
            params.update(job_params(jobs))
        delegated = self._citus_complete if self._delegated(status, jobs, pinned) else None
        if delegated is not None:
            statement = delegated
        elif self.citus:
            statement = self._citus_finishes[status is KeyStatus.COMPLETED, bool(jobs)]
        else:
            statement = self._finishes[status is KeyStatus.COMPLETED, notify, bool(jobs)]
        with self._kept_on_failure(statement, params, pinned):
            row = self._complete_on_shard(params) if delegated is not None else None
            if row is None:
                rowcount, row = self.run(statement, params, pinned, commit=commit, patient=True)
            else:
                rowcount, row = (1, row) if row[1] is not None else (0, None)
            if rowcount == 1 and row is not None:
                return typing.cast(datetime, row[1])
            if pinned is None and status is KeyStatus.COMPLETED:
                # Sent again after its connection died (:meth:`_attempt`), a finish that
                # had committed finds its own answer: this attempt's, not a newer one's.
                _, row = self.run(self._finished, params)
                return None if row is None else typing.cast(datetime, row[0])
            return None

    def _delegated(
        self, status: KeyStatus, jobs: Sequence[StagedJob], pinned: HeldTransaction | None
    ) -> bool:
        """On Citus, whether the finish is the common one sent as the delegated call: a
        completed key without staged jobs, outside a transaction, once init made the
        functions (inside a transaction Citus would run it where the request entered)."""
        return (
            self.citus
            and status is KeyStatus.COMPLETED
            and not jobs
            and pinned is None
            and self.schema.citus_claim
        )

    def _direct_statements(self, shard: Shard) -> DirectStatements:
        """The statements of one PostgreSQL on *shard*'s tables (shard_hints)."""
        parts = {
            "shard_keys": sql.SQL(shard.keys),
            "shard_graves": sql.SQL(shard.graves),
            "here_function": self.schema.here_function_name or sql.SQL("false"),
        }
        return DirectStatements(
            self.statement(DIRECT_FIRST, commit_mode=sql.SQL(""), **parts),
            self.statement(DIRECT_COMPLETE, **parts),
        )

    def _on_shard(
        self,
        params: dict[str, Any],
        pick: Callable[[DirectStatements], Statement],
        *,
        patient: bool = False,
    ) -> tuple[Any, ...] | None:
        """On Citus, the statement *pick* chooses, sent to the tenant's shard's tables when
        the shard was on this node moments ago (shard_hints): its row, whose first column
        says whether the shard was still here. None: not sent, or the shard was not here
        (the tenant is forgotten, the caller goes through the functions); a twin's row
        committed under a new key's first look, too (the function sees it)."""
        tenant = params["tenant"]
        found = self._shards.on_this_node(tenant)
        if found is None:
            return None
        shard, statements = found
        node, nodes, via = shard.node, self.nodes, None
        if node is not None:  # on a worker this process routes to (shard_nodes)
            via = None if nodes is None else nodes.pool(node)
            if via is None:  # its pool has not connected yet, or failed lately
                return None
        try:
            shard_params = {**params, "shard": shard.shard}
            _, row = self.run(
                pick(statements), shard_params, patient=patient, tables=False, via=via
            )
        except StoreError as exc:
            if exc.outage and node is not None and nodes is not None:  # the worker failed it
                self._shards.forget(tenant)
                nodes.failed(node, str(exc))
            if not isinstance(exc.__cause__, _NOT_HERE):
                raise
            row = None  # the shard's table is gone (moved and dropped), or is not ours
        if row is None or not row[0]:
            self._shards.forget(tenant)
            return None
        return row

    def _learn_node(self, tenant: str) -> None:
        """With IDEMPOTENCY_ROUTE_TO_SHARDS, learn the worker that holds *tenant*'s shard
        (SHARD_NODE), once per tenant: its next claims and common finishes are sent there
        (:meth:`_on_shard`). A failure to learn it leaves the tenant to the functions: the
        claim it follows stands."""
        if self.nodes is None or self._shards.knows(tenant):
            return
        names = {
            "tenant": tenant,
            "keys_table": self.schema.regclass("table"),
            "tombstones_table": self.schema.regclass("tombstones"),
        }
        try:
            _, row = self.run(self._shard_node, names)
        except StoreError as exc:
            logger.debug("the shard of tenant %r was not learned: %s", tenant, exc)
            return
        if row is not None:
            shard, keys, graves, host, port = row
            self._shards.learn(tenant, keys, graves, shard, (host, port))

    def _claim_on_shard(self, params: dict[str, Any]) -> tuple[Any, ...] | None:
        """A claim's first look on the tenant's shard (DIRECT_FIRST), as the claim
        function's row; None: not sent there, not there, or raced by a twin."""
        try:
            row = self._on_shard(params, lambda statements: statements.first)
        except StoreError as exc:
            if not raced(exc):
                raise
            return None
        return None if row is None else (*row[1:], False)

    def _complete_on_shard(self, params: dict[str, Any]) -> tuple[Any, ...] | None:
        """The common finish on the tenant's shard (DIRECT_COMPLETE): (here, expires_at or
        None if fenced); None: not sent there, or not there."""
        return self._on_shard(params, lambda statements: statements.complete, patient=True)

    @contextmanager
    def _kept_on_failure(
        self, statement: Statement, params: dict[str, Any], pinned: HeldTransaction | None
    ) -> Iterator[None]:
        """The end of a claim in flight (a finish, a forgetting): the owner lets the claim
        go once it ended; one that failed within its bound is kept by the owner and stored
        when the database answers (SPEC §20: an answer given is an answer stored).

        :raises AnswerKept: it failed and is kept.
        """
        owner = self._live_owner() if pinned is None else None
        try:
            yield
        except StoreError as exc:
            if owner is not None and exc.outage and owner.keep(statement, params):
                raise AnswerKept(str(exc)) from exc
            if owner is not None:
                owner.let_go(params)
            raise
        if owner is not None:
            owner.let_go(params)

    def forget(self, tenant: str, key: str, outcome: ClaimOutcome, *, notify: bool = False) -> bool:
        """Delete the key claimed afresh by *outcome*, as if it had never been used (a
        view's answer with a release status); False if fenced (a newer attempt owns the
        key, or a phase committed under it)."""
        params = {
            "tenant": tenant,
            "key": key,
            "attempt": outcome.attempt,
            "generation": outcome.generation,
            "lock_id": lock_id(tenant, key),
        }
        statement = self._citus_forget if self.citus else self._forgets[notify]
        with self._kept_on_failure(statement, params, None):
            rowcount, _ = self.run(statement, params, patient=True)
        return rowcount == 1

    def notify(self, tenant: str, key: str) -> None:
        """Wake the requests waiting for *key* (its attempt ended without a NOTIFY)."""
        self.run(self._notify, {"lock_id": lock_id(tenant, key)})

    def defer(
        self,
        tenant: str,
        key: str,
        outcome: ClaimOutcome,
        *,
        jobs: Sequence[StagedJob] = (),
        pinned: HeldTransaction | None = None,
    ) -> None:
        """Hand the claimed key to the background (``asynchronous=True``), with *jobs*;
        with *pinned*, the deferral commits the claim's transaction."""
        params: dict[str, Any] = {
            "tenant": tenant,
            "key": key,
            "attempt": outcome.attempt,
            "generation": outcome.generation,
        }
        if jobs:
            params.update(job_params(jobs))
        self.run(self._defers[bool(jobs)], params, pinned)
        if pinned is not None:
            pinned.commit()
        owner = self._live_owner()
        if owner is not None:
            owner.let_go(params)  # the background's now

    def key_status(self, tenant: str, key: str) -> KeyAnswer | None:
        """A key's status, stored response (opened if sealed) and ``expires_at`` (the
        ``Location`` view); None if no such key.

        :raises StoreError: the store failed, or the stored response cannot be opened.
        """
        _, row = self.run(self._key_status, {"tenant": tenant, "key": key})
        if row is None:
            return None
        status, code, headers, body, expires_at = row
        if code is None:
            return KeyAnswer(KeyStatus(status), None, expires_at)
        with unreadable():
            stored = self.at_rest.open_response(tenant, key, code, headers, body)
        return KeyAnswer(KeyStatus(status), stored, expires_at)

    @contextmanager
    def phase(
        self,
        tenant: str,
        key: str,
        outcome: ClaimOutcome,
        point: str,
        *,
        lease: timedelta,
        jobs: Sequence[StagedJob] = (),
    ) -> Iterator[psycopg.Connection[Any]]:
        """One transaction on a pooled connection: the block's writes commit together
        with ``recovery_point = point`` and the *jobs* staged in the block (read when
        the block ends), or not at all.

        Its own statements (``BEGIN``, the advance, ``COMMIT`` or ``ROLLBACK``) are
        bounded by ``IDEMPOTENCY_STATEMENT_TIMEOUT`` and fail as :class:`StoreError`;
        the block's, the view's, are the view's.

        :raises AttemptSuperseded: another attempt owns the key now; nothing commits.
        :raises StoreError: the store failed; nothing commits.
        """
        conn = self._checkout()
        try:
            with bounded_transaction(conn, self.settings.statement_timeout):
                yield conn
                params = {
                    "tenant": tenant,
                    "key": key,
                    "attempt": outcome.attempt,
                    "generation": outcome.generation,
                    "point": point,
                    "lease": lease.total_seconds(),
                }
                if jobs:
                    params.update(job_params(jobs))
                with store_errors(), bounded(conn, self.settings.statement_timeout):
                    advanced, _ = execute(conn, self._advances[bool(jobs)], params, self._prepare)
                if advanced != 1:
                    raise AttemptSuperseded(
                        f"attempt {outcome.attempt} no longer owns key {key!r} (its lease ran"
                        " out and another attempt took over); the phase was rolled back"
                    )
        finally:
            self.pool.putconn(conn)


def _fence(tenant: str, key: str, outcome: ClaimOutcome) -> dict[str, Any]:
    """The claim *outcome* holds, as the owner renews it and its end names it."""
    return {
        "tenant": tenant,
        "key": key,
        "attempt": outcome.attempt,
        "generation": outcome.generation,
    }


#: a statement sent to a shard's table that is not on this node any more (moved, then
#: dropped), or by a role that no longer owns the keys table (the shard's metadata lock)
_NOT_HERE = (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege)


def raced(exc: StoreError) -> bool:
    """*exc* is a claim's first look that met a twin's row committed after its snapshot."""
    return isinstance(exc.__cause__, psycopg.errors.UniqueViolation)


def _staging(update: str) -> str:
    """*update* (a fenced UPDATE) as one statement that also inserts the staged jobs."""
    returning = "" if "RETURNING" in update else "RETURNING 1"
    return f"WITH ended AS ({update} {returning})" + STAGE_JOBS
