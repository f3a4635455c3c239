"""The extension on a bare Flask app, as the in-process tests make it."""

from __future__ import annotations

from typing import Any

from flask import Flask

from flask_idempotency import Idempotency


def extension_on(app: Flask, url: str, **config: Any) -> Idempotency:
    """The extension on *app*, its keys in the database at *url*, with *config* added to the
    app's (by full name: ``IDEMPOTENCY_POOL_TIMEOUT=3``); every request in the tenant ""."""
    app.config.update(IDEMPOTENCY_DATABASE_URL=url, **config)
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "")
    return idempotency
