"""The report of a run: what was done, what the clients saw, what the views ran, and the
violations found.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

from .clients import Exchange, Intent
from .nemesis import Command, FaultEvent, Kill, Outage
from .record import Run
from .schedule import DISRUPTIVE, KINDS, SEED_ENV


@dataclasses.dataclass(repr=False)
class FaultReport:
    """What :func:`run_fault_schedule` did and found. ``assert report.ok, str(report)``:
    its ``str`` names the violations, the seed that repeats the schedule, and a summary
    (its ``repr`` is one short line)."""

    #: the seed of the schedule: ``run_fault_schedule(..., seed=report.seed)`` repeats it
    seed: int
    #: the faults as they were done, in order
    events: list[FaultEvent]
    #: what the contract forbids, one line each (``key '...': ...``), then what shows the
    #: run did not test what it should (``harness: ...``); empty when the app held
    violations: list[str]
    #: every key the clients used, with each exchange for it
    intents: list[Intent]
    #: each key's runs of the view, as the served processes recorded them
    runs: dict[str, list[Run]]
    #: when the database could not answer (partitions, restarts, the caller's faults)
    outages: list[Outage]
    #: the background commands started (by the schedule and by cron after it)
    commands: list[Command]
    #: gunicorn's log and each command's output, by name
    logs: dict[str, str]
    #: seconds spent: ``setup``, ``faults``, ``heal and drain``, ``total``
    timings: dict[str, float]
    #: the seconds of faults asked for
    seconds: float
    #: the folder of the logs and records (None: removed, the run held)
    log_dir: str | None = None
    #: (start, end, kind) of each fault by the wall clock (``time.time()``), as the runs
    windows: list[tuple[float, float, str]] = dataclasses.field(default_factory=list)
    #: effect counts of the keys (``effects(key)``, or counted from the runs)
    effects: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the workers the schedule killed or reloaded away
    ended_pids: set[int] = dataclasses.field(default_factory=set)
    #: each ``kill -9`` of a worker, and the view it landed in
    kills: list[Kill] = dataclasses.field(default_factory=list)
    #: what every key of this run begins with (``f<seed>-<random>-``): the run's checks see
    #: only these keys, and a ``check=`` that reads your tables should too (an earlier run
    #: in the same database left its own keys, and their effects, behind)
    prefix: str = ""

    def kills_in_views(self) -> dict[str, int]:
        """How many kills landed in a view of each route (its path)."""
        return dict(sorted(Counter(k.path for k in self.kills if k.into is not None).items()))

    @property
    def ok(self) -> bool:
        """No violation: each key's effect at most once, every acknowledged answer the one
        retries replay, no 500, every key settled, and every kind of fault done."""
        return not self.violations

    def disrupted(self, since: float, until: float) -> bool:
        """A fault that can end or silence an owner happened between *since* and *until*
        (wall clock; the one a takeover is judged by may have started a little before)."""
        return any(
            (kind in DISRUPTIVE or kind not in KINDS) and start < until and end > since - 1.0
            for start, end, kind in self.windows
        )

    def describe(self, intent: Intent) -> str:
        """A key's story: its answers, runs and effect count."""
        runs = [
            f"(attempt {r.attempt}, {r.how}, pid {r.pid}, {r.end or 'no end'})"
            for r in self.runs.get(intent.key, [])
        ]
        answers = [f"{e.purpose}:{e.label()}" for e in intent.exchanges]
        lines = [f"  runs: {runs}", f"  answers: {answers}"]
        lines += [
            f"  killed: {kill}; run_fault_schedule(..., {kill.again()}) does it alone again"
            for kill in self.kills
            if kill.key == intent.key
        ]
        if intent.key in self.effects:
            lines.append(f"  effects: {self.effects[intent.key]}")
        return "\n".join(lines)

    def summary(self) -> str:
        """How the run went: the faults, the commands, the outages, the answers."""
        exchanges = [e for i in self.intents for e in i.exchanges]
        by_purpose: dict[str, Counter[str]] = defaultdict(Counter)
        for e in exchanges:
            by_purpose[e.purpose][e.label()] += 1
        requests = Counter(str(i.request) for i in self.intents)
        commands = [(c.name, c.code, round((c.ended or 0) - c.started, 1)) for c in self.commands]
        runs = Counter(r.how for rs in self.runs.values() for r in rs)
        lines = [
            f"seed {self.seed}, {self.seconds:g} s of faults; timings: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items()),
            "faults done:",
            *(f"  {event}" for event in self.events),
            f"commands (name, exit, seconds): {commands}",
            "outages (kind, seconds, requests in flight): "
            + str([(o.kind, round(o.seconds, 2), _in_flight(exchanges, o)) for o in self.outages]),
            f"intents: {len(self.intents)} {dict(requests)},"
            f" answered {sum(1 for i in self.intents if i.ack)}, requests {len(exchanges)}",
            *(
                f"  {purpose}: {dict(sorted(c.items()))}"
                for purpose, c in sorted(by_purpose.items())
            ),
            f"runs of views: {dict(sorted(runs.items()))} for {len(self.runs)} keys",
            f"kills: {len(self.kills)}, landed in a view of each route: {self.kills_in_views()}",
        ]
        if self.log_dir is not None:
            lines.append(f"logs: {self.log_dir}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<FaultReport seed={self.seed} ok={self.ok} violations={len(self.violations)}>"

    def __str__(self) -> str:
        rerun = (
            f"seed {self.seed}: run_fault_schedule(..., seed={self.seed}) repeats this"
            f" schedule ({SEED_ENV}={self.seed} with seed=None)"
        )
        if self.ok:
            head = [f"fault schedule held; {rerun}"]
        else:
            shown = self.violations[:25]
            more = len(self.violations) - len(shown)
            head = [
                f"fault schedule FAILED, {len(self.violations)} violation(s); {rerun}",
                *shown,
                *([f"... and {more} more"] if more > 0 else []),
            ]
        return "\n".join([*head, self.summary()])


def _in_flight(exchanges: list[Exchange], outage: Outage) -> int:
    """How many requests were in flight at some time during *outage*."""
    return sum(1 for e in exchanges if e.sent < outage.end and e.received > outage.start)
