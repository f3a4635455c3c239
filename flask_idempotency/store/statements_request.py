"""The statements a client waits on: the claim, the finish, a phase's advance, the
deferral of an ``asynchronous=True`` request and its status view.

Readable top to bottom; ``{table}`` is filled in with ``psycopg.sql.Identifier``,
values are always bound parameters. :class:`~.postgres.PostgresStore` renders each
once and runs it through its one execution path.
"""

from __future__ import annotations

from .owner import OWNED, lock_free

# The request path's statements (CLAIM, FINISH, ADVANCE) take durations as seconds
# (a float): cheaper to send than an interval.

# The claim sets a key's expiry this many seconds beyond its TTL, so that the finish of
# an attempt shorter than that keeps it (the key lives at least the TTL after its finish)
# and changes no indexed column: a HOT update (see FINISH).
FINISH_GRACE_SECONDS = 2

# When a key's row is past its life (SPEC §24), as the claims' ``seen`` reads it (here and
# on Citus): ``expired``, a key used afresh (a retryable key past its expiry; a completed
# one past its expiry and the tombstones' TTL after it, %(tombstone_ttl)s seconds), and
# ``gone``, a completed key past its expiry: answered 409 key-expired, never run again.
EXPIRY = """status = 'retryable' AND expires_at <= now()
               OR status = 'completed'
                  AND expires_at <= now() - make_interval(secs => %(tombstone_ttl)s)
               AS expired,
           status = 'completed' AND expires_at <= now() AS gone"""

# The decisions that a claim in flight has no part in, first in the claim's CASE (here and
# on Citus, statements_citus.CLAIM): a new or expired key is claimed, another payload is a
# mismatch, a completed key past its expiry is expired, a settled key is replayed, taken
# over or unknown.
SETTLED_DECISIONS = """        WHEN seen.status IS NULL OR seen.expired THEN 'claimed'
        WHEN seen.fingerprint <> %(fingerprint)s THEN 'mismatch'
        WHEN seen.gone THEN 'expired'
        WHEN seen.status = 'completed' THEN 'replay'
        WHEN seen.status = 'retryable' THEN 'taken_over'
        WHEN seen.status = 'unknown' THEN 'unknown'
"""

# A claim's first look (SPEC §20 unchanged): what a key that was never used, or one that is
# settled, needs, at the least a statement can do. A key without a row (nor a tombstone
# in its TTL, SPEC §24) is inserted under its advisory lock by a plain INSERT (no
# speculative insertion: no ON CONFLICT and its confirmation record, 48 bytes of WAL per
# new key); a completed key with this fingerprint is replayed, another fingerprint is a
# mismatch, a completed key past its expiry (or a tombstone) is expired, each decided as
# CLAIM's SETTLED_DECISIONS would. Anything else (a claim in flight, a retryable or unknown
# key, a key to be used afresh after its expiry, a lock a twin holds) answers no decision,
# and the caller sends CLAIM. Its row has CLAIM's columns. A twin whose row committed
# between this statement's snapshot and its INSERT makes it fail with a unique violation
# (nothing written): the caller sends CLAIM, which sees that row. The lock is asked only
# when the row is absent (CASE: evaluated in order, whatever the planner prefers). A request
# %(stale)s (its client first sent it longer ago than the TTL: Repeatability-First-Sent)
# whose key has neither row nor tombstone is expired too, never inserted: past the
# tombstones' horizon nothing says it did not run.
CLAIM_FIRST = (
    """
WITH seen AS (
    SELECT status, fingerprint, attempt, response_status, response_headers, response_body,
           extract(epoch FROM expires_at - now()) AS expires_in, expires_at, updated_at,
           """
    + EXPIRY
    + """
    FROM {table} WHERE tenant = %(tenant)s AND key = %(key)s
), buried AS (
    SELECT fingerprint, first_status, completed_at, expired_at FROM {tombstones}
    WHERE tenant = %(tenant)s AND key = %(key)s
      AND expired_at > now() - make_interval(secs => %(tombstone_ttl)s)
), claimed AS (
    INSERT INTO {table}
        (tenant, key, fingerprint, status, attempt, generation, locked_until, expires_at,
         request, request_body, on_abandoned, ttl_seconds,
         owner_id, owner_claim, owner_host, owner_pid)
    SELECT %(tenant)s, %(key)s, %(fingerprint)s, 'processing', 1, now.us,
           now() + make_interval(secs => %(lease)s),
           now() + make_interval(secs => %(ttl)s + """
    + str(FINISH_GRACE_SECONDS)
    + """),
           %(request)s, %(request_body)s, %(on_abandoned)s, %(ttl)s,
           %(owner)s::bigint, now.us + 1, %(owner_host)s::text, %(owner_pid)s::integer
    FROM (SELECT (extract(epoch FROM now()) * 1000000)::bigint AS us) AS now
    WHERE CASE WHEN EXISTS (SELECT FROM seen) OR EXISTS (SELECT FROM buried)
                    OR %(stale)s THEN false
               ELSE pg_try_advisory_xact_lock(%(lock_id)s::bigint) END
    RETURNING attempt, generation, recovery_point
)
SELECT CASE WHEN claimed.attempt IS NOT NULL THEN 'claimed'
            WHEN seen.expired THEN NULL
            WHEN coalesce(seen.fingerprint, buried.fingerprint) <> %(fingerprint)s
                THEN 'mismatch'
            WHEN seen.gone OR buried.fingerprint IS NOT NULL THEN 'expired'
            WHEN seen.status = 'completed' THEN 'replay'
            WHEN seen.status IS NULL AND %(stale)s THEN 'expired' END,
       claimed.attempt, claimed.generation, claimed.recovery_point, 0, seen.status,
       seen.attempt, coalesce(seen.response_status, buried.first_status),
       seen.response_headers, seen.response_body, seen.expires_in,
       coalesce(seen.expires_at, buried.expired_at), NULL::float8, NULL::float8, NULL::bigint,
       coalesce(seen.updated_at, buried.completed_at)
FROM (VALUES (1)) AS one (x) LEFT JOIN seen ON true LEFT JOIN buried ON true
LEFT JOIN claimed ON true{commit_mode}
"""
)

