"""``ROOT/.evicted``: the keys every evictor of a shared pool removed, for KV events.

Every eviction (by any instance's evictor, or ``kvtier pool gc``) appends the chunk's key, one
hex line each, so that every instance can tell routers that a chunk it announced is gone
(``PoolTier.read_evictions``). Past ``EVICTION_LOG_MAX_BYTES`` the next appender renames the
log to ``.evicted.1`` (replacing the one before) and starts a new one; a reader that notices the
new inode first reads the rest of the file it was reading, under its old name, then the new one
from its start, so a rotation loses no line it had not read (a reader behind by more than a
whole log misses lines). Appends happen under the eviction lease (rounds, ``pool gc``), so two
appenders never rotate at once; without a working lock, two rotations at once can drop the
lines of one generation, and a router then advertises chunks that are gone until its next miss
on them. The log is as untrusted as the chunks: never followed through a symlink, never
waited on as a FIFO, read at most ``EVICTION_READ_MAX_BYTES`` per call. It only feeds KV
events: an eviction never fails for it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from kvtier.fileio import read_small
from kvtier.tiers.files import ChunkFiles

EVICTION_LOG = ".evicted"
ROTATED_LOG = ".evicted.1"  # the log before the last rotation
EVICTION_LOG_MAX_BYTES = 8 << 20
EVICTION_READ_MAX_BYTES = 1 << 20  # per read_new call: a longer backlog is read over several


class EvictionLog:
    """The eviction log of one pool directory: ``append`` from evictors (any thread), and
    ``read_new`` from one reader (it keeps its position)."""

    def __init__(self, files: ChunkFiles) -> None:
        self.files = files
        self.path = files.root / EVICTION_LOG
        self.rotated = files.root / ROTATED_LOG
        self._pos: tuple[int, int] | None = None  # (inode, offset) read so far

    def append(self, keys: Sequence[bytes]) -> None:
        """Append ``keys`` (start the log over past its size limit); never raises."""
        if not keys:
            return
        try:
            st = os.lstat(self.path)
            if st.st_size > EVICTION_LOG_MAX_BYTES or not stat.S_ISREG(st.st_mode):
                os.replace(self.path, self.rotated)  # readers finish it there, then read the new one
        except FileNotFoundError:
            pass
        except OSError:
            return
        try:
            # O_NONBLOCK: a FIFO planted between the lstat and the open fails (ENXIO), never blocks.
            fd = self.files.create_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.write(fd, b"".join(k.hex().encode() + b"\n" for k in keys))
            finally:
                os.close(fd)
        except OSError:
            pass  # the log only feeds KV events; an eviction never fails for it

    def read_new(self) -> list[bytes]:
        """Keys appended since the last call (this object's position); the first call starts at
        the log's end. Never raises."""
        path = self.path
        try:
            st = os.stat(path, follow_symlinks=False)
            if self._pos is not None and self._pos[0] != st.st_ino:
                rest = self._rest_of_rotated(self._pos)
                if rest is not None:
                    return rest
            if self._pos is None or self._pos[0] != st.st_ino or self._pos[1] > st.st_size:
                start = st.st_size if self._pos is None else 0  # new: from the end; rotated: all
            else:
                start = self._pos[1]
            data, st = read_small(path, EVICTION_READ_MAX_BYTES, start)
        except FileNotFoundError:
            self._pos = (0, 0)
            return []
        except OSError:  # a symlink, FIFO or device planted there: never followed, never waited on
            return []
        return self._take(data, st, start)

    def _rest_of_rotated(self, pos: tuple[int, int]) -> list[bytes] | None:
        """The unread lines of the log this reader was reading, rotated since (``.evicted.1``
        with its inode); None when there is none left to read (or it rotated away too)."""
        try:
            data, st = read_small(self.rotated, EVICTION_READ_MAX_BYTES, pos[1])
        except OSError:
            return None
        if st.st_ino != pos[0] or b"\n" not in data:
            return None  # nothing (or only a torn line) left there: on to the new log
        return self._take(data, st, pos[1])

    def _take(self, data: bytes, st: os.stat_result, start: int) -> list[bytes]:
        """The keys on the whole lines of ``data`` (read from ``start`` of the file ``st``);
        the position moves past them."""
        end = data.rfind(b"\n") + 1  # a line being appended is read next time
        self._pos = (st.st_ino, start + end)
        keys = []
        for line in data[:end].split():
            try:
                keys.append(bytes.fromhex(line.decode()))
            except ValueError:
                continue
        return keys
