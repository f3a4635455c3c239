"""The statements no client waits on: the completer's, the reconciler's and the
dispatcher's batches, and the operators' (clean, list, show, resolve, count).

Readable top to bottom; ``{table}`` and ``{jobs}`` are filled in with
``psycopg.sql.Identifier``, values are always bound parameters.
:class:`~.batches.Batches` and :class:`~.maintenance.Maintenance` render each once
and run it through the store's one execution path.
"""

from __future__ import annotations

from .owner import OWNED, lock_free

# -- the completer ----------------------------------------------------------------

# One batch of keys whose client evidently gave up: claims of complete=True routes
# abandoned past their lease, and retryable ones, untouched for longer than
# older_than. The batch reserves them (locked_until: a lease held by this completer,
# the fence of its takeover, and its owner: a dead completer's keys are due again at once),
# so completers on several hosts take disjoint batches; a client retry of a retryable key
# still wins at once. A key that had to be skipped is marked looked at (UNRESERVE sets
# updated_at): it waits behind the others until older_than passes again.
DUE_FOR_COMPLETION = """
WITH due AS (
    SELECT tenant, key FROM {table}
    WHERE request IS NOT NULL
      AND (status = 'retryable' AND expires_at > now() OR status = 'processing')
      AND (updated_at <= now() - %(older_than)s OR {deferred})
      -- its lease over, or held by a dead owner (a request's worker, or a completer that
      -- reserved it: the reservation leaves updated_at, so its keys are due again at once)
      AND (coalesce(locked_until, '-infinity') <= now() OR {dead_owner})
      AND (%(only_key)s::text IS NULL OR (tenant, key) = (%(only_tenant)s, %(only_key)s))
    ORDER BY updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS k SET locked_until = now() + %(hold)s,
    owner_id = %(owner)s, owner_claim = k.generation + k.attempt,
    owner_host = %(owner_host)s, owner_pid = %(owner_pid)s
FROM due WHERE k.tenant = due.tenant AND k.key = due.key
RETURNING k.tenant, k.key, k.status, k.attempt, k.generation, k.fingerprint,
          k.request, k.request_body, k.locked_until AS reserved, k.on_abandoned
"""

COUNT_DUE_FOR_COMPLETION = """
SELECT tenant, key, status, attempt FROM {table}
WHERE request IS NOT NULL AND (updated_at <= now() - %(older_than)s OR {deferred})
  AND (status = 'retryable' AND expires_at > now() OR status = 'processing')
  AND coalesce(locked_until, '-infinity') <= now()
ORDER BY updated_at
LIMIT %(limit)s
"""

# The completer takes a key over exactly as a client retry would: the next attempt,
# fenced by its reservation, under the key's advisory lock (a twin claiming the key
# right now gets 409 at once rather than waiting on the row).
TAKE_OVER = """
UPDATE {table}
SET status = 'processing', attempt = attempt + 1, locked_until = now() + %(lease)s,
    updated_at = now(), expires_at = now() + %(ttl)s + interval '2 seconds',
    response_status = NULL, response_headers = NULL, response_body = NULL,
    on_abandoned = %(on_abandoned)s, ttl_seconds = extract(epoch FROM %(ttl)s),
    owner_id = %(owner)s, owner_claim = generation + attempt + 1,
    owner_host = %(owner_host)s, owner_pid = %(owner_pid)s
WHERE tenant = %(tenant)s AND key = %(key)s AND locked_until = %(reserved)s
  AND (attempt, generation, fingerprint) = (%(attempt)s, %(generation)s, %(fingerprint)s)
  AND status IN ('retryable', 'processing')
  AND pg_try_advisory_xact_lock(%(lock_id)s::bigint)
RETURNING attempt, generation, recovery_point
"""

# A skipped key is left as it was: its reservation ends (a retryable key holds no
# lease, an abandoned claim's lease is over).
UNRESERVE = """
UPDATE {table}
SET locked_until = CASE WHEN status = 'processing' THEN now() END, updated_at = now(),
    owner_id = NULL, owner_claim = NULL
WHERE tenant = %(tenant)s AND key = %(key)s AND locked_until = %(reserved)s
  AND (attempt, generation) = (%(attempt)s, %(generation)s)
"""

# A route with ON_ABANDONED = "unknown": the abandoned claim becomes unknown, as a
# client retry would make it, and the reconciler takes it from there.
MARK_UNKNOWN = """
UPDATE {table}
SET status = 'unknown', locked_until = NULL, updated_at = now(), reconcile_due_at = now()
WHERE tenant = %(tenant)s AND key = %(key)s AND status = 'processing'
  AND (attempt, generation) = (%(attempt)s, %(generation)s) AND locked_until = %(reserved)s
"""

