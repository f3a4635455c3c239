"""The fault schedule's checks on made-up histories. Expired keys (SPEC §24): a key answered
409 key-expired is final, never runs again, and names the status its client was
acknowledged. Asynchronous routes (SPEC §10): their 202 Accepted is followed to the key's
answer, which later requests must replay. A key's attempts are counted per generation (a key
used afresh after its life starts again at 1), and a fresh claim within its TTL says its row
was lost. The schedule itself runs in
tests/e2e/test_fault_schedule.py; here each rule is shown to fail when broken, which a
passing schedule cannot show."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from flask_idempotency.testing.faults import run_fault_schedule
from flask_idempotency.testing.faults.checker import (
    _ack_violations,
    _expiry_violations,
    _key_violations,
)
from flask_idempotency.testing.faults.clients import Exchange, Intent, Request
from flask_idempotency.testing.faults.record import Run
from flask_idempotency.testing.faults.report import FaultReport

REQUEST = Request("POST", "/charge", b"{}")


def expired(at: float, first_status: object = 201) -> Exchange:
    body = json.dumps({"type": "x:key-expired", "first_status": first_status}).encode()
    return Exchange("retry", 0.0, 0.0, 409, body=body, problem="key-expired", at=at)


def acked(at: float) -> Exchange:
    return Exchange("first", 0.0, 0.0, 201, body=b'{"id": 1}', at=at)


def intent(*exchanges: Exchange) -> Intent:
    found = Intent(0, "k", REQUEST)
    for exchange in exchanges:
        found.exchanges.append(exchange)
        found.absorb(exchange)
    return found


def test_an_expired_answer_is_final() -> None:
    assert intent(expired(10.0)).final


def test_an_acknowledged_key_answered_expired_with_its_status_is_kept() -> None:
    runs = [Run("k", 1, 7, 1.0, "claimed", end="stored")]
    assert _expiry_violations(intent(acked(2.0), expired(10.0)), runs) == []


def test_a_run_after_the_expired_answer_is_a_violation() -> None:
    runs = [Run("k", 1, 7, 1.0, "claimed", end="stored"), Run("k", 1, 7, 11.0, "claimed")]
    found = _expiry_violations(intent(acked(2.0), expired(10.0)), runs)
    assert found and "ran again" in found[0]


def test_another_first_status_than_the_acknowledged_one_is_a_violation() -> None:
    runs = [Run("k", 1, 7, 1.0, "claimed", end="stored")]
    found = _expiry_violations(intent(acked(2.0), expired(10.0, first_status=500)), runs)
    assert found and "acknowledged 201" in found[0]


def test_an_expired_answer_without_a_first_status_is_a_violation() -> None:
    for nasty in (None, "201", float("nan"), [201]):
        found = _expiry_violations(intent(expired(10.0, first_status=nasty)), [])
        assert found == ["answered key-expired without the first answer's status"], nasty


def accepted(at: float) -> Exchange:
    body = b'{"status": "processing"}'
    return Exchange("first", 0.0, 0.0, 202, body=body, retry_after=1.0, at=at)


def answered(at: float, body: bytes, purpose: str = "retry") -> Exchange:
    return Exchange(purpose, at, at, 201, replayed=True, body=body, at=at)


def report() -> FaultReport:
    return FaultReport(
        seed=1,
        events=[],
        violations=[],
        intents=[],
        runs={},
        outages=[],
        commands=[],
        logs={},
        timings={},
        seconds=0.0,
    )


def test_an_accepted_202_is_followed_to_the_keys_answer() -> None:
    followed = intent(accepted(1.0))
    assert followed.accepted is not None and followed.ack is None and not followed.final
    followed.exchanges.append(answered(5.0, b'{"id": 1}'))
    followed.absorb(followed.exchanges[-1])
    assert followed.final and followed.ack is followed.exchanges[-1]


def test_the_answer_after_the_202_is_what_later_requests_must_replay() -> None:
    followed = intent(accepted(1.0), answered(5.0, b'{"id": 1}'))
    assert followed.ack is not None
    same = answered(9.0, b'{"id": 1}', "verify")
    followed.exchanges.append(same)
    assert _ack_violations(report(), followed, followed.ack, []) == []
    followed.exchanges.append(answered(10.0, b'{"id": 2}', "duplicate"))
    found = _ack_violations(report(), followed, followed.ack, [])
    assert found and "later 2xx differ" in found[0]


def test_a_202_without_retry_after_is_an_answer() -> None:
    """A view's own 202 (no Retry-After) is its answer, not work in progress."""
    own = Exchange("first", 0.0, 0.0, 202, body=b"{}", at=1.0)
    assert intent(own).ack is own