# Reads the row with the statement's snapshot and decides; only when the request
# must run the view does it take the advisory lock and write. The write is fenced
# by what was read (attempt, generation, status): a row that changed, or appeared,
# after the snapshot makes the write a no-op and the request a 409, never a second
# owner. A zero-row INSERT takes no transaction id, so a replay writes no WAL.
CLAIM = (
    """
WITH seen AS (
    SELECT status, fingerprint, attempt, generation, recovery_point, on_abandoned,
           locked_until <= now() AS lease_over, updated_at,
           """
    + EXPIRY
    + """,
           extract(epoch FROM expires_at - now()) AS expires_in, expires_at,
           response_status, response_headers, response_body,
           extract(epoch FROM now() - updated_at) AS idle_for,
           extract(epoch FROM locked_until - now()) AS lease_left,
           owner_id,
           -- the owner lock speaks for this claim in its lease (SPEC §20, owner.OWNED)
           status = 'processing' AND locked_until > now() AND """
    + OWNED
    + """ AS owned
    FROM {table} WHERE tenant = %(tenant)s AND key = %(key)s
), owner AS (
    -- the owner lock, looked at only when this claim meets another's in flight: free
    -- (true) means its session ended. Free twice, GRACE_SECONDS apart (the caller asks
    -- again with gone_owner), means its process is dead.
    SELECT CASE WHEN seen.owned AND NOT seen.fingerprint <> %(fingerprint)s
                THEN """
    + lock_free("seen.owner_id")
    + """ END AS free
    FROM seen
), intent AS (
    SELECT CASE
"""
    + SETTLED_DECISIONS
    + """        -- the policy recorded by the claim that was abandoned, not this request's
        -- route's (a deploy may have changed it); none recorded: this route's
        WHEN seen.lease_over OR (owner.free AND seen.owner_id = %(gone_owner)s::bigint) THEN
            CASE coalesce(seen.on_abandoned, %(on_abandoned)s::text)
                WHEN 'unknown' THEN 'marked_unknown' ELSE 'taken_over' END
        ELSE 'in_progress'
    END AS decision,
    coalesce(NOT seen.lease_over AND owner.free AND seen.owner_id = %(gone_owner)s::bigint,
             false) AS owner_dead
    FROM (VALUES (1)) AS one (x) LEFT JOIN seen ON true LEFT JOIN owner ON true{commit_mode}
), lock AS (
    SELECT pg_try_advisory_xact_lock(%(lock_id)s::bigint) AS granted
    FROM intent WHERE decision IN ('claimed', 'taken_over', 'marked_unknown')
), claimed AS (
    INSERT INTO {table} AS k
        (tenant, key, fingerprint, status, attempt, generation, locked_until, expires_at,
         request, request_body, on_abandoned, ttl_seconds,
         owner_id, owner_claim, owner_host, owner_pid)
    SELECT %(tenant)s, %(key)s, %(fingerprint)s, 'processing', 1,
           (extract(epoch FROM now()) * 1000000)::bigint,
           now() + make_interval(secs => %(lease)s),
           now() + make_interval(secs => %(ttl)s + """
    + str(FINISH_GRACE_SECONDS)
    + """),
           %(request)s, %(request_body)s, %(on_abandoned)s, %(ttl)s,
           %(owner)s::bigint, (extract(epoch FROM now()) * 1000000)::bigint + 1,
           %(owner_host)s::text, %(owner_pid)s::integer
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
        request = excluded.request, request_body = excluded.request_body,
        on_abandoned = excluded.on_abandoned, ttl_seconds = excluded.ttl_seconds,
        owner_id = excluded.owner_id, owner_host = excluded.owner_host,
        owner_pid = excluded.owner_pid,
        owner_claim = CASE WHEN (SELECT decision FROM intent) = 'claimed'
                           THEN excluded.owner_claim ELSE k.generation + k.attempt + 1 END
    WHERE (k.attempt, k.generation, k.status)
        = (SELECT attempt, generation, status FROM seen)
      -- a phase that committed meanwhile renewed the lease: the owner is alive (its
      -- owner's death is the other reason to take a claim in flight over)
      AND (k.status <> 'processing' OR k.locked_until <= now()
           OR (SELECT owner_dead FROM intent))
    RETURNING k.attempt, k.generation, k.recovery_point
), marked AS (
    UPDATE {table} AS k
    SET status = 'unknown', locked_until = NULL, updated_at = now(), reconcile_due_at = now()
    FROM lock, seen
    WHERE lock.granted AND (SELECT decision FROM intent) = 'marked_unknown'
      AND k.tenant = %(tenant)s AND k.key = %(key)s AND k.status = 'processing'
      AND k.attempt = seen.attempt AND k.generation = seen.generation
    RETURNING k.attempt
)
SELECT intent.decision, claimed.attempt, claimed.generation, claimed.recovery_point,
       (SELECT count(*) FROM marked), seen.status, seen.attempt,
       seen.response_status, seen.response_headers, seen.response_body, seen.expires_in,
       seen.expires_at, seen.idle_for, seen.lease_left,
       CASE WHEN intent.decision = 'in_progress' AND owner.free
                 AND %(gone_owner)s::bigint IS NULL THEN seen.owner_id END AS free_owner,
       seen.updated_at
FROM intent
LEFT JOIN owner ON true
LEFT JOIN claimed ON true
LEFT JOIN seen ON true
"""
)

