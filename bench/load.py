"""The load generators: wrk with bench/wrk.lua against gunicorn, and pgbench running the
extension's own claim and finish statements (variant e). All bounded in time."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from psycopg import sql

from bench.app import create_app
from bench.common import BENCH, BODY, DATABASE, MIMETYPE, BenchError, percentile
from bench.servers import Postgres, Processes
from flask_idempotency.fingerprint import fingerprint
from flask_idempotency.store.statements_request import CLAIM, FINISH


def wrk_command(
    port: int, path: str, mode: str, prefix: str, seconds: float, threads: int, connections: int
) -> list[str]:
    return [
        "wrk",
        *("-t", str(threads), "-c", str(connections), "-d", f"{seconds:g}s"),
        *("--timeout", "10s", "-s", str(BENCH / "wrk.lua")),
        f"http://127.0.0.1:{port}{path}",
        *("--", mode, prefix),
    ]


def parse_wrk(out: str) -> dict[str, Any]:
    """bench/wrk.lua's BENCH_JSON line, with req/s and milliseconds added."""
    match = re.search(r"^BENCH_JSON (.*)$", out, re.M)
    if match is None:
        raise BenchError(f"no BENCH_JSON line in wrk's output:\n{out}")
    data: dict[str, Any] = json.loads(match.group(1))
    data["rps"] = data["requests"] / (data["duration_us"] / 1e6)
    data["p50_ms"] = data["p50_us"] / 1000
    data["p99_ms"] = data["p99_us"] / 1000
    data["errors_total"] = sum(data["errors"].values())
    return data


def run_wrk(
    processes: Processes,
    port: int,
    path: str,
    mode: str,
    prefix: str,
    seconds: float,
    *,
    threads: int,
    connections: int,
) -> dict[str, Any]:
    cmd = wrk_command(port, path, mode, prefix, seconds, threads, connections)
    return parse_wrk(processes.run(cmd, timeout=seconds + 60))


def wrk_round(
    processes: Processes,
    port: int,
    path: str,
    prefix: str,
    seconds: float,
    clients: int,
    pids: Sequence[int],
) -> tuple[float, list[float]]:
    """One wrk round of new keys on *path* (2 threads, *clients* connections): its requests
    a second, and the CPU time (µs) per request of each of the processes *pids* with its
    children (gunicorn's, the server's: figures a stall of the shared machine's disk does
    not move). Any error or answer other than 201 ends the benchmark."""
    from bench.system import children, process_cpu

    def cpu() -> list[float]:
        return [
            process_cpu(pid, reaped=True) + sum(process_cpu(c) for c in children(pid))
            for pid in pids
        ]

    before = cpu()
    got = run_wrk(processes, port, path, "new", prefix, seconds, threads=2, connections=clients)
    if got["errors_total"] or got["others"]:
        raise SystemExit(f"{path}: errors {got['errors']}, other answers {got['others']}")
    used = [(b - a) / max(got["requests"], 1) * 1e6 for a, b in zip(before, cpu(), strict=True)]
    return float(got["rps"]), used


