"""The keys by time on plain PostgreSQL: the statements that find keys by their age or
their expiry, walking ``ttl_created_idx`` one TTL class at a time (issue 48).

A table on plain PostgreSQL has one timestamp index a key writes, ``(coalesce(ttl_seconds,
-1), created_at)``; a table on Citus keeps ``expiry_idx`` and ``created_idx`` and runs the
statements of :mod:`.statements_background` and :mod:`.statements_console` as they are
written there (so does a table whose new index is still being built). This module derives
the plain forms from them:

- A TTL class is the keys claimed with one TTL (a route's): a handful per table, found by
  a loose scan of the index, one probe each. Keys claimed by a release that recorded no
  TTL are class -1: their expiry is found through ``legacy_expiry_idx`` (on ``expires_at``,
  for them alone: a new key writes no entry in it).
- A key is kept at least its TTL from its claim: the claim sets ``expires_at`` 2 s beyond
  it, and every later write (a finish, a takeover, a resolution) sets it no earlier than
  now() + TTL. So a class's expired keys are among its keys created before now() - TTL:
  the cleaner walks each class that far, oldest first, and checks ``expires_at`` (a key
  whose slow finish pushed its expiry on is looked at again until it is due).
- The recent claims (the sweeps' last ``ABANDONED_HORIZON``) and the console's pages walk
  each class's newest (or oldest) and merge them.

``{table}`` is filled in later, as everywhere.
"""

from __future__ import annotations

import re

from ..config import MAX_SECONDS
from .statements_background import (
    ABANDONED_HORIZON,
    BURY_EXPIRED,
    COUNT_ABANDONED,
    COUNT_EXPIRED,
    COUNT_STUCK,
    LIST_KEYS,
    MARK_ABANDONED,
    OWNERS_OF_CLAIMS,
)
from .statements_console import KEYS_PAGE, WINDOW_END

#: a key's class, as the index has it
CLASS = "coalesce(ttl_seconds, -1)"
#: the class of the keys claimed by a release that recorded no TTL: their expiry is found
#: through legacy_expiry_idx (on expires_at, for them alone)
NO_TTL = "-1"

# The classes in the table, smallest first: a loose scan of the index (each step the
# next larger class, one index probe), ending with NULL.
_CLASSES = (
    """WITH RECURSIVE ttl_class (ttl) AS (
    SELECT min("""
    + CLASS
    + """) FROM {table}
    UNION ALL
    SELECT (SELECT min("""
    + CLASS
    + ") FROM {table} WHERE "
    + CLASS
    + """ > ttl_class.ttl)
    FROM ttl_class WHERE ttl_class.ttl IS NOT NULL
)"""
)

#: in a condition of :func:`each_class`: the walked class's TTL, in seconds
CLASS_TTL = "ttl_class.ttl"

#: the keys of a class whose expiry may be past: created at least its TTL ago (a TTL no
#: release writes, negative, NaN or past the longest a setting may be, counts as 0: the
#: whole class is walked, and ``expires_at`` decides); the keys without a TTL are not
#: walked (:func:`expired`)
MAY_HAVE_EXPIRED = (
    CLASS_TTL
    + " <> "
    + NO_TTL
    + " AND created_at <= now() - make_interval(secs => CASE WHEN "
    + CLASS_TTL
    + f" BETWEEN 0 AND {MAX_SECONDS:.0f} THEN "
    + CLASS_TTL
    + " ELSE 0 END)"
)


def each_class(where: str, tail: str = "") -> str:
    """A subquery of the keys table's rows that *where* selects, walked one TTL class at a
    time; *tail* (an ``ORDER BY created_at``, a ``LIMIT``, a ``FOR UPDATE``) applies
    within each class.

    The class's subquery is a ``LATERAL`` one that the planner may not flatten (``OFFSET
    0`` if *tail* has no ``LIMIT``): flattened, it may join a scan of the whole table to
    the classes, where each class is a range of the index."""
    tail = tail or "OFFSET 0"
    return (
        "(\n"
        + _CLASSES
        + "\nSELECT k.* FROM ttl_class CROSS JOIN LATERAL (\n    SELECT * FROM {table}\n    WHERE "
        + CLASS
        + " = "
        + CLASS_TTL
        + " AND "
        + where
        + "\n    "
        + tail
        + "\n) AS k\n)"
    )


