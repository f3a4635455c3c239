"""On Citus with ``IDEMPOTENCY_ROUTE_TO_SHARDS`` (SPEC §22): the pools of the workers this
process sends its tenants' claims and common finishes to itself.

A worker is known by its host and port as the cluster's metadata names it
(statements_citus.SHARD_NODE); its pool connects there with the store URL's other
parameters (database, user, TLS, timeouts), is opened in the background at the first tenant
whose shard it holds, and belongs to the process that opened it (a pool inherited through
``fork()`` is its parent's). A worker's pool is used once it has connected; until then, and
for :data:`FAILED_SECONDS` after a statement on it failed for want of the worker, requests go
through the node the store's URL names, as without routing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

logger = logging.getLogger("flask_idempotency")

#: how long a worker whose statement failed for want of it is left out of the routing
FAILED_SECONDS = 30.0

#: a worker, as the cluster's metadata names it: (host, port)
Node = tuple[str, int]


def node_conninfo(url: str, node: Node) -> str:
    """*url* with *node*'s host and port in place of its own (a ``hostaddr`` dropped: it
    would override the host)."""
    params: dict[str, Any] = {k: v for k, v in conninfo_to_dict(url).items() if k != "hostaddr"}
    params["host"], params["port"] = node[0], str(node[1])
    return make_conninfo("", **params)


class ShardNodes:
    """The workers' pools of this process; *open_pool* opens one (conninfo, and the
    callback the pool calls with each connection it made)."""

    def __init__(
        self,
        url: str,
        open_pool: Callable[[str, Callable[[psycopg.Connection[Any]], None]], ConnectionPool[Any]],
    ) -> None:
        self._url = url
        self._open_pool = open_pool
        self._pools: dict[Node, ConnectionPool[Any]] = {}
        self._connected: set[Node] = set()
        self._failed: dict[Node, float] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def pool(self, node: Node) -> ConnectionPool[Any] | None:
        """*node*'s pool, once it has connected and unless it failed lately; None: go
        through the store's own node (the pool is opened meanwhile, if it is not)."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: its parent's pools are not its own
                self._pools, self._connected, self._failed = {}, set(), {}
                self._pid = os.getpid()
            pool = self._pools.get(node)
            if pool is None:
                self._pools[node] = self._open_pool(
                    node_conninfo(self._url, node), lambda _conn: self._ready(node)
                )
                return None
            failed = self._failed.get(node)
            if failed is not None and time.monotonic() - failed < FAILED_SECONDS:
                return None
            return pool if node in self._connected else None

    def _ready(self, node: Node) -> None:
        with self._lock:
            first = node not in self._connected
            self._connected.add(node)
        if first:
            logger.info("routing to worker %s:%d: its pool connected", node[0], node[1])

    def failed(self, node: Node, reason: str) -> None:
        """A statement sent to *node* failed for want of it: left out for a while."""
        with self._lock:
            self._failed[node] = time.monotonic()
        logger.warning(
            "worker %s:%d did not serve a routed statement (%s): its tenants go through"
            " the store's node for %d s",
            node[0],
            node[1],
            reason,
            FAILED_SECONDS,
        )

    def close(self) -> None:
        """Close this process's pools."""
        with self._lock:
            pools = list(self._pools.values()) if self._pid == os.getpid() else []
            self._pools, self._connected, self._failed = {}, set(), {}
        for pool in pools:
            pool.close()
