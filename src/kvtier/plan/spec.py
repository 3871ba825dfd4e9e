"""What the planner is told: the model's KV shape, the engine's rates, the tiers, the configurations.

All specs are frozen dataclasses validated once here; a bad value raises ``ValueError`` that says
how to fix it. Units are in the names (``_bytes``, ``_s``, ``_per_s``). Byte figures are per
engine *instance* (all tensor-parallel ranks together): a tier's ``read_bytes_per_s`` is what one
instance can pull from it, its ``capacity_bytes`` what it holds in all.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvtier.config import parse_bytes
from kvtier.policy import LOAD_MODES
from kvtier.tiers.kinds import DISK, HOST, KINDS, POOL

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int8": 1, "uint8": 1}
# Tier names the default configurations use, in lookup order (the connector's: host, disk, pool).
TIER_ORDER = tuple(k.name for k in (HOST, DISK, POOL))


def _positive(owner: str, name: str, value: float, *, zero_ok: bool = False) -> None:
    ok = value >= 0 if zero_ok else value > 0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not ok:
        need = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"{owner}.{name} must be a finite number {need}, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """The KV shape of a model. ``num_kv_heads`` is the model's total; with ``parallel_size`` ranks
    each holds ``max(1, num_kv_heads // parallel_size)`` heads (heads are replicated when fewer than
    ranks, as vLLM does), so a replicated head costs bytes on every rank."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    parallel_size: int = 1
    name: str = "model"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")
        dtype = str(self.dtype).removeprefix("torch.").lower()
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"ModelSpec.dtype {self.dtype!r} is unknown; use one of {sorted(DTYPE_BYTES)}")
        object.__setattr__(self, "dtype", dtype)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token on all ranks together (K and V, every layer)."""
        heads_per_rank = max(1, self.num_kv_heads // self.parallel_size)
        return self.num_layers * 2 * heads_per_rank * self.parallel_size * self.head_dim * DTYPE_BYTES[self.dtype]

    @classmethod
    def from_hf_config(cls, path: str | Path, *, parallel_size: int = 1, dtype: str | None = None) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (or a model directory holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            cfg = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{p}: cannot read a model config.json: {exc}") from None
        cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
        if not isinstance(cfg, dict):
            raise ValueError(f"{p}: expected a JSON object")
        try:
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads", heads))
            head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{p}: missing or bad field {exc} (need num_hidden_layers, num_attention_heads, "
                             "hidden_size or head_dim)") from None
        kv_dtype = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return cls(layers, kv_heads, head_dim, kv_dtype, parallel_size, name=str(cfg.get("model_type", p.parent.name)))


@dataclass(frozen=True)
class TierSpec:
    """One storage tier as one engine instance sees it.

    ``latency_s`` is paid once per step that reads from the tier (lookups, opens, first byte);
    ``persistent`` tiers survive an engine restart (disk, pool), others (host DRAM) do not.
    ``shared`` tiers (the pool) are shared by all instances: capacity and bandwidth are divided
    among them. A hardware file that leaves either out for a tier named after a kind
    (``kvtier.tiers.kinds``: host, disk, pool, redis) gets that kind's. ``write_queue_s``:
    background writes further behind than this are dropped, as the connector's bounded write
    queue drops them rather than stall the engine.
    """

    name: str
    capacity_bytes: int
    read_bytes_per_s: float
    write_bytes_per_s: float
    latency_s: float = 0.0
    persistent: bool = True
    shared: bool = False
    write_queue_s: float = 30.0

    def __post_init__(self) -> None:
        owner = f"tier {self.name!r}"
        _positive(owner, "capacity_bytes", self.capacity_bytes, zero_ok=True)
        _positive(owner, "read_bytes_per_s", self.read_bytes_per_s)
        _positive(owner, "write_bytes_per_s", self.write_bytes_per_s)
        _positive(owner, "latency_s", self.latency_s, zero_ok=True)
        _positive(owner, "write_queue_s", self.write_queue_s, zero_ok=True)


@dataclass(frozen=True)
class EngineSpec:
    """The engine's compute figures, per instance.

    Prefill of ``n`` new tokens after ``p`` tokens already in KV costs
    ``n / prefill_tokens_per_s + prefill_quadratic_s * n * (p + n / 2)`` (the second term is
    attention over the context). A step costs ``step_overhead_s``, plus its prefill chunks, plus,
    when ``b > 0`` requests decode in it, ``decode_step_s + b * decode_per_seq_s +
    decode_context_s * (sum of their context tokens)``. ``request_overhead_s`` is paid once per
    request outside the engine (HTTP, tokenizer) and delays its arrival, with
    ``frontend_per_token_s`` per prompt token (tokenizing it, hit or not); the front end that
    pays them handles one request at a time, so requests sent together reach the engine in turn.
    ``tail_chunks`` (the vLLM connector's setting, on by default there) also keeps the prompt's
    blocks after its last full chunk, in steps of ``keys.tail_step`` tokens, as one *tail* whose
    read costs a full chunk's bytes; off, the tiers hold whole chunks only (LMCache, SGLang).
    ``hbm_kv_bytes`` is HBM (or CPU KV space) for KV over all ranks; ``None`` means unlimited.
    ``shared_rate`` (0-1] is how fast the engine and the front end each work while both have work,
    against alone: 1 where the front end has cores of its own (beside a GPU engine), less where
    they share the engine's cores (vLLM's CPU build with its threads on every core:
    ``plan.enginefit.shared_rate``; ``plan.frontend``). ``load_mode`` is the vLLM connector's
    setting: ``sync`` loads in the step that admits the request; ``auto`` (the connector's
    default) does so only on an idle engine for a load predicted under
    ``kvtier.policy.SYNC_IDLE_MAX_S``, and else reads in the background, one load after
    another, while the engine steps the others; ``async`` always in the background. A
    background load's request is scheduled two steps after its read ends (one reports it, the
    next prefills it).
    """

    prefill_tokens_per_s: float
    decode_step_s: float
    prefill_quadratic_s: float = 0.0
    step_overhead_s: float = 0.0
    decode_per_seq_s: float = 0.0
    decode_context_s: float = 0.0
    max_batched_tokens: int = 8192
    hbm_kv_bytes: int | None = None
    block_tokens: int = 16
    chunk_tokens: int = 256
    request_overhead_s: float = 0.0
    tail_chunks: bool = True
    frontend_per_token_s: float = 0.0
    shared_rate: float = 1.0
    load_mode: str = "sync"

    def __post_init__(self) -> None:
        _positive("engine", "prefill_tokens_per_s", self.prefill_tokens_per_s)
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"engine.load_mode must be one of {', '.join(LOAD_MODES)}, got {self.load_mode!r}")
        if isinstance(self.shared_rate, bool) or not isinstance(self.shared_rate, int | float) \
                or not 0 < self.shared_rate <= 1:
            raise ValueError(f"engine.shared_rate must be in (0, 1], got {self.shared_rate!r}")
        for name in ("decode_step_s", "prefill_quadratic_s", "step_overhead_s", "decode_per_seq_s",
                     "decode_context_s", "request_overhead_s", "frontend_per_token_s"):
            _positive("engine", name, getattr(self, name), zero_ok=True)
        for name in ("max_batched_tokens", "block_tokens", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"engine.{name} must be a positive int, got {value!r}")
        if self.hbm_kv_bytes is not None:
            _positive("engine", "hbm_kv_bytes", self.hbm_kv_bytes, zero_ok=True)
        if not isinstance(self.tail_chunks, bool):
            raise ValueError(f"engine.tail_chunks must be true or false, got {self.tail_chunks!r}")

    def prefill_s(self, num_tokens: int, context_tokens: int) -> float:
        """Seconds to prefill ``num_tokens`` after ``context_tokens`` already in KV."""
        n = float(num_tokens)
        return n / self.prefill_tokens_per_s + self.prefill_quadratic_s * n * (context_tokens + n / 2.0)


@dataclass(frozen=True)
class HardwareSpec:
    """Engine figures, the tiers that exist, and how many instances share the pool."""

    engine: EngineSpec
    tiers: tuple[TierSpec, ...] = ()
    instances: int = 1

    def __post_init__(self) -> None:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"hardware: tier names must be unique, got {names}")
        if not isinstance(self.instances, int) or self.instances < 1:
            raise ValueError(f"hardware.instances must be a positive int, got {self.instances!r}")

    def tier(self, name: str) -> TierSpec:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ValueError(f"no tier named {name!r}; hardware has {[t.name for t in self.tiers]}")


@dataclass(frozen=True)
class PlanConfig:
    """One configuration to simulate: the tiers the connector uses (lookup order), and instances."""

    name: str
    tiers: tuple[str, ...] = ()
    instances: int = 1


def default_configs(hw: HardwareSpec, instances: int | None = None) -> list[PlanConfig]:
    """recompute, host DRAM, local disk, shared pool, and the pool shared by N instances,
    each only where the hardware names the tiers it needs."""
    have = {t.name for t in hw.tiers}
    host = ("host",) if "host" in have else ()
    out = [PlanConfig("recompute")]
    if host:
        out.append(PlanConfig("host-dram", host))
    if "disk" in have:
        out.append(PlanConfig("local-disk", (*host, "disk")))
    if "pool" in have:
        out.append(PlanConfig("shared-pool", (*host, "pool")))
        n = instances or hw.instances
        if n > 1:
            out.append(PlanConfig(f"shared-pool-x{n}", (*host, "pool"), n))
    return out


def _build(cls: Any, data: Mapping[str, Any], where: str) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(names)}")
    kwargs = dict(data)
    for key in ("capacity_bytes", "hbm_kv_bytes"):
        if kwargs.get(key) is not None:
            kwargs[key] = parse_bytes(kwargs[key], f"{where}.{key}")
    for key in ("read_bytes_per_s", "write_bytes_per_s", "prefill_tokens_per_s"):
        value = kwargs.get(key)
        if isinstance(value, str):  # YAML reads 1e9 as a string; '10GB' is a size per second
            try:
                kwargs[key] = float(value)
            except ValueError:
                kwargs[key] = float(parse_bytes(value, f"{where}.{key}"))
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _kind_defaults(name: str) -> dict[str, bool]:
    known = KINDS.get(name)
    return {} if known is None else {"persistent": known.persistent, "shared": known.shared}


def hardware_from_dict(data: Mapping[str, Any]) -> HardwareSpec:
    """``{"engine": {...}, "tiers": {"disk": {...}, ...}, "instances": N}``; sizes may be '2TiB'."""
    if not isinstance(data, Mapping) or "engine" not in data:
        raise ValueError("hardware: expected a mapping with an 'engine' section (prefill_tokens_per_s, ...)")
    engine = _build(EngineSpec, data["engine"], "hardware.engine")
    tiers_raw = data.get("tiers") or {}
    if not isinstance(tiers_raw, Mapping):
        raise ValueError("hardware.tiers: expected a mapping of tier name to figures")
    tiers = tuple(_build(TierSpec, {"name": name, **_kind_defaults(name), **dict(spec)}, f"hardware.tiers.{name}")
                  for name, spec in tiers_raw.items())
    return HardwareSpec(engine, tiers, int(data.get("instances", 1)))


def hardware_to_dict(hw: HardwareSpec) -> dict[str, Any]:
    return {"engine": {f.name: getattr(hw.engine, f.name) for f in fields(EngineSpec)},
            "tiers": {t.name: {f.name: getattr(t, f.name) for f in fields(TierSpec) if f.name != "name"}
                      for t in hw.tiers},
            "instances": hw.instances}


def load_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON file holding one mapping."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"{p}: {exc}") from None
    if p.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a mapping at the top level")
    return data


def model_from_dict(data: Mapping[str, Any]) -> ModelSpec:
    return _build(ModelSpec, data, "model")  # type: ignore[no-any-return]


def with_engine(hw: HardwareSpec, **changes: Any) -> HardwareSpec:
    return replace(hw, engine=replace(hw.engine, **changes))


__all__ = ["TIER_ORDER", "EngineSpec", "HardwareSpec", "ModelSpec", "PlanConfig", "TierSpec", "default_configs",
           "hardware_from_dict", "hardware_to_dict", "load_mapping", "model_from_dict", "with_engine"]
