"""The request path's statements on Citus (SPEC §22), where Citus refuses the plain ones.

On a database with the ``citus`` extension the keys table is distributed by tenant, and
every statement that names its tenant and key is planned as one task on the shard's node,
whichever node the request entered at, provided Citus's router planner accepts it. It
refuses, on distributed tables (measured on Citus 14.0.1):

- an ``INSERT … ON CONFLICT DO UPDATE`` whose ``SET`` or ``WHERE`` holds a sub-select or a
  function that is not immutable (``now()``): the plain :data:`~.statements_request.CLAIM`;
- a function that is not immutable inside a ``CASE`` or ``COALESCE`` of an ``UPDATE``
  (the plain :data:`~.statements_request.FINISH`'s ``reconcile_due_at``);
- a function that is not immutable in ``RETURNING`` (the finish's ``pg_notify``: a NOTIFY
  on the shard's node would wake nobody anyway, the waiters listen where they entered), or
  in the ``WHERE`` of a modification (``set_config`` of the asynchronous commits);

and it plans an ``INSERT … SELECT`` inside a ``WITH`` apart from the rest (a subplan run
first, "pull to coordinator"), not as one task.

So on Citus a claim's first look is :data:`CLAIM_FIRST` (a ``SELECT`` that writes
nothing: a settled key answered, a new key's advisory lock taken), then, for a new key,
:data:`CLAIM_NEW`; anything else is :data:`CLAIM` (one ``SELECT``: the row read, the decision,
``pg_try_advisory_xact_lock`` and the fenced takeover ``UPDATE … FROM``, one task, the
advisory lock taken on the shard's node) and, for a key that has no row yet and whose lock
was granted, :data:`CLAIM_NEW` (``INSERT … VALUES … ON CONFLICT DO NOTHING``, one task):
a second round trip for new keys only. The unique key of the shard decides between twins
that entered at different nodes.

The owner lock (SPEC §20) is per node: a process holds it on the node it entered at, and
``pg_locks`` read inside a statement routed to the shard is the shard node's, where a live
owner would look dead. So the claim records its owner and, meeting a claim in flight that an
owner speaks for, says which (``free_owner``); the caller asks every node at once
(:data:`OWNER_FREE`, on the node it entered at, outside the claim) whether any holds that
lock or started after the claim's last write; free everywhere, and still free
:data:`~.owner.GRACE_SECONDS` later, the claim is sent again naming the owner
(``gone_owner``) and takes the key over. The renewals are :data:`RENEW_CITUS`.

The texts are the plain ones where Citus takes them as they are; what differs is derived
here from them, so that the plain PostgreSQL statements stay exactly as they are.
"""

from __future__ import annotations

import re

from .owner import LOCK_IS_MINE, lock_free
from .statements_background import (
    COUNT_STUCK,
    DELETE_JOBS,
    DUE_JOBS,
    FAIL_JOBS,
    TAKE_OVER,
    UNRESERVE,
)
from .statements_console import KEY_DETAIL
from .statements_request import CLAIM_FIRST as _PLAIN_FIRST
from .statements_request import (
    COMPLETE,
    EXPIRY,
    FINISH,
    FINISH_GRACE_SECONDS,
    SETTLED_DECISIONS,
)

# statements_request.CLAIM_FIRST's reads (the key's row and its tombstone) are the first
# look's here; what follows them there writes (the new key's INSERT), which Citus plans apart
_PLAIN_FIRST_WRITES = "), claimed AS ("
if _PLAIN_FIRST_WRITES not in _PLAIN_FIRST:  # pragma: no cover - carry a change over
    raise RuntimeError("statements_citus: CLAIM_FIRST changed; carry the change over")

# A claim's first look (statements_request.CLAIM_FIRST's, as Citus takes it): a SELECT that
# writes nothing, which Citus plans at a quarter of CLAIM's cost (measured on 14.0.1: a
# data-modifying CTE is planned and deparsed whole on the node the request entered at, and
# planned again on the shard's). A completed key with this fingerprint is replayed, another
# fingerprint is a mismatch, a completed key past its expiry (or a tombstone, or a stale
# request without either) is expired; a key with neither row nor tombstone is 'claimed'
# once its advisory lock is granted (insert_new: the caller sends CLAIM_NEW). Anything else
# (a claim in flight, a retryable or unknown key, a key to be used afresh, a lock a twin
# holds) answers no decision, and the caller sends CLAIM.
CLAIM_FIRST = (
    _PLAIN_FIRST[: _PLAIN_FIRST.index(_PLAIN_FIRST_WRITES)]
    + """), decided AS (
    SELECT CASE WHEN seen.expired THEN NULL
                WHEN coalesce(seen.fingerprint, buried.fingerprint) <> %(fingerprint)s
                    THEN 'mismatch'
                WHEN seen.gone OR buried.fingerprint IS NOT NULL THEN 'expired'
                WHEN seen.status = 'completed' THEN 'replay'
                WHEN seen.status IS NULL AND %(stale)s THEN 'expired'
                WHEN seen.status IS NULL
                     AND pg_try_advisory_xact_lock(%(lock_id)s::bigint) THEN 'claimed'
           END AS decision
    FROM (VALUES (1)) AS one (x) LEFT JOIN seen ON true LEFT JOIN buried ON true
)
SELECT decided.decision, NULL::integer, NULL::bigint, NULL::text, 0, seen.status,
       seen.attempt, coalesce(seen.response_status, buried.first_status),
       seen.response_headers, seen.response_body, seen.expires_in,
       coalesce(seen.expires_at, buried.expired_at), NULL::numeric, NULL::numeric,
       NULL::bigint, coalesce(seen.updated_at, buried.completed_at),
       coalesce(decided.decision = 'claimed', false) AS insert_new
FROM decided LEFT JOIN seen ON true LEFT JOIN buried ON true{commit_mode}
"""
)

