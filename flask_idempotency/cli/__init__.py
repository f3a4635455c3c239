"""The ``flask idempotency-*`` commands."""
