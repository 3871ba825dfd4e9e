"""Host DRAM: a slot cache of chunks in this process, LRU within a byte budget.

It is not a ``Tier``: a tier copies chunks in (``store``) and out (``load``); the host cache
lends its own memory instead. The store reads disk and pool chunks straight into a free slot
(``reserve``, then ``commit`` once validated, or ``abandon``), engines fill a slot in place
(``TieredStore.begin_put``), and readers use a held chunk where it lies (``acquire``). Each
such chunk is pinned by a ``Lease``: eviction never reuses a pinned slot, so nobody ever sees
a slot's bytes change under them. Eviction only drops the in-memory copy: chunks also written
to disk or the pool stay available there.

The slab is allocated once and reused: a read into host DRAM costs no allocation. It is mapped
as transparent huge pages where the kernel has them, and with ``prefault`` its pages are faulted
in by a background thread of the lowest priority (``memory.py``): on a virtual machine a first
touch costs many times a copy, and engines fill slots from their own thread. Like a tier, the
cache has a ``name`` ("host"), ``metrics`` and ``lookup``, so the store's one walk
(``tiers.locate``) finds chunks in it and in the tiers below.

Beside it, ``BufferPool``: the store's recycled aligned buffers for chunks that do not land in a
slot (reads with ``promote=False`` or no free slot, writes that bypass host DRAM).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier import memory
from kvtier.format import PAYLOAD_OFFSET, file_bytes_for
from kvtier.keys import ChunkId, ChunkKey
from kvtier.layout import KVLayout
from kvtier.metrics import TierMetrics
from kvtier.tiers.base import ChangeJournal, Chunk, aligned_buffer


class Lease:
    """A pinned chunk: its memory is not reused until ``release`` (idempotent)."""

    __slots__ = ("_done", "_release", "chunk")

    def __init__(self, chunk: Chunk, release: Callable[[], None] | None = None) -> None:
        self.chunk = chunk
        self._release = release
        self._done = False

    def release(self) -> None:
        if not self._done:
            self._done = True
            if self._release is not None:
                self._release()


@dataclass
class _Slot:
    key: ChunkKey | None = None
    id: ChunkId | None = None
    pins: int = 0


class HostCache:
    """The host DRAM slot cache (module docstring). Thread-safe."""

    name = "host"
    may_hang = False  # in-process memory: lookups never block (for tiers.locate)

    def __init__(self, capacity_bytes: int, layout: KVLayout, chunk_tokens: int, *, prefault: bool = False) -> None:
        self.shape = layout.shape(chunk_tokens)
        self.dtype = layout.dtype
        self.payload_bytes = chunk_tokens * layout.bytes_per_token
        self.slot_bytes = file_bytes_for(self.payload_bytes)
        self.num_slots = capacity_bytes // self.slot_bytes
        self.capacity_bytes = capacity_bytes
        self.metrics = TierMetrics(self.name)
        self._lock = threading.Lock()
        self._slab = memory.slab(self.num_slots * self.slot_bytes)
        if prefault:
            memory.prefault(self._slab)
        self._slots = [_Slot() for _ in range(self.num_slots)]
        self._views: list[torch.Tensor | None] = [None] * self.num_slots
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()
        # (added?, key) in order, kept only once track_changes() was called: an engine
        # integration ships it to another process that mirrors what this tier holds.
        self.journal = ChangeJournal()

    # -- slots ------------------------------------------------------------------------------

    def slot_buffer(self, slot: int) -> np.ndarray:
        """The whole-file-sized, 4096-aligned buffer of ``slot`` (payload at byte 4096)."""
        start = slot * self.slot_bytes
        return self._slab[start:start + self.slot_bytes]

    def pin_memory(self, register: Callable[[np.ndarray], bool]) -> bool:
        """Page-lock the slab with ``register`` (an accelerator's host-register call)."""
        return bool(register(self._slab)) if self._slab.nbytes else True

    def slot_view(self, slot: int) -> torch.Tensor:
        """The payload of a reserved ``slot`` as a chunk tensor, to fill before ``commit``."""
        return self._view(slot)

    def _view(self, slot: int) -> torch.Tensor:
        view = self._views[slot]
        if view is None:
            start = slot * self.slot_bytes + PAYLOAD_OFFSET
            raw = torch.from_numpy(self._slab[start:start + self.payload_bytes])
            view = self._views[slot] = raw.view(self.dtype).view(self.shape)
        return view

    def reserve(self) -> int | None:
        """A slot to fill, evicting the least recently used unpinned chunk if needed.

        None when every slot is pinned. The caller must ``commit`` or ``abandon`` it.
        """
        with self._lock:
            if self._free:
                return self._free.pop()
            for key, slot in self._index.items():
                if self._slots[slot].pins == 0:
                    del self._index[key]
                    self._slots[slot] = _Slot()
                    self.metrics.add(evictions=1, evicted_bytes=self.slot_bytes)
                    self._record(False, key)
                    self._publish_gauges()
                    return slot
            return None

    def abandon(self, slot: int) -> None:
        with self._lock:
            self._slots[slot] = _Slot()
            self._free.append(slot)

    def commit(self, slot: int, cid: ChunkId) -> Lease:
        """Publish a filled slot as chunk ``cid``; returns it pinned.

        If another thread published the same chunk first, ``slot`` goes back to the free list
        and the existing copy is returned instead.
        """
        with self._lock:
            existing = self._index.get(cid.key)
            if existing is not None:
                self._slots[slot] = _Slot()
                self._free.append(slot)
                slot = existing
                self._index.move_to_end(cid.key)
            else:
                self._slots[slot] = _Slot(cid.key, cid)
                self._index[cid.key] = slot
                self._record(True, cid.key)
                self.metrics.add(bytes_written=self.payload_bytes, written_chunks=1)
                self._publish_gauges()
            self._slots[slot].pins += 1
        return Lease(Chunk(cid, self._view(slot)), lambda: self._unpin(slot))

    def refresh(self, cid: ChunkId) -> bool:
        """Whether ``cid`` is held, refreshing its LRU position; not a read (nothing counted)."""
        with self._lock:
            slot = self._index.get(cid.key)
            if slot is None or self._slots[slot].id != cid:
                return False
            self._index.move_to_end(cid.key)
            return True

    def acquire(self, cid: ChunkId) -> Lease | None:
        """Pin and return a held chunk (refreshing its LRU position), or None."""
        with self._lock:
            slot = self._index.get(cid.key)
            if slot is None or self._slots[slot].id != cid:
                return None
            self._index.move_to_end(cid.key)
            self._slots[slot].pins += 1
        self.metrics.add(bytes_read=self.payload_bytes)
        return Lease(Chunk(cid, self._view(slot)), lambda: self._unpin(slot))

    def _unpin(self, slot: int) -> None:
        with self._lock:
            self._slots[slot].pins -= 1

    def _record(self, added: bool, key: ChunkKey) -> None:
        self.journal.record(added, key)

    def track_changes(self) -> None:
        """Start journaling additions and evictions (held chunks first) for ``drain_changes``."""
        with self._lock:
            self.journal.enable(list(self._index))

    def drain_changes(self) -> list[tuple[bool, ChunkKey]]:
        """``(added, key)`` events since the last call, oldest first (empty unless tracking)."""
        return self.journal.drain()  # type: ignore[return-value]

    def _publish_gauges(self) -> None:
        self.metrics.set(chunks=len(self._index), bytes=len(self._index) * self.slot_bytes)

    # -- lookup and read ---------------------------------------------------------------------

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        """How many of ``ids``, from the first on, are held (stops at the first miss)."""
        with self._lock:
            n = 0
            for cid in ids:
                slot = self._index.get(cid.key)
                if slot is None or self._slots[slot].id != cid:
                    break
                n += 1
            return n

    def evict(self, target_bytes: int) -> int:
        """Drop least recently used unpinned chunks until at most ``target_bytes`` are held; count them."""
        n = 0
        with self._lock:
            for key in list(self._index):
                if len(self._index) * self.slot_bytes <= target_bytes:
                    break
                slot = self._index[key]
                if self._slots[slot].pins:
                    continue
                del self._index[key]
                self._slots[slot] = _Slot()
                self._free.append(slot)
                self.metrics.add(evictions=1, evicted_bytes=self.slot_bytes)
                self._record(False, key)
                n += 1
            self._publish_gauges()
        return n

    def keys(self) -> list[ChunkKey]:
        """Held keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def close(self) -> None:
        """Drop every chunk (journaled as removals)."""
        with self._lock:
            for key in self._index:
                self.journal.record(False, key)
            self._index.clear()
            self._slots = [_Slot() for _ in range(self.num_slots)]
            self._free = list(range(self.num_slots - 1, -1, -1))


class BufferPool:
    """Recycled aligned chunk-file buffers (``nbytes`` each, at most ``max_free`` kept) for chunks
    that do not land in a host DRAM slot. Thread-safe."""

    def __init__(self, nbytes: int, max_free: int) -> None:
        self.nbytes = nbytes
        self.max_free = max_free
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.register: Callable[[np.ndarray], bool] | None = None  # page-locks new buffers (pin_host_memory)

    def take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        buf = aligned_buffer(self.nbytes)
        if self.register is not None:
            self.register(buf)
        return buf

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self.max_free:
                self._free.append(buf)
