"""The engine's figures fitted from a bench run, at whatever concurrency the run has.

At concurrency 1 a cold request's TTFT is its own prefill, so a least-squares fit of
``TTFT = request_overhead_s + n / prefill_tokens_per_s + prefill_quadratic_s * n^2 / 2`` over
the cold requests (``n`` prompt tokens) gives the figures and their standard errors. Which terms
are fitted depends on what the prompts can tell apart: all three when the prompt lengths span at
least 3x over 6 or more requests, overhead and rate over 1.5x, otherwise the rate alone with the
overhead taken from the floor (or a stated default). A term fitted negative is dropped, not kept.

Above concurrency 1 a TTFT also holds the wait behind the other requests' prefills, which no
per-request formula separates; the level is replayed through the simulator instead and the rate
bisected until the simulated TTFT p50 of the recompute requests equals the measured one
(``replay.fit_scalar``). The quadratic term cannot be told from the queueing there and is 0.

The front end and the engine share the machine's cores on vLLM's CPU build when the engine's
threads take every core (``shared_rate``): a fact of the run's environment, not a fit.

Whatever the data cannot determine is named in the notes with the value used instead: the fit
never stops for want of a term. Its uncertainty is the rate's one-sigma range: from the standard
error at concurrency 1, from the bootstrap band of the measured p50 above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.plan.replay import (
    FLOOR,
    Record,
    fit_scalar,
    measured_ttfts,
    median_band,
    rebuild_workload,
    resumed,
    single,
    workloads_of,
)
from kvtier.plan.sim import simulate
from kvtier.plan.spec import EngineSpec, HardwareSpec, ModelSpec, PlanConfig

CPU_BLOCK_TOKENS = 128  # vLLM's CPU backend block size
DEFAULT_OVERHEAD_S = 0.02  # HTTP, tokenizer and scheduling of one request when the run cannot tell


def shared_rate(env: dict[str, Any]) -> tuple[float, str | None]:
    """``EngineSpec.shared_rate`` of the run's engine, and a note when it is assumed.

    On vLLM's CPU build (torch ``+cpu``) the engine runs one thread per core it computes on: all
    ``cores`` less ``reserved_cpus`` (``VLLM_CPU_NUM_OF_RESERVED_CPU``; the bench suite's
    default, 0, for runs that did not record it). With the front end's thread beside them, more
    threads than cores want to run: the scheduler gives each ``cores / (threads + 1)`` of a core,
    and the engine's team, which waits at every barrier for its slowest thread, goes no faster.
    Elsewhere (a GPU engine) 1."""
    if "+cpu" not in str(env.get("torch") or ""):
        return 1.0, None
    try:
        cores = int(env["cores"])
    except (KeyError, TypeError, ValueError):
        return 1.0, "shared_rate: the run recorded no core count: 1 (the front end not slowing the engine)"
    note = None
    reserved = env.get("reserved_cpus")
    if not isinstance(reserved, int) or isinstance(reserved, bool) or reserved < 0:
        reserved, note = 0, "reserved_cpus: not recorded by the run: 0, the bench suite's default"
    threads = cores - reserved if 0 < reserved < cores else cores  # vLLM reserves nothing when it would take all
    rate = min(1.0, cores / (threads + 1))
    return rate, note


@dataclass
class EngineFit:
    engine: EngineSpec
    fit: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def _ok(r: Record) -> bool:
    return bool(r.get("measured", True) or r.get("phase") == "populate") and r.get("error") is None \
        and isinstance(r.get("ttft_s"), int | float)


def cold_rows(records: Sequence[Record], concurrency: int) -> tuple[list[Record], str]:
    """Requests at ``concurrency`` that prefilled their whole prompt: recompute's, else every
    configuration's populate turns (each a first prefill), and which of the two."""
    cold = [r for r in records if r.get("concurrency") == concurrency and _ok(r) and single(r)
            and not r.get("cached_tokens")]
    rows = [r for r in cold if r.get("config") == "recompute"]
    if rows:
        return rows, "recompute"
    return [r for r in cold if r.get("phase") == "populate"], "populate turns"


