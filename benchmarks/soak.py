"""Soak run (issue 5): one ``kvtier serve`` engine under steady load for a bounded time.

Starts vLLM's OpenAI server with the KVTierConnector on 127.0.0.1 (as ``kvtier bench suite``
does: ``kvtier serve``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, the connector's ``metrics_file``),
with a small host DRAM tier and an fs pool whose budget is small enough that the pool evicts
during the run, and a small vLLM KV cache so that vLLM's own prefix cache forgets contexts and
kvtier has to load them back. Then it drives the engine for ``--seconds`` with the benchmark
kit's LoadClient (streaming /v1/completions, loopback only), ``--concurrency`` sessions at once
(a closed loop without think time), and every ``--interval`` seconds samples each process of
the engine's process group (API server, EngineCore, worker, helpers) from /proc: VmRSS and
RssAnon, open file descriptors (by kind: sockets, pipes, anon inodes, files, pool files),
threads, CPU seconds and state; plus requests and errors so far, the pool directory's size,
and the machine's CPU use and other vLLM processes (other people's runs share the cores).
While no request ends for ``--stall-seconds``, every engine thread's state, kernel wait channel
and (main thread) kernel stack go to stalls.jsonl: runnable threads whose CPU time stands still
mean the machine starves the engine; sleeping ones mean it waits on something.

Workload. Each slot runs sessions one after the other until the time is up. A session opens
with a context of ``--context`` tokens (default 1k-3k) and runs ``--turns`` turns (a fresh
question each, ``--output-tokens`` generated, the conversation growing each turn). With
probability ``--new-fraction`` a session gets a never-seen context (its chunks are saved: host
DRAM, then written down to the pool); otherwise it reuses one of the last ``--reuse-window``
contexts, which vLLM has often evicted by then, so its prefix is loaded from kvtier (host DRAM
or pool) or, if the pool has evicted it too, recomputed.

At the end the API server gets SIGINT (vLLM drains for ``--shutdown-timeout 30``, the worker's
connector flushes its write queue and writes ``kvtier-metrics.worker.json``) and the script waits
for every process of the group to exit before it kills leftovers. The report:
requests and errors; TTFT p50/p99 in the first and last tenth of the run; per process, RSS at
the end of warm-up (the first ``--warmup-fraction`` of the run, by when the tiers and vLLM's
cache are full) and at the end, the growth in MiB and %, and the slope of a least-squares fit
over the post-warm-up samples (MiB/min); fd and thread counts after warm-up; the connector's
dropped and failed writes, written chunks, loads, pool evictions. Verdicts:

* memory: flat when the fitted slope of the group's summed RSS is at most ``--mem-slope-limit``
  MiB/min (default 1.0: under 10 MiB over ten minutes) and no single process exceeds it;
* fds: flat when, for every process, the most fds open in the last quarter of the post-warm-up
  samples is at most ``--fd-slack`` (default 2) above the most open in the first quarter.
  Sockets to the load client come and go with requests; the maxima see the same number of
  in-flight connections, so a leak shows as a rising maximum;
* dropped writes: the worker's count (0 expected at a load the machine sustains);
* errors: requests that failed (must be 0): an HTTP error, a broken stream, a timeout. A
  request answered 200 whose usage shows every token generated but whose tokens decode to no
  text (the random-weight model can generate such tokens) is counted apart as an *empty
  completion*, not an error: the LoadClient records it with an error message, as it has no
  first token to time.

``--find-concurrency`` first runs a ramp (``--ramp-levels``, ``--ramp-seconds`` each after
``--ramp-warmup`` unmeasured seconds, on an engine of its own) and soaks at the highest level,
climbing, that has no error, TTFT p99 within ``--ttft-limit`` and at least ``--min-gain`` more
requests/s than the level below (past that knee more sessions only queue); its table goes to
ramp.json and summary.md. ``--ramp-only`` runs the ramp alone.

Output folder (``--out``): samples.csv (one row per process per sample), requests.csv (one row
per request), stalls.jsonl, summary.json, summary.md, kvtier.yaml,
kvtier-metrics.{worker,scheduler}.json, ramp.json, ramp-requests.csv and logs/ramp-engine.log
(with --find-concurrency or --ramp-only) and logs/engine.log (logs are cut to their head and
tail beyond ``--log-limit``). The pool lives under OUT/work unless ``--pool`` says where;
OUT/work is removed at the end unless ``--keep-work``. Exit status: 0 when every verdict
passes, 1 otherwise, 2 when the engine failed.

    python benchmarks/soak.py --seconds 600 --out docs/results/soak     # at --concurrency 8
    python benchmarks/soak.py --ramp-only --out docs/results/soak/ramp  # how 8 was chosen
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import itertools
import json
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtier.bench.client import LoadClient, Record, Session, Target, Turn
from kvtier.bench.engines import EngineError, Process, free_port, group_pids, proc_stats, root_cause
from kvtier.bench.suite import SERVED_NAME, SuiteSpec, engine_argv
from kvtier.bench.workload import TextMaker, parse_range
from kvtier.config import parse_bytes

MiB = 1 << 20
DEFAULT_MODEL = Path.home() / ".cache" / "kvtier" / "tiny-llama"


# ---------------------------------------------------------------------------------------- workload


EMPTY = "the stream ended without any text"  # the LoadClient's record of a text-less stream


def is_empty(record: Record) -> bool:
    """Answered in full (HTTP 200, usage reports the tokens) but no token decoded to text."""
    return record.get("error") == EMPTY and record.get("status") == 200 and (record.get("output_tokens") or 0) > 0


def is_failure(record: Record) -> bool:
    return record.get("error") is not None and not is_empty(record)


class Contexts:
    """Picks each new session's context: a never-seen one, or one of the recent ones again."""

    def __init__(self, text: TextMaker, tokens: tuple[int, int], window: int, new_fraction: float,
                 seed: int) -> None:
        self.text, self.tokens, self.window, self.new_fraction = text, tokens, window, new_fraction
        self.seed = seed
        self.rng = random.Random(f"{seed}:soak:pick")
        self.recent: list[int] = []  # context ids, oldest first
        self.texts: dict[int, str] = {}
        self.next_id = 0
        self.sessions = 0
        self.new = 0

    def pick(self) -> tuple[int, str]:
        if not self.recent or self.rng.random() < self.new_fraction:
            cid, self.next_id = self.next_id, self.next_id + 1
            rng = random.Random(f"{self.seed}:soak:context:{cid}")
            self.texts[cid] = f"Context {cid}. " + self.text.words(rng, rng.randint(*self.tokens))
            self.recent.append(cid)
            if len(self.recent) > self.window:
                self.texts.pop(self.recent.pop(0), None)  # the client keeps only the window's texts
            self.new += 1
        else:
            cid = self.rng.choice(self.recent)
        self.sessions += 1
        return cid, self.texts[cid]


