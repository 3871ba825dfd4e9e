"""Planner checks run on purpose (not unit tests): speed, the bench calibrate-and-check, the seed example.

    python benchmarks/planner_check.py speed [TRACE]    # 10,000-session trace, wall time (TRACE: keep it)
    python benchmarks/planner_check.py check BENCH_DIR  # = kvtier plan --check BENCH_DIR
    python benchmarks/planner_check.py seed             # the seed's worked example vs its table
    python benchmarks/planner_check.py short-chat       # the case where tiering does not pay
    python benchmarks/planner_check.py agree RUN_A RUN_B   # how far two runs of one suite agree
"""

from __future__ import annotations

import csv
import random
import sys
import tempfile
import time
from pathlib import Path

from kvtier.plan import presets
from kvtier.plan.report import render_table, run_plan
from kvtier.plan.sim import simulate
from kvtier.plan.spec import default_configs, hardware_from_dict, with_engine
from kvtier.plan.workload import chat, cold_resume, load_trace, trace_workload


def speed(num_sessions: int = 10_000, keep: str | None = None) -> None:
    """A 10k-session, 2-turn open-loop trace (20k requests) through every seed configuration;
    ``keep``: also write the trace there (for timing ``kvtier plan --trace`` on it)."""
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(keep) if keep else Path(tmp) / "trace.csv"
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["session", "arrival_s", "prompt_tokens", "output_tokens"])
            t = 0.0
            for i in range(num_sessions):
                t += rng.expovariate(1 / 30.0)  # ~75% prefill load on the seed engine when recomputing
                prompt = rng.randint(4096, 32768)
                w.writerow([f"s{i}", f"{t:.3f}", prompt, 64])
                w.writerow([f"s{i}", f"{t + 300 + rng.random() * 600:.3f}", prompt + 200, 64])
        t0 = time.perf_counter()
        sessions = load_trace(path)
        workload = trace_workload(sessions)
        loaded = time.perf_counter() - t0
    hw = hardware_from_dict(presets.SEED_HARDWARE)
    hw = with_engine(hw, hbm_kv_bytes=100 * 10**9)  # small enough that sessions do get evicted
    for config in default_configs(hw):
        t1 = time.perf_counter()
        s = simulate(presets.SEED_MODEL, hw, config, workload).summary()
        print(f"{config.name:12s} {2 * num_sessions} requests: {time.perf_counter() - t1:5.2f} s simulated "
              f"(trace load {loaded:.2f} s); TTFT p50 {s['ttft_p50_s']:.2f} s, hit {s['hit_rate']}")


def _seed_rows(hw_dict: dict, context: tuple[int, int], concurrency: list[int]) -> list[dict]:
    hw = hardware_from_dict(hw_dict)
    configs = [c for c in default_configs(hw) if c.name in ("recompute", "local-disk", "shared-pool")]
    return run_plan(presets.SEED_MODEL, hw, configs, concurrency,
                    lambda c: cold_resume(c, context, c, turns=2, question_tokens=64, output_tokens=64, seed=0))


def _p50(rows: list[dict], config: str, c: int) -> float:
    return next(r["ttft_p50_s"] for r in rows if r["config"] == config and r["concurrency"] == c)


def seed() -> None:
    """The preset's predictions beside the seed's published table."""
    lo, hi = presets.SEED_WORKLOAD["context"]
    print(f"preset: context {lo}-{hi} tokens, prefill {presets.SEED_HARDWARE['engine']['prefill_tokens_per_s']:.0f}"
          " tok/s")
    rows = _seed_rows(presets.SEED_HARDWARE, (lo, hi), [8, 16, 32])
    print("| concurrency | pool TTFT p50 (s) seed / plan | NVMe TTFT p50 seed / plan | recompute TTFT p50 seed / plan |"
          " pool tok/s seed / plan | NVMe tok/s seed / plan | recompute tok/s seed / plan | plan bottleneck (pool) |")
    print("|---|---|---|---|---|---|---|---|")
    for c in (8, 16, 32):
        ttft = dict(zip(("shared-pool", "local-disk", "recompute"), presets.SEED_TABLE[c], strict=True))
        tok = dict(zip(("shared-pool", "local-disk", "recompute"), presets.SEED_TOK_S[c], strict=True))
        mine = {r["config"]: r for r in rows if r["concurrency"] == c}
        cells = [f"{'-' if ttft[n] is None else ttft[n]} / {mine[n]['ttft_p50_s']:.3g}" for n in ttft]
        cells += [f"{'-' if tok[n] is None else tok[n]} / {mine[n]['output_tok_s']:.3g}" for n in tok]
        print(f"| {c} | " + " | ".join(cells) + f" | {mine['shared-pool']['bottleneck']} |")