class Pgbench:
    """Variant e: pgbench with the claim and the finish the extension sends."""

    def __init__(self, db: Postgres, processes: Processes, workdir: Path, exec_dir: Path):
        self.db = db
        self.processes = processes
        self.workdir = workdir
        self.exec_dir = exec_dir
        self.command = ""
        #: -h: 127.0.0.1, or the server's socket directory (--unix-socket)
        self.host = "127.0.0.1"

    def extension_statements(self) -> tuple[str, str]:
        """The claim and the finish as the extension renders them for the bench app's
        settings (its PostgresStore), or else its CLAIM and FINISH templates as they are."""
        store = create_app(self.db.url, str(self.exec_dir)).extensions["idempotency"].store
        finishes = getattr(store, "_finishes", None)  # by (notify?, staged jobs?)
        rendered = []
        for value, template in (
            (getattr(store, "_claim", None), CLAIM),
            (finishes.get((False, False)) if isinstance(finishes, dict) else None, FINISH),
        ):
            value = getattr(value, "named", value)  # a Statement: its %(name)s text
            if isinstance(value, sql.Composable):
                value = value.as_string(None)
            if not isinstance(value, str):
                names = set(re.findall(r"{(\w+)}", template)) - {"table"}
                parts = {n: sql.SQL("1" if n == "notify" else "") for n in names}
                table = sql.Identifier("idempotency_keys")
                value = sql.SQL(template).format(table=table, **parts).as_string(None)
            rendered.append(value)
        return rendered[0], rendered[1]

    def script(self) -> Path:
        """The extension's claim then its finish, with random keys (see extension_statements)."""
        claim, finish = self.extension_statements()
        rename = {"key": "k", "lock_id": "lk", "generation": "c_generation"}

        # the stored request of a complete=True route: none here, as in the bench app
        null = {"request": "NULL::text", "request_body": "NULL::bytea"}

        def name(match: re.Match[str]) -> str:
            return null.get(match[1]) or ":" + rename.get(match[1], match[1])

        def to_pgbench(query: str) -> str:
            return re.sub(r"%\((\w+)\)s", name, query).strip()

        script = (
            "-- generated by bench/load.py from the extension's CLAIM and FINISH\n"
            "\\set k random(1, 4000000000000000000)\n"
            "\\set lk random(-4000000000000000000, 4000000000000000000)\n"
            f"{to_pgbench(claim)}\n\\gset c_\n{to_pgbench(finish)};\n"
        )
        path = self.workdir / "claim_finish.sql"
        path.write_text(script)
        return path

    @staticmethod
    def check_parameters(script: str, defined: Iterable[str]) -> None:
        """Fail clearly if the extension's statements gained a parameter we do not set."""
        used = set(re.findall(r"(?<!:):([A-Za-z_]\w*)", script))
        missing = used - set(defined) - {"k", "lk", "c_generation"}
        if missing:
            raise BenchError(
                f"CLAIM/FINISH use parameters bench/load.py does not define: {sorted(missing)};"
                " add them to Pgbench.defines"
            )

    @staticmethod
    def defines() -> list[str]:
        body = json.dumps({"amount": 1000, "id": str(uuid.uuid4())}, separators=(",", ":"))
        body += "\n"
        values = {
            "tenant": "pgbench",
            "fingerprint": "\\x" + fingerprint("POST", "/idempotent", MIMETYPE, BODY).hex(),
            "on_abandoned": "taken_over",
            "lease": "60",  # seconds: the defaults of IDEMPOTENCY_LEASE and IDEMPOTENCY_TTL
            "ttl": "86400",
            "tombstone_ttl": "2592000",  # IDEMPOTENCY_TOMBSTONE_TTL's default, 30 days
            "status": "completed",
            "attempt": "1",
            "response_status": "201",
            "response_headers": json.dumps(
                [["Content-Type", "application/json"], ["Content-Length", str(len(body))]]
            ),
            "response_body": "\\x" + body.encode().hex(),
        }
        return [arg for name, value in values.items() for arg in ("-D", f"{name}={value}")]

    def run(self, seconds: float, tag: str, *, threads: int, connections: int) -> dict[str, Any]:
        logdir = self.workdir / f"pgbench-{tag}"
        logdir.mkdir()
        script = self.script()
        defines = self.defines()
        self.check_parameters(script.read_text(), [d.split("=", 1)[0] for d in defines[1::2]])
        cmd = [
            str(self.db.bin_dir / "pgbench"),
            *("-h", self.host, "-p", str(self.db.port), "-U", "postgres"),
            *("-n", "-M", "prepared", "-c", str(connections), "-j", str(threads)),
            *("-T", str(math.ceil(seconds)), "-f", str(script)),
            *defines,
            *("--log", f"--log-prefix={logdir}/tx"),
            DATABASE,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        out = self.processes.run(cmd, timeout=seconds + 60, cwd=logdir, env=env)
        tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)
        done = re.search(r"number of transactions actually processed: (\d+)", out)
        failed = re.search(r"number of failed transactions: (\d+)", out)
        if tps is None or done is None:
            raise BenchError(f"unexpected pgbench output:\n{out}")
        latencies = []
        for log_file in logdir.iterdir():
            for line in log_file.read_text().splitlines():
                fields = line.split()
                if len(fields) >= 3:
                    latencies.append(int(fields[2]) / 1000)
        shutil.rmtree(logdir)
        self.command = " ".join(
            c for c in cmd[1:] if not c.startswith(("-D", "tenant=")) and "=" not in c
        )
        return {
            "requests": int(done[1]),
            "rps": float(tps[1]),
            "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99),
            "errors_total": int(failed[1]) if failed else 0,
        }


def start_wrk(cmd: list[str]) -> subprocess.Popen[str]:
    """wrk in the background (for a profile taken while it runs)."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
