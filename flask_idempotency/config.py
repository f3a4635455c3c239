"""Every ``IDEMPOTENCY_*`` setting, declared once, read and validated once.

Each setting is one field of :class:`RouteSettings` (a route may override it with
``@idempotency.idempotent(name=value)``) or of :class:`Settings` (it belongs to the
whole app), declared with :func:`option`: its default as written in ``app.config``
and the converter that validates it. The config key is ``IDEMPOTENCY_`` + the field's
name in upper case; :data:`DEFAULTS` and :data:`ROUTE_OPTIONS` are derived from the
fields. A new setting is one new field.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, Literal, TypeVar

from .encryption import check_encryptor
from .errors import DEFAULT_PROBLEM_TYPE_BASE, ConfigError, ProblemError
from .fingerprint import Exclusions, fingerprint_function, parse_exclusions
from .keys import key_function

PREFIX = "IDEMPOTENCY_"

OnAbandoned = Literal["retry", "unknown"]
OnException = Literal["store", "release", "unknown"]

#: Response headers never stored nor replayed: cookies belong to one session, and
#: hop-by-hop headers to one connection (RFC 9110 §7.6.1).
DEFAULT_EXCLUDED_HEADERS = (
    "set-cookie",
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "date",
)

#: The longest duration a setting may have: ``now() + ttl`` must stay a timestamp
#: PostgreSQL can store, and a value beyond it is a mistake, not a policy.
MAX_SECONDS = 100 * 365.25 * 24 * 3600

#: ``convert(value, config_key)``: the setting's value in the type the code uses
Converter = Callable[[Any, str], Any]
E = TypeVar("E", bound=ProblemError)


def config_key(name: str) -> str:
    """The ``app.config`` key of the setting *name* (``ttl`` → ``IDEMPOTENCY_TTL``)."""
    return PREFIX + name.upper()


# -- converters: (value as configured, its config key) → value as used ---------------


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a non-empty string, got {value!r}.")
    return value


def _table(value: Any, key: str) -> str:
    """A table's name: ``name`` or ``schema.name`` (no NUL byte: PostgreSQL's names hold
    none)."""
    name = _str(value, key)
    parts = name.split(".")
    if not 1 <= len(parts) <= 2 or "" in parts or "\x00" in name:
        raise ConfigError(f"{key} must be 'name' or 'schema.name', got {value!r}.")
    return name


def _table_or_none(value: Any, key: str) -> str | None:
    """A table's name (:func:`_table`), or None (unset)."""
    return None if value is None or value == "" else _table(value, key)


#: a URL's scheme (``mysql://`` ...): libpq knows ``postgresql://`` and ``postgres://``
_URL_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]*)://")


def _conninfo(value: Any, key: str) -> str | None:
    """A libpq URL or conninfo string: what can be told without libpq (the store parses
    it as libpq does when ``init_app`` makes it, :func:`.store.conninfo.check_conninfo`),
    so that a typo fails at start-up rather than as a 503 on every request."""
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{key} must be a libpq URL or conninfo string.")
    if not value:
        return None
    if "\x00" in value:  # libpq reads a C string: it would stop there, silently
        raise ConfigError(f"{key} holds a NUL character.")
    scheme = _URL_SCHEME.match(value)
    if scheme and scheme.group(1).lower() not in ("postgresql", "postgres"):
        # the scheme only: the rest of the URL may hold a password
        raise ConfigError(
            f"{key} uses the scheme {scheme.group(1)!r}: flask-idempotency keeps its keys in"
            " PostgreSQL only, through libpq. Write a 'postgresql://user@host/db' URL"
            " (SQLAlchemy's 'postgresql+psycopg://' becomes 'postgresql://') or a conninfo"
            " string ('host=... dbname=...')."
        )
    return value


def _header_name(value: Any, key: str) -> str:
    text = _str(value, key)
    if not text.isascii() or any(c in text for c in " :\t\r\n"):
        raise ConfigError(f"{key} must be an HTTP header name, got {value!r}.")
    return text


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"{key} must be True or False, got {value!r}.")


def _int_at_least(minimum: int) -> Converter:
    def convert(value: Any, key: str) -> int:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}.")
        return value

    return convert


