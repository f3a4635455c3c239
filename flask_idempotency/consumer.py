"""``idempotency.run_once(key, fn, ...)``: the same state machine for queue consumers.

The message id is the key. The first delivery runs ``fn`` and stores its result
(JSON, or the text of a ``serializer=``'s ``dumps``); a redelivery afterwards gets the
stored result (``loads`` of it) without running ``fn``; a delivery while another runs
raises :class:`~.errors.RequestInProgress`. An exception from ``fn`` always reaches the
caller; what the key becomes follows ``ON_EXCEPTION``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from flask import current_app

from . import tracing
from .answers import decision_signals
from .claim import PROCESS_ENDING, ClaimedKey, finish_attempt, peek_claim, pop_claim, set_claim
from .config import RouteSettings, convert_option
from .errors import (
    ConfigError,
    EncryptionError,
    FingerprintMismatch,
    IdempotencyError,
    InvalidKey,
    KeyExpired,
    OutcomeUnknown,
    RequestInProgress,
    StoreError,
)
from .keys import parse_key, tenant_tag
from .model import ClaimOutcome, Decision, KeyStatus, StoredResponse
from .state import IdempotencyState

logger = logging.getLogger("flask_idempotency")

T = TypeVar("T")

_JSON = [("Content-Type", "application/json")]
_TEXT = [("Content-Type", "text/plain; charset=utf-8")]
#: the stored status of a result, and of a failure kept under ``ON_EXCEPTION="store"``
RESULT_STATUS, FAILURE_STATUS = 200, 500


class Serializer(Protocol):
    """What ``run_once(..., serializer=)`` takes: a result as text, and back."""

    def dumps(self, obj: Any, /) -> str:
        """The result *obj* as text, stored as it is (UTF-8; NUL and lone surrogates
        are kept)."""

    def loads(self, text: str, /) -> Any:
        """The result again, from what :meth:`dumps` returned (on a redelivery)."""


class _JSONSerializer:
    """The default: JSON (NaN and infinities refused)."""

    def dumps(self, obj: Any) -> str:
        return json.dumps(obj, allow_nan=False)

    def loads(self, text: str) -> Any:
        return json.loads(text)

    def __repr__(self) -> str:
        return "JSON"


JSON = _JSONSerializer()


class StoredFailure(IdempotencyError):
    """The first delivery of this message raised, and ``ON_EXCEPTION`` is ``"store"``:
    later deliveries raise this instead of running ``fn`` again."""

    def __init__(self, key: str, exception_type: str, message: str, tenant: str = "") -> None:
        super().__init__(
            f"the first run of {key!r} raised {exception_type}: {message} (stored: it"
            f" will not run again until an operator runs {forget_command(tenant, key)})"
        )
        self.key = key
        #: the qualified name of the first exception's type
        self.exception_type = exception_type
        #: its message
        self.message = message


def run_once(
    state: IdempotencyState,
    key: str,
    fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tenant: str,
    on_exception: str | None = None,
    serializer: Serializer | None = None,
) -> T:
    """See :meth:`.Idempotency.run_once`."""
    serializer = _checked_serializer(serializer)
    settings = state.settings.route
    if on_exception is not None:
        settings = settings.override({"on_exception": _policy(on_exception)})
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str, got {tenant!r:.80}")
    if not isinstance(key, str):
        raise InvalidKey(f"the message key must be a str, got {key!r:.80}")
    key = parse_key([key], "The message key")
    trace = tracing.start(tenant, key)
    with trace.span(tracing.CLAIM) as span:
        outcome = state.store.claim(tenant, key, _fingerprint(fn), settings)
        span.claimed(outcome)
    _announce(tenant, key, outcome)
    if not outcome.owns_key:
        return _replayed(tenant, key, outcome, serializer)  # type: ignore[no-any-return]
    claim = ClaimedKey(tenant, key, outcome, settings, state.store, trace=trace)
    return _run(settings, claim, fn, args, kwargs, serializer)


def _checked_serializer(serializer: object) -> Serializer:
    """*serializer*, or the default JSON one; refused before anything runs if it has
    no callable ``dumps`` and ``loads``."""
    if serializer is None:
        return JSON
    if not all(callable(getattr(serializer, name, None)) for name in ("dumps", "loads")):
        raise TypeError(
            "run_once(serializer=...) must have dumps(obj) -> str and loads(str) -> obj,"
            f" got {serializer!r:.80}"
        )
    return serializer  # type: ignore[return-value]


def _fingerprint(fn: Callable[..., Any]) -> bytes:
    """The same message id given to another consumer function is misuse (422's twin)."""
    name = f"run_once\x00{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
    return hashlib.sha256(name.encode("utf-8", "backslashreplace")).digest()


def _policy(value: object) -> str:
    """A per-call ``on_exception``, checked as ``IDEMPOTENCY_ON_EXCEPTION`` is."""
    try:
        return str(convert_option("on_exception", value))
    except (ConfigError, TypeError):
        raise ConfigError(
            f"run_once(on_exception=...) must be 'store', 'release' or 'unknown' (as"
            f" IDEMPOTENCY_ON_EXCEPTION), got {value!r:.80}"
        ) from None


def forget_command(tenant: str, key: str) -> str:
    """The operator's command that forgets *key*, ready to paste into a shell."""
    command = f"flask idempotency-forget {shlex.quote(key)}"
    return f"{command} --tenant {shlex.quote(tenant)}" if tenant else command


def _replayed(tenant: str, key: str, outcome: ClaimOutcome, serializer: Serializer) -> Any:
    """The stored result, or the error a delivery that must not run gets."""
    decision = outcome.decision
    if decision is Decision.REPLAY:
        assert outcome.response is not None
        if outcome.response.status == FAILURE_STATUS:
            stored = json.loads(outcome.response.body)
            raise StoredFailure(key, stored["exception"], stored["message"], tenant)
        return _loaded(tenant, key, outcome.response.body, serializer)
    if decision is Decision.MISMATCH:
        raise FingerprintMismatch(f"the key {key!r} was used by another consumer function")
    if decision is Decision.IN_PROGRESS:
        raise RequestInProgress(
            f"a delivery of {key!r} is running right now; leave the message to be redelivered"
        )
    if decision is Decision.EXPIRED:
        raise KeyExpired(f"{key!r} ran, and its stored result expired; it will not run again")
    raise OutcomeUnknown(
        f"the outcome of {key!r} is unknown (a run was interrupted); resolve it first"
    )


def _loaded(tenant: str, key: str, body: bytes, serializer: Serializer) -> Any:
    """``loads`` of the stored result; its exception reaches the caller with a note
    (the key stays completed: *fn* ran, and runs again only once forgotten)."""
    try:
        return serializer.loads(body.decode("utf-8", "surrogatepass"))
    except Exception as exc:
        _add_note(
            exc,
            f"flask-idempotency: key {key!r} is completed (fn ran and its result is"
            f" stored), but {serializer!r}.loads could not read the stored result; fn will"
            " not run again: deliver it with the serializer that stored it, or run"
            f" {forget_command(tenant, key)} to run fn afresh",
        )
        raise


def _dumped(claim: ClaimedKey, result: Any, serializer: Serializer) -> bytes:
    """``dumps`` of *result* as stored bytes.

    :raises TypeError: ``dumps`` raised or did not return a str.
    """
    what = "is not JSON" if serializer is JSON else f"cannot be stored by {serializer!r:.80}"
    try:
        text = serializer.dumps(result)
    except Exception as exc:
        raise TypeError(f"run_once: the result of {claim.key!r} {what}: {exc}") from exc
    if not isinstance(text, str):
        raise TypeError(
            f"run_once: the result of {claim.key!r} {what}: dumps returned"
            f" {type(text).__name__}, not str"
        )
    # bytea keeps NUL; surrogatepass keeps lone surrogates: loads gets exactly this str
    return text.encode("utf-8", "surrogatepass")


def _run(
    settings: RouteSettings,
    claim: ClaimedKey,
    fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    serializer: Serializer,
) -> T:
    """Run *fn* as the owner of the key, then store its result or its failure."""
    with _claimed(claim):
        try:
            result = fn(*args, **kwargs)
        except PROCESS_ENDING:
            logger.warning(
                "decision=abandoned key=%r attempt=%r: the process is ending under fn;"
                " nothing is stored",
                claim.key,
                claim.attempt,
            )
            claim.store.leave_to_death(claim.tenant, claim.key, claim.outcome)
            raise
        except BaseException as exc:
            claim.exception = exc
            status = _failure_status(settings)
            owned = _end(claim, status, _failure(exc))
            _add_note(exc, _what_became_of(claim, status if owned else None))
            raise
        if claim.released:
            _end(claim, KeyStatus.RETRYABLE, None)
            return result
        try:
            body = _dumped(claim, result, serializer)
        except TypeError as exc:
            # fn ran, its result cannot be kept: nobody can tell a redelivery what happened.
            owned = _end(claim, KeyStatus.UNKNOWN, None)
            _add_note(exc, _what_became_of(claim, KeyStatus.UNKNOWN if owned else None, True))
            raise
        headers = _JSON if serializer is JSON else _TEXT
        _end(claim, KeyStatus.COMPLETED, StoredResponse(RESULT_STATUS, headers, body))
        return result


def _failure_status(settings: RouteSettings) -> KeyStatus:
    return {
        "store": KeyStatus.COMPLETED,
        "release": KeyStatus.RETRYABLE,
        "unknown": KeyStatus.UNKNOWN,
    }[settings.on_exception]


def _what_became_of(claim: ClaimedKey, status: KeyStatus | None, unstorable: bool = False) -> str:
    """The note a failure of *fn* (or of storing its result) carries to the caller:
    what the key is now."""
    key = claim.key
    if unstorable and status is KeyStatus.UNKNOWN:
        return (
            f"flask-idempotency: fn ran but its result was not stored: key {key!r} is now"
            " unknown; later deliveries raise OutcomeUnknown until it is resolved (the"
            " reconciler, resolve(), or flask idempotency-resolve)"
        )
    if status is KeyStatus.COMPLETED:
        return (
            f"flask-idempotency: this failure is stored for key {key!r}"
            " (on_exception='store'): later deliveries raise StoredFailure without running"
            f" fn, until an operator runs {forget_command(claim.tenant, key)}"
        )
    if status is KeyStatus.RETRYABLE:
        return (
            f"flask-idempotency: key {key!r} was released (on_exception='release'):"
            " the next delivery runs fn again"
        )
    if status is KeyStatus.UNKNOWN:
        return (
            f"flask-idempotency: key {key!r} is now unknown (on_exception='unknown'):"
            " later deliveries raise OutcomeUnknown until it is resolved (the reconciler,"
            " resolve(), or flask idempotency-resolve)"
        )
    return (
        f"flask-idempotency: another delivery took key {key!r} over while fn ran;"
        " this failure was not recorded"
    )


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (which keeps but does not print it)."""
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        notes.append(note)
        return
    try:
        exc.__notes__ = [note]  # type: ignore[attr-defined]
    except AttributeError:  # an exception type that refuses new attributes
        logger.warning("%s", note)


def _failure(exc: BaseException) -> StoredResponse:
    kind = type(exc)
    body = {"exception": f"{kind.__module__}.{kind.__qualname__}", "message": str(exc)[:2000]}
    return StoredResponse(FAILURE_STATUS, _JSON, json.dumps(body).encode())


def _end(claim: ClaimedKey, status: KeyStatus, response: StoredResponse | None) -> bool:
    """One fenced UPDATE; the jobs staged outside phases commit only with a result.
    False: another delivery owns the key now, nothing changed."""
    jobs = claim.jobs if response is not None and response.status == RESULT_STATUS else []
    try:
        with claim.trace.span(tracing.FINISH) as span:
            owned = finish_attempt(claim, status, response, jobs=jobs)
            span.decided(status.value if owned else "fenced", claim.attempt)
    except StoreError as exc:
        logger.error("decision=store_failed consumer key=%r error=%s", claim.key, exc)
        raise
    except EncryptionError as exc:
        # fn ran and its result cannot be kept, as with a result that is not JSON.
        _end(claim, KeyStatus.UNKNOWN, None)
        raise EncryptionError(
            f"run_once: the result of {claim.key!r} could not be encrypted ({exc});"
            " the key is now unknown"
        ) from exc
    level = logging.DEBUG if owned else logging.WARNING
    logger.log(
        level,
        "decision=%s consumer tenant=%s key=%r attempt=%d",
        status.value if owned else "fenced",
        tenant_tag(claim.tenant),
        claim.key,
        claim.attempt,
    )
    return owned


@contextmanager
def _claimed(claim: ClaimedKey) -> Iterator[None]:
    """``current_idempotency`` is *claim* while *fn* runs (and whatever it was after)."""
    outer = peek_claim()
    set_claim(claim)
    try:
        yield
    finally:
        pop_claim()
        if outer is not None:
            set_claim(outer)


def _announce(tenant: str, key: str, outcome: ClaimOutcome) -> None:
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    for signal, extra in decision_signals(outcome, waited=0.0):
        signal.send(app, tenant=tenant, key=key, claim_seconds=0.0, **extra)
    logger.debug(
        "decision=%s consumer tenant=%s key=%r attempt=%d",
        outcome.decision.value,
        tenant_tag(tenant),
        key,
        outcome.attempt,
    )
