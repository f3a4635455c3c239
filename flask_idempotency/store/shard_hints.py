"""On Citus (SPEC §22): the tenants whose keys shard is on the node this process's
connections enter at, and the statements sent to that shard's tables directly.

The claim function says, when it ran on the key's shard in the caller's own session, which
shard that was (statements_citus.CLAIM_FUNCTION's ``on_keys``, ``on_graves``,
``on_shard``). For :data:`HINT_SECONDS` after, that tenant's claims and finishes are one
PostgreSQL's statements on the shard's tables (statements_citus.DIRECT_FIRST and
DIRECT_COMPLETE), each asking first, under the shard's metadata lock, whether the shard is
still there; a "no" forgets the tenant, and the request goes through the functions, as does
one that finds the shard's table gone (Citus drops a moved shard's old table some time after
the move). Then it is learned again.

With ``IDEMPOTENCY_ROUTE_TO_SHARDS``, a tenant whose claim function ran elsewhere (delegated
by the node the process entered at) is looked up in the cluster's metadata
(statements_citus.SHARD_NODE), and its statements go to the worker that holds its shard,
on that worker's pool (shard_nodes), asking the same question there.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from .shard_nodes import Node
from .statement import Statement

#: how long a tenant's shard is taken as on this node after the claim function said so
HINT_SECONDS = 600.0
#: the most tenants remembered (the oldest are forgotten first)
MAX_TENANTS = 10_000


@dataclasses.dataclass(frozen=True)
class Shard:
    """A shard of the keys table and its tombstones' shard, as Citus names their tables,
    and the worker that holds them (None: the node this process's connections enter at)."""

    keys: str
    graves: str
    shard: int
    node: Node | None = None


@dataclasses.dataclass(frozen=True)
class DirectStatements:
    """The statements one PostgreSQL would send, on a shard's tables."""

    first: Statement
    complete: Statement


class ShardHints:
    """Tenant -> the :class:`Shard` on this node, for :data:`HINT_SECONDS`; and the
    :class:`DirectStatements` of each shard, rendered once by *render*."""

    def __init__(self, render: Callable[[Shard], DirectStatements]) -> None:
        self._render = render
        self._tenants: dict[str, tuple[Shard, float]] = {}
        self._statements: dict[Shard, DirectStatements] = {}
        self._lock = threading.Lock()

    def learn(
        self,
        tenant: str,
        keys: str | None,
        graves: str | None,
        shard: int | None,
        node: Node | None = None,
    ) -> None:
        """The claim function ran on *tenant*'s shard in this process's session (or, all
        None, did not); or, with *node*, the shard is on that worker (shard_nodes)."""
        if keys is None or graves is None or shard is None:
            return
        with self._lock:
            self._tenants.pop(tenant, None)
            self._tenants[tenant] = (Shard(keys, graves, shard, node), time.monotonic())
            while len(self._tenants) > MAX_TENANTS:
                del self._tenants[next(iter(self._tenants))]

    def knows(self, tenant: str) -> bool:
        """Whether *tenant*'s shard was learned (it may have been forgotten since)."""
        with self._lock:
            return tenant in self._tenants

    def forget(self, tenant: str) -> None:
        """*tenant*'s shard is not (or no longer) on this node."""
        with self._lock:
            self._tenants.pop(tenant, None)

    def on_this_node(self, tenant: str) -> tuple[Shard, DirectStatements] | None:
        """*tenant*'s shard and its statements, if it was here within :data:`HINT_SECONDS`."""
        with self._lock:
            found = self._tenants.get(tenant)
            if found is None:
                return None
            shard, learned = found
            if time.monotonic() - learned > HINT_SECONDS:
                del self._tenants[tenant]
                return None
            statements = self._statements.get(shard)
            if statements is None:
                statements = self._statements[shard] = self._render(shard)
        return shard, statements