KEY_STATE = """
SELECT status, attempt, response_status FROM {table} WHERE tenant = %(tenant)s AND key = %(key)s
"""

# -- asynchronous=True ---------------------------------------------------------

# A key an asynchronous route deferred to the background: processing, with no lease
# (a client retry sees it in progress; no lease can run out) and due for the completer
# at once, whatever --older-than says.
# (request IS NOT NULL: asynchronous implies complete, and pending_idx finds them)
DEFERRED = "(request IS NOT NULL AND status = 'processing' AND locked_until IS NULL)"

# -- reconciliation of unknown keys ---------------------------------------------

# One batch for a reconciler: unknown keys that are due and not exhausted, reserved
# for `hold` (so reconcilers on several hosts share the work) and looked at outside
# any transaction: a provider's webhook resolving one of them never waits on a lock.
DUE_FOR_RECONCILE = """
WITH due AS (
    SELECT tenant, key FROM {table}
    WHERE status = 'unknown' AND reconcile_attempts < %(max_attempts)s
      AND (reconcile_due_at <= now() OR {dead_owner})
    ORDER BY reconcile_due_at NULLS FIRST, updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS k SET reconcile_due_at = now() + %(hold)s,
    owner_id = %(owner)s, owner_claim = k.generation + k.attempt,
    owner_host = %(owner_host)s, owner_pid = %(owner_pid)s
FROM due WHERE k.tenant = due.tenant AND k.key = due.key
RETURNING k.tenant, k.key, k.attempt, k.generation, k.recovery_point,
          k.reconcile_attempts AS looks, k.request, k.request_body
"""

# An earlier release (f804229's layout) serving beside this one marks keys unknown
# without reconcile_due_at (to it, NULL meant "due now"), where unknown_due_idx does not
# find them. While that release's index of unknown keys exists (it may still serve: it
# builds that index at its start; only flask idempotency-init drops it), each reconciler
# batch first marks them due, one probe of that index; once it is gone, a one-time
# filter makes this a no-op that reads nothing.
MARK_UNKNOWN_DUE_BESIDE = """
UPDATE {table} SET reconcile_due_at = now()
WHERE status = 'unknown' AND reconcile_due_at IS NULL
  AND to_regclass(%(retired_unknown_index)s) IS NOT NULL
"""

# An undecided look (None, or the reconciler raised): the n-th is followed by the next
# look backoff × 2^(n−1) later, by the database's clock, at most `cap` later. Fenced by
# the look it answers.
RESCHEDULE = """
UPDATE {table}
SET reconcile_attempts = reconcile_attempts + 1,
    reconcile_due_at = now() + least(%(backoff)s * 2 ^ least(reconcile_attempts, 30), %(cap)s),
    reconcile_error = %(error)s, owner_id = NULL, owner_claim = NULL
WHERE tenant = %(tenant)s AND key = %(key)s AND status = 'unknown'
  AND (attempt, generation, reconcile_attempts) = (%(attempt)s, %(generation)s, %(looks)s)
RETURNING reconcile_attempts AS looks, extract(epoch FROM reconcile_due_at - now()) AS due_in
"""

# The dead-letter list: unknown keys that had their last undecided look.
LIST_EXHAUSTED = """
SELECT tenant, key, attempt, reconcile_attempts, reconcile_error, now() - updated_at AS age
FROM {table}
WHERE status = 'unknown' AND reconcile_due_at IS NOT NULL
  AND reconcile_attempts >= %(max_attempts)s
ORDER BY updated_at
LIMIT %(limit)s
"""

# -- staged jobs (the outbox) ----------------------------------------------------------------

# One round of a dispatcher's batch: held by its row locks for as long as its
# transaction lives, so a dispatcher that dies hands its batch back at once. An ordered
# job is due only while no earlier ordered job of its key is left (failing, dead, or
# held by another dispatcher: its row is still there), one probe of the order index.
# Successors of the jobs a batch hands over come in its next rounds (NEXT_JOBS).
DUE_JOBS = """
SELECT id::text AS id, name, payload, tenant, key, attempts, traceparent,
       seq IS NOT NULL AS ordered
FROM {jobs} AS j
WHERE NOT dead AND due_at <= now()
  AND (seq IS NULL OR NOT EXISTS (
      SELECT FROM {jobs} AS earlier
      WHERE earlier.tenant = j.tenant AND earlier.key = j.key AND earlier.seq < j.seq))
ORDER BY due_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""

# The batch's next round: the successor of each ordered job it just handed over (the
# key's first ordered job left, in the batch's own view), if it is due and not dead.
# Other dispatchers still see the handed-over job, so none of them takes it.
NEXT_JOBS = """
SELECT next.id::text AS id, next.name, next.payload, next.tenant, next.key, next.attempts,
       next.traceparent, true AS ordered
