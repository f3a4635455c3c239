"""Every ``IDEMPOTENCY_*`` setting, declared once, read and validated once."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, Literal

PREFIX = "IDEMPOTENCY_"

DATABASE_URL = "IDEMPOTENCY_DATABASE_URL"
LISTEN_DATABASE_URL = "IDEMPOTENCY_LISTEN_DATABASE_URL"
POOL_MIN_SIZE = "IDEMPOTENCY_POOL_MIN_SIZE"
POOL_MAX_SIZE = "IDEMPOTENCY_POOL_MAX_SIZE"
POOL_TIMEOUT = "IDEMPOTENCY_POOL_TIMEOUT"
POOL_RECONNECT_TIMEOUT = "IDEMPOTENCY_POOL_RECONNECT_TIMEOUT"
PREPARED_STATEMENTS = "IDEMPOTENCY_PREPARED_STATEMENTS"
SYNCHRONOUS_FINISH = "IDEMPOTENCY_SYNCHRONOUS_FINISH"
REPLAY_CACHE_SIZE = "IDEMPOTENCY_REPLAY_CACHE_SIZE"
TABLE = "IDEMPOTENCY_TABLE"
CREATE_TABLE = "IDEMPOTENCY_CREATE_TABLE"
HEADER = "IDEMPOTENCY_HEADER"
REQUIRED = "IDEMPOTENCY_REQUIRED"
TTL = "IDEMPOTENCY_TTL"
LEASE = "IDEMPOTENCY_LEASE"
RETRY_AFTER = "IDEMPOTENCY_RETRY_AFTER"
WAIT = "IDEMPOTENCY_WAIT"
ON_ABANDONED = "IDEMPOTENCY_ON_ABANDONED"
ON_EXCEPTION = "IDEMPOTENCY_ON_EXCEPTION"
RELEASE_STATUSES = "IDEMPOTENCY_RELEASE_STATUSES"
FAIL_OPEN = "IDEMPOTENCY_FAIL_OPEN"
REPLAY_HEADER = "IDEMPOTENCY_REPLAY_HEADER"
MAX_REQUEST_BYTES = "IDEMPOTENCY_MAX_REQUEST_BYTES"
MAX_RESPONSE_BYTES = "IDEMPOTENCY_MAX_RESPONSE_BYTES"
EXCLUDED_HEADERS = "IDEMPOTENCY_EXCLUDED_HEADERS"
PROBLEM_TYPE_BASE = "IDEMPOTENCY_PROBLEM_TYPE_BASE"
ERROR_FORMAT = "IDEMPOTENCY_ERROR_FORMAT"

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

DEFAULTS: dict[str, Any] = {
    DATABASE_URL: None,
    LISTEN_DATABASE_URL: None,
    POOL_MIN_SIZE: 1,
    POOL_MAX_SIZE: 4,
    POOL_TIMEOUT: 5.0,
    POOL_RECONNECT_TIMEOUT: 10.0,
    PREPARED_STATEMENTS: True,
    SYNCHRONOUS_FINISH: True,
    REPLAY_CACHE_SIZE: 0,
    TABLE: "idempotency_keys",
    CREATE_TABLE: True,
    HEADER: "Idempotency-Key",
    REQUIRED: True,
    TTL: 24 * 3600,
    LEASE: 60,
    RETRY_AFTER: 1,
    WAIT: 0,
    ON_ABANDONED: "retry",
    ON_EXCEPTION: "store",
    RELEASE_STATUSES: (429, 503),
    FAIL_OPEN: False,
    REPLAY_HEADER: "Idempotent-Replayed",
    MAX_REQUEST_BYTES: 1024 * 1024,
    MAX_RESPONSE_BYTES: 1024 * 1024,
    EXCLUDED_HEADERS: DEFAULT_EXCLUDED_HEADERS,
    PROBLEM_TYPE_BASE: "tag:flask-idempotency,2026:problem:",
    ERROR_FORMAT: "problem",
}

#: Settings a route may override with ``@idempotency.idempotent(name=value)``; the
#: others (pool, table) belong to the whole application.
ROUTE_OPTIONS = frozenset(
    {
        "header",
        "required",
        "ttl",
        "lease",
        "retry_after",
        "wait",
        "on_abandoned",
        "on_exception",
        "release_statuses",
        "fail_open",
        "replay_header",
        "max_request_bytes",
        "max_response_bytes",
        "excluded_headers",
        "error_format",
    }
)


class ConfigError(ValueError):
    """A setting has a value the extension cannot use; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class RouteSettings:
    """The settings that decide how one request is treated."""

    header: str
    required: bool
    ttl: timedelta
    lease: timedelta
    retry_after: int
    wait: float
    on_abandoned: OnAbandoned
    on_exception: OnException
    release_statuses: frozenset[int]
    fail_open: bool
    replay_header: str
    max_request_bytes: int
    max_response_bytes: int
    excluded_headers: frozenset[str]
    error_format: str
    problem_type_base: str

    def override(self, options: Mapping[str, Any]) -> RouteSettings:
        """Return a copy with a route's already validated options applied."""
        return dataclasses.replace(self, **options) if options else self


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the extension reads from ``app.config``, converted and validated."""

    database_url: str | None
    #: where waiting requests LISTEN; PgBouncer's transaction mode cannot carry LISTEN
    listen_database_url: str | None
    pool_min_size: int
    pool_max_size: int
    pool_timeout: float
    #: how long the pool keeps retrying a failed connection in the background before
    #: it gives up and lets the next request try afresh (psycopg_pool's reconnect_timeout)
    pool_reconnect_timeout: float
    prepared_statements: bool
    #: False: the completion commits without waiting for its WAL flush (see README)
    synchronous_finish: bool
    #: completed responses kept per process to replay without a query (0: off)
    replay_cache_size: int
    table: str
    create_table: bool
    route: RouteSettings


def load_settings(config: Mapping[str, Any], *, pool_given: bool = False) -> Settings:
    """Read every ``IDEMPOTENCY_*`` key from *config* (defaults already applied)."""
    url = config[DATABASE_URL]
    if url is not None and not isinstance(url, str):
        raise ConfigError(f"{DATABASE_URL} must be a libpq URL or conninfo string.")
    if not url and not pool_given:
        raise ConfigError(
            f"Set {DATABASE_URL} (e.g. 'postgresql://user@host/db') or pass a "
            "psycopg_pool.ConnectionPool to init_app(app, pool=...)."
        )
    listen_url = config[LISTEN_DATABASE_URL]
    if listen_url is not None and not isinstance(listen_url, str):
        raise ConfigError(f"{LISTEN_DATABASE_URL} must be a libpq URL or conninfo string.")
    min_size = _int(config, POOL_MIN_SIZE, minimum=0)
    max_size = _int(config, POOL_MAX_SIZE, minimum=1)
    if max_size < min_size:
        raise ConfigError(f"{POOL_MAX_SIZE} ({max_size}) is below {POOL_MIN_SIZE} ({min_size}).")
    table = config[TABLE]
    if not isinstance(table, str) or not 1 <= len(table.split(".")) <= 2 or "" in table.split("."):
        raise ConfigError(f"{TABLE} must be 'name' or 'schema.name', got {table!r}.")
    return Settings(
        database_url=url or None,
        listen_database_url=listen_url or url or None,
        pool_min_size=min_size,
        pool_max_size=max_size,
        pool_timeout=_seconds(config[POOL_TIMEOUT], POOL_TIMEOUT),
        pool_reconnect_timeout=_seconds(config[POOL_RECONNECT_TIMEOUT], POOL_RECONNECT_TIMEOUT),
        prepared_statements=_bool(config[PREPARED_STATEMENTS], PREPARED_STATEMENTS),
        synchronous_finish=_bool(config[SYNCHRONOUS_FINISH], SYNCHRONOUS_FINISH),
        replay_cache_size=_int(config, REPLAY_CACHE_SIZE, minimum=0),
        table=table,
        create_table=_bool(config[CREATE_TABLE], CREATE_TABLE),
        route=RouteSettings(
            **{name: convert_option(name, config[PREFIX + name.upper()]) for name in ROUTE_OPTIONS},
            problem_type_base=_str(config[PROBLEM_TYPE_BASE], PROBLEM_TYPE_BASE),
        ),
    )


def convert_option(name: str, value: Any) -> Any:
    """Validate and convert one route option (config key ``IDEMPOTENCY_<NAME>``)."""
    key = PREFIX + name.upper()
    if name not in ROUTE_OPTIONS:
        raise TypeError(
            f"idempotent() got an unknown option {name!r}; route options are: "
            + ", ".join(sorted(ROUTE_OPTIONS))
        )
    if name in ("header", "replay_header"):
        text = _str(value, key)
        if not text.isascii() or any(c in text for c in " :\t\r\n"):
            raise ConfigError(f"{key} must be an HTTP header name, got {value!r}.")
        return text
    if name in ("required", "fail_open"):
        return _bool(value, key)
    if name in ("ttl", "lease"):
        seconds = _seconds(value, key)
        if seconds <= 0:
            raise ConfigError(f"{key} must be positive, got {value!r}.")
        return timedelta(seconds=seconds)
    if name == "retry_after":
        return _int({key: value}, key, minimum=0)
    if name == "wait":
        return _seconds(value, key)
    if name in ("max_request_bytes", "max_response_bytes"):
        return _int({key: value}, key, minimum=0)
    if name == "on_abandoned":
        return _choice(value, key, ("retry", "unknown"))
    if name == "error_format":
        return _choice(value, key, ("problem", "stripe"))
    if name == "on_exception":
        return _choice(value, key, ("store", "release", "unknown"))
    if name == "release_statuses":
        statuses = _iterable(value, key)
        if not all(isinstance(s, int) and 100 <= s <= 599 for s in statuses):
            raise ConfigError(f"{key} must list HTTP status codes, got {value!r}.")
        return frozenset(statuses)
    # excluded_headers
    names = _iterable(value, key)
    if not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{key} must list header names, got {value!r}.")
    return frozenset(n.lower() for n in names)


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a non-empty string, got {value!r}.")
    return value


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"{key} must be True or False, got {value!r}.")


def _int(config: Mapping[str, Any], key: str, *, minimum: int) -> int:
    value = config[key]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}.")
    return value


def _seconds(value: Any, key: str) -> float:
    """Seconds from a number, a numeric string or a timedelta."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    elif isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{key} must be seconds or a timedelta, got {value!r}.") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{key} must be seconds (>= 0) or a timedelta, got {value!r}.")
    return float(value)


def _choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value!r}.")
    return str(value)


def _iterable(value: Any, key: str) -> tuple[Any, ...]:
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, Iterable):
        raise ConfigError(f"{key} must be a list, got {value!r}.")
    items = tuple(value)
    if key == PREFIX + "RELEASE_STATUSES":
        items = tuple(int(i) if isinstance(i, str) and i.isdigit() else i for i in items)
    return items
