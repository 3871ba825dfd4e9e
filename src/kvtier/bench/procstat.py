"""What the processes of an engine's group use, sampled through psutil (Linux), and its trends.

The soak run (``benchmarks/soak.py``) samples every process of a ``kvtier serve`` engine's
process group (API server, EngineCore, worker, helpers) with :class:`GroupSampler`: per
process (:func:`sample_process`) RSS and anonymous RSS in MiB, open fds by kind (sockets,
pipes, anon inodes, files under a pool directory, other files), threads, CPU seconds and state;
the names of its threads each time they change; and, per sample, machine-wide figures
(:meth:`GroupSampler.machine`: CPU busy/iowait/steal shares since the last sample, the load
average, vLLM processes of other groups, the pool directory's files and MiB). While the
engine stands still, :class:`StallRecorder` snapshots what each thread waits on. The trends
of the rows (growth, slopes, markdown) are kvtier.bench.trends', importable from here too.

psutil reads the figures it has (CPU times of processes and threads, memory, thread counts,
machine CPU times); what it has not is read from /proc here, in small helpers: a thread's OS
name and state (``/proc/PID/task/TID/comm`` and ``stat``: kvtier names its threads, see
kvtier.threads), fds by kind (``/proc/PID/fd`` links) and what a thread waits on (``wchan``,
``stack``). A process that exits between two reads is skipped, never an error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from kvtier.bench.engines import Process, group_pids, proc_stats, process_role
from kvtier.bench.trends import group_rss, group_series, process_summary, process_table, slope, thread_changes

__all__ = [  # the sampling, and the trends of kvtier.bench.trends for ``procstat.process_summary`` and so on
    "CpuTimes", "GroupSampler", "StallRecorder", "dir_usage", "group_rss", "group_series", "group_thread_cpu",
    "other_engines",
    "proc_cpu", "process_summary", "process_table", "sample_process", "slope", "thread_changes", "thread_cpu",
    "thread_names", "thread_stat",
]

MiB = 1 << 20
Row = dict[str, Any]
CLK_TCK = os.sysconf("SC_CLK_TCK")
# psutil's status names back to the kernel's state letters, as /proc/PID/stat spells them.
_STATE_LETTERS = {"running": "R", "sleeping": "S", "disk-sleep": "D", "stopped": "T", "tracing-stop": "t",
                  "zombie": "Z", "dead": "X", "wake-kill": "K", "waking": "W", "idle": "I", "parked": "P"}


def _process_state(p: psutil.Process) -> tuple[str, float]:
    """(state letter, user + system CPU seconds) of ``p``; psutil.Error if it has gone."""
    with p.oneshot():
        status, times = p.status(), p.cpu_times()
    return _STATE_LETTERS.get(status, "?"), times.user + times.system


def thread_stat(pid: int, tid: int) -> tuple[str, str, float]:
    """(OS name, state letter, user + system CPU seconds) of thread ``tid`` of ``pid``, from
    ``/proc/PID/task/TID``: psutil has neither a thread's name nor its state. OSError if gone."""
    task = f"/proc/{pid}/task/{tid}"
    name = Path(f"{task}/comm").read_text().strip()
    stat = Path(f"{task}/stat").read_text()
    fields = stat[stat.rfind(")") + 2:].split()
    return name, fields[0], (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_cpu(pid: int, tid: int | None = None) -> tuple[str, float]:
    """(state letter, user + system CPU seconds) of a process or one of its threads; OSError if gone."""
    if tid is not None:
        _, state, seconds = thread_stat(pid, tid)
        return state, seconds
    try:
        return _process_state(psutil.Process(pid))
    except psutil.Error as exc:
        raise OSError(f"process {pid}: {exc}") from None


def _fd_kinds(pid: int, fds: list[str], pool_dir: Path | None) -> dict[str, int]:
    """Open fds of ``pid`` by what they point at (psutil lists regular files only)."""
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
    return kinds


def sample_process(pid: int, pool_dir: Path | None = None) -> Row | None:
    """One process: ``pid``, ``process`` (its role), ``state``, ``cpu_s``, ``rss_mib``,
    ``rss_anon_mib``, ``fds`` and by kind ``fd_sockets``, ``fd_pipes``, ``fd_anon``,
    ``fd_pool_files`` (under ``pool_dir``), ``fd_files`` (the rest), and ``threads``;
    None if it has gone."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            memory, threads = p.memory_info(), p.num_threads()
        fds = os.listdir(f"/proc/{pid}/fd")
        kinds = _fd_kinds(pid, fds, pool_dir)
        state, cpu_s = _process_state(p)
    except (psutil.Error, OSError):
        return None
    # Resident pages are anonymous, file-backed or shared memory; psutil's ``shared`` counts the
    # latter two (statm's), so the rest is the status file's RssAnon.
    return {"pid": pid, "process": process_role(pid), "state": state, "cpu_s": round(cpu_s, 2),
            "rss_mib": memory.rss / MiB, "rss_anon_mib": (memory.rss - memory.shared) / MiB, "fds": len(fds),
            **{f"fd_{k}": v for k, v in kinds.items()}, "threads": threads}


def _thread_name(pid: int, tid: int) -> str | None:
    """The OS name of thread ``tid`` of ``pid`` (``/proc/PID/task/TID/comm``); None if it has gone."""
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return None


def thread_names(pid: int) -> dict[str, int]:
    """How many threads of each name (``/proc/PID/task/*/comm``), sorted by name: tells a pool
    that grows to its size from one that leaks. Empty if the process has gone."""
    names: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return names
    for tid in tids:
        name = _thread_name(pid, int(tid))
        if name is not None:
            names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each thread name of ``pid`` (psutil's threads, named
    by ``/proc/PID/task/TID/comm``), summed over the threads of one name. Empty if the process
    has gone."""
    seconds: dict[str, float] = {}
    try:
        threads = psutil.Process(pid).threads()
    except psutil.Error:
        return seconds
    for t in threads:
        name = _thread_name(pid, t.id)
        if name is not None:
            seconds[name] = seconds.get(name, 0.0) + t.user_time + t.system_time
    return seconds


def group_thread_cpu(pgid: int) -> dict[str, float]:
    """``thread_cpu`` summed over every process of process group ``pgid`` (a server and the
    engine processes it spawned), by thread name."""
    seconds: dict[str, float] = {}
    for pid in group_pids(pgid):
        for name, s in thread_cpu(pid).items():
            seconds[name] = seconds.get(name, 0.0) + s
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
    """Machine-wide CPU use between two calls of :meth:`delta` (psutil.cpu_times)."""

    def __init__(self) -> None:
        self.last = self._read()

    @staticmethod
    def _read() -> list[float]:
        t = psutil.cpu_times()
        return [t.user, t.nice, t.system, t.idle, t.iowait, t.irq, t.softirq, t.steal]

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
            try:  # psutil has no thread names, states or wait channels
                name, tstate, _ = thread_stat(pid, int(tid))
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