FROM unnest(%(tenants)s::text[], %(keys)s::text[]) AS done (tenant, key)
CROSS JOIN LATERAL (
    SELECT * FROM {jobs} AS j
    WHERE j.tenant = done.tenant AND j.key = done.key AND j.seq IS NOT NULL
    ORDER BY j.seq
    LIMIT 1
    FOR UPDATE
) AS next
WHERE NOT next.dead AND next.due_at <= now()
LIMIT %(limit)s
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

# The dead jobs, or the failing ones: tried and failed at least once, not dead (a job
# never tried is only pending; one an operator retried starts again at 0 attempts).
LIST_JOBS = """
SELECT id::text, tenant, key, name, attempts, dead, due_at, last_error,
       now() - created_at AS age
FROM {jobs}
WHERE dead = %(dead)s AND (dead OR attempts > 0)
ORDER BY created_at
LIMIT %(limit)s
"""

# -- the operators ---------------------------------------------------------------------------

# The cleaner's batch (SPEC §24): the finished keys past their expiry deleted, a tombstone left
# of each completed key whose answer expired less than the tombstones' TTL ago (a key
# already past that leaves none), in the same statement: a claim sees the key's row or its
# tombstone, never neither. A tombstone of the same key left earlier (the key was used
# afresh once its tombstone's TTL ended, and expired again) is replaced. The deleted rows
# and the tombstones left.
BURY_EXPIRED = """
WITH doomed AS (
    SELECT tenant, key FROM {table}
    WHERE status IN ('completed', 'retryable') AND expires_at <= now()
    LIMIT %(batch)s FOR UPDATE SKIP LOCKED
), deleted AS (
    DELETE FROM {table} AS k USING doomed
    WHERE k.tenant = doomed.tenant AND k.key = doomed.key
    RETURNING k.tenant, k.key, k.fingerprint, k.status, k.response_status, k.updated_at,
              k.expires_at
), buried AS (
    INSERT INTO {tombstones} AS t
        (tenant, key, fingerprint, first_status, completed_at, expired_at)
    SELECT tenant, key, fingerprint, response_status, updated_at, expires_at FROM deleted
    WHERE status = 'completed' AND response_status IS NOT NULL
      AND expires_at > now() - make_interval(secs => %(tombstone_ttl)s)
    ON CONFLICT (tenant, key) DO UPDATE SET
        fingerprint = excluded.fingerprint, first_status = excluded.first_status,
        completed_at = excluded.completed_at, expired_at = excluded.expired_at
    RETURNING 1
)
SELECT (SELECT count(*) FROM deleted), (SELECT count(*) FROM buried)
"""

# The tombstones past their TTL, a batch at a time (their own expiry index).
DELETE_TOMBSTONES = """
DELETE FROM {tombstones} AS t USING (
    SELECT tenant, key FROM {tombstones}
    WHERE expired_at <= now() - make_interval(secs => %(tombstone_ttl)s)
    LIMIT %(batch)s FOR UPDATE SKIP LOCKED
) AS past
WHERE t.tenant = past.tenant AND t.key = past.key
"""

COUNT_EXPIRED = """
SELECT count(*) FROM {table}
WHERE status IN ('completed', 'retryable') AND expires_at <= now()
"""

# Claims whose lease ended more than margin ago, marked as the policy their claim
# recorded says (on_abandoned), or as the app-wide one for a claim of a release that
# recorded none: how many, and how many of them became unknown. A finished key keeps its claim's
# lease (the finish is a HOT update: no index knows a processing row from a finished
# one), so the sweep looks at the claims of the last ABANDONED_HORIZON (created_idx),
# and at any claim past its expiry (expiry_idx), which is one abandoned long ago: two
# index range scans (a UNION, so that the planner never prefers a scan of the table).
# 20 minutes: longer than the default lease plus the 15 minutes of the
# IdempotencyAbandonedKeys alert (contrib/), so the stuck-keys gauge still shows a claim
# abandoned for that long; the price is a look at each claim of those 20 minutes per
# sweep or scrape.
ABANDONED_HORIZON = "20 minutes"
_ABANDONED = "status = 'processing' AND locked_until <= now() - %(margin)s"
ABANDONED_KEYS = (
    "SELECT tenant, key FROM {table} WHERE created_at > now() - interval '"
    + ABANDONED_HORIZON
    + "' AND "
    + _ABANDONED
    + " UNION SELECT tenant, key FROM {table} WHERE expires_at <= now() AND "
    + _ABANDONED
)

