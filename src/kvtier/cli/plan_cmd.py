"""``kvtier plan``: predict hit rate, TTFT and throughput per tier configuration; check it on a bench run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvtier.cli.args import add_load_args, add_session_args
from kvtier.plan.codecs import FIGURES as CODEC_FIGURES

EXAMPLES = """examples:
  kvtier plan --preset seed --concurrency 8,16,32
  kvtier plan --calibrate RESULTS/ --sessions 32 --context 4k-16k --concurrency 1,2,4,8 --png plan.png
  kvtier plan --model config.json --tp 8 --hardware hw.yaml --trace sessions.csv --concurrency 16
  kvtier plan --check RESULTS/          # calibrate at concurrency 1, predict the rest, compare
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="predict what tiering does for a workload (hit rate, TTFT, tok/s) before buying hardware",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Simulate a workload over the tiers (discrete-event: engine KV, LRU per tier, bandwidth "
                    "shared by concurrent read-backs, prefill queueing, the connector's load-or-recompute "
                    "decision) and print, per configuration (recompute / host DRAM / local disk / shared pool / "
                    "pool shared by N instances) and concurrency: hit rate per tier, TTFT p50/p90/p99, tok/s, "
                    "bytes read per second and the bottleneck. Hardware figures come from --hardware (YAML/JSON), "
                    "--calibrate (a `kvtier bench` result folder) and --probe (`kvtier probe --json`), later "
                    "sources overriding earlier ones. See docs/planner.md.")
    m = p.add_argument_group("model (default: the calibration run's model shape)")
    m.add_argument("--model", default=None, help="an HF config.json (or its directory)")
    m.add_argument("--layers", type=int, default=None, help="number of layers")
    m.add_argument("--kv-heads", type=int, default=None, help="KV heads (model total)")
    m.add_argument("--head-dim", type=int, default=None, help="head dim")
    m.add_argument("--dtype", default=None, help="KV dtype (bfloat16, float16, fp8, ...; default bfloat16)")
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel size: KV heads split over ranks (default 1)")
    w = p.add_argument_group("workload (a trace, or a distribution)")
    w.add_argument("--trace", default=None, help="CSV or JSONL: session, arrival_s, prompt_tokens, output_tokens "
                                                 "(open loop: each request arrives at arrival_s)")
    add_load_args(w, workloads=("cold-resume", "chat"), sessions=None, concurrency=[8, 16, 32])
    add_session_args(w)
    w.add_argument("--resume-order", choices=("written", "random"), default="written",
                   help="cold-resume: sessions come back in the order they were written (kvtier bench's order, the "
                        "default) or shuffled, as returning users would")
    h = p.add_argument_group("hardware")
    h.add_argument("--preset", choices=("seed",), default=None,
                   help="seed: the seed's Qwen3-Coder-480B TP=8 deployment (model, tiers, workload; assumptions "
                        "in kvtier/plan/presets.py)")
    h.add_argument("--hardware", default=None, help="YAML/JSON: engine figures and tiers (host, disk, pool)")
    h.add_argument("--calibrate", default=None, metavar="BENCH_DIR",
                   help="fit engine and tier figures from a `kvtier bench` result folder")
    h.add_argument("--calibrate-concurrency", type=int, default=None,
                   help="concurrency level of the bench run to fit on (default: its lowest; any level works)")
    h.add_argument("--probe", default=None, help="`kvtier probe --json` output: read/write bandwidth of --probe-tier")
    h.add_argument("--probe-tier", default="disk", help="tier the probe measured (default disk)")
    h.add_argument("--instances", type=int, default=None, help="instances sharing the pool (adds shared-pool-xN)")
    h.add_argument("--kv-codec", default=None, choices=tuple(CODEC_FIGURES),
                   help="the disk tier and the pool store KV through this codec: more tokens in their bytes, "
                        "read and written at the device's and the codec's rates together (docs/codecs.md)")
    h.add_argument("--codec-ratio", type=float, default=None,
                   help="with --kv-codec: how many times smaller it stores KV (default: measured on SmolLM2)")
    h.add_argument("--codec-threads", type=int, default=2, help="with --kv-codec: cores that code (default 2)")
    o = p.add_argument_group("output")
    o.add_argument("--check", default=None, metavar="BENCH_DIR",
                   help="calibrate on one concurrency level of BENCH_DIR, predict every other cell of that run, "
                        "print predicted vs measured TTFT p50")
    o.add_argument("--markdown", default=None, help="with --check: also write the table to this file")
    o.add_argument("--png", default=None, help="write TTFT p50 vs concurrency, and hit rate and TTFT vs pool size, "
                                               "to this PNG")
    o.add_argument("--curve-points", type=int, default=6, metavar="N",
                   help="pool sizes the capacity curve simulates per concurrency level, 5%%-100%% of the working "
                        "set (default 6; 0: no curve)")
    o.add_argument("--json", action="store_true", help="print one JSON object")


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _model(args: argparse.Namespace, fallback: Any) -> Any:
    from kvtier.plan.spec import ModelSpec

    if args.model:
        return ModelSpec.from_hf_config(args.model, parallel_size=args.tp, dtype=args.dtype)
    if args.layers or args.kv_heads or args.head_dim:
        if not (args.layers and args.kv_heads and args.head_dim):
            raise ValueError("--layers, --kv-heads and --head-dim go together (or give --model config.json)")
        return ModelSpec(args.layers, args.kv_heads, args.head_dim, args.dtype or "bfloat16", args.tp)
    if fallback is None:
        raise ValueError("no model: give --model config.json, --layers/--kv-heads/--head-dim, --calibrate or --preset")
    return fallback


