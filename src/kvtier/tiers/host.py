"""Host DRAM tier: chunks kept as tensors in this process, LRU within a byte budget.

Eviction only drops the in-memory copy: chunks also written to disk or the pool (the store
queues that write when the chunk enters this tier) stay available there.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.format import ChunkSpec
from kvtier.keys import ChunkId, ChunkKey
from kvtier.metrics import TierMetrics
from kvtier.tiers.base import Chunk, LoadResult, Status, StoreResult


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.metrics = TierMetrics(self.name)
        self._lock = threading.Lock()
        self._chunks: OrderedDict[ChunkKey, Chunk] = OrderedDict()
        self._bytes = 0

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        with self._lock:
            n = 0
            for cid in ids:
                held = self._chunks.get(cid.key)
                if held is None or held.id != cid:
                    break
                n += 1
            return n

    def load(self, chunk: ChunkId, spec: ChunkSpec) -> LoadResult:
        with self._lock:
            held = self._chunks.get(chunk.key)
            if held is None or held.id != chunk:
                return LoadResult(Status.MISS)
            self._chunks.move_to_end(chunk.key)
        self.metrics.add(bytes_read=held.nbytes)
        return LoadResult(Status.HIT, held)

    def store(self, chunk: Chunk, spec: ChunkSpec) -> StoreResult:
        nbytes = chunk.nbytes
        if nbytes > self.capacity_bytes:
            return StoreResult(Status.FAILED, f"chunk of {nbytes} B exceeds host_bytes")
        with self._lock:
            if chunk.id.key in self._chunks:
                self._chunks.move_to_end(chunk.id.key)
                return StoreResult(Status.EXISTS)
            self._chunks[chunk.id.key] = chunk
            self._bytes += nbytes
            self._evict_locked(self.capacity_bytes)
            self.metrics.set(chunks=len(self._chunks), bytes=self._bytes)
        self.metrics.add(bytes_written=nbytes, written_chunks=1)
        return StoreResult(Status.WRITTEN)

    def evict(self, target_bytes: int) -> int:
        with self._lock:
            n = self._evict_locked(target_bytes)
            self.metrics.set(chunks=len(self._chunks), bytes=self._bytes)
            return n

    def _evict_locked(self, target_bytes: int) -> int:
        n = 0
        while self._bytes > target_bytes and self._chunks:
            _, old = self._chunks.popitem(last=False)
            self._bytes -= old.nbytes
            self.metrics.add(evictions=1, evicted_bytes=old.nbytes)
            n += 1
        return n

    def keys(self) -> list[ChunkKey]:
        """Held keys, least recently used first."""
        with self._lock:
            return list(self._chunks)

    def close(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._bytes = 0
