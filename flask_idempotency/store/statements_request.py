"""Every SQL statement of flask-idempotency, readable top to bottom.

``{table}`` and the index names are filled in with ``psycopg.sql.Identifier``; values
are always bound parameters. :class:`~.postgres.PostgresStore` runs them.
"""

from __future__ import annotations

# The keys table as this release creates it. Columns added since the 0.1.0 table
# are in UPGRADE_COLUMNS too: schema.py adds them to an older table.
TABLE = """
CREATE TABLE IF NOT EXISTS {table} (
    tenant text NOT NULL,
    key text NOT NULL,
    fingerprint bytea NOT NULL,
    status text NOT NULL
        CHECK (status IN ('processing', 'completed', 'retryable', 'unknown')),
    attempt integer NOT NULL DEFAULT 1,
    generation bigint NOT NULL,
    recovery_point text NOT NULL DEFAULT 'started',
    locked_until timestamptz,
    response_status smallint,
    response_headers jsonb,
    response_body bytea,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    request text,
    request_body bytea,
    reconcile_attempts integer NOT NULL DEFAULT 0,
    reconcile_due_at timestamptz,
    reconcile_error text,
    PRIMARY KEY (tenant, key)
) WITH ({storage})
"""

#: the keys table's autovacuum settings. Every row expires, so a busy table is mostly
#: rows on their way out: at PostgreSQL's default (a vacuum once 20 % of the rows are
#: dead) the space the cleaner frees is reused only after a long wait, and a table of
#: 10 million keys grows by 2 million rows' worth before its first vacuum. At 2 % it
#: levels off near its live size. An earlier table gets the settings it lacks from
#: ``flask idempotency-init`` (run by the table's owner); settings already on the
#: table are the operator's and are kept.
STORAGE = {
    "autovacuum_vacuum_scale_factor": "0.02",
    "autovacuum_vacuum_threshold": "1000",
}

#: columns added since the 0.1.0 table, with their type and constant default, so that
#: ``ADD COLUMN`` only changes the catalog (no table rewrite)
UPGRADE_COLUMNS = (
    ("request", "text"),  # the stored request of a complete=True claim (JSON text)
    ("request_body", "bytea"),
    ("reconcile_attempts", "integer NOT NULL DEFAULT 0"),  # undecided looks so far
    ("reconcile_due_at", "timestamptz"),  # the next look (NULL: due now)
    ("reconcile_error", "text"),  # the last reconciler error
)

#: the keys table's indexes, by the suffix of their name: what follows ``ON``
INDEXES = {
    "expires_idx": "{table} (expires_at) WHERE status IN ('completed', 'retryable')",
    "lease_idx": "{table} (locked_until) WHERE status = 'processing'",
    "unknown_idx": "{table} (created_at) WHERE status = 'unknown'",
    # the completer's due keys: only claims of complete=True routes not completed yet
    "complete_idx": "{table} (updated_at) WHERE request IS NOT NULL",
}

CREATE_INDEX = "CREATE INDEX IF NOT EXISTS {name} ON "
# Outside a transaction: builds without blocking writes; a failed build leaves an
# INVALID index, which is dropped (also concurrently) and built again.
CREATE_INDEX_CONCURRENTLY = "CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON "
DROP_INDEX_CONCURRENTLY = "DROP INDEX CONCURRENTLY IF EXISTS {name}"

# A column added with ADD COLUMN waits for ACCESS EXCLUSIVE only briefly: a long
# transaction on the table makes it give up (and try again) rather than queue every
# claim behind it.
ADD_COLUMN = "ADD COLUMN IF NOT EXISTS {column} "
SET_STORAGE = "ALTER TABLE {table} SET ({storage})"
LOCK_TIMEOUT = "SELECT set_config('lock_timeout', %(timeout)s, true)"

