"""The tables' DDL: what ``flask idempotency-init`` (or ``IDEMPOTENCY_CREATE_TABLE``)
creates, and the objects an online upgrade adds to a table made by an earlier release.

``{table}`` and the index names are filled in with ``psycopg.sql.Identifier``.
:mod:`.schema` runs them.
"""

from __future__ import annotations

# The keys table as this release creates it. Columns added since the 0.1.0 table
# are in UPGRADE_COLUMNS too: schema.py adds them to an older table.
#
# The columns' order is the row's layout (issue 48), and it weighs in WAL. The fixed-width
# columns come first, widest first (no alignment padding between them); then, side by side,
# every column the common finish writes (updated_at to response_body), so that its HOT
# update logs only those bytes (PostgreSQL logs the new row version without the prefix and
# the suffix it shares with the old one on the same page); then the text the claim writes
# once; the columns of rare states, mostly NULL, last. 48 bytes less WAL per new key than
# the 0.1.0 order (docs/performance-history.md). A table made by an earlier release keeps its
# order (changing it is a rewrite): every statement names its columns.
#
# No CHECK constraint on ``status``: PostgreSQL reads a table's CHECK constraints back from
# their stored text and plans them at every INSERT and UPDATE statement, 8-20 µs of the
# server's time per claim and per finish (issue 48, docs/performance-history.md); every
# status is written by the extension's own statements, from KeyStatus. An earlier release's
# table loses it in the upgrade (STATUS_CHECK).
TABLE = """
CREATE TABLE IF NOT EXISTS {table} (
    generation bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    locked_until timestamptz,
    owner_id bigint,
    owner_claim bigint,
    attempt integer NOT NULL DEFAULT 1,
    reconcile_attempts integer NOT NULL DEFAULT 0,
    ttl_seconds real,
    owner_pid integer,
    updated_at timestamptz NOT NULL DEFAULT now(),
    status text NOT NULL,
    response_status smallint,
    response_headers jsonb,
    response_body bytea,
    tenant text NOT NULL,
    key text NOT NULL,
    fingerprint bytea NOT NULL,
    recovery_point text NOT NULL DEFAULT 'started',
    on_abandoned text,
    owner_host text,
    reconcile_due_at timestamptz,
    request text,
    request_body bytea,
    reconcile_error text,
    PRIMARY KEY (tenant, key)
) WITH ({storage})
"""

# What is left of a completed key once its answer expired (SPEC §24): the cleaner moves it
# here when it removes the key, for IDEMPOTENCY_TOMBSTONE_TTL from expired_at (the key's
# expires_at); a claim of a key without a row looks here. No body, no headers: the tenant,
# the key, the fingerprint (another body still gets 422), the first answer's status, when
# it completed and when it expired. Its own expiry index is the cleaner's.
TOMBSTONES = """
CREATE TABLE IF NOT EXISTS {tombstones} (
    tenant text NOT NULL,
    key text NOT NULL,
    fingerprint bytea NOT NULL,
    first_status smallint NOT NULL,
    completed_at timestamptz NOT NULL,
    expired_at timestamptz NOT NULL,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS {tombstones_index} ON {tombstones} (expired_at);
"""

#: the keys table's autovacuum settings. Every row expires, so a busy table is mostly
#: rows on their way out: at PostgreSQL's default (a vacuum once 20 % of the rows are
#: dead) the space the cleaner frees is reused only after a long wait, and a table of
#: 10 million keys grows by 2 million rows' worth before its first vacuum. At 2 % it
#: levels off near its live size. An earlier table gets the settings it lacks from
#: ``flask idempotency-init`` (run by the table's owner); settings already on the
#: table are the operator's and are kept.
#:
#: fillfactor: a page keeps a tenth free when it is filled by claims, so that their
#: finishes (HOT updates, see INDEXES) find room for the new row version on the same
#: page: 81 % of finishes were HOT at 100, all of them at 90 (docs/performance-history.md).
STORAGE = {
    "autovacuum_vacuum_scale_factor": "0.02",
    "autovacuum_vacuum_threshold": "1000",
    "fillfactor": "90",
}

