"""What the operators' statements take and give (:mod:`.operations`): the keys list's and the
jobs' filters, a count that may be an estimate, a page of keys; and what PostgreSQL text can
hold."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime, timedelta

from ..model import KeyStatus
from .records import KeyDetail, KeyRow


@dataclasses.dataclass(frozen=True)
class Count:
    """One figure of the overview: exact, or the planner's estimate."""

    value: int
    estimated: bool = False


@dataclasses.dataclass(frozen=True)
class Overview:
    """The console overview's figures, by name (the keys of ``KEY_COUNTS`` and
    ``JOB_COUNTS`` in :mod:`.statements_console`): ``overview["unknown"]``."""

    counts: Mapping[str, Count]

    def __getitem__(self, name: str) -> Count:
        return self.counts[name]


@dataclasses.dataclass(frozen=True)
class KeyFilter:
    """The keys list's filters (also what "Re-arm all" acts on)."""

    status: KeyStatus | None = None
    tenant: str | None = None
    prefix: str | None = None
    exhausted: bool = False
    older_than: timedelta | None = None
    newest_first: bool = True


@dataclasses.dataclass(frozen=True)
class KeysPage:
    """A page of keys, and where the next one starts (None: the end)."""

    rows: list[KeyRow]
    #: (created_at, tenant, key) of the last row walked
    next_cursor: tuple[datetime, str, str] | None
    #: True when the page walked its whole window without filling up
    window_exhausted: bool


@dataclasses.dataclass(frozen=True)
class JobFilter:
    """Which failing or dead jobs: by id, by name (a name no dispatcher knows is failing
    forever, never dead), of a kind (``dead``, ``failing`` or ``any``)."""

    id: str | None = None
    name: str | None = None
    kind: str = "any"
    #: with *id*: the job as the operator saw it, ``(attempts, dead)``; a job that changed
    #: since (retried, failed again, handed over) is left as it is
    seen: tuple[int, bool] | None = None


@dataclasses.dataclass(frozen=True)
class KeyVersion:
    """A key as an operator saw it: a change made from that page applies only while the
    key is still this version (not forgotten and used afresh, taken over, settled)."""

    generation: int
    attempt: int
    status: str

    def __str__(self) -> str:
        return f"{self.generation}.{self.attempt}.{self.status}"

    @classmethod
    def parse(cls, text: str) -> KeyVersion | None:
        """The version :meth:`__str__` wrote, or None if *text* is not one."""
        parts = text.split(".")
        if len(parts) != 3 or not all(p.lstrip("-").isdigit() for p in parts[:2]):
            return None
        return cls(int(parts[0]), int(parts[1]), parts[2])

    @classmethod
    def of(cls, row: KeyDetail) -> KeyVersion:
        """The version of a key's row."""
        return cls(row.generation, row.attempt, row.status)
