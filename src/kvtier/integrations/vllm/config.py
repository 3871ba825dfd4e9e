"""The connector's settings, validated once, and the deployment it is asked to serve.

``ConnectorConfig`` holds the connector's own settings (the rest of
``kv_connector_extra_config`` are ``StoreConfig`` settings). ``Deployment`` is what kvtier
derives from vLLM's config and KV cache config, identically in the scheduler and every worker
process: the page geometry that sizes a chunk, the tensor-parallel sharding, and the
``kv_format`` that names the bytes. Anything kvtier cannot serve correctly is refused here, at
start, with a ``ValueError`` that names the setting and the fix (``UnsupportedDeployment``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from kvtier.config import CONNECTOR_SETTINGS, StoreConfig, load_settings, parse_env_bool, read_settings_file
from kvtier.layout import KVLayout
from kvtier.policy import LOAD_MODES

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

LOAD_POLICIES = ("auto", "always", "never")
REQUIRED_LAYOUT = "LBHNC"
"""The KV cache layout the connector asks vLLM for (``get_required_kvcache_layout``): each
layer's block is one dense page, so a block moves as one run. Any other layout vLLM resolves
still works (``paged.block_runs``), with more, smaller copies."""


class UnsupportedDeployment(ValueError):
    """vLLM is configured in a way kvtier cannot serve correctly; the message says the fix."""


def _number(name: str, value: object, *, minimum: float = 0.0, strict: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"kvtier setting {name}: expected a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"kvtier setting {name}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"kvtier setting {name}: expected a finite number, got {value!r}")
    if number < minimum or (strict and number == minimum):
        raise ValueError(f"kvtier setting {name}: must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return number


MAX_COALESCE_MS = 1000.0


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's own settings (units in the names), from ``kv_connector_extra_config``."""

    load_policy: str = "auto"
    """``auto``: load a hit only when reading it is predicted faster than recomputing it;
    ``always`` / ``never``: for experiments and tests."""
    read_gbps: float = 1.0
    """Prior read bandwidth of the disk and pool tiers (host DRAM: 10x) until measured."""
    prefill_tokens_per_s: float | None = None
    """Prior prefill rate; None: measured from the engine's own steps (until then, load)."""
    min_load_tokens: int = 0
    """Hits shorter than this are not loaded."""
    load_mode: str = "auto"
    """``async``: a request with a hit waits while its chunks are read in the background and
    the engine keeps running the others; it is prefilled two engine steps later at the
    earliest (the step that reports the load over, then the next). ``sync``: the step that
    schedules it reads them before its forward pass (every running request stalls meanwhile).
    ``auto``: in the step while the engine is idle (the last step scheduled no tokens, so
    nothing stalls) and the load is predicted to take at most ``SYNC_IDLE_MAX_S``; else in
    the background."""
    load_coalesce_ms: float = 10.0
    """A background load that is over is reported at the end of the engine's step, and its
    request is prefilled in the next. When other loads are still running then, the worker
    waits up to this long for those that, at the rate they have read so far, will be done
    within it, so that requests that arrived together are prefilled in one step rather than
    one step apart (the later one waiting out the other's whole prefill). It delays that
    step's end by at most this much. 0: report each load at the first step end after it."""
    save_decode: bool = True
    """Save the full chunks of a finished request's prompt *and* generated tokens, so the next
    turn of a conversation hits the previous answer too (the request's blocks are held until
    they are copied). False: prompt chunks only."""
    tail_chunks: bool = True
    """Also save and load a prompt's *tail*: its full blocks after the last full chunk (in steps
    of a quarter chunk or one block, whichever is larger; ``keys.tail_id``), so a resumed
    session recomputes what vLLM's own prefix cache would, not up to a chunk more. Costs one
    extra file per prompt and per finished request, and at most three extra lookups per
    request that hit (one on vLLM's CPU build)."""
    lookup_timeout_s: float = 2.0
    """A request's lookup runs in the background; a request whose lookup has not finished
    after this long is scheduled without a hit."""
    retain_s: float = 0.0
    """Server-wide default session retention: every request's chunks are kept in the disk tier
    and the pool ahead of unretained ones for this long after its last save or hit (0: none). A
    request sets its own with ``kv_transfer_params: {"kvtier": {"retain_s": 1800}}``."""
    max_retain_s: float = 3600.0
    """The longest retention a request may ask for (its ``retain_s`` is clamped to this); a value
    that is not a finite number >= 0 is ignored. Both are counted (``rejected_params``). One hour
    by default: any API client can ask, and what it retains is evicted after everything else, so
    an operator who trusts clients with longer sessions raises it."""
    trust_mm_identifiers: bool = False
    """Multimodal inputs are keyed by a digest of their processed data. When vLLM hands the
    engine an item without its data (a processor-cache hit), kvtier cannot check what the
    item's identifier (possibly a client's ``multi_modal_uuids`` string) stands for, and serves
    the request without kvtier; true: key such items by the identifier (counted)."""
    events_max_chunks: int = 16384
    """With vLLM's KV events on: how many chunks' block hashes the scheduler remembers to
    announce and withdraw them (about 2.5 KB each at 256 tokens per chunk)."""
    metrics_file: str | None = None
    """Rewrite ``<metrics_file>.<role>.json`` every 5 s, at shutdown, and (the scheduler's) whenever
    the engine drains."""
    profile_file: str | None = None
    """Append one JSON line per request to this file once its prefill is scheduled: where its
    time went (lookup, waiting for the load, each rank's reads and copies, the prefill step;
    ``profile.py``). For benchmarks: off by default."""
    config: str | None = None
    """A kvtier YAML file with store settings (the extra config's own store settings win)."""
    allow_untested_vllm: bool = False
    """Run on a vLLM release the connector was not tested with (``releases.TESTED``) instead of
    refusing to start; a change in vLLM's connector API may then fail requests or the engine."""
    inject_faults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Tests only: ``{tier name: FaultyTier options}``."""
    file_settings: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The store settings of the ``config`` file (read by ``split``; never shown: it may hold secrets)."""

    KEYS = CONNECTOR_SETTINGS

    def __post_init__(self) -> None:
        if self.load_policy not in LOAD_POLICIES:
            raise ValueError(f"kvtier setting load_policy: {self.load_policy!r}; use one of {', '.join(LOAD_POLICIES)}")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"kvtier setting load_mode: {self.load_mode!r}; use one of {', '.join(LOAD_MODES)}")
        if not isinstance(self.save_decode, bool):
            raise ValueError(f"kvtier setting save_decode: expected true or false, got {self.save_decode!r}")
        if not isinstance(self.tail_chunks, bool):
            raise ValueError(f"kvtier setting tail_chunks: expected true or false, got {self.tail_chunks!r}")
        object.__setattr__(self, "lookup_timeout_s", _number("lookup_timeout_s", self.lookup_timeout_s))
        object.__setattr__(self, "read_gbps", _number("read_gbps", self.read_gbps))
        object.__setattr__(self, "load_coalesce_ms", _number("load_coalesce_ms", self.load_coalesce_ms, strict=False))
        if self.load_coalesce_ms > MAX_COALESCE_MS:  # it holds up every running request's step
            raise ValueError(f"kvtier setting load_coalesce_ms: at most {MAX_COALESCE_MS:g}, got "
                             f"{self.load_coalesce_ms!r}")
        object.__setattr__(self, "retain_s", _number("retain_s", self.retain_s, strict=False))
        object.__setattr__(self, "max_retain_s", _number("max_retain_s", self.max_retain_s, strict=False))
        if not self.retain_s <= self.max_retain_s < 1e9:  # (and finite: os.utime must take it)
            raise ValueError(f"kvtier setting retain_s / max_retain_s: need retain_s <= max_retain_s < 1e9 s, got "
                             f"{self.retain_s!r} and {self.max_retain_s!r}")
        if not isinstance(self.allow_untested_vllm, bool):
            raise ValueError(f"kvtier setting allow_untested_vllm: expected true or false, got "
                             f"{self.allow_untested_vllm!r}")
        if not isinstance(self.trust_mm_identifiers, bool):
            raise ValueError(f"kvtier setting trust_mm_identifiers: expected true or false, got "
                             f"{self.trust_mm_identifiers!r}")
        if isinstance(self.events_max_chunks, bool) or not isinstance(self.events_max_chunks, int) \
                or self.events_max_chunks < 1:
            raise ValueError(f"kvtier setting events_max_chunks: expected an integer >= 1, got "
                             f"{self.events_max_chunks!r}")
        if self.prefill_tokens_per_s is not None:
            rate = _number("prefill_tokens_per_s", self.prefill_tokens_per_s, strict=False)
            object.__setattr__(self, "prefill_tokens_per_s", rate or None)  # 0 means "measure it"
        if isinstance(self.min_load_tokens, bool) or not isinstance(self.min_load_tokens, int) \
                or self.min_load_tokens < 0:
            raise ValueError(f"kvtier setting min_load_tokens: expected an integer >= 0, got {self.min_load_tokens!r}")
        for name in ("metrics_file", "profile_file", "config"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise ValueError(f"kvtier setting {name}: expected a file path, got {value!r}")
        if not isinstance(self.inject_faults, Mapping):
            raise ValueError(f"kvtier setting inject_faults: expected {{tier: options}}, got {self.inject_faults!r}")

    @classmethod
    def split(cls, extra: Mapping[str, Any] | None) -> tuple[ConnectorConfig, dict[str, Any]]:
        """The connector's settings from ``extra`` and the ``config`` file it names, and the rest of
        ``extra`` (store settings; the file's are in ``file_settings``). ``extra`` wins over the
        file; the file's ``${VAR}`` references are expanded here, inside the connector, so a
        secret reaches vLLM's command line and logs as a variable's name at most."""
        rest = dict(extra or {})
        from_env = cls.from_env(os.environ)
        path = rest.get("config", from_env.get("config"))
        from_file: dict[str, Any] = {}
        if path is not None:
            if not isinstance(path, (str, os.PathLike)) or not str(path):
                raise ValueError(f"kvtier setting config: expected a file path, got {path!r}")
            from_file = read_settings_file(path)
        mine = {k: from_file.pop(k) for k in cls.KEYS if k in from_file and k != "config"}
        mine.update(from_env)  # the file < KVTIER_* variables < the extra config, as for the store's settings
        mine.update({k: rest.pop(k) for k in cls.KEYS if k in rest})
        return cls(**mine, file_settings=from_file), rest

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> dict[str, Any]:
        """The connector's settings given as ``KVTIER_<NAME>`` variables, parsed by the type of
        each setting; ValueError naming the variable for a value of the wrong type."""
        types = {f.name: str(f.type) for f in fields(cls)}
        out: dict[str, Any] = {}
        for key in cls.KEYS:
            var = f"KVTIER_{key.upper()}"
            if var in environ:
                out[key] = _parse_env(var, environ[var], types[key])
        return out


def _parse_env(var: str, raw: str, kind: str) -> Any:
    """``raw`` as the setting's type (its annotation, ``kind``)."""
    try:
        if "Mapping" in kind:
            return json.loads(raw)
        if kind == "bool":
            return parse_env_bool(var, raw)
        if "None" in kind and raw.lower() in ("", "none", "null"):
            return None
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise ValueError(f"{var}: expected {kind.replace(' | None', '')}, got {raw!r}") from None
    return raw


@dataclass(frozen=True)
class Sharding:
    """How one logical chunk is split into shard files, and which of them each tensor-parallel
    rank holds.

    Head shards (``by_heads``, wherever the KV layout allows it): each of the model's
    ``num_shards`` KV heads (MLA: its one latent) is a chunk of its own (``keys.shard_id``), so
    the files of a chunk are the same whatever the tensor-parallel size, and a pool written at
    TP=2 is read at TP=1 and the other way round. A rank holds ``rank_shards`` consecutive heads,
    or, when the model has fewer KV heads than ranks (MLA, small GQA), a replica of one; only
    the first replica of a head writes it to the shared pool.

    Rank shards (``by_heads`` false: a layout whose heads kvtier cannot address): each rank's
    whole KV is one shard, and the namespace names the tensor-parallel size.
    """

    world_size: int = 1
    num_shards: int = 1
    by_heads: bool = True

    def __post_init__(self) -> None:
        if self.num_shards < 1 or (self.world_size % self.num_shards and self.num_shards % self.world_size):
            raise UnsupportedDeployment(f"KV split into {self.num_shards} shards over {self.world_size} ranks")

    @property
    def replicas(self) -> int:
        """Ranks that hold each shard."""
        return max(1, self.world_size // self.num_shards)

    @property
    def rank_shards(self) -> int:
        """Shards each rank holds."""
        return max(1, self.num_shards // self.world_size)

    def shards_of(self, rank: int) -> range:
        if self.num_shards >= self.world_size:
            return range(rank * self.rank_shards, (rank + 1) * self.rank_shards)
        return range(rank // self.replicas, rank // self.replicas + 1)

    def writes_pool(self, rank: int) -> bool:
        return rank % self.replicas == 0


@dataclass(frozen=True)
class Deployment:
    """What vLLM hands kvtier, as seen identically by the scheduler and every worker."""

    block_size: int
    num_layers: int
    layer_block_bytes: int
    """Bytes of one block of one layer on one rank (vLLM's unpadded page size), all its shards."""
    sharding: Sharding
    kv_format: str
    layer_names: tuple[str, ...] = ()
    model_digest: str = ""
    """The content of the model's weights and config (``identity.model_digest``): in every key."""
    weights_digest: str = ""
    """The weights' content alone (described beside the pool, for ``kvtier doctor``)."""
    weights_known: bool = True
    """``identity.weights_identified``: when False the pool is not used (two checkpoints under one
    name would share keys)."""
    dp_rank: int = 0
    dp_size: int = 1
    """This engine's data-parallel index among ``dp_size`` engines (each has its own disk tier)."""

    @property
    def shard_block_bytes(self) -> int:
        """Bytes of one block of one layer of one shard."""
        return self.layer_block_bytes // self.sharding.rank_shards

    @property
    def layout(self) -> KVLayout:
        """One shard's chunk shape for the store: pages as bytes (``[layers, 2, tokens, 1, n]`` uint8)."""
        per_token_bytes, rest = divmod(self.shard_block_bytes, 2 * self.block_size)
        if rest or per_token_bytes == 0 or self.layer_block_bytes % self.sharding.rank_shards:
            raise UnsupportedDeployment(f"a KV page of {self.layer_block_bytes} bytes in {self.sharding.rank_shards} "
                                        f"shard(s) is not a whole number of bytes per token for K and V of "
                                        f"{self.block_size} tokens")
        return KVLayout(self.num_layers, 1, per_token_bytes, torch.uint8)


def disk_path_of_rank(disk_path: str, rank: int, dep: Deployment) -> str:
    """Each tensor-parallel rank of each data-parallel engine has a disk tier directory of its own
    (it holds its lock): two engines of one host never share one, and each engine's scheduler
    looks only in the directories its own workers write."""
    if dep.dp_size > 1:
        disk_path = os.path.join(disk_path, f"dp{dep.dp_rank}-of-{dep.dp_size}")
    world = dep.sharding.world_size
    return disk_path if world == 1 else os.path.join(disk_path, f"tp{rank}-of-{world}")


def deployment(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> Deployment:
    """Check that kvtier can serve this vLLM configuration and describe it; else refuse."""
    transfer = vllm_config.kv_transfer_config
    policy = getattr(transfer, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise UnsupportedDeployment(
            f"kvtier needs kv_load_failure_policy 'recompute' (vLLM's default is 'fail'; this config has "
            f"{policy!r}): a chunk that is damaged or evicted between lookup and load would fail the request. "
            "Add \"kv_load_failure_policy\": \"recompute\" to --kv-transfer-config (kvtier serve sets it).")
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise UnsupportedDeployment("kvtier does not support pipeline_parallel_size > 1 yet (each stage holds "
                                    "other layers); use tensor parallelism, or run without the connector")
    if getattr(pc, "decode_context_parallel_size", 1) > 1:
        raise UnsupportedDeployment("kvtier does not support decode_context_parallel_size > 1 (KV is split by "
                                    "token across ranks); run without it, or without the connector")
    if getattr(pc, "prefill_context_parallel_size", 1) > 1:
        raise UnsupportedDeployment("kvtier does not support prefill_context_parallel_size > 1 (prefill is split "
                                    "by token across ranks that the KV connector does not see); run without it, "
                                    "or without the connector")
    if kv_cache_config is None:
        raise UnsupportedDeployment("vLLM gave the connector no KV cache config (vLLM older than 0.32?)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        raise UnsupportedDeployment(
            f"kvtier supports models with one KV cache group; this model has {len(groups)} ({kinds}): a hybrid "
            "model (sliding window + full attention, or Mamba layers) is not supported yet. Run it without the "
            "connector.")
    spec = groups[0].kv_cache_spec
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # MLA's spec is one too

    if not isinstance(spec, FullAttentionSpec):
        # Sliding-window and chunked-local caches free blocks that leave the window, so a
        # chunk's blocks may no longer hold its KV; Mamba state is not paged by token.
        raise UnsupportedDeployment(f"kvtier supports full-attention KV caches (incl. MLA); this model's is "
                                    f"{type(spec).__name__}. Run it without the connector.")
    check_causal_paged(spec)
    page_bytes = spec.real_page_size_bytes
    tp = pc.tensor_parallel_size
    sharding = sharding_of(vllm_config, spec, tp)
    layout = (getattr(kv_cache_config, "kv_cache_layout", None) or vllm_config.cache_config.kv_cache_layout
              or "unresolved")
    fmt = kv_format(vllm_config, spec, layout, page_bytes // sharding.rank_shards)
    if not sharding.by_heads:
        fmt += f"-tp{tp}"
    from kvtier.identity import identity_digest, model_identity, weights_identified

    dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
    dp_rank = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0) if dp_size > 1 else 0
    identity = model_identity(vllm_config)
    return Deployment(spec.block_size, len(groups[0].layer_names), page_bytes, sharding, fmt,
                      tuple(groups[0].layer_names), identity_digest(identity), identity.get("weights", ""),
                      weights_identified(identity), dp_rank, dp_size)


def sharding_of(vllm_config: VllmConfig, spec: Any, tp: int) -> Sharding:
    """Head shards where each rank's heads are whole KV heads of the model (``Sharding``): MLA's
    latent (one shard all ranks replicate) and plain attention whose per-rank heads divide the
    model's evenly, without per-head quantization scales. Otherwise, rank shards."""
    max_shards = getattr(spec, "max_tp_shards", None)
    if max_shards is not None and max_shards <= 1:  # MLA: the latent KV is the same on every rank
        return Sharding(tp, 1)
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and getattr(quant, "name", str(quant)) != "NONE":
        return Sharding(tp, tp, by_heads=False)
    try:
        total = int(vllm_config.model_config.get_total_num_kv_heads())
    except Exception:  # a model config without the helper: keep the rank-bound split
        return Sharding(tp, tp, by_heads=False)
    rank_heads = getattr(spec, "num_kv_heads", None)
    if total < 1 or rank_heads != max(1, total // tp) or (total % tp and tp % total):
        return Sharding(tp, tp, by_heads=False)
    return Sharding(tp, total)


def check_causal_paged(spec: Any) -> None:
    """Refuse the specs that are full attention in type but not in what their blocks hold.

    A prefix-LM (``non_causal``): a token's KV depends on tokens after it, so a chunk's KV is
    not a function of its prefix (vLLM itself turns prefix caching off for it). R-SWA
    (``RSWASpec``): blocks in the gap between the prompt and the decode window are freed to
    null blocks, so a decode save would publish zeros as KV.
    """
    name = type(spec).__name__
    if getattr(spec, "non_causal", False):
        raise UnsupportedDeployment(f"kvtier cannot serve this model: its attention is non-causal ({name} with "
                                    "non_causal=True, a prefix LM), so cached KV of a prefix is not the KV of "
                                    "that prefix in a longer prompt (vLLM disables its own prefix cache for it). "
                                    "Run it without the connector.")
    if any(cls.__name__ == "RSWASpec" for cls in type(spec).__mro__) or hasattr(spec, "rswa_window"):
        raise UnsupportedDeployment(f"kvtier cannot serve this model: its KV cache ({name}) frees the blocks "
                                    "between the prompt and the decode window, so saved chunks would hold zeros "
                                    "instead of KV. Run it without the connector.")


def kv_format(vllm_config: VllmConfig, spec: Any, layout: str, page_bytes: int) -> str:
    """Names everything that decides a shard page's bytes, so different layouts never share chunks.

    Device type, attention backend (when set), CPU instruction set (the CPU backend's page
    interior depends on it), the resolved KV cache layout, block size, cache dtype and the page's
    element dtype (``auto`` is the model's dtype: bf16 and fp16 pages are the same size), the
    KV quantization mode, the spec's type and the page size of one shard (``page_bytes``).
    """
    device = str(vllm_config.device_config.device_type) if vllm_config.device_config else "unknown"
    cache_dtype = vllm_config.cache_config.cache_dtype
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    backend_name = getattr(backend, "name", None) or (str(backend) if backend else "auto")
    isa = ""
    if device == "cpu":
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = "-" + str(_get_attn_isa(spec.dtype, spec.block_size, spec.head_size, cache_dtype))
        except Exception:  # the helper moved: name the build so others never share these chunks
            import vllm

            isa = f"-unknown-{vllm.__version__}"
    page_dtype = str(getattr(spec, "dtype", "unknown")).removeprefix("torch.")
    quant = getattr(spec, "kv_quant_mode", None)
    quant_name = "" if quant is None or getattr(quant, "name", str(quant)) == "NONE" else \
        f"-q{getattr(quant, 'name', quant)}"
    return (f"vllm-{device}-{backend_name}{isa}-{layout}-bs{spec.block_size}-{cache_dtype}-{page_dtype}{quant_name}"
            f"-{type(spec).__name__}-page{page_bytes}")


_said_unidentified: set[str] = set()


def _unidentified(model: str) -> None:
    if model not in _said_unidentified:
        _said_unidentified.add(model)
        log.error("kvtier: found no weight files of %s (searched the model path, or its snapshot in vLLM's "
                  "--download-dir / the Hugging Face cache): another checkpoint under this name would read its KV, "
                  "so this engine does not use the shared pool (pool_url ignored; host and disk tiers stay). "
                  "Serve the model from a local directory to share it.", model)


def store_config(connector: ConnectorConfig, settings: Mapping[str, Any], vllm_config: VllmConfig,
                 dep: Deployment, rank: int | None) -> StoreConfig:
    """The store of tensor-parallel ``rank`` (its own disk directory; keys in one logical namespace).

    ``rank`` None: the scheduler's view of all ranks (``disk_path`` is the base directory, of which
    ``disk_path_of_rank`` names each rank's)."""
    # Lowest first: the config file (with these defaults), KVTIER_* variables, the extra config.
    base = dict(connector.file_settings)
    if "chunk_tokens" not in base and "chunk_size" not in base:
        base["chunk_tokens"] = max(256, dep.block_size)
    if not any(k in base for k in ("model_id", "model", "model_name")):
        base["model_id"] = vllm_config.model_config.model
    base.setdefault("host_prefault", True)  # first touches off the engine's thread (memory.py)
    # Head shards are the same at any tensor-parallel size: their namespace does not name it.
    world_size = 1 if dep.sharding.by_heads else dep.sharding.world_size
    config = load_settings(base, **settings, layout=dep.layout, rank=0, world_size=world_size,
                           kv_format=dep.kv_format, model_digest=dep.model_digest, weights_digest=dep.weights_digest)
    if not dep.weights_known and config.pool_url is not None:
        _unidentified(vllm_config.model_config.model)
        config = replace(config, pool_url=None)
    if config.chunk_tokens % dep.block_size:
        raise ValueError(f"kvtier setting chunk_tokens: {config.chunk_tokens} is not a multiple of vLLM's block "
                         f"size {dep.block_size}; use e.g. {dep.block_size * max(1, 256 // dep.block_size)}")
    if rank is not None:
        # host_bytes is the engine's total, like vLLM's own offloading sizes: each of the
        # tensor-parallel ranks page-locks its share (not eight times the budget at TP=8).
        config = replace(config, host_bytes=config.host_bytes // dep.sharding.world_size)
        if config.disk_path is not None:
            config = replace(config, disk_path=disk_path_of_rank(config.disk_path, rank, dep))
    return config
