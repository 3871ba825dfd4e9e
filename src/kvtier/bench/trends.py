"""Trends of a soak run's process samples (kvtier.bench.procstat's rows): growth, slopes, tables.

:func:`process_summary` and :func:`group_series` turn the rows into growth figures, with
:func:`slope` (a least-squares fit) for trends and :func:`group_rss` for the whole group's;
:func:`process_table` and :func:`thread_changes` render them as markdown. Pure functions of
the rows: no /proc, no psutil.
"""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``xs``; None with fewer than 3 points or one x."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def _rounded(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def process_summary(rows: list[Row], warmup_s: float, end_s: float) -> list[Row]:
    """Per process (by pid) over its rows up to ``end_s``, from ``warmup_s`` on: RSS at the
    first and last of those samples, growth (MiB, %), fitted slopes of RSS and RssAnon
    (MiB/min; RSS also over the second half of the run), fd, non-socket fd and thread
    ranges, the most fds in the first and in the last quarter of the samples, the most pool
    fds. A process with fewer than two such samples gets a ``note`` instead."""
    by_pid: dict[int, list[Row]] = {}
    for r in rows:
        if r["t_s"] <= end_s + 1e-6:
            by_pid.setdefault(r["pid"], []).append(r)
    out = []
    for pid, samples in sorted(by_pid.items()):
        post = [s for s in samples if s["t_s"] >= warmup_s]
        entry: Row = {"pid": pid, "process": samples[-1]["process"], "samples": len(samples)}
        out.append(entry)
        if len(post) < 2:
            entry["note"] = "not present after warm-up (short-lived)"
            continue
        first, last = post[0], post[-1]
        growth = last["rss_mib"] - first["rss_mib"]
        minutes = [s["t_s"] / 60 for s in post]
        late = [s for s in post if s["t_s"] >= end_s / 2]
        q = max(1, len(post) // 4)
        non_socket = [s["fds"] - s["fd_sockets"] for s in post]
        entry.update({
            "rss_warm_mib": round(first["rss_mib"], 1), "rss_end_mib": round(last["rss_mib"], 1),
            "growth_mib": round(growth, 1), "growth_pct": round(100 * growth / first["rss_mib"], 2),
            "slope_mib_per_min": _rounded(slope(minutes, [s["rss_mib"] for s in post])),
            "anon_slope_mib_per_min": _rounded(slope(minutes, [s["rss_anon_mib"] for s in post])),
            "second_half_slope_mib_per_min": _rounded(slope([s["t_s"] / 60 for s in late],
                                                            [s["rss_mib"] for s in late])),
            "fds_min": min(s["fds"] for s in post), "fds_max": max(s["fds"] for s in post),
            "fds_first_quarter_max": max(s["fds"] for s in post[:q]),
            "fds_last_quarter_max": max(s["fds"] for s in post[-q:]),
            "non_socket_fds_min": min(non_socket), "non_socket_fds_max": max(non_socket),
            "pool_fds_max": max(s["fd_pool_files"] for s in post),
            "threads_min": min(s["threads"] for s in post), "threads_max": max(s["threads"] for s in post),
        })
    return out


def group_series(rows: list[Row], key: str) -> dict[float, float]:
    """``key`` summed over the processes of each sample: ``t_s`` -> total."""
    series: dict[float, float] = {}
    for r in rows:
        series[r["t_s"]] = series.get(r["t_s"], 0.0) + r[key]
    return series


def group_rss(rows: list[Row], warmup_s: float, end_s: float) -> Row:
    """The group's summed RSS over the samples from ``warmup_s`` to ``end_s``: its fitted slope
    (MiB/min; also over the second half of the run, from ``end_s / 2``) and its first and last
    values, under the keys ``group_rss_slope_mib_per_min``,
    ``group_rss_second_half_slope_mib_per_min``, ``group_rss_warm_mib`` and ``group_rss_end_mib``."""
    rss = group_series([r for r in rows if r["t_s"] <= end_s + 1e-6], "rss_mib")
    post = sorted((t, v) for t, v in rss.items() if t >= warmup_s)
    late = [(t, v) for t, v in post if t >= end_s / 2]
    return {"group_rss_slope_mib_per_min": _rounded(slope([t / 60 for t, _ in post], [v for _, v in post])),
            "group_rss_second_half_slope_mib_per_min": _rounded(slope([t / 60 for t, _ in late],
                                                                      [v for _, v in late])),
            "group_rss_warm_mib": round(post[0][1], 1) if post else None,
            "group_rss_end_mib": round(post[-1][1], 1) if post else None}


def _cells(*cells: Any) -> str:
    return "| " + " | ".join("—" if c is None else str(c) for c in cells) + " |"


def process_table(procs: list[Row], group: Row) -> list[str]:
    """Markdown table of :func:`process_summary`'s entries and a last row of :func:`group_rss`'s."""
    lines = ["| process | pid | RSS warm (MiB) | RSS end (MiB) | growth (MiB) | growth (%) | slope (MiB/min) | "
             "anon slope (MiB/min) | 2nd-half slope (MiB/min) | fds min..max | fds first/last quarter max | "
             "non-socket fds | threads |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in procs:
        lines.append(_cells(p["process"], p["pid"], p["note"], *[""] * 10) if "note" in p else _cells(
            p["process"], p["pid"], p["rss_warm_mib"], p["rss_end_mib"], p["growth_mib"], p["growth_pct"],
            p["slope_mib_per_min"], p["anon_slope_mib_per_min"], p["second_half_slope_mib_per_min"],
            f"{p['fds_min']}..{p['fds_max']}", f"{p['fds_first_quarter_max']}/{p['fds_last_quarter_max']}",
            f"{p['non_socket_fds_min']}..{p['non_socket_fds_max']}", f"{p['threads_min']}..{p['threads_max']}"))
    g = group
    lines.append(_cells("group", "", g["group_rss_warm_mib"], g["group_rss_end_mib"], "", "",
                        g["group_rss_slope_mib_per_min"], "", g["group_rss_second_half_slope_mib_per_min"],
                        "", "", "", ""))
    return lines


def thread_changes(threads: dict[str, list[dict[str, Any]]], names: dict[str, str]) -> list[str]:
    """Markdown bullets, one per process whose thread names changed between the first and the
    last entry of ``threads`` (:attr:`GroupSampler.threads`, pids as strings): the counts that
    changed and when; ``names``: pid -> role."""
    changed = []
    for pid, seen in threads.items():
        first, last = seen[0]["names"], seen[-1]["names"]
        diff = [f"{n} {first.get(n, 0)}→{last.get(n, 0)}" for n in sorted({*first, *last})
                if first.get(n, 0) != last.get(n, 0)]
        if diff:
            times = ", ".join(f"{x['t_s']:g}" for x in seen[1:])
            changed.append(f"* {names.get(pid, pid)} ({pid}): {'; '.join(diff)} (changes at t = {times} s)")
    return changed
