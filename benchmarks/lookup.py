"""Benchmark: lookup latency of a long prefix held in the host tier.

Target (issue 2): a 128k-token prefix held in host DRAM is looked up in <= 5 ms. Reports the
median and p90 over ``--iters`` lookups, for token ids given as a Python list (what engines
pass) and as a numpy array, and the share spent hashing (``chunk_ids`` alone).

    python benchmarks/lookup.py --tokens 131072 --iters 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from kvtier import KVLayout, TieredStore


def timed(fn, iters: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return {"median_ms": statistics.median(samples), "p90_ms": samples[int(len(samples) * 0.9)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    args = ap.parse_args()
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    host_bytes = (args.tokens // args.chunk_tokens + 1) * (args.chunk_tokens * layout.bytes_per_token + 4096)
    tokens = np.random.default_rng(0).integers(0, 32000, args.tokens).astype(np.uint32)
    as_list = tokens.tolist()
    with TieredStore.open("bench-lookup", layout, args.chunk_tokens, host_bytes=host_bytes) as store:
        kv = torch.zeros(layout.shape(args.tokens), dtype=layout.dtype)
        store.put(tokens, kv)
        del kv
        hit = store.lookup(as_list)
        assert hit.num_tokens == args.tokens - args.tokens % args.chunk_tokens, hit.num_tokens
        assert set(hit.chunk_tiers) == {"host"}
        out = {
            "tokens": args.tokens, "chunks": hit.num_chunks, "iters": args.iters,
            "lookup_list": timed(lambda: store.lookup(as_list), args.iters),
            "lookup_numpy": timed(lambda: store.lookup(tokens), args.iters),
            "hash_only_list": timed(lambda: store.chunk_ids(as_list), args.iters),
        }
    out["target_le_5ms"] = out["lookup_list"]["median_ms"] <= 5.0
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
