"""Call an idempotent API from Python: ``pip install flask-idempotency[client]``.

:class:`IdempotentTransport` (httpx, and :class:`AsyncIdempotentTransport` for
``httpx.AsyncClient``) and :class:`IdempotentAdapter` (requests) give each ``POST`` and
``PATCH`` one ``Idempotency-Key`` that all its attempts reuse, and retry it as the server's
answers allow (``Retry-After``, ``Stripe-Should-Retry``, the problem's ``retryable``), within
a budget of attempts and seconds. They work against any server that keeps Stripe's contract,
not only this extension.

Each class imports its HTTP library when it is first used, so this module imports without
httpx or requests; a class whose library is missing raises an :class:`ImportError` that names
the extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapter import IdempotentAdapter
    from .policy import KeyExpired
    from .transport import AsyncIdempotentTransport, IdempotentTransport

__all__ = ["AsyncIdempotentTransport", "IdempotentAdapter", "IdempotentTransport", "KeyExpired"]

#: where each public class lives, and the library it needs
_HOMES = {
    "AsyncIdempotentTransport": ("transport", "httpx"),
    "IdempotentTransport": ("transport", "httpx"),
    "IdempotentAdapter": ("adapter", "requests"),
}


def __getattr__(name: str) -> Any:
    if name == "KeyExpired":  # needs no HTTP library
        from .policy import KeyExpired

        return KeyExpired
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, library = _HOMES[name]
    try:
        # the library is imported only here, so that a service using one of the two
        # libraries need not install the other
        home = importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        if exc.name != library and not (exc.name or "").startswith(f"{library}."):
            raise
        raise ImportError(
            f"flask_idempotency.client.{name} needs {library!r}:"
            " pip install 'flask-idempotency[client]'",
            name=library,
        ) from exc
    value = getattr(home, name)
    globals()[name] = value  # found at once next time
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
