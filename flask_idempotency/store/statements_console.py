"""The SQL of the operator's console and its CLI powers, readable top to bottom.

Beside :mod:`.statements_background`; ``{table}``, ``{jobs}``, ``{audit}`` and ``{heartbeats}`` are
filled in with ``psycopg.sql.Identifier``, values are always bound parameters. Every
hand-made change is one statement: the change and its audit row commit together (a
data-modifying ``WITH``), with the database's clock.
"""

from __future__ import annotations

from .statements_background import DEFERRED, LEASE, OWNER_STATE, RESOLVE_KEY

# -- the tables ------------------------------------------------------------------------

# Never cleaned: idempotency-clean leaves it alone. job_id is text (not uuid) so that
# the row keeps whatever the operator named; payload is the job's JSON text.
AUDIT_SCHEMA = """
CREATE TABLE IF NOT EXISTS {audit} (
    id bigint GENERATED ALWAYS AS IDENTITY,
    at timestamptz NOT NULL DEFAULT now(),
    actor text NOT NULL,
    action text NOT NULL
        CHECK (action IN ('resolve', 'forget', 'rearm', 'retry_job', 'discard_job')),
    tenant text,
    key text,
    job_id text,
    status_before text,
    status_after text,
    reason text,
    job_name text,
    payload text,
    PRIMARY KEY ({audit_key})
);
CREATE INDEX IF NOT EXISTS {audit_key_index} ON {audit} (tenant, key, id);
"""

# One row per command and host: the last batch it finished (interval is --loop's, NULL
# for a command run once).
HEARTBEATS_SCHEMA = """
CREATE TABLE IF NOT EXISTS {heartbeats} (
    command text NOT NULL,
    host text NOT NULL,
    pid integer NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now(),
    interval_seconds double precision,
    counts jsonb NOT NULL DEFAULT '{{}}',
    PRIMARY KEY (command, host)
);
"""

BEAT = """
INSERT INTO {heartbeats} AS h (command, host, pid, finished_at, interval_seconds, counts)
VALUES (%(command)s, %(host)s, %(pid)s, now(), %(interval)s, %(counts)s)
ON CONFLICT (command, host) DO UPDATE
SET pid = excluded.pid, finished_at = excluded.finished_at,
    interval_seconds = excluded.interval_seconds, counts = excluded.counts
"""

# Stale: no batch for three intervals of a loop, or for an hour of a command run once.
HEARTBEATS = """
SELECT command, host, pid, finished_at, interval_seconds, counts,
       extract(epoch FROM now() - finished_at) AS age_seconds,
       now() - finished_at > CASE WHEN interval_seconds IS NULL THEN interval '1 hour'
                                  ELSE make_interval(secs => 3 * interval_seconds) END
           AS stale
FROM {heartbeats}
ORDER BY command, host
"""

# -- counting without scanning ----------------------------------------------------------

# At most cap rows are read: exact below the cap, "more than" at it.
CAPPED_COUNT = "SELECT count(*) FROM (SELECT 1 FROM {source} LIMIT %(cap)s) AS capped"

# The planner's row estimate of the same predicate (from ANALYZE's statistics), read
# without running it.
ESTIMATE = "EXPLAIN (FORMAT JSON) SELECT 1 FROM {source}"

