"""The table of a ``benchmarks/side_by_side.sh`` run: each headline figure of ``run_all.sh``,
before and after, as the median over rounds (every round's value in brackets) and their ratio.

    python benchmarks/side_by_side.py results/side            # markdown on stdout
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

FIGURES = [  # (result file, dotted key, unit)
    ("read_path", "median.kvtier_read_gbps", "GB/s"),
    ("read_path", "median.kvtier_vs_best_raw", "x raw"),
    ("read_path", "median.kvtier_cache_gbps", "GB/s"),
    ("read_path", "median.write_gbps", "GB/s"),
    ("read_path_tiny", "median.kvtier_read_gbps", "GB/s"),
    ("read_path_tiny", "median.kvtier_vs_best_raw", "x raw"),
    ("read_path_tiny", "median.kvtier_cache_gbps", "GB/s"),
    ("lookup", "lookup_list.median_ms", "ms"),
    ("lookup", "lookup_numpy.median_ms", "ms"),
    ("gpu_path", "all_bit_exact", ""),
    ("probe_fs", "kvtier_read_gbps", "GB/s"),
    ("probe_fs", "kvtier_vs_best_raw", "x raw"),
    ("probe_fs", "kvtier_cache_gbps", "GB/s"),
    ("probe_redis", "kvtier_read_gbps", "GB/s"),
    ("probe_redis", "kvtier_vs_best_raw", "x raw"),
]


def value(path: Path, key: str) -> Any:
    """The figure at dotted ``key`` in the JSON file ``path``; None when missing."""
    try:
        data: Any = json.loads(path.read_text())
        for part in key.split("."):
            data = data[part]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return data


def column(out: Path, side: str, name: str, key: str) -> list[Any]:
    rounds = sorted(out.glob(f"{side}-*/"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    return [v for v in (value(r / f"{name}.json", key) for r in rounds) if v is not None]


def cell(values: list[Any]) -> tuple[str, float | None]:
    if not values:
        return "-", None
    if isinstance(values[0], bool):
        return str(all(values)), None
    med = statistics.median(values)
    return f"{med:.3f} ({', '.join(f'{v:.2f}' for v in values)})", med


def table(out: Path) -> str:
    lines = ["| benchmark | figure | before | after | after / before |", "|---|---|---:|---:|---:|"]
    for name, key, unit in FIGURES:
        before, b = cell(column(out, "before", name, key))
        after, a = cell(column(out, "after", name, key))
        ratio = f"{a / b:.2f}" if a is not None and b else ""
        label = key.removeprefix("median.") + (f" ({unit})" if unit else "")
        lines.append(f"| {name} | {label} | {before} | {after} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the OUT folder of benchmarks/side_by_side.sh")
    args = ap.parse_args(argv)
    if not any(args.out.glob("before-*/")):
        ap.error(f"{args.out} holds no before-N/ results of benchmarks/side_by_side.sh")
    print(table(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