def max_batched_tokens(settings: dict[str, Any]) -> int:
    """The suite's ``--max-num-batched-tokens`` (= ``--max-model-len``), recomputed from its settings."""
    cold = settings.get("cold") or {}
    lo_hi = cold.get("context_tokens") or [0, 16384]
    out = int(lo_hi[1]) + (int(cold.get("turns", 2)) + 1) * (int(cold.get("question_tokens", 32))
                                                             + int(cold.get("output_tokens", 32)) + 64) + 512
    for w in settings.get("extra") or []:
        hi = int((w.get("context_tokens") or [0, 0])[1])
        out = max(out, hi + int(w.get("turns", 1)) * (int(w.get("question_tokens", 32))
                                                      + int(w.get("output_tokens", 32)) + 64) + 512)
    return out


def floor_overhead(records: Sequence[Record], concurrency: int, seconds_per_token: float) -> float | None:
    """The request overhead the floor shows: the median over its resumes (whole prompt but the
    question in the engine's own cache) of TTFT less the question's prefill; None without a floor."""
    rows = resumed(records, FLOOR, concurrency)
    if not rows:
        return None
    left = [float(r["ttft_s"]) - (int(r["prompt_tokens"]) - int(r["cached_tokens"])) * seconds_per_token
            for r in rows]
    return max(0.0, float(np.median(left)))


