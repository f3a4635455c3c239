"""The ``flask idempotency-*`` commands: ``init_app`` registers :data:`COMMANDS`."""

from __future__ import annotations

from .changes import COMMANDS as CHANGE_COMMANDS
from .forget import COMMANDS as FORGET_COMMANDS
from .operators import COMMANDS as OPERATOR_COMMANDS
from .workers import COMMANDS as WORKER_COMMANDS

#: every command ``init_app`` registers on ``app.cli``
COMMANDS = (*OPERATOR_COMMANDS, *FORGET_COMMANDS, *CHANGE_COMMANDS, *WORKER_COMMANDS)
