"""The background commands' heartbeats: after each batch, a row per command
and host says when it finished and what it did; the console's overview marks a loop
whose last batch is older than three intervals (an hour for a command run once).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

from ..errors import StoreError
from ..state import get_state

logger = logging.getLogger("flask_idempotency")


def record_batch(command: str, interval: float | None, counts: Mapping[str, int]) -> None:
    """Record that this host's *command* finished a batch now. A failure is logged and
    does not stop the command: the heartbeat watches the work, it is not the work."""
    try:
        get_state().operations.beat(command, socket.gethostname(), os.getpid(), interval, counts)
    except StoreError as exc:
        logger.warning("%s: could not record its heartbeat: %s", command, exc)