# The one UPDATE that ends an attempt. Fenced by (attempt, generation): an attempt
# whose key was taken over, or used afresh after expiry, changes nothing. A completed
# key no longer needs its stored request (complete=True): it is dropped at once.
#
# The common end (a completed key of a route without complete=True) changes no indexed
# column, so it is a HOT update (ddl.INDEXES): a completed key keeps its claim's
# locked_until (read only while processing), and expires_at, set by the claim
# FINISH_GRACE_SECONDS beyond the TTL, moves only for an attempt that took longer (the
# key is always kept at least the TTL after its finish). An unknown key becomes due for the
# reconciler (reconcile_due_at set: unknown_due_idx finds it).
FINISH = """
UPDATE {table}
SET status = %(status)s,
    locked_until = CASE WHEN %(status)s::text = 'completed' THEN locked_until END,
    updated_at = now(),
    expires_at = greatest(expires_at, now() + make_interval(secs => %(ttl)s)),
    response_status = %(response_status)s,
    response_headers = %(response_headers)s,
    response_body = %(response_body)s,
    request = CASE WHEN %(status)s::text = 'completed' THEN NULL ELSE request END,
    request_body = CASE WHEN %(status)s::text = 'completed' THEN NULL ELSE request_body END,
    reconcile_due_at = CASE WHEN %(status)s::text = 'unknown' THEN now() END,
    owner_id = CASE WHEN %(status)s::text = 'completed' THEN owner_id END,
    owner_claim = CASE WHEN %(status)s::text = 'completed' THEN owner_claim END,
    owner_host = CASE WHEN %(status)s::text = 'completed' THEN owner_host END,
    owner_pid = CASE WHEN %(status)s::text = 'completed' THEN owner_pid END
{commit_mode}
WHERE tenant = %(tenant)s AND key = %(key)s
  AND attempt = %(attempt)s AND generation = %(generation)s
  AND status <> 'completed'
RETURNING {notify}, expires_at
"""

