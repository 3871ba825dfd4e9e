"""The soak run's figures, verdicts and markdown, from its request records and process samples.

benchmarks/soak.py drives the load, samples the engine's processes (kvtier.bench.procstat) and
hands the records, the samples and the connector's metrics files here: per-level request
figures (:func:`level_stats`), the concurrency ramp's choice (:func:`pick_level`), the stalls,
the connector counters (:func:`kvtier_counters`), the verdicts (:func:`summarize`: memory and
fds flat, no dropped write, no failed request) and ``summary.md`` (:func:`markdown`).

A request the random-weight model answers in full but with tokens that decode to no text is an
*empty completion* (:func:`is_empty`), not a failure (:func:`is_failure`).
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path
from typing import Any

from kvtier.bench import trends
from kvtier.bench.client import Record
from kvtier.bench.summary import percentile

MiB = 1 << 20
EMPTY = "the stream ended without any text"  # the LoadClient's record of a text-less stream


def is_empty(record: Record) -> bool:
    """Answered in full (HTTP 200, usage reports the tokens) but no token decoded to text."""
    return record.get("error") == EMPTY and record.get("status") == 200 and (record.get("output_tokens") or 0) > 0


def is_failure(record: Record) -> bool:
    return record.get("error") is not None and not is_empty(record)


def ttft_stats(records: list[Record]) -> dict[str, Any]:
    ok = [r["ttft_s"] for r in records if r.get("error") is None and r.get("ttft_s") is not None]
    p50, p99 = percentile(ok, 50), percentile(ok, 99)
    return {"requests": len(records), "errors": sum(map(is_failure, records)), "empty": sum(map(is_empty, records)),
            "ttft_p50_s": None if p50 is None else round(p50, 3), "ttft_p99_s": None if p99 is None else round(p99, 3)}


def level_stats(records: list[Record], seconds: float) -> dict[str, Any]:
    prompt = sum(r.get("prompt_tokens") or 0 for r in records)
    cached = sum(r.get("cached_tokens") or 0 for r in records)
    return {**ttft_stats(records), "requests_per_s": round(len(records) / seconds, 2),
            "output_tok_s": round(sum(r.get("output_tokens") or 0 for r in records) / seconds, 1),
            "cached_fraction": round(cached / prompt, 3) if prompt else None}


def stalls(records: list[Record], took: float, threshold: float) -> list[dict[str, float]]:
    """Spells of ``threshold`` s or more in which no request got its first token or ended (with
    the slots' requests always in flight: the engine, or the machine, standing still)."""
    events = sorted([r["start_s"] + r["ttft_s"] for r in records if r.get("ttft_s") is not None]
                    + [r["start_s"] + r["e2e_s"] for r in records if r.get("e2e_s") is not None])
    events = [e for e in events if e <= took]
    return [{"t_s": round(a, 1), "seconds": round(b - a, 1)} for a, b in itertools.pairwise(events)
            if b - a >= threshold]


def kvtier_counters(metrics: dict[str, Any]) -> dict[str, Any]:
    """The report's figures from the worker's metrics file (and the scheduler's, for matches).

    Loads are the worker's ``loaded_tokens`` and the pool tier's ``bytes_read``; host DRAM's
    ``bytes_read`` also counts every save's presence check, so it is shown apart.
    """
    w, sched = metrics.get("worker", {}), metrics.get("scheduler", {})
    if "error" in w:
        return {"error": w["error"]}
    store, tiers, conn = w.get("store", {}), w.get("tiers", {}), w.get("connector", {})
    host, pool, sstore = tiers.get("host", {}), tiers.get("pool", {}), sched.get("store") or {}

    def total(key: str) -> int:
        return sum(int(t.get(key, 0)) for t in tiers.values()) + int(store.get(key, 0))

    return {
        **{k: total(k) for k in ("dropped_writes", "failed_writes", "failed_reads", "timeouts", "corrupt_chunks")},
        "write_queue_at_exit": w.get("write_queue"), "saved_chunks": conn.get("saved_chunks"),
        "host_written_chunks": host.get("written_chunks"), "pool_written_chunks": pool.get("written_chunks"),
        "pool_written_mib": round(pool.get("bytes_written", 0) / MiB),
        "matched_tokens": (sched.get("connector") or {}).get("matched_tokens"),
        "loaded_tokens": conn.get("loaded_tokens"), "failed_blocks": conn.get("failed_blocks"),
        "pool_bytes_read_mib": round(pool.get("bytes_read", 0) / MiB),
        "host_bytes_read_mib (incl. save checks)": round(host.get("bytes_read", 0) / MiB),
        "host_evictions": host.get("evictions"), "pool_evictions": pool.get("evictions"),
        "pool_evicted_mib": round(pool.get("evicted_bytes", 0) / MiB),
        "scheduler_lookups": sstore.get("lookups"), "scheduler_hit_chunks": sstore.get("hit_chunks"),
    }


def pick_level(levels: list[dict[str, Any]], ttft_limit: float, min_gain: float) -> int | None:
    """The highest level, climbing, with no error and TTFT p99 within ``ttft_limit`` and (above the
    lowest) ``min_gain`` more requests/s than the level below: past that knee sessions only queue."""
    chosen, prev_rate = None, None
    for lv in levels:
        ok = lv["errors"] == 0 and lv["ttft_p99_s"] is not None and lv["ttft_p99_s"] <= ttft_limit
        if ok and prev_rate is not None and lv["requests_per_s"] < (1 + min_gain) * prev_rate:
            lv["verdict"] = f"saturated (requests/s gain under {min_gain:.0%})"
            break
        lv["verdict"] = "sustained" if ok else "not sustained"
        if not ok:
            break
        chosen, prev_rate = lv["concurrency"], lv["requests_per_s"]
    return chosen


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}



