"""The soak's report (text) and its plot (PNG): size and p99 over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20


def report(results: dict[str, Any]) -> str:
    c, m = results["claims"], results["machine"]
    lines = [
        f"soak: {results['command']}",
        f"machine: {m['cpus']} CPUs, busy {m['busy_before_start']:.0%} before the start,"
        f" 8 KiB fdatasync {m['fdatasync_8k_us']} us",
        "",
        f"claims on a big table ({c['empty']['claims']} sequential claims each):",
        f"  empty table        p50 {c['empty']['p50_ms']:.2f} ms  p99 {c['empty']['p99_ms']:.2f} ms"
        f"  max {c['empty']['max_ms']:.2f} ms",
        f"  {c['keys']:>10,} keys  p50 {c['loaded']['p50_ms']:.2f} ms  p99"
        f" {c['loaded']['p99_ms']:.2f} ms  max {c['loaded']['max_ms']:.2f} ms",
        f"  ratio loaded/empty: p50 {c['p50_ratio']:.2f}, p99 {c['p99_ratio']:.2f}"
        f" (bulk load {c['load_seconds']} s, {c['size_bytes'] / MIB:,.0f} MiB)",
    ]
    if "rate" not in results:  # --soak-minutes 0
        return "\n".join(lines) + "\n"
    r = results["rate"]
    lines += [
        "",
        f"full rate with IDEMPOTENCY_TTL={r['ttl']} s (the prober's keys:"
        f" {results['options'].get('soak_probe_ttl', '24 h')} s), flask idempotency-clean every"
        f" {results['options']['soak_clean_every']} s, {len(r['chunks'])} chunks:",
        f"  requests {sum(ch['requests'] for ch in r['chunks']):,},"
        f" errors {sum(ch['errors_total'] for ch in r['chunks'])},"
        f" median {_median([ch['rps'] for ch in r['chunks']]):.0f} req/s",
        f"  p99 first fifth {r['p99_first_fifth_ms']:.1f} ms, last fifth"
        f" {r['p99_last_fifth_ms']:.1f} ms: drift {r['p99_drift']:+.0%}",
        f"  size (table + indexes): max in the first half {r['size_max_first_half'] / MIB:,.1f}"
        f" MiB, in the second half {r['size_max_second_half'] / MIB:,.1f} MiB,"
        f" at the end {r['size_end'] / MIB:,.1f} MiB",
        *(
            f"    {name}: {g['start'] / MIB:,.1f} MiB at the start,"
            f" max {g['first_half_max'] / MIB:,.1f} in the first half,"
            f" {g['second_half_max'] / MIB:,.1f} in the second"
            f" ({(g['second_half_max'] - g['first_half_max']) / MIB:+.1f}),"
            f" {g['end'] / MIB:,.1f} at the end"
            for name, g in r.get("relations", {}).items()
            if name != "total"  # the line above
        ),
        f"  cleaner: {len(r['cleans'])} runs, longest {_f(r['clean_seconds_max'], 's')},"
        f" {r['clean_failures']} failed",
        f"  probe claims: {r['probe_claims']}, {r['probe_claims_while_cleaning']} while the"
        f" cleaner ran: longest {_f(r['longest_claim_while_cleaning_ms'], 'ms')}, p99"
        f" {_f(r['p99_claim_while_cleaning_ms'], 'ms')}; otherwise longest"
        f" {_f(r['longest_claim_otherwise_ms'], 'ms')},"
        f" p99 {_f(r['p99_claim_otherwise_ms'], 'ms')}",
        f"  keys executed {r['keys_executed']:,}, executed twice or more:"
        f" {r['keys_executed_twice']}",
    ]
    if r.get("workers"):
        exits = ", ".join(f"{name} exited {code}" for name, code in r["workers"].items())
        lines.append(f"  completer and dispatcher (--loop 1) ran all along: {exits}")
    if r["errors"]:
        lines.append(f"  background errors: {r['errors']}")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    # matplotlib comes with the bench extra (setup.cfg), which the dev environment that
    # type-checks bench/ lacks: there it is Any; where it is installed the ignores go unused
    # (unused-ignore).
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    r = results["rate"]
    fig, (size_ax, p99_ax) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    t = [s["t"] / 60 for s in r["sizes"]]
    base = r["sizes"][0]["total"] if r["sizes"] else 0
    size_ax.plot(t, [(s["total"] - base) / MIB for s in r["sizes"]], label="table + indexes")
    size_ax.plot(
        t,
        [(s["heap"] - r["sizes"][0]["heap"]) / MIB for s in r["sizes"]],
        label="table (heap) alone",
    )
    first = r["sizes"][0].get("indexes", {}) if r["sizes"] else {}
    for name in sorted(first):
        size_ax.plot(
            t,
            [(s["indexes"].get(name, 0) - first[name]) / MIB for s in r["sizes"]],
            lw=0.8,
            label=name.removeprefix("idempotency_keys_"),
        )
    size_ax.set_ylabel(f"MiB above the start\n({base / MIB:,.0f} MiB)")
    size_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    size_ax.set_title(
        f"{results['claims']['keys']:,} keys loaded, then full rate with IDEMPOTENCY_TTL="
        f"{r['ttl']} s{_probe_ttl(results)} and idempotency-clean every"
        f" {results['options']['soak_clean_every']} s",
        fontsize=10,
    )
    mid = [(ch["start"] + ch["end"]) / 120 for ch in r["chunks"]]
    p99_ax.plot(mid, [ch["p99_ms"] for ch in r["chunks"]], marker=".", label="HTTP p99 (wrk)")
    p99_ax.plot(mid, [ch["p50_ms"] for ch in r["chunks"]], marker=".", label="HTTP p50 (wrk)")
    probes = r["probes"]
    p99_ax.plot(
        [p[0] / 60 for p in probes],
        [p[1] for p in probes],
        ",",
        alpha=0.4,
        label="one claim (prober)",
    )
    for clean in r["cleans"]:
        for ax in (size_ax, p99_ax):
            ax.axvspan(clean["start"] / 60, clean["end"] / 60, color="grey", alpha=0.15, lw=0)
    p99_ax.set_ylabel("ms")
    p99_ax.set_xlabel("minutes (grey: idempotency-clean running)")
    p99_ax.set_yscale("log")
    p99_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def _probe_ttl(results: dict[str, Any]) -> str:
    """ ", the prober's keys: N s" when they live longer than the app's (a mix of TTLs)."""
    probe = results["options"].get("soak_probe_ttl")
    return f" (the prober's keys: {probe} s)" if probe and probe != results["rate"]["ttl"] else ""


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def _f(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.1f} {unit}"
