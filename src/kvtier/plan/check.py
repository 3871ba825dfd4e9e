"""Calibrate on one concurrency level of a ``kvtier bench suite`` run, predict every other cell.

For each (configuration, workload, concurrency) of the run the check rebuilds the workload the
suite drove from its own ``requests.jsonl``: the same sessions in the same order with the same
prompt and output lengths, populate turns unmeasured, an engine restart before the resume turns
(cold-resume), ``concurrency`` closed-loop users. Cached prefixes are *predicted* (what the
populate turns stored: whole chunks, and tails where the run's connector kept them, see
``ran_tails``), not copied from the measured run; the measured cached
tokens are shown beside the prediction so a hit-rate miss is visible rather than hidden. The
workload is rebuilt by ``kvtier.plan.replay``, and each configuration's hardware by
``calibrate.config_hardware``, the same ones calibration replays above concurrency 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.plan.calibrate import CONFIG_TIERS, Calibration, calibrate, config_hardware, load_bench, ran_tails
from kvtier.plan.capacity import StoreShape, count_on_disk, footprint
from kvtier.plan.replay import FLOOR, measured, rebuild_workload, single
from kvtier.plan.sim import simulate

TOLERANCE = 0.25


@dataclass(frozen=True)
class Cell:
    workload: str
    config: str
    concurrency: int
    requests: int
    measured_p50_s: float
    predicted_p50_s: float
    measured_cached: int
    predicted_cached: int
    calibration: bool
    measured_p90_s: float = float("nan")
    predicted_p90_s: float = float("nan")

    @property
    def error(self) -> float:
        return self.predicted_p50_s / self.measured_p50_s - 1.0

    @property
    def p90_error(self) -> float:
        return self.predicted_p90_s / self.measured_p90_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "error": self.error, "p90_error": self.p90_error,
                "within_tolerance": abs(self.error) <= TOLERANCE}


def check(bench_dir: str | Path, *, concurrency: int | None = None, probe: dict[str, Any] | None = None
          ) -> tuple[Calibration, list[Cell]]:
    """Calibrate at ``concurrency`` (default: the run's lowest level) and predict TTFT p50 and
    p90 of every (config, workload, concurrency) of the run."""
    records, configs, env = load_bench(bench_dir)
    cal = calibrate(bench_dir, probe=probe, concurrency=concurrency)
    cells = []
    groups = sorted({(str(r.get("workload")), str(r.get("config")), int(r.get("concurrency") or 0))
                     for r in records if r.get("measured") and single(r)})
    for workload, config, c in groups:
        if config not in ("recompute", FLOOR) and config not in cal.tiers:
            continue
        rows = measured(records, config, c, workload)
        if not rows:
            continue
        ok = [float(r["ttft_s"]) for r in rows]
        cached = sum(int(r.get("cached_tokens") or 0) for r in rows)
        hw, plan = config_hardware(cal.engine, cal.tiers.get(config), config, configs, env)
        result = simulate(cal.model, hw, plan, rebuild_workload(records, config, workload, c))
        predicted_cached = int(result.hbm_tokens.sum() + sum(v.sum() for v in result.loaded_tokens.values()))
        cells.append(Cell(workload, config, c, len(ok), float(np.percentile(ok, 50)),
                          float(np.percentile(result.ttft_s, 50)), cached, predicted_cached,
                          c == cal.concurrency, float(np.percentile(ok, 90)), float(np.percentile(result.ttft_s, 90))))
    return cal, cells


def run_capacity(bench_dir: str | Path, cal: Calibration) -> dict[str, Any]:
    """Per kvtier configuration of the run: the storage its requests should have left
    (``capacity.footprint`` of every request it served, all levels and workloads) and, where
    the run's work folder is still there, what its pool or disk tier holds on disk."""
    records, configs, env = load_bench(bench_dir)
    settings = env.get("settings") or {}
    kvtier_settings = settings.get("kvtier_settings") or {}
    out: dict[str, Any] = {}
    for config in (c for c in CONFIG_TIERS if c in cal.tiers):
        sessions: dict[str, list[tuple[int, int]]] = {}
        rows = [r for r in records if r.get("config") == config and single(r) and r.get("error") is None
                and isinstance(r.get("prompt_tokens"), int)]
        for r in sorted(rows, key=lambda r: int(r.get("turn") or 0)):
            sessions.setdefault(f"{r.get('workload')}/{r.get('concurrency')}/{r.get('session')}", []).append(
                (int(r["prompt_tokens"]), max(1, int(r.get("output_tokens") or 1))))
        shape = StoreShape(int(settings.get("chunk_tokens") or 256), cal.engine.block_tokens,
                           ran_tails(config, configs, env), kvtier_settings.get("save_decode") is not False)
        entry: dict[str, Any] = {"predicted": footprint(sessions.values(), cal.model, shape)}
        work = Path(bench_dir) / "work" / config
        dirs = [work / "pool"] if config == "shared-pool" else sorted(work.glob("disk-*"))
        if dirs and all(d.is_dir() for d in dirs):
            counted = [count_on_disk(d) for d in dirs]
            entry["on_disk"] = {k: sum(c[k] for c in counted) for k in counted[0]}
        out[config] = entry
    return out


def summary(cells: Sequence[Cell]) -> dict[str, Any]:
    """The check's verdict over the held-out cells: how many within tolerance, median |error| of
    p50 and p90, and the same for the cold-resume cells alone (the issue's accuracy bar)."""
    held = [c for c in cells if not c.calibration]
    cold = [c for c in held if c.workload == "cold-resume"]

    def med(values: list[float]) -> float | None:
        return float(np.median(values)) if values else None

    return {"held_out": len(held), "within_tolerance": sum(abs(c.error) <= TOLERANCE for c in held),
            "median_abs_error": med([abs(c.error) for c in held]),
            "median_abs_p90_error": med([abs(c.p90_error) for c in held]),
            "cold_resume_held_out": len(cold), "cold_resume_within_tolerance": sum(abs(c.error) <= TOLERANCE
                                                                                  for c in cold),
            "cold_resume_median_abs_error": med([abs(c.error) for c in cold]), "tolerance": TOLERANCE}


def fit_markdown(cal: Calibration) -> str:
    """What calibration fitted, on what, with its one-sigma ranges."""
    e = cal.fit["engine"]
    lo, hi = e["prefill_tokens_per_s_range"]
    lines = [f"Calibrated at concurrency {cal.concurrency} ({e['method']}, {e['requests']} {e['source']} requests of "
             f"{e['prompt_tokens'][0]}-{e['prompt_tokens'][1]} tokens): prefill {e['prefill_tokens_per_s']:,.0f} "
             f"tokens/s ({lo:,.0f} to {f'{hi:,.0f}' if hi else 'unbounded'}), quadratic "
             f"{e['prefill_quadratic_s']:.2e} s/token², request overhead {e['request_overhead_s'] * 1e3:.1f} ms + "
             f"{e['frontend_per_token_s'] * 1e6:.2f} µs per prompt token in the front end, decode step "
             f"{e['decode_step_s'] * 1e3:.1f} ms"
             + (f"; front end and engine each at {share:.2f} of their speed while both work (shared cores)."
                if (share := e.get("shared_rate", 1.0)) < 1 else ".")]
    for config, t in cal.fit["tiers"].items():
        band = t.get("latency_s_range")
        lines.append(f"- {config}: read {t['read_bytes_per_s'] / 1e9:.2f} GB/s ({t['rate_source']}), latency "
                     f"{t['latency_s'] * 1e3:.1f} ms" + (f" ({band[0] * 1e3:.1f}-{band[1] * 1e3:.1f})" if band else "")
                     + f", {t['method']} over {t['requests']} resumes")
    return "\n".join(lines)


def capacity_markdown(capacity: dict[str, Any]) -> str:
    lines = ["| config | sessions | chunks + tails | files predicted (lower bound) / on disk | "
             "bytes predicted (lower bound) / on disk |", "|---|---|---|---|---|"]
    for config, entry in capacity.items():
        p, d = entry["predicted"], entry.get("on_disk") or {}
        lines.append(f"| {config} | {p['sessions']} | {p['chunks']} + {p['tails']} | {p['files']} ({p['files_low']}) / "
                     f"{d.get('files', '-')} | {p['bytes']} ({p['bytes_low']}) / {d.get('bytes', '-')} |")
    if any("on_disk" not in e for e in capacity.values()):
        lines.append("\nOn disk: '-' where the run's work folder is gone (`kvtier bench suite --keep-work` keeps it).")
    return "\n".join(lines)


def cells_markdown(cells: Sequence[Cell]) -> str:
    lines = ["| workload | config | concurrency | requests | measured TTFT p50 (s) | predicted (s) | error | "
             "p90 measured / predicted (s) | p90 error | cached tokens measured / predicted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        mark = " (calibration)" if c.calibration else ("" if abs(c.error) <= TOLERANCE else " **miss**")
        lines.append(f"| {c.workload} | {c.config} | {c.concurrency}{mark} | {c.requests} | {c.measured_p50_s:.3f} | "
                     f"{c.predicted_p50_s:.3f} | {c.error:+.0%} | {c.measured_p90_s:.3f} / {c.predicted_p90_s:.3f} | "
                     f"{c.p90_error:+.0%} | {c.measured_cached} / {c.predicted_cached} |")
    s = summary(cells)
    lines.append("")
    if s["held_out"]:
        lines.append(f"Held-out cells within ±{TOLERANCE:.0%}: {s['within_tolerance']} of {s['held_out']}; median "
                     f"|error| {s['median_abs_error']:.0%} (p90: {s['median_abs_p90_error']:.0%})")
    if s["cold_resume_held_out"]:
        lines.append(f"Cold-resume held-out cells within ±{TOLERANCE:.0%}: {s['cold_resume_within_tolerance']} of "
                     f"{s['cold_resume_held_out']}; median |error| {s['cold_resume_median_abs_error']:.0%}")
    if not s["held_out"]:
        lines.append("No held-out cell: the run has one concurrency level.")
    return "\n".join(lines)
