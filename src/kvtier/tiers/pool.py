"""Shared pool tier (``fs://PATH``): one chunk directory used by many processes and machines.

Correctness across instances comes from the file format and naming, not from locks:
chunks are published atomically under content-addressed names, every read is validated, a
chunk deleted between lookup and read is a counted miss, and unlinking a file never breaks a
reader that already opened it (POSIX; NFS keeps it alive by silly-rename).

The byte budget holds across all instances by cooperative accounting under ``ROOT/.lock``
(``flock``; on Linux NFS clients this maps to NFS byte-range locks):

* ``ROOT/.usage`` holds the pool's total bytes as last agreed.
* Each instance adds the bytes it published to that total every ``sync_bytes`` (so the lock
  is taken once per many chunks, not per chunk).
* Whoever finds the total over budget scans the pool under the lock and unlinks the least
  recently used chunks (oldest mtime; a hit refreshes mtime at most once a minute) until the
  pool is at ``low_watermark`` of its budget, then writes the exact total back.

The pool can overshoot its budget by at most ``instances x sync_bytes`` between syncs.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from kvtier.errors import TierUnavailableError
from kvtier.format import ChunkSpec
from kvtier.keys import ChunkId
from kvtier.metrics import TierMetrics
from kvtier.tiers.base import Chunk, LoadResult, Status, StoreResult
from kvtier.tiers.files import ChunkFiles

TOUCH_INTERVAL_S = 60.0
LOW_WATERMARK = 0.9
RESCAN_INTERVAL_S = 600.0


def parse_pool_url(url: str) -> str:
    """``fs:///abs/path`` or ``fs://rel/path`` or a bare path -> the directory path."""
    if url.startswith("fs://"):
        path = url[len("fs://"):]
    elif "://" in url:
        scheme = url.split("://", 1)[0]
        raise ValueError(f"pool_url scheme {scheme!r} is not supported; use fs:///path/to/pool or "
                         "redis://host:6379/0 (also rediss://, valkey://)")
    else:
        path = url
    if not path:
        raise ValueError("pool_url has no path; use fs:///path/to/pool")
    return path


class PoolTier:
    name = "pool"
    may_hang = True  # a network filesystem: lookups are timed (tiers/guard.py)

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int | None, *,
                 fsync: bool = False, direct_io: bool = True, sync_bytes: int | None = None,
                 group_access: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.metrics = TierMetrics(self.name)
        self.files = ChunkFiles(path, fsync=fsync, direct_io=direct_io, group_access=group_access)
        try:
            # Created here with the directory's file mode (group members must open it too);
            # a symlink planted in its place is refused, never followed.
            os.close(self.files.create_file(self.files.root / ".lock", os.O_RDWR))
        except OSError as exc:
            raise TierUnavailableError(f"cannot use {self.files.root / '.lock'} as the pool's lock file: "
                                       f"{exc.strerror or exc}") from exc
        if sync_bytes is None:
            sync_bytes = 64 << 20 if capacity_bytes is None else max(1 << 20, min(256 << 20, capacity_bytes // 32))
        self.sync_bytes = sync_bytes
        self._lock = threading.Lock()
        self._pending = 0
        self._known_total = 0

    # -- protocol ---------------------------------------------------------------------------

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        return self.files.leading_present(ids)

    def load(self, chunk: ChunkId, spec: ChunkSpec, into: np.ndarray | None = None) -> LoadResult:
        # A corrupt chunk is useless to every instance: load removes it for all of them.
        return self.files.load(chunk, spec, into, self.metrics, TOUCH_INTERVAL_S)

    def store(self, chunk: Chunk, spec: ChunkSpec) -> StoreResult:
        try:
            written = self.files.publish(chunk, spec)
        except OSError as exc:
            self.metrics.add(failed_writes=1)
            return StoreResult(Status.FAILED, str(exc))
        if not written:
            return StoreResult(Status.EXISTS)
        self.metrics.add(bytes_written=written, written_chunks=1)
        with self._lock:
            self._pending += written
            due = self._pending >= self.sync_bytes or (
                self.capacity_bytes is not None
                and self._known_total + self._pending > self.capacity_bytes)
        if due:
            try:
                self.sync()
            except OSError as exc:
                self.metrics.add(failed_writes=1)
                return StoreResult(Status.WRITTEN, f"budget sync failed: {exc}")
        return StoreResult(Status.WRITTEN)

    def evict(self, target_bytes: int) -> int:
        with self._shared_lock():
            total, n = self._evict_locked(target_bytes)
            self._write_usage(total, time.time())
        return n

    def close(self) -> None:
        try:
            self.sync()
        except OSError:
            pass

    # -- cooperative budget -----------------------------------------------------------------

    def sync(self) -> int:
        """Add our published bytes to the shared total; evict if over budget. Returns total."""
        with self._lock:
            pending, self._pending = self._pending, 0
        with self._shared_lock():
            now = time.time()
            usage = self._read_usage()
            if usage is None or now - usage[1] > RESCAN_INTERVAL_S:
                # Missing or old: recount, which also corrects drift from gc or manual deletes.
                total, scanned_at = self._scan_total(), now
            else:
                total, scanned_at = usage[0] + pending, usage[1]
            if self.capacity_bytes is not None and total > self.capacity_bytes:
                total, _ = self._evict_locked(int(self.capacity_bytes * LOW_WATERMARK))
                scanned_at = now
            self._write_usage(total, scanned_at)
        with self._lock:
            self._known_total = total
        self.metrics.set(bytes=total)
        return total

    def _evict_locked(self, target_bytes: int) -> tuple[int, int]:
        found = sorted(self.files.scan(), key=lambda f: f.mtime)
        total = sum(f.size for f in found)
        n = 0
        for f in found:
            if total <= target_bytes:
                break
            try:
                os.unlink(f.path)
            except FileNotFoundError:
                pass  # another gc got there first; its bytes are gone all the same
            total -= f.size
            n += 1
            self.metrics.add(evictions=1, evicted_bytes=f.size)
        self.metrics.set(chunks=len(found) - n, bytes=total)
        return total, n

    def _scan_total(self) -> int:
        return sum(f.size for f in self.files.scan())

    @contextmanager
    def _shared_lock(self) -> Iterator[None]:
        # O_NOFOLLOW: a symlink swapped in for .lock after open is refused (OSError), not followed.
        fd = os.open(self.files.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, self.files.file_mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def _read_usage(self) -> tuple[int, float] | None:
        """(bytes, time of the last exact scan), or None when missing or unreadable."""
        try:
            data = json.loads((self.files.root / ".usage").read_text())
            return int(data["bytes"]), float(data["scanned_at"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write_usage(self, total: int, scanned_at: float) -> None:
        self.files.write_small(self.files.root / ".usage",
                               json.dumps({"bytes": total, "scanned_at": scanned_at}).encode())
