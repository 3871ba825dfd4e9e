"""kvtier against plain vLLM, measured by vLLM's own client: ``vllm bench serve``.

    python benchmarks/bench_serve.py [--rounds 3] [--prefix-len 6144] [--suffix-len 64]
                                     [--prompts 6] [--concurrency 2] [--output-len 16]
                                     [--model DIR | --real] [--out DIR]

Every round runs the same two servers side by side, each fresh (``vllm serve`` with vLLM's
prefix cache, and ``kvtier serve`` with kvtier's defaults and a pool on the local disk), and
drives both with ``vllm bench serve --dataset-name prefix_repetition``: ``--prompts`` prompts
of ``--prefix-len`` + ``--suffix-len`` random tokens, one prompt per prefix, at
``--max-concurrency``. A prompt set is a seed: set A is ``1000 + round``, set B ``2000 + round``.

    plain vLLM:  fresh server: A (fresh), B (new, after A), A again (the floor: its prefix cache)
    kvtier:      fresh server: A (fresh, saving), B (new, after A, saving); stop;
                 page cache dropped; fresh server on the same pool: A (resume)

The rows compare TTFT p50 (vLLM's client: time to the first streamed token): the resume
against the floor (goal <= 1.25x) and each of kvtier's fresh runs against plain vLLM's
(saving's cost; goal <= +3%). Which server runs first alternates by round; each row's ratio is
taken within a round, and the summary gives the medians over rounds. The page cache is dropped
with ``/proc/sys/vm/drop_caches`` as root, else file by file with ``posix_fadvise``. The resume
is checked: the connector must have loaded tokens, or the round fails. Per phase the summary
also keeps the CPU seconds of every thread of the server's processes (kvtier's threads by name,
the rest as ``other``) and, for the resume, the medians of kvtier's resume profile.

Both servers run with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, as the bench suite's do, unless
``--vllm-cpu-defaults`` leaves it to vLLM and ``kvtier serve`` (``kvtier.cli.serve_cmd``).
``vllm bench serve`` runs through its own entry point (``vllm.benchmarks.serve``): the ``vllm``
command of the CPU build fails before parsing its arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.configs import SERVED_NAME, SuiteSpec, kvtier_setting
from kvtier.bench.engines import Process, free_port, group_pids
from kvtier.bench.procstat import group_thread_cpu, proc_cpu
from kvtier.bench.profiles import PROFILE_FIELDS
from kvtier.bench.runner import engine_argv, engine_env, kvtier_serve_argv
from kvtier.probe.fs import drop_cache
from kvtier.tiers.poolroot import scratch_pool

# ``vllm bench serve``'s own entry point. The ``vllm`` command of the CPU build (vllm-cpu 0.32)
# fails before parsing: it asks for the version of a distribution named ``vllm``.
BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
               "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
               "p = P(prog='vllm bench serve'); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")

TOTAL = "\0total"  # group_cpu's key for the processes' own CPU seconds (no thread is named so)
PHASES = {"plain": ("fresh", "new", "floor"), "kvtier": ("fresh", "new", "resume")}


def server(kind: str, args: argparse.Namespace, model: Path, out: Path, tag: str, pool: str) -> tuple[Process, int]:
    port = free_port()
    # Both servers get the bench suite's engine flags.
    vllm_args = engine_argv(SuiteSpec(out), model, port, args.prefix_len + args.suffix_len + args.output_len + 64)
    if kind == "plain":
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_args]
    else:
        settings = {**dict(args.kvtier_setting), "pool_url": pool, "metrics_file": str(out / "work" / f"metrics-{tag}"),
                    "profile_file": str(out / "work" / f"profile-{tag}.jsonl")}
        argv = kvtier_serve_argv(settings, out / "work" / f"kvtier-{tag}.yaml", vllm_args)
    env = engine_env(args.kv_cache_gib)
    if args.vllm_cpu_defaults:
        env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    proc = Process(f"{kind} {tag}", argv, out / "logs" / f"{kind}-{tag}.log", env,
                   ready_url=f"http://127.0.0.1:{port}/health")
    proc.start(timeout_s=900)
    return proc, port


def group_cpu(proc: Process) -> dict[str, float]:
    """CPU seconds so far of each thread name in the server's process group (all its processes),
    and of the processes themselves (``TOTAL``: their threads that have exited included)."""
    if proc.proc is None:
        return {TOTAL: 0.0}
    seconds = {**group_thread_cpu(proc.proc.pid), TOTAL: 0.0}
    for pid in group_pids(proc.proc.pid):
        try:
            seconds[TOTAL] += proc_cpu(pid)[1]
        except OSError:  # it exited meanwhile
            pass
    return seconds


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds used between two ``group_cpu`` calls: kvtier's threads by name (``kvtier-*``), the
    other live threads summed as ``other``, and ``exited``: what threads that ended meanwhile used
    (the processes' total less every live thread's)."""
    out: dict[str, float] = {}
    for name, s in after.items():
        if name != TOTAL:
            key = name if name.startswith("kvtier") else "other"
            out[key] = out.get(key, 0.0) + s - before.get(name, 0.0)
    out["exited"] = after[TOTAL] - before[TOTAL] - sum(out.values())
    return {k: round(v, 3) for k, v in sorted(out.items()) if k in ("other", "exited") or abs(v) >= 0.005}