def summarize(args: argparse.Namespace, concurrency: int, records: list[Record], rows: list[dict[str, Any]],
              end_s: float, took: float, counters: dict[str, Any]) -> dict[str, Any]:
    """summary.json of a soak at ``concurrency``: load figures, per-process trends of the sample
    ``rows`` after the warm-up up to ``end_s``, the connector ``counters`` and the verdicts. Reads
    ``args.seconds``, ``warmup_fraction``, ``mem_slope_limit``, ``fd_slack`` and ``interval``."""
    dur, limit = args.seconds, args.mem_slope_limit
    warmup_s = args.warmup_fraction * dur
    procs, group = trends.process_summary(rows, warmup_s, end_s), trends.group_rss(rows, warmup_s, end_s)
    total_fit = group["group_rss_slope_mib_per_min"]
    errors, empty = sum(map(is_failure, records)), sum(map(is_empty, records))
    error_kinds: dict[str, int] = {}
    for r in records:
        if r.get("error"):
            error_kinds[r["error"][:120]] = error_kinds.get(r["error"][:120], 0) + 1
    worst = max((p for p in procs if p.get("slope_mib_per_min") is not None),
                key=lambda p: p["slope_mib_per_min"], default=None)
    mem_ok = total_fit is not None and total_fit <= limit and (worst is None or worst["slope_mib_per_min"] <= limit)
    fd_ok = all(p["fds_last_quarter_max"] <= p["fds_first_quarter_max"] + args.fd_slack for p in procs
                if "fds_min" in p)
    fds = trends.group_series([r for r in rows if warmup_s <= r["t_s"] <= end_s + 1e-6], "fds")
    fd_lo, fd_hi = (int(min(fds.values())), int(max(fds.values()))) if fds else (0, 0)
    dropped, failed = counters.get("dropped_writes"), counters.get("failed_writes")
    nan = float("nan")
    verdicts = {
        "memory": {"ok": mem_ok, "line": f"memory growth: {total_fit if total_fit is not None else nan:+.2f} "
                   f"MiB/min over the group, worst process {worst['process'] if worst else '-'} "
                   f"{worst['slope_mib_per_min'] if worst else nan:+.2f} MiB/min "
                   f"({'flat' if mem_ok else 'GROWING'}; threshold {limit:g} MiB/min)"},
        "fds": {"ok": fd_ok, "line": f"fds: {fd_lo}..{fd_hi} over the group after warm-up "
                f"({'flat' if fd_ok else 'GROWING'}; threshold: last-quarter max <= first-quarter max + "
                f"{args.fd_slack} per process)"},
        "dropped_writes": {"ok": dropped == 0, "line": f"dropped writes: {dropped} (failed writes: {failed})"},
        "errors": {"ok": errors == 0 and bool(records), "line": f"errors: {errors} of {len(records)} requests" + (
            f" (and {empty} empty completions: HTTP 200, every token generated, none decoding to text)" if empty
            else "")},
    }
    return {
        "seconds": dur, "load_seconds": round(took, 1), "concurrency": concurrency, "interval_s": args.interval,
        "warmup_s": warmup_s, "machine": {"cores": os.cpu_count(), "load_avg": os.getloadavg()},
        "settings": settings(args), "requests": len(records), "errors": errors, "empty_completions": empty,
        "error_kinds": error_kinds, "overall": level_stats(records, took) if records else {},
        "first_tenth": ttft_stats([r for r in records if r["start_s"] < dur / 10]),
        "last_tenth": ttft_stats([r for r in records if r["start_s"] >= dur * 9 / 10]),
        **group, "processes": procs, "kvtier": counters, "verdicts": verdicts,
    }