# FINISH of the common end, a completed key, with its CASEs decided: the same columns
# written with the same values, none of them computed per status.
COMPLETE = """
UPDATE {table}
SET status = 'completed',
    updated_at = now(),
    expires_at = greatest(expires_at, now() + make_interval(secs => %(ttl)s)),
    response_status = %(response_status)s,
    response_headers = %(response_headers)s,
    response_body = %(response_body)s,
    request = NULL, request_body = NULL, reconcile_due_at = NULL
{commit_mode}
WHERE tenant = %(tenant)s AND key = %(key)s
  AND attempt = %(attempt)s AND generation = %(generation)s
  AND status <> 'completed'
RETURNING {notify}, expires_at
"""

# A view's answer with a release status (IDEMPOTENCY_RELEASE_STATUSES) to a fresh
# claim: the key is left as if never used (SPEC §18), its row deleted, so the next
# request under it, with any body, runs as the first and binds its own fingerprint and
# generation. Fenced like the finish, and only while nothing committed under the
# attempt (no phase: recovery_point 'started'); a key with a history (a takeover) keeps
# its row (ending.ending_of).
FORGET = """
DELETE FROM {table}
WHERE tenant = %(tenant)s AND key = %(key)s
  AND attempt = %(attempt)s AND generation = %(generation)s
  AND status = 'processing' AND recovery_point = 'started'
RETURNING {notify}
"""

# Whether this attempt's finish committed as completed: a finish sent again after its
# connection died finds its own answer here, where a zombie attempt finds nothing.
FINISHED = """
SELECT expires_at FROM {table}
WHERE tenant = %(tenant)s AND key = %(key)s
  AND attempt = %(attempt)s AND generation = %(generation)s AND status = 'completed'
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

# With IDEMPOTENCY_SYNCHRONOUS_CLAIM = False: the same for the claim's own transaction
# (never for a transactional view's claim, whose transaction is the view's). Evaluated
# once, with the decision, whatever the decision is.
ASYNC_CLAIM = " CROSS JOIN (SELECT set_config('synchronous_commit', 'off', true)) AS commit_mode"

# Appended to a fenced UPDATE named ``ended`` (the finish, or a phase's advance): the
# jobs are inserted only if that UPDATE changed the key, in the same statement, so a
# fenced or rolled-back attempt stages nothing and staging adds no round trip.
# An ordered job's place (seq) comes after every ordered job of its key still in the
# table, in the order of the stage() calls. Only the attempt that owns the key inserts
# jobs, one statement after another, each holding the key's row lock until it commits:
# so a key's ordered jobs are numbered in the order they commit (store/ddl.py).
STAGE_JOBS = """
, staged AS (
    INSERT INTO {jobs} (id, tenant, key, name, payload, traceparent, seq)
    SELECT job.id, %(tenant)s, %(key)s, job.name, job.payload, job.traceparent,
           CASE WHEN job.ordered THEN last.seq + job.n END
    FROM unnest(%(job_ids)s::uuid[], %(job_names)s::text[], %(job_payloads)s::text[],
                %(job_traceparents)s::text[], %(job_ordered)s::boolean[])
             WITH ORDINALITY AS job (id, name, payload, traceparent, ordered, n),
         (SELECT coalesce(max(seq), 0) AS seq FROM {jobs}
          WHERE tenant = %(tenant)s AND key = %(key)s AND seq IS NOT NULL) AS last
    WHERE EXISTS (SELECT FROM ended)
)
SELECT * FROM ended
"""


# The request that claimed the key hands it to the background instead of running the
# view: no lease, and its attempt given back, so the run that takes it over is the
# attempt the client's own would have been. Fenced like the finish. Its owner is cleared
# (SPEC §20): with the attempt given back, owner_claim would name the run that takes it over
# (generation + attempt again), and a run by a release that records no owner (fe789f9's
# completer) would be judged by this request's process, taken over once that one is gone.
DEFER = """
UPDATE {table}
SET locked_until = NULL, attempt = attempt - 1, updated_at = now(),
    owner_id = NULL, owner_claim = NULL, owner_host = NULL, owner_pid = NULL
WHERE tenant = %(tenant)s AND key = %(key)s AND status = 'processing'
  AND attempt = %(attempt)s AND generation = %(generation)s
