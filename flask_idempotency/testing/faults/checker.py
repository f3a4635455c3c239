"""The checks (Jepsen's checker): what the contract forbids for each key, and whether the run
tested what it should.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence

from .clients import Exchange, Intent
from .nemesis import CLI_TIMEOUT
from .record import Run
from .report import FaultReport, _in_flight
from .schedule import COMMANDS


def _effect_of_runs(runs: list[Run]) -> int:
    """Without ``effects``: every run of a view may have written, except a run of a
    ``transactional=True`` view whose transaction did not commit with a stored answer."""
    return sum(1 if not run.transactional else run.end == "stored" for run in runs)


def _key_violations(
    report: FaultReport, intent: Intent, effect: int, counted_by_runs: bool
) -> list[str]:
    """What the contract forbids for one key."""
    problems: list[str] = []
    runs = report.runs.get(intent.key, [])
    if effect > 1:
        how = "the view's runs that may have written" if counted_by_runs else "effects(key)"
        problems.append(f"its effect happened {effect} times (counted by {how})")
    # a transactional attempt that rolled back left no trace: the next run is its attempt;
    # a key used afresh after its expiry numbers its attempts again, in a new generation
    kept = Counter((r.generation, r.attempt) for r in runs if not r.transactional)
    twice = [a for (_, a), n in kept.items() if n > 1]
    if twice:
        problems.append(f"attempt(s) {twice} ran more than once")
    problems += _afresh_violations(runs)
    for earlier, later in zip(runs, runs[1:], strict=False):
        if later.how == "taken_over" and not report.disrupted(earlier.started, later.started):
            problems.append(
                f"taken over {later.started - earlier.started:.1f} s after its attempt"
                f" {earlier.attempt} started, with no fault in between: a live view taken over"
            )
    for answer in intent.exchanges:
        status = answer.status
        if status is not None and status >= 500 and status != 503:
            problems.append(f"answered {answer.label()}: {answer.body[:200]!r}")
        elif status is not None and 400 <= status < 500 and status not in (409, 429):
            problems.append(f"answered {answer.label()}")
    problems += _expiry_violations(intent, runs)
    ack = intent.ack
    if ack is not None:
        problems += _ack_violations(report, intent, ack, runs)
    elif not intent.final:
        last = intent.exchanges[-1].label() if intent.exchanges else "nothing"
        problems.append(f"never settled: no final answer after the drain (last: {last})")
    return problems


def _afresh_violations(runs: list[Run]) -> list[str]:
    """A key claimed afresh (a new generation) after a run of an earlier one: its row must
    have been past its life, which lasts at least the TTL after the earlier generation's
    last run started (each claim or takeover sets it beyond that). Sooner, the row was lost.
    A run whose row may rightly be gone is not counted: a transactional one that did not
    commit with its answer, and one whose key was released as never used."""
    problems: list[str] = []
    last: dict[int, float] = {}
    for run in runs:
        if run.generation is None:
            continue
        earlier = [(g, t) for g, t in last.items() if g != run.generation]
        if run.how == "claimed" and run.ttl is not None and earlier:
            generation, started = max(earlier, key=lambda item: item[1])
            if run.started - started < run.ttl:
                problems.append(
                    f"claimed afresh {run.started - started:.1f} s after a run of its"
                    f" generation {generation} started, before its TTL of {run.ttl:g} s"
                    " could pass: its row was lost"
                )
        kept = run.end == "stored" if run.transactional else run.end != "released:unused"
        if kept:
            last[run.generation] = max(last.get(run.generation, run.started), run.started)
    return problems


def _first_status(answer: Exchange) -> int | None:
    """The first answer's status a 409 key-expired names (SPEC §24), else None."""
    if answer.status != 409 or answer.problem != "key-expired":
        return None
    try:
        status = json.loads(answer.body).get("first_status")
    except (ValueError, AttributeError):
        return None
    return status if isinstance(status, int) else None


