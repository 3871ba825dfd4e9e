"""``KVTierHiCacheStorage``: kvtier's disk tier and shared pool as SGLang HiCache's L3 storage.

Contracts (sglang 0.5.23's ``HiCacheStorage``, as its ``HiCacheController`` calls it):

* Failures are returned, never raised: a page that is missing, corrupt, truncated, of another
  namespace or slower than ``read_timeout_s`` is a miss (``False`` / ``None`` / a shorter
  count), and a write that did not land is ``False``. Wrong bytes never reach the host pool:
  every page is checked (header, identity, layout, payload checksum) before it is copied.
* ``batch_exists`` is the number of leading keys held (file-system metadata only);
  ``batch_get_v1`` / ``batch_get`` read the leading run of pages through ``load_into`` (in parallel,
  ``io_threads`` per tier, once reads are slow) straight into the host pool; a page after the
  first miss is reported ``False``.
* ``batch_set_v1`` / ``batch_set`` write a batch's pages in parallel (``io_threads``) to every
  tier while SGLang's backup thread waits, returning only once the pages are there: nothing is
  queued or dropped, and a slow pool slows the backup instead of losing pages. A page already
  held is not rewritten. Page copies run on NumPy, not torch (``copy_page``).
* Each TP rank answers for its own shard of a page (MLA: the one shared page), and the
  controller takes the minimum across ranks; ranks that are not storage writers (MLA ranks
  other than the first) write nothing and report success.

Not implemented: the v2 interface (``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``,
hybrid models' sidecar pools), which SGLang's base class answers with NotImplementedError,
and ``clear`` (a shared pool is not one engine's to wipe: ``kvtier pool gc``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvtier.integrations.sglang.pages import BackendSettings, PageGeometry, Parallel, page_chunk_id, store_config
from kvtier.keys import ChunkId
from kvtier.store import TieredStore
from kvtier.threads import Failures, executor

log = logging.getLogger(__name__)

_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_page(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for two CPU tensors of one shape and element size, on the calling thread.

    Not ``dst.copy_(src)``: torch opens an OpenMP parallel region for a copy this large, and
    from ``io_threads`` callers at once on a busy host each region's team spins waiting for
    threads that are not scheduled (measured on 2 cores: 1-4 ms of CPU per 1 MiB page instead
    of ~0.15 ms; the backend's write ran at 0.35x the raw device). NumPy copies the same bytes
    (any strides) on one thread with the GIL released.
    """
    width = _SAME_WIDTH.get(src.element_size())
    if width is None or dst.element_size() != src.element_size() or dst.device.type != "cpu" \
            or src.device.type != "cpu" or dst.shape != src.shape:
        dst.copy_(src)
        return
    np.copyto(dst.view(width).numpy(), src.view(width).numpy(), casting="no")


class KVTierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang HiCache L3 storage on kvtier's tiers below host DRAM (module docstring).

    Built by SGLang's ``StorageBackendFactory`` as ``cls(storage_config, kwargs)``; the store
    opens in ``register_mem_pool_host``, when the page geometry is known. Until then every
    call misses. Raises ValueError at construction on bad settings.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None,
                 mem_pool_host: Any = None) -> None:
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra(storage_config.extra_config)
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError("kvtier: tp_lcm_size head splitting (page_head layout) is not supported")
        self.parallel = Parallel.of(storage_config)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.store: TieredStore | None = None
        self.geometry: PageGeometry | None = None
        self.failures = Failures()
        self._stats_lock = threading.Lock()
        self._stats: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                               "backup_bandwidth": []}
        self._metrics_server: Any = None
        if mem_pool_host is not None:
            self.register_mem_pool_host(mem_pool_host)

    # -- set-up -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.store is not None:
            return
        self.geometry = PageGeometry.of(mem_pool_host)
        config = store_config(self.settings, self.geometry, self.parallel, self.storage_config.model_name)
        self.store = TieredStore(config)
        geometry = self.geometry.kv_geometry()
        if geometry is not None:
            self.store.set_codec_geometry(geometry)
        self.failures = Failures(self.store.store_metrics)
        self._writers = executor(config.io_threads, "kvtier-sglang-write")
        if not self.store.tiers:
            log.warning("kvtier: no disk_path or pool_url given: SGLang's L3 storage holds nothing")
        log.info("kvtier HiCache storage (TP rank %d of %d): %s", self.parallel.tp_rank, self.parallel.tp_size,
                 config)
        if self.settings.metrics_port is not None:
            from prometheus_client import start_http_server

            port = self.settings.metrics_port + self.parallel.tp_rank
            self._metrics_server, _ = start_http_server(port, registry=self.store.registry)

    def _ids(self, keys: Sequence[Any]) -> list[ChunkId]:
        """Identities of the leading keys that are valid page names."""
        assert self.store is not None
        digest = self.store.namespace.digest
        ids: list[ChunkId] = []
        for key in keys:
            cid = page_chunk_id(digest, key)
            if cid is None:
                break
            ids.append(cid)
        return ids

    def _offsets(self, host_indices: Any, n: int) -> list[int] | None:
        """The host pool offset of each of ``n`` pages, or None when ``host_indices`` does not fit."""
        page = self.geometry.page_size if self.geometry is not None else 0
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1 or host_indices.numel() != n * page:
            return None
        return [int(i) for i in host_indices[::page].tolist()] if n else []

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if not self.storage_config.enable_storage_metrics or pages == 0:
            return
        assert self.geometry is not None
        with self._stats_lock:
            self._stats[f"{kind}_pgs"].append(pages)
            self._stats[f"{kind}_bandwidth"].append(pages * self.geometry.page_bytes / max(seconds, 1e-9) / 1e9)

    # -- the interface --------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if self.store is None:
            return 0
        try:
            return self.store.lookup_ids(self._ids(keys)).num_chunks
        except Exception:
            self.failures.record("the SGLang backend's batch_exists")
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _load(self, keys: Sequence[Any], sink: Callable[[int, torch.Tensor], None]) -> int:
        """Deliver the leading run of ``keys`` to ``sink(i, page)``; the number delivered."""
        if self.store is None:
            return 0
        start = time.perf_counter()
        try:
            loaded = self.store.load_into(self._ids(keys), sink, promote=False).num_chunks
        except Exception:
            self.failures.record("the SGLang backend's read")
            return 0
        self._record("prefetch", loaded, time.perf_counter() - start)
        return loaded

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        offsets = self._offsets(host_indices, len(keys))
        if offsets is None or self.store is None:
            return [False] * len(keys)
        host = self.mem_pool_host
        pool = getattr(host, "kv_buffer", None)
        pool_ptr = pool.untyped_storage().data_ptr() if isinstance(pool, torch.Tensor) else None

        def into_host(i: int, page: torch.Tensor) -> None:
            dst = host.get_data_page(offsets[i], flat=False)
            if dst.untyped_storage().data_ptr() == pool_ptr and dst.numel() == page.numel():
                copy_page(dst, page.reshape(dst.shape))  # the page is a view of the pool: filled in place
            else:
                host.set_from_flat_data_page(offsets[i], page.reshape(-1))

        loaded = self._load(keys, into_host)
        return [i < loaded for i in range(len(keys))]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets = list(target_locations) if target_locations is not None else []
        if len(targets) != len(keys) or self.geometry is None:
            return [None] * len(keys)
        want = self.geometry.page_bytes
        ok = [isinstance(t, torch.Tensor) and t.is_contiguous() and t.numel() * t.element_size() == want
              for t in targets]
        n = ok.index(False) if False in ok else len(keys)

        def into_target(i: int, page: torch.Tensor) -> None:
            copy_page(targets[i].view(-1).view(torch.uint8), page.reshape(-1).view(torch.uint8))

        loaded = self._load(keys[:n], into_target)
        return [targets[i] if i < loaded else None for i in range(len(keys))]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        if target_location is None and self.mem_pool_host is not None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        return self.batch_get([key], [target_location])[0]

    def _save(self, keys: Sequence[Any], fills: Sequence[Callable[[torch.Tensor], None]]) -> list[bool]:
        if self.store is None:
            return [False] * len(keys)
        if not self.is_writer:
            return [True] * len(keys)  # another rank writes this (MLA) page
        ids = self._ids(keys)
        start = time.perf_counter()
        out = [False] * len(keys)
        store = self.store

        def write(i: int) -> None:
            try:
                out[i] = store.put_chunk_now(ids[i], fills[i])
            except Exception:
                self.failures.record("the SGLang backend's write")

        # A batch's pages are written in parallel (io_threads at once), like its reads.
        try:
            list(self._writers.map(write, range(len(ids))))
        except RuntimeError:  # closed
            return [False] * len(keys)
        self._record("backup", sum(out), time.perf_counter() - start)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        offsets = self._offsets(host_indices, len(keys))
        if offsets is None or self.store is None:
            return [False] * len(keys)
        host = self.mem_pool_host

        def page_fill(offset: int) -> Callable[[torch.Tensor], None]:
            def fill(buffer: torch.Tensor) -> None:
                page = host.get_data_page(offset, flat=False)
                copy_page(buffer.view(-1).view(page.dtype).view(page.shape), page)
            return fill

        return self._save(keys, [page_fill(o) for o in offsets])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        values = list(values) if values is not None else []
        if len(values) != len(keys) or self.geometry is None:
            return False
        want = self.geometry.page_bytes
        if not all(isinstance(v, torch.Tensor) and v.numel() * v.element_size() == want for v in values):
            return False

        def value_fill(value: torch.Tensor) -> Callable[[torch.Tensor], None]:
            def fill(buffer: torch.Tensor) -> None:
                copy_page(buffer.view(-1).view(torch.uint8), value.contiguous().reshape(-1).view(torch.uint8))
            return fill

        return all(self._save(keys, [value_fill(v) for v in values]))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def clear(self) -> bool:
        log.warning("kvtier: clear() ignored: the pool is shared; evict with `kvtier pool gc`")
        return False

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the pages moved since the last call (None when SGLang's
        storage metrics are off); kvtier's own counters are on ``metrics_port``."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._stats_lock:
            stats, self._stats = self._stats, {k: [] for k in self._stats}
        return StorageMetrics(**stats)

    def metrics_snapshot(self) -> dict[str, Any]:
        """kvtier's counters (``TieredStore.metrics_snapshot``); empty before the store opened."""
        return self.store.metrics_snapshot() if self.store is not None else {}

    def close(self) -> None:
        """Flush and close the store; idempotent."""
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
        if self.store is not None:
            self._writers.shutdown(wait=True)
            self.store.close()