__all__ = [
    "CLAIM",
    "CLAIM_CALL",
    "CLAIM_FIRST",
    "CLAIM_FUNCTION",
    "COMPLETE_CALL",
    "COMPLETE_FUNCTION",
    "DIRECT_COMPLETE",
    "DIRECT_FIRST",
    "HERE_FUNCTION",
    "CLAIM_NEW",
    "LOCK_IS_MINE_CITUS",
    "OWNER_FREE",
    "owners_since",
    "RENEW_CITUS",
    "DELETE_JOBS_CITUS",
    "DUE_JOBS_CITUS",
    "DUE_TENANTS",
    "FAIL_JOBS_CITUS",
    "COUNT_STUCK_CITUS",
    "FINISH_CITUS",
    "KEY_DETAIL_CITUS",
    "TAKE_OVER_CITUS",
    "UNRESERVE_CITUS",
]

# The decision, as statements_request.CLAIM makes it, the owner lock looked at by the caller
# (OWNER_FREE): a claim in flight is abandoned when its lease ends, or when the owner that
# speaks for it (owned) is the one the caller found gone. The clock's values are read
# once, in ``fresh``: Citus takes now() in a SELECT, not inside a CASE of an UPDATE's SET.
# The row this request must insert (a new key, lock granted) is said by ``insert_new``;
# the caller sends CLAIM_NEW in the same transaction (or right after it, for a claim in
# autocommit: the unique key then decides, as it does between any two inserts).
CLAIM = (
    """
WITH seen AS (
    SELECT status, fingerprint, attempt, generation, on_abandoned,
           locked_until <= now() AS lease_over, updated_at,
           """
    + EXPIRY
    + """,
           extract(epoch FROM expires_at - now()) AS expires_in, expires_at,
           response_status, response_headers, response_body,
           extract(epoch FROM now() - updated_at) AS idle_for,
           extract(epoch FROM locked_until - now()) AS lease_left,
           owner_id, status = 'processing' AND locked_until > now() AND owner_id IS NOT NULL
                     AND owner_claim = generation + attempt AS owned
    FROM {table} WHERE tenant = %(tenant)s AND key = %(key)s
), buried AS (
    SELECT fingerprint, first_status, completed_at, expired_at FROM {tombstones}
    WHERE tenant = %(tenant)s AND key = %(key)s
      AND expired_at > now() - make_interval(secs => %(tombstone_ttl)s)
), intent AS (
    SELECT CASE
        WHEN seen.status IS NULL AND buried.fingerprint <> %(fingerprint)s THEN 'mismatch'
        WHEN seen.status IS NULL AND (buried.fingerprint IS NOT NULL OR %(stale)s)
            THEN 'expired'
"""
    + SETTLED_DECISIONS
    + """        WHEN seen.lease_over
             OR (seen.owned AND seen.owner_id = %(gone_owner)s::bigint) THEN
            CASE coalesce(seen.on_abandoned, %(on_abandoned)s::text)
                WHEN 'unknown' THEN 'marked_unknown' ELSE 'taken_over' END
        ELSE 'in_progress'
    END AS decision,
    coalesce(NOT seen.lease_over AND seen.owned AND seen.owner_id = %(gone_owner)s::bigint,
             false) AS owner_dead
    FROM (VALUES (1)) AS one (x) LEFT JOIN seen ON true LEFT JOIN buried ON true{commit_mode}
), fresh AS (
    SELECT (extract(epoch FROM now()) * 1000000)::bigint AS generation, now() AS at,
           now() + make_interval(secs => %(lease)s) AS locked_until,
           now() + make_interval(secs => %(ttl)s + """
    + str(FINISH_GRACE_SECONDS)
    + """) AS expires_at
), lock AS (
    SELECT pg_try_advisory_xact_lock(%(lock_id)s::bigint) AS granted
    FROM intent WHERE decision IN ('claimed', 'taken_over', 'marked_unknown')
), taken AS (
    UPDATE {table} AS k SET
        status = 'processing',
        fingerprint = %(fingerprint)s,
        attempt = CASE WHEN intent.decision = 'claimed' THEN 1 ELSE k.attempt + 1 END,
        generation = CASE WHEN intent.decision = 'claimed'
                          THEN fresh.generation ELSE k.generation END,
        recovery_point = CASE WHEN intent.decision = 'claimed'
                              THEN 'started' ELSE k.recovery_point END,
        created_at = CASE WHEN intent.decision = 'claimed' THEN fresh.at ELSE k.created_at END,
        locked_until = fresh.locked_until,
        expires_at = fresh.expires_at,
        updated_at = fresh.at,
        response_status = NULL, response_headers = NULL, response_body = NULL,
        request = %(request)s, request_body = %(request_body)s,
        on_abandoned = %(on_abandoned)s, ttl_seconds = %(ttl)s,
        owner_id = %(owner)s::bigint,
        owner_claim = CASE WHEN intent.decision = 'claimed' THEN fresh.generation + 1
                           ELSE k.generation + k.attempt + 1 END,
        owner_host = %(owner_host)s::text, owner_pid = %(owner_pid)s::integer
    FROM lock, intent, seen, fresh
    WHERE lock.granted AND intent.decision IN ('claimed', 'taken_over')
      AND k.tenant = %(tenant)s AND k.key = %(key)s
      AND (k.attempt, k.generation, k.status) = (seen.attempt, seen.generation, seen.status)
      AND (k.status <> 'processing' OR k.locked_until <= fresh.at OR intent.owner_dead)
    RETURNING k.attempt, k.generation, k.recovery_point
), marked AS (
    UPDATE {table} AS k
    SET status = 'unknown', locked_until = NULL, updated_at = fresh.at,
        reconcile_due_at = fresh.at
    FROM lock, seen, intent, fresh
    WHERE lock.granted AND intent.decision = 'marked_unknown'
      AND k.tenant = %(tenant)s AND k.key = %(key)s AND k.status = 'processing'
      AND k.attempt = seen.attempt AND k.generation = seen.generation
    RETURNING k.attempt
)
SELECT intent.decision, taken.attempt, taken.generation, taken.recovery_point,
       (SELECT count(*) FROM marked), seen.status, seen.attempt,
       coalesce(seen.response_status, buried.first_status), seen.response_headers,
       seen.response_body, seen.expires_in, coalesce(seen.expires_at, buried.expired_at),
       seen.idle_for, seen.lease_left,
       CASE WHEN intent.decision = 'in_progress' AND seen.owned
                 AND %(gone_owner)s::bigint IS NULL THEN seen.owner_id END AS free_owner,
       coalesce(seen.updated_at, buried.completed_at),
       coalesce(lock.granted AND intent.decision = 'claimed' AND seen.status IS NULL, false)
           AS insert_new
FROM intent
LEFT JOIN lock ON true
LEFT JOIN taken ON true
LEFT JOIN seen ON true
LEFT JOIN buried ON true
"""
)

