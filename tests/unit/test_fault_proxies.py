"""The fault schedule's proxy in front of the store (flask_idempotency/testing/faults/
nemesis.py): one proxy for a URL of one server, one per host for a multi-host URL (an HA
cluster's nodes), so that libpq's ``target_session_attrs`` still chooses among them through
the proxies."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict

from flask_idempotency.testing.faults.nemesis import _Proxies, _servers

CLUSTER = (
    "postgresql://postgres@127.0.0.1:6001,127.0.0.1:6002,127.0.0.1:6003/postgres"
    "?target_session_attrs=read-write"
)


def test_the_servers_of_a_url() -> None:
    assert _servers(CLUSTER) == [("127.0.0.1", 6001), ("127.0.0.1", 6002), ("127.0.0.1", 6003)]
    assert _servers("host=a,b port=7000 dbname=x") == [("a", 7000), ("b", 7000)]
    assert len(_servers("postgresql:///app")) == 1


@pytest.mark.parametrize("url", [CLUSTER, "host=127.0.0.1,127.0.0.1 port=6001,6002 dbname=x"])
def test_a_multi_host_url_gets_a_proxy_per_host(url: str) -> None:
    with _Proxies(url) as proxies:
        targets = [proxy.target for proxy in proxies.proxies]
        assert targets == _servers(url)
        params = conninfo_to_dict(proxies.url)
        assert params["host"] == ",".join(["127.0.0.1"] * len(targets))
        assert params["port"] == ",".join(str(proxy.port) for proxy in proxies.proxies)
        assert params.get("target_session_attrs") == conninfo_to_dict(url).get(
            "target_session_attrs"
        )
        proxies.freeze()
        assert not any(proxy._flowing.is_set() for proxy in proxies.proxies)
        proxies.thaw()
        assert all(proxy._flowing.is_set() for proxy in proxies.proxies)
