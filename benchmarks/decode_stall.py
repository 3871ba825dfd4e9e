"""Benchmark: do running sessions keep decoding while others resume from a slow pool?

4 sessions stream long outputs; once each has produced ``--warm-tokens`` tokens, 8 other
sessions of 8k+ tokens resume from the shared pool (one every ``--gap-s``), through a pool
that adds ``--chunk-latency-ms`` to every chunk read (kvtier's fault-injecting tier, standing
in for a networked all-flash pool). Measured: the streaming sessions' inter-token latency
(ITL) p50/p99 over the window that starts with the first resume and lasts ``--window-s``,
in fresh engine processes, one after the other (``--repeats`` rounds, interleaved; medians):

* ``baseline``: the same engine and streams, no resumes (the same window);
* ``warm``: the resumes, with every session already in vLLM's own prefix cache (run once
  before the streams start): what a resume costs the others with no load at all (its last
  16 tokens computed over an 8k context, its first token);
* ``async``: the resumes with ``load_mode: async`` (the request waits, the engine goes on);
* ``sync``: the resumes with ``load_mode: sync`` (the step that schedules a resume waits).

Target (the "loads never stall the engine" issue): async ITL p99 <= 1.5x the baseline's.

    python benchmarks/decode_stall.py --out docs/results/decode_stall.json

A first process populates the pool with the 8 sessions (no latency injected). Each engine is
vLLM's ``AsyncLLM`` in the benchmark's own process, so token arrival times are taken where
the engine hands them out (no HTTP in between).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.summary import quantile
from kvtier.tiers.poolroot import scratch_pool


async def _stream(engine: Any, prompt: list[int], params: Any, req_id: str, times: list[float]) -> int:
    n = 0
    async for out in engine.generate({"prompt_token_ids": prompt}, params, req_id):
        now = time.perf_counter()
        for _ in out.outputs[0].token_ids:
            times.append(now)
        n = len(times)
    return n


async def _resume(engine: Any, prompt: list[int], params: Any, req_id: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    cached = 0
    async for out in engine.generate({"prompt_token_ids": prompt}, params, req_id):
        cached = out.num_cached_tokens or cached
    return {"t0": t0, "ttft_s": time.perf_counter() - t0, "cached": cached}


async def _run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config=spec["extra"])
    longest = max(len(p) for p in spec["resumes"]) + 64
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=spec["model"], enforce_eager=True, max_model_len=longest, max_num_batched_tokens=longest,
        enable_prefix_caching=True, seed=0, kv_transfer_config=transfer))
    try:
        stream_params = SamplingParams(temperature=0, max_tokens=spec["stream_tokens"], ignore_eos=True,
                                       output_kind=RequestOutputKind.DELTA)
        one = SamplingParams(temperature=0, max_tokens=1, output_kind=RequestOutputKind.DELTA)
        if spec["populate"]:
            return {"resumes": [await _resume(engine, p, one, f"pop{i}") for i, p in enumerate(spec["resumes"])]}
        await _resume(engine, spec["warmup"], one, "warmup")  # the engine's first step is slow
        if spec["prewarm"]:  # vLLM's own prefix cache will hold every resumed session
            for i, prompt in enumerate(spec["resumes"]):
                await _resume(engine, prompt, one, f"pre{i}")
        times: list[list[float]] = [[] for _ in spec["streams"]]
        streams = [asyncio.create_task(_stream(engine, p, stream_params, f"s{i}", times[i]))
                   for i, p in enumerate(spec["streams"])]
        while min(len(t) for t in times) < spec["warm_tokens"]:
            await asyncio.sleep(0.005)
        start = time.perf_counter()
        resumes = []
        if spec["resume"]:
            for i, prompt in enumerate(spec["resumes"]):
                resumes.append(asyncio.create_task(_resume(engine, prompt, one, f"r{i}")))
                await asyncio.sleep(spec["gap_s"])
        done = [await r for r in resumes]
        await asyncio.gather(*streams)
        end = start + spec["window_s"]
        gaps = [b - a for t in times for a, b in itertools.pairwise(t) if start <= b <= end]
        last_token = min(t[-1] for t in times)
        return {"gaps": gaps, "resumes": [{k: v for k, v in r.items() if k != "t0"} for r in done],
                "resumes_done_s": max((r["t0"] + r["ttft_s"] for r in done), default=start) - start,
                "streams_outlast_window": last_token >= end}
    finally:
        engine.shutdown()


def worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    result = asyncio.run(_run(spec))
    Path(spec["out"]).write_text(json.dumps(result))


def run(spec: dict[str, Any], tmp: Path, name: str) -> dict[str, Any]:
    spec = {**spec, "out": str(tmp / f"{name}.json")}
    path = tmp / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    print(f"running {name} ...", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, __file__, "--worker", str(path)], capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    result: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
    return result


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    if "error" in result:
        return {"error": result["error"][-500:]}
    gaps = result["gaps"]
    out: dict[str, Any] = {"itl_p50_s": quantile(gaps, 0.5), "itl_p99_s": quantile(gaps, 0.99),
                           "itl_max_s": max(gaps, default=None), "tokens_in_window": len(gaps),
                           "streams_outlast_window": result["streams_outlast_window"]}
    if result["resumes"]:
        out["resume_ttft_median_s"] = statistics.median(r["ttft_s"] for r in result["resumes"])
        out["resume_cached_tokens"] = [r["cached"] for r in result["resumes"]]
        out["resumes_done_s"] = result["resumes_done_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: the tiny model, built here)")
    ap.add_argument("--resume-tokens", type=int, default=8192, help="context of each resumed session (8192)")
    ap.add_argument("--resumes", type=int, default=8, help="sessions resumed during the window (8)")
    ap.add_argument("--streams", type=int, default=4, help="sessions streaming meanwhile (4)")
    ap.add_argument("--stream-tokens", type=int, default=400, help="tokens each stream generates (400)")
    ap.add_argument("--warm-tokens", type=int, default=24, help="stream tokens before the first resume (24)")
    ap.add_argument("--gap-s", type=float, default=0.25, help="seconds between resumes (0.25)")
    ap.add_argument("--window-s", type=float, default=3.0, help="ITL window from the first resume (3.0 s)")
    ap.add_argument("--chunk-latency-ms", type=float, default=20.0, help="added to each pool chunk read (20)")
    ap.add_argument("--io-threads", type=int, default=8, help="kvtier io_threads (reads in flight, 8)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each configuration, interleaved (3)")
    ap.add_argument("--out", type=Path, default=None, help="write summary and raw gaps here (JSON)")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    with tempfile.TemporaryDirectory(prefix="kvtier-decode-stall-") as scratch:
        return _bench(args, Path(scratch))


def _bench(args: argparse.Namespace, tmp: Path) -> int:
    """The run itself; `tmp` is scratch space that main removes afterwards."""
    from kvtier.bench.model import model_or_tiny

    model = model_or_tiny(args.model, tmp)
    rng = random.Random(7)
    # 16 tokens past the last full chunk: the resume computes 16 tokens, the rest is loaded.
    resumes = [[rng.randrange(100, 31000) for _ in range(args.resume_tokens + 16)] for _ in range(args.resumes)]
    streams = [[rng.randrange(100, 31000) for _ in range(64)] for _ in range(args.streams)]
    warmup = [rng.randrange(100, 31000) for _ in range(512)]
    latency = args.chunk_latency_ms / 1e3
    extra = {"pool_url": scratch_pool(tmp / "pool"), "host_bytes": "512MiB", "io_threads": args.io_threads,
             "load_policy": "always"}
    slow = {"pool": {"delay_prob": 1.0, "min_delay_s": latency, "max_delay_s": latency, "ops": ["load"]}}
    base = {"model": str(model), "resumes": resumes, "streams": streams, "warmup": warmup,
            "stream_tokens": args.stream_tokens, "warm_tokens": args.warm_tokens, "gap_s": args.gap_s,
            "window_s": args.window_s, "populate": False, "resume": True, "prewarm": False}
    populate = run({**base, "populate": True, "extra": extra}, tmp, "populate")
    configs = (("baseline", "async", False, False), ("warm", "async", True, True), ("async", "async", True, False),
               ("sync", "sync", True, False))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in configs}
    for rep in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
        for name, mode, resume, prewarm in configs:
            extra_run = {**extra, "load_mode": mode, "inject_faults": slow}
            runs[name].append(run({**base, "resume": resume, "prewarm": prewarm, "extra": extra_run}, tmp,
                                  f"{name}-{rep}"))
            print(f"  {name} #{rep}: {summarize(runs[name][-1])}", file=sys.stderr, flush=True)
    summary: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in ("worker", "out", "model")}
    summary["runs"] = {name: [summarize(r) for r in rs] for name, rs in runs.items()}
    p99 = {name: [s.get("itl_p99_s") for s in runs_] for name, runs_ in summary["runs"].items()}
    for name, values in p99.items():
        ok = [v for v in values if v is not None]
        summary[f"itl_p99_{name}_median_s"] = statistics.median(ok) if ok else None
    for mode in ("warm", "async", "sync"):
        ratios = [m / b for m, b in zip(p99[mode], p99["baseline"], strict=True) if m and b]
        summary[f"itl_p99_{mode}_vs_baseline_median"] = statistics.median(ratios) if ratios else None
        summary[f"itl_p99_{mode}_vs_baseline_each"] = ratios
        ttfts = [s["resume_ttft_median_s"] for s in summary["runs"][mode] if "resume_ttft_median_s" in s]
        summary[f"resume_ttft_{mode}_median_s"] = statistics.median(ttfts) if ttfts else None
    if "error" in populate:
        summary["populate_error"] = populate["error"][-500:]
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "runs": runs, "populate": populate}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