# Where a delegated function's statements run (SPEC §22): the shard itself when it is on this
# node, else the distributed tables. Citus plans a statement on a distributed table anew at
# every execution, even one on a local shard (it deparses the shard's query, parses it back
# and plans it: about 0.25 ms of the node's CPU each, measured on Citus 14.0.1); the shard's
# own table costs what one PostgreSQL's does. Writing a shard directly is safe under the lock
# every Citus write takes on the shard's metadata (lock_shard_metadata, ShareLock): a shard
# move or split blocks writes by taking it exclusively, so it waits for this call to end, and
# this call, once it has the lock, finds the shard where the metadata says it is now: moved
# away, the statements go through the distributed tables. lock_shard_metadata is the table
# owner's (Citus's check): a role that does not own the table goes through them too. The
# lock and the placement are HERE_FUNCTION's, which the client's own statements ask too.
#
# Each statement is prepared once per session and relation (a dynamic statement would be
# parsed and planned at every call, 0.06-0.13 ms each), under a name of the table's oid, the
# shard (0: the distributed table), this text's version and the statement; a session that
# lost them (DISCARD ALL) prepares them again. Sets ``named`` from ``p_tenant``.
_WHERE_TO_RUN = """
    shard := get_shard_id_for_distribution_column({table_name}::regclass, p_tenant);
    keys := {table_name};
    graves := {tombstones_name};
    named := format('idem2_%s_0_', {table_name}::regclass::oid);
    IF pg_has_role((SELECT relowner FROM pg_class WHERE oid = {table_name}::regclass), 'USAGE')
    THEN
        IF {here_function}(shard, p_tenant,
                           (SELECT l.groupid FROM pg_dist_local_group AS l)) THEN
            keys := shard_name({table_name}::regclass, shard);
            graves := shard_name({tombstones_name}::regclass,
                get_shard_id_for_distribution_column({tombstones_name}::regclass, p_tenant));
            named := format('idem2_%s_%s_', {table_name}::regclass::oid, shard);
            direct := true;
        END IF;
    END IF;
"""


def _prepare(name: str, types: str, text: str) -> str:
    """PL/pgSQL: PREPARE the statement *text* (its relations ``%1$s``, the keys, and
    ``%2$s``, the tombstones) as ``named || name``."""
    quoted = text.replace("'", "''")
    return (
        f"        EXECUTE format('PREPARE %3$I ({types}) AS {quoted}',\n"
        f"                       keys, graves, named || '{name}');\n"
    )


# The claim's statements, by their name: the key's row, its tombstone, the new row.
_SEEN = """SELECT k.status, k.fingerprint, k.attempt, k.response_status,
           k.response_headers, k.response_body,
           extract(epoch FROM k.expires_at - now()) AS expires_in, k.expires_at, k.updated_at,
           k.status = 'retryable' AND k.expires_at <= now()
               OR k.status = 'completed'
                  AND k.expires_at <= now() - make_interval(secs => $3) AS expired,
           k.status = 'completed' AND k.expires_at <= now() AS gone
    FROM %1$s AS k WHERE k.tenant = $1 AND k.key = $2"""
_BURIED = """SELECT b.fingerprint, b.first_status, b.completed_at, b.expired_at
    FROM %2$s AS b
    WHERE b.tenant = $1 AND b.key = $2 AND b.expired_at > now() - make_interval(secs => $3)"""
_INSERT = (
    """INSERT INTO %1$s AS k
        (tenant, key, fingerprint, status, attempt, generation, locked_until, expires_at,
         request, request_body, on_abandoned, ttl_seconds, owner_id, owner_claim,
         owner_host, owner_pid)
    VALUES ($1, $2, $3, 'processing', 1, (extract(epoch FROM now()) * 1000000)::bigint,
            now() + make_interval(secs => $4), now() + make_interval(secs => $5 + """
    + str(FINISH_GRACE_SECONDS)
    + """),
            $6, $7, $8, $5, $9, (extract(epoch FROM now()) * 1000000)::bigint + 1, $10, $11)
    ON CONFLICT (tenant, key) DO NOTHING
    RETURNING k.attempt, k.generation, k.recovery_point"""
)
# statements_request.COMPLETE, its RETURNING as Citus runs it
_COMPLETE = """UPDATE %1$s
    SET status = 'completed',
        updated_at = now(),
        expires_at = greatest(expires_at, now() + make_interval(secs => $5)),
        response_status = $6,
        response_headers = $7,
        response_body = $8,
        request = NULL, request_body = NULL, reconcile_due_at = NULL
    WHERE tenant = $1 AND key = $2 AND attempt = $3 AND generation = $4
      AND status <> 'completed'
    RETURNING 1, expires_at"""

