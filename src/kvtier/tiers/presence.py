"""Which chunks a chunk directory holds, asked by lookups: one ``stat`` per chunk. For a
directory on a network filesystem (the shared pool), where each stat is a round trip, many
stats are kept in flight and absences are remembered for a while (``parallel``). Stats run on
the caller's thread for as long as each answers within ``SERIAL_STAT_S`` (a local filesystem,
or a network client's cached metadata): there, handing them to threads costs more than the
stats themselves (measured: 32 stats in 0.16 ms in one thread, 1.5 ms median and 12.8 ms at
worst through 16 threads, on an idle 2-core machine).

``ChunkFiles`` owns one (its ``parallel_lookups`` and ``leading_present``) and passes its stat
function on each call, so this object holds no reference back to it.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial

from kvtier.keys import ChunkId, ChunkKey
from kvtier.threads import ThreadInit, executor

MAX_ABSENT = 1 << 16  # keys a pool remembers as absent (parallel_lookups)
SERIAL_STAT_S = 50e-6
"""A stat answered within this is local (or the client's cache): the next one runs on the
caller's thread too. The first slower one sends the rest of the lookup to the stat threads.
(Measured here: a local stat about 5 us with Python's overhead; GlusterFS 150-200 us.)"""

StatSize = Callable[[ChunkKey], "int | None"]
"""A chunk file's size, or None when it is absent."""


class Presence:
    """Leading-run presence checks for one chunk directory. Thread-safe."""

    def __init__(self) -> None:
        self._pool: cf.ThreadPoolExecutor | None = None
        self._absent: Absent | None = None
        self.stats = Counter()
        """File-metadata calls made (``ChunkFiles.lookup_stats``)."""

    def parallel(self, threads: int, negative_ttl_s: float, init: ThreadInit | None = None) -> None:
        """Keep up to ``threads`` stats in flight and remember absent chunks for ``negative_ttl_s``;
        ``init`` runs first in each of those threads (``threads.py``)."""
        self._pool = executor(threads, "kvtier-stat", init) if threads > 1 else None
        if self._pool is not None:  # its idle threads go with this object (no close in the Tier protocol)
            weakref.finalize(self, self._pool.shutdown, wait=False)
        self._absent = Absent(negative_ttl_s) if negative_ttl_s > 0 else None

    def forget(self, key: ChunkKey) -> None:
        """``key`` has a file now (just published): forget that it was absent."""
        if self._absent is not None:
            self._absent.discard(key)

    def leading(self, ids: Sequence[ChunkId], stat_size: StatSize) -> int:
        """How many of ``ids``, from the first on, ``stat_size`` finds (at most one stat each).

        Stats run on the calling thread while each takes at most ``SERIAL_STAT_S``. With
        ``parallel``, after the first slower one the rest run in windows that double from 8 to
        256, so a prefix of n chunks costs about n round trips / threads, and a miss early on
        wastes a few stats.
        """
        present = partial(self._present, stat_size)
        pool = self._pool
        n = 0
        for cid in ids:
            t0 = time.perf_counter()
            if not present(cid.key):
                return n
            n += 1
            if pool is not None and time.perf_counter() - t0 > SERIAL_STAT_S:
                break  # a round trip: keep many in flight from here on
        if pool is None:
            return n
        window = 8
        while n < len(ids):
            for found in pool.map(present, [cid.key for cid in ids[n:n + window]]):
                if not found:
                    return n
                n += 1
            window = min(2 * window, 256)
        return n

    def _present(self, stat_size: StatSize, key: ChunkKey) -> bool:
        absent = self._absent
        if absent is not None and absent.holds(key):
            return False
        self.stats.add(1)
        if stat_size(key) is not None:
            return True
        if absent is not None:
            absent.add(key)
        return False


class Counter:
    """A thread-safe count."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


class Absent:
    """Keys recently found absent, each remembered for ``ttl_s``; at most ``MAX_ABSENT`` of
    them (the oldest forgotten first), so a flood of distinct misses costs bounded memory."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._until: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()

    def holds(self, key: bytes) -> bool:
        with self._lock:
            until = self._until.get(key)
            if until is None:
                return False
            if time.monotonic() < until:
                return True
            del self._until[key]
            return False

    def add(self, key: bytes) -> None:
        with self._lock:
            self._until[key] = time.monotonic() + self.ttl_s
            self._until.move_to_end(key)
            while len(self._until) > MAX_ABSENT:
                self._until.popitem(last=False)

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._until.pop(key, None)
