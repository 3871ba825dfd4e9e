"""What the processes of an engine's group use, sampled from /proc (Linux), and its trends.

The soak run (``benchmarks/soak.py``) samples every process of a ``kvtier serve`` engine's
process group (API server, EngineCore, worker, helpers) with :class:`GroupSampler`: per
process (:func:`sample_process`) VmRSS and RssAnon in MiB, open fds by kind (sockets, pipes,
anon inodes, files under a pool directory, other files), threads, CPU seconds and state; the
names of its threads each time they change; and, per sample, machine-wide figures
(:meth:`GroupSampler.machine`: CPU busy/iowait/steal shares since the last sample, the load
average, vLLM processes of other groups, the pool directory's files and MiB). While the
engine stands still, :class:`StallRecorder` snapshots what each thread waits on. Then
:func:`process_summary` and :func:`group_series` turn the rows into growth figures, with
:func:`slope` (a least-squares fit) for trends, :func:`group_rss` for the whole group's,
and :func:`process_table` and :func:`thread_changes` render them as markdown. Nothing here
needs a dependency beyond the standard library; a process that exits between two reads is
skipped, never an error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench.engines import Process, group_pids, proc_stats, process_role

CLK_TCK = os.sysconf("SC_CLK_TCK")
MiB = 1 << 20
Row = dict[str, Any]


def proc_cpu(pid: int, tid: int | None = None) -> tuple[str, float]:
    """(state letter, user + system CPU seconds) of a process or one of its threads; OSError if gone."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[0], (int(fields[11]) + int(fields[12])) / CLK_TCK