def expired(where: str = "true", batch: bool = False) -> str:
    """A subquery of the keys whose expiry is past that *where* selects: each TTL class walked
    up to now() - its TTL, and the keys without a TTL through their own expiry index. With
    *batch*, the oldest ``%(batch)s`` of each, locked (skipping those locked already)."""
    walk_tail = "ORDER BY created_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED" if batch else ""
    lone_tail = "ORDER BY expires_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED" if batch else ""
    past = "expires_at <= now() AND " + where
    walked = each_class(MAY_HAVE_EXPIRED + " AND " + past, walk_tail)
    without_ttl = f"SELECT * FROM {{table}} WHERE {CLASS} = {NO_TTL} AND {past} {lone_tail}"
    return f"(SELECT * FROM {walked} AS walked UNION ALL SELECT * FROM ({without_ttl}) AS lone)"


def _replaced(statement: str, pattern: str, by: str, name: str) -> str:
    """*statement* with every match of *pattern* replaced *by*; a statement of the other
    modules that no longer has what this module replaces is a mistake to see at import."""
    replaced, count = re.subn(pattern, lambda _: by, statement)
    if not count:  # pragma: no cover - guards the derivation, not a runtime state
        raise RuntimeError(f"statements_by_class: {name} changed; carry it over")
    return replaced


# -- the sweeps and the cleaner's counts -------------------------------------------------

_RECENT = (
    r"FROM \{table\}\s+WHERE created_at > now\(\) - interval '" + ABANDONED_HORIZON + r"'\s+AND"
)
_RECENT_BY_CLASS = (
    "FROM "
    + each_class("created_at > now() - interval '" + ABANDONED_HORIZON + "'")
    + " AS recent WHERE"
)
_EXPIRED = r"FROM \{table\} WHERE expires_at <= now\(\) AND"
_EXPIRED_BY_CLASS = "FROM " + expired() + " AS expired WHERE"


def _by_class(statement: str, name: str) -> str:
    """*statement* with its scans of the recent claims and of the expired keys by class."""
    recent = re.subn(_RECENT, lambda _: _RECENT_BY_CLASS, statement)
    expired = re.subn(_EXPIRED, lambda _: _EXPIRED_BY_CLASS, recent[0])
    if not (recent[1] or expired[1]):  # pragma: no cover - as _replaced
        raise RuntimeError(f"statements_by_class: {name} changed; carry it over")
    return expired[0]


# The sweep locks each claim it found by its primary key: joined to the table, the planner,
# which cannot tell how many classes there are, may prefer a scan of the whole table.
MARK_ABANDONED_BY_CLASS = _replaced(
    _by_class(MARK_ABANDONED, "MARK_ABANDONED"),
    re.escape("SELECT k.tenant, k.key FROM {table} AS k JOIN found USING (tenant, key)\n")
    + r"(?P<where>\s+WHERE k\.status = 'processing'\s+AND \(k\.locked_until <= now\(\) "
    + r"- %\(margin\)s OR \{dead_owner\}\))\s+"
    + re.escape("LIMIT %(batch)s FOR UPDATE OF k SKIP LOCKED"),
    """SELECT s.tenant, s.key FROM found CROSS JOIN LATERAL (
        SELECT k.tenant, k.key FROM {table} AS k
        WHERE k.tenant = found.tenant AND k.key = found.key AND k.status = 'processing'
          AND (k.locked_until <= now() - %(margin)s OR {dead_owner})
        FOR UPDATE OF k SKIP LOCKED
    ) AS s
    LIMIT %(batch)s""",
    "MARK_ABANDONED",
)
COUNT_STUCK_BY_CLASS = _by_class(COUNT_STUCK, "COUNT_STUCK")
COUNT_ABANDONED_BY_CLASS = _replaced(  # each by its primary key, as MARK_ABANDONED_BY_CLASS
    _by_class(COUNT_ABANDONED, "COUNT_ABANDONED"),
    re.escape(" JOIN {table} AS k USING (tenant, key)"),
    " CROSS JOIN LATERAL (SELECT t.on_abandoned FROM {table} AS t"
    " WHERE t.tenant = abandoned.tenant AND t.key = abandoned.key LIMIT 1) AS k",
    "COUNT_ABANDONED",
)
OWNERS_OF_CLAIMS_BY_CLASS = _by_class(OWNERS_OF_CLAIMS, "OWNERS_OF_CLAIMS")

