"""The suite tests the package that is installed, in every process it starts: in CI (CI=true)
that is the wheel .ci/run built, in site-packages, never the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import flask_idempotency
from tests.support.gunicorn_server import ROOT

PACKAGE = Path(flask_idempotency.__file__).resolve()


def test_the_imported_package_is_the_installed_distribution() -> None:
    """The editable checkout for a developer; under CI=true, the wheel in site-packages."""
    distribution = metadata.distribution("flask-idempotency")
    origin = json.loads(distribution.read_text("direct_url.json") or "{}")
    if origin.get("dir_info", {}).get("editable"):
        source = Path(origin["url"].removeprefix("file://")).resolve()
        assert source in PACKAGE.parents, (PACKAGE, origin)
    else:
        files = {Path(str(distribution.locate_file(f))).resolve() for f in distribution.files or ()}
        assert PACKAGE in files, f"{PACKAGE} is not a file of the installed distribution"
    if os.environ.get("CI") == "true":
        site = Path(sysconfig.get_paths()["purelib"]).resolve()
        assert site in PACKAGE.parents, f"CI imports {PACKAGE}, not the wheel in {site}"
        assert origin["url"].endswith(".whl") and "archive_info" in origin, origin
        assert not (ROOT / "flask_idempotency").exists(), "CI runs the tests without the checkout"


def test_subprocesses_import_the_same_package() -> None:
    """gunicorn and flask processes start with cwd and PYTHONPATH holding the repository:
    they must import the same flask_idempotency as the tests."""
    result = subprocess.run(
        [sys.executable, "-c", "import flask_idempotency; print(flask_idempotency.__file__)"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert Path(result.stdout.strip()).resolve() == PACKAGE