def run(started: float, how: str, generation: int, end: str = "", attempt: int = 1) -> Run:
    return Run("k", attempt, 7, started, how, end=end, generation=generation, ttl=3.0)


def key_violations(*runs: Run) -> list[str]:
    found = report()
    found.runs = {"k": list(runs)}
    return _key_violations(found, intent(acked(30.0)), 1, True)


def test_a_key_used_afresh_after_its_life_numbers_its_attempts_again() -> None:
    """CI, seed 860222463: a worker killed in the view; the retry came after reconcile made
    the key retryable and its life had passed, so it was claimed afresh: attempt 1 again,
    of a new generation (the view may run again: its route said so, on_abandoned="retry")."""
    assert key_violations(run(2.3, "claimed", 100), run(16.0, "claimed", 200, "stored")) == []


def test_the_same_attempt_of_one_generation_twice_is_a_violation() -> None:
    found = key_violations(run(2.3, "claimed", 100), run(16.0, "claimed", 100, "stored"))
    assert "attempt(s) [1] ran more than once" in found


def test_a_key_claimed_afresh_within_its_life_lost_its_row() -> None:
    found = key_violations(run(2.3, "claimed", 100), run(4.0, "claimed", 200, "stored"))
    assert any("claimed afresh 1.7 s after" in f and "its row was lost" in f for f in found)
    taken = run(3.0, "taken_over", 100, attempt=2)
    found = key_violations(run(0.5, "claimed", 100), taken, run(5.5, "claimed", 200, "stored"))
    assert any("claimed afresh 2.5 s after a run of its generation 100" in f for f in found)


@pytest.mark.parametrize("end", ["released:unused", "released:rolled_back", ""])
def test_a_row_rightly_gone_may_be_claimed_afresh_at_once(end: str) -> None:
    """A key released as never used, and a transactional attempt that did not commit (a
    rolled-back one, or a killed one), leave no row: the next claim is a fresh one."""
    first = run(2.3, "claimed", 100, end)
    first.transactional = end != "released:unused"
    assert key_violations(first, run(2.5, "claimed", 200, "stored")) == []


@pytest.mark.parametrize(
    ("kill_at", "said"),
    [
        (("/nope", 0.3), "none of the requests is"),
        (("/payouts", -0.1), "must be 0 to 4"),
        (("/payouts", 4.5), "must be 0 to 4"),
        (("/payouts", float("nan")), "must be 0 to 4"),
        (("/payouts", "soon"), "is (route, seconds into its view)"),
        (("/payouts",), "is (route, seconds into its view)"),
        ("/payouts", "is (route, seconds into its view)"),
        (("/pay\x00outs", 0.3), "none of the requests is"),
    ],
)
def test_a_kill_at_that_names_no_route_or_point_is_refused(kill_at: Any, said: str) -> None:
    """``kill_at`` is checked before anything starts: a route of the requests, 0 to 4 s."""
    with pytest.raises(ValueError, match=re.escape(said)):
        run_fault_schedule(
            "app:create_app()",
            [("POST", "/payouts", {})],
            database="postgresql://127.0.0.1:1/none",
            kill_at=kill_at,
        )
