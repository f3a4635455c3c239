"""A throwaway PgBouncer in transaction pooling mode in front of the test database."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

from flask_idempotency.testing.postgres import free_port
from flask_idempotency.testing.service import Service

BINARY = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
RUN_AS = "pgtest"  # the unprivileged user PostgresServer runs PostgreSQL as (as root)


class PgBouncer(Service):
    """``pgbouncer`` with ``pool_mode = transaction`` forwarding to *database_url*."""

    def __init__(self, workdir: Path, database_url: str) -> None:
        self.workdir = workdir
        self.target = conninfo_to_dict(database_url)
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        user = self.target.get("user", "postgres")
        return f"postgresql://{user}@127.0.0.1:{self.port}/{self.target['dbname']}"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o777)
        user = self.target.get("user", "postgres")
        target = " ".join(
            f"{name}={self.target[name]}"
            for name in ("host", "port", "dbname", "user", "password")
            if self.target.get(name)
        )
        (self.workdir / "userlist.txt").write_text(f'"{user}" ""\n')
        config = self.workdir / "pgbouncer.ini"
        config.write_text(
            f"""[databases]
{self.target["dbname"]} = {target}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.workdir / "userlist.txt"}
pool_mode = transaction
max_client_conn = 500
default_pool_size = 10
logfile = {self.workdir / "pgbouncer.log"}
"""
        )
        command = [BINARY, str(config)]
        if os.geteuid() == 0:  # pgbouncer refuses to run as root
            command[1:1] = ["-u", RUN_AS]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 15
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    log = self.workdir / "pgbouncer.log"
                    raise RuntimeError(
                        "pgbouncer did not start: "
                        + (log.read_text()[-2000:] if log.exists() else "no log")
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None
