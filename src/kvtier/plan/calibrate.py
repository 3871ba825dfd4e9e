"""Hardware figures from measurements on the user's own machine: a ``kvtier bench`` result folder
and, optionally, a ``kvtier probe --json`` output.

What is fitted on what, all from the requests at one concurrency level (by default the run's
lowest; any level works, with or without a concurrency-1 level):

* engine (``kvtier.plan.enginefit``): the prefill rate, its quadratic term and the request
  overhead from the requests that prefilled a whole prompt (recompute's, else the populate
  turns): per request at concurrency 1, by replaying the level through the simulator above it;
  ``ITL = decode_step_s + decode_context_s * prompt_tokens``, least squares over the same requests.
* each tier configuration: read bandwidth from the engine's own kvtier metrics (tier
  ``bytes_read / read_seconds``) when the run recorded them, else the storage probe's kvtier
  read figure; ``latency_s`` absorbs the connector's per-request cost (lookup, file opens,
  copies). At concurrency 1 it is the median over that configuration's resumed requests of
  ``TTFT - request_overhead - prefill(suffix after the cached prefix) - bytes / bandwidth``,
  clamped at 0; above it, the latency at which the replayed level's TTFT p50 equals the
  measured one (and where even no latency is too slow, the read rate that does).
* ``max_batched_tokens``, KV space and host budget come from the suite's recorded settings.

What the run cannot determine is named in ``Calibration.notes`` with the value used instead.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.config import parse_bytes
from kvtier.plan.enginefit import fit_engine, replay_p50
from kvtier.plan.replay import FLOOR, Record, fit_scalar, measured_ttfts, median_band, resumed, single
from kvtier.plan.spec import EngineSpec, HardwareSpec, ModelSpec, PlanConfig, TierSpec, with_engine
from kvtier.policy import LOAD_MODES
from kvtier.tiers.kinds import KINDS

log = logging.getLogger(__name__)

# Suite configuration -> tier name in the plan.
CONFIG_TIERS = {"local-disk": "disk", "shared-pool": "pool"}
# The chunk size each connector keys its cache by where it is not kvtier's 256 (ExampleConnector
# keys whole prompts and matches at the engine's block size).
CONNECTOR_CHUNK_TOKENS = {"example-connector": 128}
_UNBOUNDED_BYTES = 1 << 50


@dataclass
class Calibration:
    """Everything fitted, with the evidence: which requests, how many, the residuals."""

    model: ModelSpec
    engine: EngineSpec
    tiers: dict[str, TierSpec]  # by suite configuration name
    concurrency: int
    notes: list[str] = field(default_factory=list)
    fit: dict[str, Any] = field(default_factory=dict)

    def hardware(self, configs: Sequence[str] | None = None) -> HardwareSpec:
        """Engine plus the tiers of ``configs`` (default all), named by plan tier names."""
        chosen = [self.tiers[c] for c in (configs or list(self.tiers)) if c in self.tiers]
        return HardwareSpec(self.engine, tuple(chosen))

    def to_dict(self) -> dict[str, Any]:
        from kvtier.plan.spec import hardware_to_dict

        return {"model": self.model.__dict__, "bytes_per_token": self.model.bytes_per_token,
                "hardware": hardware_to_dict(self.hardware()), "tier_configs": {c: t.name for c, t in
                                                                               self.tiers.items()},
                "calibrated_on_concurrency": self.concurrency, "fit": self.fit, "notes": self.notes}


def load_bench(path: str | Path) -> tuple[list[Record], list[Record], dict[str, Any]]:
    """(requests, configs, env) of a bench result folder, through the bench report's own loader."""
    from kvtier.bench.report import load_run

    run = load_run(path)
    return run.records, run.configs, run.env