#: columns added since the 0.1.0 table, with their type and constant default, so that
#: ``ADD COLUMN`` only changes the catalog (no table rewrite)
UPGRADE_COLUMNS = (
    ("request", "text"),  # the stored request of a complete=True claim (JSON text)
    ("request_body", "bytea"),
    ("reconcile_attempts", "integer NOT NULL DEFAULT 0"),  # undecided looks so far
    ("reconcile_due_at", "timestamptz"),  # the next look (NULL: due now)
    ("reconcile_error", "text"),  # the last reconciler error
    # the route's policy, recorded by the claim (SPEC §16): what the cleaner, the
    # completer, the reconciler and the next request act on. NULL: claimed by an
    # earlier release, which recorded none; the acting process's app-wide setting applies.
    ("on_abandoned", "text"),  # 'retry' or 'unknown'
    ("ttl_seconds", "real"),  # how long the key is kept once it has an answer
    # the claim's owner (SPEC §20): the owner lock's id, which claim it made
    # (generation + attempt: a later claim by a release without owners leaves it behind),
    # and where it runs, for people. NULL: no owner lock speaks for it (its lease does).
    ("owner_id", "bigint"),
    ("owner_claim", "bigint"),
    ("owner_host", "text"),
    ("owner_pid", "integer"),
)

#: columns added to the jobs table since 0.1.0 (same rule: a catalog change only)
UPGRADE_JOB_COLUMNS = (
    ("traceparent", "text"),  # the W3C traceparent of the span that staged the job
)

#: the keys table's indexes, by the suffix of their name: what follows ``ON``.
#:
#: None of them covers a column the common finish (``processing`` -> ``completed``)
#: changes, nor ``status``, so that finish is a HOT update: PostgreSQL writes no index
#: entry and keeps the new row version on its page (docs/performance-history.md, issue 24).
#: The finish leaves ``locked_until``, ``expires_at`` (the claim sets it 2 s beyond the
#: TTL) and ``reconcile_due_at`` alone; rare states are found by columns only rare
#: transitions change.
INDEXES = {
    # unknown keys (the reconciler, the dead-letter list, the console): exactly the rows
    # whose reconcile_due_at is set
    "unknown_due_idx": "{table} (created_at) WHERE reconcile_due_at IS NOT NULL",
    # the completer's due keys: only claims of complete=True routes not completed yet
    "pending_idx": "{table} (created_at) WHERE request IS NOT NULL",
    # The keys claimed by a release that recorded no TTL (ttl_seconds NULL, class -1 below),
    # by expiry, for the cleaner: a new key has a TTL, and writes no entry here. Built
    # before ttl_created_idx, so that a table has both when the statements walk it.
    "legacy_expiry_idx": "{table} (expires_at) WHERE coalesce(ttl_seconds, -1) = -1",
    # One timestamp index for the keys by time (issue 48): each TTL class (the routes'
    # TTLs, a handful; -1 for the keys without one) in order of creation. The cleaner walks
    # a class up to now() - its TTL (a key expires no sooner), the console and the sweeps
    # of recent claims walk each class's newest and merge them (statements_by_class). One
    # index entry per new key, where the two below cost two (64 B of WAL each).
    "ttl_created_idx": "{table} ((coalesce(ttl_seconds, -1)), created_at)",
    # On Citus (SPEC §22) the two of earlier releases instead: a recursive loose scan of
    # the classes cannot run on a distributed table.
    # the cleaner's expired keys, every status (a processing row past its expiry is an
    # abandoned claim, which the cleaner settles too)
    "expiry_idx": "{table} (expires_at)",
    # the console's keys list, newest or oldest first, a page at a time; the
    # abandoned-claim sweep over the recent claims
    "created_idx": "{table} (created_at)",
}