def show(v: Any) -> str:
    return "—" if v is None else str(v)


def row(*cells: Any) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown(s: dict[str, Any]) -> str:
    o, a, b, st, lg = s["overall"], s["first_tenth"], s["last_tenth"], s["stalls"], s["log"]
    lines = [f"# Soak run: {s['seconds']:g} s at concurrency {s['concurrency']}", "",
             f"kvtier {s.get('kvtier_commit') or '(unknown commit)'}; {s['machine']['cores']} cores; "
             f"machine load average at the end {s['machine']['load_avg'][0]:.1f}.", "",
             *(f"* {v['line']}" for v in s["verdicts"].values()), "", "## Load", "",
             "| | requests | errors | TTFT p50 (s) | TTFT p99 (s) |", "|---|---|---|---|---|",
             row("whole run", s["requests"], s["errors"], show(o.get("ttft_p50_s")), show(o.get("ttft_p99_s"))),
             *(row(name, x["requests"], x["errors"], show(x["ttft_p50_s"]), show(x["ttft_p99_s"]))
               for name, x in (("first tenth", a), ("last tenth", b))), "",
             f"{show(o.get('requests_per_s'))} requests/s, {show(o.get('output_tok_s'))} output tok/s, cached "
             f"fraction of prompt tokens {show(o.get('cached_fraction'))}; {s['contexts']['sessions']} sessions, "
             f"{s['contexts']['new_contexts']} distinct contexts.", "",
             f"Stalls (no first token and no request end for {s['settings']['stall_seconds']:g} s or more, while "
             f"sessions were in flight): {len(st)}" + (
                 f", longest {max(x['seconds'] for x in st)} s; at t = "
                 + ", ".join(f"{x['t_s']:g} s ({x['seconds']:g} s)" for x in st[:12])
                 + f". Thread snapshots taken during them: {s['stall_snapshots']} (stalls.jsonl)." if st else "."), "",
             f"## Processes (after warm-up: the first {s['warmup_s']:g} s)", "",
             *trends.process_table(s["processes"], s), "", "## kvtier (worker metrics at shutdown)", "",
             "| counter | value |", "|---|---|", *(row(key, show(val)) for key, val in s["kvtier"].items())]
    killed = f"; killed after the wait: {', '.join(s['killed'])}" if s.get("killed") else ""
    lines += ["", f"Engine: ready in {s['engine_start_s']} s, stopped in {s['stop_s']} s (exit status "
              f"{s['exit_status']}{killed}); log: {lg.get('during_run_error_lines')} ERROR lines before the stop, "
              f"{lg.get('error_lines')} in all, {lg.get('tracebacks')} tracebacks, {lg.get('warning_lines')} WARNING "
              "lines."]
    changed = trends.thread_changes(s["thread_names"], {str(p["pid"]): p["process"] for p in s["processes"]})
    if changed:
        lines += ["", "Threads by name, first sample → last (summary.json has every change):", "", *changed]
    missing = [role for role, m in s["kvtier_metrics"].items() if "error" in m]
    if missing:
        lines += ["", f"Metrics files not written: {', '.join(missing)} (see summary.json)."]
    if s.get("ramp"):
        lines += ["", "## Concurrency ramp", *ramp_markdown(s["ramp"], s["concurrency"]).splitlines()[1:]]
    if s["error_kinds"]:
        lines += ["", "## Error messages (failures and empty completions)", "",
                  *(f"* {n} x {e}" for e, n in s["error_kinds"].items())]
    return "\n".join(lines) + "\n"


def ramp_markdown(levels: list[dict[str, Any]], chosen: int) -> str:
    lines = ["# Concurrency ramp", "", "| concurrency | requests | errors | TTFT p50 (s) | TTFT p99 (s) | requests/s | "
             "output tok/s | verdict |", "|---|---|---|---|---|---|---|---|",
             *(row(lv["concurrency"], lv["requests"], lv["errors"], show(lv["ttft_p50_s"]), show(lv["ttft_p99_s"]),
                   lv["requests_per_s"], lv["output_tok_s"], lv.get("verdict", "—")) for lv in levels)]
    return "\n".join([*lines, "", f"Chosen: concurrency {chosen}."]) + "\n"
