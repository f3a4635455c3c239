"""The connection a ``transactional=True`` view gets: the key's own, minus the ways
of ending its transaction.

The view's writes and the key's row commit together in one transaction that the
extension ends after the view. A view that committed it itself would keep its writes
and leave the key ``processing`` if it then failed; so ``commit()``, ``rollback()``,
``close()``, ``with connection:`` and setting ``autocommit`` are refused. Savepoints
(``connection.transaction()``) stay allowed: they end inside the key's transaction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

from .errors import IdempotencyError

if TYPE_CHECKING:
    import psycopg


class TransactionOwnedByKey(IdempotencyError):
    """A ``transactional=True`` view tried to end the transaction that belongs to its
    idempotency key (``commit()``, ``rollback()``, ``autocommit``...)."""


def _refuse(what: str) -> NoReturn:
    raise TransactionOwnedByKey(
        f"{what} on current_idempotency.connection is not allowed: the transaction"
        " belongs to the idempotency key, and the extension commits it together with"
        " the stored response after the view (or rolls it back if the view fails). Use"
        " savepoints (with connection.transaction(): ...) for partial rollbacks, or"
        " current_idempotency.phase(name) in a view without transactional=True for"
        " steps that must commit on their own."
    )


class OwnedConnection:
    """A psycopg connection whose transaction belongs to the key: everything but
    ending it is passed through (``execute()``, ``cursor()``, ``transaction()``, ...)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        object.__setattr__(self, "_conn", conn)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "autocommit":
            _refuse("setting autocommit")
        setattr(self._conn, name, value)

    def commit(self) -> NoReturn:
        _refuse("commit()")

    def rollback(self) -> NoReturn:
        _refuse("rollback()")

    def set_autocommit(self, value: bool) -> NoReturn:
        _refuse("set_autocommit()")

    def close(self) -> NoReturn:
        _refuse("close()")

    def __enter__(self) -> NoReturn:
        _refuse("'with connection:' (it commits and closes on exit)")

    def __exit__(self, *exc: object) -> None:  # pragma: no cover - __enter__ refuses
        return None

    def __repr__(self) -> str:
        return f"<OwnedConnection of {self._conn!r}>"