#: what the overview counts, each as the ``FROM ... WHERE`` of a capped count; unknown
#: and exhausted keys use unknown_due_idx, deferred ones pending_idx
KEY_COUNTS = {
    "total": "{table}",
    "processing": "{table} WHERE status = 'processing'",
    "completed": "{table} WHERE status = 'completed'",
    "retryable": "{table} WHERE status = 'retryable'",
    "unknown": "{table} WHERE status = 'unknown' AND reconcile_due_at IS NOT NULL",
    "exhausted": (
        "{table} WHERE status = 'unknown' AND reconcile_due_at IS NOT NULL"
        " AND reconcile_attempts >= %(max_attempts)s::integer"
    ),
    "deferred": "{table} WHERE " + DEFERRED,
}
JOB_COUNTS = {
    "jobs": "{jobs}",
    "jobs_due": "{jobs} WHERE NOT dead AND due_at <= now()",
    "jobs_failing": "{jobs} WHERE NOT dead AND last_error IS NOT NULL",
    "jobs_dead": "{jobs} WHERE dead",
}
#: statuses a big table has no partial index to count exactly: estimated. (No index
#: tells a processing key from a finished one: the finish is a HOT update.)
ESTIMATED_ON_BIG_TABLES = frozenset({"processing", "completed", "retryable"})
EXACT_COUNTS = """
SELECT status, count(*) AS keys,
       count(*) FILTER (WHERE status = 'unknown' AND reconcile_attempts >= %(max_attempts)s)
           AS exhausted,
       count(*) FILTER (WHERE status = 'processing' AND locked_until IS NULL) AS deferred
FROM {table} GROUP BY status
"""

# -- reading ---------------------------------------------------------------------------

# A page of keys, newest (or oldest) first, never their bodies. The inner window walks
# at most %(window)s rows of the created_at index from the cursor; the filters apply to
# that window, so a rare filter costs a bounded page, never a scan of the table. Unknown
# (and exhausted) keys walk their own partial index (unknown_due_idx, on created_at) instead.
#: the window of unknown keys only
UNKNOWN_ONLY = "AND reconcile_due_at IS NOT NULL AND status = 'unknown'"
KEYS_PAGE = (
    """
WITH window_ AS MATERIALIZED (
    SELECT tenant, left(key, 300) AS key_shown, length(key) AS key_length, key, status,
           attempt, recovery_point, created_at, updated_at, expires_at,
           """
    + LEASE
    + """,
           reconcile_attempts, response_status,
           status = 'unknown' AND reconcile_attempts >= %(max_attempts)s AS exhausted
    FROM {table}
    WHERE (%(after)s::timestamptz IS NULL OR created_at {cmp}= %(after)s)
      AND (%(after)s::timestamptz IS NULL
           OR (created_at, tenant, key) {cmp} (%(after)s, %(after_tenant)s, %(after_key)s))
      AND (%(older_than)s::interval IS NULL OR created_at <= now() - %(older_than)s)
      {unknown_only}
    ORDER BY created_at {order}, tenant {order}, key {order}
    LIMIT %(window)s
)
SELECT *, created_at AS cursor_at FROM window_
WHERE (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
  AND (%(prefix)s::text IS NULL OR left(key, length(%(prefix)s)) = %(prefix)s)
  AND (NOT %(exhausted)s OR exhausted)
ORDER BY created_at {order}, tenant {order}, key {order}
LIMIT %(limit)s
"""
)

# The last row of the window: where the next page starts when this one found too few.
WINDOW_END = """
SELECT created_at, tenant, key FROM {table}
WHERE (%(after)s::timestamptz IS NULL OR created_at {cmp}= %(after)s)
  AND (%(after)s::timestamptz IS NULL
       OR (created_at, tenant, key) {cmp} (%(after)s, %(after_tenant)s, %(after_key)s))
  AND (%(older_than)s::interval IS NULL OR created_at <= now() - %(older_than)s)
  {unknown_only}
ORDER BY created_at {order}, tenant {order}, key {order}
OFFSET %(window)s - 1 LIMIT 1
"""

# One key, with a preview of its body only (the body may be a megabyte).
KEY_DETAIL = (
    """
SELECT tenant, key, status, attempt, generation, recovery_point,
       encode(fingerprint, 'hex') AS fingerprint, created_at, updated_at,
       """
    + LEASE
    + """,
       expires_at, reconcile_attempts, reconcile_due_at, reconcile_error,
       response_status, response_headers,
       -- a sealed response (IDEMPOTENCY_ENCRYPTOR) is opened whole, then cut
       CASE WHEN response_headers = '{{"sealed": 1}}'::jsonb THEN response_body
            ELSE substring(response_body FROM 1 FOR %(preview)s) END AS body_preview,
       octet_length(response_body) AS body_length,
       request, CASE WHEN request = '{{"sealed":1}}' THEN request_body END AS request_sealed,
       octet_length(request_body) AS request_body_length,
       status = 'unknown' AND reconcile_attempts >= %(max_attempts)s AS exhausted,
       owner_id, owner_host, owner_pid, """
    + OWNER_STATE
    + """ AS owner_state
FROM {table} WHERE tenant = %(tenant)s AND key = %(key)s
"""
)

