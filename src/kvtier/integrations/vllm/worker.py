"""The connector's worker role: moves KV bytes between vLLM's paged cache and kvtier's store.

Runs beside the KV tensors, one per tensor-parallel rank. It owns that rank's store: host DRAM
(a slab in this process), the rank's own local disk directory, and the shared pool. It stores
the rank's shard of each chunk under the shard's own key (``keys.shard_id``); for KV that every
rank replicates (MLA), only the first rank of each replica group writes it to the pool.

* ``register_kv_caches`` finds each layer's pages from the tensors' shapes and strides
  (``paged.block_runs``) and checks them against the page size vLLM's KV cache config states.
  A layout it cannot handle turns the connector off for this engine with one error line (the
  engine keeps serving, with no hits) instead of crashing or moving wrong bytes.
* Loads are synchronous: ``start_load_kv`` runs before the forward pass and reads the chunks in
  parallel straight into the request's blocks. Chunks that cannot be served are reported
  through ``get_block_ids_with_load_errors`` and vLLM recomputes from there.
* Saves: after each forward pass ``wait_for_save`` gathers every prompt chunk that became
  complete into host DRAM (one copy per page run); disk and pool writes happen in the
  background and never block the engine (a full queue drops and counts).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import torch

from kvtier.config import StoreConfig
from kvtier.integrations.paged import LayoutError, PagedKV
from kvtier.integrations.vllm.common import KVTierMetadata, KVTierWorkerMeta, Transfer, tier_unavailable
from kvtier.integrations.vllm.config import ConnectorConfig, Deployment
from kvtier.keys import shard_id
from kvtier.store import TieredStore

log = logging.getLogger(__name__)

SHARED_TIERS = ("pool", "redis")


class WorkerRole:
    """See the module docstring."""

    def __init__(self, connector: ConnectorConfig, store: StoreConfig, dep: Deployment, rank: int,
                 counters: dict[str, int]) -> None:
        self.connector, self.config, self.dep, self.rank = connector, store, dep, rank
        self.counters = counters
        self.block_size = dep.block_size
        self.chunk_tokens = store.chunk_tokens
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        self.shard = dep.sharding.shard_of(rank)
        # Replicas of a shard (MLA's latent KV on every rank) reach the shared pool once.
        self.skip_tiers: tuple[str, ...] = () if dep.sharding.writes_pool(rank) else SHARED_TIERS
        self.store: TieredStore | None = None
        self.paged: PagedKV | None = None
        self.disabled = False
        self._reported_disabled = False
        self._failed_blocks: set[int] = set()
        self._forward_t0: float | None = None
        self._prefill_samples: list[tuple[int, float]] = []
        self._reads: list[tuple[str, int, float]] = []
        self._tier_order: dict[str, int] = {}

    def _disable(self, why: str) -> None:
        self.disabled = True
        self.counters["disabled"] = 1
        log.error("kvtier: connector disabled on rank %d, the engine serves without cache hits: %s", self.rank, why)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None) -> None:
        """Map vLLM's KV tensors (``num_blocks`` blocks each; None: their first dim) to pages and
        open this rank's store, or disable the connector (see the module docstring)."""
        names = [n for n in self.dep.layer_names if n in kv_caches] or list(kv_caches)
        missing = set(self.dep.layer_names) - set(kv_caches)
        if missing:
            self._disable(f"vLLM registered no KV cache for layers {sorted(missing)[:4]}")
            return
        if num_blocks is None:
            num_blocks = kv_caches[names[0]].shape[0]
        try:
            paged = PagedKV([kv_caches[n] for n in names], num_blocks)
        except LayoutError as exc:
            self._disable(f"KV cache layout not supported: {exc}")
            return
        if set(paged.layer_block_bytes) != {self.dep.layer_block_bytes}:
            self._disable(f"KV pages of {sorted(set(paged.layer_block_bytes))} bytes per block per layer, but vLLM's "
                          f"KV cache config states {self.dep.layer_block_bytes} (layout {self.dep.kv_format})")
            return
        self.paged = paged
        log.info("kvtier: rank %d: %d layers, %d page runs per block, %d bytes per block, %s", self.rank,
                 len(names), len(paged.runs), paged.block_bytes, self.dep.kv_format)
        self.open_store()

    def open_store(self) -> None:
        store = TieredStore(self.config, unavailable=partial(tier_unavailable, self.counters))
        faults = self.connector.inject_faults
        if faults:
            from kvtier.tiers.faulty import FaultyTier

            unknown = set(faults) - {t.name for t in store.tiers}
            if unknown:
                store.close()
                raise ValueError(f"kvtier setting inject_faults: no tier named {sorted(unknown)}; tiers: "
                                 f"{[t.name for t in store.tiers]}")
            store.tiers = [FaultyTier(t, **faults[t.name]) if t.name in faults else t for t in store.tiers]
            log.warning("kvtier: injecting faults into %s (a test setting)", sorted(faults))
        if store.host is not None:
            store.host.track_changes()
        self._tier_order = {t.name: i for i, t in enumerate(store.tiers)}
        self.store = store

    # ---------------------------------------------------------------- each step

    def bind(self, meta: KVTierMetadata) -> None:
        # vLLM binds the metadata before the forward pass and calls wait_for_save after it
        # (start_load_kv comes before the pass only when there are loads): a big step without
        # loads times prefill from here.
        self._forward_t0 = time.perf_counter() if meta.num_tokens >= 4 * self.block_size else None

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        for load in meta.loads:
            self._load(load)
        if meta.loads:
            self._forward_t0 = None  # a step with loads does not time prefill alone

    def _load(self, load: Transfer) -> None:
        bpc = self.blocks_per_chunk
        got = 0
        if self.store is not None and self.paged is not None and not self.disabled:
            paged = self.paged

            def sink(index: int, data: torch.Tensor) -> None:
                paged.scatter(data, load.block_ids[index * bpc:(index + 1) * bpc])

            ids = [shard_id(c, self.shard, self.dep.sharding.num_shards) for c in load.chunk_ids]
            # vLLM's prefix cache keeps what is loaded: no need to promote it into host DRAM too.
            t0 = time.perf_counter()
            result = self.store.load_into(ids, sink, promote=False)
            seconds = time.perf_counter() - t0
            got = result.num_chunks
            if got:
                slowest = max(result.chunk_tiers, key=lambda name: self._tier_order.get(name, 0))
                self._reads.append((slowest, got * self.config.chunk_bytes, seconds))
            log.debug("kvtier: loaded %d of %d chunks of %s in %.1f ms", got, len(ids), load.req_id, seconds * 1e3)
        failed = [b for b in load.block_ids[got * bpc:] if b is not None]
        self.counters["loaded_tokens"] += sum(1 for b in load.block_ids[:got * bpc] if b is not None) * self.block_size
        self.counters["failed_blocks"] += len(failed)
        if failed:
            log.warning("kvtier: %d of %d chunks of %s could not be loaded on rank %d; vLLM recomputes them",
                        len(load.chunk_ids) - got, len(load.chunk_ids), load.req_id, self.rank)
            self._failed_blocks.update(failed)

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        if self._forward_t0 is not None:
            self._prefill_samples.append((meta.num_tokens, time.perf_counter() - self._forward_t0))
            self._forward_t0 = None
        if self.store is None or self.paged is None or self.disabled:
            return
        bpc, paged, sharding = self.blocks_per_chunk, self.paged, self.dep.sharding
        for save in meta.saves:
            for i, cid in enumerate(save.chunk_ids):
                blocks = save.block_ids[i * bpc:(i + 1) * bpc]
                if any(b is None for b in blocks):
                    continue
                self.store.put_chunk(shard_id(cid, self.shard, sharding.num_shards),
                                     lambda buf, blocks=blocks: paged.gather(blocks, buf),  # type: ignore[misc]
                                     skip_tiers=self.skip_tiers)
                self.counters["saved_chunks"] += 1

    def report(self) -> KVTierWorkerMeta | None:
        """This step's report for the scheduler (None when there is nothing to say)."""
        changes = self.store.host.drain_changes() if self.store is not None and self.store.host else []
        disabled = self.disabled and not self._reported_disabled
        if not changes and not self._reads and not self._prefill_samples and not disabled:
            return None
        self._reported_disabled = self.disabled
        reads, self._reads = self._reads, []
        prefill, self._prefill_samples = self._prefill_samples, []
        return KVTierWorkerMeta(host_changes={self.rank: [(added, bytes(key)) for added, key in changes]},
                                reads=reads, prefill=prefill, disabled=[self.rank] if disabled else [])

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def snapshot(self) -> dict[str, Any]:
        return self.store.metrics_snapshot() if self.store is not None else {}

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