_FINISHED = "status IN ('completed', 'retryable')"
_EXPIRED_KEYS = _FINISHED + " AND expires_at <= now()"

# The cleaner's batch: each class's oldest expired keys, locked (and skipped if locked)
# in the class's walk, up to the batch in all.
BURY_EXPIRED_BY_CLASS = _replaced(
    BURY_EXPIRED,
    r"SELECT tenant, key FROM \{table\}\s+WHERE "
    + re.escape(_EXPIRED_KEYS)
    + r"\s+LIMIT %\(batch\)s FOR UPDATE SKIP LOCKED",
    "SELECT tenant, key FROM "
    + expired(_FINISHED, batch=True)
    + " AS expired\n    LIMIT %(batch)s",
    "BURY_EXPIRED",
)

COUNT_EXPIRED_BY_CLASS = _replaced(
    COUNT_EXPIRED,
    r"FROM \{table\}\s+WHERE " + re.escape(_EXPIRED_KEYS),
    "FROM " + expired(_FINISHED) + " AS expired",
    "COUNT_EXPIRED",
)

# -- the operators' lists ---------------------------------------------------------------

# idempotency-list: each class's oldest matching keys, merged.
_LIST_FILTERS = (
    "(%(status)s::text IS NULL OR status = %(status)s)\n"
    "  AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)\n"
    "  AND created_at <= now() - %(older_than)s"
)
LIST_KEYS_BY_CLASS = _replaced(
    LIST_KEYS,
    r"FROM \{table\}\s+WHERE " + re.escape(_LIST_FILTERS),
    "FROM " + each_class(_LIST_FILTERS, "ORDER BY created_at LIMIT %(limit)s") + " AS listed",
    "LIST_KEYS",
)

# The console's window: each class's first %(window)s rows from the cursor, merged, the
# first %(window)s of them (the unknown keys' window walks unknown_due_idx as before).
_WINDOW = re.compile(
    r"FROM \{table\}\s+WHERE (?P<where>.*?)\s+\{unknown_only\}\s+"
    r"(?P<order>ORDER BY created_at \{order\}, tenant \{order\}, key \{order\})\s+"
    r"(?P<limit>LIMIT %\(window\)s|OFFSET %\(window\)s - 1 LIMIT 1)",
    re.DOTALL,
)


def _window_by_class(statement: str, name: str) -> str:
    found = _WINDOW.search(statement)
    if found is None:  # pragma: no cover - as _replaced
        raise RuntimeError(f"statements_by_class: {name} changed; carry it over")
    walked = each_class(found["where"], found["order"] + " LIMIT %(window)s")
    return (
        statement[: found.start()]
        + "FROM "
        + walked
        + " AS walked\n"
        + found["order"]
        + "\n"
        + found["limit"]
        + statement[found.end() :]
    )


KEYS_PAGE_BY_CLASS = _window_by_class(KEYS_PAGE, "KEYS_PAGE")
WINDOW_END_BY_CLASS = _window_by_class(WINDOW_END, "WINDOW_END")
