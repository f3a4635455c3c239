"""What every part of the benchmark shares: the variants, the request, small statistics
and HTTP helpers, and the one exception that aborts a run."""

from __future__ import annotations

import http.client
import json
import math
import socket
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
#: The database the benchmark creates in its throwaway server.
DATABASE = "bench"
#: The request body every variant sends (as bench/wrk.lua does).
BODY = b'{"amount": 1000, "currency": "eur"}'
MIMETYPE = "application/json"


class BenchError(RuntimeError):
    """Something the benchmark depends on failed; the message says what."""


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    path: str = ""
    mode: str = ""  # bench/wrk.lua's mode; "" for pgbench
    peer: str = ""  # the peer library it runs (bench/peers.py), "" for ours

    @property
    def is_pgbench(self) -> bool:
        return not self.path


VARIANTS = [
    Variant("a", "plain view, no idempotency", "/plain", "new"),
    Variant("b", "@idempotent, new key per request", "/idempotent", "new"),
    Variant("c", "@idempotent, replay of one key", "/idempotent", "replay"),
    Variant("d", "@idempotent, 10 % duplicate keys", "/idempotent", "mix"),
    Variant("e", "pgbench: the extension's claim + finish SQL"),
    Variant("f", "hand-rolled seed-style, new key", "/handrolled", "new"),
    Variant("p", "floor: bare INSERT + UPDATE, new key", "/floor", "new"),
    Variant("g", "Powertools + Redis, new key per request", "/powertools", "new", "powertools"),
    Variant("gr", "Powertools + Redis, replay of one key", "/powertools", "replay", "powertools"),
    Variant("o", "order view, plain (its own INSERT)", "/order-plain", "new"),
    Variant("ot", "order view, @idempotent(transactional=True)", "/order-transactional", "new"),
    Variant("oh", "order view, hand-rolled + its INSERT", "/order-handrolled", "new"),
    Variant("pt", "order view, floor: one transaction", "/order-floor", "new"),
    Variant("h", "Flask-Idempotent 0.1.0, new key", "/flask-idempotent", "new", "flask_idempotent"),
]
BY_NAME = {v.name: v for v in VARIANTS}


def parse_variants(text: str) -> list[str]:
    """``abcf`` (one letter each) or ``a,b,gr`` (names); unknown names raise ValueError."""
    names = [n.strip() for n in text.split(",")] if "," in text else list(text)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise ValueError(f"unknown variants {unknown}; known: {', '.join(BY_NAME)}")
    return list(dict.fromkeys(names))


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(pct / 100 * len(ordered)) - 1))
    return ordered[index]


def median(values: Iterable[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def post(port: int, path: str, key: str | None) -> tuple[int, bool]:
    """One POST like wrk's; returns (status, replayed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": MIMETYPE}
    if key is not None:
        headers["Idempotency-Key"] = key
    try:
        conn.request("POST", path, body=BODY, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status, response.getheader("Idempotent-Replayed") == "true"
    finally:
        conn.close()


def get_json(port: int, path: str) -> Any:
    """The JSON answer to a GET, or None if there is none (yet)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return json.loads(response.read()) if response.status == 200 else None
    except (OSError, ValueError):
        return None
    finally:
        conn.close()
