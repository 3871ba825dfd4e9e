"""Which threads of a fresh server use CPU, and when: from ``/health`` through its first requests.

    python benchmarks/serve_threads.py [--server kvtier|plain] [--prefix-len 1024] [--out DIR]
                                       [--kvtier-setting KEY=VALUE ...]

Starts one server as ``benchmarks/bench_serve.py`` does (the tiny model; ``kvtier serve`` with a
pool on the local disk, or plain ``vllm serve``), then, while ``vllm bench serve`` sends its
first prompts (the bench's fresh phase), samples every thread of the server's processes every
0.25 s (``/proc/PID/task/TID``). It prints, per thread that used more than 0.05 s of CPU, when
it was first and last seen and the CPU it used, beside when the client's first request went out
and its TTFTs, and writes the same to ``DIR/threads.json``. It answers whether something that
starts with the server (kvtier's host-DRAM prefault, say) still runs when the first requests
come.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import bench_serve

from kvtier.bench.configs import kvtier_setting
from kvtier.bench.engines import group_pids
from kvtier.bench.model import ensure_model
from kvtier.bench.procstat import thread_stat
from kvtier.tiers.poolroot import scratch_pool

PERIOD_S = 0.25


def sample(root_pid: int) -> dict[str, float]:
    """CPU seconds so far of every live thread in the process group, as ``pid/tid/name``."""
    row: dict[str, float] = {}
    for pid in group_pids(root_pid):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                name, _, seconds = thread_stat(pid, int(tid))
            except OSError:
                continue
            row[f"{pid}/{tid}/{name}"] = seconds
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=("kvtier", "plain"), default="kvtier")
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens per prefix (default 1024)")
    parser.add_argument("--kvtier-setting", type=kvtier_setting, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=Path("serve-threads"))
    args = parser.parse_args()
    out = args.out.absolute()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    bench = argparse.Namespace(prefix_len=args.prefix_len, suffix_len=64, prompts=6, concurrency=2, output_len=16,
                               kv_cache_gib=4, kvtier_setting=args.kvtier_setting, vllm_cpu_defaults=False)
    model = ensure_model(out / "model", say=print)
    pool = scratch_pool(out / "work" / "pool") if args.server == "kvtier" else ""
    proc, port = bench_serve.server(args.server, bench, model, out, "t", pool)
    assert proc.proc is not None
    t0 = time.perf_counter()
    samples: list[tuple[float, dict[str, float]]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, sample(proc.proc.pid)))  # type: ignore[union-attr]
            stop.wait(PERIOD_S)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        ttfts = bench_serve.client(bench, model, port, 1000, out, "fresh")
        detail = json.loads((out / "raw" / "fresh.json").read_text())
        started = detail.get("date")
        client_s = time.perf_counter() - t0
        time.sleep(1.0)
    finally:
        stop.set()
        watcher.join()
        proc.stop()
    threads: dict[str, dict[str, float]] = {}
    for at, row in samples:
        for key, seconds in row.items():
            entry = threads.setdefault(key, {"first_s": at, "cpu_at_first": seconds})
            entry.update(last_s=at, cpu_at_last=seconds)
    used = {k: {"first_s": round(v["first_s"], 2), "last_s": round(v["last_s"], 2),
                "cpu_s": round(v["cpu_at_last"] - v["cpu_at_first"], 3)} for k, v in threads.items()}
    # The client's run lasts ``duration`` from its first request to its last answer; what follows
    # (writing its results, exiting) makes this an estimate on the late side.
    first_request_s = client_s - float(detail.get("duration", 0.0))
    result: dict[str, Any] = {"server": args.server, "prefix_len": args.prefix_len, "client_date": started,
                              "client_done_s": round(client_s, 2), "first_request_s": round(first_request_s, 2),
                              "ttfts_s": ttfts, "threads": used}
    (out / "threads.json").write_text(json.dumps(result, indent=1))
    print(f"{args.server}: /health at 0 s; client's first request at about {first_request_s:.1f} s, "
          f"done at {client_s:.1f} s; TTFTs {', '.join(f'{t:.3f}' for t in ttfts)} s")
    for key, v in sorted(used.items(), key=lambda kv: -kv[1]["cpu_s"]):
        if v["cpu_s"] > 0.05:
            print(f"  {key:<44} seen {v['first_s']:6.2f}-{v['last_s']:6.2f} s  CPU {v['cpu_s']:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