JOBS_PAGE = """
SELECT id::text, tenant, left(key, 300) AS key, name, attempts, dead, due_at, last_error,
       created_at
FROM {jobs}
WHERE (CASE WHEN %(kind)s = 'dead' THEN dead ELSE NOT dead AND last_error IS NOT NULL END)
  AND (%(name)s::text IS NULL OR name = %(name)s)
  AND (%(after)s::uuid IS NULL OR (created_at, id) > (%(after_at)s, %(after)s::uuid))
ORDER BY created_at, id
LIMIT %(limit)s
"""

JOB_DETAIL = """
SELECT id::text, tenant, key, name, payload, attempts, dead, due_at, last_error, created_at
FROM {jobs} WHERE id = %(id)s::uuid
"""

# What is left of an expired key (SPEC §24): its tombstone, and until when it is kept.
TOMBSTONE = """
SELECT first_status, completed_at, expired_at,
       expired_at + make_interval(secs => %(tombstone_ttl)s) AS kept_until
FROM {tombstones} WHERE tenant = %(tenant)s AND key = %(key)s
"""

AUDIT_PAGE = """
SELECT id, at, actor, action, tenant, key, job_id, status_before, status_after, reason,
       job_name, left(payload, %(preview)s) AS payload, length(payload) AS payload_length
FROM {audit}
WHERE (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
  AND (%(key)s::text IS NULL OR key = %(key)s)
  AND (%(before)s::bigint IS NULL OR id < %(before)s)
ORDER BY id DESC
LIMIT %(limit)s
"""

# -- changing, each with its audit row ---------------------------------------------------

_AUDIT_KEYS = """
, audited AS (
    INSERT INTO {audit} (actor, action, tenant, key, status_before, status_after, reason)
    SELECT %(actor)s, %(action)s, tenant, key, before, after, %(reason)s FROM changed
)
SELECT tenant, key FROM changed
"""

# Only an unknown key, as idempotency-resolve and resolve() (RESOLVE_KEY's rules).
RESOLVE = (
    "WITH changed AS ("
    + RESOLVE_KEY
    + " RETURNING tenant, key, 'unknown'::text AS before, status AS after)"
    + _AUDIT_KEYS
)

# Forget: a finished key is deleted, so its key may be used afresh. A key in
# processing (a live attempt) or unknown (nobody knows what happened) is not.
FORGET = (
    """
WITH changed AS (
    DELETE FROM {table}
    WHERE tenant = %(tenant)s AND key = %(key)s AND status IN ('completed', 'retryable')
      AND (%(seen_attempt)s::integer IS NULL
           OR (generation, attempt, status)
              = (%(seen_generation)s, %(seen_attempt)s, %(seen_status)s))
    RETURNING tenant, key, status AS before, 'deleted'::text AS after
)"""
    + _AUDIT_KEYS
)

# A key's tombstone (SPEC §24), forgotten so that the key may be used afresh; only when the
# operator saw no particular version of the key (a tombstone has none).
FORGET_TOMBSTONE = (
    """
WITH changed AS (
    DELETE FROM {tombstones}
    WHERE tenant = %(tenant)s AND key = %(key)s AND %(seen_attempt)s::integer IS NULL
    RETURNING tenant, key, 'expired'::text AS before, 'deleted'::text AS after
)"""
    + _AUDIT_KEYS
)