# What exists: missing objects (by their to_regclass name), the keys table's columns,
# its invalid indexes (a concurrent build that failed), its storage parameters, and
# whether this role may change them (the table's owner, or a member of its role).
SCHEMA_STATE = """
SELECT ARRAY(SELECT name FROM unnest(%(names)s::text[]) AS name WHERE to_regclass(name) IS NULL),
       ARRAY(SELECT attname::text FROM pg_attribute
             WHERE attrelid = to_regclass(%(table)s) AND attnum > 0 AND NOT attisdropped),
       ARRAY(SELECT c.relname::text FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
             WHERE i.indrelid = to_regclass(%(table)s) AND NOT i.indisvalid),
       coalesce((SELECT reloptions FROM pg_class WHERE oid = to_regclass(%(table)s)), '{}'),
       coalesce((SELECT pg_has_role(relowner, 'USAGE') FROM pg_class
                 WHERE oid = to_regclass(%(table)s)), false)
"""

# The request path's statements (CLAIM, FINISH, ADVANCE) take durations as seconds
# (a float): cheaper to send than an interval.

# Reads the row with the statement's snapshot and decides; only when the request
# must run the view does it take the advisory lock and write. The write is fenced
# by what was read (attempt, generation, status): a row that changed, or appeared,
# after the snapshot makes the write a no-op and the request a 409, never a second
# owner. A zero-row INSERT takes no transaction id, so a replay writes no WAL.
CLAIM = """
WITH seen AS (
    SELECT status, fingerprint, attempt, generation, recovery_point,
           locked_until <= now() AS lease_over,
           status IN ('completed', 'retryable') AND expires_at <= now() AS expired,
           extract(epoch FROM expires_at - now()) AS expires_in,
           response_status, response_headers, response_body
    FROM {table} WHERE tenant = %(tenant)s AND key = %(key)s
), intent AS (
    SELECT CASE
        WHEN seen.status IS NULL OR seen.expired THEN 'claimed'
        WHEN seen.fingerprint <> %(fingerprint)s THEN 'mismatch'
        WHEN seen.status = 'completed' THEN 'replay'
        WHEN seen.status = 'retryable' THEN 'taken_over'
        WHEN seen.status = 'unknown' THEN 'unknown'
        WHEN seen.lease_over THEN %(on_abandoned)s::text
        ELSE 'in_progress'
    END AS decision
    FROM (VALUES (1)) AS one (x) LEFT JOIN seen ON true
), lock AS (
    SELECT pg_try_advisory_xact_lock(%(lock_id)s::bigint) AS granted
    FROM intent WHERE decision IN ('claimed', 'taken_over', 'marked_unknown')
), claimed AS (
    INSERT INTO {table} AS k
        (tenant, key, fingerprint, status, attempt, generation, locked_until, expires_at,
         request, request_body)
    SELECT %(tenant)s, %(key)s, %(fingerprint)s, 'processing', 1,
           (extract(epoch FROM now()) * 1000000)::bigint,
           now() + make_interval(secs => %(lease)s), now() + make_interval(secs => %(ttl)s),
           %(request)s, %(request_body)s
    FROM lock, intent
    WHERE lock.granted AND intent.decision IN ('claimed', 'taken_over')
    ON CONFLICT (tenant, key) DO UPDATE SET
        status = 'processing',
        fingerprint = excluded.fingerprint,
        attempt = CASE WHEN (SELECT decision FROM intent) = 'claimed'
                       THEN 1 ELSE k.attempt + 1 END,
        generation = CASE WHEN (SELECT decision FROM intent) = 'claimed'
                          THEN excluded.generation ELSE k.generation END,
        recovery_point = CASE WHEN (SELECT decision FROM intent) = 'claimed'
                              THEN 'started' ELSE k.recovery_point END,
        created_at = CASE WHEN (SELECT decision FROM intent) = 'claimed'
                          THEN now() ELSE k.created_at END,
        locked_until = excluded.locked_until,
        expires_at = excluded.expires_at,
        updated_at = now(),
        response_status = NULL, response_headers = NULL, response_body = NULL,
        request = excluded.request, request_body = excluded.request_body
    WHERE (k.attempt, k.generation, k.status)
        = (SELECT attempt, generation, status FROM seen)
      -- a phase that committed meanwhile renewed the lease: the owner is alive
      AND (k.status <> 'processing' OR k.locked_until <= now())
    RETURNING k.attempt, k.generation, k.recovery_point
), marked AS (
    UPDATE {table} AS k
    SET status = 'unknown', locked_until = NULL, updated_at = now()
    FROM lock, seen
    WHERE lock.granted AND (SELECT decision FROM intent) = 'marked_unknown'
      AND k.tenant = %(tenant)s AND k.key = %(key)s AND k.status = 'processing'
      AND k.attempt = seen.attempt AND k.generation = seen.generation
    RETURNING k.attempt
)
SELECT intent.decision, claimed.attempt, claimed.generation, claimed.recovery_point,
       (SELECT count(*) FROM marked), seen.status, seen.attempt,
       seen.response_status, seen.response_headers, seen.response_body, seen.expires_in
FROM intent
LEFT JOIN claimed ON true
LEFT JOIN seen ON true
"""

