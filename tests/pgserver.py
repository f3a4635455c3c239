"""The suite's throwaway PostgreSQL: the plugin's (:mod:`flask_idempotency.testing.postgres`)."""

from __future__ import annotations

from flask_idempotency.testing.postgres import (
    PostgresServer,
    PostgresServerError,
    StopMode,
    find_bin_dir,
    free_port,
)

__all__ = ["PostgresServer", "PostgresServerError", "StopMode", "find_bin_dir", "free_port"]
