"""One pool budget, two codecs: how many sessions the pool holds, and what that does to resumes.

    python benchmarks/codec_capacity.py --storage-bytes 120MiB [--codecs none,fp8] [--sessions 24]
                                        [--concurrency 4] [--model DIR] [--out DIR]

Runs ``kvtier bench suite`` (cold resume, the shared-pool configuration only, no short chat) once
per codec, each with the same pool budget (``--storage-bytes``) and the same sessions: populate
every session, restart the engine, resume each one at ``--concurrency``. A budget below what the
sessions' KV takes in ``none`` makes the pool evict; a codec that stores fewer bytes per token
keeps more sessions. For each codec it prints the pool's bytes and chunk files on disk at the
end, the sessions resumed from the pool (the resume read at least 90% of the tokens the session
had before), the share of resumed prompt tokens read from the pool, and the resume TTFT p50/p90;
then each codec's figures against the first's, from the same run. The suite's own folders (raw
rows, summaries, plots) stay under ``--out``.

The resumes go in the order the sessions were populated, oldest first, as the suite always
resumes. With a least-recently-used pool, a session that missed writes its whole prompt again
and evicts the next-oldest sessions before their turn: a pool that holds half the sessions can
serve far fewer than half of them. That is how such a pool behaves under a scan, and the figure
is reported as measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HELD = 0.9  # a resume "from the pool": it read at least this share of the session's earlier prompt


def run_suite(args: argparse.Namespace, codec: str, out: Path) -> None:
    argv = [sys.executable, "-m", "kvtier.cli.main", "bench", "suite", "--preset", args.preset,
            "--configs", "shared-pool", "--no-short-chat", "--no-probe", "--keep-work",
            "--concurrency", str(args.concurrency),
            "--sessions", str(args.sessions), "--storage-bytes", args.storage_bytes,
            "--kvtier-setting", f"kv_codec={codec}", "--out", str(out)]
    if args.model:
        argv += ["--model", str(args.model)]
    print("$", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def figures(out: Path) -> dict[str, Any]:
    from kvtier.bench.summary import percentile

    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines() if line.strip()]
    populate = {r["session"]: r for r in rows if r["phase"] == "populate" and r["error"] is None}
    resumes = [r for r in rows if r["measured"] and r["error"] is None]
    held = [r for r in resumes if r["session"] in populate
            and (r["cached_tokens"] or 0) >= HELD * populate[r["session"]]["prompt_tokens"]]
    ttfts = [r["ttft_s"] for r in resumes]
    files = list((out / "work").rglob("*.kvt"))
    return {
        "sessions": len(resumes),
        "errors": sum(1 for r in rows if r["error"] is not None),
        "resumed_from_pool": len(held),
        "token_hit_rate": sum(r["cached_tokens"] or 0 for r in resumes) / max(1, sum(r["prompt_tokens"]
                                                                                      for r in resumes)),
        "ttft_p50_s": percentile(ttfts, 50),  # the suite's own percentiles (summary.json's)
        "ttft_p90_s": percentile(ttfts, 90),
        "pool_bytes_on_disk": sum(f.stat().st_size for f in files),
        "pool_files": len(files),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage-bytes", required=True, help="the pool budget, the same for every codec")
    parser.add_argument("--codecs", default="none,fp8", help="comma-separated; the first is the baseline")
    parser.add_argument("--preset", default="quick", help="the suite's preset (its context range and model)")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: the suite's tiny model)")
    parser.add_argument("--out", type=Path, default=Path("codec-capacity"))
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty")
    rows: dict[str, dict[str, Any]] = {}
    for codec in args.codecs.split(","):
        out = args.out / codec
        run_suite(args, codec, out)
        rows[codec] = figures(out)
        shutil.rmtree(out / "work", ignore_errors=True)  # the pool: counted, no longer needed
        print(codec, json.dumps(rows[codec]), flush=True)
    base = rows[args.codecs.split(",")[0]]
    print(f"\nbudget {args.storage_bytes}, {base['sessions']} sessions, resumed at c={args.concurrency}")
    print("| codec | pool bytes | files | resumed from the pool | token hit rate | TTFT p50 | TTFT p90 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for codec, r in rows.items():
        print(f"| {codec} | {r['pool_bytes_on_disk'] / 2**20:.0f} MiB | {r['pool_files']} | "
              f"{r['resumed_from_pool']}/{r['sessions']} | {r['token_hit_rate']:.2f} | {r['ttft_p50_s']:.3f} s | "
              f"{r['ttft_p90_s']:.3f} s |")
    for codec, r in rows.items():
        if r is not base and base["ttft_p50_s"]:
            r["vs_first"] = {"resumed_from_pool": r["resumed_from_pool"] / max(1, base["resumed_from_pool"]),
                             "ttft_p50": r["ttft_p50_s"] / base["ttft_p50_s"]}
            print(codec, "against", args.codecs.split(",")[0], r["vs_first"])
    (args.out / "capacity.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
