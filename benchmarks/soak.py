"""Soak run: one ``kvtier serve`` engine under steady load for a bounded time; does it leak?

The engine is started as ``kvtier bench suite`` starts its engines (kvtier.bench.suite), with
a small host DRAM tier, an fs pool small enough to evict all along, and a small vLLM KV cache
so that vLLM forgets contexts and kvtier loads them back. For ``--seconds``, ``--concurrency``
closed-loop slots run sessions (a ``--context``-token context, ``--turns`` turns); a share
``--new-fraction`` of sessions opens a never-seen context, the rest reuse one of the last
``--reuse-window``. Every ``--interval`` seconds every process of the engine's group is sampled
from /proc (kvtier.bench.procstat: RSS, fds by kind, threads, CPU; machine CPU use); while no
request ends for ``--stall-seconds`` the engine's threads are snapshotted. Then the engine is
stopped gracefully (the worker writes kvtier-metrics.worker.json) and the report is written.

Verdicts: memory flat (the fitted RSS slope after the first ``--warmup-fraction``, of the
group and of each process, at most ``--mem-slope-limit`` MiB/min); fds flat (per process, the
most open in the last quarter of the post-warm-up samples at most ``--fd-slack`` above the
first quarter's); no dropped writes; no failed request (a 200 answer whose tokens decode to no
text, as the random-weight model can produce, is an *empty completion*, not an error).

``--find-concurrency`` first ramps ``--ramp-levels`` on an engine of its own and soaks at the
highest level, climbing, with no error, TTFT p99 within ``--ttft-limit`` and ``--min-gain``
more requests/s than the level below; ``--ramp-only`` runs the ramp alone.

Output (``--out``): samples.csv, requests.csv, stalls.jsonl, summary.json, summary.md,
kvtier.yaml, kvtier-metrics.{worker,scheduler}.json, logs/engine.log (cut beyond
``--log-limit``); with a ramp also ramp.json, ramp-requests.csv, logs/ramp-engine.log. The pool
is OUT/work/pool unless ``--pool``; OUT/work is removed unless ``--keep-work``. Exit status: 0
when every verdict passes, 1 otherwise, 2 when the engine failed.

    python benchmarks/soak.py --seconds 600 --out docs/results/soak     # at --concurrency 8
    python benchmarks/soak.py --ramp-only --out docs/results/soak/ramp  # how 8 was chosen
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench import procstat
from kvtier.bench.client import LoadClient, Record, Session, Target, closed_loop
from kvtier.bench.configs import SERVED_NAME, SuiteSpec
from kvtier.bench.engines import EngineError, Process, cut_log, free_port, log_findings, root_cause
from kvtier.bench.model import ensure_model
from kvtier.bench.runner import engine_argv, engine_env, kvtier_serve_argv, read_metrics
from kvtier.bench.soak_report import (
    is_failure,
    kvtier_counters,
    level_stats,
    markdown,
    pick_level,
    ramp_markdown,
    settings,
    stalls,
    summarize,
)
from kvtier.bench.workload import RecurringContexts, TextMaker
from kvtier.cli.args import add_session_args, byte_size, positive_ints
from kvtier.tiers.poolroot import scratch_pool

MiB = 1 << 20
DEFAULT_MODEL = Path.home() / ".cache" / "kvtier" / "tiny-llama"


def say(line: str) -> None:
    print(line, flush=True)


@dataclass
class Tally:
    """Every request's record, appended to requests.csv as it finishes."""

    path: Path
    records: list[Record] = field(default_factory=list)
    errors: int = 0

    COLUMNS = ("stage", "concurrency", "session", "context", "turn", "start_s", "ttft_s", "e2e_s",
               "prompt_tokens", "output_tokens", "cached_tokens", "status", "error")

    def __post_init__(self) -> None:
        with open(self.path, "w", newline="") as fh:
            csv.writer(fh).writerow(self.COLUMNS)

    def __call__(self, record: Record) -> None:
        self.records.append(record)
        self.errors += is_failure(record)
        with open(self.path, "a", newline="") as fh:
            csv.writer(fh).writerow([round(v, 4) if isinstance(v, float) else v
                                     for v in (record.get(k) for k in self.COLUMNS)])


