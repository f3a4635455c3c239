"""What the served processes record: every decision the extension signals, one JSON line
per signal in a file per process, and the runs of the views read back from them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: in the served processes: the folder each one appends its recorded decisions to
RECORD_ENV = "IDEMPOTENCY_FAULT_RECORD"
#: the recorded signals that start a run of the view, by the signal's name
RUN_STARTS = {
    "idempotency-claimed": "claimed",
    "idempotency-retried": "retried",
    "idempotency-abandoned-taken-over": "taken_over",
}
#: the recorded signals that end an attempt (a finish that could not be stored leaves the
#: run without an end, as a process that died does)
RUN_ENDS = ("idempotency-stored", "idempotency-released")


def record_decisions() -> None:
    """Record, in this process, every decision the extension signals: one JSON line per
    signal in ``<$IDEMPOTENCY_FAULT_RECORD>/<pid>.jsonl``, appended at once (a ``kill -9``
    right after loses nothing). Nothing when the variable is unset. The fault schedule
    calls it in each gunicorn worker and each ``flask`` command it starts."""
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return
    from blinker import NamedSignal

    from ... import signals

    for value in vars(signals).values():
        if isinstance(value, NamedSignal):
            value.connect(_recorder(Path(folder), value.name), weak=False)


def _recorder(folder: Path, name: str) -> Callable[..., None]:
    def receive(sender: Any, **kwargs: Any) -> None:
        entry: dict[str, Any] = {
            "signal": name,
            "t": time.time(),
            "pid": os.getpid(),
            **{
                k: v if isinstance(v, (str, int, float, bool)) else repr(v)
                for k, v in kwargs.items()
            },
        }
        entry.update(_request_facts())
        line = (json.dumps(entry) + "\n").encode()
        fd = os.open(folder / f"{os.getpid()}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    return receive


def _request_facts() -> dict[str, Any]:
    """The endpoint and the path of the request a signal came from, whether its view is
    ``transactional=True``, and the key it holds: its generation (a key used afresh after
    its expiry starts a new one) and its route's TTL."""
    from flask import current_app, has_request_context, request

    from ...claim import peek_claim
    from ...extension import TRANSACTIONAL_MARK

    if not has_request_context():
        return {}
    view = current_app.view_functions.get(request.endpoint or "")
    facts: dict[str, Any] = {
        "endpoint": request.endpoint or "",
        "path": request.path,
        "transactional": bool(getattr(view, TRANSACTIONAL_MARK, False)),
    }
    claim = peek_claim()
    if claim is not None:
        facts["generation"] = claim.outcome.generation
        facts["ttl"] = claim.settings.ttl.total_seconds()
    return facts


def _read_decisions(folder: Path) -> list[dict[str, Any]]:
    """Every recorded decision, by time (a line cut by a kill is left out)."""
    found: list[dict[str, Any]] = []
    for path in folder.glob("*.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    found.sort(key=lambda d: float(d["t"]))
    return found


@dataclasses.dataclass
class Run:
    """One run of a view for a key, as the served process recorded it."""

    key: str
    attempt: int
    pid: int
    #: wall-clock time the view started (``time.time()``)
    started: float
    #: ``claimed`` (a fresh key), ``retried`` (after a release), ``taken_over`` (a
    #: claim in flight whose owner was dead or silent)
    how: str
    endpoint: str = ""
    #: the path of the request it serves (a route of the schedule's requests)
    path: str = ""
    #: ``stored``, ``fenced``, ``released:<status>``, or ``""``: no end recorded (the
    #: process died, or keeps an answer it could not store yet, or could not store it)
    end: str = ""
    #: wall-clock time its end was recorded (None: no end)
    ended: float | None = None
    #: the view is ``transactional=True`` (None: not known)
    transactional: bool | None = None
    #: the key's generation (new when an expired key is used afresh; None: not known)
    generation: int | None = None
    #: the route's TTL in seconds (None: not known)
    ttl: float | None = None


def _runs(decisions: list[dict[str, Any]]) -> dict[str, list[Run]]:
    """The runs of each key, each with the end its process recorded for its attempt."""
    runs: dict[str, list[Run]] = defaultdict(list)
    open_runs: dict[tuple[int, str], Run] = {}
    for d in decisions:
        name, key = d["signal"], d.get("key")
        if key is None:
            continue
        where = (int(d["pid"]), str(key))
        if name in RUN_STARTS:
            run = Run(str(key), int(d["attempt"]), where[0], float(d["t"]), RUN_STARTS[name])
            run.endpoint = str(d.get("endpoint", ""))
            run.path = str(d.get("path", ""))
            run.transactional = d.get("transactional")
            run.generation = d.get("generation")
            run.ttl = d.get("ttl")
            runs[run.key].append(run)
            open_runs[where] = run
            continue
        run_of = open_runs.get(where)
        if name not in RUN_ENDS or run_of is None or d.get("attempt") != run_of.attempt:
            continue
        del open_runs[where]
        run_of.ended = float(d["t"])
        if name == "idempotency-stored":
            run_of.end = "stored" if d.get("stored") else "fenced"
        else:
            run_of.end = f"released:{d.get('status')}"
    return runs
