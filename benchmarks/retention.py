"""Benchmark: session retention for agents, a small shared pool, side by side without and with.

An agent-like trace against vLLM's OpenAI server (CPU build) started by ``kvtier serve``:
``--long-sessions`` long "agent" sessions of ``--long-tokens`` tokens take ``--turns`` turns
each; every turn after the first resumes the session (its previous prompt + the previous
turn's output + ``--turn-new-tokens`` new tokens). Between two rounds of long turns (the
agents' slow tool calls) ``--shorts-per-gap`` short sessions of ``--short-tokens`` tokens run,
each a never-seen prompt; at the gap's end ``--short-resumes`` of them (those sent just before
the gap's middle) take a second turn the same way: what retention costs sessions that did
not ask for it. Requests go one at a time, streamed (TTFT = time to the first token), as
token ids (random ids in [100, 30000), exact lengths; no tokenizer involved).

The pool's budget (``pool_bytes``) is ``--pool-headroom`` times the chunk files the long
sessions need (computed from the trace and printed); each gap's short sessions write about as
much as the whole budget. vLLM's own prefix cache is limited to the longest prompt + 16 blocks
(``--num-gpu-blocks-override``) and kvtier's host DRAM tier is off (``host_bytes: 0``), so a
resume is served from the pool or recomputed; per request, the deltas of vLLM's
``vllm:prefix_cache_hits`` and kvtier's ``kvtier_loaded_tokens_total`` around it say which.

The same trace (same seed) runs in fresh servers on fresh pool directories, ``--repeats``
rounds of:

* ``no-retention``: plain requests (the pool evicts least recently used chunks first);
* ``retention``: the long sessions' requests carry
  ``"kv_transfer_params": {"kvtier": {"retain_s": N}}``; short sessions do not.

Reported per mode (every round pooled): for the long sessions' resumes, the hit rate
(``cached_tokens / prompt_tokens`` summed, and the fraction of resumes with any hit) and TTFT
p50; the same for short sessions and their resumes; the pool's evictions and hits per run
(``kvtier_evictions_total{tier="pool"}``, ``kvtier_hit_tokens_total{tier="pool"}``).

    python benchmarks/retention.py --out docs/results/retention.json

Servers are started with ``--served-model-name retention`` (after a failure:
``pkill -9 -f "served-model-name retention"``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.retention_figures import KVTIER_LOADED, PREFIX_HITS, summarize
from kvtier.bench.summary import median
from kvtier.bench.tokens import TokenServer, metric_delta
from kvtier.tiers.poolroot import scratch_pool

CHUNK = 256
CPU_BLOCK = 128  # vLLM's CPU backend block size (tokens)
NAME = "retention"


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


def make_trace(args: argparse.Namespace) -> dict[str, Any]:
    """Everything random in the trace, from the seed: first prompts, each turn's new tokens, shorts."""
    rng = random.Random(args.seed)
    longs = [{"first": rand_tokens(rng, args.long_tokens),
              "new": [rand_tokens(rng, args.turn_new_tokens) for _ in range(args.turns - 1)]}
             for _ in range(args.long_sessions)]
    gaps = [[rand_tokens(rng, rng.randint(args.short_tokens[0], args.short_tokens[1]))
             for _ in range(args.shorts_per_gap)] for _ in range(args.turns - 1)]
    short_new = [[rand_tokens(rng, args.turn_new_tokens) for _ in short_resumed(args)] for _ in range(args.turns - 1)]
    warmup = [rand_tokens(rng, args.short_tokens[0]) for _ in range(args.warmup)]
    return {"longs": longs, "gaps": gaps, "short_new": short_new, "warmup": warmup}


def final_long_tokens(args: argparse.Namespace) -> int:
    """Tokens of a long session after its last turn (prompt + output)."""
    return args.long_tokens + (args.turns - 1) * (args.long_max_tokens + args.turn_new_tokens) + args.long_max_tokens


def chunk_file_bytes() -> int:
    import torch

    from kvtier.bench.model import HEAD_DIM, KV_HEADS, LAYERS
    from kvtier.format import file_bytes_for
    from kvtier.layout import KVLayout

    return file_bytes_for(CHUNK * KVLayout(LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16).bytes_per_token)


