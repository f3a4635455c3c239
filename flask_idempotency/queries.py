"""Every SQL statement of flask-idempotency, readable top to bottom.

``{table}`` and the index names are filled in with ``psycopg.sql.Identifier``; values
are always bound parameters. :class:`~.postgres.PostgresStore` runs them.
"""

from __future__ import annotations

SCHEMA = """
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
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS {expires_index} ON {table} (expires_at)
    WHERE status IN ('completed', 'retryable');
CREATE INDEX IF NOT EXISTS {lease_index} ON {table} (locked_until)
    WHERE status = 'processing';
CREATE INDEX IF NOT EXISTS {unknown_index} ON {table} (created_at)
    WHERE status = 'unknown';
"""

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
        (tenant, key, fingerprint, status, attempt, generation, locked_until, expires_at)
    SELECT %(tenant)s, %(key)s, %(fingerprint)s, 'processing', 1,
           (extract(epoch FROM now()) * 1000000)::bigint,
           now() + %(lease)s, now() + %(ttl)s
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
        response_status = NULL, response_headers = NULL, response_body = NULL
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
# whose key was taken over, or used afresh after expiry, changes nothing.
FINISH = """
UPDATE {table}
SET status = %(status)s, locked_until = NULL, updated_at = now(),
    expires_at = now() + %(ttl)s,
    response_status = %(response_status)s,
    response_headers = %(response_headers)s,
    response_body = %(response_body)s
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
SET recovery_point = %(point)s, locked_until = now() + %(lease)s, updated_at = now()
WHERE tenant = %(tenant)s AND key = %(key)s
  AND attempt = %(attempt)s AND generation = %(generation)s AND status = 'processing'
"""

# With IDEMPOTENCY_SYNCHRONOUS_FINISH = False: this statement's own transaction commits
# without waiting for its WAL flush (set_config(..., true) lasts until its commit).
ASYNC_COMMIT = "FROM (SELECT set_config('synchronous_commit', 'off', true)) AS commit_mode"

SCHEMA_PRESENT = "SELECT count(to_regclass(name)) FROM unnest(%(names)s::text[]) AS name"

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

# Only an ``unknown`` key is resolved by hand; anything else is the extension's.
RESOLVE_KEY = """
UPDATE {table}
SET status = %(status)s, updated_at = now(), expires_at = now() + %(ttl)s, locked_until = NULL,
    response_status = %(response_status)s, response_headers = %(response_headers)s,
    response_body = %(response_body)s
WHERE tenant = %(tenant)s AND key = %(key)s AND status = 'unknown'
"""

COUNT_STUCK = """
SELECT (SELECT count(*) FROM {table} WHERE status = 'processing' AND locked_until <= now()),
       (SELECT count(*) FROM {table} WHERE status = 'unknown')
"""

COUNT_ABANDONED = """
SELECT count(*) FROM {table}
WHERE status = 'processing' AND locked_until <= now() - %(margin)s
"""
