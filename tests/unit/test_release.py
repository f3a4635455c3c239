"""The release users pin (issue 52): one version, the same everywhere it is read."""

from __future__ import annotations

import re
from importlib.metadata import metadata, version
from pathlib import Path

import flask_idempotency

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_is_the_installed_distributions_and_the_changelogs() -> None:
    installed = version("flask-idempotency")
    assert flask_idempotency.__version__ == installed
    assert "__version__" in dir(flask_idempotency)
    top = re.search(r"^## Version (\S+)$", (ROOT / "CHANGES.md").read_text(), re.MULTILINE)
    assert top is not None and top[1] == installed


def test_a_stable_release_says_so() -> None:
    classifiers = metadata("flask-idempotency").get_all("Classifier") or []
    major = int(version("flask-idempotency").split(".")[0])
    assert ("Development Status :: 5 - Production/Stable" in classifiers) == (major >= 1)
