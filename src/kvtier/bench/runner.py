"""How the suite starts each configuration: engine command lines, environments, and the processes.

:class:`ConfigRunner` owns the processes of one configuration (an engine per instance, and
LMCache's server where needed); ``ENGINES`` maps each name of kvtier.bench.configs.CONFIGS to
the method that builds its engine's argv. The soak run and the save-cost benchmark start their
engines with the same :func:`engine_argv`, :func:`engine_env` and :func:`kvtier_serve_argv`, so
every measured engine is set up alike. :func:`failure_text` turns a failed start into the error
recorded in configs.json, led by the root cause found in the engine's log.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kvtier.bench.client import Target
from kvtier.bench.configs import CONFIGS, FLOOR, SERVED_NAME, SuiteSpec
from kvtier.bench.engines import EngineError, Process, free_port, root_cause
from kvtier.config import parse_bytes
from kvtier.tiers.poolroot import scratch_pool

ENGINES = {  # configuration -> the ConfigRunner method that builds its engine's argv
    "engine-cache": "_vllm", "recompute": "_vllm", "local-disk": "_kvtier", "shared-pool": "_kvtier",
    "example-connector": "_example", "lmcache": "_lmcache_engine", "vllm-offload-cpu": "_offload",
    "vllm-offload-fs": "_offload",
}

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
        settings: dict[str, Any] = {**self.spec.kvtier_settings, "host_bytes": self.spec.host_bytes,
                                    "chunk_tokens": self.spec.chunk_tokens}
        if self.config == "local-disk":
            settings["disk_path"] = str(self.work / f"disk-{i}")
            settings["disk_bytes"] = self.spec.storage_bytes
        else:
            budget = parse_bytes(self.spec.storage_bytes, "storage_bytes")
            settings["pool_url"] = scratch_pool(self.work / "pool", budget)
            settings["pool_bytes"] = self.spec.storage_bytes
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