def _expiry_violations(intent: Intent, runs: list[Run]) -> list[str]:
    """A key answered 409 key-expired (SPEC §24) is past its life: no view runs under it
    after that answer, every such answer names the first answer's status, and that status
    is the one the client was acknowledged."""
    expired = [e for e in intent.exchanges if e.status == 409 and e.problem == "key-expired"]
    if not expired:
        return []
    problems: list[str] = []
    first = min(e.at for e in expired)
    late = [r for r in runs if r.started > first]
    if late:
        problems.append(
            f"ran again (attempt {late[0].attempt}, {late[0].how}) after it was answered"
            " key-expired"
        )
    named = [_first_status(e) for e in expired]
    if None in named:
        problems.append("answered key-expired without the first answer's status")
    elif intent.ack is not None and set(named) != {intent.ack.status}:
        problems.append(
            f"answered key-expired naming first status {set(named)}, acknowledged"
            f" {intent.ack.status}"
        )
    return problems


def _ack_violations(
    report: FaultReport, intent: Intent, ack: Exchange, runs: list[Run]
) -> list[str]:
    """The acknowledged answer is every later 2xx and the final replay, unless the
    process that gave it died before it could be stored (SPEC §20: only the process's
    death leaves such a key to its ``on_abandoned``)."""
    later = [e for e in intent.exchanges if e.sent > ack.sent or e.purpose == "verify"]
    changed = [e for e in later if e.status is not None and 200 <= e.status < 300]
    changed = [e for e in changed if e.body != ack.body]
    verify = [e for e in intent.exchanges if e.purpose == "verify"]
    lost = [
        e
        for e in verify
        if (e.status is None or not 200 <= e.status < 300 or not e.replayed)
        and _first_status(e) != ack.status
    ]
    if not changed and not lost:
        return []
    answering = [r for r in runs if r.started < ack.at]
    if not ack.replayed and answering:
        run = answering[-1]
        if not run.end and run.pid in report.ended_pids:
            return []  # its process ended before the answer was stored
    what = []
    if changed:
        what.append(
            f"later 2xx differ ({', '.join(e.body[:60].decode(errors='replace') for e in changed)})"
        )
    if lost:
        what.append(f"the final retry answered {', '.join(e.label() for e in lost)}")
    return [f"acknowledged {ack.status} ({ack.body[:60]!r}) lost or changed: " + "; ".join(what)]


def _harness_problems(report: FaultReport, kinds: Sequence[str], no_reconciler: bool) -> list[str]:
    """The run must have tested something: every kind of fault done, the commands run,
    each partition catching requests, every request answered, every run recorded."""
    problems: list[str] = []
    done = Counter(e.kind for e in report.events)
    missing = [k for k in kinds if done[k] == 0]
    if missing:
        problems.append(f"fault kinds never done: {missing}")
    for kind in COMMANDS:
        runs = [c for c in report.commands if c.name == kind]
        if kind == "reconcile" and no_reconciler:
            continue
        if not any(c.code == 0 for c in runs):
            outputs = [(c.code, c.output()[-300:]) for c in runs]
            problems.append(f"flask {' '.join(COMMANDS[kind])}: no run succeeded: {outputs}")
    hung = [c.name for c in report.commands if c.killed]
    if hung:
        problems.append(f"background commands killed after {CLI_TIMEOUT} s: {hung}")
    exchanges = [e for i in report.intents for e in i.exchanges]
    for outage in report.outages:
        if outage.kind == "partition" and not _in_flight(exchanges, outage):
            problems.append(f"a partition of {outage.seconds:.1f} s caught no request")
    acked = [i for i in report.intents if i.ack is not None]
    for request in sorted({str(i.request) for i in report.intents}):
        if not any(str(i.request) == request for i in acked):
            problems.append(f"no {request} was ever answered 2xx")
    unrecorded = [
        i.key
        for i in acked
        if i.ack is not None and not i.ack.replayed and not report.runs.get(i.key)
    ]
    if unrecorded:
        problems.append(f"fresh 2xx answers with no run of the view recorded: {unrecorded[:10]}")
    return [f"harness: {p}" for p in problems]


def _count_effects(
    report: FaultReport, effects: Callable[[str], int] | None
) -> tuple[dict[str, int], list[str]]:
    """Each key's effect count: ``effects(key)``, or its runs that may have written."""
    counts: dict[str, int] = {}
    problems: list[str] = []
    for intent in report.intents:
        if effects is None:
            counts[intent.key] = _effect_of_runs(report.runs.get(intent.key, []))
            continue
        try:
            counts[intent.key] = int(effects(intent.key))
        except Exception as exc:  # the user's function: reported, not raised
            problems.append(f"key {intent.key!r}: effects(key) raised {exc!r}")
    return counts, problems