class Server(TokenServer):
    """The benchmark's ``kvtier serve`` engine: the pool in ``pool``, no host DRAM by default, and
    vLLM's own cache held to ``--gpu-blocks`` blocks."""

    def __init__(self, root: Path, model: Path, name: str, pool: Path, args: argparse.Namespace,
                 pool_bytes: int, max_len: int) -> None:
        settings = {"pool_url": scratch_pool(pool), "pool_bytes": pool_bytes, "host_bytes": args.host_bytes,
                    "chunk_tokens": CHUNK, "io_threads": args.io_threads}
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "PYTHONHASHSEED": "0"}
        super().__init__(name, NAME, model, max_len, settings, root, env,
                         ["--num-gpu-blocks-override", str(args.gpu_blocks)])

    def complete(self, prompt: list[int], max_tokens: int, retain_s: float | None) -> dict[str, Any]:
        """One streamed request: TTFT, output token ids, prompt and cached tokens."""
        body: dict[str, Any] = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True, "stream": True, "return_token_ids": True,
                                "stream_options": {"include_usage": True}}
        if retain_s is not None:
            body["kv_transfer_params"] = {"kvtier": {"retain_s": retain_s}}
        return self.request(body)

    def metrics(self) -> dict[str, float]:
        """kvtier's and vLLM's prefix-cache counters."""
        return self.counters(("kvtier_", "vllm:prefix_cache", "vllm:external_prefix_cache"))


def timed(server: Server, prompt: list[int], max_tokens: int, retain_s: float | None,
          settle_s: float) -> dict[str, Any]:
    """One request, with what vLLM's prefix cache and kvtier each served it (/metrics deltas)."""
    time.sleep(settle_s)  # the previous request's stats reach /metrics with engine steps
    before = server.metrics()
    rec = server.complete(prompt, max_tokens, retain_s)
    time.sleep(settle_s)
    after = server.metrics()
    rec.update(prefix_cache_hit_tokens=metric_delta(after, before, PREFIX_HITS),
               kvtier_loaded_tokens=metric_delta(after, before, KVTIER_LOADED), prompt_sha=_sha(prompt))
    return rec


def short_resumed(args: argparse.Namespace) -> list[int]:
    """Which shorts of a gap take a second turn at the gap's end: ``--short-resumes`` of them,
    the ones sent just before the gap's middle (about half a gap of other sessions back)."""
    mid = args.shorts_per_gap // 2
    return list(range(max(0, mid - args.short_resumes), mid))


