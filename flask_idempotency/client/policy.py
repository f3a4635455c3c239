"""What the httpx transport and the requests adapter share: which requests get a key, which
answers and errors are retried, and how long to wait before the next attempt.

Nothing here does I/O or imports an HTTP library, so that the sync and async transports and
the adapter decide alike and each keeps only its library's calls.
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timezone

logger = logging.getLogger("flask_idempotency.client")

#: the request header that carries the key
KEY_HEADER = "Idempotency-Key"
#: the media type of the server's problem answers (RFC 9457)
PROBLEM = "application/problem+json"
#: a problem body larger than this is not read to find ``retryable`` (ours are ~300 bytes)
MAX_PROBLEM_BYTES = 64 * 1024
#: the request header a retry says when its request was first sent in (OASIS Repeatable
#: Requests 1.0, an HTTP-date): a server that kept nothing of an older key refuses it
FIRST_SENT_HEADER = "Repeatability-First-Sent"


class KeyExpired(Exception):
    """The server answered 409 ``key-expired`` (SPEC §24): the request ran under this key
    long ago and its answer expired, or it was first sent longer ago than the server keeps
    keys. Never retried, and no new key is made for it: whether it took effect is for the
    caller to find out before it sends the request again under a new key.

    *problem* is the answer's problem object (``{}`` if it had none), whose members are
    also attributes: ``completed_at``, ``expired_at`` and ``first_status`` (None when the
    server does not know them), ``operation_state`` and ``safe_new_key``.
    """

    def __init__(self, key: str, problem: dict[str, object]) -> None:
        super().__init__(f"the answer of the request with Idempotency-Key {key!r} has expired")
        self.key = key
        self.problem = problem
        self.completed_at = problem.get("completed_at")
        self.expired_at = problem.get("expired_at")
        self.first_status = problem.get("first_status")
        self.operation_state = problem.get("operation_state", "expired")
        self.safe_new_key = problem.get("safe_new_key", False)


KeyExpired.__module__ = "flask_idempotency.client"


def json_object(body: bytes) -> dict[str, object] | None:
    """*body* as a JSON object (a problem, or Stripe's error); None when it is too large to
    be one of ours, not JSON, or not an object."""
    if len(body) > MAX_PROBLEM_BYTES:
        return None
    try:
        found = json.loads(body)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def expired_problem(body: bytes) -> dict[str, object] | None:
    """The problem (or Stripe's error object) of a ``key-expired`` answer; None for any
    other answer."""
    found = json_object(body)
    if found is None:
        return None
    error = found.get("error")
    if isinstance(error, dict):  # IDEMPOTENCY_ERROR_FORMAT = "stripe"
        return error if error.get("code") == "key-expired" else None
    slug = str(found.get("type", "")).rsplit(":", 1)[-1].rsplit("/", 1)[-1]
    return found if slug == "key-expired" else None


def new_key() -> str:
    """A fresh key: a UUID4, as Stripe's SDKs make them."""
    return str(uuid.uuid4())


@dataclass(frozen=True)
class RetryPolicy:
    """The settings of a transport or adapter, checked once when it is made."""

    max_attempts: int
    max_elapsed: float
    backoff: float
    max_backoff: float
    methods: frozenset[str]

    @classmethod
    def checked(
        cls,
        max_attempts: int,
        max_elapsed: float,
        backoff: float,
        max_backoff: float,
        methods: Iterable[str],
    ) -> RetryPolicy:
        if isinstance(methods, str):  # ("POST") for ("POST",): every letter a method
            raise TypeError(f"methods must be a collection of method names, got {methods!r}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
            raise TypeError(f"max_attempts must be an int, got {max_attempts!r}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        for name, value in (("max_elapsed", max_elapsed), ("max_backoff", max_backoff)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if not (math.isfinite(backoff) and 0 <= backoff <= max_backoff):
            raise ValueError(f"backoff must be between 0 and max_backoff, got {backoff}")
        return cls(
            max_attempts,
            float(max_elapsed),
            float(backoff),
            float(max_backoff),
            frozenset(method.upper() for method in methods),
        )

    def covers(self, method: str) -> bool:
        """Whether a request with *method* gets a key and retries."""
        return method.upper() in self.methods


def should_retry_header(value: str | None) -> bool | None:
    """``Stripe-Should-Retry``: True, False, or None when absent or neither."""
    if value is None:
        return None
    return {"true": True, "false": False}.get(value.strip().lower())


def retryable_status(status: int, should_retry: bool | None) -> bool | None:
    """Whether an answer with *status* is worth another attempt with the same key.

    None means "it depends on the body": a 409 without ``Stripe-Should-Retry`` is retried
    when its problem says ``retryable: true``, so the caller reads the body and asks
    :func:`retryable_problem`.
    """
    if should_retry is False:
        return False  # the server knows: another attempt cannot succeed
    if status < 400 or status == 422:
        return False
    if status == 409:
        return True if should_retry else None
    if status in (429, 503):
        return True
    # Other 5xx only when the server says so: a 500 of the view may well repeat.
    return bool(should_retry) and status >= 500


def wants_body(content_type: str | None, content_length: str | None) -> bool:
    """Whether to read the body of an answer that :func:`retryable_status` left open."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media not in (PROBLEM, "application/json"):
        return False
    try:
        return content_length is None or int(content_length) <= MAX_PROBLEM_BYTES
    except ValueError:
        return False


def retryable_problem(body: bytes) -> bool:
    """A problem body's ``retryable`` member (RFC 9457 extension; False when not a problem)."""
    problem = json_object(body)
    return problem is not None and problem.get("retryable") is True


def retry_after_seconds(value: str | None, now: Callable[[], float] = time.time) -> float | None:
    """``Retry-After`` in seconds: delta-seconds or an HTTP-date; None when absent or bad."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT; "-0000" parses naive
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - now())


@dataclass
class Attempts:
    """One request's retries: how many were made, and the budget that is left.

    The budget is counted from the first attempt with :func:`time.monotonic`, so a clock
    change cannot stretch it. *label* names the request in the log line of each retry.
    """

    policy: RetryPolicy
    random: Callable[[], float]
    label: str
    #: the request's key
    key: str = ""
    made: int = 0
    started: float = field(default_factory=time.monotonic)
    #: when the first attempt was made, an HTTP-date (``Repeatability-First-Sent``)
    first_sent: str = field(default_factory=lambda: email.utils.formatdate(usegmt=True))

    def attempt(self) -> None:
        """Count an attempt that is about to be sent."""
        self.made += 1

    def after_error(self, error: BaseException) -> float | None:
        """Seconds to wait after an attempt that raised a retryable *error*; None to raise it."""
        return self._next(None, error)

    def retry_headers(self) -> dict[str, str]:
        """The headers the attempt about to be sent adds: on a retry, when its request was
        first sent (``Repeatability-First-Sent``)."""
        return {FIRST_SENT_HEADER: self.first_sent} if self.made > 1 else {}

    def after_answer(
        self, status: int, headers: Mapping[str, str], body: Callable[[], bytes], answer: object
    ) -> float | None:
        """Seconds to wait after an answer; None to return it. *body* is called only for a
        409, whose problem then decides (``retryable``, or ``key-expired``).

        :raises KeyExpired: the answer is 409 ``key-expired``.
        """
        if status == 409 and wants_body(headers.get("Content-Type"), headers.get("Content-Length")):
            expired = expired_problem(body())
            if expired is not None:
                raise KeyExpired(self.key, expired)
        retry = retryable_status(status, should_retry_header(headers.get("Stripe-Should-Retry")))
        if retry is None:
            retry = wants_body(
                headers.get("Content-Type"), headers.get("Content-Length")
            ) and retryable_problem(body())
        if not retry:
            return None
        return self._next(retry_after_seconds(headers.get("Retry-After")), answer)

    def _next(self, retry_after: float | None, outcome: object) -> float | None:
        wait = self.wait_before_next(retry_after)
        if wait is not None:
            logger.info(
                "%s: attempt %d of %d got %s; next in %.2f s",
                self.label,
                self.made,
                self.policy.max_attempts,
                repr(outcome) if isinstance(outcome, BaseException) else outcome,
                wait,
            )
        return wait

    def wait_before_next(self, retry_after: float | None) -> float | None:
        """Seconds to wait before the next attempt, or None when none is to be made.

        The server's ``Retry-After`` is followed when given (capped by ``max_backoff``);
        otherwise the wait is exponential with full jitter: a random fraction of
        ``backoff * 2 ** (attempts - 1)``, capped by ``max_backoff``. When the attempts are
        spent, or the wait would end at or past the end of the budget, there is no next
        attempt: waiting only to give up would just delay the answer.
        """
        policy = self.policy
        if self.made >= policy.max_attempts:
            return None
        if retry_after is not None:
            wait = min(retry_after, policy.max_backoff)
        else:
            # the exponent is capped: 2 ** 1000 would not fit a float, and 2 ** 60 * backoff
            # is past any max_backoff already
            ceiling = min(policy.max_backoff, policy.backoff * 2 ** min(self.made - 1, 60))
            wait = self.random() * ceiling
        remaining = policy.max_elapsed - (time.monotonic() - self.started)
        if wait >= remaining:
            return None
        return max(0.0, wait)


def label(method: object, url: object, key: object) -> str:
    """How a retry's log line names its request."""
    return f"{method} {url} (Idempotency-Key {key})"