def model_from_env(env: dict[str, Any]) -> ModelSpec:
    shape = env.get("model_shape") or {}
    try:
        heads = int(shape["num_attention_heads"])
        return ModelSpec(int(shape["num_hidden_layers"]), int(shape.get("num_key_value_heads", heads)),
                         int(shape.get("head_dim") or int(shape["hidden_size"]) // heads),
                         str(shape.get("torch_dtype") or shape.get("dtype") or "bfloat16"), 1,
                         str(shape.get("model_type", "model")))
    except (KeyError, TypeError, ValueError):
        raise ValueError("env.json has no usable model_shape (num_hidden_layers, num_attention_heads, ...); "
                         "pass --model config.json") from None


def _metrics_read_rate(entry: Record, tier: str) -> float | None:
    """bytes_read / read_seconds of ``tier`` summed over the engine's workers' metric files."""
    nbytes, seconds = 0, 0.0
    for doc in (entry.get("kvtier_metrics") or {}).values():
        figures = ((doc or {}).get("tiers") or {}).get(tier) or {}
        nbytes += int(figures.get("bytes_read") or 0)
        seconds += float(figures.get("read_seconds") or 0.0)
    return nbytes / seconds if nbytes > 0 and seconds > 0 else None


def probe_read_rate(probe: dict[str, Any] | None) -> float | None:
    if not probe:
        return None
    for key in ("kvtier_read_gbps", "best_raw_gbps", "parallel_gbps"):
        value = probe.get(key)
        if isinstance(value, int | float) and value > 0:
            return float(value) * 1e9
    return None


def ran_tails(config: str, configs: Sequence[Record], env: dict[str, Any]) -> bool:
    """Whether ``config`` ran kvtier's connector with tails (``tail_chunks``): a kvtier
    configuration whose connector counted tail saves at all (runs from before tails existed have
    no such counter) and whose ``--kvtier-setting``s did not turn them off."""
    if config not in CONFIG_TIERS:
        return False
    if _kvtier_settings(env).get("tail_chunks") is False:
        return False
    return any("tail_saves" in ((doc or {}).get("connector") or {})
               for entry in configs if entry.get("config") == config
               for doc in (entry.get("kvtier_metrics") or {}).values())


def load_mode(config: str, env: dict[str, Any]) -> str:
    """How ``config`` loaded: kvtier's connector by its ``load_mode`` (default ``auto``), every
    other connector in the step."""
    if config not in CONFIG_TIERS:
        return "sync"
    mode = _kvtier_settings(env).get("load_mode", "auto")
    return mode if mode in LOAD_MODES else "auto"


def _kvtier_settings(env: dict[str, Any]) -> dict[str, Any]:
    """The ``--kvtier-setting``s the run gave kvtier's configurations."""
    return (env.get("settings") or {}).get("kvtier_settings") or {}


def config_hardware(engine: EngineSpec, tier: TierSpec | None, config: str, configs: Sequence[Record],
                    env: dict[str, Any]) -> tuple[HardwareSpec, PlanConfig]:
    """What the simulator runs for one configuration of the run: its engine with the chunk size
    its connector keys by, the tails it kept and how it loaded, and its tier (none for recompute)."""
    hw = HardwareSpec(engine, (tier,) if tier is not None else ())
    if config in CONNECTOR_CHUNK_TOKENS:
        hw = with_engine(hw, chunk_tokens=CONNECTOR_CHUNK_TOKENS[config])
    hw = with_engine(hw, tail_chunks=ran_tails(config, configs, env), load_mode=load_mode(config, env))
    return hw, PlanConfig(config, tuple(t.name for t in hw.tiers))


def _replay_tier(spec: TierSpec, config: str, records: Sequence[Record], configs: Sequence[Record],
                 env: dict[str, Any], model: ModelSpec, engine: EngineSpec, concurrency: int
                 ) -> tuple[TierSpec, str | None]:
    """The latency (else, where no latency is fast enough, the read rate) at which the replayed
    level's TTFT p50 equals the measured one; and a note when the rate had to move."""
    target = float(np.median(measured_ttfts(records, config, concurrency)))

    def p50(latency: float, rate: float = spec.read_bytes_per_s) -> float:
        hw, plan = config_hardware(engine, replace(spec, latency_s=latency, read_bytes_per_s=rate), config,
                                   configs, env)
        return replay_p50(records, model, hw, plan, concurrency)

    latency, inside = fit_scalar(p50, target, 1e-5, 30.0, increasing=True)
    if inside or latency > 1e-5:
        return replace(spec, latency_s=latency), None
    rate, _ = fit_scalar(lambda x: p50(0.0, x), target, spec.read_bytes_per_s,
                         spec.read_bytes_per_s * 100, increasing=False)
    return replace(spec, latency_s=0.0, read_bytes_per_s=rate), \
        f"{config}: faster at concurrency {concurrency} than its measured read rate allows; read rate fitted " \
        f"({rate / 1e9:.2f} GB/s)"


def _residual_tier(spec: TierSpec, rows: Sequence[Record], model: ModelSpec, engine: EngineSpec
                   ) -> tuple[TierSpec, dict[str, Any]]:
    """At concurrency 1: the latency is the median of what each resume leaves after the front
    end, the suffix's prefill and its bytes at the tier's rate. Where that is negative (the
    tier read faster than its measured rate says: the metrics sum the read threads' seconds),
    the latency is 0 and the rate the one that leaves the median resume nothing; where even an
    unbounded rate leaves the median resume less than the engine's figures, the measured rate."""
    residuals, reads = [], []
    for r in rows:
        cached, prompt = int(r["cached_tokens"]), int(r["prompt_tokens"])
        compute = engine.request_overhead_s + engine.frontend_per_token_s * prompt \
            + engine.prefill_s(prompt - cached, cached)
        residuals.append(float(r["ttft_s"]) - compute - cached * model.bytes_per_token / spec.read_bytes_per_s)
        reads.append((cached * model.bytes_per_token, float(r["ttft_s"]) - compute))
    fit: dict[str, Any] = {"method": "residual per request", "residuals_s": [round(x, 4) for x in residuals]}
    if not residuals:
        return spec, fit
    latency = float(np.median(residuals))
    band = median_band(residuals)
    fit["latency_s_range"] = [round(max(0.0, b), 4) for b in band]
    if latency >= 0:
        return replace(spec, latency_s=latency), fit
    # A resume that took less than the engine's figures alone (front end, suffix prefill) would
    # need an unbounded rate: it counts so in the median, not left out (which biases it low).
    rate = float(np.median([nbytes / left if left > 0 else math.inf for nbytes, left in reads]))
    if not math.isfinite(rate) or rate <= spec.read_bytes_per_s:
        fit["note"] = ("its resumes are faster than the engine's fitted figures alone allow: latency 0 at the "
                       f"measured {spec.read_bytes_per_s / 1e9:.2f} GB/s, and its cells predicted high")
        return replace(spec, latency_s=0.0), fit
    fit["note"] = f"read faster than its measured {spec.read_bytes_per_s / 1e9:.2f} GB/s: read rate fitted " \
                  f"({rate / 1e9:.2f} GB/s), latency 0"
    return replace(spec, latency_s=0.0, read_bytes_per_s=rate), fit


def fit_tier(config: str, entry: Record, records: Sequence[Record], model: ModelSpec, engine: EngineSpec,
             probe: dict[str, Any] | None, concurrency: int = 1, configs: Sequence[Record] = (),
             env: dict[str, Any] | None = None) -> tuple[TierSpec, dict[str, Any]]:
    tier_name = CONFIG_TIERS.get(config, config)
    source = "kvtier metrics"
    rate = _metrics_read_rate(entry, tier_name)
    if rate is None:
        rate, source = probe_read_rate(probe), "storage probe"
    if rate is None:
        rate, source = 1e9, "assumed 1 GB/s (no metrics, no probe)"
    rows = resumed(records, config, concurrency)
    probe_write = (probe or {}).get("write_gbps")
    write = float(probe_write) * 1e9 if isinstance(probe_write, int | float) and probe_write > 0 else rate
    known = KINDS.get(tier_name)  # another connector's configuration: a persistent local tier
    spec = TierSpec(tier_name, _UNBOUNDED_BYTES, rate, write, 0.0, persistent=known.persistent if known else True,
                    shared=known.shared if known else False, write_queue_s=1e9)
    fit: dict[str, Any] = {"rate_source": source, "requests": len(rows)}
    if concurrency == 1 or not rows:
        spec, per_request = _residual_tier(spec, rows, model, engine)
        fit.update(per_request)
    else:
        spec, note = _replay_tier(spec, config, records, configs, env or {}, model, engine, concurrency)
        fit.update(method="replay through the simulator", note=note)
    return spec, {**fit, "read_bytes_per_s": spec.read_bytes_per_s, "latency_s": spec.latency_s}


def run_levels(records: Sequence[Record]) -> list[int]:
    """The one-instance concurrency levels a run measured, lowest first."""
    return sorted({int(r["concurrency"]) for r in records if r.get("measured") and single(r)
                   and isinstance(r.get("concurrency"), int)})


def calibrate(bench_dir: str | Path, *, probe: dict[str, Any] | None = None, concurrency: int | None = None,
              model: ModelSpec | None = None) -> Calibration:
    """Fit the engine and one tier per other configuration at ``concurrency`` (default: the
    run's lowest level)."""
    records, configs, env = load_bench(bench_dir)
    levels = run_levels(records)
    if concurrency is None:
        if not levels:
            raise ValueError(f"{bench_dir}: no measured request to calibrate on")
        concurrency = levels[0]
    elif concurrency not in levels:
        raise ValueError(f"{bench_dir}: no measured request at concurrency {concurrency}; the run has "
                         f"{', '.join(map(str, levels)) or 'none'}")
    model = model or model_from_env(env)
    probe = probe or env.get("storage_probe")
    efit = fit_engine(records, env, model, concurrency)
    cal = Calibration(model, efit.engine, {}, concurrency, notes=list(efit.notes),
                      fit={"engine": efit.fit, "tiers": {}})
    for entry in configs:
        name = str(entry.get("config"))
        if name in ("recompute", FLOOR) or entry.get("status") != "ok":
            if entry.get("status") != "ok":
                cal.notes.append(f"{name}: status {entry.get('status')} in the run; not calibrated")
            continue
        tier, tier_fit = fit_tier(name, entry, records, model, efit.engine, probe, concurrency, configs, env)
        if tier_fit["requests"] == 0:
            cal.notes.append(f"{name}: no resumed request with cached tokens at concurrency {concurrency}; "
                             "latency set to 0")
        note = tier_fit.get("note")
        if note:
            cal.notes.append(note if note.startswith(f"{name}:") else f"{name}: {note}")
        cal.tiers[name] = tier
        cal.fit["tiers"][name] = tier_fit
    host_bytes = (env.get("settings") or {}).get("host_bytes")
    if host_bytes is not None:
        cal.fit["host_bytes"] = parse_bytes(host_bytes if not str(host_bytes).isdigit() else int(host_bytes),
                                            "host_bytes")
    return cal


def load_probe(path: str | Path) -> dict[str, Any]:
    """A ``kvtier probe --json`` output (or any JSON object holding its figures)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a kvtier probe JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