#: the indexes of INDEXES a table on plain PostgreSQL does without, and those a table on
#: Citus does without: an upgrade builds what the table's kind has and lacks, and
#: ``flask idempotency-init`` drops the others (RETIRED_INDEXES)
CITUS_ONLY_INDEXES = frozenset({"expiry_idx", "created_idx"})
PLAIN_ONLY_INDEXES = frozenset({"legacy_expiry_idx", "ttl_created_idx"})
#: the indexes a table on plain PostgreSQL has
PLAIN_INDEXES = tuple(suffix for suffix in INDEXES if suffix not in CITUS_ONLY_INDEXES)

#: indexes of earlier releases that the finish had to update (their columns change
#: with it): dropped by the upgrade once the indexes above exist
RETIRED_INDEXES = ("expires_idx", "lease_idx", "unknown_idx", "complete_idx")

#: the backfill that makes the unknown keys of an earlier table findable by
#: unknown_due_idx (runs while the old unknown_idx still serves it)
MARK_UNKNOWN_DUE = """
UPDATE {table} SET reconcile_due_at = now()
WHERE status = 'unknown' AND reconcile_due_at IS NULL
"""

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
# the jobs table's columns, the keys table's invalid indexes (a concurrent build that
# failed), its storage parameters, whether this role may change them (the table's
# owner, or a member of its role), whether the database has Citus, and the names of an
# earlier release's CHECK constraints on status (STATUS_CHECK).
SCHEMA_STATE = """
SELECT ARRAY(SELECT name FROM unnest(%(names)s::text[]) AS name WHERE to_regclass(name) IS NULL),
       ARRAY(SELECT attname::text FROM pg_attribute
             WHERE attrelid = to_regclass(%(table)s) AND attnum > 0 AND NOT attisdropped),
       ARRAY(SELECT attname::text FROM pg_attribute
             WHERE attrelid = to_regclass(%(jobs)s) AND attnum > 0 AND NOT attisdropped),
       ARRAY(SELECT c.relname::text FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
             WHERE i.indrelid IN (to_regclass(%(table)s), to_regclass(%(jobs)s))
               AND NOT i.indisvalid),
       coalesce((SELECT reloptions FROM pg_class WHERE oid = to_regclass(%(table)s)), '{}'),
       coalesce((SELECT pg_has_role(relowner, 'USAGE') FROM pg_class
                 WHERE oid = to_regclass(%(table)s)), false),
       EXISTS (SELECT FROM pg_extension WHERE extname = 'citus'),
       ARRAY(SELECT conname::text FROM pg_constraint
             WHERE conrelid = to_regclass(%(table)s) AND contype = 'c'
               AND pg_get_constraintdef(oid) = %(status_check)s)
"""

#: the CHECK constraint on ``status`` of the tables made before 1.1, as PostgreSQL shows
#: it (pg_get_constraintdef): the upgrade drops it (see TABLE); a constraint of the
#: operator's own is left alone
STATUS_CHECK = (
    "CHECK ((status = ANY (ARRAY['processing'::text, 'completed'::text,"
    " 'retryable'::text, 'unknown'::text])))"
)
DROP_CONSTRAINT = "ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {name}"

# On a database with the citus extension (SPEC §22), asked after SCHEMA_STATE: whether
# this node is the coordinator (only it creates distributed tables; queries and DML may
# enter at any node once the metadata is synced), and which of the named tables are
# distributed or reference tables already.
CITUS_STATE = """
SELECT citus_is_coordinator(),
       ARRAY(SELECT name FROM unnest(%(names)s::text[]) AS name
             WHERE to_regclass(name) IN (SELECT logicalrelid FROM pg_dist_partition)),
       EXISTS (SELECT FROM pg_proc AS p
               JOIN pg_dist_object AS d
                 ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid
                AND d.distribution_argument_index IS NOT NULL
               WHERE p.proname = %(function)s
                 AND p.pronamespace = (SELECT relnamespace FROM pg_class
                                       WHERE oid = to_regclass(%(table)s)))
"""