def load(target: Target, contexts: RecurringContexts, args: argparse.Namespace, tally: Tally, concurrency: int,
         seconds: float, stage: str, tick: Callable[[float], None] | None = None,
         stalled: Callable[[float, float], None] | None = None) -> float:
    """``concurrency`` closed-loop slots of sessions on ``target`` for ``seconds`` (client.closed_loop)."""
    def next_session() -> tuple[Session, dict[str, Any]]:
        cid, session = contexts.session(args.turns, args.question_tokens, args.output_tokens, args.think, args.seed)
        return session, {"stage": stage, "concurrency": concurrency, "context": cid}

    return asyncio.run(closed_loop(
        LoadClient([target], timeout_s=args.request_timeout), seconds, concurrency, next_session, on_record=tally,
        interval=args.interval, tick=tick, stall_s=args.stall_seconds, stalled=stalled, drain_s=args.drain_seconds,
        say=say))


def engine(args: argparse.Namespace, out: Path, pool_dir: Path, ramp: bool = False) -> tuple[Process, Target]:
    """A ``kvtier serve`` engine built as the suite builds one, with the soak's tiers, an explicit
    small vLLM KV cache and no access log. The ramp's engine keeps its config and metrics under
    OUT/work and logs to ramp-engine.log."""
    max_len = args.context[1] + args.turns * (args.question_tokens + args.output_tokens + 64) + 512
    port = free_port()
    vllm_args = [*engine_argv(SuiteSpec(out), args.model, port, max_len),
                 "--kv-cache-memory-bytes", str(args.vllm_kv_bytes), "--disable-uvicorn-access-log"]
    prefix = "work/ramp-" if ramp else ""
    tiers = {"host_bytes": args.host_bytes, "chunk_tokens": 256, "pool_url": scratch_pool(pool_dir),
             "pool_bytes": args.pool_bytes, "metrics_file": str(out / f"{prefix}kvtier-metrics")}
    argv = kvtier_serve_argv(tiers, out / f"{prefix}kvtier.yaml", vllm_args)
    log = out / "logs" / ("ramp-engine.log" if ramp else "engine.log")
    return (Process("ramp engine" if ramp else "soak engine", argv, log, engine_env(None),
                    ready_url=f"http://127.0.0.1:{port}/health"), Target(f"http://127.0.0.1:{port}", SERVED_NAME))


def stop(proc: Process) -> dict[str, Any]:
    """Process.stop with a 90 s grace: the server drains, the worker flushes and writes its metrics."""
    s = proc.stop(timeout_s=90.0)
    return {"stop_s": None if s.seconds is None else round(s.seconds, 1), "exit_status": s.exit_status,
            "killed": list(s.killed)}


