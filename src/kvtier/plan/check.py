"""Calibrate on one concurrency level of a ``kvtier bench suite`` run, predict every other cell.

For each (configuration, workload, concurrency) of the run the check rebuilds the workload the
suite drove from its own ``requests.jsonl``: the same sessions in the same order with the same
prompt and output lengths, populate turns unmeasured, an engine restart before the resume turns
(cold-resume), ``concurrency`` closed-loop users. Cached prefixes are *predicted* (what the
populate turns stored: whole chunks, and tails where the run's connector kept them, see
``ran_tails``), not copied from the measured run; the measured cached
tokens are shown beside the prediction so a hit-rate miss is visible rather than hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.plan.calibrate import CONFIG_TIERS, Calibration, Record, calibrate, load_bench
from kvtier.plan.sim import simulate
from kvtier.plan.spec import HardwareSpec, PlanConfig, with_engine
from kvtier.plan.workload import Phase, Turn

# The chunk size each connector keys its cache by (kvtier and LMCache: 256; ExampleConnector keys
# whole prompts and matches at the engine's block size).
CONNECTOR_CHUNK_TOKENS = {"example-connector": 128}
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

    @property
    def error(self) -> float:
        return self.predicted_p50_s / self.measured_p50_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "error": self.error, "within_tolerance": abs(self.error) <= TOLERANCE}


def _session_key(r: Record) -> tuple[int, str]:
    s = r.get("session")
    return (int(str(s)), "") if str(s).isdigit() else (0, str(s))


def rebuild_workload(records: Sequence[Record], config: str, workload: str, concurrency: int) -> tuple[Phase, ...]:
    rows = [r for r in records if r.get("config") == config and r.get("workload") == workload
            and r.get("concurrency") == concurrency and int(r.get("instances", 1)) == 1]
    by_session: dict[str, list[Record]] = {}
    for r in sorted(rows, key=lambda r: (_session_key(r), int(r.get("turn") or 0))):
        by_session.setdefault(str(r.get("session")), []).append(r)

    def turn(r: Record, measured: bool) -> Turn:
        return Turn(str(r.get("session")), int(r["prompt_tokens"]), max(1, int(r.get("output_tokens") or 1)),
                    None, 0.0, measured)

    populate = tuple((turn(r, False),) for rs in by_session.values() for r in rs if r.get("phase") == "populate")
    measured = tuple(tuple(turn(r, True) for r in rs if r.get("measured")) for rs in by_session.values())
    measured = tuple(s for s in measured if s)
    phases = []
    if populate:
        phases.append(Phase(populate, concurrency, False, "populate"))
    phases.append(Phase(measured, concurrency, bool(populate), "measured"))
    return tuple(phases)


def ran_tails(config: str, configs: Sequence[Record], env: dict[str, Any]) -> bool:
    """Whether ``config`` ran kvtier's connector with tails (``tail_chunks``): a kvtier
    configuration whose connector counted tail saves at all (runs from before tails existed have
    no such counter) and whose ``--kvtier-setting``s did not turn them off."""
    if config not in CONFIG_TIERS:
        return False
    settings = (env.get("settings") or {}).get("kvtier_settings") or {}
    if settings.get("tail_chunks") is False:
        return False
    return any("tail_saves" in ((doc or {}).get("connector") or {})
               for entry in configs if entry.get("config") == config
               for doc in (entry.get("kvtier_metrics") or {}).values())


def check(bench_dir: str | Path, *, concurrency: int = 1, probe: dict[str, Any] | None = None
          ) -> tuple[Calibration, list[Cell]]:
    """Calibrate at ``concurrency`` and predict TTFT p50 of every (config, workload, concurrency)."""
    records, configs, env = load_bench(bench_dir)
    cal = calibrate(bench_dir, probe=probe, concurrency=concurrency)
    cells = []
    groups = sorted({(str(r.get("workload")), str(r.get("config")), int(r.get("concurrency") or 0))
                     for r in records if r.get("measured") and int(r.get("instances", 1)) == 1})
    for workload, config, c in groups:
        if config != "recompute" and config not in cal.tiers:
            continue
        ok = [r for r in records if r.get("config") == config and r.get("workload") == workload
              and r.get("concurrency") == c and r.get("measured") and r.get("error") is None
              and isinstance(r.get("ttft_s"), int | float) and int(r.get("instances", 1)) == 1]
        if not ok:
            continue
        hw = cal.hardware([config]) if config != "recompute" else HardwareSpec(cal.engine)
        if config in CONNECTOR_CHUNK_TOKENS:
            hw = with_engine(hw, chunk_tokens=CONNECTOR_CHUNK_TOKENS[config])
        hw = with_engine(hw, tail_chunks=ran_tails(config, configs, env))
        plan = PlanConfig(config, tuple(t.name for t in hw.tiers))
        result = simulate(cal.model, hw, plan, rebuild_workload(records, config, workload, c))
        predicted_cached = int(result.hbm_tokens.sum() + sum(v.sum() for v in result.loaded_tokens.values()))
        cells.append(Cell(workload, config, c, len(ok), float(np.percentile([r["ttft_s"] for r in ok], 50)),
                          float(np.percentile(result.ttft_s, 50)), sum(int(r.get("cached_tokens") or 0) for r in ok),
                          predicted_cached, c == concurrency))
    return cal, cells


def cells_markdown(cells: Sequence[Cell]) -> str:
    lines = ["| workload | config | concurrency | requests | measured TTFT p50 (s) | predicted (s) | error | "
             "cached tokens measured / predicted |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        mark = " (calibration)" if c.calibration else ("" if abs(c.error) <= TOLERANCE else " **miss**")
        lines.append(f"| {c.workload} | {c.config} | {c.concurrency}{mark} | {c.requests} | {c.measured_p50_s:.3f} | "
                     f"{c.predicted_p50_s:.3f} | {c.error:+.0%} | {c.measured_cached} / {c.predicted_cached} |")
    held_out = [c for c in cells if not c.calibration]
    inside = sum(abs(c.error) <= TOLERANCE for c in held_out)
    lines.append("")
    lines.append(f"Held-out cells within ±{TOLERANCE:.0%}: {inside} of {len(held_out)}"
                 + (f"; median |error| {np.median([abs(c.error) for c in held_out]):.0%}" if held_out else ""))
    return "\n".join(lines)
