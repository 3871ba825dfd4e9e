"""Local disk tier: one file per chunk, LRU within a byte budget, survives restarts.

One process owns a disk directory at a time (an exclusive ``flock`` on ``ROOT/.lock``): the
LRU index lives in this process's memory. At open, the directory is scanned and the index is
rebuilt in mtime order (a hit refreshes a chunk's mtime), so a restarted process serves what
an earlier one wrote and evicts down to its budget at once. Directories shared by several
processes or machines are what the pool tier is for.

A retained chunk (``retain``: kept for a session until a time) is evicted only when no
unretained chunk is left, or once its time has passed; its file's mtime is that time, so a
restarted process keeps it too.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvtier.errors import TierUnavailableError
from kvtier.format import ChunkSpec
from kvtier.keys import ChunkId, ChunkKey
from kvtier.metrics import TierMetrics
from kvtier.tiers.base import ChangeJournal, Chunk, LoadResult, Pages, Status, StoreResult, TierBase, leading_held
from kvtier.tiers.files import ChunkFiles

TOUCH_INTERVAL_S = 60.0


class DiskTier(TierBase):
    name = "disk"
    reads_in_place = True

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *, fsync: bool = False,
                 direct_io: bool = True, group_access: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.metrics = TierMetrics(self.name)
        self.files = ChunkFiles(path, fsync=fsync, direct_io=direct_io, group_access=group_access)
        try:
            self._lock_fd = self.files.create_file(self.files.root / ".lock", os.O_RDWR)
        except OSError as exc:  # a symlink planted as .lock, a read-only directory
            raise TierUnavailableError(f"cannot use {self.files.root / '.lock'} as the disk tier's lock file: "
                                       f"{exc.strerror or exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise TierUnavailableError(
                f"disk tier {self.files.root} is in use by another process; give each engine "
                "instance its own disk_path (share data between instances with pool_url)"
            ) from None
        self._lock = threading.Lock()
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()
        self._retained: dict[ChunkKey, float] = {}  # key -> until (epoch s); also its file's mtime
        self._bytes = 0
        self.journal: ChangeJournal = ChangeJournal()
        self._recover()

    def _recover(self) -> None:
        found = sorted(self.files.scan(), key=lambda f: f.mtime)
        now = time.time()
        for f in found:
            self._index[f.key] = f.size
            self._bytes += f.size
            if f.mtime > now:  # retained before a restart (sorted last, so evicted last)
                self._retained[f.key] = f.mtime
        self.evict(self.capacity_bytes)
        self._publish_gauges()

    def _publish_gauges(self) -> None:
        self.metrics.set(chunks=len(self._index), bytes=self._bytes)

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        with self._lock:
            return leading_held(ids, self._index)

    def load(self, chunk: ChunkId, spec: ChunkSpec, into: np.ndarray | None = None, *,
             pages: Pages | None = None) -> LoadResult:
        with self._lock:
            if chunk.key not in self._index:
                return LoadResult(Status.MISS)
        result = self.files.load(chunk, spec, into, self.metrics, TOUCH_INTERVAL_S, pages)
        with self._lock:
            if result.ok and chunk.key in self._index:
                self._index.move_to_end(chunk.key)
        if result.status in (Status.MISS, Status.CORRUPT):
            # Deleted behind our back (an operator, a full-disk cleanup) or removed as bad.
            self._forget(chunk.key)
        return result

    def time_read(self, chunk: ChunkId, max_bytes: int) -> tuple[int, float] | None:
        return self.files.time_read(chunk.key, max_bytes)

    def store(self, chunk: Chunk, spec: ChunkSpec) -> StoreResult:
        with self._lock:
            if chunk.id.key in self._index:
                self._index.move_to_end(chunk.id.key)
                return StoreResult(Status.EXISTS)
        if spec.file_bytes > self.capacity_bytes:
            return StoreResult(Status.FAILED, "chunk larger than disk_bytes")
        try:
            written = self.files.publish(chunk, spec)
        except OSError as exc:
            self.metrics.add(failed_writes=1)
            return StoreResult(Status.FAILED, str(exc))
        # A coded chunk's file is smaller than spec.file_bytes: the budget counts what is on disk.
        size = written or self.files.stat_size(chunk.id.key) or spec.file_bytes
        with self._lock:
            if chunk.id.key not in self._index:
                self._index[chunk.id.key] = size
                self._bytes += size
        self.metrics.add(bytes_written=written, written_chunks=1 if written else 0)
        self.evict(self.capacity_bytes)
        return StoreResult(Status.WRITTEN if written else Status.EXISTS)

    def retain(self, key: ChunkKey, until: float) -> bool:
        """Evict the chunk only after every unretained one, until ``until`` (epoch seconds)."""
        with self._lock:
            if key not in self._index:
                return False
            self._retained[key] = max(until, self._retained.get(key, 0.0))
        return self.files.retain(key, until)  # a restarted process finds it retained too

    def describe_namespace(self, digest: bytes, info: dict[str, object]) -> None:
        self.files.describe_namespace(digest, info)

    def _pop_victim(self) -> tuple[ChunkKey, int]:
        """The least recently used chunk that is not retained (else the oldest retained). Locked."""
        now = time.time()
        for key in self._index:
            until = self._retained.get(key)
            if until is None or until <= now:
                self._retained.pop(key, None)
                return key, self._index.pop(key)
        key, size = self._index.popitem(last=False)
        self._retained.pop(key, None)
        return key, size

    def evict(self, target_bytes: int) -> int:
        n = 0
        while True:
            with self._lock:
                if self._bytes <= target_bytes or not self._index:
                    break
                key, size = self._pop_victim()
                self._bytes -= size
            self.journal.record(False, key)
            self.files.remove(key)
            self.metrics.add(evictions=1, evicted_bytes=size)
            n += 1
        self._publish_gauges()
        return n

    def _forget(self, key: ChunkKey) -> None:
        with self._lock:
            self._retained.pop(key, None)
            size = self._index.pop(key, None)
            if size is not None:
                self.journal.record(False, key)
            if size is not None:
                self._bytes -= size
        self._publish_gauges()

    def keys(self) -> list[ChunkKey]:
        """Held keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