"""

# The Location view of an asynchronous key: what it answers (202, the stored response,
# or the unknown outcome), for the tenant that asks.
KEY_STATUS = """
SELECT status, response_status, response_headers, response_body, expires_at
FROM {table} WHERE tenant = %(tenant)s AND key = %(key)s
"""


# The owner's renewal (SPEC §20): the leases of its claims in flight, one statement per
# lease third for all of them, each for its route's lease. Fenced like the finish, and by
# the owner (a claim whose owner was cleared, expire_lease in tests, is let go); a row
# another statement holds locked right now (a phase committing) is skipped, never waited
# for. updated_at stays: it is the claim's last sign of progress (Retry-After), and the
# claim's time against the server's start.
RENEW = """
UPDATE {table} AS k SET locked_until = now() + make_interval(secs => mine.lease)
FROM (
    SELECT k.tenant, k.key, held.lease
    FROM unnest(%(tenants)s::text[], %(keys)s::text[], %(attempts)s::integer[],
                %(generations)s::bigint[], %(leases)s::float8[])
             AS held (tenant, key, attempt, generation, lease)
    JOIN {table} AS k ON (k.tenant, k.key, k.attempt, k.generation)
                       = (held.tenant, held.key, held.attempt, held.generation)
    WHERE k.status = 'processing' AND k.locked_until IS NOT NULL AND k.owner_id = %(owner)s
    FOR UPDATE OF k SKIP LOCKED
) AS mine
WHERE k.tenant = mine.tenant AND k.key = mine.key
"""

# An owner whose lock turned out not to be its own session's (a transaction pooler): its
# claims in flight are judged by their lease from now on (owner_claim cleared; RENEW goes
# on renewing them by owner_id).
DISOWN = """
UPDATE {table} AS k SET owner_claim = NULL
FROM unnest(%(tenants)s::text[], %(keys)s::text[], %(attempts)s::integer[],
            %(generations)s::bigint[]) AS held (tenant, key, attempt, generation)
WHERE (k.tenant, k.key, k.attempt, k.generation)
    = (held.tenant, held.key, held.attempt, held.generation)
  AND k.owner_id = %(owner)s
"""

# A claim of this owner whose answer was lost (SPEC §20: the statement was sent, its
# connection died, its result is unknown; the request answered 503 or 409 and ran no view)
# is handed back as soon as the database answers again, by the owner's renewals' thread.
# Only a 'processing' row that names this owner and was written by its claim (owner_claim)
# and that none of the owner's claims in flight holds (attempts, generations: the claims it
# holds of this key, held by the owner.Owner and never sent here while one of the key is
# being sent). Taken under the key's advisory lock, as a claim is: a claim of the key in
# flight right now (a transactional view's, held for its whole transaction) makes it wait
# for a later tick. A new key goes as FORGET leaves it (deleted); a takeover keeps its row,
# its lease ended at once and its owner_claim cleared, so that the next request (or the
# completer) acts on it by its recorded on_abandoned.
HAND_BACK = """
WITH lock AS (
    SELECT pg_try_advisory_xact_lock(%(lock_id)s::bigint) AS granted
), lost AS (
    SELECT k.attempt = 1 AND k.recovery_point = 'started' AS fresh
    FROM {table} AS k, lock
    WHERE lock.granted AND k.tenant = %(tenant)s AND k.key = %(key)s
      AND k.status = 'processing' AND k.owner_id = %(owner)s::bigint
      AND k.owner_claim = k.generation + k.attempt
      AND (k.attempt, k.generation) NOT IN (
          SELECT held.attempt, held.generation
          FROM unnest(%(attempts)s::integer[], %(generations)s::bigint[])
              AS held (attempt, generation))
    FOR UPDATE OF k
), forgotten AS (
    DELETE FROM {table} AS k USING lost
    WHERE lost.fresh AND k.tenant = %(tenant)s AND k.key = %(key)s
    RETURNING 1
), ended AS (
    UPDATE {table} AS k SET locked_until = now(), owner_claim = NULL
    FROM lost
    WHERE NOT lost.fresh AND k.tenant = %(tenant)s AND k.key = %(key)s
    RETURNING 1
)
SELECT lock.granted, (SELECT count(*) FROM forgotten), (SELECT count(*) FROM ended),
       CASE WHEN EXISTS (SELECT FROM lost) THEN {notify} END
FROM lock
"""