def _lstsq(design: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients and their standard errors (zeros when the fit has no spare degree of freedom)."""
    coef, *_ = np.linalg.lstsq(design, t, rcond=None)
    dof = len(t) - design.shape[1]
    if dof <= 0:
        return coef, np.zeros_like(coef)
    sigma2 = float(np.sum((design @ coef - t) ** 2)) / dof
    cov = sigma2 * np.linalg.pinv(design.T @ design)
    return coef, np.sqrt(np.maximum(np.diag(cov), 0.0))


def fit_one_level(rows: Sequence[Record], records: Sequence[Record]) -> tuple[tuple[float, float, float],
                                                                            float, list[str]]:
    """``(overhead, seconds per token, quadratic)``, the per-token term's standard error and the
    notes, fitted on concurrency-1 cold requests with as many terms as their lengths determine."""
    n = np.array([float(r["prompt_tokens"]) for r in rows])
    t = np.array([float(r["ttft_s"]) for r in rows])
    notes: list[str] = []
    span = float(n.max() / n.min())
    columns = [np.ones_like(n), n, n * n / 2.0]
    if len(rows) >= 6 and span >= 3.0:
        coef, err = _lstsq(np.stack(columns, axis=1), t)
        if coef[2] >= 0 and coef[0] >= 0 and coef[1] > 0:
            return (float(coef[0]), float(coef[1]), float(coef[2])), float(err[1]), notes
        notes.append("prefill_quadratic_s fitted negative (prompt lengths too alike to separate it): set to 0")
    elif len(rows) >= 3 and span >= 1.5:
        notes.append(f"prefill_quadratic_s: prompt lengths span {span:.1f}x over {len(rows)} requests (3x over 6 "
                     "needed to separate it): set to 0")
    if len(rows) >= 3 and span >= 1.5:
        coef, err = _lstsq(np.stack(columns[:2], axis=1), t)
        if coef[0] >= 0 and coef[1] > 0:
            return (float(coef[0]), float(coef[1]), 0.0), float(err[1]), notes
    guess = float(np.median(t / n))
    overhead = floor_overhead(records, 1, guess)
    if overhead is None:
        overhead = DEFAULT_OVERHEAD_S
        notes.append(f"request_overhead_s: not determined (prompt lengths span {span:.2f}x, no floor run): "
                     f"default {DEFAULT_OVERHEAD_S} s")
    else:
        notes.append(f"request_overhead_s: taken from the floor's resumes ({overhead:.3f} s); prompt lengths span "
                     f"only {span:.2f}x")
    coef, err = _lstsq(n[:, None], t - overhead)
    if coef[0] <= 0:
        return (0.0, guess, 0.0), 0.0, [*notes, "request_overhead_s: the floor's is longer than these prefills: 0"]
    return (overhead, float(coef[0]), 0.0), float(err[0]), notes


def split_frontend(records: Sequence[Record], overhead: float, per_token: float, quadratic: float
                   ) -> tuple[float, float, list[str]]:
    """``(front end per token, prefill per token, notes)``: the part of the cold requests'
    per-token cost that the front end pays (tokenizing the prompt), which a hit pays too. The
    floor's concurrency-1 resumes tell it: what is left of their TTFT after the fitted overhead
    and the question's prefill, per prompt token (median). Without a floor the front end's
    share stays in the prefill rate."""
    rows = resumed(records, FLOOR, 1)
    if not rows:
        return 0.0, per_token, ["frontend_per_token_s: no floor run at concurrency 1: 0 (the front end's share "
                                "stays in the prefill rate)"]
    n = np.array([float(r["prompt_tokens"]) for r in rows])
    suffix = n - np.array([float(r["cached_tokens"]) for r in rows])
    left = np.array([float(r["ttft_s"]) for r in rows]) - overhead - suffix * per_token \
        - quadratic * suffix * (n - suffix / 2.0)
    f = float(np.median(left / n))
    if f <= 0:
        return 0.0, per_token, []
    if f >= 0.5 * per_token:
        return 0.0, per_token, [f"frontend_per_token_s: the floor's resumes give {f:.2e} s/token, half the prefill's "
                                "cost or more: not used (0)"]
    return f, per_token - f, []


def _fit_decode(rows: Sequence[Record]) -> tuple[float, float]:
    """``(decode_step_s, decode_context_s)`` from the inter-token latencies of ``rows``."""
    timed = [r for r in rows if isinstance(r.get("itl_s"), int | float)]
    if len(timed) < 2:
        return 0.0, 0.0
    ctx = np.array([float(r["prompt_tokens"]) for r in timed])
    itl = np.array([float(r["itl_s"]) for r in timed])
    d0, d1 = np.linalg.lstsq(np.stack([np.ones_like(ctx), ctx], axis=1), itl, rcond=None)[0]
    return (float(d0), float(d1)) if d1 > 0 and d0 > 0 else (float(np.median(itl)), 0.0)


def replay_p50(records: Sequence[Record], model: ModelSpec, hw: HardwareSpec, config: PlanConfig,
               concurrency: int) -> float:
    """The simulated TTFT p50 of ``config``'s measured requests at ``concurrency``, every workload
    of the run replayed."""
    ttfts = [simulate(model, hw, config, rebuild_workload(records, config.name, w, concurrency)).ttft_s
             for w in workloads_of(records, config.name, concurrency)]
    return float(np.median(np.concatenate(ttfts))) if ttfts else float("nan")


def _fit_by_replay(records: Sequence[Record], rows: Sequence[Record], base: EngineSpec, model: ModelSpec,
                   concurrency: int) -> tuple[EngineSpec, tuple[float, float | None], list[str]]:
    """Rate and overhead at a concurrent level: the overhead by replaying the floor (every
    resume a hit in the engine's own cache: its TTFT is the front end's queue and one short
    step), the rate by replaying recompute with that overhead; twice, each with the other's
    latest value."""
    guess = float(np.median([float(r["prompt_tokens"]) / float(r["ttft_s"]) for r in rows]))
    notes = ["prefill_quadratic_s: not separable from queueing above concurrency 1: set to 0"]
    floor = measured_ttfts(records, FLOOR, concurrency)
    measured = measured_ttfts(records, "recompute", concurrency)

    def engine(rate: float, overhead: float) -> EngineSpec:
        return EngineSpec(**{**base.__dict__, "prefill_tokens_per_s": rate, "request_overhead_s": overhead})

    def p50(config: str, rate: float, overhead: float) -> float:
        return replay_p50(records, model, HardwareSpec(engine(rate, overhead)), PlanConfig(config), concurrency)

    def fit_overhead(rate: float) -> float:
        return fit_scalar(lambda o: p50(FLOOR, rate, o), float(np.median(floor)), 1e-4, 5.0, increasing=True)[0]

    def fit_rate(overhead: float, target: float) -> tuple[float, bool]:
        return fit_scalar(lambda x: p50("recompute", x, overhead), target, guess / 4.0, guess * 64.0,
                          increasing=False)

    overhead, rate, inside = DEFAULT_OVERHEAD_S, guess, True
    for _ in range(2):
        if floor:
            overhead = fit_overhead(rate)
        rate, inside = fit_rate(overhead, float(np.median(measured)))
    if not floor:
        notes.append(f"request_overhead_s: no floor run at concurrency {concurrency}: default {DEFAULT_OVERHEAD_S} s")
    if not inside:
        notes.append(f"prefill_tokens_per_s: the replay cannot reach the measured p50 at concurrency {concurrency}; "
                     f"{rate:.0f} tokens/s is the end of the range searched")
    lo, hi = median_band(measured)
    band = (fit_rate(overhead, hi)[0], fit_rate(overhead, lo)[0])
    return engine(rate, overhead), band, notes


def fit_engine(records: Sequence[Record], env: dict[str, Any], model: ModelSpec, concurrency: int = 1) -> EngineFit:
    """The engine's figures from the cold requests at ``concurrency`` (the module docstring)."""
    rows, source = cold_rows(records, concurrency)
    if not rows:
        raise ValueError(f"no request at concurrency {concurrency} prefilled its whole prompt (no recompute "
                         "configuration, no populate turn): nothing to fit the engine on")
    notes = [] if source == "recompute" else [f"engine fitted on the {source}: the run has no recompute requests "
                                              f"at concurrency {concurrency}"]
    settings = env.get("settings") or {}
    kv_gib = settings.get("kv_cache_gib")
    decode, decode_context = _fit_decode(rows)
    share, share_note = shared_rate(env)
    notes += [share_note] if share_note else []
    base = EngineSpec(prefill_tokens_per_s=1.0, decode_step_s=decode, decode_context_s=decode_context,
                      max_batched_tokens=max_batched_tokens(settings), block_tokens=CPU_BLOCK_TOKENS,
                      hbm_kv_bytes=int(float(kv_gib) * (1 << 30)) if kv_gib else None, shared_rate=share)
    if concurrency == 1 or source != "recompute":
        if concurrency != 1:
            notes.append(f"concurrency {concurrency}: fitted per request, as at concurrency 1 (queueing not separated)")
        (overhead, per_token, quadratic), se, more = fit_one_level(rows, records)
        frontend, per_token, split_notes = split_frontend(records, overhead, per_token, quadratic)
        more += split_notes
        engine = EngineSpec(**{**base.__dict__, "prefill_tokens_per_s": 1.0 / per_token, "frontend_per_token_s":
                               frontend, "request_overhead_s": overhead, "prefill_quadratic_s": quadratic})
        band = (1.0 / (per_token + se), None if se >= per_token else 1.0 / (per_token - se))
        method = "least squares per request"
    else:
        engine, band, more = _fit_by_replay(records, rows, base, model, concurrency)
        method = "replay through the simulator"
    n = [int(r["prompt_tokens"]) for r in rows]
    fit = {"requests": len(rows), "source": source, "method": method, "prompt_tokens": [min(n), max(n)],
           "request_overhead_s": engine.request_overhead_s, "frontend_per_token_s": engine.frontend_per_token_s,
           "prefill_tokens_per_s": engine.prefill_tokens_per_s,
           "prefill_tokens_per_s_range": [round(b, 1) if b is not None else None for b in band],
           "prefill_quadratic_s": engine.prefill_quadratic_s, "decode_step_s": decode,
           "decode_context_s": decode_context, "shared_rate": share, "undetermined": more}
    if concurrency == 1 or source != "recompute":
        t = np.array([float(r["ttft_s"]) for r in rows])
        pred = np.array([engine.request_overhead_s + engine.frontend_per_token_s * k + engine.prefill_s(k, 0)
                         for k in n])
        fit.update(max_abs_error_s=float(np.max(np.abs(pred - t))), max_rel_error=float(np.max(np.abs(pred - t) / t)))
    return EngineFit(engine, fit, notes + more)