MARK_ABANDONED = (
    """
WITH found AS (
    """
    + ABANDONED_KEYS
    + """
    UNION SELECT tenant, key FROM {table}
    WHERE created_at > now() - interval '"""
    + ABANDONED_HORIZON
    + """' AND status = 'processing' AND {dead_owner}
), stale AS (
    SELECT k.tenant, k.key FROM {table} AS k JOIN found USING (tenant, key)
    WHERE k.status = 'processing'
      AND (k.locked_until <= now() - %(margin)s OR """
    + "{dead_owner}"
    + """)
    LIMIT %(batch)s FOR UPDATE OF k SKIP LOCKED
), marked AS (
    UPDATE {table} AS k
    SET status = CASE coalesce(k.on_abandoned, %(on_abandoned)s::text)
                 WHEN 'unknown' THEN 'unknown' ELSE 'retryable' END,
        locked_until = NULL, updated_at = now(),
        reconcile_due_at = CASE coalesce(k.on_abandoned, %(on_abandoned)s::text)
                           WHEN 'unknown' THEN now() END
    FROM stale WHERE k.tenant = stale.tenant AND k.key = stale.key
    RETURNING k.status
)
SELECT count(*), count(*) FILTER (WHERE status = 'unknown') FROM marked
"""
)

# locked_until is a lease only while the key is processing (a completed key keeps
# its claim's, see FINISH)
LEASE = "CASE WHEN status = 'processing' THEN locked_until END AS locked_until"


# What a person is told of a claim's owner: 'alive' (its lock is held), 'gone' (its session
# ended: the claim is abandoned at the next look that finds it still free), 'lease' (no
# owner lock speaks for it: judged by its lease), NULL (not a claim in its lease).
OWNER_STATE = (
    "CASE WHEN status <> 'processing' OR NOT coalesce(locked_until > now(), false) THEN NULL"
    " WHEN NOT coalesce(" + OWNED + ", false) THEN 'lease'"
    " WHEN " + lock_free("owner_id") + " THEN 'gone' ELSE 'alive' END"
)

LIST_KEYS = (
    """
SELECT tenant, key, status, attempt, recovery_point, now() - created_at AS age,
       """
    + LEASE
    + """, expires_at, response_status
FROM {table}
WHERE (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
  AND created_at <= now() - %(older_than)s
ORDER BY created_at
LIMIT %(limit)s
"""
)

SHOW_KEY = (
    """
SELECT tenant, key, status, attempt, recovery_point, encode(fingerprint, 'hex') AS fingerprint,
       created_at, updated_at, """
    + LEASE
    + """, expires_at,
       response_status, response_headers, response_body
FROM {table} WHERE tenant = %(tenant)s AND key = %(key)s
"""
)

# Only an ``unknown`` key is resolved (by hand, by resolve(), by the reconciler); it is
# kept for the TTL its claim recorded (the route's), else the app-wide one (ttl);
# anything else is the extension's, and a completed key is never overwritten. The
# reconciler's answer is fenced by the look it answers (attempt, generation, looks), an
# operator's by the key they saw (attempt, generation).
RESOLVE_KEY = """
UPDATE {table}
SET status = %(status)s, updated_at = now(), locked_until = NULL,
    expires_at = now() + coalesce(make_interval(secs => ttl_seconds), %(ttl)s),
    response_status = %(response_status)s, response_headers = %(response_headers)s,
    response_body = %(response_body)s,
    request = CASE WHEN %(status)s::text = 'completed' THEN NULL ELSE request END,
    request_body = CASE WHEN %(status)s::text = 'completed' THEN NULL ELSE request_body END,
    reconcile_attempts = 0, reconcile_due_at = NULL, reconcile_error = NULL
WHERE tenant = %(tenant)s AND key = %(key)s AND status = 'unknown'
  AND (%(attempt)s::integer IS NULL OR (attempt, generation) = (%(attempt)s, %(generation)s))
  AND (%(looks)s::integer IS NULL OR reconcile_attempts = %(looks)s)
"""

