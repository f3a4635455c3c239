"""The client (``flask_idempotency.client``) against real gunicorn, through a TCP proxy that
counts requests and can lose answers after the server sent them.

Every scenario runs with the three clients: httpx's :class:`IdempotentTransport`, its async
twin, and requests' :class:`IdempotentAdapter`. Their waits go through a recording ``sleep``
(which really sleeps, so the budget's clock is the real one) and their jitter is fixed at
one half, so each wait is known. The app is tests/apps/e2e_app.py: ``POST /pay`` records each run
of the view in ``e2e_executions`` and holds at a gate on request.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
import pytest
import requests
from psycopg.rows import TupleRow

from flask_idempotency.client import (
    AsyncIdempotentTransport,
    IdempotentAdapter,
    IdempotentTransport,
    KeyExpired,
)
from flask_idempotency.client.policy import (
    Attempts,
    RetryPolicy,
    retry_after_seconds,
    retryable_status,
)
from flask_idempotency.testing.postgres import free_port
from flask_idempotency.testing.proxy import TcpProxy
from tests.apps.e2e_app import create_tables, environment
from tests.support.gunicorn_server import GunicornServer, Response, post, wait_until

DB = psycopg.Connection[TupleRow]
APP = "tests.apps.e2e_app:create_app()"
KINDS = ["httpx", "httpx-async", "requests"]
PROBLEM_BASE = "tag:flask-idempotency,2026:problem:"
JITTER = 0.5  # what random() returns: each jittered wait is half its ceiling
PROBLEM_TYPE = "application/problem+json"


# -- the servers ------------------------------------------------------------------------------


def serve(
    tmp_path_factory: pytest.TempPathFactory, env: dict[str, str], workers: int
) -> Iterator[int]:
    """The e2e app under gunicorn with *env*, for a module: its port."""
    gunicorn = GunicornServer(
        APP,
        log_path=tmp_path_factory.mktemp("client") / "gunicorn.log",
        env=env,
        workers=workers,
        ready_path="/health",
    )
    gunicorn.start()
    try:
        yield gunicorn.port
    finally:
        gunicorn.stop()


@pytest.fixture(scope="module")
def server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The e2e app; an abandoned claim becomes ``unknown``. Two workers: one may be held."""
    create_tables(database_url)
    env = environment(database_url, database_url, on_abandoned="unknown")
    yield from serve(tmp_path_factory, env, workers=2)