# The first look and a new key's claim in one call, delegated by Citus to the shard's node
# (create_distributed_function, by the tenant, co-located with the keys: schema's "claim
# function on Citus" step), its statements on the shard itself (_WHERE_TO_RUN).
# CLAIM_FIRST's decisions, in order: a key with a row is answered as CLAIM_FIRST answers it
# (no decision: the caller sends CLAIM); a tombstone is a mismatch or expired; a stale
# request expired; else the key's advisory lock (not granted: no decision) and the new row
# (a twin's row there: 'claimed' without an attempt, in progress). Used outside a
# transaction only (a claim in autocommit): inside one, Citus would run the function on the
# node the request entered at. The _v1 function of the release before (the same decisions,
# through the distributed tables) is left to the processes of that release that call it.
CLAIM_FUNCTION = (
    """
CREATE OR REPLACE FUNCTION {function}(
    p_tenant {tenant_type}, p_key text, p_fingerprint bytea, p_lock_id bigint,
    p_stale boolean, p_tombstone_ttl float8, p_lease float8, p_ttl float8, p_request text,
    p_request_body bytea, p_on_abandoned text, p_owner bigint, p_owner_host text,
    p_owner_pid integer)
RETURNS TABLE (decision text, attempt integer, generation bigint, recovery_point text,
               marked bigint, status text, seen_attempt integer, response_status smallint,
               response_headers jsonb, response_body bytea, expires_in numeric,
               expires_at timestamptz, idle_for numeric, lease_left numeric,
               free_owner bigint, updated_at timestamptz, on_keys text, on_graves text,
               on_shard bigint)
LANGUAGE plpgsql AS $claim$
DECLARE
    seen record;
    buried record;
    shard bigint;
    keys text;
    graves text;
    named text;
    direct boolean := false;
BEGIN
    marked := 0;"""
    + _WHERE_TO_RUN
    + """    IF direct AND current_setting('application_name') NOT LIKE 'citus_internal%' THEN
        -- on the caller's own node: it may send the next statements there itself
        on_keys := keys;
        on_graves := graves;
        on_shard := shard;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_prepared_statements AS s
                   WHERE s.name = named || 'seen') THEN
"""
    + _prepare("seen", "{tenant_type}, text, float8", _SEEN)
    + _prepare("buried", "{tenant_type}, text, float8", _BURIED)
    + _prepare(
        "insert",
        "{tenant_type}, text, bytea, float8, float8, text, bytea, text, bigint, text, integer",
        _INSERT,
    )
    + """    END IF;
    EXECUTE format('EXECUTE %I(%L, %L, %L)', named || 'seen', p_tenant, p_key, p_tombstone_ttl)
    INTO seen;
    IF seen.status IS NOT NULL THEN
        decision := CASE WHEN seen.expired THEN NULL
                         WHEN seen.fingerprint <> p_fingerprint THEN 'mismatch'
                         WHEN seen.gone THEN 'expired'
                         WHEN seen.status = 'completed' THEN 'replay' END;
        status := seen.status;
        seen_attempt := seen.attempt;
        response_status := seen.response_status;
        response_headers := seen.response_headers;
        response_body := seen.response_body;
        expires_in := seen.expires_in;
        expires_at := seen.expires_at;
        updated_at := seen.updated_at;
        RETURN NEXT;
        RETURN;
    END IF;
    EXECUTE format('EXECUTE %I(%L, %L, %L)', named || 'buried', p_tenant, p_key,
                   p_tombstone_ttl)
    INTO buried;
    IF buried.first_status IS NOT NULL THEN
        decision := CASE WHEN buried.fingerprint <> p_fingerprint THEN 'mismatch'
                         ELSE 'expired' END;
        response_status := buried.first_status;
        expires_at := buried.expired_at;
        updated_at := buried.completed_at;
        RETURN NEXT;
        RETURN;
    END IF;
    IF p_stale THEN
        decision := 'expired';
        RETURN NEXT;
        RETURN;
    END IF;
    IF NOT pg_try_advisory_xact_lock(p_lock_id) THEN
        RETURN NEXT;
        RETURN;
    END IF;
    EXECUTE format('EXECUTE %I(%L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L)', named || 'insert',
                   p_tenant, p_key, p_fingerprint, p_lease, p_ttl, p_request, p_request_body,
                   p_on_abandoned, p_owner, p_owner_host, p_owner_pid)
    INTO attempt, generation, recovery_point;
    decision := 'claimed';
    RETURN NEXT;
END
$claim$
"""
)

