"""Reading a database URL as libpq does: the settings' URLs are checked with it when
``init_app`` makes the store (the settings themselves import no driver)."""

from __future__ import annotations

from psycopg import ProgrammingError
from psycopg.conninfo import conninfo_to_dict

from ..config import Settings, config_key
from ..errors import ConfigError


def conninfo_params(value: str) -> dict[str, object]:
    """The parameters of the libpq URL or conninfo string *value*.

    :raises ValueError: libpq cannot read it; the message is libpq's reason on one
        line, never the value (it may hold a password).
    """
    try:
        return dict(conninfo_to_dict(value))
    except ProgrammingError as exc:
        raise ValueError(" ".join(str(exc).split())) from None


def check_conninfo(settings: Settings) -> None:
    """Parse the settings' database URLs (no connection is made).

    :raises ConfigError: libpq cannot read one, or its port is not a port.
    """
    for name in ("database_url", "listen_database_url", "owner_database_url"):
        value = getattr(settings, name)
        if not value:
            continue
        key = config_key(name)
        try:
            params = conninfo_params(value)
        except ValueError as exc:
            # libpq's reason, not the value: it may hold a password.
            raise ConfigError(f"{key} is not a valid libpq URL or conninfo string: {exc}") from None
        ports = str(params.get("port") or "").split(",")
        if not all(p == "" or (p.isdigit() and 0 < int(p) < 65536) for p in ports):
            raise ConfigError(f"{key} has an invalid port: {params['port']!r}.")