# The one UPDATE that ends an attempt. Fenced by (attempt, generation): an attempt
# whose key was taken over, or used afresh after expiry, changes nothing. A completed
# key no longer needs its stored request (complete=True): it is dropped at once.
FINISH = """
UPDATE {table}
SET status = %(status)s, locked_until = NULL, updated_at = now(),
    expires_at = now() + make_interval(secs => %(ttl)s),
    response_status = %(response_status)s,
    response_headers = %(response_headers)s,
    response_body = %(response_body)s,
    request = CASE WHEN %(status)s::text = 'completed' THEN NULL ELSE request END,
    request_body = CASE WHEN %(status)s::text = 'completed' THEN NULL ELSE request_body END
{commit_mode}
WHERE tenant = %(tenant)s AND key = %(key)s
  AND attempt = %(attempt)s AND generation = %(generation)s
  AND status <> 'completed'
RETURNING {notify}
"""

# A recovery point commits with the phase's writes, fenced like the finish, and
# renews the lease: an attempt that makes progress is not abandoned.
ADVANCE = """
UPDATE {table}
SET recovery_point = %(point)s, locked_until = now() + make_interval(secs => %(lease)s),
    updated_at = now()
WHERE tenant = %(tenant)s AND key = %(key)s
  AND attempt = %(attempt)s AND generation = %(generation)s AND status = 'processing'
"""

# With IDEMPOTENCY_SYNCHRONOUS_FINISH = False: this statement's own transaction commits
# without waiting for its WAL flush (set_config(..., true) lasts until its commit).
ASYNC_COMMIT = "FROM (SELECT set_config('synchronous_commit', 'off', true)) AS commit_mode"

DELETE_EXPIRED = """
WITH doomed AS (
    SELECT tenant, key FROM {table}
    WHERE status IN ('completed', 'retryable') AND expires_at <= now()
    LIMIT %(batch)s FOR UPDATE SKIP LOCKED
)
DELETE FROM {table} AS k USING doomed
WHERE k.tenant = doomed.tenant AND k.key = doomed.key
"""

COUNT_EXPIRED = """
SELECT count(*) FROM {table}
WHERE status IN ('completed', 'retryable') AND expires_at <= now()
"""

MARK_ABANDONED = """
WITH stale AS (
    SELECT tenant, key FROM {table}
    WHERE status = 'processing' AND locked_until <= now() - %(margin)s
    LIMIT %(batch)s FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS k SET status = %(status)s, locked_until = NULL, updated_at = now()
FROM stale WHERE k.tenant = stale.tenant AND k.key = stale.key
"""

LIST_KEYS = """
SELECT tenant, key, status, attempt, recovery_point, now() - created_at AS age,
       locked_until, expires_at, response_status
FROM {table}
WHERE (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
  AND created_at <= now() - %(older_than)s
ORDER BY created_at
LIMIT %(limit)s
"""

SHOW_KEY = """
SELECT tenant, key, status, attempt, recovery_point, encode(fingerprint, 'hex') AS fingerprint,
       created_at, updated_at, locked_until, expires_at,
       response_status, response_headers, response_body
FROM {table} WHERE tenant = %(tenant)s AND key = %(key)s
"""

