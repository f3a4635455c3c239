"""The click group sphinx-click documents: the commands ``init_app`` registers on an app.

Read from an app rather than from the modules that define them, so that the reference lists
exactly what ``flask --app yours ...`` offers, wherever the commands live in the package.
"""

from __future__ import annotations

import click
from idempotency_docs import docs_app

_app = docs_app()

cli = click.Group(
    "flask",
    help="The commands flask-idempotency adds to your app's ``flask`` command.",
    commands={
        name: command
        for name, command in sorted(_app.cli.commands.items())
        if name.startswith("idempotency")
    },
)