def measured(args: argparse.Namespace, model: Path, proc: Process, port: int, seed: int, out: Path, name: str,
             cpu: dict[str, Any]) -> list[float]:
    """``client``, with the CPU seconds the server's threads used meanwhile put in ``cpu[phase]``
    (``name`` is ``r<round>-<server>-<phase>``)."""
    before = group_cpu(proc)
    ttfts = client(args, model, port, seed, out, name)
    cpu[name.rsplit("-", 1)[1]] = cpu_delta(before, group_cpu(proc))
    return ttfts


def client(args: argparse.Namespace, model: Path, port: int, seed: int, out: Path, name: str) -> list[float]:
    """Run ``vllm bench serve`` once; returns each request's TTFT in seconds (all must succeed)."""
    result = out / "raw" / f"{name}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-c", BENCH_SERVE, "--backend", "openai",
            "--host", "127.0.0.1", "--port", str(port), "--model", SERVED_NAME, "--tokenizer", str(model),
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.prompts), "--prefix-repetition-output-len",
            str(args.output_len), "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
            "--seed", str(seed), "--ignore-eos", "--disable-tqdm", "--percentile-metrics", "ttft",
            "--metric-percentiles", "50,90", "--save-result", "--save-detailed",
            "--result-dir", str(result.parent), "--result-filename", result.name]
    with open(out / "logs" / f"client-{name}.log", "wb") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=True,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    data = json.loads(result.read_text())
    if data.get("completed") != args.prompts:
        raise SystemExit(f"{name}: {data.get('completed')} of {args.prompts} requests completed: {data.get('errors')}")
    return [float(t) for t in data["ttfts"]]


def drop_page_cache(pool_dir: Path) -> str:
    subprocess.run(["sync"], check=True)
    if os.geteuid() == 0:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    drop_cache([p for p in pool_dir.rglob("*") if p.is_file()])
    return "fadvise"


def loaded_tokens(out: Path, tag: str) -> int:
    """Tokens the resume server's connector loaded (its metrics files, written at shutdown)."""
    total = 0
    for f in (out / "work").glob(f"metrics-{tag}.*.json"):
        total += int(json.loads(f.read_text()).get("connector", {}).get("loaded_tokens", 0))
    return total


def profile_medians(path: Path) -> dict[str, float]:
    """Medians of the resume profile's spans (``kvtier.integrations.vllm.profile``) over the
    requests that loaded: where the resume's time went, in the connector's clocks."""
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return {}
    loads = [x for x in records if x.get("load_tokens")]
    return {k: statistics.median(x[k] for x in loads if x.get(k) is not None)
            for k in PROFILE_FIELDS if any(x.get(k) is not None for x in loads)}


def run_plain(args: argparse.Namespace, model: Path, out: Path, r: int) -> dict[str, Any]:
    proc, port = server("plain", args, model, out, f"r{r}", "")
    cpu: dict[str, Any] = {}
    try:
        row: dict[str, Any] = {phase: measured(args, model, proc, port, seed, out, f"r{r}-plain-{phase}", cpu)
                               for phase, seed in (("fresh", 1000 + r), ("new", 2000 + r), ("floor", 1000 + r))}
    finally:
        proc.stop()
    return {**row, "cpu_s": cpu}


