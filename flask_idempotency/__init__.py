"""flask-idempotency: safe retries for unsafe HTTP methods, backed by PostgreSQL."""

from __future__ import annotations

from . import signals
from .claim import ClaimedKey, current_idempotency
from .config import ConfigError
from .errors import (
    FingerprintMismatch,
    IdempotencyError,
    InvalidKey,
    MissingKey,
    OutcomeUnknown,
    ProblemError,
    RequestInProgress,
    RequestTooLarge,
    ResponseNotStorable,
    StoreError,
    StoreUnavailable,
)
from .extension import Idempotency
from .store import KeyStatus

__all__ = [
    "ClaimedKey",
    "ConfigError",
    "FingerprintMismatch",
    "Idempotency",
    "IdempotencyError",
    "InvalidKey",
    "KeyStatus",
    "MissingKey",
    "OutcomeUnknown",
    "ProblemError",
    "RequestInProgress",
    "RequestTooLarge",
    "ResponseNotStorable",
    "StoreError",
    "StoreUnavailable",
    "current_idempotency",
    "signals",
]

for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        _obj.__module__ = __name__
