"""The DDL of the table as the 0.1.0 release made it (before SPEC §9 added the stored
request and reconciliation columns), to test the online upgrade from it."""

from __future__ import annotations

#: ``{table}``, ``{expires_index}``, ``{lease_index}``, ``{unknown_index}``, ``{jobs}``
#: and ``{jobs_due_index}`` are filled in with identifiers
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
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS {expires_index} ON {table} (expires_at)
    WHERE status IN ('completed', 'retryable');
CREATE INDEX IF NOT EXISTS {lease_index} ON {table} (locked_until)
    WHERE status = 'processing';
CREATE INDEX IF NOT EXISTS {unknown_index} ON {table} (created_at)
    WHERE status = 'unknown';
"""

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
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS {jobs_due_index} ON {jobs} (due_at) WHERE NOT dead;
"""
