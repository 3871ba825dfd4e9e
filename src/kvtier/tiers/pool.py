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

Retention (``retain``): a chunk kept for a session until a time gets that time as its mtime.
LRU order then evicts every unretained chunk before it, across instances and by ``kvtier pool
gc`` alike, and once the time has passed it ages like any chunk used then. (Setting a file's
times needs its owner: in a group-shared pool a chunk another user wrote keeps its mtime.)

Every eviction (by any instance, or gc) appends the chunk's key to ``ROOT/.evicted``, so that
each instance can tell routers that a chunk it announced is gone (``read_evictions``).

The pool's own files (``.lock``, ``.usage``, ``.evicted``) are as untrusted as its chunks in a
group-shared pool: each is opened without following a symlink or blocking on a FIFO, must be a
regular file, and is read only up to a fixed size (``fileio.read_small``). A filesystem that
cannot ``flock`` (ENOLCK on an NFS mount without lockd, a FUSE daemon without locks), or a lock
file a neighbour replaced, does not stop the budget: it is kept without the lock (concurrent
evictors are harmless; the overshoot bound may then be exceeded), warned about once and
counted in ``lock_failures``; and the bytes a failed sync was adding are kept for the next.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from kvtier.errors import TierUnavailableError
from kvtier.fileio import open_regular, read_small
from kvtier.format import ChunkSpec
from kvtier.keys import ChunkId, ChunkKey
from kvtier.metrics import TierMetrics
from kvtier.tiers.base import ChangeJournal, Chunk, LoadResult, Status, StoreResult, TierBase
from kvtier.tiers.files import ChunkFiles

log = logging.getLogger(__name__)

TOUCH_INTERVAL_S = 60.0
EVICTION_LOG = ".evicted"
EVICTION_LOG_MAX_BYTES = 8 << 20  # then it starts over (a reader behind by that much misses lines)
EVICTION_READ_MAX_BYTES = 1 << 20  # read per read_evictions call: a longer backlog is read over several
USAGE_MAX_BYTES = 4096
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


