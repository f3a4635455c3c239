"""flask-idempotency: safe retries for unsafe HTTP methods, backed by PostgreSQL."""

from __future__ import annotations

from . import signals
from .background.reconciler import RETRYABLE, UnknownKey
from .claim import ClaimedKey, current_idempotency
from .consumer import StoredFailure
from .errors import (
    AttemptSuperseded,
    ConfigError,
    EncryptionError,
    FingerprintFailed,
    FingerprintMismatch,
    IdempotencyError,
    InvalidKey,
    InvalidTenant,
    KeyNotFound,
    MissingKey,
    OutcomeUnknown,
    ProblemError,
    RequestInProgress,
    RequestTooLarge,
    ResponseNotStorable,
    StoreError,
    StoreRefused,
    StoreUnavailable,
)
from .extension import Idempotency
from .jobs import Job
from .model import KeyStatus
from .rerun import completing

__all__ = [
    "RETRYABLE",
    "AttemptSuperseded",
    "ClaimedKey",
    "ConfigError",
    "EncryptionError",
    "FingerprintFailed",
    "FingerprintMismatch",
    "Idempotency",
    "IdempotencyError",
    "InvalidKey",
    "InvalidTenant",
    "Job",
    "KeyNotFound",
    "KeyStatus",
    "MissingKey",
    "OutcomeUnknown",
    "ProblemError",
    "RequestInProgress",
    "RequestTooLarge",
    "ResponseNotStorable",
    "StoreError",
    "StoreRefused",
    "StoreUnavailable",
    "StoredFailure",
    "UnknownKey",
    "completing",
    "current_idempotency",
    "signals",
]

for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        _obj.__module__ = __name__
