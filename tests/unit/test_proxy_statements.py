"""The proxy's statement count (flask_idempotency.testing.proxy.FrontendMessages): the
protocol's Execute and simple Query messages, whatever way the bytes arrive, and nothing
counted (nor kept) for bytes that are not PostgreSQL's protocol in the clear."""

from __future__ import annotations

import psycopg
import pytest

from flask_idempotency.testing.proxy import FrontendMessages, TcpProxy

SSL_REQUEST = (8).to_bytes(4, "big") + (80877103).to_bytes(4, "big")


def message(kind: bytes, body: bytes = b"") -> bytes:
    return kind + (4 + len(body)).to_bytes(4, "big") + body


def startup() -> bytes:
    body = (3 << 16).to_bytes(4, "big") + b"user\0postgres\0\0"
    return (4 + len(body)).to_bytes(4, "big") + body


#: an SSL request refused, the startup, then a pipeline: Parse, Bind, Execute twice, Sync,
#: and a simple Query holding two statements (one message)
STREAM = (
    SSL_REQUEST
    + startup()
    + message(b"P", b"\0SELECT 1\0\0\0")
    + (message(b"B", b"\0\0" + b"\0" * 6) + message(b"E", b"\0\0\0\0\0")) * 2
    + message(b"S")
    + message(b"Q", b"BEGIN; COMMIT\0")
    + message(b"X")
)


@pytest.mark.parametrize("size", [1, 3, 7, len(STREAM)])
def test_statements_are_counted_however_the_bytes_are_cut(size: int) -> None:
    messages = FrontendMessages()
    counted = sum(messages.feed(STREAM[i : i + size]) for i in range(0, len(STREAM), size))
    assert counted == 3 and not messages.lost


def test_a_bind_of_100_kb_holding_e_and_q_bytes_is_one_message() -> None:
    body = b"EQ" * 50_000
    messages = FrontendMessages()
    assert messages.feed(startup() + message(b"B", body) + message(b"E", b"\0" * 5)) == 1


@pytest.mark.parametrize(
    "garbage",
    [
        SSL_REQUEST + b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"E" * 64,  # TLS
        b"\0\0\0\0" + b"E" * 32,  # a length of zero
        startup() + b"E\0\0\0\0",  # a typed length shorter than itself
        startup() + b"E\xff\xff\xff\xff",  # longer than any message
        b"GET / HTTP/1.1\r\n\r\n",
    ],
)
def test_bytes_that_are_not_the_protocol_are_not_counted(garbage: bytes) -> None:
    messages = FrontendMessages()
    assert messages.feed(garbage) == 0
    assert messages.feed(message(b"E", b"\0" * 5) * 3) == 0
    assert messages.lost


def test_a_real_session_through_the_proxy(database_url: str) -> None:
    proxy = TcpProxy.to_database(database_url)
    proxy.start()
    try:
        with psycopg.connect(proxy.url(database_url), autocommit=True) as conn:
            before = proxy.statements
            conn.execute("SELECT 1")
            conn.execute("SELECT %s::int", [2], prepare=True)
            with conn.pipeline():
                for n in range(3):
                    conn.execute("SELECT %s::int", [n])
            assert proxy.statements - before == 5
    finally:
        proxy.stop()