def _hardware(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    from kvtier.plan import calibrate as cal_mod
    from kvtier.plan import presets
    from kvtier.plan.spec import hardware_from_dict, hardware_to_dict, load_mapping

    data: dict[str, Any] = {}
    model = None
    info: dict[str, Any] = {}
    if args.preset == "seed":
        data = presets.SEED_HARDWARE
        model = presets.SEED_MODEL
    if args.calibrate:
        probe = cal_mod.load_probe(args.probe) if args.probe else None
        cal = cal_mod.calibrate(args.calibrate, probe=probe, concurrency=args.calibrate_concurrency)
        model = cal.model
        calibrated = hardware_to_dict(cal.hardware())
        env_probe = probe or {}
        host_rate = cal_mod.probe_read_rate({"x": env_probe.get("kvtier_cache_gbps")}) or 5e9
        calibrated["tiers"]["host"] = {"capacity_bytes": cal.fit.get("host_bytes", 1 << 30),
                                       "read_bytes_per_s": host_rate, "write_bytes_per_s": host_rate,
                                       "persistent": False}
        data = _deep_merge(data, calibrated)
        info["calibration"] = cal.to_dict()
    if args.hardware:
        data = _deep_merge(data, load_mapping(args.hardware))
    if args.probe and not args.calibrate:
        probe = cal_mod.load_probe(args.probe)
        rate = cal_mod.probe_read_rate(probe)
        if rate:
            tier = dict((data.get("tiers") or {}).get(args.probe_tier) or {"capacity_bytes": 1 << 40})
            tier["read_bytes_per_s"] = rate
            tier["write_bytes_per_s"] = float(probe.get("write_gbps") or rate / 1e9) * 1e9
            data = _deep_merge(data, {"tiers": {args.probe_tier: tier}})
    if args.instances:
        data = {**data, "instances": args.instances}
    if not data:
        raise ValueError("no hardware figures: give --hardware FILE, --calibrate BENCH_DIR or --preset seed")
    if args.kv_codec:
        from kvtier.plan.codecs import apply

        data = apply(data, args.kv_codec, args.codec_threads, args.codec_ratio)
        info["kv_codec"] = {"name": args.kv_codec, "threads": args.codec_threads, "ratio": args.codec_ratio}
    return _model(args, model), hardware_from_dict(data), info


def _workload_maker(args: argparse.Namespace) -> Any:
    from kvtier.plan import presets, workload

    if args.trace:
        sessions = workload.load_trace(args.trace)
        return lambda c: workload.trace_workload(sessions)
    context, turns, q, out = args.context, args.turns, args.question_tokens, args.output_tokens
    per_user: float = 2.0
    if args.preset == "seed" and args.sessions is None:
        s = presets.SEED_WORKLOAD
        context, turns, q, out, per_user = s["context"], s["turns"], s["question_tokens"], s["output_tokens"], \
            s["sessions_per_user"]

    def make(c: int) -> Any:
        n = args.sessions or max(1, int(per_user * c))
        if args.workload == "chat":
            return workload.chat(n, context, c, turns=turns, question_tokens=q, output_tokens=out,
                                 think_s=args.think, seed=args.seed)
        return workload.cold_resume(n, context, c, turns=max(2, turns), question_tokens=q, output_tokens=out,
                                    seed=args.seed, resume_order=args.resume_order)

    return make


def run_check(args: argparse.Namespace) -> int:
    from kvtier.cli.output import emit_json
    from kvtier.plan import calibrate as cal_mod
    from kvtier.plan.check import capacity_markdown, cells_markdown, check, fit_markdown, run_capacity, summary

    probe = cal_mod.load_probe(args.probe) if args.probe else None
    cal, cells = check(args.check, concurrency=args.calibrate_concurrency, probe=probe)
    capacity = run_capacity(args.check, cal)
    notes = "".join(f"\n- {n}" for n in cal.notes)
    text = fit_markdown(cal) + "\n\n" + cells_markdown(cells) + (f"\n\nCalibration notes:{notes}" if notes else "") \
        + ("\n\nStorage the run's kvtier configurations left:\n\n" + capacity_markdown(capacity) if capacity else "")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        emit_json({"bench_dir": args.check, "calibration": cal.to_dict(), "cells": [c.to_dict() for c in cells],
                   "summary": summary(cells), "capacity": capacity})
    else:
        print(text)
    return 0


def run(args: argparse.Namespace) -> int:
    from kvtier.cli.output import emit_json
    from kvtier.plan.report import render_capacity, render_seed, render_table, run_plan, write_png
    from kvtier.plan.spec import default_configs, hardware_to_dict

    if args.check:
        return run_check(args)
    model, hw, info = _hardware(args)
    configs = default_configs(hw, args.instances)
    concurrency = [0] if args.trace else args.concurrency
    # Each level's workload once: the plan, the storage and the curve all simulate the same one.
    workloads = {c: _workload_maker(args)(c) for c in concurrency}
    make = workloads.__getitem__
    rows = run_plan(model, hw, configs, concurrency, make, seed=args.seed)
    storage, curves = _storage(args, model, hw, configs, concurrency, make)
    seed = _seed_side_by_side(args, rows)
    if seed:
        info["seed_table"] = seed
    if args.png:
        write_png(rows, args.png, curves=curves)
    if args.json:
        emit_json({"model": {**model.__dict__, "bytes_per_token": model.bytes_per_token},
                   "hardware": hardware_to_dict(hw), "rows": rows, **info, "capacity": storage,
                   "capacity_curves": curves, "png": args.png})
    else:
        print(f"model {model.name}: {model.bytes_per_token} KV bytes/token; configurations: "
              + ", ".join(f"{c.name}={'+'.join(c.tiers) or 'none'}" for c in configs), file=sys.stderr)
        print(render_table(rows))
        print(render_capacity(storage, curves))
        if seed:
            print(render_seed(seed))
        if args.png:
            print(f"wrote {args.png}")
    return 0


def _seed_side_by_side(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """With ``--preset seed`` and the preset's own workload and hardware (no --calibrate,
    --hardware, --trace or --sessions changing them), the plan beside the seed's table."""
    from kvtier.plan.presets import seed_comparison

    if args.preset != "seed" or args.calibrate or args.hardware or args.trace or args.sessions or args.kv_codec:
        return []
    return seed_comparison(rows)


def _storage(args: argparse.Namespace, model: Any, hw: Any, configs: Any, concurrency: list[int],
             make: Any) -> tuple[dict[int, Any], list[dict[str, Any]]]:
    """Per concurrency level: the capacity each tier needs, and the capacity curve of the shared
    pool (else the local disk) over ``--curve-points`` sizes."""
    from kvtier.plan.capacity import capacity, capacity_curve

    storage = {c: capacity(model, hw, make(c), instances=args.instances or hw.instances) for c in concurrency}
    config = next((c for name in ("shared-pool", "local-disk") for c in configs if c.name == name), None)
    if config is None or args.curve_points <= 0:
        return storage, []
    n = args.curve_points
    fractions = [round(0.05 + 0.95 * i / (n - 1), 3) for i in range(n)] if n > 1 else [1.0]
    return storage, [{"concurrency": c, **capacity_curve(model, hw, config, make(c), fractions, seed=args.seed)}
                     for c in concurrency]
