"""The retrying clients: the requests they send, each key's exchanges, and when they retry."""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

DUPLICATE_SHARE = 0.15  # steps that send an answered key again
MAX_INTENTS_PER_CLIENT = 400


MAX_STEPS_PER_CLIENT = 4000
HTTP_TIMEOUT = 20.0


RETRY_AFTER_CAP = 3.0  # a client obeys Retry-After up to this many seconds
UNKNOWN_RETRY = 1.5  # an outcome-unknown key is asked again after this long


ERROR_RETRY = 0.3  # after a connection error


@dataclasses.dataclass(frozen=True)
class Request:
    """One of the requests the clients send, each time with a key of its own."""

    method: str
    path: str
    body: bytes | None
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, item: Sequence[Any]) -> Request:
        """From ``(method, path, body)`` or ``(method, path, body, headers)``: a body of
        bytes or ``str`` is sent as it is, None is no body, anything else is JSON."""
        if len(item) not in (3, 4):
            raise ValueError(f"a request is (method, path, body[, headers]), not {item!r}")
        method, path, body = item[0], item[1], item[2]
        headers = dict(item[3]) if len(item) == 4 and item[3] else {}
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
            headers.setdefault("Content-Type", "application/json")
        data = body.encode() if isinstance(body, str) else body
        return cls(str(method).upper(), str(path), data, tuple(headers.items()))

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


@dataclasses.dataclass
class Exchange:
    """One request and what came back."""

    purpose: str  #: first, retry, duplicate or verify
    sent: float  #: ``time.monotonic()``
    received: float
    status: int | None = None  #: None: no HTTP answer (connection error, timeout)
    replayed: bool = False
    body: bytes = b""
    problem: str = ""  #: the problem type's last segment
    retry_after: float | None = None
    error: str = ""
    #: ``time.time()`` when the answer (or the error) came, beside the runs' times
    at: float = dataclasses.field(default_factory=time.time)

    @property
    def pending(self) -> bool:
        """A ``202 Accepted`` of an ``asynchronous=True`` route's key still at work (SPEC
        §10: ``Retry-After``, never a replay): not the key's answer, which comes later."""
        return self.status == 202 and not self.replayed and self.retry_after is not None

    def label(self) -> str:
        if self.status is None:
            return self.error
        if self.problem:
            return f"{self.status} {self.problem}"
        if self.pending:
            return "202 accepted"
        return f"{self.status}{' replay' if self.replayed else ''}"


@dataclasses.dataclass
class Intent:
    """A key a client wants done, with one of the requests, and every exchange for it."""

    client: int
    key: str
    request: Request
    exchanges: list[Exchange] = dataclasses.field(default_factory=list)
    ack: Exchange | None = None  #: the first 2xx: what the client was told happened
    #: the first ``202 Accepted`` of an asynchronous route's key, followed by retries to
    #: the key's answer (the ack), which every later one must replay
    accepted: Exchange | None = None
    final: bool = False
    next_at: float = 0.0

    def absorb(self, answer: Exchange) -> None:
        """Update the state with an answer to a first request or a retry."""
        now = answer.received
        status = answer.status
        if status is None:
            self.next_at = now + ERROR_RETRY
        elif answer.replayed and not 200 <= status < 300:
            self.final = True  # a stored answer: no retry can change it (a finding if 5xx)
        elif answer.pending:
            self.accepted = self.accepted or answer
            self.next_at = now + min(answer.retry_after or 1.0, RETRY_AFTER_CAP)
        elif 200 <= status < 300:
            self.ack = self.ack or answer
            self.final = True
        elif status == 409 and answer.problem == "key-expired":
            self.final = True  # past its life (SPEC §24): answered so, never run again
        elif status == 409 and answer.problem == "outcome-unknown":
            self.next_at = now + UNKNOWN_RETRY
        elif status in (409, 429, 503):
            self.next_at = now + min(answer.retry_after or 1.0, RETRY_AFTER_CAP)
        elif status >= 500:
            self.next_at = now + 1.0
        else:  # another 4xx: no retry can change it (and it is a finding)
            self.final = True


