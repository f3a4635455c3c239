"""The keys table as the release before issue 24 made it (main at dff827d: every index
partial on ``status`` or ``request``, or keyed on a column the finish changes), to test the
online upgrade from it."""

from __future__ import annotations

#: ``{table}`` and the index names (``{table_name}_...``) are filled in with identifiers
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
    PRIMARY KEY (tenant, key)
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000);
CREATE INDEX IF NOT EXISTS {expires_idx} ON {table} (expires_at)
    WHERE status IN ('completed', 'retryable');
CREATE INDEX IF NOT EXISTS {lease_idx} ON {table} (locked_until) WHERE status = 'processing';
CREATE INDEX IF NOT EXISTS {unknown_idx} ON {table} (created_at) WHERE status = 'unknown';
CREATE INDEX IF NOT EXISTS {complete_idx} ON {table} (updated_at) WHERE request IS NOT NULL;
CREATE INDEX IF NOT EXISTS {created_idx} ON {table} (created_at);
"""

#: ROWS keys of every status; a quarter unknown (reconcile_due_at NULL: "due now", as that
#: release wrote them), some of complete=True routes (a stored request)
ROWS = """
INSERT INTO {table} (tenant, key, fingerprint, status, attempt, generation, locked_until,
    response_status, response_headers, response_body, expires_at, request)
SELECT 't' || (i % 7), 'prev-' || i, '\\x00'::bytea,
       (ARRAY['completed', 'retryable', 'unknown', 'processing'])[1 + i % 4], 1, 1,
       CASE WHEN i % 4 = 3 THEN now() + interval '1 hour' END,
       201, '[["Content-Type", "text/plain"]]', 'old body', now() + interval '1 day',
       CASE WHEN i % 8 = 3 THEN '{{"method": "POST"}}' END
FROM generate_series(1, {rows}) AS i
"""