# The common finish, a completed key's (statements_request.COMPLETE, its RETURNING as
# Citus runs it), in one call delegated like the claim's, on the shard itself: a row (1, the
# key's expires_at) if the key changed, none if fenced. Used outside a transaction only.
COMPLETE_FUNCTION = (
    """
CREATE OR REPLACE FUNCTION {function}(
    p_tenant {tenant_type}, p_key text, p_attempt integer, p_generation bigint, p_ttl float8,
    p_response_status smallint, p_response_headers jsonb, p_response_body bytea)
RETURNS TABLE (changed integer, expires_at timestamptz)
LANGUAGE plpgsql AS $complete$
DECLARE
    shard bigint;
    keys text;
    graves text;
    named text;
    direct boolean := false;
BEGIN"""
    + _WHERE_TO_RUN
    + """    IF NOT EXISTS (SELECT FROM pg_prepared_statements AS s
                   WHERE s.name = named || 'complete') THEN
"""
    + _prepare(
        "complete",
        "{tenant_type}, text, integer, bigint, float8, smallint, jsonb, bytea",
        _COMPLETE,
    )
    + """    END IF;
    RETURN QUERY EXECUTE format('EXECUTE %I(%L, %L, %L, %L, %L, %L, %L, %L)', named || 'complete',
                                p_tenant, p_key, p_attempt, p_generation, p_ttl,
                                p_response_status, p_response_headers, p_response_body);
END
$complete$
"""
)

# The call: one round trip, one task on the shard's node.
CLAIM_CALL = """
SELECT * FROM {claim_function}(
    %(tenant)s, %(key)s, %(fingerprint)s, %(lock_id)s::bigint, %(stale)s::boolean,
    %(tombstone_ttl)s::float8, %(lease)s::float8, %(ttl)s::float8, %(request)s::text,
    %(request_body)s::bytea, %(on_abandoned)s::text, %(owner)s::bigint,
    %(owner_host)s::text, %(owner_pid)s::integer)
"""

# The common finish's call: one round trip, one task on the shard's node.
COMPLETE_CALL = """
SELECT * FROM {complete_function}(
    %(tenant)s, %(key)s, %(attempt)s::integer, %(generation)s::bigint, %(ttl)s::float8,
    %(response_status)s::smallint, %(response_headers)s::jsonb, %(response_body)s::bytea)
"""

# Whether the shard p_shard is on this node (p_group: this node's group, which the calling
# statement reads) and is p_tenant's, under its metadata lock (the functions' _WHERE_TO_RUN,
# alone): what a statement sent to a shard's table by the client itself asks first. A shard
# that is no longer the tenant's (split: a split or an isolation makes new shards and removes
# the old one) answers false before its lock is asked for, which Citus refuses for a shard it
# no longer knows. The lock is taken in an expression (PL/pgSQL evaluates a simple expression
# without running a query, where PERFORM runs one); the placement is then read by a query
# with a snapshot taken after the lock is held, so a move that committed while this call
# waited is seen. The node's group is the caller's to read (it never changes under a
# statement): one query fewer in the function, about 13 µs of a worker's CPU a call on
# Citus 14.0.1 (docs/performance-history.md). Made on every node (create_distributed_function
# without a distribution argument: not delegated, run where it is called).
HERE_FUNCTION = """
CREATE OR REPLACE FUNCTION {function}(p_shard bigint, p_tenant {tenant_type}, p_group integer)
RETURNS boolean
LANGUAGE plpgsql AS $here$
DECLARE
    locked boolean;
BEGIN
    IF get_shard_id_for_distribution_column({table_name}::regclass, p_tenant) <> p_shard THEN
        RETURN false;
    END IF;
    locked := lock_shard_metadata(5, ARRAY[p_shard]) IS NULL;
    RETURN EXISTS (SELECT FROM pg_dist_placement AS p
                   WHERE p.shardid = p_shard AND p.groupid = p_group);
END
$here$
"""

# A tenant whose claim ran on the shard in the caller's own session (the claim function's
# on_keys, on_graves, on_shard): its next requests on that connection's node send one
# PostgreSQL's statements to the shard's tables themselves, the first of them asking
# HERE_FUNCTION before anything is written (the lock held to the statement's end). Not
# here (moved away): the row is discarded (its first column, ``here``, false) and the
# caller goes through the functions. The plain CLAIM_FIRST: the key's row, its tombstone
# and the new row.
_HERE = (
    "WITH here AS MATERIALIZED (SELECT {here_function}(%(shard)s::bigint, %(tenant)s,"
    " (SELECT l.groupid FROM pg_dist_local_group AS l)) AS ok), seen AS ("
)
DIRECT_FIRST = (
    _PLAIN_FIRST.replace("WITH seen AS (", _HERE, 1)
    .replace("{table}", "{shard_keys}")
    .replace("{tombstones}", "{shard_graves}")
    .replace(
        "WHERE tenant = %(tenant)s AND key = %(key)s\n), buried",
        "WHERE tenant = %(tenant)s AND key = %(key)s AND (SELECT ok FROM here)\n), buried",
        1,
    )
    .replace(
        "    WHERE CASE WHEN EXISTS", "    WHERE (SELECT ok FROM here) AND CASE WHEN EXISTS", 1
    )
    .replace("\nSELECT CASE WHEN claimed", "\nSELECT (SELECT ok FROM here), CASE WHEN claimed", 1)
)
# The common finish (statements_request.COMPLETE) on the shard's table: (here, the key's
# expires_at: NULL if fenced).
DIRECT_COMPLETE = (
    _HERE.replace(", seen AS (", ", done AS (", 1)
    + COMPLETE.replace("UPDATE {table}", "UPDATE {shard_keys}", 1)
    .replace("{commit_mode}\n", "", 1)
    .replace("AND status <> 'completed'\n", "AND status <> 'completed' AND (SELECT ok FROM here)\n")
    .replace("RETURNING {notify}, expires_at\n", "RETURNING expires_at\n")
    + ")\nSELECT here.ok, done.expires_at FROM here LEFT JOIN done ON true\n"
)