def sample_process(pid: int, pool_dir: Path | None = None) -> Row | None:
    """One process: ``pid``, ``process`` (its role), ``state``, ``cpu_s``, ``rss_mib``,
    ``rss_anon_mib``, ``fds`` and by kind ``fd_sockets``, ``fd_pipes``, ``fd_anon``,
    ``fd_pool_files`` (under ``pool_dir``), ``fd_files`` (the rest), and ``threads``;
    None if it has gone."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    kinds = {"sockets": 0, "pipes": 0, "anon": 0, "pool_files": 0, "files": 0}
    prefixes = {"socket:": "sockets", "pipe:": "pipes", "anon_inode:": "anon"}
    pool = str(pool_dir) if pool_dir is not None else None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed between listdir and readlink
        kind = next((k for p, k in prefixes.items() if target.startswith(p)), None)
        kinds[kind or ("pool_files" if pool is not None and target.startswith(pool) else "files")] += 1
    try:
        state, cpu_s = proc_cpu(pid)
    except OSError:
        return None

    def mib(key: str) -> float:
        return int(status.get(key, "0 kB").split()[0]) / 1024

    return {"pid": pid, "process": process_role(pid), "state": state, "cpu_s": round(cpu_s, 2),
            "rss_mib": mib("VmRSS"), "rss_anon_mib": mib("RssAnon"), "fds": len(fds),
            **{f"fd_{k}": v for k, v in kinds.items()}, "threads": int(status.get("Threads", "0").strip())}


def thread_names(pid: int) -> dict[str, int]:
    """How many threads of each name (``/proc/PID/task/*/comm``), sorted by name: tells a pool
    that grows to its size from one that leaks. Empty if the process has gone."""
    names: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return names
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each thread name of ``pid`` (``/proc/PID/task/*``),
    summed over the threads of one name. Empty if the process has gone."""
    seconds: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return seconds
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            _, cpu_s = proc_cpu(pid, int(tid))
        except OSError:
            continue
        seconds[name] = seconds.get(name, 0.0) + cpu_s
    return seconds


def dir_usage(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path``; files that vanish during the walk are left out."""
    files = size = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                size += os.stat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                pass
    return files, size


def other_engines(pgid: int) -> int:
    """vLLM processes (``VLLM::*``) on this machine outside process group ``pgid``: other runs
    compete for the same cores, so a slow spell with a non-zero count is likely theirs."""
    return sum(comm.startswith("VLLM::") and int(fields[2]) != pgid for _, comm, fields in proc_stats())


class CpuTimes:
    """Machine-wide CPU use between two calls of :meth:`delta`, from the first line of /proc/stat."""

    def __init__(self) -> None:
        self.last = self._read()

    @staticmethod
    def _read() -> list[int]:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]

    def delta(self) -> dict[str, float]:
        """``cpu_busy`` (not idle, not iowait), ``cpu_iowait`` and ``cpu_steal`` shares since the last call."""
        now = self._read()
        d = [b - a for a, b in zip(self.last, now, strict=True)]
        self.last = now
        total = sum(d) or 1  # user nice system idle iowait irq softirq steal
        return {"cpu_busy": round(1 - (d[3] + d[4]) / total, 3), "cpu_iowait": round(d[4] / total, 3),
                "cpu_steal": round(d[7] / total, 3)}


class GroupSampler:
    """Samples every process of a process group; keeps the rows and each process's thread names.

    ``rows``: every row :meth:`sample` returned; ``threads``: pid -> ``[{"t_s", "names"}]``, one
    entry per change of :func:`thread_names` (the first sample included).
    """

    def __init__(self, pool_dir: Path) -> None:
        self.pool_dir = pool_dir
        self.rows: list[Row] = []
        self.threads: dict[int, list[dict[str, Any]]] = {}
        self.cpu = CpuTimes()

    def machine(self, pgid: int) -> Row:
        """``pool_files``, ``pool_mib``, the :class:`CpuTimes` shares since the last call,
        ``load_avg`` (1 min) and ``other_vllm_procs`` (:func:`other_engines`)."""
        files, size = dir_usage(self.pool_dir)
        return {"pool_files": files, "pool_mib": round(size / MiB, 1), **self.cpu.delta(),
                "load_avg": os.getloadavg()[0], "other_vllm_procs": other_engines(pgid)}

    def sample(self, pgid: int, common: Row) -> list[Row]:
        """One row per live process of group ``pgid``: ``common`` (which must hold ``t_s``)
        and :func:`sample_process`'s figures; appended to ``rows`` and returned."""
        new = []
        for pid in group_pids(pgid):
            s = sample_process(pid, self.pool_dir)
            if s is None:
                continue
            new.append({**common, **s})
            names = thread_names(pid)
            seen = self.threads.setdefault(pid, [])
            if not seen or seen[-1]["names"] != names:
                seen.append({"t_s": common["t_s"], "names": names})
        self.rows += new
        return new


class StallRecorder:
    """While no request ends, snapshots what the engine's threads do (a ``stalled`` callback).

    Called as ``recorder(t, gap)`` (seconds into the run, seconds since a request last ended)
    during a stall; a smaller gap than the last call's starts a new stall. Every 3 s of a stall
    (at most 5 per stall, 40 in all) it appends to ``path`` a JSON line with, per process of
    ``proc``'s group, its state and CPU seconds, its threads counted by (name, state, kernel
    wait channel), and the kernel stack of its main thread and of any thread in uninterruptible
    sleep (``D``). CPU seconds that grow between snapshots mean the engine computes; flat ones
    with threads asleep mean it waits (a lock, I/O, a queue). ``count``: snapshots written.
    """

    def __init__(self, path: Path, proc: Process, say: Callable[[str], None] | None = None) -> None:
        self.path, self.proc, self.say = path, proc, say
        self.count = 0
        self.in_stall = 0  # snapshots of the current stall
        self.prev_gap = 0.0
        self.last_t = -1e9

    def __call__(self, t: float, gap: float) -> None:
        if gap < self.prev_gap:  # a request ended since the last call: this is a new stall
            self.in_stall = 0
        self.prev_gap = gap
        if self.count >= 40 or self.in_stall >= 5 or t - self.last_t < 3.0 or self.proc.proc is None:
            return
        self.count += 1
        self.in_stall += 1
        self.last_t = t
        procs = [p for p in map(self._process, group_pids(self.proc.proc.pid)) if p is not None]
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"t_s": round(t, 1), "since_last_end_s": round(gap, 1), "processes": procs}) + "\n")
        if self.say is not None:
            cpu = ", ".join(f"{p['process']} {p['state']} {p['cpu_s']:.0f} s" for p in procs)
            self.say(f"  stall: no request ended for {gap:.0f} s at t={t:.0f} s; snapshot {self.count} ({cpu})")

    @staticmethod
    def _process(pid: int) -> Row | None:
        try:
            state, cpu_s = proc_cpu(pid)
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return None
        groups: dict[str, int] = {}
        stacks = {}
        for tid in tids:
            task = f"/proc/{pid}/task/{tid}"
            try:
                name = Path(f"{task}/comm").read_text().strip()
                tstate, _ = proc_cpu(pid, int(tid))
                wchan = Path(f"{task}/wchan").read_text().strip() or "-"
            except OSError:
                continue
            key = f"{name} {tstate} {wchan}"
            groups[key] = groups.get(key, 0) + 1
            if int(tid) == pid or tstate == "D":
                try:
                    stack = Path(f"{task}/stack").read_text().splitlines()[:8]
                except OSError:
                    stack = []
                stacks[tid] = {"name": name, "state": tstate, "wchan": wchan,
                               "stack": [line.split("] ", 1)[-1] for line in stack]}
        return {"pid": pid, "process": process_role(pid), "state": state, "cpu_s": round(cpu_s, 2),
                "threads": dict(sorted(groups.items())), "stacks": stacks}


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