@pytest.fixture(scope="module")
def outage(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The e2e app whose store is a port nothing listens on: every POST /pay answers 503
    ``store-unavailable`` with ``Retry-After: 1``, after the pool's short timeout."""
    dead = f"postgresql://nobody@127.0.0.1:{free_port()}/nothing?connect_timeout=1"
    env = environment(dead, database_url, pool_timeout=0.2, retry_after=1)
    yield from serve(tmp_path_factory, env, workers=1)


@pytest.fixture
def front(server: int) -> Iterator[TcpProxy]:
    """The proxy in front of the app: counts the requests the client sends."""
    with TcpProxy("127.0.0.1", server) as proxy:
        yield proxy


@pytest.fixture
def tenant() -> str:
    return f"client-{uuid.uuid4()}"


def executions(db: DB, tenant: str, key: str) -> int:
    row = db.execute(
        "SELECT count(*) FROM e2e_executions WHERE tenant = %s AND key = %s", (tenant, key)
    ).fetchone()
    assert row is not None
    return int(row[0])


# -- the clients, driven alike -------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: Mapping[str, str]
    body: Any
    key: str | None  #: the Idempotency-Key the request went out with

    @property
    def replayed(self) -> bool:
        return self.headers.get("Idempotent-Replayed") == "true"

    def problem(self) -> str:
        assert self.headers.get("Content-Type", "").startswith("application/problem+json")
        return str(self.body["type"]).removeprefix(PROBLEM_BASE)


@dataclass
class Caller:
    """One kind of client to *base_url*, its waits recorded in :attr:`sleeps`."""

    kind: str
    base_url: str
    options: dict[str, Any] = field(default_factory=dict)
    sleeps: list[float] = field(default_factory=list)
    #: called before each wait (a test opens a gate there)
    on_sleep: Callable[[], None] = lambda: None

    def _sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.on_sleep()
        time.sleep(seconds)

    async def _async_sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.on_sleep()
        await asyncio.sleep(seconds)

    def send(self, method: str, path: str, **kwargs: Any) -> Answer:
        """Send one request (``headers=``, ``json=`` or ``body=``) through the client."""
        options = {"random": lambda: JITTER, **self.options}
        if self.kind == "requests":
            return self._requests(method, path, options, **kwargs)
        if self.kind == "httpx":
            transport = IdempotentTransport(sleep=self._sleep, **options)
            with httpx.Client(transport=transport, base_url=self.base_url, timeout=10) as client:
                return self._httpx(client.request(method, path, **self._httpx_args(kwargs)))
        return asyncio.run(self._send_async(method, path, options, **kwargs))

    async def _send_async(
        self, method: str, path: str, options: dict[str, Any], **kwargs: Any
    ) -> Answer:
        transport = AsyncIdempotentTransport(sleep=self._async_sleep, **options)
        async with httpx.AsyncClient(
            transport=transport, base_url=self.base_url, timeout=10
        ) as client:
            return self._httpx(await client.request(method, path, **self._httpx_args(kwargs)))

    def _httpx_args(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if "body" not in kwargs:
            return kwargs
        body = kwargs.pop("body")
        if self.kind == "httpx-async":  # an AsyncClient streams async iterables only
            body = _async_iterator(body)
        return {**kwargs, "content": body}

    @staticmethod
    def _httpx(response: httpx.Response) -> Answer:
        # read and closed as any answer of httpx, though the transport read it first
        assert response.is_closed and response.elapsed.total_seconds() > 0
        return Answer(
            response.status_code,
            response.headers,
            _json(response.headers, response.content),
            response.request.headers.get("Idempotency-Key"),
        )

    def _requests(self, method: str, path: str, options: dict[str, Any], **kwargs: Any) -> Answer:
        if "body" in kwargs:
            kwargs["data"] = kwargs.pop("body")
        with requests.Session() as session:
            session.mount("http://", IdempotentAdapter(sleep=self._sleep, **options))
            response = session.request(method, self.base_url + path, timeout=10, **kwargs)
        key = response.request.headers.get("Idempotency-Key")
        return Answer(
            response.status_code,
            httpx.Headers(list(response.headers.items())),  # case-insensitive, as httpx's
            _json(response.headers, response.content),
            key if key is None else str(key),
        )


def _json(headers: Mapping[str, str], content: bytes) -> Any:
    return json.loads(content) if "json" in headers.get("Content-Type", "") else content


async def _async_iterator(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


@pytest.fixture(params=KINDS)
def caller(request: pytest.FixtureRequest, front: TcpProxy) -> Caller:
    return Caller(request.param, f"http://127.0.0.1:{front.port}")


#: what each client raises when the connection closes without an answer
LOST = (httpx.TransportError, requests.ConnectionError)


class Held:
    """A ``POST /pay`` sent straight to the app (not through the proxy) from a thread, its
    view held at a gate until :meth:`open`; joined on exit, the gate opened whatever
    happened."""

    def __init__(self, db: DB, port: int, tenant: str, key: str) -> None:
        self.db = db
        self.gate = f"gate-{uuid.uuid4()}"
        db.execute("INSERT INTO e2e_gates (name) VALUES (%s)", (self.gate,))
        self.answer: list[Response | BaseException] = []
        headers = {"X-Tenant": tenant, "X-Gate": self.gate}
        self.thread = threading.Thread(target=self._send, args=(port, key, headers))

    def _send(self, port: int, key: str, headers: dict[str, str]) -> None:
        try:
            self.answer.append(post(port, "/pay", key, headers=headers))
        except (OSError, http.client.HTTPException) as exc:
            self.answer.append(exc)

    def open(self) -> None:
        self.db.execute("UPDATE e2e_gates SET open = true WHERE name = %s", (self.gate,))

    def __enter__(self) -> Held:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.open()
        self.thread.join(60)
        assert not self.thread.is_alive()


# -- what is retried -------------------------------------------------------------------------


def test_an_answer_lost_after_the_commit_is_replayed_to_the_retry(
    caller: Caller, front: TcpProxy, db: DB, tenant: str
) -> None:
    """The server ran the view, stored its answer and sent it; the proxy lost it. The client
    retries with the same key and gets the stored answer; the view ran once."""
    front.drop_answers(1)
    answer = caller.send("POST", "/pay", headers={"X-Tenant": tenant}, json={"amount": 7})
    assert answer.status == 201 and answer.replayed, answer
    assert answer.key is not None and str(uuid.UUID(answer.key)) == answer.key  # a UUID4
    assert answer.body["key"] == answer.key and answer.body["amount"] == 7
    assert executions(db, tenant, answer.key) == 1
    assert front.round_trips == 2
    assert caller.sleeps == [0.5 * JITTER]  # backoff 0.5, full jitter


def test_errors_until_the_attempts_are_spent_raise_the_last(
    caller: Caller, front: TcpProxy, db: DB, tenant: str
) -> None:
    caller.options = {"max_attempts": 3}
    front.drop_answers(10)
    with pytest.raises(LOST):
        caller.send("POST", "/pay", headers={"X-Tenant": tenant, "Idempotency-Key": "lost"})
    assert front.round_trips == 3
    assert caller.sleeps == [0.5 * JITTER, 1.0 * JITTER]  # the ceiling doubles
    assert executions(db, tenant, "lost") == 1  # the retries were replays, lost too


def test_a_request_in_progress_is_waited_for_as_the_server_says(
    caller: Caller, server: int, front: TcpProxy, db: DB, tenant: str
) -> None:
    """409 ``request-in-progress`` with ``Retry-After``: the client waits that long (not its
    own backoff) and gets the answer of the run it waited for. Its own key is kept."""
    key = f"mine-{uuid.uuid4()}"
    with Held(db, server, tenant, key) as held:
        wait_until(lambda: executions(db, tenant, key) == 1, 30, "the held view to start")
        caller.on_sleep = held.open
        mine = {"X-Tenant": tenant, "Idempotency-Key": key}  # the held request's key and body
        answer = caller.send("POST", "/pay", headers=mine, json={"amount": 100})
    assert answer.key == key
    assert answer.status == 201 and answer.replayed, answer
    first = held.answer[0]
    assert isinstance(first, Response) and first.status == 201
    assert answer.body == first.json()
    assert executions(db, tenant, key) == 1
    # Retry-After is whole seconds, at least IDEMPOTENCY_RETRY_AFTER (1): not a jittered wait
    assert caller.sleeps and all(s >= 1 and s.is_integer() for s in caller.sleeps)
    assert front.round_trips == 1 + len(caller.sleeps)


# -- what is returned at once ----------------------------------------------------------------


def test_a_reused_key_is_returned_at_once(
    caller: Caller, server: int, front: TcpProxy, tenant: str
) -> None:
    key = f"reused-{uuid.uuid4()}"
    assert post(server, "/pay", key, {"amount": 1}, headers={"X-Tenant": tenant}).status == 201
    answer = caller.send(
        "POST", "/pay", headers={"X-Tenant": tenant, "Idempotency-Key": key}, json={"amount": 2}
    )
    assert answer.status == 422 and answer.problem() == "key-reused"
    assert answer.headers["Stripe-Should-Retry"] == "false"
    assert front.round_trips == 1 and caller.sleeps == []


def test_an_unknown_outcome_is_returned_at_once(
    caller: Caller, server: int, front: TcpProxy, db: DB, tenant: str
) -> None:
    """The held run's lease ends: the server (``on_abandoned="unknown"``) cannot know whether
    it took effect, answers 409 ``outcome-unknown``, and the client does not insist."""
    key = f"unknown-{uuid.uuid4()}"
    with Held(db, server, tenant, key):
        wait_until(lambda: executions(db, tenant, key) == 1, 30, "the held view to start")
        db.execute(
            "UPDATE idempotency_keys SET locked_until = now() WHERE tenant = %s AND key = %s",
            (tenant, key),
        )
        mine = {"X-Tenant": tenant, "Idempotency-Key": key}  # the held request's key and body
        answer = caller.send("POST", "/pay", headers=mine, json={"amount": 100})
    assert answer.status == 409 and answer.problem() == "outcome-unknown", answer
    assert answer.body["retryable"] is False
    assert front.round_trips == 1 and caller.sleeps == []
    assert executions(db, tenant, key) == 1


def test_an_expired_key_raises_key_expired_at_once(
    caller: Caller, server: int, front: TcpProxy, db: DB, tenant: str
) -> None:
    """SPEC §24: a 409 ``key-expired`` is raised as KeyExpired, never retried, and the
    request is not sent again under another key."""
    key = f"expired-{uuid.uuid4()}"
    assert post(server, "/pay", key, {"amount": 1}, headers={"X-Tenant": tenant}).status == 201
    db.execute(
        "UPDATE idempotency_keys SET expires_at = now() WHERE tenant = %s AND key = %s",
        (tenant, key),
    )
    with pytest.raises(KeyExpired) as raised:
        caller.send(
            "POST", "/pay", headers={"X-Tenant": tenant, "Idempotency-Key": key}, json={"amount": 1}
        )
    expired = raised.value
    assert expired.key == key and expired.first_status == 201
    assert expired.operation_state == "expired" and expired.safe_new_key is False
    assert isinstance(expired.completed_at, str) and isinstance(expired.expired_at, str)
    assert front.round_trips == 1 and caller.sleeps == []
    assert executions(db, tenant, key) == 1


def test_other_methods_are_untouched(caller: Caller, front: TcpProxy) -> None:
    """A GET gets no key and is never retried, not even after a lost answer."""
    answer = caller.send("GET", "/health")
    assert answer.status == 200 and answer.key is None
    front.drop_answers(1)
    with pytest.raises(LOST):
        caller.send("GET", "/health")
    assert front.round_trips == 2 and caller.sleeps == []


def test_a_streamed_body_gets_a_key_and_is_sent_once(
    caller: Caller, front: TcpProxy, db: DB, tenant: str
) -> None:
    """A generator body cannot be sent twice: no retry after the lost answer."""

    def body() -> Iterator[bytes]:
        yield b'{"amount": '
        yield b"3}"

    front.drop_answers(1)
    key = f"streamed-{uuid.uuid4()}"
    headers = {"X-Tenant": tenant, "Content-Type": "application/json", "Idempotency-Key": key}
    with pytest.raises(LOST):
        caller.send("POST", "/pay", headers=headers, body=body())
    assert front.round_trips == 1 and caller.sleeps == []
    assert executions(db, tenant, key) == 1


# -- the budget ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_budget_in_seconds_is_kept(kind: str, outage: int) -> None:
    """Every answer is 503 with ``Retry-After: 1``: the client stops when the next wait would
    end past ``max_elapsed``, with the last answer, before ``max_attempts`` (5) are spent."""
    with TcpProxy("127.0.0.1", outage) as proxy:
        caller = Caller(kind, f"http://127.0.0.1:{proxy.port}", {"max_elapsed": 2.5})
        started = time.monotonic()
        answer = caller.send("POST", "/pay", json={"amount": 1})
        elapsed = time.monotonic() - started
    assert answer.status == 503 and answer.problem() == "store-unavailable"
    assert answer.headers["Retry-After"] == "1"
    # no wait ends past the budget: the last attempt starts within it, and takes ~0.2 s
    assert elapsed < 2.5 + 1.0, elapsed
    assert caller.sleeps in ([1.0], [1.0, 1.0]), caller.sleeps
    assert proxy.round_trips == len(caller.sleeps) + 1


@pytest.mark.parametrize("kind", KINDS)
def test_the_budget_in_attempts_is_kept(kind: str, outage: int) -> None:
    with TcpProxy("127.0.0.1", outage) as proxy:
        caller = Caller(kind, f"http://127.0.0.1:{proxy.port}", {"max_attempts": 2})
        answer = caller.send("POST", "/pay", json={"amount": 1})
    assert answer.status == 503
    assert caller.sleeps == [1.0] and proxy.round_trips == 2


# -- the policy, without a server ------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "should_retry", "retry"),
    [
        (201, None, False),
        (409, True, True),
        (409, None, None),  # the problem's "retryable" decides
        (409, False, False),
        (422, None, False),
        (422, True, False),
        (400, None, False),
        (429, None, True),
        (503, None, True),
        (503, False, False),
        (500, None, False),
        (500, True, True),
        (502, True, True),
        (404, True, False),
    ],
)
def test_which_answers_are_retried(status: int, should_retry: bool | None, retry: object) -> None:
    assert retryable_status(status, should_retry) is retry


def test_a_409_is_retried_on_its_problem_alone() -> None:
    """Without ``Stripe-Should-Retry`` (a proxy dropped it), the problem's ``retryable``
    decides. (httpx's MockTransport stands for the server: ours always sends the header.)"""
    problem = {"type": "in-progress", "status": 409, "retryable": True}
    answers = [
        httpx.Response(409, headers={"Content-Type": "application/problem+json"}, json=problem),
        httpx.Response(409, headers={"Content-Type": "application/problem+json"}, json={}),
    ]
    keys: list[str | None] = []

    def server(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers.get("Idempotency-Key"))
        return answers[len(keys) - 1]

    waits: list[float] = []
    transport = IdempotentTransport(
        httpx.MockTransport(server), sleep=waits.append, random=lambda: 0.0
    )
    with httpx.Client(transport=transport) as client:
        answer = client.patch("http://api/orders/1", json={"state": "paid"})
    assert answer.status_code == 409 and answer.json() == {}  # not retryable: returned
    assert waits == [0.0] and len(keys) == 2 and keys[0] == keys[1] is not None


def test_a_retry_says_when_its_request_was_first_sent() -> None:
    """``Repeatability-First-Sent`` (OASIS Repeatable Requests 1.0) on every retry, the same
    HTTP-date each time; not on the first attempt."""
    sent: list[str | None] = []

    def server(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("Repeatability-First-Sent"))
        return httpx.Response(503 if len(sent) < 3 else 201, json={})

    transport = IdempotentTransport(
        httpx.MockTransport(server), sleep=lambda s: None, random=lambda: 0.0
    )
    with httpx.Client(transport=transport) as client:
        assert client.post("http://api/pay", json={}).status_code == 201
    first, *retries = sent
    assert first is None and len(retries) == 2 and retries[0] == retries[1]
    assert retries[0] is not None and retry_after_seconds(retries[0]) == 0.0  # a past date


def test_a_key_expired_problem_in_stripes_shape_raises_too() -> None:
    error = {"error": {"type": "invalid_request_error", "code": "key-expired", "message": "x"}}

    def server(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409, headers={"Stripe-Should-Retry": "false"}, json=error)

    transport = IdempotentTransport(httpx.MockTransport(server), sleep=lambda s: None)
    with httpx.Client(transport=transport) as client, pytest.raises(KeyExpired) as raised:
        client.post("http://api/pay", json={})
    assert raised.value.first_status is None and raised.value.operation_state == "expired"


@pytest.mark.parametrize(
    "body", [b"[1]", b'"key-expired"', b"null", b"{", b'{"error": [1]}', b"x" * 70_000]
)
def test_a_409_body_that_is_no_problem_object_is_returned(body: bytes) -> None:
    """A 409 whose body is JSON but not an object (or no JSON) raises nothing: returned."""
    transport = IdempotentTransport(
        httpx.MockTransport(
            lambda r: httpx.Response(409, headers={"Content-Type": PROBLEM_TYPE}, content=body)
        ),
        sleep=lambda s: None,
    )
    with httpx.Client(transport=transport) as client:
        assert client.post("http://api/pay", json={}).status_code == 409


def test_waits_are_capped_by_max_backoff_and_the_budget() -> None:
    policy = RetryPolicy.checked(8, 30.0, 0.5, 3.0, ["post"])
    assert policy.covers("POST") and not policy.covers("GET")
    attempts = Attempts(policy, lambda: 0.999, "POST /x")
    waits = []
    for _ in range(5):
        attempts.attempt()
        waits.append(round(attempts.wait_before_next(None) or -1, 2))
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert attempts.wait_before_next(120.0) == 3.0  # Retry-After, capped too
    attempts.started -= 29.0  # one second of budget left
    assert attempts.wait_before_next(2.0) is None  # not worth waiting only to give up
    assert attempts.wait_before_next(0.0) == 0.0


def test_retry_after_as_seconds_or_a_date() -> None:
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=lambda: 1445412475.0) == 5.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert retry_after_seconds("soon") is None and retry_after_seconds("-1") is None
    assert retry_after_seconds(None) is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_attempts": 0}, "max_attempts must be at least 1"),
        ({"max_elapsed": 0}, "max_elapsed must be a positive"),
        ({"backoff": 9.0}, "backoff must be between 0 and max_backoff"),
        ({"max_backoff": float("inf")}, "max_backoff must be a positive"),
    ],
)
def test_bad_settings_fail_when_made(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        IdempotentTransport(httpx.MockTransport(lambda r: httpx.Response(200)), **options)
    with pytest.raises(ValueError, match=message):
        IdempotentAdapter(**options)
    with pytest.raises(TypeError, match="collection of method names"):
        IdempotentAdapter(methods="POST")


def test_the_module_imports_without_the_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without httpx, the module imports; the transport says which extra to install."""
    import flask_idempotency.client as client

    monkeypatch.setitem(sys.modules, "httpx", None)
    monkeypatch.delitem(sys.modules, "flask_idempotency.client.transport")
    monkeypatch.delattr(client, "IdempotentTransport")
    with pytest.raises(ImportError, match=r"pip install 'flask-idempotency\[client\]'"):
        client.IdempotentTransport  # noqa: B018
    with pytest.raises(AttributeError):
        client.Nothing  # noqa: B018
