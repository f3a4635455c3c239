"""What a batch of the background did: one :class:`Outcome` per key or job, and one
summary line per batch, the same for the completer, the reconciler and the dispatcher."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a batch did with one key (or with one job, of that key)."""

    tenant: str
    key: str
    #: what became of it: ``completed``, ``retryable``, ``undecided``, ``dispatched``, ...
    outcome: str
    #: the attempt it ran as (the completer), or the job's hand-overs so far
    attempt: int = 0
    detail: str = ""
    #: the job's id (the dispatcher's outcomes)
    job: str = ""

    @property
    def subject(self) -> tuple[str, str, str]:
        """What the outcome is about: the key, or the job."""
        return self.tenant, self.key, self.job

    def line(self) -> str:
        """The line printed for it."""
        text = f"{self.outcome} tenant={self.tenant!r} key={self.key!r}"
        if self.attempt:
            text += f" attempt={self.attempt}"
        return f"{text}: {self.detail}" if self.detail else text


def summary(outcomes: Sequence[Outcome], always: Sequence[str], rare: Sequence[str] = ()) -> str:
    """One line for a batch: ``"N due: a completed, b retryable, ..."``, with the counts
    of the outcomes *always* shown, then those of *rare* that happened, in that order."""
    counts = Counter(outcome.outcome for outcome in outcomes)
    shown = [*always, *(name for name in rare if counts[name])]
    shown += sorted(set(counts) - set(shown))
    return f"{len(outcomes)} due: " + ", ".join(f"{counts[name]} {name}" for name in shown)
