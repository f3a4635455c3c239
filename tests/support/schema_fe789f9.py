"""The tables as release fe789f9 made them (the release before the owner lock, SPEC §20: no
``owner_*`` columns), to test the online upgrade from it. Its ``flask_idempotency/store/ddl.py``
(``git show fe789f9:flask_idempotency/store/ddl.py``): TABLE with STORAGE, INDEXES,
JOBS_SCHEMA and JOBS_ORDER_INDEX."""

from __future__ import annotations

#: ``{table}``, ``{expiry_idx}``, ``{unknown_due_idx}``, ``{pending_idx}`` and
#: ``{created_idx}`` are filled in with identifiers
KEYS = """
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
    on_abandoned text,
    ttl_seconds real,
    PRIMARY KEY (tenant, key)
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000,
        fillfactor = 90);
CREATE INDEX IF NOT EXISTS {expiry_idx} ON {table} (expires_at);
CREATE INDEX IF NOT EXISTS {unknown_due_idx} ON {table} (created_at)
    WHERE reconcile_due_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS {pending_idx} ON {table} (created_at) WHERE request IS NOT NULL;
CREATE INDEX IF NOT EXISTS {created_idx} ON {table} (created_at);
"""

#: ``{jobs}``, ``{jobs_due_idx}`` and ``{jobs_order_idx}`` are filled in with identifiers
JOBS = """
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
    created_at timestamptz NOT NULL DEFAULT now(),
    traceparent text,
    seq bigint
);
CREATE INDEX IF NOT EXISTS {jobs_due_idx} ON {jobs} (due_at) WHERE NOT dead;
CREATE INDEX IF NOT EXISTS {jobs_order_idx} ON {jobs} (tenant, key, seq) WHERE seq IS NOT NULL;
"""

#: ``{rows}`` keys of every status, as that release wrote them: a quarter of them claims in
#: flight (``processing``, leased for an hour, no owner: that release records none), a
#: quarter unknown (``reconcile_due_at`` set, as it marks them), the route's policy and TTL
#: recorded by the claim
ROWS = """
INSERT INTO {table} (tenant, key, fingerprint, status, attempt, generation, locked_until,
    response_status, response_headers, response_body, expires_at, reconcile_due_at,
    on_abandoned, ttl_seconds)
SELECT 't' || (i % 7), 'fe-' || i, '\\x00'::bytea,
       (ARRAY['completed', 'retryable', 'unknown', 'processing'])[1 + i % 4], 1,
       1000000 + i,
       CASE WHEN i % 4 = 3 THEN now() + interval '1 hour' END,
       CASE WHEN i % 4 < 2 THEN 201 END,
       CASE WHEN i % 4 < 2 THEN '[["Content-Type", "text/plain"]]'::jsonb END,
       CASE WHEN i % 4 < 2 THEN 'old body'::bytea END,
       now() + interval '1 day',
       CASE WHEN i % 4 = 2 THEN now() END,
       'retry', 86400
FROM generate_series(1, {rows}) AS i
"""
