"""Benchmark: cold resume of long contexts in a fresh vLLM process (CPU build), side by side.

Targets: an 8k-token context resumed in a fresh engine process has a TTFT at least
10x lower than recompute on the tiny model, and not worse than vLLM's ExampleConnector on the
same prompts in the same run; with all-new prompts, the connector costs at most 3%.

Every configuration runs in its own engine processes, one after the other:

* ``plain``: no connector: TTFT of never-seen prompts (the recompute baseline);
* ``kvtier-never``: the connector loaded with ``load_policy: never`` (all-new prompts: its
  overhead, and vLLM's CPU binding with a connector set);
* ``kvtier``: process A prefills the sessions (saving into an fs pool), process B (fresh)
  resumes them: TTFT of the resume (``load_mode: auto``, the default: one resume at a time
  on an idle engine loads in the step), and process C (fresh) the same with ``load_mode:
  async`` (every load in the background);
* ``example``: the same with vLLM's ExampleConnector (``shared_storage_path``);
* ``floor``: plain vLLM prefills the sessions, then serves each again from its own prefix cache
  in the same process: the resume "as if the KV had never left". ``floor + bytes`` adds the
  time to read the pool's chunk files of a session at the device's rate, measured in the same
  run right after the kvtier resume, in the page-cache state that resume saw (one thread,
  8 MiB reads, no checks: the raw device's best single-stream rate).

With ``--warmup`` every process serves one short new prompt first, left out of the figures
(the first request of a process pays one-off costs: allocator growth, lazy imports).

    python benchmarks/vllm_resume.py --tokens 8192 --sessions 3 --warmup --out docs/results/vllm_resume.json

With ``--ab-src OTHER/src`` it compares two kvtier trees instead (before and after a change):
the floor, one populate, then ``--ab-rounds`` pairs of fresh resumes on the same pool, this
tree's and the other's alternating (which goes first alternates too), and the median of the
per-pair TTFT ratios:

    git worktree add /tmp/before HEAD~1
    python benchmarks/vllm_resume.py --tokens 8192 --sessions 5 --warmup --profile --ab-src /tmp/before/src

With ``--tensor-parallel-size 2`` every engine runs tensor parallel (one core per rank on the
CPU build); the target there (the connector's deployment issue) is a resume at least 5x faster
than TP=2 recompute, with every rank's shard in the pool and outputs equal to recompute's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.engines import EngineError
from kvtier.bench.offline import run_engine
from kvtier.tiers.poolroot import scratch_pool


def run(spec: dict[str, Any], tmp: Path, name: str, src: Path | None = None) -> dict[str, Any]:
    """Results of one engine process, or ``{"error": ...}``: a failed peer is recorded, not fatal.
    ``src``: import kvtier from that source tree in the engine process instead."""
    saved = os.environ.get("PYTHONPATH")
    if src is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(src.resolve()), saved) if p)
    try:
        result: dict[str, Any] = run_engine(spec, tmp, name)
        return result
    except EngineError as exc:
        return {"error": str(exc)}
    finally:
        if src is not None:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved


def median_ttft(result: dict[str, Any], tag: str | None = None) -> float | None:
    """Median TTFT of the results tagged ``tag`` (warm-up requests never count)."""
    if "error" in result:
        return None
    times = [r["ttft_s"] for r in result["results"] if r.get("tag") == tag]
    return statistics.median(times) if times else None


def raw_read_s(files: list[Path]) -> float:
    """Seconds to read ``files`` in one thread with 8 MiB reads into one buffer (no checks)."""
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass
    return time.perf_counter() - t0


def session_files(pool: Path, session: list[int], chunk_tokens: int = 256) -> list[Path]:
    """The pool files holding ``session``'s full chunks (every head and rank shard), found by
    the token digest in their headers."""
    import numpy as np
    from blake3 import blake3

    from kvtier.format import unpack_header

    digests = {blake3(np.asarray(session[i:i + chunk_tokens], dtype="<u4").tobytes()).digest()
               for i in range(0, len(session) // chunk_tokens * chunk_tokens, chunk_tokens)}
    found = []
    for path in pool.glob("??/??/*.kvt"):
        with open(path, "rb") as fh:
            if unpack_header(fh.read(4096)).chunk.tokens_digest in digests:
                found.append(path)
    return found


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: kvtier model make into a temp dir)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=2,
                    help="kvtier io_threads (default 2: this machine has 2 cores and vLLM binds one)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="TP size of every engine (default 1)")
    ap.add_argument("--skip-example", action="store_true", help="leave out vLLM's ExampleConnector peer")
    ap.add_argument("--warmup", action="store_true",
                    help="every process serves one short new prompt first, left out of the figures")
    ap.add_argument("--profile", action="store_true",
                    help="write kvtier's resume profile (connector setting profile_file) for both resumes and "
                         "put its medians (ms) in the summary: where the time over the floor goes")
    ap.add_argument("--ab-src", type=Path, default=None,
                    help="A/B mode: another kvtier source tree (a checkout's src/, e.g. of the commit before a "
                         "change); runs only the floor, one populate and --ab-rounds pairs of fresh resumes, this "
                         "tree's and that one's alternating on the same pool, and reports the median of the "
                         "per-round TTFT ratios (the machine's drift falls on both sides of each pair)")
    ap.add_argument("--ab-rounds", type=int, default=3, help="resume pairs in A/B mode (default 3)")
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args()


def _steps(args: argparse.Namespace, model: Path, tmp: Path, sessions: list[list[int]], fresh: list[list[int]],
           warm: list[int]) -> list[tuple[str, dict[str, Any]]]:
    """The engine processes to run, in order: the floor, plain vLLM, kvtier's, the peer's."""
    base = {"model": str(model), "max_tokens": 1, "tensor_parallel_size": args.tensor_parallel_size, "kv_cache_gib": 2,
            "logprobs": None, "log_stats": False}  # timing runs: no log-probabilities, no vLLM metrics
    kv_extra = {"pool_url": scratch_pool(tmp / "pool"), "host_bytes": "1GiB", "io_threads": args.io_threads}

    def plan(n: int, again: bool = False) -> dict[str, Any]:
        """Prompts and plan: the warm-up prompt (index n) first if asked, each session once
        (and, for the floor, each again from the engine's own prefix cache, tagged "hit")."""
        steps = ([{"p": n, "tag": "warmup"}] if args.warmup else []) + [{"p": i} for i in range(n)]
        if again:
            steps += [{"p": i, "tag": "hit"} for i in range(n)]
        return {"plan": steps}

    on_sessions = {"prompts": [*sessions, warm], **plan(args.sessions)}
    on_fresh = {"prompts": [*fresh, warm], **plan(args.sessions)}
    example = {"connector": "example", "extra": {"shared_storage_path": str(tmp / "example")}}
    def profiled(name: str, extra: dict[str, Any]) -> dict[str, Any]:
        return {**extra, "profile_file": str(tmp / f"{name}.profile.jsonl")} if args.profile else extra

    steps = [
        ("floor", {**base, "connector": None, "prompts": [*sessions, warm], **plan(args.sessions, again=True)}),
        ("plain", {**base, "connector": None, **on_fresh}),
        ("kvtier-never", {**base, "connector": "kvtier", **on_fresh,
                          "extra": {**kv_extra, "pool_url": scratch_pool(tmp / "unused"), "load_policy": "never"}}),
        ("kvtier-populate", {**base, "connector": "kvtier", **on_sessions, "extra": kv_extra}),
        ("kvtier-resume", {**base, "connector": "kvtier", **on_sessions,
                           "extra": profiled("kvtier-resume", kv_extra)}),
        ("kvtier-resume-async", {**base, "connector": "kvtier", **on_sessions,
                                 "extra": profiled("kvtier-resume-async", {**kv_extra, "load_mode": "async"})}),
        ("example-populate", {**base, **example, **on_sessions}),
        ("example-resume", {**base, **example, **on_sessions}),
    ]
    if args.skip_example:
        steps = [(name, spec) for name, spec in steps if not name.startswith("example")]
    if args.ab_src is not None:
        named = dict(steps)
        steps = [("floor", named["floor"]), ("kvtier-populate", named["kvtier-populate"])]
        for r in range(args.ab_rounds):
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):  # neither side always goes first
                name = f"kvtier-resume-{side}{r}"
                steps.append((name, {**named["kvtier-resume"], "extra": profiled(name, kv_extra)}))
    return steps


