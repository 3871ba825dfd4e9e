"""A bench run's own workload, rebuilt for the simulator, and figures fitted by replaying it.

``rebuild_workload`` turns one (configuration, workload, concurrency) of a ``kvtier bench suite``
run back into the phases it drove: the same sessions in the same order with the same prompt and
output lengths, populate turns unmeasured, an engine restart before the resume turns
(cold-resume; not for the floor, which the suite never restarts), ``concurrency`` closed-loop
users.

``fit_scalar`` is how calibration fits a figure at a concurrency above 1, where a request's TTFT
holds its wait behind the others and no per-request formula separates the two: it replays the
level through the simulator and bisects one figure until the simulated TTFT p50 equals the
measured one. ``median_band`` gives the measured p50's own spread (a bootstrap), which the same
bisection turns into the fitted figure's uncertainty.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.plan.workload import Phase, Turn

Record = dict[str, Any]
FLOOR = "engine-cache"  # the suite's floor: never restarted, resumes hit vLLM's own prefix cache


def single(r: Record) -> bool:
    """A request of a one-instance run (the planner's levels; two-instance runs are not fitted)."""
    return int(r.get("instances", 1)) == 1


def _session_key(r: Record) -> tuple[int, str]:
    s = r.get("session")
    return (int(str(s)), "") if str(s).isdigit() else (0, str(s))


def rebuild_workload(records: Sequence[Record], config: str, workload: str, concurrency: int) -> tuple[Phase, ...]:
    rows = [r for r in records if r.get("config") == config and r.get("workload") == workload
            and r.get("concurrency") == concurrency and single(r)]
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
    phases.append(Phase(measured, concurrency, bool(populate) and config != FLOOR, "measured"))
    return tuple(phases)


def measured(records: Sequence[Record], config: str, concurrency: int, workload: str | None = None) -> list[Record]:
    """``config``'s measured, error-free requests with a TTFT at ``concurrency``, of ``workload``
    (None: every workload)."""
    return [r for r in records if r.get("config") == config and r.get("concurrency") == concurrency
            and (workload is None or r.get("workload") == workload) and r.get("measured")
            and r.get("error") is None and isinstance(r.get("ttft_s"), int | float) and single(r)]


def measured_ttfts(records: Sequence[Record], config: str, concurrency: int) -> list[float]:
    """TTFTs of ``measured`` requests, every workload."""
    return [float(r["ttft_s"]) for r in measured(records, config, concurrency)]


def resumed(records: Sequence[Record], config: str, concurrency: int) -> list[Record]:
    """The ``measured`` requests that started from cached tokens (a tier's load or the engine's hit)."""
    return [r for r in measured(records, config, concurrency) if int(r.get("cached_tokens") or 0) > 0]


def workloads_of(records: Sequence[Record], config: str, concurrency: int) -> list[str]:
    return sorted({str(r.get("workload")) for r in records if r.get("config") == config
                   and r.get("concurrency") == concurrency and r.get("measured") and single(r)})


def median_band(values: Sequence[float], *, draws: int = 400, seed: int = 0) -> tuple[float, float]:
    """The 16th and 84th percentiles of the median over bootstrap resamples of ``values``: the
    measured p50's one-sigma band (two runs of a suite here differ by about this much)."""
    data = np.asarray(values, dtype=float)
    if len(data) < 2:
        return float(data[0]), float(data[0])
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(data, size=(draws, len(data)), replace=True), axis=1)
    return float(np.percentile(medians, 16)), float(np.percentile(medians, 84))


def fit_scalar(predict: Callable[[float], float], target: float, lo: float, hi: float, *,
               increasing: bool, log_scale: bool = True, iterations: int = 28) -> tuple[float, bool]:
    """The ``x`` in ``[lo, hi]`` where ``predict(x)`` (monotonic: ``increasing`` or not) equals
    ``target``, by bisection; ``(x, inside)``, ``inside`` False when the target lies beyond an
    end of the range (``x`` is then that end)."""
    f_lo, f_hi = predict(lo), predict(hi)
    low_end, high_end = (f_lo, f_hi) if increasing else (f_hi, f_lo)
    if target <= low_end:
        return (lo if increasing else hi), math.isclose(target, low_end, rel_tol=1e-3)
    if target >= high_end:
        return (hi if increasing else lo), math.isclose(target, high_end, rel_tol=1e-3)
    a, b = lo, hi
    for _ in range(iterations):
        mid = math.sqrt(a * b) if log_scale else (a + b) / 2.0
        if (predict(mid) < target) == increasing:
            a = mid
        else:
            b = mid
    return (math.sqrt(a * b) if log_scale else (a + b) / 2.0), True
