"""Store configuration: one frozen dataclass, validated once, from kwargs, YAML or env.

Precedence (later wins): YAML file or dict < ``KVTIER_*`` environment variables < keyword
overrides. In a YAML file, ``${NAME}`` (or ``${NAME:-default}``) in a value is replaced by that
environment variable, so secrets (``redis_password``, a ``pool_url``'s credentials,
``tenant_salt``) need not be written in the file; a variable that is unset and has no default
is an error naming it (never its value). Sizes accept ints (bytes) or strings such as
``"2GiB"``, ``"512MB"``, ``"1.5G"``.
LMCache-style names are accepted as aliases (``chunk_size``, ``max_local_cpu_size`` and
``max_local_disk_size`` in GB, ``local_disk``, ``remote_url``).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from kvtier.codec import namespace_tag, parse_codec
from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.urls import is_redis_url, parse_pool_url, parse_redis_url
from kvtier.urls import redact_url as redact_url  # its old home: kvtier.config.redact_url

GiB = 1 << 30
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_bytes(value: object, setting: str) -> int:
    """``1073741824``, ``"1GiB"``, ``"1G"`` and ``"1GB"`` all mean 2**30 bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{setting}: expected a size such as 2147483648 or '2GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        if not m.group(2) and not float(m.group(1)).is_integer():
            # "0.5" is not half a byte: it was meant in GB (LMCache's sizes) and would turn the tier off.
            raise ValueError(f"{setting}: {value!r} has no unit, so it is bytes, and not a whole number; "
                             f"write it with a unit, e.g. '{m.group(1)}GiB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{setting}: expected a size such as 2147483648 or '2GiB', got {value!r}")
    if n < 0:
        raise ValueError(f"{setting}: must be >= 0 bytes, got {value!r}")
    return n


WRITE_QUEUE_BYTES = 1 * GiB