def run_kvtier(args: argparse.Namespace, model: Path, out: Path, r: int) -> dict[str, Any]:
    pool_dir = out / "work" / f"pool-r{r}"
    url = scratch_pool(pool_dir)
    proc, port = server("kvtier", args, model, out, f"r{r}-save", url)
    cpu: dict[str, Any] = {}
    row: dict[str, Any] = {"cpu_s": cpu}
    try:
        for phase, seed in (("fresh", 1000 + r), ("new", 2000 + r)):
            row[phase] = measured(args, model, proc, port, seed, out, f"r{r}-kvtier-{phase}", cpu)
    finally:
        proc.stop()
    row["dropped_with"] = drop_page_cache(pool_dir)
    proc, port = server("kvtier", args, model, out, f"r{r}-resume", url)
    try:
        row["resume"] = measured(args, model, proc, port, 1000 + r, out, f"r{r}-kvtier-resume", cpu)
    finally:
        proc.stop()
    row["loaded_tokens"] = loaded_tokens(out, f"r{r}-resume")
    row["profile"] = profile_medians(out / "work" / f"profile-r{r}-resume.jsonl")
    if row["loaded_tokens"] <= 0:
        raise SystemExit(f"round {r}: the resume server loaded nothing from the pool (logs in {out / 'logs'})")
    return row


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    p50 = statistics.median
    ratios = {"resume_vs_floor": [p50(x["kvtier"]["resume"]) / p50(x["plain"]["floor"]) for x in rounds],
              "resume_vs_recompute": [p50(x["kvtier"]["resume"]) / p50(x["plain"]["fresh"]) for x in rounds],
              "fresh_vs_plain": [p50(x["kvtier"]["fresh"]) / p50(x["plain"]["fresh"]) for x in rounds],
              "new_vs_plain": [p50(x["kvtier"]["new"]) / p50(x["plain"]["new"]) for x in rounds]}
    ttft = {f"{kind}_{phase}": p50([p50(x[kind][phase]) for x in rounds])
            for kind, phases in PHASES.items() for phase in phases}
    return {"ttft_p50_s": ttft, "ratios_per_round": ratios, "ratio_medians": {k: p50(v) for k, v in ratios.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds (default 3)")
    parser.add_argument("--prefix-len", type=int, default=6144, help="tokens per prefix (default 6144)")
    parser.add_argument("--suffix-len", type=int, default=64, help="tokens after each prefix (default 64)")
    parser.add_argument("--prompts", type=int, default=6, help="prompts (and prefixes) per set (default 6)")
    parser.add_argument("--concurrency", type=int, default=2, help="--max-concurrency of the client (default 2)")
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated per request (default 16)")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="each engine's KV cache (default 4)")
    parser.add_argument("--model", type=Path, default=None, help="a model directory (default: the tiny test model)")
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct, built from PyPI")
    parser.add_argument("--kvtier-setting", type=kvtier_setting, action="append", default=[], metavar="KEY=VALUE",
                        help="one more kvtier setting for kvtier's servers (repeatable; e.g. load_mode=sync)")
    parser.add_argument("--vllm-cpu-defaults", action="store_true",
                        help="leave VLLM_CPU_NUM_OF_RESERVED_CPU to vLLM (default: 0 for both servers, as the bench "
                             "suite: vLLM's CPU build reserves one core more for an engine with any KV connector)")
    parser.add_argument("--out", type=Path, default=Path("bench-serve"), help="logs, raw results, summary.json")
    args = parser.parse_args()
    out = args.out.absolute()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if args.real:
        from kvtier.bench.real_model import make_real_model
        model = make_real_model(out / "smollm2").dir
    else:
        from kvtier.bench.model import ensure_model
        model = ensure_model(args.model or out / "model", say=print)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        order = ("plain", "kvtier") if r % 2 == 0 else ("kvtier", "plain")
        row: dict[str, Any] = {"round": r, "order": list(order)}
        for kind in order:
            row[kind] = run_plain(args, model, out, r) if kind == "plain" else run_kvtier(args, model, out, r)
        rounds.append(row)
        p50 = statistics.median
        print(f"round {r} ({time.perf_counter() - t0:.0f} s): TTFT p50 plain fresh {p50(row['plain']['fresh']):.3f} "
              f"new {p50(row['plain']['new']):.3f} floor {p50(row['plain']['floor']):.3f} | kvtier fresh "
              f"{p50(row['kvtier']['fresh']):.3f} new {p50(row['kvtier']['new']):.3f} resume "
              f"{p50(row['kvtier']['resume']):.3f} s ({row['kvtier']['loaded_tokens']} tokens loaded)", flush=True)
        for kind in order:
            print(f"  {kind} CPU seconds: " + "; ".join(f"{phase} " + ", ".join(f"{k} {v:.2f}" for k, v in d.items())
                                                       for phase, d in row[kind]["cpu_s"].items()), flush=True)
        print("  resume profile, medians: " + ", ".join(f"{k} {v * 1e3:.1f} ms" if k.endswith("_s") else f"{k} {v:g}"
                                                    for k, v in row["kvtier"]["profile"].items()), flush=True)
    summary = summarize(rounds)
    (out / "summary.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                  "summary": summary, "rounds": rounds}, indent=1))
    for k, v in summary["ratio_medians"].items():
        print(f"{k:<22} median {v:.3f}x  (rounds: {', '.join(f'{x:.3f}' for x in summary['ratios_per_round'][k])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
