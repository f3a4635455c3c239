"""The report printed at the end of a run (and written to bench/out/report.txt), from the
results alone: each section is a function of the results that writes lines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.common import BY_NAME, VARIANTS

Write = Callable[[str], None]

#: (label, numerator, denominator, what it compares, target or None)
RATIOS = [
    ("b/a", "b", "a", "new key vs plain", 0.30),
    ("c/a", "c", "a", "replay vs plain", 0.75),
    ("b/f", "b", "f", "new key vs hand-rolled", 1.20),
    ("b/e", "b", "e", "new key vs the database's ceiling", None),
    ("d/a", "d", "a", "10 % duplicates vs plain", None),
    ("b/g", "b", "g", "new key vs Powertools + Redis", 1.00),
    ("c/gr", "c", "gr", "replay vs Powertools + Redis", 1.20),
    ("ot/o", "ot", "o", "order view: transactional=True vs plain with its write", 0.70),
    ("oh/o", "oh", "o", "order view: hand-rolled vs plain with its write", None),
    ("ot/oh", "ot", "oh", "order view: transactional=True vs hand-rolled", None),
    ("b/p", "b", "p", "new key vs the floor (2 statements)", None),
    ("p/f", "p", "f", "the floor vs hand-rolled", None),
    ("p/g", "p", "g", "the floor vs Powertools + Redis", None),
    ("ot/pt", "ot", "pt", "order view: transactional=True vs floor", None),
    ("pt/o", "pt", "o", "order view: floor vs plain with its write", None),
]


def render_report(results: dict[str, Any]) -> str:
    out: list[str] = []
    w = out.append
    for section in (
        header,
        throughput,
        ratios,
        latency,
        peers,
        cpu,
        database,
        counted,
        rss,
        duplicates,
        inprocess,
        profiles,
        targets,
        lean_key_targets,
    ):
        section(results, w)
    w("")
    w(f"elapsed: {results.get('elapsed_s', '?')} s")
    return "\n".join(out) + "\n"


def header(results: dict[str, Any], w: Write) -> None:
    settings = results["settings"]
    machine = results["machine"]
    w("flask-idempotency benchmark")
    w(
        f"machine: {machine['cpus']} x {machine['cpu']}, {machine['memory_gib']} GiB,"
        f" Linux {machine['kernel']}, Python {machine['python']},"
        f" fdatasync of 8 KiB: {machine['fdatasync_8k_us']} us; CPUs busy before the run:"
        f" {machine['busy_before_start']:.0%}"
    )
    pg = settings["postgres"]
    w(
        f"PostgreSQL {pg['server_version']}: fsync={pg['fsync']}"
        f" synchronous_commit={pg['synchronous_commit']}"
        f" full_page_writes={pg['full_page_writes']} wal_sync_method={pg['wal_sync_method']}"
        f" shared_buffers={pg['shared_buffers']}"
    )
    start, end = results.get("library_at_start", {}), results.get("library_at_end", {})
    measured = results.get("measured_sources", {})
    w(
        f"flask-idempotency: commit {start.get('commit')}, uncommitted changes in"
        f" flask_idempotency/: {start.get('library_modified')}; measured sources"
        f" {measured.get('sha256')} ({measured.get('path')})"
    )
    if measured.get("sha256") != start.get("library_sha256"):
        w("WARNING: the measured sources differ from the repository's at the start")
    if start and end and start.get("library_sha256") != end.get("library_sha256"):
        w(
            f"(the repository's flask_idempotency/ changed during the run, now commit"
            f" {end.get('commit')}; this run measured its snapshot from the start)"
        )
    overrides = settings.get("idempotency_overrides") or {}
    w("extension settings: defaults" + "".join(f", {k}={v}" for k, v in sorted(overrides.items())))
    w(
        "transport to PostgreSQL (the app's pools, pgbench, the counted phase):"
        f" {settings.get('transport', 'TCP 127.0.0.1')}"
    )
    w(f"gunicorn {machine['gunicorn']}: {settings['gunicorn']['main']}")
    w(f"wrk ({machine['wrk']}): {settings['wrk']}")
    w(f"pgbench: {settings.get('pgbench', '-')}")
    w(
        f"Flask {machine['flask']}, psycopg {machine['psycopg']};"
        f" {settings['rounds']} alternating rounds per variant, medians"
    )


def throughput(results: dict[str, Any], w: Write) -> None:
    s = results["summary"]
    w("")
    w(
        f"{'':3}{'variant':45} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'non-2xx':>7}"
        "  req/s of each round"
    )
    for v in VARIANTS:
        if v.name in s:
            r = s[v.name]
            rounds = " ".join(f"{x:.0f}" for x in r["rps_rounds"])
            w(
                f"{v.name:2} {v.label:45} {r['rps']:8.1f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f}"
                f" {r['errors']:7d}  {rounds}"
            )
    for peer in results.get("peers", {}).values():
        for v in peer["variants"]:
            if v not in s:
                w(f"{v:2} {BY_NAME[v].label:45} not measured (see 'peers' below)")
    w("(non-2xx: wrk's errors and non-2xx answers over all rounds; in c, d and gr these are")
    w("the 409 answers to duplicates that arrived while their first request still ran)")
    if results.get("discarded_rounds"):
        w(
            f"{len(results['discarded_rounds'])} round(s) repeated because other processes used"
            " the CPU meanwhile: "
            + ", ".join(
                f"{d['variant']} {d['rps']:.0f} req/s ({d['foreign_cpu_share']:.0%})"
                for d in results["discarded_rounds"]
            )
        )


def ratios(results: dict[str, Any], w: Write) -> None:
    s = results["summary"]
    w("")
    w("ratios of the medians (req/s), same run:")
    found = {}
    for label, num, den, text, target in RATIOS:
        if num not in s or den not in s:
            continue
        value = s[num]["rps"] / s[den]["rps"]
        per_round = [
            x["rps"] / y["rps"]
            for x, y in zip(results["rounds"][num], results["rounds"][den], strict=False)
        ]
        found[label] = value
        verdict = ""
        if target is not None:
            met = "MET" if value >= target else "NOT MET"
            verdict = f"issue 24's target >= {target:.2f}: {met}"
        low, high = min(per_round), max(per_round)
        w(f"  {label:4} {text:36} {value:5.2f}  (rounds {low:.2f}-{high:.2f})  {verdict}".rstrip())
    results["ratios"] = found


def latency(results: dict[str, Any], w: Write) -> None:
    if "latency" not in results:
        return
    lat = results["latency"]
    w("")
    w(f"latency at low load, sequential ({results['settings'].get('latency', '')}):")
    w("one client, one connection, the next request sent when the last one was answered;")
    w("added: over the plain view (a), p50 over p50 and p99 over p99")
    w(
        f"  {'':3}{'variant':42} {'p50 ms':>7} {'p99 ms':>7} {'added p50':>9}"
        f" {'added p99':>9} {'requests':>8}"
    )
    plain = lat.get("a")
    for v in VARIANTS:
        if v.name in lat:
            r = lat[v.name]
            added = ""
            if plain is not None and v.name != "a":
                added = (
                    f" {r['p50_ms'] - plain['p50_ms']:+9.2f} {r['p99_ms'] - plain['p99_ms']:+9.2f}"
                )
            else:
                added = f" {'':9} {'':9}"
            w(
                f"  {v.name:2} {v.label:42} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f}{added}"
                f" {r['requests']:8d}"
            )


def peers(results: dict[str, Any], w: Write) -> None:
    if "peers" not in results:
        return
    w("")
    w("peers, same app, same view body, same run:")
    for name, peer in results["peers"].items():
        w(f"  {name}: {peer.get('package', '?')}; {peer['status']}")
        if peer.get("install_log"):
            w(f"    pip: {peer['install_log'].splitlines()[-1]}")
        if peer.get("redis"):
            items = peer["redis_settings"].items()
            settings = ", ".join(f"{k} {v}" if v else f"{k} ''" for k, v in items)
            w(f"    {peer['redis'].split(' sha=')[0]} on 127.0.0.1: {settings}")
    w("  (Redis acknowledges a write before it is on disk: with appendfsync everysec up to a")
    w("  second of acknowledged keys is lost in a crash of the machine; a PostgreSQL commit")
    w("  with synchronous_commit=on answers only after its WAL flush)")


def cpu(results: dict[str, Any], w: Write) -> None:
    s = results["summary"]
    w("")
    w("CPU per request under load (medians, ms of CPU time): gunicorn (master and workers),")
    w("postgres (all its processes), redis-server, the load generator, the kernel")
    w("(interrupts, softirq and kernel threads: loopback TCP, disk), other processes on the")
    w("machine; how busy the CPUs were during the round:")
    w(
        f"  {'':3}{'total':>6} {'gunicorn':>9} {'postgres':>9} {'redis':>6} {'wrk/pgb':>8}"
        f" {'kernel':>7} {'others':>7} {'CPUs busy':>10}"
    )
    for v in VARIANTS:
        if v.name in s:
            c = s[v.name]["cpu_ms_per_request"]
            w(
                f"  {v.name:2} {c['busy']:6.2f} {c['gunicorn']:9.2f} {c['postgres']:9.2f}"
                f" {c.get('redis', 0.0):6.2f} {c['loadgen']:8.2f} {c['kernel']:7.2f}"
                f" {c['other']:7.2f} {s[v.name]['cpu_utilisation']:10.0%}"
            )


def database(results: dict[str, Any], w: Write) -> None:
    s = results["summary"]
    w("")
    w("database work per request under load (medians; statements: pg_stat_statements;")
    w("xids: transaction ids assigned; WAL flushes: pg_stat_io fsyncs of client backends,")
    w("then of all processes; fewer than commits when commits share a flush):")
    for v in VARIANTS:
        if v.name in s and v.name != "a" and not v.peer:
            d = s[v.name]["db_per_request"]
            w(
                f"  {v.name} {d['statements']:5.2f} statements {d['xids']:5.2f} xids"
                f" {d['wal_flushes']:5.2f} WAL flushes ({d['wal_flushes_all']:.2f} all)"
                f" {d['wal_bytes']:6.0f} WAL bytes {hot_share(d)}"
            )


def counted(results: dict[str, Any], w: Write) -> None:
    if "counted" not in results:
        return
    w("")
    w("counted per request, sequential (one client, a one-worker gunicorn whose pools")
    w("connect through a counting proxy; pg_stat_statements, pg_stat_io, transaction ids):")
    w(
        f"  {'':22} {'round trips':>11} {'statements':>10} {'xids':>5}"
        f" {'WAL flushes':>11} {'WAL bytes':>9} {'latency p50':>11}  HOT updates"
    )
    for c in results["counted"].values():
        w(
            f"  {c['label']:22} {c['round_trips']:11.2f} {c['statements']:10.2f}"
            f" {c['xids']:5.2f} {c['wal_flushes']:11.2f}"
            f" {c['statement_wal_bytes']:9.0f} {c['sequential_latency_ms_p50']:8.2f} ms"
            f"  {hot_share(c)}"
        )
    w("  (every statement is its own transaction, except in ot and pt: one transaction per")
    w("  request, BEGIN and COMMIT counted as statements; xids: the")
    w("  transactions that wrote; WAL flushes: fsyncs by client backends, pg_stat_io;")
    w("  WAL bytes: written by the statements themselves, pg_stat_statements)")
    for name in ("b", "c", "ot", "p", "pt"):
        if name not in results["counted"]:
            continue
        c = results["counted"][name]
        w(f"  statements of '{c['label']}' (calls per request, mean execution time):")
        for st in c["statement_calls"]:
            calls = st["calls"] / c["requests"]
            w(f"    {calls:5.2f} x {st['mean_exec_us']:6.1f} us  {st['query']}")
    b, c = results["counted"]["b"], results["counted"]["c"]
    ok_b = round(b["round_trips"], 2) <= 2.0 and round(b["wal_flushes"], 2) <= 2.0
    # Not WAL bytes: a read may prune dead row versions off a heap page and log that
    # (no transaction id, no commit record, so nothing to flush).
    ok_c = round(c["round_trips"], 2) <= 1.0 and round(c["wal_flushes"], 2) == 0
    w(
        "  target <= 2 round trips and <= 2 flushes per new key:"
        f" {'MET' if ok_b else 'NOT MET'}; 1 round trip and 0 flushes per replay:"
        f" {'MET' if ok_c else 'NOT MET'}"
    )


def rss(results: dict[str, Any], w: Write) -> None:
    if "rss" not in results:
        return
    r = results["rss"]
    w("")
    w(
        f"per-worker RSS around a long new-key run: {r['requests']} requests in"
        f" {r['seconds']} s ({r['rps']:.0f} req/s, {r['errors']} errors),"
        f" same worker processes throughout: {r['same_workers']}"
    )
    for worker in r["workers"]:
        w(
            f"  worker {worker['pid']}: after warm-up {worker['rss_after_warmup_kib']} KiB,"
            f" before {worker['rss_before_kib']} KiB, after {worker['rss_after_kib']} KiB"
            f" ({worker['requests']} requests in the long run)"
        )


def duplicates(results: dict[str, Any], w: Write) -> None:
    if "duplicates" not in results:
        return
    d = results["duplicates"]
    w("")
    w(
        f"10 % duplicates (d): {d['mix_requests']} requests, {d['mix_duplicates_sent']}"
        f" duplicates sent; {d['mix_created']} executed, {d['mix_replayed']} replayed,"
        f" {d['mix_conflicts_409']} x 409 in progress, {d['mix_other_status']} other"
    )
    w(
        f"  keys executed {d['mix_keys_executed']}, executions {d['mix_executions']},"
        f" keys executed more than once: {d['mix_keys_executed_twice_or_more']};"
        f" rows completed {d['mix_rows_completed']} of {d['mix_rows']}"
    )
    w(
        f"  whole run, @idempotent: {d['all_idempotent_keys_executed']} keys,"
        f" {d['all_idempotent_executions']} executions, double executions:"
        f" {d['all_idempotent_double_executions']};"
        f" hand-rolled: {d['handrolled_keys_executed']} keys,"
        f" double executions: {d['handrolled_double_executions']}"
    )
    if d.get("floor_keys_executed"):
        w(
            f"  floor (p, pt): {d['floor_keys_executed']} keys,"
            f" double executions: {d['floor_double_executions']}"
        )
    if d.get("powertools_keys_executed"):
        w(
            f"  Powertools + Redis: {d['powertools_keys_executed']} keys,"
            f" double executions: {d['powertools_double_executions']}"
        )


def inprocess(results: dict[str, Any], w: Write) -> None:
    if "inprocess" not in results:
        return
    m = results["inprocess"]
    plain = m["plain"]["cpu_us"]
    w("")
    w("CPU per request in one process (Flask test client, no HTTP server), sequential:")
    for name, label in (
        ("plain", "plain view"),
        ("new", "@idempotent, new key"),
        ("replay", "@idempotent, replay"),
        ("handrolled", "hand-rolled, new key"),
    ):
        r = m[name]
        extra = f"  ({r['cpu_us'] - plain:+.0f} us vs plain)" if name != "plain" else ""
        w(
            f"  {label:22} {r['cpu_us']:6.0f} us CPU (user {r['user_us']:.0f},"
            f" system {r['sys_us']:.0f}), wall {r['wall_us']:6.0f} us{extra}"
        )


def profiles(results: dict[str, Any], w: Write) -> None:
    for title, key in (("wall-clock profile", "profiles"), ("CPU profile", "cpu_profiles")):
        for name, profile in results.get(key, {}).items():
            w("")
            w(f"{title} of {name}:")
            head = profile["text"].split("\n\ntop self time")[0]
            for line in head.splitlines():
                w("  " + line)


def hot_share(counters: dict[str, Any]) -> str:
    """How many of the updates were HOT (pg_stat_user_tables), e.g. "0 % of 1.00 updates HOT"."""
    updates = counters.get("updates")
    if updates is None:  # a results.json from before HOT was counted
        return ""
    if updates < 0.005:
        return "no updates"
    return f"{counters['hot_updates'] / updates:.0%} of {updates:.2f} updates HOT"


def targets(results: dict[str, Any], w: Write) -> None:
    """The performance targets in one table: measured, target, met or not."""
    ratio = results.get("ratios", {})
    counted_b = results.get("counted", {}).get("b", {})
    counted_c = results.get("counted", {}).get("c", {})
    rows: list[tuple[str, str, str, bool | None]] = []
    for label, least in (
        ("b/f", 1.20),
        ("b/g", 1.00),
        ("c/gr", 1.20),
        ("b/a", 0.30),
        ("ot/o", 0.70),
    ):
        if label in ratio:
            rows.append((label, f"{ratio[label]:.2f}", f">= {least:.2f}", ratio[label] >= least))
    if counted_b:
        rows.append(
            (
                "WAL bytes per new key (statements)",
                f"{counted_b['statement_wal_bytes']:.0f}",
                "<= 600",
                counted_b["statement_wal_bytes"] <= 600,
            )
        )
        if counted_b.get("updates"):
            share = counted_b["hot_updates"] / counted_b["updates"]
            rows.append(("finishes that are HOT updates", f"{share:.0%}", ">= 90 %", share >= 0.9))
        rows.append(
            (
                "round trips / flushes per new key",
                f"{counted_b['round_trips']:.2f} / {counted_b['wal_flushes']:.2f}",
                "2 / 2",
                round(counted_b["round_trips"], 2) <= 2 and round(counted_b["wal_flushes"], 2) <= 2,
            )
        )
    if counted_c:
        rows.append(
            (
                "round trips / flushes per replay",
                f"{counted_c['round_trips']:.2f} / {counted_c['wal_flushes']:.2f}",
                "1 / 0",
                round(counted_c["round_trips"], 2) <= 1 and round(counted_c["wal_flushes"], 2) == 0,
            )
        )
    _target_table("targets (issue 24), this run:", rows, w)


def lean_key_targets(results: dict[str, Any], w: Write) -> None:
    """Issue 48's targets that this run measures: a new key's CPU under load at most the
    hand-rolled code's (so b/f >= 1.0 by rate), and its WAL at most 1.3x the floor's."""
    summary = results.get("summary", {})
    counted = results.get("counted", {})
    rows: list[tuple[str, str, str, bool | None]] = []
    if "b" in summary and "f" in summary:
        b, f = (summary[v]["cpu_ms_per_request"]["busy"] for v in ("b", "f"))
        rows.append(("CPU per new key under load / f's", f"{b / f:.2f}", "<= 1.00", b <= f))
        rate = summary["b"]["rps"] / summary["f"]["rps"]
        rows.append(("b/f by rate", f"{rate:.2f}", ">= 1.00", rate >= 1.0))
    wal_b = counted.get("b", {}).get("statement_wal_bytes")
    wal_p = counted.get("p", {}).get("statement_wal_bytes")
    if wal_b and wal_p:
        ratio = wal_b / wal_p
        name = "WAL per new key / the floor's (counted)"
        rows.append((name, f"{ratio:.2f}", "<= 1.30", ratio <= 1.3))
    _target_table("targets (issue 48), this run:", rows, w)


def _target_table(title: str, rows: list[tuple[str, str, str, bool | None]], w: Write) -> None:
    """*rows* (name, measured, target, met or None) under *title*; nothing if none."""
    if not rows:
        return
    w("")
    w(title)
    for name, measured, target, met in rows:
        verdict = "" if met is None else ("MET" if met else "NOT MET")
        w(f"  {name:38} {measured:>14}  target {target:11} {verdict}")