# Re-arm exhausted keys: reconciliation starts again, due at once. One key, or up to
# %(batch)s of a filter (the keys list's filters).
REARM = (
    """
WITH chosen AS (
    SELECT tenant, key FROM {table}
    WHERE status = 'unknown' AND reconcile_due_at IS NOT NULL
      AND reconcile_attempts >= %(max_attempts)s
      AND (%(key)s::text IS NULL OR (tenant, key) = (%(tenant)s, %(key)s))
      AND (%(key)s::text IS NOT NULL OR %(tenant)s::text IS NULL OR tenant = %(tenant)s)
      AND (%(prefix)s::text IS NULL OR left(key, length(%(prefix)s)) = %(prefix)s)
      AND (%(older_than)s::interval IS NULL OR created_at <= now() - %(older_than)s)
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), changed AS (
    UPDATE {table} AS k
    SET reconcile_attempts = 0, reconcile_due_at = now(), reconcile_error = NULL,
        updated_at = now()
    FROM chosen WHERE (k.tenant, k.key) = (chosen.tenant, chosen.key)
      AND k.status = 'unknown' AND k.reconcile_attempts >= %(max_attempts)s
      AND (%(seen_attempt)s::integer IS NULL
           OR (k.generation, k.attempt) = (%(seen_generation)s, %(seen_attempt)s))
    RETURNING k.tenant, k.key, 'exhausted'::text AS before, 'unknown'::text AS after
)"""
    + _AUDIT_KEYS
)

# The jobs an operator acts on: failing (their last hand-over failed) or dead, one by
# id or those of a filter (kind: dead, failing or any; a name), %(batch)s at a time.
_CHOSEN_JOBS = """
WITH chosen AS (
    SELECT id, dead FROM {jobs}
    WHERE (dead OR last_error IS NOT NULL)
      AND (%(id)s::uuid IS NULL OR id = %(id)s::uuid)
      AND (%(name)s::text IS NULL OR name = %(name)s)
      AND (%(kind)s::text = 'any' OR dead = (%(kind)s::text = 'dead'))
      AND (%(seen_attempts)s::integer IS NULL
           OR (attempts, dead) = (%(seen_attempts)s, %(seen_dead)s::boolean))
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)"""

_AUDIT_JOBS = """
, audited AS (
    INSERT INTO {audit} (actor, action, tenant, key, job_id, status_before, status_after,
                         reason, job_name, payload)
    SELECT %(actor)s, %(action)s, tenant, key, id, before, after, %(reason)s, name, payload
    FROM changed
)
SELECT id FROM changed
"""

# Retry: due at once, attempts back to 0, no longer dead.
RETRY_JOBS = (
    _CHOSEN_JOBS
    + """, changed AS (
    UPDATE {jobs} AS j
    SET due_at = now(), attempts = 0, dead = false, last_error = NULL
    FROM chosen WHERE j.id = chosen.id
    RETURNING j.tenant, j.key, j.id::text, CASE WHEN chosen.dead THEN 'dead' ELSE 'failing' END
              AS before, 'due'::text AS after, j.name, NULL::text AS payload
)"""
    + _AUDIT_JOBS
)

# Discard: deleted; the audit row keeps its name and payload.
DISCARD_JOBS = (
    _CHOSEN_JOBS
    + """, changed AS (
    DELETE FROM {jobs} AS j USING chosen WHERE j.id = chosen.id
    RETURNING j.tenant, j.key, j.id::text, CASE WHEN j.dead THEN 'dead' ELSE 'failing' END
              AS before, 'discarded'::text AS after, j.name, j.payload
)"""
    + _AUDIT_JOBS
)

# What a bulk action would change, counted before it does (capped like the overview).
EXHAUSTED_OF_FILTER = """{table}
WHERE status = 'unknown' AND reconcile_due_at IS NOT NULL AND reconcile_attempts >= %(max_attempts)s
  AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
  AND (%(prefix)s::text IS NULL OR left(key, length(%(prefix)s)) = %(prefix)s)
  AND (%(older_than)s::interval IS NULL OR created_at <= now() - %(older_than)s)"""

JOBS_OF_FILTER = """{jobs}
WHERE (dead OR last_error IS NOT NULL)
  AND (%(name)s::text IS NULL OR name = %(name)s)
  AND (%(kind)s::text = 'any' OR dead = (%(kind)s::text = 'dead'))"""
