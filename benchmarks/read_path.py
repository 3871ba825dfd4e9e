"""Benchmark: kvtier's read path against the raw device, in the same run.

Targets (issue 2): kvtier cold read >= 85% of the best raw cold read the probe measures on the
same files; parallel >= 1.8x serial on page-cache reads (kvtier's path and raw reported).
Runs the probe ``--runs`` times (each with its own repeats, interleaved modes) and reports
the median of each figure over the runs, plus every run's numbers.

    python benchmarks/read_path.py /var/tmp --runs 3 --total 512MiB --out results/read_path.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from kvtier.config import parse_bytes
from kvtier.probe import run_probe

FIELDS = ("serial_gbps", "parallel_gbps", "direct_serial_gbps", "direct_parallel_gbps", "best_raw_gbps",
          "kvtier_cold_serial_gbps", "kvtier_read_gbps", "kvtier_vs_best_raw", "cache_serial_gbps",
          "cache_parallel_gbps", "cache_parallel_speedup", "kvtier_cache_serial_gbps", "kvtier_cache_gbps",
          "kvtier_cache_parallel_speedup", "write_gbps")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--total", default="512MiB")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        r = run_probe(args.path, total_bytes=parse_bytes(args.total, "--total"), threads=args.threads,
                      repeats=args.repeats).to_dict()
        runs.append(r)
        print(f"run {i + 1}/{args.runs}: kvtier cold {r['kvtier_read_gbps']:.2f} GB/s = "
              f"{r['kvtier_vs_best_raw']:.0%} of best raw {r['best_raw_gbps']:.2f}; page cache kvtier "
              f"{r['kvtier_cache_serial_gbps']:.2f} -> {r['kvtier_cache_gbps']:.2f} GB/s "
              f"({r['kvtier_cache_parallel_speedup']:.2f}x), raw {r['cache_parallel_speedup']:.2f}x",
              file=sys.stderr)
    med = {f: statistics.median(r[f] for r in runs if r[f] is not None) for f in FIELDS
           if any(r[f] is not None for r in runs)}
    summary = {
        "median": med,
        "targets": {
            "kvtier_cold_vs_best_raw >= 0.85": med["kvtier_vs_best_raw"] >= 0.85,
            "kvtier_page_cache_parallel_vs_serial >= 1.8": med["kvtier_cache_parallel_speedup"] >= 1.8,
            "raw_page_cache_parallel_vs_serial >= 1.8": med["cache_parallel_speedup"] >= 1.8,
        },
        "file_bytes": runs[0]["file_bytes"], "files": runs[0]["files"], "threads": args.threads,
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