def fit_seed() -> None:
    """Bisect the context mean on pool p50 @16 = 11.85 s, then the prefill rate on recompute p50 @16 = 149.5 s."""
    hw = {**presets.SEED_HARDWARE, "engine": dict(presets.SEED_HARDWARE["engine"])}
    lo, hi = presets.SEED_WORKLOAD["context"]
    half = (hi - lo) // 2
    mean = (lo + hi) / 2
    for _ in range(2):
        a, b = 1024.0 + half, 200_000.0
        for _ in range(30):
            mean = (a + b) / 2
            ctx = (int(mean - half), int(mean + half))
            p = _p50(_seed_rows(hw, ctx, [16]), "shared-pool", 16)
            a, b = (mean, b) if p < 11.85 else (a, mean)
        ctx = (int(mean - half), int(mean + half))
        a, b = 200.0, 50_000.0
        for _ in range(30):
            rate = (a + b) / 2
            hw["engine"]["prefill_tokens_per_s"] = rate
            p = _p50(_seed_rows(hw, ctx, [16]), "recompute", 16)
            a, b = (a, rate) if p < 149.48 else (rate, b)
    print(f"context {ctx}, prefill_tokens_per_s {hw['engine']['prefill_tokens_per_s']:.0f}")


def short_chat() -> None:
    """Short multi-turn chats that stay in HBM: the tiers never hit, nothing to gain."""
    hw = hardware_from_dict(presets.SEED_HARDWARE)
    rows = run_plan(presets.SEED_MODEL, hw, default_configs(hw), [8, 16, 32],
                    lambda c: chat(4 * c, (256, 2048), c, turns=4, question_tokens=64, output_tokens=128,
                                   think_s=5.0))
    print(render_table(rows, "short chat: 4 turns of 256-2048 tokens, 5 s think time"))


def agree(a: str, b: str) -> None:
    """Measured TTFT p50 of every cell two runs share, their ratio, and the median |difference|:
    the noise a prediction from one run is judged against."""
    import numpy as np

    from kvtier.plan.calibrate import load_bench

    def cells(folder: str) -> dict[tuple[str, str, int], float]:
        records = load_bench(folder)[0]
        keys = {(r["workload"], r["config"], r["concurrency"]) for r in records if r.get("measured")}
        return {k: float(np.median([r["ttft_s"] for r in records if (r["workload"], r["config"], r["concurrency"]) == k
                                    and r.get("measured") and r.get("error") is None])) for k in keys}

    first, second = cells(a), cells(b)
    print("| workload | config | concurrency | TTFT p50 run A (s) | run B (s) | B / A |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for key in sorted(set(first) & set(second)):
        ratios.append(second[key] / first[key])
        print(f"| {key[0]} | {key[1]} | {key[2]} | {first[key]:.3f} | {second[key]:.3f} | {ratios[-1]:.2f} |")
    diffs = [abs(r - 1.0) for r in ratios]
    print(f"\n{len(ratios)} cells; median |B/A - 1| {np.median(diffs):.0%}, largest {max(diffs):.0%}")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "speed"
    if what == "speed":
        speed(keep=sys.argv[2] if len(sys.argv) > 2 else None)
    elif what == "check":
        from kvtier.plan.check import cells_markdown, check

        print(cells_markdown(check(sys.argv[2])[1]))
    elif what == "seed":
        seed()
    elif what == "fit-seed":
        fit_seed()
    elif what == "short-chat":
        short_chat()
    elif what == "agree":
        agree(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