def run_trace(server: Server, trace: dict[str, Any], args: argparse.Namespace, retain: bool) -> dict[str, Any]:
    retain_s = args.retain_s if retain else None
    for prompt in trace["warmup"]:  # first requests of a fresh engine are slow; not in the trace
        server.complete(prompt, args.short_max_tokens, None)
    records: list[dict[str, Any]] = []
    prompts = [list(s["first"]) for s in trace["longs"]]
    for turn in range(args.turns):
        for i, sess in enumerate(trace["longs"]):
            if turn > 0:
                prompts[i] = prompts[i] + records_last(records, i)["output"] + sess["new"][turn - 1]
            rec = timed(server, prompts[i], args.long_max_tokens, retain_s, args.settle_s)
            rec.update(kind="long", session=i, turn=turn)
            records.append(rec)
            print(f"  long s{i} turn {turn}: {rec['prompt_tokens']} tokens, cached {rec['cached_tokens']} "
                  f"(kvtier {rec['kvtier_loaded_tokens']:.0f}, "
                  f"vLLM prefix cache {rec['prefix_cache_hit_tokens']:.0f}), "
                  f"TTFT {rec['ttft_s'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
        if turn == args.turns - 1:
            break
        gap = []
        for j, prompt in enumerate(trace["gaps"][turn]):
            rec = server.complete(prompt, args.short_max_tokens, None)
            rec.update(kind="short", gap=turn, index=j, prompt=prompt)
            gap.append(rec)
        for j, new in zip(short_resumed(args), trace["short_new"][turn], strict=True):
            prompt = gap[j].pop("prompt") + gap[j]["output"] + new
            rec = timed(server, prompt, args.short_max_tokens, None, args.settle_s)
            rec.update(kind="short-resume", gap=turn, index=j)
            gap.append(rec)
        for rec in gap:
            rec.pop("prompt", None)
        records.extend(gap)
        firsts = [r for r in gap if r["kind"] == "short"]
        again = [r for r in gap if r["kind"] == "short-resume"]
        print(f"  gap {turn}: {len(firsts)} short sessions, TTFT p50 "
              f"{median([r['ttft_s'] for r in firsts]) * 1e3:.0f} ms; {len(again)} of them resumed: cached "
              f"{[r['cached_tokens'] for r in again]}", file=sys.stderr, flush=True)
    # A few more engine steps so that the last requests' worker stats (evictions) reach /metrics.
    for k in range(2):
        time.sleep(1.0)
        server.complete(rand_tokens(random.Random(10_000 + k), 16), 2, None)
    return {"records": records, "metrics": server.metrics()}


def records_last(records: list[dict[str, Any]], session: int) -> dict[str, Any]:
    return [r for r in records if r["kind"] == "long" and r["session"] == session][-1]


def _sha(tokens: list[int]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def pool_state(pool: Path) -> dict[str, int]:
    now = time.time()
    stats = [f.stat() for f in pool.glob("??/??/*.kvt")]
    return {"pool_files_at_end": len(stats), "pool_bytes_at_end": sum(st.st_size for st in stats),
            "pool_files_retained_at_end": sum(st.st_mtime > now for st in stats)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: kvtier's tiny model, in a temp dir)")
    ap.add_argument("--long-sessions", type=int, default=3, help="long agent sessions (default 3)")
    ap.add_argument("--long-tokens", type=int, default=6000, help="first prompt of a long session (default 6000)")
    ap.add_argument("--turns", type=int, default=4, help="turns per long session, the first included (default 4)")
    ap.add_argument("--turn-new-tokens", type=int, default=200,
                    help="new tokens each later turn (long or short) appends (default 200)")
    ap.add_argument("--long-max-tokens", type=int, default=32, help="output tokens of a long turn (default 32)")
    ap.add_argument("--shorts-per-gap", type=int, default=20,
                    help="short sessions between two rounds of long turns (default 20)")
    ap.add_argument("--short-tokens", type=int, nargs=2, default=[1000, 1500], metavar=("MIN", "MAX"),
                    help="short session prompt length range (default 1000 1500)")
    ap.add_argument("--short-max-tokens", type=int, default=8, help="output tokens of a short session (default 8)")
    ap.add_argument("--short-resumes", type=int, default=5,
                    help="short sessions per gap that take a second turn at the gap's end, those sent just "
                         "before the gap's middle: what retention costs the unretained (default 5)")
    ap.add_argument("--retain-s", type=float, default=1800.0, help="retain_s the long sessions ask for (default 1800)")
    ap.add_argument("--pool-headroom", type=float, default=1.25,
                    help="pool budget = this x the long sessions' chunk files (default 1.25)")
    ap.add_argument("--pool-bytes", type=int, default=None, help="pool budget in bytes (overrides --pool-headroom)")
    ap.add_argument("--host-bytes", default="0", help="kvtier host DRAM tier (default 0: off)")
    ap.add_argument("--gpu-blocks", type=int, default=None,
                    help="vLLM --num-gpu-blocks-override (default: the longest prompt's blocks + 16)")
    ap.add_argument("--io-threads", type=int, default=2, help="kvtier io_threads (default 2)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up requests per server, not in the trace (default 3)")
    ap.add_argument("--settle-s", type=float, default=0.3,
                    help="pause around each long request and short resume before reading /metrics (default 0.3)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of both runs, interleaved; figures pool every round (default 3)")
    ap.add_argument("--seed", type=int, default=1, help="the trace's seed, the same for every run (default 1)")
    ap.add_argument("--modes", default="no-retention,retention", help="runs per round, in order (default both)")
    ap.add_argument("--workdir", type=Path, default=None, help="pools and server logs (default: a temp dir)")
    ap.add_argument("--log-dir", type=Path, default=None, help="copy the servers' logs here")
    ap.add_argument("--out", type=Path, default=None, help="JSON: summary, parameters, every request")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        if mode not in ("no-retention", "retention"):
            ap.error(f"--modes: unknown mode {mode!r}")
    return args


def sizing(args: argparse.Namespace, trace: dict[str, Any]) -> tuple[dict[str, Any], int, int]:
    """(the parameters recorded, the pool's budget, max_model_len), from the trace; sets
    ``args.gpu_blocks`` when not given and prints the budget."""
    final = final_long_tokens(args)
    max_len = -(-(final + 64) // CPU_BLOCK) * CPU_BLOCK
    if args.gpu_blocks is None:
        args.gpu_blocks = max_len // CPU_BLOCK + 16
    file_bytes = chunk_file_bytes()
    long_chunks = args.long_sessions * (final // CHUNK)
    long_need = long_chunks * file_bytes
    pool_bytes = args.pool_bytes or int(long_need * args.pool_headroom)
    short_chunks_per_gap = [sum(len(p) // CHUNK for p in gap) for gap in trace["gaps"]]
    params = {k: v for k, v in vars(args).items() if k not in ("out", "workdir", "log_dir", "model")}
    params.update(final_long_tokens=final, max_model_len=max_len, chunk_file_bytes=file_bytes,
                  long_chunk_files=long_chunks, long_need_bytes=long_need, pool_bytes=pool_bytes,
                  pool_evicts_down_to_bytes=int(pool_bytes * 0.9), short_resumed_indices=short_resumed(args),
                  short_chunk_files_per_gap=short_chunks_per_gap,
                  short_bytes_per_gap=[n * file_bytes for n in short_chunks_per_gap])
    print(f"pool budget: {pool_bytes / 2**20:.1f} MiB = {args.pool_headroom} x the long sessions' "
          f"{long_chunks} chunk files ({long_need / 2**20:.1f} MiB, {file_bytes} B each); each gap's short "
          f"sessions write {min(short_chunks_per_gap) * file_bytes / 2**20:.1f}+ MiB; vLLM KV cache "
          f"{args.gpu_blocks} blocks of {CPU_BLOCK} tokens; max_model_len {max_len}", file=sys.stderr, flush=True)
    return params, pool_bytes, max_len


def run_one(args: argparse.Namespace, trace: dict[str, Any], server: Server, pool: Path, retain: bool,
            name: str) -> dict[str, Any]:
    """One run of the trace on a fresh server and pool; a failure is recorded as ``{"error"}``."""
    print(f"running {name} ...", file=sys.stderr, flush=True)
    try:
        start_s = server.start()
        t0 = time.perf_counter()
        result = run_trace(server, trace, args, retain)
        result.update(trace_s=time.perf_counter() - t0, start_s=start_s, pool=pool_state(pool))
    except Exception as exc:  # recorded, and the other runs still go
        result = {"error": repr(exc)[-2000:]}
        print(f"  {name} failed: {result['error']}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(server.log, args.log_dir / f"{name}.log")
    return result


def main() -> int:
    args = parse_args()
    modes = args.modes.split(",")
    tmp = args.workdir or Path(tempfile.mkdtemp(prefix="kvtier-retention-"))
    tmp.mkdir(parents=True, exist_ok=True)
    from kvtier.bench.model import model_or_tiny

    model = model_or_tiny(args.model, tmp)
    trace = make_trace(args)
    params, pool_bytes, max_len = sizing(args, trace)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            name = f"{mode}-{repeat}"
            pool = tmp / f"pool-{name}"
            shutil.rmtree(pool, ignore_errors=True)
            server = Server(tmp, model, name, pool, args, pool_bytes, max_len)
            runs[mode].append(run_one(args, trace, server, pool, mode == "retention", name))
            shutil.rmtree(pool, ignore_errors=True)

    summary: dict[str, Any] = {"params": params}
    errors = {f"{mode}-{i}": r["error"] for mode in modes for i, r in enumerate(runs[mode]) if "error" in r}
    for mode in modes:
        done = [r for r in runs[mode] if "error" not in r]
        if done:
            summary[mode] = summarize(done)
    ok = [mode for mode in modes if mode in summary]
    # Outputs feed later turns: the same trace means the same long prompts in every run.
    every = [[r["prompt_sha"] for r in res["records"] if r["kind"] == "long"]
             for mode in ok for res in runs[mode] if "error" not in res]
    summary["same_long_prompts_in_every_run"] = all(s == every[0] for s in every)
    summary["errors"] = errors
    print_table(summary, ok)
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))
    return 1 if errors else 0


def print_table(summary: dict[str, Any], modes: list[str]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f} ms"

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:.0f}%"

    rows = [
        ("long resumes: hit rate (cached / prompt tokens)", lambda s: pct(s["long_resume_hit_rate"])),
        ("long resumes: with any hit", lambda s: f"{pct(s['long_resume_any_hit_fraction'])} of {s['long_resumes']}"),
        ("long resumes: TTFT p50", lambda s: ms(s["long_resume_ttft_p50_s"])),
        ("long first turns: TTFT p50", lambda s: ms(s["long_first_turn_ttft_p50_s"])),
        ("short sessions: hit rate", lambda s: pct(s["short_hit_rate"])),
        ("short sessions: TTFT p50", lambda s: ms(s["short_ttft_p50_s"])),
        ("short resumes: hit rate", lambda s: pct(s["short_resume_hit_rate"])),
        ("short resumes: with any hit",
         lambda s: f"{pct(s['short_resume_any_hit_fraction'])} of {s['short_resumes']}"),
        ("short resumes: TTFT p50", lambda s: ms(s["short_resume_ttft_p50_s"])),
        ("pool evictions per run (chunks), p50", lambda s: f"{s['pool_evictions_p50']:.0f}"),
        ("pool hit tokens per run", lambda s: ", ".join(f"{v:.0f}" for v in s["pool_hit_tokens_per_run"])),
    ]
    print("\n| | " + " | ".join(modes) + " |", file=sys.stderr)
    print("|---|" + "---:|" * len(modes), file=sys.stderr)
    for label, fmt in rows:
        print(f"| {label} | " + " | ".join(fmt(summary[m]) for m in modes) + " |", file=sys.stderr)
    print(file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
