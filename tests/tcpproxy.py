"""The suite's TCP fault proxy: the plugin's (:mod:`flask_idempotency.testing.proxy`)."""

from __future__ import annotations

from flask_idempotency.testing.proxy import TcpProxy

__all__ = ["TcpProxy"]
