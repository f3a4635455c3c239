"""The benchmark of flask-idempotency: run ``bash bench/run``; see docs/performance-history.md."""

from __future__ import annotations
