"""Previous releases of the package, taken out of git, to serve beside this one
(tests/e2e/test_releases.py, SPEC §16 "Two releases side by side").

``git archive <commit> flask_idempotency`` into a directory: with that directory first on
``PYTHONPATH`` (and as the process's working directory, which Python and gunicorn put before
``PYTHONPATH``), ``import flask_idempotency`` gets the old code.

The repository is found by walking up from tests/ to a ``.git`` (a directory, or the file of a
worktree), or, where the suite runs from a copy without one (``.ci/run``), from
``IDEMPOTENCY_TEST_GIT_DIR``. A release that cannot be found fails the test that needs it:
skipping would let CI pass without ever serving two releases at once.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

#: the repository's git directory (or a worktree's ``.git`` file), for a copy without one
GIT_DIR_ENV = "IDEMPOTENCY_TEST_GIT_DIR"


def git_command() -> list[str]:
    """``git`` pointed at this repository (``--git-dir`` from the environment, else ``-C``
    the first directory above tests/ that has a ``.git``); fails the test when none is."""
    configured = os.environ.get(GIT_DIR_ENV)
    if configured:
        if not Path(configured).exists():
            pytest.fail(f"{GIT_DIR_ENV}={configured} does not exist", pytrace=False)
        return ["git", "--git-dir", configured]
    for directory in (TESTS, *TESTS.parents):
        if (directory / ".git").exists():
            return ["git", "-C", str(directory)]
    pytest.fail(
        f"no git repository above {TESTS} to take previous releases from: run the tests from a"
        f" checkout, or set {GIT_DIR_ENV} to the repository's .git (.ci/run does)",
        pytrace=False,
    )


def extract(commit: str, destination: Path) -> Path:
    """``flask_idempotency/`` of *commit* under *destination* (created); *destination*."""
    git = git_command()
    try:
        resolved = subprocess.run(
            [*git, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except FileNotFoundError:
        pytest.fail("git is not installed: it is needed to take previous releases", pytrace=False)
    if resolved.returncode != 0:
        pytest.fail(
            f"commit {commit} is not in the repository ({' '.join(git)}): a shallow clone?"
            f" fetch the full history. {resolved.stderr.strip()}",
            pytrace=False,
        )
    archive = subprocess.run(
        [*git, "archive", "--format=tar", resolved.stdout.strip(), "flask_idempotency"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    if archive.returncode != 0:
        message = archive.stderr.decode(errors="replace").strip()
        pytest.fail(f"git archive {commit} flask_idempotency failed: {message}", pytrace=False)
    destination.mkdir(parents=True, exist_ok=True)
    untar = subprocess.run(
        ["tar", "-x", "-C", str(destination)],
        input=archive.stdout,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert untar.returncode == 0, untar.stderr.decode(errors="replace")
    assert (destination / "flask_idempotency" / "__init__.py").is_file(), destination
    return destination