# IDEMPOTENCY_ROUTE_TO_SHARDS: a tenant's shard, its tables' names and the worker that holds
# it (its active primary placement), read from the metadata of the node the request entered
# at, for the process to send DIRECT_FIRST and DIRECT_COMPLETE to that worker itself: what
# the claim function says of a shard on the caller's own node (on_shard, on_keys, on_graves),
# asked once per tenant. No row: the role may not write the shard's tables itself (the same
# check as the functions'), or the shard has no active primary placement. The values are
# bound %(keys_table)s, %(tombstones_table)s: the tables' names as ``::regclass`` reads them.
SHARD_NODE = """
SELECT shard.id, shard_name(%(keys_table)s::regclass, shard.id),
       shard_name(%(tombstones_table)s::regclass,
                  get_shard_id_for_distribution_column(%(tombstones_table)s::regclass,
                                                       %(tenant)s::text)),
       n.nodename, n.nodeport
FROM (SELECT get_shard_id_for_distribution_column(%(keys_table)s::regclass, %(tenant)s::text)
             AS id) AS shard
JOIN pg_dist_placement AS p ON p.shardid = shard.id
JOIN pg_dist_node AS n ON n.groupid = p.groupid AND n.isactive AND n.noderole = 'primary'
WHERE pg_has_role((SELECT relowner FROM pg_class WHERE oid = %(keys_table)s::regclass),
                  'USAGE')
"""

# A new key: its row, unless a twin's is there already (then no row comes back, and the
# request is the twin's in-progress duplicate).
CLAIM_NEW = (
    """
INSERT INTO {table}
    (tenant, key, fingerprint, status, attempt, generation, locked_until, expires_at,
     request, request_body, on_abandoned, ttl_seconds, owner_id, owner_claim, owner_host,
     owner_pid)
VALUES (%(tenant)s, %(key)s, %(fingerprint)s, 'processing', 1,
        (extract(epoch FROM now()) * 1000000)::bigint,
        now() + make_interval(secs => %(lease)s),
        now() + make_interval(secs => %(ttl)s + """
    + str(FINISH_GRACE_SECONDS)
    + """),
        %(request)s, %(request_body)s, %(on_abandoned)s, %(ttl)s,
        %(owner)s::bigint, (extract(epoch FROM now()) * 1000000)::bigint + 1,
        %(owner_host)s::text, %(owner_pid)s::integer)
ON CONFLICT (tenant, key) DO NOTHING
RETURNING attempt, generation, recovery_point
"""
)

# Whether the owner lock %(owner)s is free on every node of the cluster, none of which
# started after %(since)s (the claim's last write: a node restarted since then ended every
# session on it, and an owner there may not have taken its lock again yet, so its claim is
# judged by its lease, as statements_request.CLAIM judges one made before its server's
# start). A node that does not answer makes it held. Sent on the node the request entered at
# (run_command_on_all_nodes asks every active primary node of the metadata; an owner whose
# own node is not in the metadata holds no lock the others can see: LOCK_IS_MINE_CITUS).
OWNER_FREE = (
    "SELECT count(*) > 0 AND coalesce(bool_and(success AND result = 't'), false)"
    " FROM run_command_on_all_nodes(format('SELECT "
    + lock_free("%1$s::bigint").replace("'", "''")
    + " AND pg_postmaster_start_time() <= %2$L::timestamptz',"
    " %(owner)s::bigint, %(since)s::timestamptz))"
)


def owners_since(owners: str) -> str:
    """*owners* (statements_background.OWNERS_OF_*: the distinct owners of what a
    background pass looks at) with, for each owner, its earliest claim's last write: what
    OWNER_FREE compares the nodes' starts with."""
    distinct = "SELECT DISTINCT owner_id FROM"
    if not owners.startswith(distinct):  # pragma: no cover - carry a change over
        raise RuntimeError("statements_citus: an owners statement changed; carry it over")
    return "SELECT owner_id, min(updated_at) FROM" + owners[len(distinct) :] + " GROUP BY owner_id"


# The owner's lock counts only where the other nodes see it: held by this session, on a node
# that is an active primary of the cluster's metadata (a coordinator never added to it,
# citus_set_coordinator_host, is not asked by run_command_on_all_nodes from a worker).
LOCK_IS_MINE_CITUS = (
    LOCK_IS_MINE.rstrip()[: -len(")")]
    + """)
   AND EXISTS (SELECT FROM pg_dist_node
               WHERE isactive AND noderole = 'primary'
                 AND groupid = (SELECT groupid FROM pg_dist_local_group))
"""
)

# The renewals (statements_request.RENEW), one claim each (owner.Owner's renew_each): Citus
# refuses FOR UPDATE over many shards, and a statement over every shard would fail every
# renewal while any node is down; one claim's is a fast-path UPDATE on its own shard.
RENEW_CITUS = """
UPDATE {table} SET locked_until = now() + make_interval(secs => %(lease)s)
WHERE tenant = %(tenant)s AND key = %(key)s
  AND attempt = %(attempt)s AND generation = %(generation)s
  AND status = 'processing' AND locked_until IS NOT NULL AND owner_id = %(owner)s
"""

_DUE = "reconcile_due_at = CASE WHEN %(status)s::text = 'unknown' THEN now() END"
# the same value, with no function inside the CASE (now() + NULL is NULL)
_DUE_CITUS = (
    "reconcile_due_at = now() + CASE WHEN %(status)s::text = 'unknown' THEN interval '0' END"
)
if _DUE not in FINISH:  # pragma: no cover - a change of FINISH must be carried over here
    raise RuntimeError("statements_citus: FINISH changed; carry the change over")

# The finish, as statements_request.FINISH, rendered with ``{notify}`` as ``1`` and
# ``{commit_mode}`` empty (Citus refuses both: see the module's docstring).
FINISH_CITUS = FINISH.replace(_DUE, _DUE_CITUS)