def ab_summary(args: argparse.Namespace, ttft: dict[str, float | None], tmp: Path) -> dict[str, Any]:
    """A/B mode: each round's resume TTFT of this tree (a) and ``--ab-src`` (b), their ratio, the
    median ratio, each side's median and its x of the floor, and each side's profile medians."""
    rounds = []
    for r in range(args.ab_rounds):
        a, b = ttft.get(f"kvtier-resume-a{r}"), ttft.get(f"kvtier-resume-b{r}")
        rounds.append({"a_s": a, "b_s": b, "a_over_b": a / b if a and b else None})
    ratios = [x["a_over_b"] for x in rounds if x["a_over_b"] is not None]
    out: dict[str, Any] = {"b_src": str(args.ab_src), "rounds": rounds,
                           "median_a_over_b": statistics.median(ratios) if ratios else None}
    floor = ttft.get("floor")
    for side in ("a", "b"):
        values = [x[f"{side}_s"] for x in rounds if x[f"{side}_s"] is not None]
        if values:
            out[f"median_{side}_s"] = statistics.median(values)
            if floor:
                out[f"median_{side}_x_floor"] = statistics.median(values) / floor
        if args.profile:
            rows = [profile_medians(tmp / f"kvtier-resume-{side}{r}.profile.jsonl", args.tokens)
                    for r in range(args.ab_rounds)]
            out[f"profile_{side}"] = {k: statistics.median(row[k] for row in rows if k in row)
                                      for k in rows[0]} if rows and rows[0] else {}
    return out


