"""What saving costs new prompts: plain vLLM vs kvtier on all-new prompts, side by side.

Issue 23's target: with an outside OpenAI-API client (new prompts of about 6.2k tokens, 8 output
tokens each, concurrency 2, a fresh server on an empty pool), kvtier's mean TTFT within 3% of
plain vLLM's. Each repeat starts every variant fresh, in an order that rotates between repeats,
sends the same kind of prompts (new ones each time, so every one is a full prefill) after one
warm-up request, and stops it. Variants (``--variants``):

* ``plain``: vLLM without a connector;
* ``noop``: vLLM with a KV connector that does nothing (``benchmarks/noop_connector.py``):
  the cost of vLLM's own calls into any connector;
* ``connector``: kvtier loaded, nothing stored (``host_bytes: 0``, no disk, no pool): the cost
  of the connector's presence (vLLM's CPU binding, the hooks);
* ``host``: kvtier saving into host DRAM only (the gather on the engine thread);
* ``pool``: kvtier saving into host DRAM and an fs pool (the background writer), the default
  deployment;
* ``pool-no-tails``: the same with ``tail_chunks: false`` (whole chunks only): what saving each
  prompt's tail adds.

Every server gets the same arguments and environment (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, as
the suite). Printed: each variant's mean and median TTFT (medians over repeats) and the ratio
to plain within each repeat.

    python benchmarks/save_cost.py --out /tmp/save-cost [--repeats 3] [--prompts 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench import procstat
from kvtier.bench.client import LoadClient, Session, Target, Turn
from kvtier.bench.configs import SuiteSpec
from kvtier.bench.engines import Process, free_port
from kvtier.bench.model import ensure_model
from kvtier.bench.runner import engine_argv, engine_env, kvtier_serve_argv
from kvtier.bench.workload import TextMaker
from kvtier.tiers.poolroot import scratch_pool

VARIANTS = ("plain", "noop", "connector", "host", "pool", "pool-no-tails")


NOOP = {"kv_connector": "NoopConnector", "kv_connector_module_path": "noop_connector", "kv_role": "kv_both"}


def settings(variant: str, work: Path) -> dict[str, Any] | None:
    if variant in ("plain", "noop"):
        return None
    base: dict[str, Any] = {"chunk_tokens": 256, "metrics_file": str(work / "metrics")}
    if variant == "connector":
        return {**base, "host_bytes": 0, "load_policy": "never"}
    if variant == "host":
        return {**base, "host_bytes": "1GiB"}
    if variant in ("pool", "pool-no-tails"):
        pool = {**base, "host_bytes": "1GiB", "pool_url": scratch_pool(work / "pool"), "pool_bytes": "16GiB"}
        return pool if variant == "pool" else {**pool, "tail_chunks": False}
    raise ValueError(f"variant {variant!r}; use {', '.join(VARIANTS)}")


def sessions(text: TextMaker, n: int, tokens: int, seed: int) -> list[Session]:
    import random

    rng = random.Random(seed)
    return [Session(seed * 1000 + i, "", [Turn(text.words(rng, tokens), 8)]) for i in range(n)]


def thread_cpu(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every thread of the server's process group, summed by
    thread name (``kvtier-writer-0`` -> ``kvtier-writer``: a pool's threads count together)."""
    out: dict[str, float] = {}
    for name, seconds in procstat.group_thread_cpu(pgid).items():
        group = re.sub(r"[_-]\d*$", "", name) if name.startswith("kvtier") else "engine"
        out[group] = out.get(group, 0.0) + seconds
    return out


def measure(variant: str, model: Path, work: Path, text: TextMaker, args: argparse.Namespace,
            seed: int) -> tuple[list[float], dict[str, float]]:
    """Start ``variant`` fresh, warm it up, send ``args.prompts`` new prompts; their TTFTs and the
    CPU seconds each group of the server's threads spent meanwhile."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    port = free_port()
    vllm = engine_argv(SuiteSpec(work), model, port, args.tokens + 1024)
    conf = settings(variant, work)
    env = engine_env(args.kv_cache_gib)
    if variant == "noop":
        vllm = [*vllm, "--kv-transfer-config", json.dumps(NOOP)]
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    argv = ([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm] if conf is None
            else kvtier_serve_argv(conf, work / "kvtier.yaml", vllm))
    proc = Process(variant, argv, work / "engine.log", env, ready_url=f"http://127.0.0.1:{port}/health")
    proc.start(300)
    try:
        client = LoadClient([Target(f"http://127.0.0.1:{port}", "bench")])
        asyncio.run(client.run(sessions(text, 1, args.tokens, seed + 500), range(1), 1))  # warm-up
        assert proc.proc is not None
        before = thread_cpu(proc.proc.pid)
        records = asyncio.run(client.run(sessions(text, args.prompts, args.tokens, seed), range(1), args.concurrency))
        after = thread_cpu(proc.proc.pid)
    finally:
        proc.stop()
    bad = [r["error"] for r in records if r["error"]]
    if bad:
        raise RuntimeError(f"{variant}: {bad[0]}")
    cpu = {k: round(after[k] - before.get(k, 0.0), 3) for k in after if after[k] - before.get(k, 0.0) > 0}
    return [float(r["ttft_s"]) for r in records], cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="work folder (engine logs, pools); results.json here")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=6, help="new prompts per measurement")
    ap.add_argument("--tokens", type=int, default=6200, help="prompt length")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    model = ensure_model(args.out / "model")
    text = TextMaker(model)
    results: dict[str, list[list[float]]] = {v: [] for v in variants}
    cpu: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            t0 = time.perf_counter()
            ttfts, used = measure(v, model, args.out / "work" / v, text, args, seed=100 * rep + VARIANTS.index(v) + 1)
            results[v].append(ttfts)
            cpu[v].append(used)
            kv = sum(s for k, s in used.items() if k != "engine")
            print(f"repeat {rep + 1} {v}: mean TTFT {statistics.mean(ttfts):.3f} s, CPU engine "
                  f"{used.get('engine', 0):.2f} s, kvtier threads {kv:.2f} s ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr)
    means = {v: [statistics.mean(t) for t in results[v]] for v in variants}
    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "ttft_s": results, "mean_ttft_s": means,
                           "median_of_means_s": {v: statistics.median(m) for v, m in means.items()},
                           "cpu_s": cpu,
                           "median_cpu_s": {v: {k: statistics.median(c.get(k, 0.0) for c in cpu[v])
                                                for k in sorted({k for c in cpu[v] for k in c})} for v in variants}}
    if "plain" in variants:
        out["vs_plain"] = {v: statistics.median(m / p for m, p in zip(means[v], means["plain"], strict=True))
                           for v in variants}
    (args.out / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("median_of_means_s", "vs_plain", "median_cpu_s") if k in out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