def make_session(contexts: Contexts, args: argparse.Namespace) -> tuple[int, Session]:
    """A session on a picked context with fresh questions: only the context is shared."""
    cid, context = contexts.pick()
    sid = contexts.sessions
    rng = random.Random(f"{args.seed}:soak:session:{sid}")
    turns = [Turn(f"Question {t}: " + contexts.text.words(rng, args.question_tokens), args.output_tokens,
                  think_s=args.think if t else 0.0) for t in range(args.turns)]
    return cid, Session(sid, context, turns)


@dataclass
class Tally:
    """Every request's record, appended to requests.csv as it finishes."""

    path: Path
    records: list[Record] = field(default_factory=list)
    errors: int = 0
    empty: int = 0
    last_done: float = field(default_factory=time.perf_counter)  # when the latest request ended

    COLUMNS = ("stage", "concurrency", "session", "context", "turn", "start_s", "ttft_s", "e2e_s",
               "prompt_tokens", "output_tokens", "cached_tokens", "status", "error")

    def __post_init__(self) -> None:
        with open(self.path, "w", newline="") as fh:
            csv.writer(fh).writerow(self.COLUMNS)

    def __call__(self, record: Record) -> None:
        self.last_done = time.perf_counter()
        self.records.append(record)
        self.errors += is_failure(record)
        self.empty += is_empty(record)
        row = [round(v, 4) if isinstance(v, float) else v for v in (record.get(k) for k in self.COLUMNS)]
        with open(self.path, "a", newline="") as fh:
            csv.writer(fh).writerow(row)


async def drive(client: LoadClient, contexts: Contexts, args: argparse.Namespace, tally: Tally,
                concurrency: int, seconds: float, stage: str,
                tick: Callable[[float], None] | None = None,
                stalled: Callable[[float, float], None] | None = None) -> float:
    """Run sessions in ``concurrency`` slots until ``seconds`` have passed; returns the seconds it took.

    A slot starts no new session after the deadline; sessions in flight finish their turns (up
    to ``--drain-seconds``; then they are cancelled, unrecorded). ``tick(t)`` is called every
    ``--interval`` seconds and once at the deadline, while the load is still on;
    ``stalled(t, gap)`` every second while no request has ended for ``--stall-seconds``.
    """
    t0 = time.perf_counter()
    deadline = t0 + seconds
    tally.last_done = t0

    async def watchdog() -> None:
        while stalled is not None:
            await asyncio.sleep(1.0)
            now = time.perf_counter()
            if now - tally.last_done >= args.stall_seconds:
                stalled(now - t0, now - tally.last_done)

    async def slot() -> None:
        while time.perf_counter() < deadline:
            cid, session = make_session(contexts, args)
            await client.run([session], range(args.turns), 1, on_record=tally,
                             tags={"stage": stage, "concurrency": concurrency, "context": cid})

    async def ticker() -> None:
        # Runs until the deadline even without ``tick``: the drain below starts from its end.
        n = 0
        while True:
            n += 1
            await asyncio.sleep(max(0.0, min(deadline, t0 + n * args.interval) - time.perf_counter()))
            if time.perf_counter() >= deadline - 0.5:
                return
            if tick is not None:
                tick(time.perf_counter() - t0)

    slots = [asyncio.create_task(slot()) for _ in range(concurrency)]
    ticks = asyncio.create_task(ticker())
    dog = asyncio.create_task(watchdog())
    # The ticker ends before the deadline only by raising (the engine died): stop the load.
    await asyncio.wait([ticks], timeout=max(0.0, deadline - time.perf_counter()) + 1.0)
    if ticks.done() and not ticks.cancelled() and ticks.exception() is not None:
        for task in slots:
            task.cancel()
        await asyncio.gather(*slots, return_exceptions=True)
        raise ticks.exception()  # type: ignore[misc]
    ticks.cancel()
    if tick is not None:
        tick(time.perf_counter() - t0)  # the last sample under load
    _, late = await asyncio.wait(slots, timeout=args.drain_seconds)
    for task in [*late, dog]:
        task.cancel()
    await asyncio.gather(*slots, dog, return_exceptions=True)
    if late:
        print(f"  {len(late)} session(s) still running {args.drain_seconds:g} s after the deadline: cancelled",
              flush=True)
    for task in slots:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------- /proc


CLK_TCK = os.sysconf("SC_CLK_TCK")


def other_engines(pgid: int) -> int:
    """vLLM processes on this machine outside our engine's group (other people's runs compete
    for the same cores: a slow spell with a non-zero count here is likely theirs)."""
    return sum(comm.startswith("VLLM::") and int(fields[2]) != pgid for _, comm, fields in proc_stats())


class CpuTimes:
    """Machine-wide CPU use between two calls, from /proc/stat: busy, iowait and steal shares."""

    def __init__(self) -> None:
        self.last = self._read()

    @staticmethod
    def _read() -> list[int]:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]

    def delta(self) -> dict[str, float]:
        now = self._read()
        d = [b - a for a, b in zip(self.last, now, strict=True)]
        self.last = now
        total = sum(d) or 1
        # user nice system idle iowait irq softirq steal
        return {"cpu_busy": round(1 - (d[3] + d[4]) / total, 3), "cpu_iowait": round(d[4] / total, 3),
                "cpu_steal": round(d[7] / total, 3)}


def proc_cpu(pid: int, tid: int | None = None) -> tuple[str, float]:
    """(state, CPU seconds) of a process or one of its threads."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    stat = Path(path).read_text()
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[0], (int(fields[11]) + int(fields[12])) / CLK_TCK


def label(pid: int) -> str:
    """A readable role: vLLM titles its processes ``VLLM::EngineCore`` and so on."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace") if argv else ""
    joined = b" ".join(argv).decode(errors="replace")
    if first.startswith("VLLM::"):
        return first.split()[0][6:]
    if "api_server" in joined or "kvtier.cli.main" in joined:
        return "APIServer"
    if "resource_tracker" in joined:
        return "resource_tracker"
    return comm


