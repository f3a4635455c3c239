"""Blinker signals, one per decision. The sender is always the Flask app; every
signal passes ``tenant`` and ``key``, and the decisions taken by the claim
(``claimed``, ``retried``, ``abandoned_*``, ``replayed``, ``conflict``, ``mismatch``)
also pass ``claim_seconds``, the time the claim statement took."""

from __future__ import annotations

from blinker import Namespace

_signals = Namespace()

#: A fresh key was claimed and the view is about to run. Kwargs: ``tenant``,
#: ``key``, ``attempt``.
claimed = _signals.signal("idempotency-claimed")

#: A retryable key (released earlier) was claimed again. Kwargs: ``tenant``, ``key``,
#: ``attempt``.
retried = _signals.signal("idempotency-retried")

#: A claim whose lease ran out was taken over; the view runs again. Kwargs:
#: ``tenant``, ``key``, ``attempt`` (the new one), ``previous_attempt``.
abandoned_taken_over = _signals.signal("idempotency-abandoned-taken-over")

#: A claim whose lease ran out was marked ``unknown`` (``IDEMPOTENCY_ON_ABANDONED =
#: "unknown"``). Kwargs: ``tenant``, ``key``, ``attempt``.
abandoned_marked_unknown = _signals.signal("idempotency-abandoned-marked-unknown")

#: A stored response was replayed. Kwargs: ``tenant``, ``key``, ``attempt``,
#: ``status`` (the replayed status code).
replayed = _signals.signal("idempotency-replayed")

#: The key is held by a request in progress, or is ``unknown``: answered 409.
#: Kwargs: ``tenant``, ``key``, ``reason`` (``"in_progress"`` or ``"unknown"``),
#: ``waited`` (seconds spent waiting for the twin).
conflict = _signals.signal("idempotency-conflict")

#: The key was used before for a different request: answered 422. Kwargs:
#: ``tenant``, ``key``.
mismatch = _signals.signal("idempotency-mismatch")

#: A completed key whose answer expired was asked again (SPEC §24): answered 409
#: ``key-expired``, the view not run. Kwargs: ``tenant``, ``key``, ``claim_seconds``,
#: ``attempt``.
expired = _signals.signal("idempotency-expired")

#: The view's response was stored for replay. Kwargs: ``tenant``, ``key``,
#: ``attempt``, ``status``, ``stored`` (False when a newer attempt owned the key).
stored = _signals.signal("idempotency-stored")

#: The attempt ended without a stored response. Kwargs: ``tenant``, ``key``,
#: ``attempt``, ``status``, ``reason``. ``status`` is the key's new status
#: (``"retryable"``, or ``"unknown"`` per ``IDEMPOTENCY_ON_EXCEPTION``), ``"unused"``
#: for a fresh key whose row was deleted (a status in ``IDEMPOTENCY_RELEASE_STATUSES``:
#: as if never used), or ``"rolled_back"`` for a ``transactional=True`` view whose
#: transaction rolled back, so that the key is as if never used.
released = _signals.signal("idempotency-released")

#: The store could not be reached. Kwargs: ``tenant``, ``key``, ``error``,
#: ``fail_open`` (True when the view ran unprotected).
store_unavailable = _signals.signal("idempotency-store-unavailable")

# -- the background processes (README "When clients give up") -----------------------------

#: ``flask idempotency-complete`` ran a key's stored request to its end. Kwargs:
#: ``tenant``, ``key``, ``attempt`` (the completer's), ``status`` (the key's new status:
#: ``"completed"``, ``"retryable"``, ``"unknown"``, or ``"marked_unknown"`` for an
#: abandoned claim of a route with ``ON_ABANDONED = "unknown"``).
completer_finished = _signals.signal("idempotency-completer-finished")

#: The completer left a key as it was: its tenant changed, its route is gone or no
#: longer has ``complete=True``, or its stored request cannot run. Kwargs: ``tenant``,
#: ``key``, ``reason``.
completer_skipped = _signals.signal("idempotency-completer-skipped")

#: An ``unknown`` key's look was undecided (the reconciler returned ``None``, or raised:
#: ``error`` is the exception) and its next look is scheduled. Kwargs: ``tenant``,
#: ``key``, ``looks`` (undecided looks so far), ``due_in`` (seconds), ``error``.
reconcile_scheduled = _signals.signal("idempotency-reconcile-scheduled")

#: An ``unknown`` key was resolved. Kwargs: ``tenant``, ``key``, ``status``
#: (``"completed"`` or ``"retryable"``), ``source`` (``"reconciler"``, ``"resolve"``,
#: ``"console"`` or ``"cli"``), ``actor`` (the operator of a hand-made answer, else None).
reconcile_resolved = _signals.signal("idempotency-reconcile-resolved")

#: An ``unknown`` key had ``IDEMPOTENCY_RECONCILE_MAX_ATTEMPTS`` undecided looks: it
#: stays ``unknown`` and is listed by ``flask idempotency-list --exhausted``. Kwargs:
#: ``tenant``, ``key``, ``looks``.
reconcile_exhausted = _signals.signal("idempotency-reconcile-exhausted")

#: ``flask idempotency-clean`` finished. Kwargs: ``deleted`` (expired keys deleted),
#: ``marked`` (abandoned claims marked retryable or unknown).
keys_cleaned = _signals.signal("idempotency-keys-cleaned")