def _send(port: int, intent: Intent, headers: Mapping[str, str], purpose: str) -> Exchange:
    """Send *intent*'s request once, on a new connection: whatever comes back, or the
    connection error, is the exchange (never raised: a client retries on it)."""
    request = intent.request
    all_headers = {**headers, **dict(request.headers), "Idempotency-Key": intent.key}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT)
    sent = time.monotonic()
    try:
        conn.request(request.method, request.path, body=request.body, headers=all_headers)
        answer = conn.getresponse()
        body = answer.read()
    except (OSError, http.client.HTTPException) as exc:
        return Exchange(purpose, sent, time.monotonic(), error=type(exc).__name__)
    finally:
        conn.close()
    problem = ""
    if (answer.getheader("Content-Type") or "").startswith("application/problem+json"):
        try:
            problem = str(json.loads(body)["type"]).rpartition(":")[2].rpartition("/")[2]
        except (ValueError, KeyError, TypeError):
            problem = "unreadable-problem"
    retry_after = answer.getheader("Retry-After")
    return Exchange(
        purpose,
        sent,
        time.monotonic(),
        answer.status,
        answer.getheader("Idempotent-Replayed") == "true",
        body,
        problem,
        float(retry_after) if retry_after and retry_after.isdigit() else None,
    )


class _Client:
    """One client thread: makes intents and retries each until it has a final answer."""

    def __init__(
        self,
        number: int,
        port: int,
        requests: Sequence[Request],
        headers: Mapping[str, str],
        prefix: str,
        seed: int,
        stop: threading.Event,
    ) -> None:
        self.number = number
        self.port = port
        self.requests = requests
        self.headers = headers
        self.prefix = prefix
        self.rng = random.Random(f"{seed}/client/{number}")
        self.stop = stop
        self.intents: list[Intent] = []
        self.lock = threading.Lock()
        self.failure: BaseException | None = None

    def run(self, deadline: float, new_intents: bool) -> None:
        """Bounded in steps and time: with *new_intents*, make and retry intents until
        stopped; without, only retry the open ones until none is left."""
        try:
            for _ in range(MAX_STEPS_PER_CLIENT):
                now = time.monotonic()
                if self.stop.is_set() or now > deadline:
                    return
                step = self.next_step(now, new_intents)
                if step is None:
                    waiting = [i.next_at for i in self.open()]
                    if not waiting:
                        return
                    self.stop.wait(min(0.5, max(0.01, min(waiting) - now)))
                    continue
                intent, purpose = step
                answer = _send(self.port, intent, self.headers, purpose)
                with self.lock:
                    intent.exchanges.append(answer)
                    if purpose != "duplicate":
                        intent.absorb(answer)
        except BaseException as exc:  # reported by the harness, never lost in a thread
            self.failure = exc

    def open(self) -> list[Intent]:
        with self.lock:
            return [i for i in self.intents if not i.final]

    def next_step(self, now: float, new_intents: bool) -> tuple[Intent, str] | None:
        due = [i for i in self.open() if i.next_at <= now]
        if due:
            return min(due, key=lambda i: i.next_at), "retry"
        if not new_intents:
            return None
        acked = [i for i in self.intents if i.ack is not None]
        if acked and self.rng.random() < DUPLICATE_SHARE:
            return self.rng.choice(acked), "duplicate"
        if len(self.intents) >= MAX_INTENTS_PER_CLIENT:
            return None
        request = self.rng.choice(self.requests)
        intent = Intent(self.number, f"{self.prefix}-c{self.number}-{len(self.intents)}", request)
        with self.lock:
            self.intents.append(intent)
        return intent, "first"

    def acked(self, path: str) -> bool:
        """A request to *path* was answered 2xx (an asynchronous route's 202 counts)."""
        with self.lock:
            return any(
                (i.ack or i.accepted) is not None and i.request.path == path for i in self.intents
            )


def _run_clients(
    clients: list[_Client], deadline: float, new_intents: bool
) -> list[threading.Thread]:
    threads = [
        threading.Thread(
            target=c.run, args=(deadline, new_intents), name=f"fault-client-{c.number}"
        )
        for c in clients
    ]
    for thread in threads:
        thread.start()
    return threads


def _join(threads: list[threading.Thread], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        raise RuntimeError(f"client threads still running after {timeout} s: {alive}")
