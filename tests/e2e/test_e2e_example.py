"""End to end with the example payments API (example/app.py) under real gunicorn: Stripe's own
Python SDK as the client, across a connection that loses the first answer, and the example's
client script.
"""

from __future__ import annotations

import http.client
import selectors
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import requests
import stripe
from psycopg.rows import TupleRow

from tests.support.gunicorn_server import ROOT, GunicornServer, wait_until
from tests.support.helpers import start_example

DB = psycopg.Connection[TupleRow]
MAX_HEAD = 64 * 1024


# -- a proxy that loses the first answer ---------------------------------------------------


def read_request(sock: socket.socket) -> bytes | None:
    """One whole HTTP/1.1 request (head and Content-Length body), or None if the client
    closed the connection before sending one."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
        assert len(data) < MAX_HEAD, "request head too large"
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(header(head, "Content-Length") or 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        body += chunk
    return head + b"\r\n\r\n" + body


def header(head: bytes, name: str) -> str | None:
    for line in head.decode("latin-1").split("\r\n")[1:]:
        field, _, value = line.partition(":")
        if field.strip().lower() == name.lower():
            return value.strip()
    return None


class AnswerLosingProxy:
    """A TCP proxy on 127.0.0.1 in front of *upstream_port*.

    On the first *lose* connections it forwards the request, waits for the whole answer
    (so the server has finished the request), and then closes the client's connection
    without sending it a byte: the answer is lost on the way back. Later connections are
    relayed as they are. Each request's ``Idempotency-Key`` is recorded in ``seen``.
    """

    def __init__(self, upstream_port: int, lose: int = 1) -> None:
        self.upstream_port = upstream_port
        self.lose = lose
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = int(self.listener.getsockname()[1])
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> AnswerLosingProxy:
        acceptor = threading.Thread(target=self._accept, daemon=True)
        self.threads.append(acceptor)
        acceptor.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopping.set()
        self.threads[0].join(30)  # the acceptor: no thread is added after it ended
        for thread in self.threads:
            thread.join(30)
        self.listener.close()
        assert not any(thread.is_alive() for thread in self.threads)

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._serve, args=(client,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        try:
            with client, socket.create_connection(("127.0.0.1", self.upstream_port)) as upstream:
                client.settimeout(30)
                upstream.settimeout(30)
                request = read_request(client)
                if request is None:
                    return
                with self.lock:
                    lose = self.lose > 0
                    self.lose -= lose
                upstream.sendall(request)
                record: dict[str, Any] = {
                    "line": request.split(b"\r\n", 1)[0].decode(),
                    "key": header(request.partition(b"\r\n\r\n")[0], "Idempotency-Key"),
                    "lost": lose,
                }
                with self.lock:
                    self.seen.append(record)
                if lose:
                    answer = http.client.HTTPResponse(upstream)
                    try:
                        answer.begin()
                        answer.read()
                        record["upstream_status"] = answer.status
                    finally:
                        answer.close()
                    return  # closing the client's connection without a byte
                self._relay(client, upstream)
        except BaseException as exc:
            self.errors.append(exc)

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(client, selectors.EVENT_READ, upstream)
            selector.register(upstream, selectors.EVENT_READ, client)
            while not self.stopping.is_set():
                for key, _ in selector.select(0.1):
                    source: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = source.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)


@pytest.fixture
def stripe_session() -> Iterator[requests.Session]:
    session = requests.Session()
    session.trust_env = False  # no proxy from the environment between the SDK and loopback
    with session:
        yield session


def test_stripe_sdk_retries_a_lost_answer_and_the_charge_happens_once(
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    db: DB,
    stripe_session: requests.Session,
) -> None:
    server = start_example(start_gunicorn, database_url, db, latency=0.05)
    api_key = f"sk_test_e2e_{uuid.uuid4().hex}"  # the example's tenant is the API key
    with AnswerLosingProxy(server.port, lose=1) as proxy:
        client = stripe.StripeClient(
            api_key,
            base_addresses={"api": proxy.url},
            max_network_retries=3,
            http_client=stripe.RequestsClient(session=stripe_session, timeout=30),
        )
        charge = client.v1.charges.create(params={"amount": 1234, "currency": "usd"})
    assert not proxy.errors, proxy.errors
    print(f"proxy saw: {proxy.seen}; charge {charge.id}")

    # The SDK sent the charge twice, with the one Idempotency-Key it generated: the first
    # answer (a success) was lost, the retry got it replayed.
    assert [r["line"] for r in proxy.seen] == ["POST /v1/charges HTTP/1.1"] * 2
    first, second = proxy.seen
    assert first["lost"] and first["upstream_status"] == 200 and not second["lost"]
    assert first["key"] and first["key"] == second["key"]
    assert charge.last_response.headers["Idempotent-Replayed"] == "true"
    assert (charge.object, charge.amount, charge.currency) == ("charge", 1234, "usd")
    assert charge.status == "succeeded" and charge.id.startswith("ch_")

    # One charge at the provider, one payment, one provider call: the view ran once.
    charges = db.execute(
        "SELECT idempotency_key, amount FROM provider_charges WHERE charge_id = %s", (charge.id,)
    ).fetchall()
    assert len(charges) == 1 and charges[0][1] == 1234
    downstream_key = charges[0][0]
    calls = db.execute(
        "SELECT count(*) FROM provider_calls WHERE idempotency_key = %s", (downstream_key,)
    ).fetchone()
    assert calls == (1,)
    payments = db.execute(
        "SELECT id::text, charge_id, amount, status FROM payments WHERE tenant = %s", (api_key,)
    ).fetchall()
    assert payments == [(charge.metadata["payment_id"], charge.id, 1234, "succeeded")]
    key_row = db.execute(
        "SELECT status, attempt FROM idempotency_keys WHERE tenant = %s AND key = %s",
        (api_key, first["key"]),
    ).fetchone()
    assert key_row == ("completed", 1)


def test_example_client_script(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    # The provider takes 0.3 s per charge, so the three racing twins overlap: 409s.
    server = start_example(start_gunicorn, database_url, db, latency=0.3)
    result = subprocess.run(
        [sys.executable, str(ROOT / "example" / "client.py"), server.url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()

    def answer(title: str) -> str:
        (line,) = [line for line in lines if line.lstrip().startswith(title)]
        return line.partition("->")[2].strip()

    assert answer("1. first request").startswith("201")
    assert answer("2. retry, same body").startswith("201  (replayed)")
    assert answer("3. same key, another amount").startswith("422")
    race = [answer(f"request {n}") for n in (1, 2, 3)]
    assert sum(a == "201" for a in race) == 1, race  # one ran the view
    assert any(a.startswith("409") and "Retry-After: 1" in a for a in race), race
    assert all(a == "201" or a.startswith(("409", "201  (replayed)")) for a in race), race
    assert answer("5. retry once they are done").startswith("201  (replayed)")
    assert "request-in-progress" in result.stdout and "key-reused" in result.stdout


def test_example_exports_run_in_the_background_and_payments_send_one_receipt(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    """The example as ``bash example/run`` serves it: gunicorn's master runs
    ``idempotency-complete --loop 1`` and ``idempotency-dispatch --loop 1`` beside the
    workers, with no broker."""
    server = start_example(
        start_gunicorn, database_url, db, latency=0.05, FLASK_EXAMPLE_EXPORT_SECONDS="0.5"
    )
    account = f"acct-{uuid.uuid4()}"
    auth = {"X-API-Key": account}
    export_key = f"export-{uuid.uuid4()}"
    first = requests.post(
        f"{server.url}/exports", json={}, headers={**auth, "Idempotency-Key": export_key},
        timeout=30,
    )  # fmt: skip
    assert first.status_code == 202 and first.headers["Retry-After"] == "1", first.text
    location = server.url + first.headers["Location"]

    def polled() -> requests.Response | None:
        answer = requests.get(location, headers=auth, timeout=30)
        return answer if answer.status_code != 202 else None

    done = wait_until(polled, 60, "the export to finish in the background")
    assert done.status_code == 201 and done.json()["export"] == export_key
    assert done.headers["Idempotent-Replayed"] == "true"
    retry = requests.post(
        f"{server.url}/exports", json={}, headers={**auth, "Idempotency-Key": export_key},
        timeout=30,
    )  # fmt: skip
    assert retry.status_code == 201 and retry.content == done.content

    pay_key = f"pay-{uuid.uuid4()}"
    for _ in range(2):  # a retry stages nothing more
        paid = requests.post(
            f"{server.url}/payments", json={"amount": 500},
            headers={**auth, "Idempotency-Key": pay_key}, timeout=30,
        )  # fmt: skip
        assert paid.status_code == 201, paid.text

    def receipts() -> int:
        row = db.execute(
            "SELECT count(*) FROM receipts WHERE tenant = %s AND payment_key = %s",
            (account, pay_key),
        ).fetchone()
        return int(row[0]) if row else 0

    def jobs_left() -> int:
        row = db.execute(
            "SELECT count(*) FROM idempotency_jobs WHERE tenant = %s", (account,)
        ).fetchone()
        return int(row[0]) if row else -1

    wait_until(receipts, 60, "the receipt to be sent")
    # The dispatcher forgets the job when its batch commits, just after the receipt.
    wait_until(lambda: jobs_left() == 0, 30, "the dispatched job to be forgotten")
    assert receipts() == 1
