"""Fixtures for testing an app that uses flask-idempotency, against a real PostgreSQL.

The plugin flask_idempotency.testing (loaded by pytest wherever flask-idempotency is
installed) gives the session a database of its own: ``idempotency_database``. The app
here is payments.py beside this file (an app factory); use your own.
"""

from __future__ import annotations

import uuid

import pytest
from flask import Flask
from flask.testing import FlaskClient
from payments import create_app

from flask_idempotency.testing import IdempotencyDatabase


@pytest.fixture
def app(idempotency_database: IdempotencyDatabase) -> Flask:
    # built in each test: the plugin closes its pool at the test's teardown
    return create_app(
        IDEMPOTENCY_DATABASE_URL=idempotency_database.url,
        # an outage test answers within these two (the defaults are 5 s each)
        IDEMPOTENCY_POOL_TIMEOUT=0.5,
        IDEMPOTENCY_STATEMENT_TIMEOUT=0.5,
        TESTING=True,
    )


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def key() -> str:
    """A key no other test uses: keys outlive a test in the session's database."""
    return f"test-{uuid.uuid4()}"
