"""TcpProxy listening on a Unix-domain socket instead of 127.0.0.1 (``listen_path``, as
bench/counting.py uses it with ``--unix-socket``), and the connections it counts."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from flask_idempotency.testing.proxy import TcpProxy


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory: a socket's path must fit in 108 bytes, pytest's tmp_path may not."""
    with tempfile.TemporaryDirectory(prefix="proxy-") as directory:
        yield Path(directory)


def unix_listening(database_url: str, socket_dir: Path, name: str = ".s.PGSQL.5432") -> TcpProxy:
    params = conninfo_to_dict(database_url)
    host, port = str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
    return TcpProxy(host, port, listen_path=socket_dir / name)


def test_a_proxy_listens_on_a_unix_socket_and_counts(database_url: str, socket_dir: Path) -> None:
    path = socket_dir / ".s.PGSQL.5432"
    with unix_listening(database_url, socket_dir) as proxy:
        assert path.is_socket() and proxy.port == 0
        url = proxy.url(database_url)
        assert conninfo_to_dict(url)["host"] == str(socket_dir)
        assert conninfo_to_dict(url)["port"] == "5432"
        for expected in (1, 2):
            with psycopg.connect(url, autocommit=True) as conn:
                before = proxy.round_trips
                for _ in range(3):
                    assert conn.execute("SELECT 1").fetchone() == (1,)
                assert proxy.round_trips - before == 3
                assert conn.info.host == str(socket_dir)  # not a TCP address
            assert proxy.connections == expected
    assert not os.path.exists(path)  # removed by stop()


def test_a_unix_socket_libpq_cannot_name_has_no_url(database_url: str, socket_dir: Path) -> None:
    with unix_listening(database_url, socket_dir, name="proxy.sock") as proxy:
        with pytest.raises(ValueError, match="not .s.PGSQL"):
            proxy.url(database_url)


def test_a_tcp_proxy_counts_its_connections(proxy: TcpProxy, database_url: str) -> None:
    assert proxy.connections == 0
    for _ in range(2):
        with psycopg.connect(proxy.url(database_url), autocommit=True) as conn:
            conn.execute("SELECT 1")
    assert proxy.connections == 2 and proxy.port > 0
