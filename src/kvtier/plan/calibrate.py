"""Hardware figures from measurements on the user's own machine: a ``kvtier bench`` result folder
and, optionally, a ``kvtier probe --json`` output.

What is fitted on what (all from requests at one concurrency level, ``concurrency=1`` by default):

* engine: ``TTFT = request_overhead_s + n / prefill_tokens_per_s + prefill_quadratic_s * n^2 / 2``,
  least squares over the ``recompute`` configuration's requests with no cached tokens (every
  workload, populate turns included: at concurrency 1 each is one cold prefill);
  ``ITL = decode_step_s + decode_context_s * prompt_tokens``, least squares over the same requests.
* each tier configuration: read bandwidth from the engine's own kvtier metrics (tier
  ``bytes_read / read_seconds``) when the run recorded them, else the storage probe's kvtier
  read figure; ``latency_s`` = median over that configuration's resumed requests of
  ``TTFT - request_overhead - prefill(suffix after the cached prefix) - bytes / bandwidth``,
  clamped at 0. It absorbs the connector's per-request cost (lookup, file opens, copies).
* ``max_batched_tokens``, KV space and host budget come from the suite's recorded settings.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.config import parse_bytes
from kvtier.plan.spec import EngineSpec, HardwareSpec, ModelSpec, TierSpec
from kvtier.tiers.kinds import KINDS

log = logging.getLogger(__name__)

Record = dict[str, Any]
# Suite configuration -> (tier name in the plan, chunk tokens of that connector's keys).
CONFIG_TIERS = {"local-disk": "disk", "shared-pool": "pool"}
CPU_BLOCK_TOKENS = 128  # vLLM's CPU backend block size
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
                         str(shape.get("torch_dtype", "bfloat16")), 1, str(shape.get("model_type", "model")))
    except (KeyError, TypeError, ValueError):
        raise ValueError("env.json has no usable model_shape (num_hidden_layers, num_attention_heads, ...); "
                         "pass --model config.json") from None


def _ok(r: Record) -> bool:
    return bool(r.get("measured", True) or r.get("phase") == "populate") and r.get("error") is None \
        and isinstance(r.get("ttft_s"), int | float)


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


def fit_engine(records: Sequence[Record], env: dict[str, Any],
               concurrency: int = 1) -> tuple[EngineSpec, dict[str, Any]]:
    rows = [r for r in records if r.get("config") == "recompute" and r.get("concurrency") == concurrency
            and _ok(r) and not r.get("cached_tokens") and int(r.get("instances", 1)) == 1]
    if len(rows) < 3:
        raise ValueError(f"calibration needs >= 3 recompute requests at concurrency {concurrency} without cached "
                         f"tokens; found {len(rows)}")
    n = np.array([float(r["prompt_tokens"]) for r in rows])
    t = np.array([float(r["ttft_s"]) for r in rows])
    design = np.stack([np.ones_like(n), n, n * n / 2.0], axis=1)
    coef = np.linalg.lstsq(design, t, rcond=None)[0]
    if coef[2] < 0 or coef[0] < 0:  # attention term or overhead fitted negative: drop it, refit
        keep = [0, 1] if coef[0] >= 0 else [1, 2]
        sub = np.linalg.lstsq(design[:, keep], t, rcond=None)[0]
        coef = np.zeros(3)
        coef[keep] = sub
    overhead, per_token, quadratic = (max(0.0, float(c)) for c in coef)
    if per_token <= 0:
        raise ValueError("calibration: fitted prefill cost per token is not positive; the recompute requests "
                         "do not grow with prompt length")
    timed = [r for r in rows if isinstance(r.get("itl_s"), int | float)]
    decode, decode_context = 0.0, 0.0
    if len(timed) >= 2:
        ctx = np.array([float(r["prompt_tokens"]) for r in timed])
        itl = np.array([float(r["itl_s"]) for r in timed])
        d0, d1 = np.linalg.lstsq(np.stack([np.ones_like(ctx), ctx], axis=1), itl, rcond=None)[0]
        decode, decode_context = (float(d0), float(d1)) if d1 > 0 and d0 > 0 else (float(np.median(itl)), 0.0)
    settings = env.get("settings") or {}
    kv_gib = settings.get("kv_cache_gib")
    engine = EngineSpec(prefill_tokens_per_s=1.0 / per_token, decode_step_s=decode, prefill_quadratic_s=quadratic,
                        request_overhead_s=overhead, decode_context_s=decode_context,
                        max_batched_tokens=max_batched_tokens(settings),
                        hbm_kv_bytes=int(float(kv_gib) * (1 << 30)) if kv_gib else None,
                        block_tokens=CPU_BLOCK_TOKENS)
    pred = design @ np.array([overhead, per_token, quadratic])
    fit = {"requests": len(rows), "prompt_tokens": [int(n.min()), int(n.max())],
           "request_overhead_s": overhead, "prefill_tokens_per_s": 1.0 / per_token, "prefill_quadratic_s": quadratic,
           "decode_step_s": decode, "decode_context_s": decode_context,
           "max_abs_error_s": float(np.max(np.abs(pred - t))),
           "max_rel_error": float(np.max(np.abs(pred - t) / t))}
    return engine, fit


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


def fit_tier(config: str, entry: Record, records: Sequence[Record], model: ModelSpec, engine: EngineSpec,
             probe: dict[str, Any] | None, concurrency: int = 1) -> tuple[TierSpec, dict[str, Any]]:
    tier_name = CONFIG_TIERS.get(config, config)
    source = "kvtier metrics"
    rate = _metrics_read_rate(entry, tier_name)
    if rate is None:
        rate, source = probe_read_rate(probe), "storage probe"
    if rate is None:
        rate, source = 1e9, "assumed 1 GB/s (no metrics, no probe)"
    rows = [r for r in records if r.get("config") == config and r.get("concurrency") == concurrency and _ok(r)
            and r.get("measured") and int(r.get("cached_tokens") or 0) > 0 and int(r.get("instances", 1)) == 1]
    residuals = []
    for r in rows:
        cached, prompt = int(r["cached_tokens"]), int(r["prompt_tokens"])
        compute = engine.request_overhead_s + engine.prefill_s(prompt - cached, cached)
        residuals.append(float(r["ttft_s"]) - compute - cached * model.bytes_per_token / rate)
    latency = max(0.0, float(np.median(residuals))) if residuals else 0.0
    probe_write = (probe or {}).get("write_gbps")
    write = float(probe_write) * 1e9 if isinstance(probe_write, int | float) and probe_write > 0 else rate
    known = KINDS.get(tier_name)  # another connector's configuration: a persistent local tier
    spec = TierSpec(tier_name, _UNBOUNDED_BYTES, rate, write, latency, persistent=known.persistent if known else True,
                    shared=known.shared if known else False, write_queue_s=1e9)
    return spec, {"read_bytes_per_s": rate, "rate_source": source, "latency_s": latency,
                  "requests": len(residuals), "residuals_s": [round(x, 4) for x in residuals]}


def calibrate(bench_dir: str | Path, *, probe: dict[str, Any] | None = None, concurrency: int = 1,
              model: ModelSpec | None = None) -> Calibration:
    """Fit the engine on ``recompute`` and one tier per other configuration, at ``concurrency``."""
    records, configs, env = load_bench(bench_dir)
    model = model or model_from_env(env)
    probe = probe or env.get("storage_probe")
    engine, engine_fit = fit_engine(records, env, concurrency)
    cal = Calibration(model, engine, {}, concurrency, fit={"engine": engine_fit, "tiers": {}})
    for entry in configs:
        name = str(entry.get("config"))
        if name == "recompute" or entry.get("status") != "ok":
            if entry.get("status") != "ok":
                cal.notes.append(f"{name}: status {entry.get('status')} in the run; not calibrated")
            continue
        tier, tier_fit = fit_tier(name, entry, records, model, engine, probe, concurrency)
        if tier_fit["requests"] == 0:
            cal.notes.append(f"{name}: no resumed request with cached tokens at concurrency {concurrency}; "
                             "latency set to 0")
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