# On Citus: the new-key claim as a function delegated to the shard's node (SPEC §22,
# statements_citus.CLAIM_FUNCTION), once the keys table is distributed; its distribution
# argument, the tenant, of the keys' tenant column's type (Citus co-locates only one type).
TENANT_TYPE = """
SELECT format_type(atttypid, atttypmod) FROM pg_attribute
WHERE attrelid = to_regclass(%(table)s) AND attname = 'tenant'
"""
# A function Citus makes on every node, run where it is called (no distribution argument).
PROPAGATE_FUNCTION = """
SELECT create_distributed_function(p.oid::regprocedure)
FROM pg_proc AS p
WHERE p.proname = %(function)s
  AND p.pronamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass(%(table)s))
"""
DISTRIBUTE_FUNCTION = """
SELECT create_distributed_function(p.oid::regprocedure, 'p_tenant'::text,
                                   colocate_with => %(table)s::text)
FROM pg_proc AS p
WHERE p.proname = %(function)s
  AND p.pronamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass(%(table)s))
"""

# The keys, jobs and audit tables are distributed by tenant: every statement of a request
# names its tenant, so it runs on one shard. The keys table goes into the co-location
# group of IDEMPOTENCY_COLOCATE_WITH (the app's table distributed by its tenant column) or
# Citus's default one; jobs and audit follow the keys, so a statement that writes a key and
# its jobs or its audit row stays on one shard. On a table with rows, Citus copies them
# into the shards and blocks writes to the table meanwhile.
DISTRIBUTE = (
    "SELECT create_distributed_table(%(table)s::regclass, 'tenant', colocate_with => %(with)s)"
)
# The distribution column of the table IDEMPOTENCY_COLOCATE_WITH names: its name, its type
# and the type's category ('S': a string type), or no row when it is not a distributed table.
COLOCATED_TENANT = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod), t.typcategory
FROM pg_dist_partition AS p
JOIN pg_attribute AS a
  ON a.attrelid = p.logicalrelid
 AND a.attname = column_to_column_name(p.logicalrelid, p.partkey)
JOIN pg_type AS t ON t.oid = a.atttypid
WHERE p.logicalrelid = to_regclass(%(table)s) AND p.partmethod = 'h'
"""
# The heartbeats (one row per command and host, written once a batch): on every node.
REFERENCE = "SELECT create_reference_table(%(table)s::regclass)"
#: the primary keys of the jobs and audit tables: on Citus, a unique constraint must hold
#: the distribution column (tenant)
JOBS_KEY, JOBS_KEY_DISTRIBUTED = "id", "tenant, id"
AUDIT_KEY, AUDIT_KEY_DISTRIBUTED = "id", "tenant, id"

# The payload is a JSON document kept as text: jsonb refuses \u0000 and lone surrogates,
# which json.dumps writes as escapes that text keeps faithfully.
JOBS_SCHEMA = """
CREATE TABLE IF NOT EXISTS {jobs} (
    id uuid NOT NULL,
    tenant text NOT NULL,
    key text NOT NULL,
    name text NOT NULL,
    payload text NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    due_at timestamptz NOT NULL DEFAULT now(),
    dead boolean NOT NULL DEFAULT false,
    last_error text,
    created_at timestamptz NOT NULL DEFAULT now(),
    traceparent text,
    seq bigint,
    PRIMARY KEY ({jobs_key})
);
CREATE INDEX IF NOT EXISTS {jobs_due_index} ON {jobs} (due_at) WHERE NOT dead;
"""

# Ordered jobs (stage(..., ordered=True)): ``seq`` is the job's place among the ordered
# jobs of its key (NULL: unordered). The statement that commits a job gives it
# max(seq) + its position among that statement's jobs; that statement holds the key's
# row lock, so a key's ordered jobs get their places in the order they commit. No
# sequence object: the app's role needs no privilege beyond DML on the table.
# The index answers both "the key's last place" and "is an earlier one left?" (the
# dispatcher's hold-back) with one probe. A column without default is a catalog change.
JOBS_SEQ_COLUMN = "ALTER TABLE {jobs} ADD COLUMN IF NOT EXISTS seq bigint"
JOBS_ORDER_INDEX = "{jobs} (tenant, key, seq) WHERE seq IS NOT NULL"
