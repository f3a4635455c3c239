"""The schedule (Jepsen's generator): the kinds of fault and the seeded order they come in."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

#: with ``seed=None``, the seed comes from this variable when it is set (a failed run's
#: seed, to repeat its schedule), else from the system's randomness
SEED_ENV = "IDEMPOTENCY_FAULT_SEED"
#: the kinds of fault, in the order of the first round before it is shuffled
KINDS = (
    "kill-worker",
    "restart-fast",
    "restart-immediate",
    "terminate-backends",
    "partition",
    "sighup",
    "clean",
    "complete",
    "reconcile",
)
RESTARTS = ("restart-fast", "restart-immediate")


#: the command line of each CLI fault (after ``flask --app APP``)
COMMANDS = {
    "clean": ("idempotency-clean", "--margin", "0"),
    "complete": ("idempotency-complete", "--older-than", "0"),
    "reconcile": ("idempotency-reconcile",),
}
#: the faults that can end or silence a view's owner: only after one may a claim in
#: flight be taken over (so can every kind of ``more_faults``)
DISRUPTIVE = (
    "kill-worker",
    "restart-fast",
    "restart-immediate",
    "terminate-backends",
    "partition",
    "sighup",
)
#: rough seconds a fault itself takes, for planning how many fit in the duration
COST = {"restart-fast": 0.5, "restart-immediate": 0.5, "sighup": 1.5, "kill-worker": 1.0}
#: a duration at and above which the schedule's pace is that of the project's own run;
#: a shorter one has its calms and partitions shortened in proportion
FULL_PACE = 30.0


#: seconds of calm drawn before a fault; before a kill, less: a kill disturbs one worker,
#: and the kills must land in the views of every route of a short run (SPEC §23)
CALM = (1.0, 2.5)
KILL_CALM = (0.5, 1.5)
#: after the first round, a kill is drawn this many times as often as another kind
KILL_WEIGHT = 3


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault of a schedule."""

    gap: float  #: seconds of calm before it
    kind: str
    seconds: float = 0.0  #: a partition's length


def first_round(kinds: Sequence[str]) -> list[str]:
    """The faults every schedule begins with, before it is shuffled: every kind once, and
    a second volley of kills (the kills must land in every route's views, SPEC §23)."""
    return [*kinds, *(["kill-worker"] if "kill-worker" in kinds else [])]


def draw_schedule(rng: random.Random, seconds: float, kinds: Sequence[str] = KINDS) -> list[Fault]:
    """Every kind once (and a second volley of kills), in a seeded order, then seeded kinds
    (kills the most often) until *seconds* are planned:
    a function of the seed, the duration and the kinds only, so a seed repeats its
    schedule. Below :data:`FULL_PACE` seconds the calms and partitions are shortened in
    proportion."""
    scale = min(1.0, seconds / FULL_PACE)
    first = first_round(kinds)
    rng.shuffle(first)
    faults: list[Fault] = []
    planned = 0.0
    weights = [KILL_WEIGHT if kind == "kill-worker" else 1 for kind in kinds]
    while first or planned < seconds:
        kind = first.pop() if first else rng.choices(kinds, weights)[0]
        calm = KILL_CALM if kind == "kill-worker" else CALM
        gap = round(rng.uniform(*calm) * scale, 2)
        length = round(rng.uniform(2.0, 6.0) * scale, 2) if kind == "partition" else 0.0
        faults.append(Fault(gap, kind, length))
        planned += gap + length + COST.get(kind, 0.0)
    return faults
