"""IDEMPOTENCY_ROUTE_TO_SHARDS's pools of the workers (store/shard_nodes.py): which URL a
worker's pool gets, and when a pool is used. The routing itself, on a real cluster:
tests/e2e/test_citus_routed.py."""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import pytest
from psycopg.conninfo import conninfo_to_dict

from flask_idempotency.store import shard_nodes
from flask_idempotency.store.shard_nodes import ShardNodes, node_conninfo


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:p%40ss%20'w%5Crd@db.example:6432/pay?sslmode=verify-full&application_name=x",
        "host=/run/postgresql port=5433 dbname='my db' user=app password='a b\\'c'",
        "postgresql://app@10.0.0.1,10.0.0.2:5432,5433/pay?target_session_attrs=read-write",
        "postgresql://app@db.example/pay?hostaddr=10.0.0.9&connect_timeout=3",
    ],
)
def test_a_worker_s_url_is_the_store_s_with_the_worker_s_host_and_port(url: str) -> None:
    worker = conninfo_to_dict(node_conninfo(url, ("worker-2.internal", 5432)))
    store = conninfo_to_dict(url)
    assert (worker["host"], worker["port"]) == ("worker-2.internal", "5432")
    assert "hostaddr" not in worker  # it would take the place of the host
    kept = {k: v for k, v in store.items() if k not in ("host", "port", "hostaddr")}
    assert {k: v for k, v in worker.items() if k in kept} == kept


class Opened:
    """What ShardNodes opened: the conninfo and the callback, per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.pools: list[mock.Mock] = []

    def __call__(self, conninfo: str, configure: Any) -> mock.Mock:
        self.calls.append((conninfo, configure))
        pool = mock.Mock(name=f"pool{len(self.pools)}")
        self.pools.append(pool)
        return pool


def test_a_worker_s_pool_is_used_once_it_connected_and_not_for_a_while_after_it_failed() -> None:
    opened = Opened()
    nodes = ShardNodes("postgresql://app@coordinator/pay", opened)
    worker = ("127.0.0.1", 9700)
    assert nodes.pool(worker) is None  # opened now, in the background
    assert nodes.pool(worker) is None  # not connected yet: through the store's node
    assert len(opened.calls) == 1
    conninfo, configure = opened.calls[0]
    assert conninfo_to_dict(conninfo)["port"] == "9700"
    configure(object())  # the pool made its first connection
    assert nodes.pool(worker) is opened.pools[0]
    nodes.failed(worker, "PoolTimeout")
    assert nodes.pool(worker) is None
    with mock.patch.object(shard_nodes.time, "monotonic", return_value=1e12):
        assert nodes.pool(worker) is opened.pools[0]  # FAILED_SECONDS later
    assert len(opened.calls) == 1  # one pool per worker
    nodes.close()
    opened.pools[0].close.assert_called_once_with()


def test_a_forked_child_opens_its_own_pools() -> None:
    opened = Opened()
    nodes = ShardNodes("postgresql://app@coordinator/pay", opened)
    worker = ("127.0.0.1", 9700)
    nodes.pool(worker)
    opened.calls[0][1](object())
    assert nodes.pool(worker) is opened.pools[0]
    with mock.patch.object(shard_nodes.os, "getpid", return_value=os.getpid() + 1):
        assert nodes.pool(worker) is None  # the parent's pool is not the child's
        assert len(opened.calls) == 2
        nodes.close()
    opened.pools[0].close.assert_not_called()  # the parent's, left to the parent
    opened.pools[1].close.assert_called_once_with()
