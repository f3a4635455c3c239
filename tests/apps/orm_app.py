"""A Flask-SQLAlchemy app as Flask teams write one (an app factory, a blueprint, a model),
with its idempotent routes (tests/e2e/test_sqlalchemy.py; served by gunicorn as
``tests.apps.orm_app:create_app()`` with ``ORM_DATABASE_URL`` and ``FLASK_IDEMPOTENCY_*``).

``POST /orders`` is ``transactional=True`` and writes an ``Order`` through ``db.session``:
``X-Commit: 1`` calls ``db.session.commit()`` first, ``X-Duplicate: 1`` then flushes an
order with the same id (SQL), catches the ``IntegrityError`` and calls ``db.session.rollback()``,
``X-Nested: 1`` flushes a second order in ``db.session.begin_nested()`` and rolls that
back, ``X-Null: 1`` adds an order without an amount (its flush fails when the view returns),
``X-Raise: 1`` raises after its writes, ``X-Gate`` holds it at a gate row (on its own
connection), ``X-Delay`` sleeps.
``POST /plain-orders`` is not idempotent: ``db.session`` as without the extension.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import psycopg
from flask import Blueprint, Flask, current_app, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Idempotency, current_idempotency
from tests.apps.common import (
    add_health_route,
    sleep_requested_delay,
    tenant_from_header,
    wait_for_gate,
)


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
idempotency = Idempotency()
orders = Blueprint("orders", __name__)
add_health_route(orders)


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "orm_orders"
    id: Mapped[str] = mapped_column(primary_key=True)
    key: Mapped[str | None]
    amount: Mapped[int]


@orders.post("/orders")
@idempotency.idempotent(transactional=True)
def create_order() -> tuple[dict[str, Any], int]:
    order = Order(id=str(uuid.uuid4()), key=current_idempotency.key, amount=request.json["amount"])
    db.session.add(order)
    current_idempotency.stage("order_created", {"id": order.id})
    if request.headers.get("X-Commit"):
        db.session.commit()  # into the key's transaction, not the database
    if request.headers.get("X-Duplicate"):
        duplicate = "INSERT INTO orm_orders (id, key, amount) VALUES (:id, :key, -1)"
        try:
            db.session.execute(text(duplicate), {"id": order.id, "key": order.key})
        except IntegrityError:
            db.session.rollback()  # back to the savepoint: the key's transaction goes on
    if request.headers.get("X-Nested"):
        nested = db.session.begin_nested()
        db.session.add(Order(id=str(uuid.uuid4()), key=order.key, amount=-2))
        db.session.flush()
        nested.rollback()  # that order only: the first one stays
    if request.headers.get("X-Null"):
        db.session.add(Order(id=str(uuid.uuid4()), key=order.key, amount=None))
    gate = request.headers.get("X-Gate")
    if gate:
        url = current_app.config["SQLALCHEMY_DATABASE_URI"].replace("+psycopg", "")
        with psycopg.connect(url) as conn:
            wait_for_gate(conn, "e2e_gates", gate)
    sleep_requested_delay(10.0)
    if request.headers.get("X-Raise"):
        raise RuntimeError("after the writes")
    return {"id": order.id, "amount": order.amount, "pid": os.getpid()}, 201


@orders.post("/plain-orders")
def create_plain_order() -> tuple[dict[str, Any], int]:
    order = Order(id=str(uuid.uuid4()), key=None, amount=request.json["amount"])
    db.session.add(order)
    db.session.commit()
    return {"id": order.id}, 201


def create_app(**config: Any) -> Flask:
    app = Flask("orm_app")
    app.config.from_prefixed_env()
    app.config.setdefault("SQLALCHEMY_DATABASE_URI", os.environ.get("ORM_DATABASE_URL"))
    app.config.update(config)
    db.init_app(app)
    idempotency.init_app(app, sqlalchemy=db)
    idempotency.tenant_loader(tenant_from_header)
    app.register_blueprint(orders)
    with app.app_context():
        db.create_all()
    return app