# What a person is told of a claim's owner (statements_background.OWNER_STATE) cannot be
# read inside a statement routed to the shard (its pg_locks are the shard node's): there an
# owned claim in its lease reads 'alive', and the console's key page asks every node
# (OWNER_FREE) whether it is 'gone'; the count of claims whose owner is gone (a metric) is 0.
_OWNER_LOCK_FREE = lock_free("owner_id")
if _OWNER_LOCK_FREE not in KEY_DETAIL or _OWNER_LOCK_FREE not in COUNT_STUCK:  # pragma: no cover
    raise RuntimeError("statements_citus: OWNER_STATE changed; carry the change over")
KEY_DETAIL_CITUS = KEY_DETAIL.replace(_OWNER_LOCK_FREE, "false")
COUNT_STUCK_CITUS = COUNT_STUCK.replace(_OWNER_LOCK_FREE, "false")


# -- the batches (SPEC §22): no row locks across shards ------------------------------------------
#
# Citus refuses ``FOR UPDATE`` in a query over many shards ("could not run distributed query
# with FOR UPDATE/SHARE commands"). The batches that reserve keys (the completer's, the
# reconciler's) and the cleaner's deletion pick their rows without it, and the write that
# follows checks again, row by row, what made the row due: under READ COMMITTED a row that
# another batch reserved (or a client took) meanwhile is looked at anew once that one
# commits, and left alone. So batches on several hosts still take disjoint rows; they may
# pick the same candidates and take fewer than their limit.

_SKIP_LOCKED = re.compile(r"\s+FOR UPDATE (OF k )?SKIP LOCKED")
_JOINED = "FROM due WHERE k.tenant = due.tenant AND k.key = due.key\n"


def without_row_locks(query: str, recheck: str, joined: str = _JOINED) -> str:
    """*query* (a batch's ``WITH due AS (… FOR UPDATE SKIP LOCKED) UPDATE … FROM due``)
    without the row locks, its write checking *recheck* of each row."""
    if not _SKIP_LOCKED.search(query) or joined not in query:  # pragma: no cover
        raise RuntimeError("statements_citus: a batch's statement changed; carry it over")
    unlocked = _SKIP_LOCKED.sub("", query)
    return unlocked.replace(joined, joined.rstrip("\n") + recheck + "\n")


#: what makes a key due for the completer, checked again by its reservation
COMPLETION_RECHECK = (
    " AND k.request IS NOT NULL"
    " AND (coalesce(k.locked_until, '-infinity') <= now() OR {dead_owner})"
)
#: what makes a key due for the reconciler, checked again by its reservation
RECONCILE_RECHECK = " AND k.status = 'unknown' AND (k.reconcile_due_at <= now() OR {dead_owner})"
#: the cleaner's expired keys, checked again by the deletion
EXPIRED_RECHECK = " AND k.status IN ('completed', 'retryable') AND k.expires_at <= now()"
EXPIRED_JOINED = "WHERE k.tenant = doomed.tenant AND k.key = doomed.key\n"
#: the tombstones past their TTL, checked again by their deletion
TOMBSTONE_RECHECK = " AND t.expired_at <= now() - make_interval(secs => %(tombstone_ttl)s)"
TOMBSTONE_JOINED = "WHERE t.tenant = past.tenant AND t.key = past.key\n"

#: the claims the cleaner marks abandoned, checked again by its marking
ABANDONED_RECHECK = (
    " AND k.status = 'processing' AND (k.locked_until <= now() - %(margin)s OR {dead_owner})"
)
ABANDONED_JOINED = "FROM stale WHERE k.tenant = stale.tenant AND k.key = stale.key\n"
_DUE_IF_UNKNOWN = """reconcile_due_at = CASE coalesce(k.on_abandoned, %(on_abandoned)s::text)
                           WHEN 'unknown' THEN now() END"""
_DUE_IF_UNKNOWN_CITUS = (
    "reconcile_due_at = now()"
    " + CASE coalesce(k.on_abandoned, %(on_abandoned)s::text) WHEN 'unknown' THEN interval '0' END"
)
# Citus 14 sends a simple CASE of a modification to the shards as "text = boolean": searched
_SIMPLE_CASE = re.compile(r"CASE (coalesce\(k\.on_abandoned, %\(on_abandoned\)s::text\))\s+WHEN")


def abandoned_without_row_locks(query: str) -> str:
    """The cleaner's MARK_ABANDONED on Citus: no row locks, no now() inside its CASE."""
    if _DUE_IF_UNKNOWN not in query:  # pragma: no cover
        raise RuntimeError("statements_citus: MARK_ABANDONED changed; carry it over")
    query = query.replace(_DUE_IF_UNKNOWN, _DUE_IF_UNKNOWN_CITUS)
    query = _SIMPLE_CASE.sub(r"CASE WHEN \1 =", query)
    return without_row_locks(query, ABANDONED_RECHECK, ABANDONED_JOINED)


# -- the completer's takeover (SPEC §22) ----------------------------------------------------------
#
# Citus refuses a function that is not immutable in the WHERE of a modification
# (TAKE_OVER's pg_try_advisory_xact_lock). As in CLAIM, the lock is taken in a CTE that
# reads the key's row, so the statement stays one task and the lock is taken on the shard's
# node, where a client's claim takes it, whichever node the completer entered at.
_TAKE_OVER_LOCK = "\n  AND pg_try_advisory_xact_lock(%(lock_id)s::bigint)"
_TAKE_OVER_WHERE = "WHERE tenant = %(tenant)s AND key = %(key)s AND locked_until = %(reserved)s"
_TAKE_OVER_RETURNING = "RETURNING attempt, generation, recovery_point\n"
if not all(  # pragma: no cover - a change of TAKE_OVER must be carried over here
    part in TAKE_OVER for part in (_TAKE_OVER_LOCK, _TAKE_OVER_WHERE, _TAKE_OVER_RETURNING)
):
    raise RuntimeError("statements_citus: TAKE_OVER changed; carry the change over")

