"""flask-idempotency: safe retries for unsafe HTTP methods, backed by PostgreSQL."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
        KeyExpired,
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
    "KeyExpired",
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

#: where each public name is defined. The package imports them on first use, so that
#: importing a module of its own that needs none of them costs nothing: pytest loads
#: :mod:`flask_idempotency.testing` (the ``pytest11`` entry point) in every run where the
#: package is installed, and that must not import Flask and psycopg (SPEC §19).
_DEFINED_IN = {
    "AttemptSuperseded": ".errors",
    "ClaimedKey": ".claim",
    "ConfigError": ".errors",
    "EncryptionError": ".errors",
    "FingerprintFailed": ".errors",
    "FingerprintMismatch": ".errors",
    "Idempotency": ".extension",
    "IdempotencyError": ".errors",
    "InvalidKey": ".errors",
    "InvalidTenant": ".errors",
    "Job": ".jobs",
    "KeyExpired": ".errors",
    "KeyNotFound": ".errors",
    "KeyStatus": ".model",
    "MissingKey": ".errors",
    "OutcomeUnknown": ".errors",
    "ProblemError": ".errors",
    "RETRYABLE": ".background.reconciler",
    "RequestInProgress": ".errors",
    "RequestTooLarge": ".errors",
    "ResponseNotStorable": ".errors",
    "StoreError": ".errors",
    "StoreRefused": ".errors",
    "StoreUnavailable": ".errors",
    "StoredFailure": ".consumer",
    "UnknownKey": ".background.reconciler",
    "completing": ".rerun",
    "current_idempotency": ".claim",
}


def _load_all() -> None:
    """Import every public name, each class under its public path (``__module__``)."""
    names = globals()
    for name, module in _DEFINED_IN.items():
        obj = getattr(importlib.import_module(module, __name__), name)
        if isinstance(obj, type):
            obj.__module__ = __name__
        names[name] = obj


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed distribution's (setup.cfg), read on first use
        from importlib.metadata import version

        return version("flask-idempotency")
    if name == "signals":  # a module: ``from . import signals`` inside the package
        return importlib.import_module(".signals", __name__)
    if name not in _DEFINED_IN:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_all()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})