class PoolTier(TierBase):
    name = "pool"
    may_hang = True  # a network filesystem: lookups are timed (tiers/guard.py)

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int | None, *,
                 fsync: bool = False, direct_io: bool = True, sync_bytes: int | None = None,
                 group_access: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.metrics = TierMetrics(self.name)
        self.files = ChunkFiles(path, fsync=fsync, direct_io=direct_io, group_access=group_access)
        self._lock_warned = False
        try:
            # Created here with the directory's file mode (group members must open it too);
            # a symlink planted in its place is refused, never followed, and (like a FIFO
            # there) costs only the lock: the probe below warns and counts it.
            os.close(self.files.create_file(self.files.root / ".lock", os.O_RDWR | os.O_NONBLOCK))
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise TierUnavailableError(f"cannot use {self.files.root / '.lock'} as the pool's lock file: "
                                           f"{exc.strerror or exc}") from exc
        self.lock_works = self._probe_lock()
        if sync_bytes is None:
            sync_bytes = 64 << 20 if capacity_bytes is None else max(1 << 20, min(256 << 20, capacity_bytes // 32))
        self.sync_bytes = sync_bytes
        self._lock = threading.Lock()
        self._pending = 0
        self._known_total = 0
        self.journal: ChangeJournal = ChangeJournal()
        self._log_pos: tuple[int, int] | None = None  # (inode, offset) read so far in ROOT/.evicted

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
        self.journal.record(True, chunk.id.key)
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

    def retain(self, key: ChunkKey, until: float) -> bool:
        """Keep the chunk ahead of unretained ones until ``until`` (epoch seconds): its mtime.
        False when it is not there, or its mtime could not be set (another user's file)."""
        return self.files.retain(key, until)

    def describe_namespace(self, digest: bytes, info: dict[str, object]) -> None:
        self.files.describe_namespace(digest, info)

    def read_evictions(self) -> list[bytes]:
        """Keys evicted from the pool (by anyone) since the last call; the first call starts
        at the log's end."""
        path = self.files.root / EVICTION_LOG
        try:
            st = os.stat(path, follow_symlinks=False)
            if self._log_pos is None or self._log_pos[0] != st.st_ino or self._log_pos[1] > st.st_size:
                start = st.st_size if self._log_pos is None else 0  # new: from the end; rotated: all
            else:
                start = self._log_pos[1]
            data, st = read_small(path, EVICTION_READ_MAX_BYTES, start)
        except FileNotFoundError:
            self._log_pos = (0, 0)
            return []
        except OSError:  # a symlink, FIFO or device planted there: never followed, never waited on
            return []
        end = data.rfind(b"\n") + 1  # a line being appended is read next time
        self._log_pos = (st.st_ino, start + end)
        keys = []
        for line in data[:end].split():
            try:
                keys.append(bytes.fromhex(line.decode()))
            except ValueError:
                continue
        return keys

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
        try:
            total = self._sync_locked(pending)
        except BaseException:
            with self._lock:
                self._pending += pending  # not lost: the next sync adds them
            raise
        with self._lock:
            self._known_total = total
        self.metrics.set(bytes=total)
        return total

    def _sync_locked(self, pending: int) -> int:
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
        return total

    def _evict_locked(self, target_bytes: int) -> tuple[int, int]:
        found = sorted(self.files.scan(), key=lambda f: f.mtime)  # retained chunks: mtime in the future
        total = sum(f.size for f in found)
        n = 0
        evicted: list[bytes] = []
        for f in found:
            if total <= target_bytes:
                break
            try:
                os.unlink(f.path)
                evicted.append(f.key)
                self.journal.record(False, f.key)
            except FileNotFoundError:
                pass  # another gc got there first; its bytes are gone all the same
            total -= f.size
            n += 1
            self.metrics.add(evictions=1, evicted_bytes=f.size)
        self.metrics.set(chunks=len(found) - n, bytes=total)
        if evicted:
            self._log_evictions(evicted)
        return total, n

    def _log_evictions(self, keys: list[bytes]) -> None:
        """Append to ROOT/.evicted (under the pool lock); start it over past its size limit."""
        path = self.files.root / EVICTION_LOG
        try:
            st = os.lstat(path)
            if st.st_size > EVICTION_LOG_MAX_BYTES or not stat.S_ISREG(st.st_mode):
                os.unlink(path)  # readers notice the new inode and read the new file from its start
        except FileNotFoundError:
            pass
        except OSError:
            return
        try:
            # O_NONBLOCK: a FIFO planted between the lstat and the open fails (ENXIO), never blocks.
            fd = self.files.create_file(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.write(fd, b"".join(k.hex().encode() + b"\n" for k in keys))
            finally:
                os.close(fd)
        except OSError:
            pass  # the log only feeds KV events; an eviction never fails for it

    def _scan_total(self) -> int:
        return sum(f.size for f in self.files.scan())

    def _open_lock(self) -> int:
        # A symlink or FIFO swapped in for .lock is refused (OSError), never followed or waited on.
        return open_regular(self.files.root / ".lock", os.O_RDWR | os.O_CREAT, self.files.file_mode)

    def _probe_lock(self) -> bool:
        """Whether ``flock`` works on the lock file (a held lock counts as working)."""
        try:
            fd = self._open_lock()
        except OSError as exc:
            self._lock_failed(exc)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        except BlockingIOError:
            return True  # another instance holds it right now
        except OSError as exc:
            self._lock_failed(exc)
            return False
        finally:
            os.close(fd)

    def _lock_failed(self, exc: OSError) -> None:
        self.metrics.add(lock_failures=1)
        if not self._lock_warned:
            self._lock_warned = True
            log.warning("kvtier: cannot lock %s (%s): the pool's byte budget is kept without its lock, so "
                        "instances evicting at once may overshoot it; use a filesystem with flock (NFS: run "
                        "lockd) or check who replaced the lock file. Counted in kvtier_lock_failures_total.",
                        self.files.root / ".lock", errno.errorcode.get(exc.errno or 0, exc))

    @contextmanager
    def _shared_lock(self) -> Iterator[None]:
        """The fleet-wide lock; without it (a failed open or flock) the body runs unlocked."""
        try:
            fd = self._open_lock()
        except OSError as exc:
            self._lock_failed(exc)
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                self._lock_failed(exc)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def _read_usage(self) -> tuple[int, float] | None:
        """(bytes, time of the last exact scan), or None when missing or unreadable."""
        try:
            data = json.loads(read_small(self.files.root / ".usage", USAGE_MAX_BYTES)[0])
            total, scanned_at = int(data["bytes"]), float(data["scanned_at"])
        except (OSError, ValueError, KeyError, TypeError, OverflowError):
            return None
        # A neighbour's nonsense (negative bytes, a scan "in the future" that would put off every
        # recount) means "unknown": the caller recounts.
        if total < 0 or not scanned_at <= time.time() + 60:  # (NaN fails the comparison too)
            return None
        return total, scanned_at

    def _write_usage(self, total: int, scanned_at: float) -> None:
        self.files.write_small(self.files.root / ".usage",
                               json.dumps({"bytes": total, "scanned_at": scanned_at}).encode())
