"""The SQL of the background processes of SPEC §9: the completer and the reconciler.

Beside :mod:`.queries` (the request path's and the operators' statements), readable
top to bottom; ``{table}`` is filled in with ``psycopg.sql.Identifier``, values are
always bound parameters.
"""

from __future__ import annotations

# -- the completer (SPEC §9) ----------------------------------------------------------------

# One batch of keys whose client evidently gave up: claims of complete=True routes
# abandoned past their lease, and retryable ones, untouched for longer than
# older_than. The batch reserves them (locked_until: a lease held by this completer,
# the fence of its takeover), so completers on several hosts take disjoint batches; a
# client retry of a retryable key still wins at once. updated_at marks them looked at:
# a key that had to be skipped waits behind the others until older_than passes again.
DUE_FOR_COMPLETION = """
WITH due AS (
    SELECT tenant, key FROM {table}
    WHERE request IS NOT NULL
      AND (updated_at <= now() - %(older_than)s OR {deferred})
      AND (status = 'retryable' AND expires_at > now() OR status = 'processing')
      AND coalesce(locked_until, '-infinity') <= now()
      AND (%(only_key)s::text IS NULL OR (tenant, key) = (%(only_tenant)s, %(only_key)s))
    ORDER BY updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS k SET updated_at = now(), locked_until = now() + %(hold)s
FROM due WHERE k.tenant = due.tenant AND k.key = due.key
RETURNING k.tenant, k.key, k.status, k.attempt, k.generation, k.fingerprint,
          k.request, k.request_body, k.locked_until
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
    updated_at = now(), expires_at = now() + %(ttl)s,
    response_status = NULL, response_headers = NULL, response_body = NULL
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
SET locked_until = CASE WHEN status = 'processing' THEN now() END
WHERE tenant = %(tenant)s AND key = %(key)s AND locked_until = %(reserved)s
  AND (attempt, generation) = (%(attempt)s, %(generation)s)
"""

# A route with ON_ABANDONED = "unknown": the abandoned claim becomes unknown, as a
# client retry would make it, and the reconciler takes it from there.
MARK_UNKNOWN = """
UPDATE {table} SET status = 'unknown', locked_until = NULL, updated_at = now()
WHERE tenant = %(tenant)s AND key = %(key)s AND status = 'processing'
  AND (attempt, generation) = (%(attempt)s, %(generation)s) AND locked_until = %(reserved)s
"""

KEY_STATE = """
SELECT status, attempt, response_status FROM {table} WHERE tenant = %(tenant)s AND key = %(key)s
"""

# -- asynchronous=True (SPEC §10) ---------------------------------------------------------

# A key an asynchronous route deferred to the background: processing, with no lease
# (a client retry sees it in progress; no lease can run out) and due for the completer
# at once, whatever --older-than says.
DEFERRED = "(status = 'processing' AND locked_until IS NULL)"

# The request that claimed the key hands it to the background instead of running the
# view: no lease, and its attempt given back, so the run that takes it over is the
# attempt the client's own would have been. Fenced like the finish.
DEFER = """
UPDATE {table}
SET locked_until = NULL, attempt = attempt - 1, updated_at = now()
WHERE tenant = %(tenant)s AND key = %(key)s AND status = 'processing'
  AND attempt = %(attempt)s AND generation = %(generation)s
"""

# -- reconciliation of unknown keys (SPEC §9) ---------------------------------------------

# One batch for a reconciler: unknown keys that are due and not exhausted, reserved
# for `hold` (so reconcilers on several hosts share the work) and looked at outside
# any transaction: a provider's webhook resolving one of them never waits on a lock.
DUE_FOR_RECONCILE = """
WITH due AS (
    SELECT tenant, key FROM {table}
    WHERE status = 'unknown' AND reconcile_attempts < %(max_attempts)s
      AND coalesce(reconcile_due_at, '-infinity') <= now()
    ORDER BY reconcile_due_at NULLS FIRST, updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS k SET reconcile_due_at = now() + %(hold)s
FROM due WHERE k.tenant = due.tenant AND k.key = due.key
RETURNING k.tenant, k.key, k.attempt, k.generation, k.recovery_point, k.reconcile_attempts,
          k.request, k.request_body
"""

# An undecided look (None, or the reconciler raised): the n-th is followed by the next
# look backoff × 2^(n−1) later, by the database's clock, at most `cap` later. Fenced by
# the look it answers.
RESCHEDULE = """
UPDATE {table}
SET reconcile_attempts = reconcile_attempts + 1,
    reconcile_due_at = now() + least(%(backoff)s * 2 ^ least(reconcile_attempts, 30), %(cap)s),
    reconcile_error = %(error)s
WHERE tenant = %(tenant)s AND key = %(key)s AND status = 'unknown'
  AND (attempt, generation, reconcile_attempts) = (%(attempt)s, %(generation)s, %(looks)s)
RETURNING reconcile_attempts, extract(epoch FROM reconcile_due_at - now())
"""

# The dead-letter list: unknown keys that had their last undecided look.
LIST_EXHAUSTED = """
SELECT tenant, key, attempt, reconcile_attempts, reconcile_error, now() - updated_at AS age
FROM {table}
WHERE status = 'unknown' AND reconcile_attempts >= %(max_attempts)s
ORDER BY updated_at
LIMIT %(limit)s
"""
