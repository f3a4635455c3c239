"""``run_fault_schedule`` (SPEC §23) as a user's project meets it: a throwaway project with its
own app (an app factory, Flask-SQLAlchemy models, an idempotent route writing an order row in
the key's transaction), no conftest of its own, and a test that is one call per seed (the
testing how-to's example, as written), run by pytest in a subprocess with the plugin loaded
from its ``pytest11`` entry point and a PostgreSQL the plugin starts (so the schedule restarts
it too). Two seeds of 10 s each: about 35 to 50 s in all.

The same project with a planted defect, an ``on_abandoned="retry"`` route whose view commits
its order on its own before it answers (unfenced), fails: a worker killed after that commit
leaves the order, the retry takes the dead worker's claim over and orders again; the failure
names the seed and the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.project.test_docs_examples import DOCS, python_blocks
from tests.project.test_testing_plugin import (  # noqa: F401  (entry_point: a fixture)
    entry_point,
    run_project,
)

pytest_plugins = ["pytester"]

#: the user's app: orders in the key's transaction (through db.session), and a quote that
#: writes nothing; ``unfenced_orders=True`` serves the planted defect instead
SHOP = """
from __future__ import annotations

import os
import time

from flask import Blueprint, Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Idempotency, current_idempotency


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
idempotency = Idempotency()


@idempotency.tenant_loader
def tenant() -> str:
    return ""  # one shop, one key space


shop = Blueprint("shop", __name__)
unfenced = Blueprint("unfenced", __name__)


class Order(db.Model):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(index=True)  # the Idempotency-Key, to count effects
    sku: Mapped[str]


def pause() -> None:
    time.sleep(min(float(request.json.get("delay", 0)), 2.0))


@shop.post("/orders")
@idempotency.idempotent(transactional=True)
def order():
    row = Order(key=current_idempotency.key, sku=request.json["sku"])
    db.session.add(row)
    db.session.flush()
    pause()  # a fault here rolls the order back with the key's claim
    return {"id": row.id, "sku": row.sku}, 201


@shop.post("/quotes")
@idempotency.idempotent
def quote():
    pause()
    return {"sku": request.json["sku"], "price": 1200}, 200


@unfenced.post("/orders")
@idempotency.idempotent  # on_abandoned="retry": a dead worker's claim runs again
def order_unfenced():
    row = Order(key=current_idempotency.key, sku=request.json["sku"])
    db.session.add(row)
    db.session.commit()  # the app's own transaction: committed now, whatever follows
    pause()  # a worker killed here leaves the order, and the retry orders again
    return {"id": row.id, "sku": row.sku}, 201


def create_app(database_url: str | None = None, unfenced_orders: bool = False) -> Flask:
    url = database_url or os.environ["DATABASE_URL"]
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url.replace("postgresql://", "postgresql+psycopg://", 1),
        SQLALCHEMY_ENGINE_OPTIONS={"pool_pre_ping": True},
        IDEMPOTENCY_DATABASE_URL=url,
        # above the slowest view; short, so that a claim judged by its lease (its worker
        # killed just before a PostgreSQL restart) settles within the test
        IDEMPOTENCY_LEASE=5,
    )
    db.init_app(app)
    idempotency.init_app(app, sqlalchemy=db)
    app.register_blueprint(unfenced if unfenced_orders else shop)
    return app
"""


def faults_test() -> str:
    """The user's test: the testing how-to's example as written (the tables made once, one
    call per seed), and the defect's test beside it."""
    page = DOCS / "howto" / "testing.md"
    blocks = [b.code for b in python_blocks(page) if "run_fault_schedule(" in b.code]
    assert len(blocks) == 1, f"{page}: one example of run_fault_schedule, not {len(blocks)}"
    return blocks[0] + UNFENCED_TEST


#: the planted defect's test, in the how-to's example's module
UNFENCED_TEST = """

def test_an_unfenced_retry_route_orders_twice(database, tmp_path):
    report = run_fault_schedule(
        "shop:create_app(unfenced_orders=True)",
        [("POST", "/orders", {"sku": "book", "delay": 0.6})],
        database=database,
        seconds=10,
        seed=1103,
        effects=orders_of(database),
        logs=tmp_path,  # pytest's, not the system's temporary folder: it fails
    )
    assert report.ok, str(report)
"""


@pytest.mark.timeout(200)
def test_a_project_proves_its_own_app_under_faults(
    pytester: pytest.Pytester,
    entry_point: Path,  # noqa: F811
) -> None:
    """A correct app holds under two seeds of the schedule."""
    pytester.makepyfile(shop=SHOP, test_faults=faults_test())
    result = run_project(pytester, entry_point, {}, "-k", "hold")
    result.assert_outcomes(passed=2, deselected=1)


@pytest.mark.timeout(200)
def test_a_planted_defect_fails_with_the_seed_and_the_key(
    pytester: pytest.Pytester,
    entry_point: Path,  # noqa: F811
) -> None:
    """An unfenced side effect in a ``"retry"`` route: a worker killed after the view's own
    commit leaves the order, and the retry, taking the dead worker's claim over, orders
    again. The failure names the seed that repeats it and the key ordered twice."""
    pytester.makepyfile(shop=SHOP, test_faults=faults_test())
    result = run_project(pytester, entry_point, {}, "-k", "unfenced")
    result.assert_outcomes(failed=1, deselected=2)
    output = "\n".join(result.outlines)
    assert "fault schedule FAILED" in output
    assert "seed 1103: run_fault_schedule(..., seed=1103) repeats this schedule" in output
    assert re.search(
        r"key 'f1103-\w+-c\d+-\d+' \(POST /orders\): its effect happened [2-9]", output
    )