def profile_medians(path: Path, tokens: int) -> dict[str, float]:
    """Median of each profile span (ms; ``wait_steps`` as is) over the loaded sessions in ``path``
    (prompts of ``tokens`` tokens: the warm-up prompt is left out)."""
    from kvtier.bench.profiles import PROFILE_FIELDS

    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("load_tokens") and r.get("prompt_tokens") == tokens]
    out: dict[str, float] = {"loaded_requests": len(rows)}
    for key in PROFILE_FIELDS:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            scale = 1 if key == "wait_steps" else 1000
            out[key.removesuffix("_s") + ("" if key == "wait_steps" else "_ms")] = round(
                statistics.median(values) * scale, 2)
    return out


def _ratios(ttft: dict[str, float | None], read_s: float | None) -> dict[str, Any]:
    """Every ratio of the run, each only where both of its figures were measured."""
    out: dict[str, Any] = {}
    rec, kv, ex, never = ttft["plain"], ttft["kvtier-resume"], ttft.get("example-resume"), ttft["kvtier-never"]
    floor = ttft["floor"]
    if floor and kv and read_s is not None:
        out["floor_s"], out["raw_read_per_session_s"] = floor, read_s
        out["floor_bytes_s"] = floor + read_s
        out["kvtier_x_floor"] = kv / floor
        out["kvtier_x_floor_bytes"] = kv / (floor + read_s)
        if ex:
            out["example_x_floor_bytes"] = ex / (floor + read_s)
    if rec and kv:
        out["kvtier_speedup_vs_recompute"] = rec / kv
    populate = ttft["kvtier-populate"]
    if populate and kv:
        out["kvtier_speedup_vs_recompute_same_binding"] = populate / kv
        out["kvtier_populate_recompute_s"] = populate
    background = ttft.get("kvtier-resume-async")
    if kv and background:
        # The default (auto: in the step on an idle engine) vs every load in the background.
        out["kvtier_vs_async_resume_ttft_ratio"] = kv / background
    if kv and ex:
        out["kvtier_vs_example_ttft_ratio"] = kv / ex
    if rec and never:
        # vLLM's CPU backend binds threads differently once any connector is set: this ratio
        # mixes that with kvtier's own cost, which the next one isolates (saving on vs off).
        out["connector_set_vs_plain_all_new"] = never / rec - 1
    if never and populate:
        out["kvtier_saving_overhead_all_new"] = populate / never - 1
    return out