def _seconds(value: Any, key: str) -> float:
    """Seconds from a number, a numeric string or a timedelta."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    elif isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{key} must be seconds or a timedelta, got {value!r}.") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be seconds or a timedelta, got {value!r}.")
    # NaN compares false with everything: test what a value is, not what it is not.
    if not (0 <= value <= MAX_SECONDS):
        raise ConfigError(
            f"{key} must be between 0 and {MAX_SECONDS:.0f} seconds (100 years), got {value!r}."
        )
    return float(value)


def _positive_seconds(value: Any, key: str) -> float:
    seconds = _seconds(value, key)
    if seconds <= 0:
        raise ConfigError(f"{key} must be positive, got {value!r}.")
    return seconds


def _duration(value: Any, key: str) -> timedelta:
    return timedelta(seconds=_positive_seconds(value, key))


def _duration_or_none(value: Any, key: str) -> timedelta:
    """A duration that may be 0 (the feature it bounds is off)."""
    return timedelta(seconds=_seconds(value, key))


def _choice(*choices: str) -> Converter:
    def convert(value: Any, key: str) -> str:
        if value not in choices:
            raise ConfigError(
                f"{key} must be one of {', '.join(map(repr, choices))}, got {value!r}."
            )
        return str(value)

    return convert


def _items(value: Any, key: str) -> tuple[Any, ...]:
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, Iterable):
        raise ConfigError(f"{key} must be a list, got {value!r}.")
    return tuple(value)


def _statuses(value: Any, key: str) -> frozenset[int]:
    items = tuple(int(i) if isinstance(i, str) and i.isdigit() else i for i in _items(value, key))
    if not all(isinstance(s, int) and not isinstance(s, bool) and 100 <= s <= 599 for s in items):
        raise ConfigError(f"{key} must list HTTP status codes, got {value!r}.")
    return frozenset(items)


def _header_names(value: Any, key: str) -> frozenset[str]:
    names = _items(value, key)
    if not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{key} must list header names, got {value!r}.")
    return frozenset(n.lower() for n in names)


def _parsed(parse: Callable[[Any], Any]) -> Converter:
    """A converter from a parser that raises ValueError with the reason."""

    def convert(value: Any, key: str) -> Any:
        try:
            return parse(value)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}.") from None

    return convert


def _release(*releases: str) -> Converter:
    """A release's "major.minor", also as the number ``from_prefixed_env`` makes of it."""
    choose = _choice(*releases)

    def convert(value: Any, key: str) -> str:
        return str(choose(repr(value) if isinstance(value, float) else value, key))

    return convert


def _in_progress_status(value: Any, key: str) -> int:
    status = _int_at_least(0)(value, key)
    if status not in (202, 409):
        raise ConfigError(f"{key} must be 409 or 202, got {value!r}.")
    return int(status)


def _url_path(value: Any, key: str) -> str:
    path = _str(value, key)
    if not path.startswith("/") or path.endswith("/") or any(c in path for c in "<>?# \t\r\n"):
        raise ConfigError(f"{key} must be a URL path like '/idempotency/keys', got {value!r}.")
    return path


def option(default: Any, convert: Converter) -> Any:
    """Declare a setting: its default as written in ``app.config`` (JSON-friendly, so
    ``app.config.from_prefixed_env()`` works) and its converter."""
    return dataclasses.field(metadata={"default": default, "convert": convert})


