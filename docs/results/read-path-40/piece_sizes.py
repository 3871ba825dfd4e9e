"""`kvtier probe`'s page-cache read through kvtier against the raw read, for several sizes of the
piece that a read in place checksums at a time (``kvtier.tiers.reads.HASH_PIECE_BYTES``),
alternating, ROUNDS rounds; writes piece-sizes.json here.

    python docs/results/read-path-40/piece_sizes.py DIR 1048576,262144,524288,131072 2
"""
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import kvtier.tiers.reads as reads
from kvtier.probe.fs import run_probe

where, sizes, rounds = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
out: dict[int, list[dict[str, float]]] = {s: [] for s in sizes}
for r in range(rounds):
    for s in sizes:
        reads.HASH_PIECE_BYTES = s
        d = dataclasses.asdict(run_probe(where))
        raw = max(d["cache_serial_gbps"], d["cache_parallel_gbps"])
        row = {"kvtier_cache": d["kvtier_cache_gbps"], "raw_cache": raw, "ratio": d["kvtier_cache_gbps"] / raw,
               "cold": d["kvtier_vs_best_raw"]}
        out[s].append(row)
        print(r, s, {k: round(v, 3) for k, v in row.items()}, flush=True)
for s in sizes:
    print(s, "median page-cache ratio", round(statistics.median(x["ratio"] for x in out[s]), 3))
(Path(__file__).parent / "piece-sizes.json").write_text(json.dumps({str(k): v for k, v in out.items()}, indent=1))