def _checks(args: argparse.Namespace, results: dict[str, Any], model: Path, pool: Path,
            warm: list[int]) -> dict[str, Any]:
    """Same outputs, tokens served from the cache, and the pool's file count against the expected."""
    out: dict[str, Any] = {}
    if "error" not in results["kvtier-resume"] and "error" not in results["kvtier-populate"]:
        out["outputs_equal_kvtier_vs_populate"] = [r["tokens"] for r in results["kvtier-resume"]["results"]] == [
            r["tokens"] for r in results["kvtier-populate"]["results"]]
        out["kvtier_cached_tokens"] = [r["cached"] for r in results["kvtier-resume"]["results"]
                                       if r.get("tag") != "warmup"]
        out["pool_chunk_files"] = len(list(pool.glob("??/??/*.kvt")))
        # One file per KV head of each full chunk (head shards), the warm-up prompt's included.
        heads = json.loads((model / "config.json").read_text())["num_key_value_heads"]
        chunks = args.sessions * (args.tokens // 256) + (len(warm) // 256 if args.warmup else 0)
        out["pool_chunk_files_expected"] = heads * chunks
    if "error" not in results.get("example-resume", {"error": ""}):
        out["example_cached_tokens"] = [r["cached"] for r in results["example-resume"]["results"]
                                        if r.get("tag") != "warmup"]
    return out


def main() -> int:
    args = _args()
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as scratch:
        return _bench(args, Path(scratch))


def _bench(args: argparse.Namespace, tmp: Path) -> int:
    """The run itself; `tmp` is scratch space that main removes afterwards."""
    from kvtier.bench.model import model_or_tiny

    model = model_or_tiny(args.model, tmp)
    rng = random.Random(1)
    sessions = [[rng.randrange(100, 31000) for _ in range(args.tokens)] for _ in range(args.sessions)]
    fresh = [[rng.randrange(100, 31000) for _ in range(args.tokens)] for _ in range(args.sessions)]
    warm = [rng.randrange(100, 31000) for _ in range(300)]
    pool = tmp / "pool"
    results: dict[str, Any] = {}
    read_s: float | None = None
    for name, spec in _steps(args, model, tmp, sessions, fresh, warm):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = run(spec, tmp, name, args.ab_src if name.startswith("kvtier-resume-b") else None)
        print(f"  {name}: TTFT median {median_ttft(results[name])}", file=sys.stderr, flush=True)
        if name == "kvtier-resume" and "error" not in results[name]:
            read_s = statistics.median(raw_read_s(session_files(pool, session)) for session in sessions)
    ttft = {name: median_ttft(r) for name, r in results.items()}
    ttft["floor"] = median_ttft(results["floor"], "hit")  # its first pass is a plain prefill
    if args.ab_src is not None:
        ab = {"ttft_median_s": ttft, "ab": ab_summary(args, ttft, tmp),
              "errors": {name: r["error"][-500:] for name, r in results.items() if "error" in r}}
        print(json.dumps(ab, indent=2))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"summary": ab, "runs": results}, indent=2))
        return 0
    summary: dict[str, Any] = {"tokens": args.tokens, "sessions": args.sessions, "io_threads": args.io_threads,
                               "warmup": args.warmup, "tensor_parallel_size": args.tensor_parallel_size,
                               "ttft_median_s": ttft, **_ratios(ttft, read_s),
                               **_checks(args, results, model, pool, warm)}
    if args.profile:
        summary["profile"] = {name: profile_medians(tmp / f"{name}.profile.jsonl", args.tokens)
                              for name in ("kvtier-resume", "kvtier-resume-async")}
    summary["errors"] = {name: r["error"][-500:] for name, r in results.items() if "error" in r}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
