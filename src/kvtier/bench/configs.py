"""The suite's configurations and settings: the registry, what a run is given, the presets.

A configuration names one way of serving the same workload (``CONFIGS``, in the order a reader
compares them: the floor, recompute, kvtier's tiers, then peers); kvtier.bench.runner builds
each one's engines and kvtier.bench.summary orders report tables by this registry. This module
imports neither of them: it is the one place both read the names from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvtier.workload import WorkloadSpec

# The registry, in the order a reader compares them; kvtier.bench.runner.ENGINES says how each
# one's engine is built (a test keeps the two in step).
CONFIGS = ("engine-cache", "recompute", "local-disk", "shared-pool", "example-connector", "lmcache",
           "vllm-offload-cpu", "vllm-offload-fs")
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
    warmup_sessions: int = 0  # cold-resume sessions populated and resumed first, never measured
    host_bytes: str = "1GiB"
    storage_bytes: str = "16GiB"  # the shared pool's budget and each local disk tier's
    chunk_tokens: int = 256  # kvtier's configurations: tokens per chunk (a multiple of the block size)
    kvtier_settings: Mapping[str, Any] = field(default_factory=dict)  # more of their settings (kvtier_setting)
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


# The settings the suite gives kvtier's configurations itself (canonical names; their aliases
# are refused too): where their storage and their records go, and the sizes they share.
SUITE_OWNED = ("pool_url", "disk_path", "pool_bytes", "disk_bytes", "host_bytes", "chunk_tokens", "metrics_file",
               "profile_file", "config")


def kvtier_setting(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` (``VALUE`` read as YAML: ``sync``, ``8``, ``true``) as one more setting of
    kvtier's configurations. ValueError for a malformed pair, a key kvtier does not know, or one
    the suite sets itself (``SUITE_OWNED``; the chunk size has ``--chunk-tokens``)."""
    import yaml

    from kvtier.config import StoreConfig, setting_name

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"--kvtier-setting: expected KEY=VALUE (e.g. load_mode=sync), got {text!r}")
    name = setting_name(key) or (key if key in (*CONNECTOR_KEYS, *SUITE_OWNED) else None)
    if name in SUITE_OWNED:
        raise ValueError(f"--kvtier-setting: {key} is set by the suite itself"
                         + (" (use --chunk-tokens)" if name == "chunk_tokens" else ""))
    if name is None:
        names = sorted({f.name for f in fields(StoreConfig)} | set(CONNECTOR_KEYS))
        raise ValueError(f"--kvtier-setting: unknown kvtier setting {key!r}; known: {', '.join(names)}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ValueError(f"--kvtier-setting {key}: not a YAML value: {raw!r} ({exc})") from None
    return key, value


# The vLLM connector's own settings that a suite run may set: ConnectorConfig.KEYS less the
# suite's and the tests' own. A copy because importing kvtier.integrations.vllm imports vLLM;
# tests/test_bench_offloading.py holds the two equal.
CONNECTOR_KEYS = ("load_policy", "read_gbps", "prefill_tokens_per_s", "min_load_tokens", "load_mode",
                  "load_coalesce_ms", "save_decode", "tail_chunks", "lookup_timeout_s", "retain_s", "max_retain_s",
                  "trust_mm_identifiers", "events_max_chunks", "allow_untested_vllm")