class Sampler:
    """Samples the engine's group (procstat.GroupSampler) into samples.csv, one progress line each."""

    COLUMNS = ("t_s", "pid", "process", "state", "cpu_s", "rss_mib", "rss_anon_mib", "fds", "fd_sockets", "fd_pipes",
               "fd_anon", "fd_files", "fd_pool_files", "threads", "requests", "errors", "pool_files", "pool_mib",
               "cpu_busy", "cpu_iowait", "cpu_steal", "load_avg", "other_vllm_procs")

    def __init__(self, path: Path, proc: Process, pool_dir: Path, tally: Tally, seconds: float) -> None:
        self.path, self.proc, self.tally, self.seconds = path, proc, tally, seconds
        self.group = procstat.GroupSampler(pool_dir)
        with open(path, "w", newline="") as fh:
            csv.writer(fh).writerow(self.COLUMNS)

    def __call__(self, t: float) -> None:
        if self.proc.proc is None or not self.proc.alive():
            raise EngineError(f"the engine exited during the run: {root_cause(self.proc.log) or 'see the log'}")
        pgid = self.proc.proc.pid
        c = {"t_s": round(t, 1), "requests": len(self.tally.records), "errors": self.tally.errors,
             **self.group.machine(pgid)}
        new = self.group.sample(pgid, c)
        with open(self.path, "a", newline="") as fh:
            csv.writer(fh).writerows([round(r[k], 1) if isinstance(r[k], float) else r[k] for k in self.COLUMNS]
                                     for r in new)
        procs = " ".join(f"{r['process']}:{r['rss_mib']:.0f}MiB/{r['fds']}fd/{r['threads']}thr" for r in new
                         if r["process"] in ("APIServer", "EngineCore") or r["process"].startswith("Worker"))
        say(f"[{t:5.0f}/{self.seconds:.0f} s] requests {c['requests']} errors {c['errors']} | {procs} | pool "
            f"{c['pool_mib']:.0f} MiB in {c['pool_files']} files | machine busy {c['cpu_busy']:.0%}, other vLLM "
            f"procs {c['other_vllm_procs']}")


def source_version() -> str | None:
    """The kvtier checkout's commit (``+dirty`` with uncommitted changes to src/), or None."""
    import kvtier

    git = ["git", "-C", str(Path(kvtier.__file__).resolve().parents[2])]
    try:
        head, dirty = (subprocess.run(git + cmd, capture_output=True, text=True, timeout=10).stdout.strip()
                       for cmd in (["rev-parse", "--short", "HEAD"], ["status", "--porcelain", "--", "src"]))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def run_ramp(args: argparse.Namespace, out: Path, text: TextMaker) -> tuple[int, list[dict[str, Any]]]:
    """Short stages at rising concurrency on an engine of their own; picks the soak's level."""
    pool_dir = out / "work" / "ramp-pool"
    pool_dir.mkdir(parents=True, exist_ok=True)
    proc, target = engine(args, out, pool_dir, ramp=True)
    say(f"ramp: starting the engine ({proc.log})")
    proc.start(args.start_timeout)
    tally = Tally(out / "ramp-requests.csv")
    # One context picker for every level: the caches carry over, as they would in service.
    contexts = RecurringContexts(text, args.context, args.reuse_window, args.new_fraction, args.seed + 1)
    levels = []
    try:
        if args.ramp_warmup > 0:  # unmeasured: until the reuse window fills, sessions hit vLLM's own cache
            say(f"ramp: warming up for {args.ramp_warmup:g} s at concurrency {args.ramp_levels[0]}")
            load(target, contexts, args, tally, args.ramp_levels[0], args.ramp_warmup, "ramp-warmup")
        for c in args.ramp_levels:
            n0 = len(tally.records)
            took = load(target, contexts, args, tally, c, args.ramp_seconds, "ramp")
            levels.append({"concurrency": c, **level_stats(tally.records[n0:], took)})
            say(f"ramp: concurrency {c}: {levels[-1]}")
            proc.check()
            if levels[-1]["errors"]:
                break  # higher levels will not do better
    finally:
        stop(proc)
        cut_log(proc.log, args.log_limit)
    chosen = pick_level(levels, args.ttft_limit, args.min_gain)
    if chosen is None:
        chosen = min(args.ramp_levels)
        say(f"ramp: no level met the criteria; soaking at the lowest, {chosen}")
    shutil.rmtree(pool_dir, ignore_errors=True)
    return chosen, levels