@dataclasses.dataclass(frozen=True)
class RouteSettings:
    """The settings that decide how one request is treated; each can be set per route."""

    #: the request header that carries the key
    header: str = option("Idempotency-Key", _header_name)
    #: a request without the header: 400 ``key-missing`` (True), or the view runs
    #: unprotected (False)
    required: bool = option(True, _bool)
    #: how long a finished key is kept and replayed (seconds or a timedelta)
    ttl: timedelta = option(24 * 3600, _duration)
    #: how long a ``processing`` claim is trusted before it counts as abandoned; set
    #: it above your slowest view
    lease: timedelta = option(60, _duration)
    #: seconds, sent in ``Retry-After`` on 409, 202 and 503. A twin of a claim in flight
    #: is told at least this, and about as long as the claim has run without a sign of
    #: life (its claim, a committed phase), never past its lease's end, at most 30 s: a
    #: claim whose worker died is not polled every second for its whole lease
    retry_after: int = option(1, _int_at_least(0))
    #: seconds a duplicate may wait for its in-flight twin, woken by NOTIFY, before 409
    wait: float = option(0, _seconds)
    #: an abandoned claim: taken over and the view runs again (``"retry"``), or
    #: marked ``unknown`` and never re-run automatically (``"unknown"``)
    on_abandoned: OnAbandoned = option("retry", _choice("retry", "unknown"))
    #: an unhandled exception in the view: store and replay the 500 (``"store"``),
    #: mark the key retryable (``"release"``) or ``unknown`` (``"unknown"``)
    on_exception: OnException = option("store", _choice("store", "release", "unknown"))
    #: responses with these statuses are not stored (validation failures, as at Stripe):
    #: a fresh key is left as if never used, so the next request under it, with any
    #: body, runs as the first; a key taken over keeps its fingerprint and becomes
    #: retryable
    release_statuses: frozenset[int] = option((400, 422, 429, 503), _statuses)
    #: store unreachable: answer 503 (False), or run the view unprotected and log it
    #: (True)
    fail_open: bool = option(False, _bool)
    #: the header added (value ``true``) to every replayed response
    replay_header: str = option("Idempotent-Replayed", _header_name)
    #: larger request bodies get 413 before anything is claimed
    max_request_bytes: int = option(1024 * 1024, _int_at_least(0))
    #: larger responses are not stored (500 problem, the key becomes ``unknown``)
    max_response_bytes: int = option(1024 * 1024, _int_at_least(0))
    #: response headers never stored nor replayed, added to the defaults (``Set-Cookie``,
    #: ``Date`` and the hop-by-hop headers of ``DEFAULT_EXCLUDED_HEADERS``)
    excluded_headers: frozenset[str] = option((), _header_names)
    #: True: ``excluded_headers`` replaces the default list instead of adding to it
    replace_excluded_headers: bool = option(False, _bool)
    #: error bodies as RFC 9457 problems (``"problem"``), or Stripe-compatible
    #: (``"stripe"``)
    error_format: str = option("problem", _choice("problem", "stripe"))
    #: the answer to an in-flight twin: 409 (a problem) or 202 Accepted
    in_progress_status: int = option(409, _in_progress_status)
    #: store the request with the claim, so that ``flask idempotency-complete`` can run
    #: it again without its client (docs: "The background half in detail")
    complete: bool = option(False, _bool)
    #: long work: the claiming request defers the view to the background and answers 202
    #: with a Location to poll (docs: "Long work: 202 Accepted"); implies ``complete``
    asynchronous: bool = option(False, _bool)
    #: the request headers stored with a ``complete=True`` claim (this list replaces
    #: the default: name Content-Type yourself)
    stored_request_headers: frozenset[str] = option(("Content-Type",), _header_names)
    #: the prefix of every problem's ``type`` URI
    problem_type_base: str = option(DEFAULT_PROBLEM_TYPE_BASE, _str)
    #: JSON pointers (``/metadata/request_id``) and form field names left out of the
    #: fingerprint; a route's list replaces the app's
    fingerprint_exclude: Exclusions = option((), _parsed(parse_exclusions))
    #: ``fn(request) -> bytes | str``: replaces the body part of the fingerprint (the
    #: method and the path with its query still count)
    fingerprint: Callable[[Any], bytes | str] | None = option(None, _parsed(fingerprint_function))
    #: ``fn(request) -> str | None``: the request's key, instead of the header (which
    #: the route then ignores): a body field, a webhook's delivery id. ``None`` is a
    #: missing key; the key rules (1-255 visible ASCII) apply to the string. Background
    #: runs of the key never call it (the key is stored with the claim)
    key: Callable[[Any], str | None] | None = option(None, _parsed(key_function))
    #: send ``Idempotency-Key-Expires`` (the key's ``expires_at``) with the first
    #: answer that is stored and with every replay
    expires_header: bool = option(False, _bool)

    def __post_init__(self) -> None:
        if self.asynchronous and not self.complete:  # it runs from the stored request
            object.__setattr__(self, "complete", True)

    @functools.cached_property
    def unstored_headers(self) -> frozenset[str]:
        """The response headers (lower case) that are never stored nor replayed."""
        if self.replace_excluded_headers:
            return self.excluded_headers
        return self.excluded_headers | frozenset(DEFAULT_EXCLUDED_HEADERS)

    def override(self, options: Mapping[str, Any]) -> RouteSettings:
        """Return a copy with a route's already validated options applied."""
        return dataclasses.replace(self, **options) if options else self

    def problem(
        self, error: type[E], detail: str, *, retry_after: bool = False, wait: int | None = None
    ) -> E:
        """The client-facing *error*, in this route's error format; with *retry_after*, a
        ``Retry-After`` of *wait* seconds (default ``IDEMPOTENCY_RETRY_AFTER``)."""
        return error(
            detail,
            retry_after_seconds=(self.retry_after if wait is None else wait)
            if retry_after
            else None,
            type_base=self.problem_type_base,
            error_format=self.error_format,
        )


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the extension reads from ``app.config``, converted and validated."""

    #: libpq URL or conninfo of the store; required unless a pool is passed to
    #: ``init_app``
    database_url: str | None = option(None, _conninfo)
    #: where waiting requests LISTEN; PgBouncer's transaction mode cannot carry LISTEN
    listen_database_url: str | None = option(None, _conninfo)
    #: where each process holds its owner lock (SPEC §20): a direct (session) URL where
    #: the store's goes through a transaction pooler; unset: the store's URL
    owner_database_url: str | None = option(None, _conninfo)
    #: hold an owner lock, so that a dead process's claims are abandoned at once and a
    #: live one's leases are renewed; False: claims are judged by their lease alone
    owner_lock: bool = option(True, _bool)
    #: connections each process's pool keeps open
    pool_min_size: int = option(1, _int_at_least(0))
    #: connections each process's pool opens at most
    pool_max_size: int = option(4, _int_at_least(1))
    #: the longest a request waits for a pool connection; then 503
    pool_timeout: float = option(5.0, _seconds)
    #: the longest the database may take to answer one of the extension's statements,
    #: measured on the client (a silent network, a hung pooler); then 503, and the statement
    #: is cancelled on the server (with libpq 17 or later, as psycopg's binary wheels have)
    statement_timeout: float = option(5.0, _positive_seconds)
    #: how long the pool keeps retrying a failed connection in the background before
    #: it gives up and lets the next request try afresh (psycopg_pool's reconnect_timeout)
    pool_reconnect_timeout: float = option(10.0, _seconds)
    #: prepare the request path's statements; switched off by itself behind a
    #: PgBouncer older than 1.21 (set False there to start so)
    prepared_statements: bool = option(True, _bool)
    #: False: the completion commits without waiting for its WAL flush, and may lose the
    #: last stored answers if PostgreSQL itself crashes (docs: "Trade-offs you can opt into")
    synchronous_finish: bool = option(True, _bool)
    #: False: the claim commits without waiting for its WAL flush; a claim lost in a crash
    #: of PostgreSQL itself lets a retry run the view again (docs: "Trade-offs you can
    #: opt into")
    synchronous_claim: bool = option(True, _bool)
    #: serve only while the commits of the server the store writes to wait for a
    #: synchronous standby (asked at each process's first claim, again every 2 s while
    #: refused); else 503 with ``Retry-After`` and nothing runs. False: served, and a server
    #: with standbys but none synchronous is said once in the log (docs: "Patroni and
    #: managed HA")
    require_sync_replication: bool = option(False, _bool)
    #: completed responses kept per process to replay without a query (0: off)
    replay_cache_size: int = option(0, _int_at_least(0))
    #: how long a completed key whose answer expired is still answered 409 ``key-expired``
    #: (never run again), counted from its expiry (SPEC §24): the cleaner keeps a
    #: tombstone of it that long. 0: none kept, an expired key runs again as a new request
    tombstone_ttl: timedelta = option(30 * 24 * 3600, _duration_or_none)
    #: the keys' table, may be schema-qualified
    table: str = option("idempotency_keys", _table)
    #: where staged jobs wait for a dispatcher (docs: "Staged jobs")
    jobs_table: str = option("idempotency_jobs", _table)
    #: every hand-made change, one row each; never cleaned
    audit_table: str = option("idempotency_audit", _table)
    #: the background commands' last batch, one row per command and host
    heartbeats_table: str = option("idempotency_heartbeats", _table)
    #: create the tables and indexes if missing (or upgrade an earlier release's
    #: online), once per process
    create_table: bool = option(True, _bool)
    #: on Citus (SPEC §22): the app's distributed table (distributed by its tenant column,
    #: of type text) that the keys, jobs and audit tables are co-located with, so that a
    #: ``transactional=True`` view's writes to it and the key's row commit on one node;
    #: unset: Citus's default co-location group for text columns (docs: "Citus")
    colocate_with: str | None = option(None, _table_or_none)
    #: on Citus: a tenant's claims and common finishes go from the process straight to the
    #: worker that holds its shard (the address the cluster's metadata gives, with the
    #: store URL's other parameters), learned at the tenant's first request; off: through
    #: the node the store's URL names (docs: "Citus", "Entering at the coordinator: routed
    #: to the shard's worker")
    route_to_shards: bool = option(False, _bool)
    #: the oldest release that may read the keys table (serving beside this one, or
    #: rolled back to): "1.0" writes only what every earlier release reads; "1.1" stores
    #: the common JSON answer's headers as NULL (52 bytes less per key), which a 1.0
    #: release would replay without its Content-Type (docs: "Upgrading")
    compatibility: str = option("1.0", _release("1.0", "1.1"))
    #: the first retry of a failed job hand-over (or reconciliation) waits this long; each
    #: further one twice as long, at most an hour
    reconcile_backoff: timedelta = option(5, _duration)
    #: failed hand-overs (or undecided reconciliations) before a job is dead (a key exhausted)
    reconcile_max_attempts: int = option(10, _int_at_least(1))
    #: where the extension answers the Location of an asynchronous key (``<path>/<key>``)
    status_path: str = option("/idempotency/keys", _url_path)
    #: where ``idempotency.init_console(app)`` mounts the operator's console
    console_path: str = option("/idempotency/console", _url_path)
    #: ``flask idempotency-complete`` takes keys untouched for this long (``--older-than``)
    complete_after: float = option(300, _seconds)
    #: encrypts stored bodies and headers at rest (an object with encrypt() and decrypt(),
    #: e.g. ``flask_idempotency.encryption.Fernet``); None: plain
    encryptor: Any = option(None, _parsed(check_encryptor))
    #: the app-wide defaults of the per-route settings
    route: RouteSettings = dataclasses.field(default_factory=RouteSettings)


def _declared(cls: type[Any]) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls) if "convert" in f.metadata}


_ROUTE_FIELDS = _declared(RouteSettings)
_APP_FIELDS = _declared(Settings)

#: every setting's default, by config key; ``init_app`` puts them in ``app.config``
DEFAULTS: dict[str, Any] = {
    config_key(name): field.metadata["default"]
    for name, field in {**_APP_FIELDS, **_ROUTE_FIELDS}.items()
}

#: settings a route may override with ``@idempotency.idempotent(name=value)``; the
#: others (pool, table) belong to the whole application
ROUTE_OPTIONS = frozenset(_ROUTE_FIELDS)


def convert_option(name: str, value: Any) -> Any:
    """Validate and convert one route option (config key ``IDEMPOTENCY_<NAME>``)."""
    field = _ROUTE_FIELDS.get(name)
    if field is None:
        raise TypeError(
            f"idempotent() got an unknown option {name!r}; route options are: "
            + ", ".join(sorted(ROUTE_OPTIONS))
        )
    return field.metadata["convert"](value, config_key(name))


def unknown_keys(config: Mapping[str, Any]) -> list[str]:
    """``IDEMPOTENCY_*`` keys of *config* that are no setting, each with the setting
    it probably means (``IDEMPOTENCY_REQUIERD`` → ``IDEMPOTENCY_REQUIRED``)."""
    found = []
    for name in sorted(k for k in config if isinstance(k, str) and k.startswith(PREFIX)):
        if name not in DEFAULTS:
            close = difflib.get_close_matches(name, DEFAULTS, n=1)
            found.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return found


def load_settings(config: Mapping[str, Any], *, pool_given: bool = False) -> Settings:
    """Read every ``IDEMPOTENCY_*`` key from *config* (defaults already applied)."""
    values = {
        name: field.metadata["convert"](config[config_key(name)], config_key(name))
        for name, field in _APP_FIELDS.items()
    }
    route = RouteSettings(
        **{name: convert_option(name, config[config_key(name)]) for name in ROUTE_OPTIONS}
    )
    settings = Settings(**values, route=route)
    _check_together(settings, pool_given)
    return dataclasses.replace(
        settings, listen_database_url=settings.listen_database_url or settings.database_url
    )


def _check_together(settings: Settings, pool_given: bool) -> None:
    """The checks that involve more than one setting."""
    if not settings.database_url and not pool_given:
        raise ConfigError(
            f"{config_key('database_url')} is not set when init_app(app) runs, and the"
            " extension reads its config there, once: set it (e.g."
            " 'postgresql://user@host/db') before Idempotency(app) / init_app(app), or pass"
            " a psycopg_pool.ConnectionPool as init_app(app, pool=...)."
        )
    if settings.pool_max_size < settings.pool_min_size:
        raise ConfigError(
            f"{config_key('pool_max_size')} ({settings.pool_max_size}) is below"
            f" {config_key('pool_min_size')} ({settings.pool_min_size})."
        )
    if settings.require_sync_replication and not (
        settings.synchronous_claim and settings.synchronous_finish
    ):
        raise ConfigError(
            f"{config_key('require_sync_replication')} is True, but"
            f" {config_key('synchronous_claim')} or {config_key('synchronous_finish')} is"
            " False: those commits would not wait for the standby. Set both True."
        )