# Only an ``unknown`` key is resolved (by hand, by resolve(), by the reconciler);
# anything else is the extension's, and a completed key is never overwritten. The
# reconciler's answer is fenced by the look it answers (attempt, generation, looks).
RESOLVE_KEY = """
UPDATE {table}
SET status = %(status)s, updated_at = now(), expires_at = now() + %(ttl)s, locked_until = NULL,
    response_status = %(response_status)s, response_headers = %(response_headers)s,
    response_body = %(response_body)s,
    request = CASE WHEN %(status)s::text = 'completed' THEN NULL ELSE request END,
    request_body = CASE WHEN %(status)s::text = 'completed' THEN NULL ELSE request_body END,
    reconcile_attempts = 0, reconcile_due_at = NULL, reconcile_error = NULL
WHERE tenant = %(tenant)s AND key = %(key)s AND status = 'unknown'
  AND (%(looks)s::integer IS NULL
       OR (attempt, generation, reconcile_attempts) = (%(attempt)s, %(generation)s, %(looks)s))
"""

COUNT_STUCK = """
SELECT (SELECT count(*) FROM {table} WHERE status = 'processing' AND locked_until <= now()),
       (SELECT count(*) FROM {table} WHERE status = 'unknown'),
       (SELECT count(*) FROM {table}
        WHERE status = 'unknown' AND reconcile_attempts >= %(max_attempts)s)
"""

COUNT_ABANDONED = """
SELECT count(*) FROM {table}
WHERE status = 'processing' AND locked_until <= now() - %(margin)s
"""

# -- staged jobs (the outbox, SPEC §10) ---------------------------------------------------

# The payload is a JSON document kept as text: jsonb refuses \u0000 and lone surrogates,
# which json.dumps writes as escapes that text keeps faithfully.
JOBS_SCHEMA = """
CREATE TABLE IF NOT EXISTS {jobs} (
    id uuid PRIMARY KEY,
    tenant text NOT NULL,
    key text NOT NULL,
    name text NOT NULL,
    payload text NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    due_at timestamptz NOT NULL DEFAULT now(),
    dead boolean NOT NULL DEFAULT false,
    last_error text,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS {jobs_due_index} ON {jobs} (due_at) WHERE NOT dead;
"""

# Appended to a fenced UPDATE named ``ended`` (the finish, or a phase's advance): the
# jobs are inserted only if that UPDATE changed the key, in the same statement, so a
# fenced or rolled-back attempt stages nothing and staging adds no round trip.
STAGE_JOBS = """
, staged AS (
    INSERT INTO {jobs} (id, tenant, key, name, payload)
    SELECT job.id, %(tenant)s, %(key)s, job.name, job.payload
    FROM unnest(%(job_ids)s::uuid[], %(job_names)s::text[], %(job_payloads)s::text[])
         AS job (id, name, payload)
    WHERE EXISTS (SELECT FROM ended)
)
SELECT * FROM ended
"""

# One batch for a dispatcher: held by its row locks for as long as its transaction
# lives, so a dispatcher that dies hands its batch back at once.
DUE_JOBS = """
SELECT id::text, name, payload, tenant, key, attempts FROM {jobs}
WHERE NOT dead AND due_at <= now()
ORDER BY due_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""

DELETE_JOBS = "DELETE FROM {jobs} WHERE id = ANY(%(ids)s::uuid[])"

# A failed hand-over: the n-th failure is retried after backoff × 2^(n−1), capped; a
# job whose dispatcher failed max_attempts times is dead; a job whose name no
# dispatcher knows backs off the same way but is never dead (never dropped).
FAIL_JOBS = """
UPDATE {jobs} AS j
SET attempts = j.attempts + 1,
    last_error = failed.error,
    due_at = now() + least(%(backoff)s * 2 ^ least(j.attempts, 30), %(cap)s),
    dead = failed.countable AND j.attempts + 1 >= %(max_attempts)s
FROM unnest(%(ids)s::uuid[], %(errors)s::text[], %(countable)s::boolean[])
     AS failed (id, error, countable)
WHERE j.id = failed.id
"""

LIST_JOBS = """
SELECT id::text, tenant, key, name, attempts, dead, due_at, last_error,
       now() - created_at AS age
FROM {jobs}
WHERE dead = %(dead)s OR (NOT %(dead)s AND last_error IS NOT NULL)
ORDER BY created_at
LIMIT %(limit)s
"""