TAKE_OVER_CITUS = (
    "\nWITH lock AS (\n    SELECT pg_try_advisory_xact_lock(%(lock_id)s::bigint) AS granted\n"
    "    FROM {table} WHERE tenant = %(tenant)s AND key = %(key)s\n), taken AS ("
    + TAKE_OVER.replace(_TAKE_OVER_LOCK, "").replace(
        _TAKE_OVER_WHERE,
        "FROM lock\n" + _TAKE_OVER_WHERE.replace("WHERE ", "WHERE lock.granted AND "),
    )
    + ")\nSELECT attempt, generation, recovery_point FROM taken\n"
)

_UNRESERVE_LEASE = "locked_until = CASE WHEN status = 'processing' THEN now() END"
if _UNRESERVE_LEASE not in UNRESERVE:  # pragma: no cover
    raise RuntimeError("statements_citus: UNRESERVE changed; carry the change over")
#: the same value, with no function inside the CASE (now() + NULL is NULL)
UNRESERVE_CITUS = UNRESERVE.replace(
    _UNRESERVE_LEASE,
    "locked_until = now() + CASE WHEN status = 'processing' THEN interval '0' END",
)


# -- the dispatcher (SPEC §22): one tenant's jobs a transaction ---------------------------------
#
# A dispatcher's batch holds its jobs' row locks for its transaction's life (a dispatcher
# that dies hands its batch back at once), which Citus refuses across shards. A tenant's
# jobs live on one shard (the jobs table is distributed by tenant): so on Citus a batch is
# a few transactions, one per tenant with due jobs (DUE_TENANTS, read without locks), each
# the plain batch narrowed to its tenant, planned as one task and holding its row locks on
# one node. The guarantees are the plain ones: disjoint batches across hosts (SKIP LOCKED),
# a job forgotten only after its hand-over returned, a dead dispatcher's jobs due again at
# once, a key's ordered jobs one after another. No schema change.
_DUE_FILTER = "WHERE NOT dead AND due_at <= now()"
_EARLIER = "WHERE earlier.tenant = j.tenant"
_FAILED = "WHERE j.id = failed.id"
_FAIL_SET = """SET attempts = j.attempts + 1,
    last_error = failed.error,
    due_at = now() + least(%(backoff)s * 2 ^ least(j.attempts, 30), %(cap)s),
    dead = failed.countable AND j.attempts + 1 >= %(max_attempts)s
FROM unnest(%(ids)s::uuid[], %(errors)s::text[], %(countable)s::boolean[])
     AS failed (id, error, countable)
"""
if (  # pragma: no cover - a change of the dispatcher's statements must be carried over here
    _DUE_FILTER not in DUE_JOBS
    or _EARLIER not in DUE_JOBS
    or not DUE_JOBS.rstrip().endswith("FOR UPDATE SKIP LOCKED")
    or _FAILED not in FAIL_JOBS
    or _FAIL_SET not in FAIL_JOBS
    or "WHERE id = " not in DELETE_JOBS
):
    raise RuntimeError("statements_citus: the dispatcher's statements changed; carry it over")

_DUE_WHERE = DUE_JOBS[DUE_JOBS.index(_DUE_FILTER) : DUE_JOBS.index("ORDER BY due_at")]

#: the tenants with due jobs, the longest due first; no row locks (many shards)
DUE_TENANTS = (
    "\nSELECT j.tenant FROM {jobs} AS j\n"
    + _DUE_WHERE
    + "GROUP BY j.tenant\nORDER BY min(j.due_at)\nLIMIT %(limit)s\n"
)

#: DUE_JOBS for one tenant (one shard), or, given %(keys)s, NEXT_JOBS: the due ordered
#: jobs of those keys with no earlier one left in the batch's own view (the successors of
#: the jobs it just handed over and deleted)
DUE_JOBS_CITUS = DUE_JOBS.replace(
    _DUE_FILTER,
    "WHERE j.tenant = %(tenant)s AND NOT dead AND due_at <= now()\n"
    "  AND (%(keys)s::text[] IS NULL OR j.seq IS NOT NULL AND j.key = ANY(%(keys)s::text[]))",
).replace(_EARLIER, "WHERE earlier.tenant = %(tenant)s")

DELETE_JOBS_CITUS = DELETE_JOBS.replace("WHERE id = ", "WHERE tenant = %(tenant)s AND id = ")

# Citus refuses now() + an interval computed from the row's columns in an UPDATE's SET
# ("STABLE functions used in UPDATE queries cannot be called with column references"): the
# values are read first, in the same transaction, under the batch's row locks.
FAIL_JOBS_CITUS = """
WITH failed AS (
    SELECT j.id, f.error,
           now() + least(%(backoff)s * 2 ^ least(j.attempts, 30), %(cap)s) AS due_at,
           f.countable AND j.attempts + 1 >= %(max_attempts)s AS dead
    FROM {jobs} AS j
    JOIN unnest(%(ids)s::uuid[], %(errors)s::text[], %(countable)s::boolean[])
         AS f (id, error, countable) ON j.id = f.id
    WHERE j.tenant = %(tenant)s
)
UPDATE {jobs} AS j
SET attempts = j.attempts + 1, last_error = failed.error, due_at = failed.due_at,
    dead = failed.dead
FROM failed WHERE j.tenant = %(tenant)s AND j.id = failed.id
"""
