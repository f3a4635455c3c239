"""Reading a database URL as libpq does (the settings check it at ``init_app``)."""

from __future__ import annotations

from psycopg import ProgrammingError
from psycopg.conninfo import conninfo_to_dict


def conninfo_params(value: str) -> dict[str, object]:
    """The parameters of the libpq URL or conninfo string *value*.

    :raises ValueError: libpq cannot read it; the message is libpq's reason on one
        line, never the value (it may hold a password).
    """
    try:
        return dict(conninfo_to_dict(value))
    except ProgrammingError as exc:
        raise ValueError(" ".join(str(exc).split())) from None