COUNT_STUCK = (
    """
SELECT (SELECT count(*) FROM ("""
    + ABANDONED_KEYS.replace("%(margin)s", "interval '0'")
    + """) AS abandoned) AS abandoned,
       (SELECT count(*) FROM {table} WHERE status = 'unknown' AND reconcile_due_at IS NOT NULL)
       -- an earlier release's unknown keys the reconciler has not marked due yet
       + (SELECT count(*) FROM {table} WHERE status = 'unknown' AND reconcile_due_at IS NULL
          AND to_regclass(%(retired_unknown_index)s) IS NOT NULL) AS unknown,
       (SELECT count(*) FROM {table}
        WHERE status = 'unknown' AND reconcile_due_at IS NOT NULL
          AND reconcile_attempts >= %(max_attempts)s) AS exhausted,
       -- claims in their lease whose owner's session ended (SPEC §20): a dead worker's,
       -- abandoned at the next look (a moment, if the owner was only reconnecting)
       (SELECT count(*) FROM {table}
        WHERE created_at > now() - interval '"""
    + ABANDONED_HORIZON
    + """'
          AND """
    + OWNER_STATE
    + """ = 'gone') AS dead_owner
"""
)

# Read at scrape time beside COUNT_STUCK: asynchronous keys waiting for a run
# ({deferred}, DEFERRED), and the staged jobs by state: due (never tried, or retried by
# hand, and due), failing (failed at least once, not dead), dead.
COUNT_BACKLOG = """
SELECT (SELECT count(*) FROM {table} WHERE {deferred}) AS deferred,
       (SELECT count(*) FROM {jobs} WHERE NOT dead AND attempts = 0 AND due_at <= now()) AS due,
       (SELECT count(*) FROM {jobs} WHERE NOT dead AND attempts > 0) AS failing,
       (SELECT count(*) FROM {jobs} WHERE dead) AS dead
"""

# How many claims MARK_ABANDONED would mark, and how many of them unknown.
COUNT_ABANDONED = (
    "SELECT count(*), count(*) FILTER (WHERE coalesce(k.on_abandoned, %(on_abandoned)s::text)"
    " = 'unknown') FROM (" + ABANDONED_KEYS + ") AS abandoned"
    " JOIN {table} AS k USING (tenant, key)"
)

# -- tests (flask_idempotency.testing) ------------------------------------------------

# expire_lease(app, key): a claim's lease ends now, as if its worker had gone silent and
# its lease had run out; the next request for the key takes over as ON_ABANDONED says. Its
# owner is cleared, so the owner's renewals leave it alone.
# A transactional view's claim holds its row locked: this waits for its end.
END_LEASE = """
UPDATE {table} SET locked_until = now(), owner_id = NULL, owner_claim = NULL
WHERE tenant = %(tenant)s AND key = %(key)s AND status = 'processing'
RETURNING attempt, generation, locked_until AS lease_ended
"""

# -- owners (SPEC §20) -----------------------------------------------------------------

# A claim or a reservation that an owner lock speaks for (OWNED) whose owner is among
# those found dead (%(gone_owners)s): {dead_owner}.
DEAD_OWNER = "(owner_id = ANY(%(gone_owners)s::bigint[]) AND " + OWNED + ")"

# The owners of what a background pass looks at: request claims in their lease and
# reservations (a completer's, a reconciler's), in the index each pass reads. Few: one per
# process.
OWNERS_OF_PENDING = (
    "SELECT DISTINCT owner_id FROM {table} WHERE request IS NOT NULL AND "
    + OWNED
    + " AND (status = 'processing' OR status = 'retryable' AND locked_until > now())"
)
OWNERS_OF_UNKNOWN = (
    "SELECT DISTINCT owner_id FROM {table}"
    " WHERE status = 'unknown' AND reconcile_due_at > now() AND " + OWNED
)
OWNERS_OF_CLAIMS = (
    "SELECT DISTINCT owner_id FROM {table} WHERE created_at > now() - interval '"
    + ABANDONED_HORIZON
    + "' AND status = 'processing' AND locked_until > now() AND "
    + OWNED
)

# Which of the owners are free now: their session ended (dead, or reconnecting). Asked
# twice, GRACE_SECONDS apart: free both times, dead.
FREE_OWNERS = "SELECT id FROM unnest(%(ids)s::bigint[]) AS id WHERE " + lock_free("id")