def sample_process(pid: int, pool_dir: Path) -> dict[str, Any] | None:
    """RSS, fds by kind and threads of one process; None if it has gone."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    kinds = {"sockets": 0, "pipes": 0, "anon": 0, "pool_files": 0, "files": 0}
    pool = str(pool_dir)
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed between listdir and readlink
        if target.startswith("socket:"):
            kinds["sockets"] += 1
        elif target.startswith("pipe:"):
            kinds["pipes"] += 1
        elif target.startswith("anon_inode:"):
            kinds["anon"] += 1
        elif target.startswith(pool):
            kinds["pool_files"] += 1
        else:
            kinds["files"] += 1

    def kib(key: str) -> int:
        return int(status.get(key, "0 kB").split()[0])

    try:
        state, cpu_s = proc_cpu(pid)
    except OSError:
        return None
    return {"pid": pid, "process": label(pid), "state": state, "cpu_s": round(cpu_s, 2),
            "rss_mib": kib("VmRSS") / 1024, "rss_anon_mib": kib("RssAnon") / 1024,
            "fds": len(fds), **{f"fd_{k}": v for k, v in kinds.items()},
            "threads": int(status.get("Threads", "0").strip())}


def thread_names(pid: int) -> dict[str, int]:
    """How many threads of each name (``/proc/PID/task/*/comm``): tells a pool that grows to its
    size from one that leaks."""
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


def dir_usage(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    files = size = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                size += os.stat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                pass
    return files, size


# ---------------------------------------------------------------------------------------- engine


def engine(args: argparse.Namespace, out: Path, pool_dir: Path, name: str,
           ramp: bool = False) -> tuple[Process, Target]:
    """A ``kvtier serve`` engine with the soak's tier sizes, built the way the suite builds one.

    The ramp's engine keeps its config and metrics under OUT/work and logs to ramp-engine.log,
    so the soak engine's files are its own.
    """
    ctx_hi = args.context[1]
    max_len = ctx_hi + args.turns * (args.question_tokens + args.output_tokens + 64) + 512
    port = free_port()
    vllm_args = engine_argv(SuiteSpec(out), args.model, port, max_len)
    # An explicit, small vLLM KV cache (bytes, not the legacy VLLM_CPU_KVCACHE_SPACE GiB) so
    # vLLM's prefix cache forgets contexts and kvtier serves them; no per-request access log.
    vllm_args += ["--kv-cache-memory-bytes", str(args.vllm_kv_bytes), "--disable-uvicorn-access-log"]
    settings: dict[str, Any] = {"host_bytes": args.host_bytes, "chunk_tokens": 256,
                                "pool_url": f"fs://{pool_dir}", "pool_bytes": args.pool_bytes,
                                "metrics_file": str(out / "work" / "ramp-kvtier-metrics" if ramp
                                                    else out / "kvtier-metrics")}
    cfg = out / "work" / "ramp-kvtier.yaml" if ramp else out / "kvtier.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(yaml.safe_dump(settings))
    argv = [sys.executable, "-m", "kvtier.cli.main", "serve", "--config", str(cfg), "--", *vllm_args]
    env = {"PYTHONUNBUFFERED": "1",
           # As in the suite: all configurations compute on the same cores (see docs/benchmark-kit.md).
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")}
    log = out / "logs" / ("ramp-engine.log" if ramp else "engine.log")
    proc = Process(name, argv, log, env, ready_url=f"http://127.0.0.1:{port}/health")
    return proc, Target(f"http://127.0.0.1:{port}", SERVED_NAME)


def stop(proc: Process, timeout_s: float = 90.0) -> dict[str, Any]:
    """Stop the engine the graceful way and wait for every process of its group to exit.

    SIGINT goes to the API server alone, which stops EngineCore itself (SIGTERM); EngineCore
    drains and the worker flushes kvtier's write queue and writes its metrics file. Signalling
    the whole group at once, as Process.stop does, races vLLM 0.32's teardown: EngineCore
    restores the default signal actions when its loop exits, so the API server's SIGTERM can
    then kill it before the scheduler-side connector shuts down (no scheduler metrics file).
    Process.stop also SIGKILLs the group as soon as the API server has exited, which could cut
    a worker's flush short; here the group is waited for first, and only leftovers are killed.
    """
    popen = proc.proc
    if popen is None:
        return {"stop_s": None, "exit_status": None, "killed": []}
    t0 = time.perf_counter()
    try:
        os.kill(popen.pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    deadline = t0 + timeout_s
    while time.perf_counter() < deadline:
        popen.poll()  # reap the API server once it exits, so it does not linger as a zombie
        if not group_pids(popen.pid, live_only=True):
            break
        time.sleep(0.2)
    left = [f"{label(pid)} ({pid})" for pid in group_pids(popen.pid, live_only=True)]
    took = time.perf_counter() - t0
    proc.stop(timeout_s=10.0)  # SIGINT, SIGTERM, SIGKILL whatever is left; reaps the API server
    return {"stop_s": round(took, 1), "exit_status": popen.returncode, "killed": left}


def cut_log(path: Path, limit: int) -> None:
    """Keep a log's head and tail when it is over ``limit`` bytes (the result folder is committed)."""
    try:
        data = path.read_bytes()
    except OSError:
        return
    if len(data) <= limit:
        return
    head, tail = data[: limit // 3], data[-(2 * limit // 3):]
    marker = f"\n[... {len(data) - len(head) - len(tail)} bytes cut by soak.py ...]\n".encode()
    path.write_bytes(head + marker + tail)


def log_findings(path: Path) -> dict[str, Any]:
    """Counts of warning/error lines and tracebacks in the engine log (before it is cut)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    errors = [line for line in lines if " ERROR " in line or line.startswith("ERROR")]
    warnings = [line for line in lines if " WARNING " in line]
    return {"error_lines": len(errors), "warning_lines": len(warnings),
            "tracebacks": sum("Traceback (most recent call last)" in line for line in lines),
            "first_errors": errors[:5],
            "distinct_warnings": sorted({w.split("] ", 1)[-1][:160] for w in warnings})[:10]}


# ---------------------------------------------------------------------------------------- statistics


def quantile(values: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics; None when empty."""
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs; None with fewer than 3 points."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def ttft_stats(records: list[Record]) -> dict[str, Any]:
    ok = [r["ttft_s"] for r in records if r.get("error") is None and r.get("ttft_s") is not None]
    p50, p99 = quantile(ok, 0.5), quantile(ok, 0.99)
    return {"requests": len(records), "errors": sum(map(is_failure, records)), "empty": sum(map(is_empty, records)),
            "ttft_p50_s": None if p50 is None else round(p50, 3), "ttft_p99_s": None if p99 is None else round(p99, 3)}


def level_stats(records: list[Record], seconds: float) -> dict[str, Any]:
    out = ttft_stats(records)
    out["requests_per_s"] = round(len(records) / seconds, 2)
    out["output_tok_s"] = round(sum(r.get("output_tokens") or 0 for r in records) / seconds, 1)
    prompt = sum(r.get("prompt_tokens") or 0 for r in records)
    cached = sum(r.get("cached_tokens") or 0 for r in records)
    out["cached_fraction"] = round(cached / prompt, 3) if prompt else None
    return out


def process_summary(rows: list[dict[str, Any]], warmup_s: float, end_s: float) -> list[dict[str, Any]]:
    """Per process: RSS at warm-up end vs the last sample under load, slope, fds and threads after warm-up."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r["t_s"] <= end_s + 1e-6:
            by_pid.setdefault(r["pid"], []).append(r)
    out = []
    for pid, samples in sorted(by_pid.items()):
        post = [s for s in samples if s["t_s"] >= warmup_s]
        entry: dict[str, Any] = {"pid": pid, "process": samples[-1]["process"], "samples": len(samples)}
        if len(post) < 2:
            entry["note"] = "not present after warm-up (short-lived)"
            out.append(entry)
            continue
        first, last = post[0], post[-1]
        growth = last["rss_mib"] - first["rss_mib"]
        fit = slope([s["t_s"] / 60 for s in post], [s["rss_mib"] for s in post])
        anon_fit = slope([s["t_s"] / 60 for s in post], [s["rss_anon_mib"] for s in post])
        late = [s for s in post if s["t_s"] >= end_s / 2]
        late_fit = slope([s["t_s"] / 60 for s in late], [s["rss_mib"] for s in late])
        q = max(1, len(post) // 4)
        fds_first, fds_last = max(s["fds"] for s in post[:q]), max(s["fds"] for s in post[-q:])
        entry.update({
            "rss_warm_mib": round(first["rss_mib"], 1), "rss_end_mib": round(last["rss_mib"], 1),
            "growth_mib": round(growth, 1), "growth_pct": round(100 * growth / first["rss_mib"], 2),
            "slope_mib_per_min": None if fit is None else round(fit, 3),
            "anon_slope_mib_per_min": None if anon_fit is None else round(anon_fit, 3),
            "second_half_slope_mib_per_min": None if late_fit is None else round(late_fit, 3),
            "fds_min": min(s["fds"] for s in post), "fds_max": max(s["fds"] for s in post),
            "fds_first_quarter_max": fds_first, "fds_last_quarter_max": fds_last,
            "non_socket_fds_min": min(s["fds"] - s["fd_sockets"] for s in post),
            "non_socket_fds_max": max(s["fds"] - s["fd_sockets"] for s in post),
            "pool_fds_max": max(s["fd_pool_files"] for s in post),
            "threads_min": min(s["threads"] for s in post), "threads_max": max(s["threads"] for s in post),
        })
        out.append(entry)
    return out


def group_series(rows: list[dict[str, Any]], key: str) -> dict[float, float]:
    series: dict[float, float] = {}
    for r in rows:
        series[r["t_s"]] = series.get(r["t_s"], 0.0) + r[key]
    return series


# ---------------------------------------------------------------------------------------- the run


class Sampler:
    """Samples the engine's process group into samples.csv; prints one progress line per sample."""

    COLUMNS = ("t_s", "pid", "process", "state", "cpu_s", "rss_mib", "rss_anon_mib", "fds", "fd_sockets", "fd_pipes",
               "fd_anon", "fd_files", "fd_pool_files", "threads", "requests", "errors", "pool_files", "pool_mib",
               "cpu_busy", "cpu_iowait", "cpu_steal", "load_avg", "other_vllm_procs")

    def __init__(self, path: Path, proc: Process, pool_dir: Path, tally: Tally, seconds: float) -> None:
        self.path, self.proc, self.pool_dir, self.tally, self.seconds = path, proc, pool_dir, tally, seconds
        self.rows: list[dict[str, Any]] = []
        self.threads: dict[int, list[dict[str, Any]]] = {}  # pid -> thread names, when they changed
        self.cpu = CpuTimes()
        with open(path, "w", newline="") as fh:
            csv.writer(fh).writerow(self.COLUMNS)

    def __call__(self, t: float) -> None:
        if not self.proc.alive():
            raise EngineError(f"the engine exited during the run: {root_cause(self.proc.log) or 'see the log'}")
        assert self.proc.proc is not None
        pool_files, pool_bytes = dir_usage(self.pool_dir)
        common = {"t_s": round(t, 1), "requests": len(self.tally.records), "errors": self.tally.errors,
                  "pool_files": pool_files, "pool_mib": round(pool_bytes / MiB, 1), **self.cpu.delta(),
                  "load_avg": os.getloadavg()[0], "other_vllm_procs": other_engines(self.proc.proc.pid)}
        new = []
        for pid in group_pids(self.proc.proc.pid):
            s = sample_process(pid, self.pool_dir)
            if s is not None:
                new.append({**common, **s})
                names = thread_names(pid)
                seen = self.threads.setdefault(pid, [])
                if not seen or seen[-1]["names"] != names:
                    seen.append({"t_s": common["t_s"], "names": names})
        self.rows += new
        with open(self.path, "a", newline="") as fh:
            w = csv.writer(fh)
            for r in new:
                w.writerow([round(r[k], 1) if isinstance(r[k], float) else r[k] for k in self.COLUMNS])
        procs = " ".join(f"{r['process']}:{r['rss_mib']:.0f}MiB/{r['fds']}fd/{r['threads']}thr" for r in new
                         if r["process"] in ("APIServer", "EngineCore") or r["process"].startswith("Worker"))
        print(f"[{t:5.0f}/{self.seconds:.0f} s] requests {common['requests']} errors {common['errors']} | "
              f"{procs} | pool {common['pool_mib']:.0f} MiB in {pool_files} files | machine busy "
              f"{common['cpu_busy']:.0%}, other vLLM procs {common['other_vllm_procs']}", flush=True)


class StallRecorder:
    """While no request ends for ``--stall-seconds``, snapshots what the engine's threads do.

    Every 3 s of a stall (at most 5 per stall, 40 in all) it appends to stalls.jsonl, per
    process: its state and CPU seconds, its threads grouped by (name, state, kernel wait
    channel), and the kernel stack of its main thread and of any thread in uninterruptible
    sleep (``D``: waiting for I/O). CPU seconds that grow between snapshots mean the engine
    computes; flat ones with threads asleep mean it waits (a lock, I/O, a queue).
    """

    def __init__(self, path: Path, proc: Process) -> None:
        self.path, self.proc = path, proc
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
        snap: dict[str, Any] = {"t_s": round(t, 1), "since_last_end_s": round(gap, 1), "processes": []}
        for pid in group_pids(self.proc.proc.pid):
            try:
                state, cpu_s = proc_cpu(pid)
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            groups: dict[str, int] = {}
            stacks = {}
            for tid in tids:
                try:
                    name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                    tstate, _ = proc_cpu(pid, int(tid))
                    wchan = Path(f"/proc/{pid}/task/{tid}/wchan").read_text().strip() or "-"
                except OSError:
                    continue
                key = f"{name} {tstate} {wchan}"
                groups[key] = groups.get(key, 0) + 1
                if int(tid) == pid or tstate == "D":
                    try:
                        stack = Path(f"/proc/{pid}/task/{tid}/stack").read_text().splitlines()[:8]
                    except OSError:
                        stack = []
                    stacks[tid] = {"name": name, "state": tstate, "wchan": wchan,
                                   "stack": [line.split("] ", 1)[-1] for line in stack]}
            snap["processes"].append({"pid": pid, "process": label(pid), "state": state, "cpu_s": round(cpu_s, 2),
                                      "threads": dict(sorted(groups.items())), "stacks": stacks})
        with open(self.path, "a") as fh:
            fh.write(json.dumps(snap) + "\n")
        cpu = ", ".join(f"{p['process']} {p['state']} {p['cpu_s']:.0f} s" for p in snap["processes"])
        print(f"  stall: no request ended for {gap:.0f} s at t={t:.0f} s; snapshot {self.count} ({cpu})", flush=True)


def stalls(records: list[Record], took: float, threshold: float) -> list[dict[str, float]]:
    """Spells of ``threshold`` seconds or more in which no request got its first token or ended.

    With ``concurrency`` sessions in a closed loop, requests are always in flight, so such a
    spell is the engine (or the machine) standing still, whatever the cause.
    """
    events = sorted([r["start_s"] + r["ttft_s"] for r in records if r.get("ttft_s") is not None]
                    + [r["start_s"] + r["e2e_s"] for r in records if r.get("e2e_s") is not None])
    events = [e for e in events if e <= took]
    return [{"t_s": round(a, 1), "seconds": round(b - a, 1)} for a, b in itertools.pairwise(events)
            if b - a >= threshold]


def source_version() -> str | None:
    """The kvtier checkout's commit (``+dirty`` with uncommitted changes to src/), or None."""
    import subprocess

    import kvtier

    root = Path(kvtier.__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def worker_metrics(out: Path) -> dict[str, Any]:
    """The counters the connector wrote at shutdown (worker and scheduler roles)."""
    found: dict[str, Any] = {}
    for role in ("worker", "scheduler"):
        path = out / f"kvtier-metrics.{role}.json"
        try:
            found[role] = json.loads(path.read_text())
        except FileNotFoundError:
            found[role] = {"error": f"{path.name} was not written (the worker did not shut down cleanly?)"}
        except ValueError as exc:
            found[role] = {"error": f"{path.name}: {exc}"}
    return found


def kvtier_counters(metrics: dict[str, Any]) -> dict[str, Any]:
    """The figures the report needs, from the worker's file (and the scheduler's for matches).

    Loads are the worker's ``loaded_tokens`` and the pool tier's ``bytes_read``; the host tier's
    own ``bytes_read`` also counts the presence check of every save (a chunk host DRAM already
    holds is pinned, not copied), so it is reported but is not a load figure.
    """
    w, sched = metrics.get("worker", {}), metrics.get("scheduler", {})
    if "error" in w:
        return {"error": w["error"]}
    store, tiers, conn = w.get("store", {}), w.get("tiers", {}), w.get("connector", {})
    host, pool = tiers.get("host", {}), tiers.get("pool", {})

    def total(key: str) -> int:
        return sum(int(t.get(key, 0)) for t in tiers.values()) + int(store.get(key, 0))

    return {
        "dropped_writes": total("dropped_writes"), "failed_writes": total("failed_writes"),
        "failed_reads": total("failed_reads"), "timeouts": total("timeouts"),
        "corrupt_chunks": total("corrupt_chunks"), "write_queue_at_exit": w.get("write_queue"),
        "saved_chunks": conn.get("saved_chunks"), "host_written_chunks": host.get("written_chunks"),
        "pool_written_chunks": pool.get("written_chunks"),
        "pool_written_mib": round(pool.get("bytes_written", 0) / MiB),
        "matched_tokens": (sched.get("connector") or {}).get("matched_tokens"),
        "loaded_tokens": conn.get("loaded_tokens"), "failed_blocks": conn.get("failed_blocks"),
        "pool_bytes_read_mib": round(pool.get("bytes_read", 0) / MiB),
        "host_bytes_read_mib (incl. save checks)": round(host.get("bytes_read", 0) / MiB),
        "host_evictions": host.get("evictions"), "pool_evictions": pool.get("evictions"),
        "pool_evicted_mib": round(pool.get("evicted_bytes", 0) / MiB),
        "scheduler_lookups": (sched.get("store") or {}).get("lookups"),
        "scheduler_hit_chunks": (sched.get("store") or {}).get("hit_chunks"),
    }


def pick_level(levels: list[dict[str, Any]], ttft_limit: float, min_gain: float) -> int | None:
    """The highest level, climbing from the lowest, that the machine sustains.

    A level sustains its load with no error and TTFT p99 within ``ttft_limit``; and, above the
    lowest, only if it serves at least ``min_gain`` more requests/s than the level below: past
    that knee more sessions only queue (TTFT grows, throughput does not), which stresses the
    HTTP front end's queue, not kvtier.
    """
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


def run_ramp(args: argparse.Namespace, out: Path, text: TextMaker) -> tuple[int, list[dict[str, Any]]]:
    """Short stages at rising concurrency on an engine of their own; picks the soak's level."""
    pool_dir = out / "work" / "ramp-pool"
    pool_dir.mkdir(parents=True, exist_ok=True)
    proc, target = engine(args, out, pool_dir, "ramp engine", ramp=True)
    print(f"ramp: starting the engine ({proc.log})", flush=True)
    proc.start(args.start_timeout)
    tally = Tally(out / "ramp-requests.csv")
    # One context picker for every level: the caches carry over, as they would in service.
    contexts = Contexts(text, args.context, args.reuse_window, args.new_fraction, args.seed + 1)
    levels = []
    try:
        if args.ramp_warmup > 0:
            # Unmeasured: until the reuse window fills, reused contexts still sit in vLLM's own
            # cache and sessions are cheap; measuring from a cold start would favour the first level.
            c0 = args.ramp_levels[0]
            print(f"ramp: warming up for {args.ramp_warmup:g} s at concurrency {c0}", flush=True)
            asyncio.run(drive(LoadClient([target], timeout_s=args.request_timeout), contexts, args, tally, c0,
                              args.ramp_warmup, "ramp-warmup"))
        for c in args.ramp_levels:
            client = LoadClient([target], timeout_s=args.request_timeout)
            n0 = len(tally.records)
            took = asyncio.run(drive(client, contexts, args, tally, c, args.ramp_seconds, "ramp"))
            stats = {"concurrency": c, **level_stats(tally.records[n0:], took)}
            levels.append(stats)
            print(f"ramp: concurrency {c}: {stats}", flush=True)
            proc.check()
            if stats["errors"]:
                break  # higher levels will not do better
    finally:
        stop(proc)
        cut_log(proc.log, args.log_limit)
    chosen = pick_level(levels, args.ttft_limit, args.min_gain)
    if chosen is None:
        chosen = min(args.ramp_levels)
        print(f"ramp: no level met the criteria; soaking at the lowest, {chosen}", flush=True)
    shutil.rmtree(pool_dir, ignore_errors=True)
    return chosen, levels


def run_soak(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in ["samples.csv", "requests.csv", "summary.json", "summary.md", "ramp.json", "ramp-requests.csv",
                  "stalls.jsonl",
                  "kvtier-metrics.worker.json", "kvtier-metrics.scheduler.json", "logs/engine.log",
                  "logs/ramp-engine.log"]:
        (out / stale).unlink(missing_ok=True)
    model: Path = args.model
    if not (model / "config.json").exists():
        from kvtier.bench.model import make_model

        print(f"building the tiny model in {model}", flush=True)
        make_model(model)
    text = TextMaker(model if (model / "tokenizer.json").exists() else None)
    # The legacy GiB setting would override --kv-cache-memory-bytes in vLLM's CPU platform.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

    ramp: list[dict[str, Any]] = []
    concurrency = args.concurrency
    if args.find_concurrency or args.ramp_only:
        concurrency, ramp = run_ramp(args, out, text)
        (out / "ramp.json").write_text(json.dumps({"levels": ramp, "chosen": concurrency,
                                                    "ttft_limit_s": args.ttft_limit, "min_gain": args.min_gain,
                                                    "machine": {"cores": os.cpu_count(), "load_avg": os.getloadavg()},
                                                    "settings": {k: str(v) if isinstance(v, Path) else v
                                                                 for k, v in vars(args).items()}},
                                                   indent=2))
        if args.ramp_only:
            md = ramp_markdown(ramp, concurrency)
            (out / "summary.md").write_text(md)
            print(md, flush=True)
            if not args.keep_work:
                shutil.rmtree(out / "work", ignore_errors=True)
            return 0
        print(f"ramp: soaking at concurrency {concurrency}", flush=True)

    pool_dir: Path = args.pool or out / "work" / "pool"
    pool_dir.mkdir(parents=True, exist_ok=True)
    proc, target = engine(args, out, pool_dir, "soak engine")
    print(f"starting the engine ({proc.log})", flush=True)
    start_s = proc.start(args.start_timeout)
    print(f"engine ready in {start_s:.0f} s; soaking for {args.seconds:g} s at concurrency {concurrency}",
          flush=True)
    tally = Tally(out / "requests.csv")
    sampler = Sampler(out / "samples.csv", proc, pool_dir, tally, args.seconds)
    stall_recorder = StallRecorder(out / "stalls.jsonl", proc)
    contexts = Contexts(text, args.context, args.reuse_window, args.new_fraction, args.seed)
    client = LoadClient([target], timeout_s=args.request_timeout)
    failure: str | None = None
    took = end_s = 0.0
    try:
        sampler(0.0)  # idle, before any request
        took = asyncio.run(drive(client, contexts, args, tally, concurrency, args.seconds, "soak", sampler,
                                 stall_recorder))
        end_s = sampler.rows[-1]["t_s"]
        time.sleep(1.0)
        sampler(took + 1.0)  # idle again, after the drain
        proc.check()
    except EngineError as exc:
        failure = str(exc)
        print(f"ENGINE FAILED: {failure}", flush=True)
    finally:
        findings_before_stop = log_findings(proc.log)
        stopped = stop(proc)
    print(f"engine stopped in {stopped['stop_s']} s (exit status {stopped['exit_status']}"
          + (f"; killed after the wait: {', '.join(stopped['killed'])}" if stopped["killed"] else "") + ")",
          flush=True)

    findings = log_findings(proc.log)
    findings["during_run_error_lines"] = findings_before_stop.get("error_lines")
    cut_log(proc.log, args.log_limit)
    metrics = worker_metrics(out)
    counters = kvtier_counters(metrics)
    summary = summarize(args, concurrency, tally.records, sampler.rows, end_s or took, took, counters)
    summary.update({"engine_start_s": round(start_s, 1), **stopped, "engine_failure": failure, "log": findings,
                    "contexts": {"sessions": contexts.sessions, "new_contexts": contexts.new},
                    "ramp": ramp or None, "kvtier_metrics": metrics,
                    "thread_names": {str(pid): seen for pid, seen in sampler.threads.items()},
                    "stalls": stalls(tally.records, took, args.stall_seconds),
                    "stall_snapshots": stall_recorder.count, "kvtier_commit": source_version()})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    md = markdown(summary)
    (out / "summary.md").write_text(md)
    print(md, flush=True)
    if not args.keep_work:
        shutil.rmtree(out / "work", ignore_errors=True)
    if failure:
        return 2
    return 0 if all(v["ok"] for v in summary["verdicts"].values()) else 1


def summarize(args: argparse.Namespace, concurrency: int, records: list[Record], rows: list[dict[str, Any]],
              end_s: float, took: float, counters: dict[str, Any]) -> dict[str, Any]:
    dur = args.seconds
    warmup_s = args.warmup_fraction * dur
    first = [r for r in records if r["start_s"] < dur / 10]
    last = [r for r in records if r["start_s"] >= dur * 9 / 10]
    procs = process_summary(rows, warmup_s, end_s)
    rss = group_series([r for r in rows if r["t_s"] <= end_s + 1e-6], "rss_mib")
    post = sorted((t, v) for t, v in rss.items() if t >= warmup_s)
    total_fit = slope([t / 60 for t, _ in post], [v for _, v in post])
    late = [(t, v) for t, v in post if t >= end_s / 2]
    late_fit = slope([t / 60 for t, _ in late], [v for _, v in late])
    errors = sum(map(is_failure, records))
    empty = sum(map(is_empty, records))
    error_kinds: dict[str, int] = {}
    for r in records:
        if r.get("error"):
            error_kinds[r["error"][:120]] = error_kinds.get(r["error"][:120], 0) + 1

    limit = args.mem_slope_limit
    worst = max((p for p in procs if p.get("slope_mib_per_min") is not None),
                key=lambda p: p["slope_mib_per_min"], default=None)
    mem_ok = total_fit is not None and total_fit <= limit and (worst is None or worst["slope_mib_per_min"] <= limit)
    fd_procs = [p for p in procs if "fds_min" in p]
    fd_ok = all(p["fds_last_quarter_max"] <= p["fds_first_quarter_max"] + args.fd_slack for p in fd_procs)
    fds = group_series([r for r in rows if warmup_s <= r["t_s"] <= end_s + 1e-6], "fds")
    fd_lo, fd_hi = (int(min(fds.values())), int(max(fds.values()))) if fds else (0, 0)
    dropped = counters.get("dropped_writes")
    failed = counters.get("failed_writes")
    verdicts = {
        "memory": {"ok": mem_ok, "line": f"memory growth: {total_fit if total_fit is not None else float('nan'):+.2f} "
                   f"MiB/min over the group, worst process {worst['process'] if worst else '-'} "
                   f"{worst['slope_mib_per_min'] if worst else float('nan'):+.2f} MiB/min "
                   f"({'flat' if mem_ok else 'GROWING'}; threshold {limit:g} MiB/min)"},
        "fds": {"ok": fd_ok, "line": f"fds: {fd_lo}..{fd_hi} "
                f"over the group after warm-up ({'flat' if fd_ok else 'GROWING'}; threshold: last-quarter max <= "
                f"first-quarter max + {args.fd_slack} per process)"},
        "dropped_writes": {"ok": dropped == 0, "line": f"dropped writes: {dropped} (failed writes: {failed})"},
        "errors": {"ok": errors == 0 and bool(records),
                   "line": f"errors: {errors} of {len(records)} requests"
                   + (f" (and {empty} empty completions: HTTP 200, every token generated, none decoding to text)"
                      if empty else "")},
    }
    return {
        "seconds": dur, "load_seconds": round(took, 1), "concurrency": concurrency, "interval_s": args.interval,
        "warmup_s": warmup_s, "machine": {"cores": os.cpu_count(), "load_avg": os.getloadavg()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "requests": len(records), "errors": errors, "empty_completions": empty, "error_kinds": error_kinds,
        "overall": level_stats(records, took) if records else {},
        "first_tenth": ttft_stats(first), "last_tenth": ttft_stats(last),
        "group_rss_slope_mib_per_min": None if total_fit is None else round(total_fit, 3),
        "group_rss_second_half_slope_mib_per_min": None if late_fit is None else round(late_fit, 3),
        "group_rss_warm_mib": round(post[0][1], 1) if post else None,
        "group_rss_end_mib": round(post[-1][1], 1) if post else None,
        "processes": procs, "kvtier": counters, "verdicts": verdicts,
    }


def markdown(s: dict[str, Any]) -> str:
    def f(v: Any) -> str:
        return "—" if v is None else str(v)

    lines = [f"# Soak run: {s['seconds']:g} s at concurrency {s['concurrency']}", "",
             f"kvtier {s.get('kvtier_commit') or '(unknown commit)'}; {s['machine']['cores']} cores; "
             f"machine load average at the end {s['machine']['load_avg'][0]:.1f}.", ""]
    lines += [f"* {v['line']}" for v in s["verdicts"].values()]
    o, a, b = s["overall"], s["first_tenth"], s["last_tenth"]
    lines += ["", "## Load", "", "| | requests | errors | TTFT p50 (s) | TTFT p99 (s) |", "|---|---|---|---|---|",
              f"| whole run | {s['requests']} | {s['errors']} | {f(o.get('ttft_p50_s'))} | {f(o.get('ttft_p99_s'))} |",
              f"| first tenth | {a['requests']} | {a['errors']} | {f(a['ttft_p50_s'])} | {f(a['ttft_p99_s'])} |",
              f"| last tenth | {b['requests']} | {b['errors']} | {f(b['ttft_p50_s'])} | {f(b['ttft_p99_s'])} |", "",
              f"{f(o.get('requests_per_s'))} requests/s, {f(o.get('output_tok_s'))} output tok/s, cached fraction of "
              f"prompt tokens {f(o.get('cached_fraction'))}; {s['contexts']['sessions']} sessions, "
              f"{s['contexts']['new_contexts']} distinct contexts.", ""]
    st = s["stalls"]
    lines += [f"Stalls (no first token and no request end for {s['settings']['stall_seconds']:g} s or more, "
              f"while sessions were in flight): {len(st)}"
              + (f", longest {max(x['seconds'] for x in st)} s; at t = "
                 + ", ".join(f"{x['t_s']:g} s ({x['seconds']:g} s)" for x in st[:12])
                 + f". Thread snapshots taken during them: {s['stall_snapshots']} (stalls.jsonl)." if st else "."),
              ""]
    lines += ["## Processes (after warm-up: the first "
              f"{s['warmup_s']:g} s)", "",
              "| process | pid | RSS warm (MiB) | RSS end (MiB) | growth (MiB) | growth (%) | slope (MiB/min) | "
              "anon slope (MiB/min) | 2nd-half slope (MiB/min) | fds min..max | fds first/last quarter max | "
              "non-socket fds | threads |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in s["processes"]:
        if "note" in p:
            lines.append(f"| {p['process']} | {p['pid']} | {p['note']} | | | | | | | | | | |")
            continue
        lines.append(f"| {p['process']} | {p['pid']} | {p['rss_warm_mib']} | {p['rss_end_mib']} | {p['growth_mib']} | "
                     f"{p['growth_pct']} | {f(p['slope_mib_per_min'])} | {f(p['anon_slope_mib_per_min'])} | "
                     f"{f(p['second_half_slope_mib_per_min'])} | "
                     f"{p['fds_min']}..{p['fds_max']} | {p['fds_first_quarter_max']}/{p['fds_last_quarter_max']} | "
                     f"{p['non_socket_fds_min']}..{p['non_socket_fds_max']} | "
                     f"{p['threads_min']}..{p['threads_max']} |")
    lines.append(f"| group | | {f(s['group_rss_warm_mib'])} | {f(s['group_rss_end_mib'])} | | | "
                 f"{f(s['group_rss_slope_mib_per_min'])} | | {f(s['group_rss_second_half_slope_mib_per_min'])} "
                 "| | | | |")
    k = s["kvtier"]
    lines += ["", "## kvtier (worker metrics at shutdown)", "", "| counter | value |", "|---|---|"]
    lines += [f"| {key} | {f(val)} |" for key, val in k.items()]
    killed = f"; killed after the wait: {', '.join(s['killed'])}" if s.get("killed") else ""
    lines += ["", f"Engine: ready in {s['engine_start_s']} s, stopped in {s['stop_s']} s "
              f"(exit status {s['exit_status']}{killed}); log: {s['log'].get('during_run_error_lines')} ERROR lines "
              f"before the stop, {s['log'].get('error_lines')} in all, {s['log'].get('tracebacks')} tracebacks, "
              f"{s['log'].get('warning_lines')} WARNING lines."]
    names = {str(p["pid"]): p["process"] for p in s["processes"]}
    changed = []
    for pid, seen in s["thread_names"].items():
        first, last = seen[0]["names"], seen[-1]["names"]
        diff = [f"{n} {first.get(n, 0)}→{last.get(n, 0)}" for n in sorted({*first, *last})
                if first.get(n, 0) != last.get(n, 0)]
        if diff:
            times = ", ".join(f"{x['t_s']:g}" for x in seen[1:])
            changed.append(f"* {names.get(pid, pid)} ({pid}): {'; '.join(diff)} (changes at t = {times} s)")
    if changed:
        lines += ["", "Threads by name, first sample → last (summary.json has every change):", "", *changed]
    missing = [role for role, m in s["kvtier_metrics"].items() if "error" in m]
    if missing:
        lines += ["", f"Metrics files not written: {', '.join(missing)} (see summary.json)."]
    if s.get("ramp"):
        lines += ["", "## Concurrency ramp", *ramp_markdown(s["ramp"], s["concurrency"]).splitlines()[1:]]
    if s["error_kinds"]:
        lines += ["", "## Error messages (failures and empty completions)", ""]
        lines += [f"* {n} x {e}" for e, n in s["error_kinds"].items()]
    return "\n".join(lines) + "\n"


def ramp_markdown(levels: list[dict[str, Any]], chosen: int) -> str:
    def f(v: Any) -> str:
        return "—" if v is None else str(v)

    lines = ["# Concurrency ramp", "", "| concurrency | requests | errors | TTFT p50 (s) | TTFT p99 (s) | requests/s | "
             "output tok/s | verdict |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {lv['concurrency']} | {lv['requests']} | {lv['errors']} | {f(lv['ttft_p50_s'])} | "
              f"{f(lv['ttft_p99_s'])} | {lv['requests_per_s']} | {lv['output_tok_s']} | {lv.get('verdict', '—')} |"
              for lv in levels]
    return "\n".join([*lines, "", f"Chosen: concurrency {chosen}."]) + "\n"


def levels(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of concurrency levels: {text!r} (e.g. 4,8,16)") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"levels must be >= 1: {text!r}")
    return sorted(out)


def size(text: str) -> int:
    try:
        return parse_bytes(text, "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def token_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"need 0 < min <= max: {text!r}")
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("run")
    g.add_argument("--out", type=Path, default=Path("docs/results/soak"),
                   help="result folder (samples.csv, summary.json, ...; default docs/results/soak)")
    g.add_argument("--seconds", type=float, default=600.0,
                   help="load duration in seconds (default 600; at most 6 h: the run is bounded)")
    g.add_argument("--concurrency", type=int, default=8,
                   help="sessions in flight (default 8: on the 2-core reference machine, the highest level of "
                        "4/8/16 with no error and TTFT p99 within 10 s in every ramp; see the soak section of "
                        "docs/reliability-record.md)")
    g.add_argument("--interval", type=float, default=10.0, help="seconds between samples (default 10)")
    g.add_argument("--warmup-fraction", type=float, default=0.1,
                   help="the first part of the run left out of growth figures (default 0.1)")
    g.add_argument("--drain-seconds", type=float, default=120.0,
                   help="after the deadline, wait this long for sessions in flight, then cancel (default 120)")
    g.add_argument("--stall-seconds", type=float, default=6.0,
                   help="a spell this long with no request ending is a stall: the engine's threads are "
                        "snapshotted into stalls.jsonl and the report lists stalls (default 6 s)")
    g.add_argument("--request-timeout", type=float, default=120.0,
                   help="a request not complete within this is an error (default 120 s)")
    g.add_argument("--start-timeout", type=float, default=300.0, help="engine start timeout (default 300 s)")
    g.add_argument("--log-limit", type=size, default=200_000,
                   help="cut logs/engine.log to its head and tail beyond this (default 200000 bytes)")
    g.add_argument("--keep-work", action="store_true", help="keep OUT/work (the pool) at the end")
    g = ap.add_argument_group("engine and tiers")
    g.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help=f"model directory (default {DEFAULT_MODEL}; the tiny model is built there if missing)")
    g.add_argument("--pool", type=Path, default=None, help="fs pool directory (default OUT/work/pool)")
    g.add_argument("--host-bytes", default="16MiB",
                   help="kvtier host DRAM tier (default 16MiB: 32 chunks, so reads go to the pool)")
    g.add_argument("--pool-bytes", default="256MiB",
                   help="fs pool budget (default 256MiB: 512 chunks, about the reuse window's contexts; a "
                        "run writes several times that, so the pool evicts all along)")
    g.add_argument("--vllm-kv-bytes", type=size, default=64 * MiB,
                   help="vLLM's own KV cache (default 64MiB: 32k tokens of the tiny model, about what the "
                        "sessions in flight use, so vLLM forgets contexts and kvtier loads them)")
    g = ap.add_argument_group("workload")
    g.add_argument("--context", type=token_range, default=(1024, 3072),
                   help="context tokens per session, drawn uniformly (default 1k-3k)")
    g.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    g.add_argument("--question-tokens", type=int, default=32, help="tokens per question (default 32)")
    g.add_argument("--output-tokens", type=int, default=32, help="tokens generated per turn (default 32)")
    g.add_argument("--think", type=float, default=0.0, help="seconds before each later turn (default 0)")
    g.add_argument("--new-fraction", type=float, default=0.3,
                   help="share of sessions on a never-seen context (default 0.3; the rest reuse one)")
    g.add_argument("--reuse-window", type=int, default=32,
                   help="reused contexts are drawn from the last this-many new ones (default 32: twice "
                        "what vLLM's cache holds, so most reuses load from kvtier)")
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("concurrency ramp")
    g.add_argument("--find-concurrency", action="store_true",
                   help="ramp first (--ramp-levels) and soak at the highest level that sustains the load")
    g.add_argument("--ramp-only", action="store_true",
                   help="run the ramp alone (ramp.json, ramp-requests.csv, summary.md with its table), no soak")
    g.add_argument("--ramp-levels", type=levels, default=[4, 8, 16], help="levels to try (default 4,8,16)")
    g.add_argument("--ramp-seconds", type=float, default=60.0, help="seconds per level (default 60)")
    g.add_argument("--ramp-warmup", type=float, default=90.0,
                   help="unmeasured seconds at the first level before the ramp, so that every level sees "
                        "the same cache mix (default 90)")
    g.add_argument("--ttft-limit", type=float, default=10.0,
                   help="a level sustains the load with no error and TTFT p99 at most this (default 10 s)")
    g.add_argument("--min-gain", type=float, default=0.1,
                   help="and, above the lowest level, at least this much more requests/s than the level "
                        "below (default 0.1: past the knee, more sessions only queue)")
    g = ap.add_argument_group("verdict thresholds")
    g.add_argument("--mem-slope-limit", type=float, default=1.0,
                   help="memory is flat when the fitted RSS slope (group and each process) is at most "
                        "this many MiB/min (default 1.0)")
    g.add_argument("--fd-slack", type=int, default=2,
                   help="fds are flat when each process's last-quarter max is at most this above its "
                        "first-quarter max (default 2)")
    args = ap.parse_args(argv)
    if not 0 < args.seconds <= 6 * 3600:
        ap.error("--seconds: between 0 and 21600")
    if args.concurrency < 1 or args.turns < 1 or args.interval <= 0 or not 0 <= args.new_fraction <= 1:
        ap.error("--concurrency and --turns must be >= 1, --interval > 0, --new-fraction in [0, 1]")
    if not 0 <= args.warmup_fraction < 1 or args.reuse_window < 1:
        ap.error("--warmup-fraction in [0, 1), --reuse-window >= 1")
    args.model = args.model.expanduser().resolve()
    args.out = args.out.resolve()
    if args.pool is not None:
        args.pool = args.pool.resolve()
    try:
        return run_soak(args)
    except EngineError as exc:
        print(f"engine failed: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