def run_soak(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("samples.csv", "requests.csv", "summary.json", "summary.md", "ramp.json", "ramp-requests.csv",
                  "stalls.jsonl", "kvtier-metrics.worker.json", "kvtier-metrics.scheduler.json", "logs/engine.log",
                  "logs/ramp-engine.log"):
        (out / stale).unlink(missing_ok=True)
    model = ensure_model(args.model, say)
    text = TextMaker(model if (model / "tokenizer.json").exists() else None)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes

    ramp: list[dict[str, Any]] = []
    concurrency = args.concurrency
    if args.find_concurrency or args.ramp_only:
        concurrency, ramp = run_ramp(args, out, text)
        (out / "ramp.json").write_text(json.dumps(
            {"levels": ramp, "chosen": concurrency, "ttft_limit_s": args.ttft_limit, "min_gain": args.min_gain,
             "machine": {"cores": os.cpu_count(), "load_avg": os.getloadavg()}, "settings": settings(args)}, indent=2))
        if args.ramp_only:
            md = ramp_markdown(ramp, concurrency)
            (out / "summary.md").write_text(md)
            say(md)
            if not args.keep_work:
                shutil.rmtree(out / "work", ignore_errors=True)
            return 0
        say(f"ramp: soaking at concurrency {concurrency}")

    pool_dir: Path = args.pool or out / "work" / "pool"
    pool_dir.mkdir(parents=True, exist_ok=True)
    proc, target = engine(args, out, pool_dir)
    say(f"starting the engine ({proc.log})")
    start_s = proc.start(args.start_timeout)
    say(f"engine ready in {start_s:.0f} s; soaking for {args.seconds:g} s at concurrency {concurrency}")
    tally = Tally(out / "requests.csv")
    sampler = Sampler(out / "samples.csv", proc, pool_dir, tally, args.seconds)
    recorder = procstat.StallRecorder(out / "stalls.jsonl", proc, say)
    contexts = RecurringContexts(text, args.context, args.reuse_window, args.new_fraction, args.seed)
    failure: str | None = None
    took = end_s = 0.0
    try:
        sampler(0.0)  # idle, before any request
        took = load(target, contexts, args, tally, concurrency, args.seconds, "soak", sampler, recorder)
        end_s = sampler.group.rows[-1]["t_s"]
        time.sleep(1.0)
        sampler(took + 1.0)  # idle again, after the drain
        proc.check()
    except EngineError as exc:
        failure = str(exc)
        say(f"ENGINE FAILED: {failure}")
    finally:
        findings_before_stop = log_findings(proc.log)
        stopped = stop(proc)
    killed = f"; killed after the wait: {', '.join(stopped['killed'])}" if stopped["killed"] else ""
    say(f"engine stopped in {stopped['stop_s']} s (exit status {stopped['exit_status']}{killed})")

    findings = {**log_findings(proc.log), "during_run_error_lines": findings_before_stop.get("error_lines")}
    cut_log(proc.log, args.log_limit)
    metrics = {role: read_metrics(out / f"kvtier-metrics.{role}.json") for role in ("worker", "scheduler")}
    summary = summarize(args, concurrency, tally.records, sampler.group.rows, end_s or took, took,
                        kvtier_counters(metrics))
    summary.update({"engine_start_s": round(start_s, 1), **stopped, "engine_failure": failure, "log": findings,
                    "contexts": {"sessions": contexts.sessions, "new_contexts": contexts.new},
                    "ramp": ramp or None, "kvtier_metrics": metrics,
                    "thread_names": {str(pid): seen for pid, seen in sampler.group.threads.items()},
                    "stalls": stalls(tally.records, took, args.stall_seconds),
                    "stall_snapshots": recorder.count, "kvtier_commit": source_version()})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    md = markdown(summary)
    (out / "summary.md").write_text(md)
    say(md)
    if not args.keep_work:
        shutil.rmtree(out / "work", ignore_errors=True)
    if failure:
        return 2
    return 0 if all(v["ok"] for v in summary["verdicts"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("run")
    add = g.add_argument
    add("--out", type=Path, default=Path("docs/results/soak"), help="result folder (default docs/results/soak)")
    add("--seconds", type=float, default=600.0, help="load duration (default 600; at most 6 h)")
    add("--concurrency", type=int, default=8, help="sessions in flight (default 8: the level the 2-core reference "
        "machine sustained in every ramp; see docs/reliability-record.md)")
    add("--interval", type=float, default=10.0, help="seconds between samples (default 10)")
    add("--warmup-fraction", type=float, default=0.1, help="start of the run left out of growth figures (default 0.1)")
    add("--drain-seconds", type=float, default=120.0, help="then wait for sessions in flight (default 120)")
    add("--stall-seconds", type=float, default=6.0, help="no request ending this long is a stall (default 6)")
    add("--request-timeout", type=float, default=120.0, help="a request slower than this is an error (default 120 s)")
    add("--start-timeout", type=float, default=300.0, help="engine start timeout (default 300 s)")
    add("--log-limit", type=byte_size, default=200_000, help="cut engine logs beyond this many bytes (default 200000)")
    add("--keep-work", action="store_true", help="keep OUT/work (the pool) at the end")
    add = ap.add_argument_group("engine and tiers").add_argument
    add("--model", type=Path, default=DEFAULT_MODEL, help=f"model directory (default {DEFAULT_MODEL}; the tiny "
        "model is built there if missing)")
    add("--pool", type=Path, default=None, help="fs pool directory (default OUT/work/pool)")
    add("--host-bytes", default="16MiB", help="kvtier host DRAM tier (default 16MiB: 32 chunks)")
    add("--pool-bytes", default="256MiB", help="fs pool budget (default 256MiB: it evicts all along)")
    add("--vllm-kv-bytes", type=byte_size, default=64 * MiB, help="vLLM's own KV cache (default 64MiB: it forgets "
        "contexts, kvtier loads them)")
    workload = ap.add_argument_group("workload")
    add = workload.add_argument
    add_session_args(workload, context=(1024, 3072), turns=3)
    add("--new-fraction", type=float, default=0.3, help="share of sessions on a never-seen context (default 0.3)")
    add("--reuse-window", type=int, default=32, help="reuse one of the last this-many contexts (default 32)")
    add = ap.add_argument_group("concurrency ramp").add_argument
    add("--find-concurrency", action="store_true", help="ramp first and soak at the highest level sustained")
    add("--ramp-only", action="store_true", help="run the ramp alone (ramp.json, summary.md), no soak")
    add("--ramp-levels", type=positive_ints, default=[4, 8, 16], help="levels to try (default 4,8,16)")
    add("--ramp-seconds", type=float, default=60.0, help="seconds per level (default 60)")
    add("--ramp-warmup", type=float, default=90.0, help="unmeasured seconds at the first level first (default 90)")
    add("--ttft-limit", type=float, default=10.0, help="a sustained level has TTFT p99 within this (default 10 s)")
    add("--min-gain", type=float, default=0.1, help="and this much more requests/s than the level below (default 0.1)")
    add = ap.add_argument_group("verdict thresholds").add_argument
    add("--mem-slope-limit", type=float, default=1.0, help="flat memory: RSS slope at most this MiB/min (default 1.0)")
    add("--fd-slack", type=int, default=2, help="flat fds: last-quarter max at most this above the first's (default 2)")
    args = ap.parse_args(argv)
    if not 0 < args.seconds <= 6 * 3600:
        ap.error("--seconds: between 0 and 21600")
    if args.concurrency < 1 or args.turns < 1 or args.interval <= 0 or not 0 <= args.new_fraction <= 1:
        ap.error("--concurrency and --turns must be >= 1, --interval > 0, --new-fraction in [0, 1]")
    if not 0 <= args.warmup_fraction < 1 or args.reuse_window < 1:
        ap.error("--warmup-fraction in [0, 1), --reuse-window >= 1")
    args.ramp_levels = sorted(args.ramp_levels)
    args.model, args.out = args.model.expanduser().resolve(), args.out.resolve()
    args.pool = args.pool.resolve() if args.pool is not None else None
    try:
        return run_soak(args)
    except EngineError as exc:
        print(f"engine failed: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
