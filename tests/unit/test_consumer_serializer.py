"""SPEC §14 "Results that are not JSON": ``run_once(..., serializer=)``. The stored result
is what ``dumps`` returned, a redelivery gets ``loads`` of it; a ``dumps`` that raises or
returns anything but a str leaves the key unknown with a TypeError that says so; a
``loads`` that raises on a redelivery reaches the caller with a note, the key stays
completed."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg.rows import TupleRow
from pydantic import BaseModel

from flask_idempotency import Idempotency, OutcomeUnknown
from tests.support.keys_table import key_rows

DB = psycopg.Connection[TupleRow]


def extension(app: Flask) -> Idempotency:
    return app.extensions["idempotency"].extension  # type: ignore[no-any-return]


def stored(db: DB, key: str) -> tuple[str, bytes | None]:
    row = db.execute(
        "SELECT status, response_body FROM idempotency_keys WHERE key = %s", (key,)
    ).fetchone()
    assert row is not None
    return row[0], row[1]


class Charge(BaseModel):
    id: uuid.UUID
    amount: int
    note: str


class PydanticSerializer:
    def __init__(self, model: type[BaseModel]) -> None:
        self.model = model

    def dumps(self, obj: BaseModel) -> str:
        return obj.model_dump_json()

    def loads(self, text: str) -> BaseModel:
        return self.model.model_validate_json(text)


@dataclasses.dataclass(frozen=True)
class Receipt:
    order: str
    lines: tuple[str, ...]


class DataclassSerializer:
    def dumps(self, obj: Receipt) -> str:
        return json.dumps(dataclasses.asdict(obj))

    def loads(self, text: str) -> Receipt:
        document = json.loads(text)
        return Receipt(document["order"], tuple(document["lines"]))


class UUIDSerializer:
    def dumps(self, obj: uuid.UUID) -> str:
        return str(obj)

    def loads(self, text: str) -> uuid.UUID:
        return uuid.UUID(text)


class Returns:
    """A serializer whose dumps returns *value* (anything) and whose loads is identity."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def dumps(self, obj: Any) -> Any:
        return self.value

    def loads(self, text: str) -> str:
        return text

    def __repr__(self) -> str:
        return f"Returns({type(self.value).__name__})"


@pytest.mark.parametrize(
    ("serializer", "result"),
    [
        (
            PydanticSerializer(Charge),
            Charge(id=uuid.uuid4(), amount=5, note="é😀 <b>\x00"),
        ),
        (DataclassSerializer(), Receipt("o-1", ("a", "b"))),
        (UUIDSerializer(), uuid.uuid4()),
    ],
    ids=["pydantic", "dataclass", "uuid"],
)
def test_a_redelivery_gets_loads_of_what_dumps_stored(
    app: Flask, key: str, db: DB, serializer: Any, result: Any
) -> None:
    calls: list[int] = []

    def consume() -> Any:
        calls.append(1)
        return result

    with app.app_context():
        first = extension(app).run_once(key, consume, serializer=serializer)
        again = extension(app).run_once(key, consume, serializer=serializer)
    assert first is result
    assert again == result and type(again) is type(result) and again is not result
    assert calls == [1]
    assert stored(db, key) == ("completed", serializer.dumps(result).encode())


def test_the_default_stays_json(app: Flask, key: str, db: DB) -> None:
    with app.app_context():
        assert extension(app).run_once(key, lambda: {"a": [1, "é"]}) == {"a": [1, "é"]}
        assert extension(app).run_once(key, lambda: None) == {"a": [1, "é"]}
    assert stored(db, key) == ("completed", b'{"a": [1, "\\u00e9"]}')


@pytest.mark.parametrize(
    "value",
    [b"bytes", None, 42, bytearray(b"x")],
    ids=["bytes", "none", "int", "bytearray"],
)
def test_a_dumps_that_returns_no_str_leaves_the_key_unknown(
    app: Flask, key: str, db: DB, value: Any
) -> None:
    calls: list[int] = []
    with app.app_context():
        with pytest.raises(TypeError) as raised:
            extension(app).run_once(key, lambda: calls.append(1), serializer=Returns(value))
        message = str(raised.value)
        assert key in message and f"returned {type(value).__name__}, not str" in message
        assert "is now unknown" in raised.value.__notes__[0]
        with pytest.raises(OutcomeUnknown):
            extension(app).run_once(key, lambda: calls.append(1), serializer=Returns(value))
    assert calls == [1]
    assert stored(db, key) == ("unknown", None)


def test_a_dumps_that_raises_leaves_the_key_unknown(app: Flask, key: str, db: DB) -> None:
    class Raises:
        def dumps(self, obj: Any) -> str:
            raise ValueError("cannot \x00 serialise")

        def loads(self, text: str) -> Any:
            raise AssertionError("never called")

    with app.app_context(), pytest.raises(TypeError, match="cannot \x00 serialise") as raised:
        extension(app).run_once(key, lambda: 1, serializer=Raises())
    assert isinstance(raised.value.__cause__, ValueError)
    assert "is now unknown" in raised.value.__notes__[0]
    assert stored(db, key)[0] == "unknown"


def test_a_result_json_cannot_hold_says_what_became_of_the_key(app: Flask, key: str) -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with app.app_context(), pytest.raises(TypeError, match="is not JSON") as raised:
        extension(app).run_once(key, lambda: deep)
    assert "is now unknown" in raised.value.__notes__[0]


@pytest.mark.parametrize(
    "text",
    ["x" * 100_000, "a\x00b", "\ud800 lone \udfff", ""],
    ids=["100kB", "nul", "surrogates", "empty"],
)
def test_hostile_text_is_stored_and_read_back_exactly(app: Flask, key: str, text: str) -> None:
    with app.app_context():
        assert extension(app).run_once(key, lambda: "ignored", serializer=Returns(text)) == (
            "ignored"
        )
        assert extension(app).run_once(key, lambda: "other", serializer=Returns(text)) == text


def test_a_loads_that_raises_reaches_the_caller_and_the_key_stays_completed(
    app: Flask, key: str, db: DB
) -> None:
    calls: list[int] = []

    def consume() -> uuid.UUID:
        calls.append(1)
        return uuid.UUID(int=7)

    with app.app_context():
        extension(app).run_once(key, consume, serializer=UUIDSerializer())
        # A redelivery with another serializer (here: the default JSON) cannot read it.
        with pytest.raises(json.JSONDecodeError) as raised:
            extension(app).run_once(key, consume)
        assert "flask idempotency-forget" in raised.value.__notes__[0]
        assert "is completed" in raised.value.__notes__[0]
        again = extension(app).run_once(key, consume, serializer=UUIDSerializer())
    assert again == uuid.UUID(int=7) and calls == [1]
    assert stored(db, key)[0] == "completed"


@pytest.mark.parametrize("bad", [json, "json", object(), 42], ids=["module", "str", "obj", "int"])
def test_a_serializer_without_dumps_and_loads_is_refused_before_anything_runs(
    make_app: Callable[..., Flask], key: str, db: DB, bad: Any
) -> None:
    app = make_app()
    if bad is json:  # the json module has both: it is a fine serializer
        with app.app_context():
            assert extension(app).run_once(key, lambda: [1], serializer=bad) == [1]
        return
    with app.app_context(), pytest.raises(TypeError, match="dumps.*loads"):
        extension(app).run_once(key, pytest.fail, serializer=bad)
    assert key_rows(db, key) == 0
