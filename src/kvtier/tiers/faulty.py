"""FaultyTier: a proxy that injects seeded random delays and failures before each tier call.

Used by tests (and by anyone who wants to see a store survive a misbehaving backend): wrap any
tier, e.g. ``TieredStore(config, host=HostCache(...), tiers=[FaultyTier(PoolTier(...), seed=1,
error_prob=0.1, max_delay_s=0.01)])``. Before each ``lookup``/``load``/``store`` it may

* sleep for a random time up to ``max_delay_s`` (with ``delay_prob``); ``wake()`` ends every
  sleep at once, so a test can shut a store down without waiting out injected delays;
* fail: an ``OSError`` raised inside and turned into the tier protocol's result, never an
  exception to the caller (``lookup`` -> 0 chunks held, ``load`` -> ``Status.ERROR``,
  ``store`` -> ``Status.FAILED``), counted in the inner tier's ``failed_reads``/``failed_writes``;
* miss (``load`` only, with ``miss_prob``): ``Status.MISS`` as if the chunk vanished between
  lookup and read, counted in ``read_races``.

The proxy shares ``name`` and ``metrics`` with the tier it wraps, so the store's counters
read as if the wrapped tier itself misbehaved. What it injected is counted in ``injected``.
Decisions come from one ``random.Random(seed)`` under a lock: a single-threaded caller sees
the same faults on every run; with I/O threads the order of calls, hence of faults, varies.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from kvtier.format import ChunkSpec
from kvtier.keys import ChunkId
from kvtier.tiers.base import Chunk, LoadResult, Pages, Status, StoreResult, Tier

OPS = ("lookup", "load", "store")


@dataclass
class InjectedFaults:
    """What a FaultyTier injected, per kind (counters only grow)."""

    calls: int = 0
    delays: int = 0
    delay_seconds: float = 0.0
    errors: int = 0
    misses: int = 0


class FaultyTier:
    """Wraps ``inner`` and injects faults before each call. See module docstring."""

    def __init__(self, inner: Tier, *, seed: int = 0, delay_prob: float = 0.0,
                 max_delay_s: float = 0.0, min_delay_s: float = 0.0, error_prob: float = 0.0,
                 miss_prob: float = 0.0, ops: Sequence[str] = OPS) -> None:
        for name, p in (("delay_prob", delay_prob), ("error_prob", error_prob), ("miss_prob", miss_prob)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name}: must be a probability in [0, 1], got {p!r}")
        if not 0.0 <= min_delay_s <= max_delay_s:
            raise ValueError(f"min_delay_s/max_delay_s: need 0 <= min <= max, got {min_delay_s}, "
                             f"{max_delay_s}")
        unknown = set(ops) - set(OPS)
        if unknown:
            raise ValueError(f"ops: unknown operation(s) {sorted(unknown)}; use some of {OPS}")
        self.inner = inner
        self.name = inner.name
        self.metrics = inner.metrics
        self.delay_prob = delay_prob
        self.min_delay_s = min_delay_s
        self.max_delay_s = max_delay_s
        self.error_prob = error_prob
        self.miss_prob = miss_prob
        self.ops = frozenset(ops)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._injected = {op: InjectedFaults() for op in OPS}

    # -- fault decisions --------------------------------------------------------------------

    def _decide(self, op: str) -> tuple[float, bool, bool]:
        """(seconds to sleep, raise an error, report a miss) for one call of ``op``."""
        with self._lock:
            counts = self._injected[op]
            counts.calls += 1
            if op not in self.ops:
                return 0.0, False, False
            # Always draw all four numbers so changing one setting does not shift the others' draws.
            r_delay, r_len, r_err, r_miss = (self._rng.random() for _ in range(4))
            delay = 0.0
            if r_delay < self.delay_prob and self.max_delay_s > 0:
                delay = self.min_delay_s + r_len * (self.max_delay_s - self.min_delay_s)
                counts.delays += 1
                counts.delay_seconds += delay
            error = r_err < self.error_prob
            miss = not error and op == "load" and r_miss < self.miss_prob
            counts.errors += error
            counts.misses += miss
            return delay, error, miss

    def _before(self, op: str) -> tuple[bool, bool]:
        """Sleep and/or raise OSError as decided; return (report a miss, slept)."""
        delay, error, miss = self._decide(op)
        if delay and not self._wake.is_set():
            self._wake.wait(delay)
        if error:
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected by FaultyTier before {op})")
        return miss, delay > 0

    # -- tier protocol ----------------------------------------------------------------------

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        try:
            self._before("lookup")
        except OSError:
            return 0  # a tier that cannot answer holds nothing, as far as the caller knows
        return self.inner.lookup(ids)

    @property
    def reads_in_place(self) -> bool:
        return bool(getattr(self.inner, "reads_in_place", False))

    def load(self, chunk: ChunkId, spec: ChunkSpec, into: np.ndarray | None = None, *,
             pages: Pages | None = None) -> LoadResult:
        try:
            miss, slept = self._before("load")
        except OSError as exc:
            self.metrics.add(failed_reads=1)
            return LoadResult(Status.ERROR, error=str(exc))
        if miss:
            self.metrics.add(read_races=1)
            return LoadResult(Status.MISS)
        if pages is None:
            result = self.inner.load(chunk, spec, into)
        else:
            result = self.inner.load(chunk, spec, into, pages=pages)  # type: ignore[call-arg]
        # An injected delay stands for a slow device, whatever served the bytes after it.
        return replace(result, from_cache=False) if slept and result.from_cache else result

    def time_read(self, chunk: ChunkId, max_bytes: int) -> tuple[int, float] | None:
        """The inner tier's, after what ``load`` would suffer (its delay counts in the time)."""
        t0 = time.perf_counter()
        try:
            miss, _ = self._before("load")
        except OSError:
            return None
        timed = None if miss else getattr(self.inner, "time_read", lambda c, m: None)(chunk, max_bytes)
        return None if timed is None else (timed[0], time.perf_counter() - t0)

    def store(self, chunk: Chunk, spec: ChunkSpec) -> StoreResult:
        try:
            self._before("store")
        except OSError as exc:
            self.metrics.add(failed_writes=1)
            return StoreResult(Status.FAILED, str(exc))
        return self.inner.store(chunk, spec)

    def evict(self, target_bytes: int) -> int:
        return self.inner.evict(target_bytes)

    def close(self) -> None:
        self.wake()
        self.inner.close()

    # -- control ----------------------------------------------------------------------------

    def wake(self) -> None:
        """End every injected delay now and skip later ones (e.g. before closing a store)."""
        self._wake.set()

    def injected(self) -> dict[str, dict[str, Any]]:
        """Per operation: calls seen and delays, errors and misses injected."""
        with self._lock:
            return {op: asdict(c) for op, c in self._injected.items()}

    def __getattr__(self, name: str) -> Any:
        # Anything beyond the protocol (keys(), files, capacity_bytes) is the inner tier's.
        return getattr(self.__dict__["inner"], name)
