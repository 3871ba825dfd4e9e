"""``kvtier demo``: the embedded default run: a probe, then a store round trip on a temp pool."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from kvtier.cli.main import emit_json
from kvtier.cli.probe_cmd import probe_table
from kvtier.layout import KVLayout
from kvtier.probe import run_probe
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


def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="kvtier-demo-", dir=args.dir))
    err = Console(stderr=True)
    try:
        with err.status("probing the temp directory (512 MiB, 2 repeats)"):
            probe = run_probe(root, total_bytes=512 << 20, repeats=2)
        with err.status("store round trip: instance A writes a pool, instance B reads it"):
            trip = round_trip(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        emit_json({"probe": probe.to_dict(), "round_trip": trip})
        return 0 if trip["identical"] else 1
    out = Console()
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
    return 0 if trip["identical"] else 1
