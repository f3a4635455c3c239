"""Rotating the encryption keys under load, across a fleet that is never all on one
config at once (SPEC §16, "Rotations without wrong answers").

Two app instances on one table stand for two processes of a fleet in the middle of a
deploy. Client threads send each key to one of them and its retry to the other, so every
answer sealed by one is opened by the other.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

from cryptography.fernet import Fernet as CryptoFernet
from flask import Flask

from flask_idempotency.encryption import Fernet
from tests.support.helpers import DB, executions

OLD, NEW = CryptoFernet.generate_key(), CryptoFernet.generate_key()
THREADS = 4
SECONDS = 2.0


def mixed_load(first: Flask, second: Flask, seed: int) -> tuple[Counter[str], list[str]]:
    """THREADS clients for SECONDS: each key's first request to one app at random, its
    retry to the other. What each answer was (``first 201``, ``replay 201``, ``replay
    503``...), and the keys sent."""
    answers: Counter[str] = Counter()
    keys: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + SECONDS

    def client(n: int) -> None:
        rng = random.Random(seed + n)
        while time.monotonic() < deadline:
            key = f"rotate-{uuid.uuid4()}"
            one, other = (first, second) if rng.random() < 0.5 else (second, first)
            got = []
            for app, which in ((one, "first"), (other, "replay")):
                response = app.test_client().post(
                    "/payments", json={"amount": 1}, headers={"Idempotency-Key": key}
                )
                body = response.get_data(as_text=True)
                assert "not processed" not in body, body  # never, whatever the fleet's keys
                label = f"{which} {response.status_code}"
                if response.status_code == 503:
                    assert "was processed" in response.get_json()["detail"]
                    assert response.get_json()["retryable"] is True
                    assert response.headers["Retry-After"]
                got.append(label)
            with lock:
                answers.update(got)
                keys.append(key)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return answers, keys


def test_a_fleet_half_rotated_never_says_not_processed(
    make_app: Callable[..., Flask], db: DB
) -> None:
    """The one-step rotation (``[new, old]`` deployed while some processes still have
    ``[old]``): the old processes cannot open what the new ones sealed. They answer 503,
    "processed", retryable: the retry on a rotated process gets the replay. The view
    never runs twice."""
    rotated = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([NEW, OLD]))
    behind = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([OLD]))
    answers, keys = mixed_load(rotated, behind, seed=1)
    print(f"one step, half the fleet rotated: {sum(answers.values())} requests: {answers}")
    assert answers["replay 503"] > 0  # the mixed fleet really met sealed answers it cannot open
    assert set(answers) <= {"first 201", "replay 201", "replay 503"}, answers
    for key in keys[:50]:
        assert executions(db, key) == 1
        # and once the client retries on a process that has the key, it gets its answer
        again = rotated.test_client().post(
            "/payments", json={"amount": 1}, headers={"Idempotency-Key": key}
        )
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"


def test_the_two_step_rotation_answers_every_request(
    make_app: Callable[..., Flask], db: DB
) -> None:
    """The documented rotation: first add the new key for decryption everywhere (``[old,
    new]`` beside ``[old]``), then encrypt with it (``[new, old]`` beside ``[old, new]``):
    no error at either step (docs/howto/encryption.md)."""
    figures = {}
    steps = {
        "step 1: [old, new] beside [old]": (Fernet([OLD, NEW]), Fernet([OLD])),
        "step 2: [new, old] beside [old, new]": (Fernet([NEW, OLD]), Fernet([OLD, NEW])),
    }
    for n, (step, (one, other)) in enumerate(steps.items()):
        first = make_app(IDEMPOTENCY_ENCRYPTOR=one)
        second = make_app(IDEMPOTENCY_ENCRYPTOR=other)
        answers, keys = mixed_load(first, second, seed=10 + n)
        figures[step] = answers
        assert set(answers) == {"first 201", "replay 201"}, (step, answers)
        assert all(executions(db, key) == 1 for key in keys[:50])
    print(f"two steps: {figures}")