@dataclass(frozen=True)
class StoreConfig:
    """Every setting of a TieredStore. Units are in the names; see docs for each."""

    model_id: str
    layout: KVLayout
    chunk_tokens: int = 256
    host_bytes: int = 1 * GiB
    disk_path: str | None = None
    disk_bytes: int = 10 * GiB
    pool_url: str | None = None
    pool_bytes: int | None = None
    rank: int = 0
    world_size: int = 1
    tenant_salt: str = ""
    kv_format: str = "kvtier"
    model_digest: str = ""
    """The content of the model's weights (engine integrations set it: ``keys.Namespace``)."""
    weights_digest: str = ""
    """The weights' content alone, described beside the pool for ``kvtier doctor`` (not in keys)."""
    kv_codec: str = "none"
    """How chunks are stored on the disk tier and in the pool (``kvtier.codec``): ``none``,
    ``lossless``, ``fp8``, ``k8v4`` or ``k8v8`` (``auto``: k8v8 where it pays). A lossy one is
    part of the namespace."""
    io_threads: int = 8
    write_threads: int = 1
    write_queue_chunks: int | None = None
    write_nice: int = 10
    """Scheduling priority of the background writer threads (0-19; higher yields more): their
    copies and checksums run behind the engine's threads instead of preempting them."""
    host_prefault: bool = False
    """Fault host DRAM's pages in at open, on a thread of the lowest priority, instead of on the
    engine's thread at its first saves (engine integrations turn it on; ``memory.py``)."""
    read_timeout_s: float = 10.0
    tier_cooldown_s: float = 30.0
    lookup_threads: int = 16
    """File-metadata calls a lookup of the shared pool keeps in flight (a network filesystem
    answers each in a round trip: 150-200 us on GlusterFS here); 1: one at a time."""
    lookup_negative_ttl_s: float = 1.0
    """How long the pool remembers that a chunk is absent (a chunk another instance writes is
    seen that much later at most; this instance's own writes at once); 0: never."""
    fsync: bool = False
    direct_io: bool = True
    group_access: bool = False
    """Disk and pool files 0o660 and directories 0o2770 (setgid) instead of owner-only, for a
    pool shared by several users of one group."""
    redis_ttl_s: float | None = None
    redis_timeout_s: float = 1.0
    redis_cluster: bool = False
    redis_prefix: str = "kvtier:v1:"
    redis_username: str | None = None
    redis_password: str | None = None
    redis_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError("model_id: must be a non-empty string naming the model (e.g. its HF id)")
        if not isinstance(self.layout, KVLayout):
            raise ValueError("layout: must be a kvtier.KVLayout(num_layers, num_kv_heads, head_dim, dtype)")
        _positive_int("chunk_tokens", self.chunk_tokens, "use a multiple of the engine's block size, e.g. 256")
        object.__setattr__(self, "kv_codec", parse_codec(self.kv_codec))
        _positive_int("io_threads", self.io_threads, "e.g. 8")
        _positive_int("write_threads", self.write_threads, "e.g. 1")
        if isinstance(self.write_nice, bool) or not isinstance(self.write_nice, int) or not 0 <= self.write_nice <= 19:
            raise ValueError(f"write_nice: must be an integer 0-19 (0: as the engine; 19: only idle time), "
                             f"got {self.write_nice!r}")
        if not isinstance(self.host_prefault, bool):
            raise ValueError(f"host_prefault: expected true/false, got {self.host_prefault!r}")
        _positive_int("lookup_threads", self.lookup_threads, "e.g. 16, or 1 for one metadata call at a time")
        if isinstance(self.lookup_negative_ttl_s, bool) or not isinstance(self.lookup_negative_ttl_s, (int, float)) \
                or not 0 <= self.lookup_negative_ttl_s <= 60:
            raise ValueError(f"lookup_negative_ttl_s: must be 0-60 seconds, got {self.lookup_negative_ttl_s!r}")
        if self.write_queue_chunks is None:
            # Bounded in bytes by default: a queued chunk pins its memory until written.
            object.__setattr__(self, "write_queue_chunks", max(4, WRITE_QUEUE_BYTES // self.chunk_bytes))
        _positive_int("write_queue_chunks", self.write_queue_chunks, "e.g. 256, or leave unset for 1 GiB worth")
        _positive_int("world_size", self.world_size, "the tensor/pipeline parallel size")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: must be in [0, world_size={self.world_size}), got {self.rank!r}")
        for name in ("host_bytes", "disk_bytes"):
            object.__setattr__(self, name, parse_bytes(getattr(self, name), name))
        if self.pool_bytes is not None:
            object.__setattr__(self, "pool_bytes", parse_bytes(self.pool_bytes, "pool_bytes"))
        if self.disk_path is not None and self.disk_bytes == 0:
            raise ValueError("disk_bytes: is 0 while disk_path is set; give a budget such as '50GiB' "
                             "or leave disk_path unset to turn the disk tier off")
        if not isinstance(self.group_access, bool):
            raise ValueError(f"group_access: expected true/false, got {self.group_access!r}")
        if not isinstance(self.read_timeout_s, (int, float)) or self.read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s: must be > 0 seconds, got {self.read_timeout_s!r}")
        if not isinstance(self.tier_cooldown_s, (int, float)) or isinstance(self.tier_cooldown_s, bool) \
                or self.tier_cooldown_s < 0:
            raise ValueError(f"tier_cooldown_s: must be >= 0 seconds, got {self.tier_cooldown_s!r}")
        if self.pool_url is not None:
            if is_redis_url(self.pool_url):
                _check_redis(self)
                if parse_redis_url(self.pool_url).db and self.redis_cluster:
                    raise ValueError("pool_url: Redis Cluster has database 0 only; drop the /db part")
            else:
                parse_pool_url(self.pool_url)
        if self.disk_path is not None and not str(self.disk_path):
            raise ValueError("disk_path: empty; give a directory or leave it unset")

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * self.layout.bytes_per_token

    def namespace(self, rank: int | None = None) -> Namespace:
        """The namespace this store's keys are made in (``rank``: another parallel rank's)."""
        return Namespace(self.model_id, self.layout, self.chunk_tokens, self.rank if rank is None else rank,
                         self.world_size, self.tenant_salt, kv_format=self.kv_format,
                         model_digest=self.model_digest, weights_digest=self.weights_digest,
                         kv_codec=namespace_tag(self.kv_codec))

    def __repr__(self) -> str:
        # Logged at start by engine integrations: secrets never reach a log line or a repr.
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("redis_password", "tenant_salt") and value:
                value = "***"
            elif f.name == "pool_url" and value is not None:
                value = redact_url(value)
            elif f.name == "redis_options" and value is not None:
                value = {k: "***" if _secret_key(k) else v for k, v in dict(value).items()}
            shown.append(f"{f.name}={value!r}")
        return f"StoreConfig({', '.join(shown)})"

    __str__ = __repr__


def _secret_key(name: str) -> bool:
    return any(word in name.lower() for word in ("pass", "secret", "token", "key"))


def _check_redis(c: StoreConfig) -> None:
    if c.pool_bytes is not None:
        raise ValueError("pool_bytes: not used with a Redis pool_url; the server's maxmemory is the "
                         "budget (set maxmemory-policy allkeys-lru); leave pool_bytes unset")
    if not isinstance(c.redis_timeout_s, (int, float)) or isinstance(c.redis_timeout_s, bool) \
            or c.redis_timeout_s <= 0:
        raise ValueError(f"redis_timeout_s: must be > 0 seconds, got {c.redis_timeout_s!r}")
    if c.redis_ttl_s is not None and (not isinstance(c.redis_ttl_s, (int, float))
                                      or isinstance(c.redis_ttl_s, bool) or c.redis_ttl_s <= 0):
        raise ValueError(f"redis_ttl_s: must be > 0 seconds or unset (no expiry), got {c.redis_ttl_s!r}")
    if not isinstance(c.redis_cluster, bool):
        raise ValueError(f"redis_cluster: expected true/false, got {c.redis_cluster!r}")
    if not isinstance(c.redis_prefix, str) or not c.redis_prefix:
        raise ValueError(f"redis_prefix: must be a non-empty string such as 'kvtier:v1:', "
                         f"got {c.redis_prefix!r}")
    if c.redis_options is not None and not isinstance(c.redis_options, Mapping):
        raise ValueError(f"redis_options: expected a mapping of redis-py options such as "
                         f"{{ssl_ca_certs: /path/ca.pem}}, got {c.redis_options!r}")


def _positive_int(name: str, value: object, hint: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer ({hint}), got {value!r}")


_ALIASES = {
    "chunk_size": "chunk_tokens",
    "local_disk": "disk_path",
    "remote_url": "pool_url",
    "model": "model_id",
    "model_name": "model_id",
}
# LMCache gives these in GB (floats).
_GB_ALIASES = {"max_local_cpu_size": "host_bytes", "max_local_disk_size": "disk_bytes"}
_LAYOUT_KEYS = ("num_layers", "num_kv_heads", "head_dim", "dtype")
_INT_KEYS = {"chunk_tokens", "rank", "world_size", "io_threads", "write_threads", "write_queue_chunks",
             "lookup_threads", "write_nice",
             "num_layers", "num_kv_heads", "head_dim"}
_BOOL_KEYS = {"fsync", "direct_io", "group_access", "redis_cluster", "host_prefault"}
_FLOAT_KEYS = {"read_timeout_s", "tier_cooldown_s", "redis_timeout_s", "redis_ttl_s", "lookup_negative_ttl_s"}
_NULLABLE_KEYS = {"disk_path", "pool_url", "pool_bytes", "redis_ttl_s", "redis_username", "redis_password",
                  "redis_options"}
_ENV_PARSERS: tuple[tuple[Container[str], Callable[[str], object], str], ...] = (
    ({"redis_options"}, json.loads, "a JSON object"), (_INT_KEYS, int, "an integer"), (_FLOAT_KEYS, float, "a number"))
"""How a ``KVTIER_*`` value of those keys is parsed, and what the error says it expected."""


def _coerce_env(name: str, raw: str) -> object:
    if raw.lower() in ("", "none", "null") and name in _NULLABLE_KEYS:
        return None
    for keys, parse, expected in _ENV_PARSERS:
        if name in keys:
            try:
                return parse(raw)
            except ValueError:  # json.JSONDecodeError is one
                raise ValueError(f"KVTIER_{name.upper()}: expected {expected}, got {raw!r}") from None
    if name in _BOOL_KEYS:
        return parse_env_bool(f"KVTIER_{name.upper()}", raw)
    return raw


def parse_env_bool(var: str, raw: str) -> bool:
    """An environment variable's true/false (``1``/``0``, ``yes``/``no``, ``on``/``off``), or
    ValueError naming ``var``."""
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{var}: expected true/false, got {raw!r}")


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value: Any, environ: Mapping[str, str], where: str = "") -> Any:
    """``value`` with every ``${NAME}`` / ``${NAME:-default}`` in its strings replaced (recursively
    in mappings and lists). ValueError for an unset variable without a default."""
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in environ:
                return environ[name]
            if default is not None:
                return default
            raise ValueError(f"{where or 'kvtier config'}: environment variable {name} is not set "
                             f"(write ${{{name}:-default}} for a default)")

        return _ENV_REF.sub(sub, value)
    if isinstance(value, Mapping):
        return {k: expand_env(v, environ, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, environ, where) for v in value]
    return value


def read_settings_file(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings of a kvtier YAML file (a top-level mapping, or one under ``kvtier:``), with
    ``${VAR}`` references expanded from ``environ`` (default: the process environment)."""
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ValueError(f"{path}: not valid YAML{where}: {problem}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of settings at the top level")
    if isinstance(loaded.get("kvtier"), dict):  # allow nesting under a `kvtier:` section
        loaded = dict(loaded["kvtier"])
    return dict(expand_env(loaded, os.environ if environ is None else environ, str(path)))


def load_settings(source: str | os.PathLike[str] | Mapping[str, Any] | None,
                  environ: Mapping[str, str] | None = None, **overrides: Any) -> StoreConfig:
    """Merge a YAML file or dict, ``KVTIER_*`` variables and keyword overrides; validate."""
    env = os.environ if environ is None else environ
    if source is None:
        raw: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        raw = dict(source)
    else:
        raw = read_settings_file(source, env)
    if isinstance(raw.get("kvtier"), dict):  # allow nesting under a `kvtier:` section
        raw = dict(raw["kvtier"])
    known = {f.name for f in fields(StoreConfig)} | set(_LAYOUT_KEYS)
    env_layer: dict[str, Any] = {}
    for var, value in env.items():
        if var.startswith("KVTIER_"):
            name = var[len("KVTIER_"):].lower()
            name = _ALIASES.get(name, name)
            if name in known or name in _GB_ALIASES:
                env_layer[name] = _coerce_env(name, value)
            else:
                _warn_unknown_env(var, known)
    # Each layer is put in canonical names before merging, so a later layer wins even when
    # it spells a setting differently (``chunk_size`` vs ``chunk_tokens``).
    settings = _canonical(raw)
    settings.update(_canonical(env_layer))
    settings.update(_canonical(overrides))
    return _build(settings)


ENV_NOT_SETTINGS = ("CACHE_DIR", "VENV", "TEST_", "REQUIRE_", "GLUSTER_", "SGLANG_", "VLLM_RELEASES", "EXPECT_",
                    "LOADED", "SALT")
"""``KVTIER_*`` names (prefixes) that are not settings: kvtier's model cache, its scripts' and tests'."""
CONNECTOR_SETTINGS = (
    "load_policy", "read_gbps", "prefill_tokens_per_s", "min_load_tokens", "load_mode", "load_coalesce_ms",
    "save_decode", "tail_chunks", "lookup_timeout_s", "retain_s", "max_retain_s", "trust_mm_identifiers",
    "events_max_chunks", "metrics_file", "profile_file", "config", "inject_faults", "allow_untested_vllm")
"""The vLLM connector's own settings (``integrations.vllm.config.ConnectorConfig``), here so that
their ``KVTIER_*`` forms are known without importing vLLM."""
_warned_env: set[str] = set()


def _warn_unknown_env(var: str, known: set[str]) -> None:
    """Warn once per name about a ``KVTIER_*`` variable that is no setting (a typo is otherwise
    silently ignored)."""
    name = var[len("KVTIER_"):]
    if var in _warned_env or name.lower() in CONNECTOR_SETTINGS or name.startswith(ENV_NOT_SETTINGS):
        return
    _warned_env.add(var)
    names = sorted(known | set(_ALIASES) | set(_GB_ALIASES) | set(CONNECTOR_SETTINGS))
    close = difflib.get_close_matches(name.lower(), names, n=1)
    hint = f"; did you mean KVTIER_{close[0].upper()}?" if close else ""
    logging.getLogger(__name__).warning("kvtier: environment variable %s is not a kvtier setting and is "
                                        "ignored%s", var, hint)


def setting_name(name: str) -> str | None:
    """The canonical name of the store setting ``name`` (an alias such as ``chunk_size`` or
    ``max_local_cpu_size`` gives ``chunk_tokens`` / ``host_bytes``), or None when
    ``load_settings`` does not take it."""
    canonical = _GB_ALIASES.get(name) or _ALIASES.get(name, name)
    return canonical if canonical in {f.name for f in fields(StoreConfig)} or canonical in _LAYOUT_KEYS else None


def _canonical(layer: Mapping[str, Any]) -> dict[str, Any]:
    """One layer of settings with aliases replaced by canonical names (GB aliases in bytes)."""
    out: dict[str, Any] = {}
    for key, value in layer.items():
        if key in _GB_ALIASES:
            try:
                out[_GB_ALIASES[key]] = int(float(value) * GiB)
            except (TypeError, ValueError):
                raise ValueError(f"{key}: expected a number of GB such as 5 or 0.5 (LMCache style), got "
                                 f"{value!r}; or set {_GB_ALIASES[key]} to a size such as '5GiB'") from None
        else:
            out[_ALIASES.get(key, key)] = value
    return out


def _build(settings: dict[str, Any]) -> StoreConfig:
    if isinstance(settings.get("disk_path"), str) and settings["disk_path"].startswith("file://"):
        settings["disk_path"] = settings["disk_path"][len("file://"):]
    layout = settings.pop("layout", None)
    flat = {k: settings.pop(k) for k in _LAYOUT_KEYS if k in settings}
    if isinstance(layout, Mapping):
        layout = KVLayout(**{**dict(layout), **flat})
    elif layout is None:
        missing = [k for k in _LAYOUT_KEYS[:3] if k not in flat]
        if missing:
            raise ValueError(f"layout: missing {', '.join(missing)}; give `layout: {{num_layers: .., "
                             "num_kv_heads: .., head_dim: .., dtype: bfloat16}}`")
        layout = KVLayout(**flat)
    known = {f.name for f in fields(StoreConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return StoreConfig(layout=layout, **settings)
