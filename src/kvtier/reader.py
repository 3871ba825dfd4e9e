"""PrefixReader: the one read pipeline behind ``TieredStore.load_into`` (and ``get``,
``iter_chunks``), owned by the store as its ``BackgroundWriter`` is for writes.

Contracts (the store's module docstring has the caller's view):

* Every chunk of a prefix that is not in host DRAM is queued at once to the I/O threads of the
  tier a lookup found it in (``io_threads`` per tier, started on first use); the I/O thread
  that read a chunk also hands it to the caller's sink. One thread takes a tier's queue in
  order while its reads take under ``FAST_READ_S`` or come from the page cache (there, more
  threads only hand the GIL around, and a read that took long waited for a CPU); the
  ``SLOW_READS``-th slower read of the device calls up the tier's other threads, so reads of a
  cold device or a network filesystem overlap. Chunks in host DRAM are lent in place on the
  caller's thread.
* Chunks are taken in order; a chunk gone from its tier (missing, corrupt, unreadable) is read
  from each other usable tier in turn (those below it first, then those above), again on that
  tier's threads. A read slower than
  ``read_timeout_s`` trips its tier in the store's ``TierGuard`` and ends the prefix; so do a
  chunk no tier delivers, an exception (recorded in ``Failures``) and a set ``stop`` event.
* The sink is never called after ``load`` returns (``_SinkGate``), not even by a read that
  outlived ``read_timeout_s``; reads still running are abandoned, never awaited.
* Tier reads land in a host DRAM slot (``promote``: promotion without a copy) or, with no free
  slot, in one of the store's recycled buffers (``BufferPool``). A load with a ``Placement``
  (and no ``promote``) lets tiers that can (``reads_in_place``: the disk tier and the pool) read
  a page-cache hit straight into the caller's memory instead, validated there: no buffer, no
  copy by the sink. Such a write is gated like a sink call (``Pages.enter``/``leave``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import cast

import torch

from kvtier.format import ChunkSpec
from kvtier.keys import ChunkId
from kvtier.results import PrefixLoad
from kvtier.threads import Failures, ThreadInit, executor
from kvtier.tiers.base import Level, Pages, Status, Tier
from kvtier.tiers.guard import TierGuard
from kvtier.tiers.host import BufferPool, HostCache, Lease

log = logging.getLogger(__name__)

_Queue = deque[tuple[int, "cf.Future[str | None]"]]
"""A tier's chunks of one load, in order: (index, the future its read's outcome is set on)."""

Sink = Callable[[int, torch.Tensor], None]
"""``sink(index, data)``: the caller's copy of chunk ``index``; ``data`` is valid during the call."""

STOP_POLL_S = 0.02  # how often a stoppable load checks its stop event while a read runs
FAST_READ_S = 0.5e-3
"""A chunk read within this (with its checks and the hand-off to the sink) counts as fast;
a tier's queue stays on one I/O thread until ``SLOW_READS`` reads were slower. Measured on a
2-core machine, a warm 8k load of 64 files of 256 KiB: 9-11 ms on one I/O thread, 13-25 ms
spread over 2-8 (each read from the page cache takes about 80 us, a GIL hand-off tens of us);
with 0.2 ms, scheduling jitter spread warm loads too (13-21 ms)."""
BIG_CACHED_READ_BYTES = 4 << 20
"""A page-cache read of a chunk at least this large counts as slow when it took over
``FAST_READ_S``, as a device read does: its memory copy and checksum run without the GIL for
milliseconds (a 32 MiB chunk of an 8B-class model: about 5 ms on a 2-core machine), so a second
thread doubles what the cache delivers. Smaller ones never count (below)."""
SLOW_READS = 2
"""Slow reads before a tier's other threads are called up: two, so that one read delayed by the
scheduler (the engine's threads share the cores) does not spread a load. Reads the page cache
served (``LoadResult.from_cache``) of chunks under ``BIG_CACHED_READ_BYTES`` never count,
however long they took: in vLLM's process on 2 cores they took 0.3 ms of CPU each and waited as
long again for a core, and calling up a second thread only added a third runnable thread.
A tier whose last read was slow starts its next load on all its threads at once: a load of a
few large chunks would otherwise read ``SLOW_READS`` of them one after the other first."""


@dataclass(frozen=True)
class Placement:
    """Where a load may read chunks straight into the caller's memory (``load_into``'s ``place``).

    ``views(index)``: writable byte buffers for chunk ``index``'s payload, in payload order,
    their sizes adding up to the chunk's payload (``tiers.base.Pages``), or None: hand that
    chunk to the sink. ``landed(index)``: called, on an I/O thread, once chunk ``index`` was
    read and validated there (instead of the sink); it must not write to the views.
    """

    views: Callable[[int], Sequence[memoryview] | None]
    landed: Callable[[int], None]


class _Gone(Exception):
    """A tier read's outcome: the chunk was not there (missing, corrupt, unreadable). Raised
    rather than returned so that it wakes a caller waiting for the rest of the reads."""


@dataclass(frozen=True)
class _Loaded:
    tier: str
    lease: Lease | None  # None: read in place (``Placement``)
    from_cache: bool = False


class _SinkGate:
    """Lets I/O threads hand chunks to a ``load_into`` sink only until that call returns.

    A read can outlive its load: one slower than ``read_timeout_s``, or one still running
    past the first miss. Once ``load_into`` has returned, the caller's buffers may belong to
    someone else (an engine hands a failed request's KV blocks to other requests), so a late
    read must never write there. ``close`` shuts the gate and waits for sinks already running
    (each is one copy).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._active = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def enter(self) -> bool:
        with self._cond:
            if self._open:
                self._active += 1
            return self._open

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: not self._active)


@dataclass(frozen=True)
class _Load:
    """One ``PrefixReader.load`` call, shared with the I/O threads that serve it.

    ``read_s``, ``copy_s`` and ``from_cache`` have one entry per chunk, each written by one
    thread at a time.
    """

    ids: Sequence[ChunkId]
    tiers: list[Tier]  # the store's tiers below host DRAM when the load began, fastest first
    spec: ChunkSpec
    sink: Sink
    promote: bool
    stop: threading.Event | None
    read_s: list[float]
    copy_s: list[float]
    gate: _SinkGate
    from_cache: list[bool]
    place: Placement | None = None

    def hand(self, index: int, data: torch.Tensor) -> None:
        """The caller's sink, timed into ``copy_s``."""
        t0 = time.perf_counter()
        self.sink(index, data)
        self.copy_s[index] += time.perf_counter() - t0


def _cancel_if_cancelled(queue: _Queue, task: cf.Future[None]) -> None:
    """A queue's reader task was cancelled (``close`` while a load ran): cancel its chunks'
    futures too, so that the load ends now rather than after ``read_timeout_s``."""
    if task.cancelled():
        for _, fut in list(queue):
            fut.cancel()


class PrefixReader:
    """Reads a located prefix into a sink (see module docstring). Thread-safe."""

    def __init__(self, host: HostCache | None, guard: TierGuard, buffers: BufferPool, failures: Failures, *,
                 io_threads: int, read_timeout_s: float, thread_init: ThreadInit | None = None) -> None:
        self.host = host
        self._guard = guard
        self._buffers = buffers
        self._failures = failures
        self._io_threads = io_threads
        self._read_timeout_s = read_timeout_s
        self._thread_init = thread_init
        # io_threads per tier, started on first use: reads stuck in a hung tier (a read cannot be
        # cancelled) hold only that tier's threads, never the ones other tiers' reads need.
        self._io: dict[str, cf.ThreadPoolExecutor] = {}
        self._io_lock = threading.Lock()
        self._slow: dict[str, bool] = {}  # by tier name: whether its last read was slow (``_drain``)

    def load(self, ids: Sequence[ChunkId], located: Sequence[Level], tiers: Sequence[Tier], spec: ChunkSpec,
             sink: Sink, *, promote: bool, stop: threading.Event | None,
             place: Placement | None = None) -> PrefixLoad:
        """Hand chunks ``ids[i]`` to ``sink`` (or read them in place, ``place``) from ``located[i]``
        (host DRAM or a tier: where a lookup found them), falling back on the other ``tiers``;
        what ``load_into`` returns."""
        n = len(located)
        load = _Load(ids, list(tiers), spec, sink, promote, stop, [0.0] * n, [0.0] * n, _SinkGate(), [False] * n,
                     None if promote else place)
        # Host DRAM chunks are lent in place, on this thread; tier reads run on the tier's own
        # I/O threads, each tier's chunks queued at once, in order.
        futures: list[cf.Future[str | None] | None] = []
        queues: dict[int, tuple[Tier, _Queue]] = {}  # by id(tier), in the order tiers first appear
        for i, level in enumerate(located):
            if level is self.host:
                futures.append(None)
                continue
            read: cf.Future[str | None] = cf.Future()
            futures.append(read)
            queues.setdefault(id(level), (cast(Tier, level), deque()))[1].append((i, read))
        for tier, queue in queues.values():
            self._queue(load, queue, tier)
        names: list[str] = []
        try:
            for i, level in enumerate(located):
                try:
                    name = self._next(load, i, level, futures)
                except Exception:  # a tier's or the sink's bug: the prefix ends here, the caller goes on
                    self._failures.record("a chunk's delivery")
                    break
                if name is None or (stop is not None and stop.is_set()):
                    break
                names.append(name)
        finally:
            for fut in futures[len(names):]:
                if fut is not None:
                    fut.cancel()
            load.gate.close()
        n = len(names)
        return PrefixLoad(n, tuple(names), sum(load.read_s[:n]), sum(load.copy_s[:n]))

    def close(self) -> None:
        """Stop the I/O threads. Reads still running are abandoned, not awaited: their callers
        gave up on them after read_timeout_s, and a hung filesystem must not hang shutdown (and
        the metrics after it)."""
        with self._io_lock:
            pools = list(self._io.values())
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)

    def _pool(self, tier: Tier) -> cf.ThreadPoolExecutor:
        pool = self._io.get(tier.name)
        if pool is None:
            with self._io_lock:
                pool = self._io.get(tier.name)
                if pool is None:
                    pool = self._io[tier.name] = executor(self._io_threads, f"kvtier-io-{tier.name}",
                                                          self._thread_init)
        return pool

    def _submit(self, load: _Load, index: int, tier: Tier) -> cf.Future[str | None]:
        fut: cf.Future[str | None] = cf.Future()
        self._queue(load, deque([(index, fut)]), tier)
        return fut

    def _queue(self, load: _Load, queue: _Queue, tier: Tier) -> None:
        """Read ``queue``'s chunks from ``tier`` on its I/O threads, each result set on its future
        (cancelled futures are skipped): one thread, until reads are slow (``FAST_READ_S``); all
        of them at once when the tier's last read was slow."""
        spread = self._slow.get(tier.name, False) and len(queue) > 1
        pool = self._pool(tier)
        for _ in range(min(self._io_threads, len(queue)) if spread else 1):
            task = pool.submit(self._drain, load, queue, tier, 0 if spread else SLOW_READS)
            task.add_done_callback(partial(_cancel_if_cancelled, queue))

    def _drain(self, load: _Load, queue: _Queue, tier: Tier, slow_reads: int) -> None:
        """On an I/O thread: take chunks from ``queue`` until it is empty. After ``slow_reads``
        slow device reads, this thread calls up ``io_threads - 1`` more (0: it never does)."""
        while True:
            try:
                index, fut = queue.popleft()  # deque: atomic, shared with the threads called up
            except IndexError:
                return
            if not fut.set_running_or_notify_cancel():
                continue  # the load ended before this chunk
            t0 = time.perf_counter()
            try:
                fut.set_result(self._deliver(load, index, tier))
            except BaseException as e:  # _Gone, or a tier's or the sink's bug: the caller decides
                fut.set_exception(e)
            slow = time.perf_counter() - t0 > FAST_READ_S and (
                not load.from_cache[index] or load.spec.payload_bytes >= BIG_CACHED_READ_BYTES)
            self._slow[tier.name] = slow
            if slow_reads and queue and slow:
                slow_reads -= 1
                if slow_reads:
                    continue
                try:
                    for _ in range(self._io_threads - 1):
                        self._pool(tier).submit(self._drain, load, queue, tier, 0)
                except RuntimeError:  # the reader was closed: this thread goes on alone
                    pass

    def _next(self, load: _Load, i: int, located: Level, futures: list[cf.Future[str | None] | None]) -> str | None:
        """Chunk ``i`` of ``load``, handed to its sink: the name of the tier it came from, or
        None (not delivered: the prefix ends here).

        Where the lookup found it first; if it is gone from there (evicted, corrupt, an I/O
        error), from each other usable tier in turn, those below first. Every tier read,
        fallbacks included, runs on that tier's I/O threads under ``read_timeout_s``, and a
        timeout trips the tier that did not answer.
        """
        if located is self.host:
            assert self.host is not None
            lease = self.host.acquire(load.ids[i])
            if lease is not None:
                try:
                    load.hand(i, lease.chunk.data)
                finally:
                    lease.release()
                return self.host.name
            start = 0  # evicted since the lookup
        else:
            start = load.tiers.index(cast(Tier, located))
        # Where it was found, the tiers below, then those above: a tensor-parallel rank is told
        # the slowest tier any rank found a chunk in, and its own disk may hold what the pool lost.
        order = [*load.tiers[start:], *load.tiers[:start]]
        tier: Level = located
        fut, k = futures[i], 0
        while True:
            if fut is None:
                usable = next((j for j in range(k, len(order)) if self._guard.usable(order[j])), None)
                if usable is None:
                    return None
                k, tier = usable, order[usable]
                fut = futures[i] = self._submit(load, i, order[usable])
            try:
                return self._await(fut, islice(futures, i + 1, None), load.stop)
            except cf.TimeoutError:
                self._guard.trip(tier, f"read of chunk {i}")
                return None
            except _Gone:
                k += 1
                fut = None

    def _await(self, fut: cf.Future[str | None], later: Iterable[cf.Future[str | None] | None],
               stop: threading.Event | None) -> str | None:
        """``fut``'s result within ``read_timeout_s`` (else TimeoutError); None once ``stop`` is set.

        Waits for the ``later`` reads too, until all are done or one fails: one wake-up for a
        whole prefix instead of one per chunk, each of which costs a GIL hand-off to an I/O
        thread in the middle of its reads (measured: a warm 8k load took 15 ms through one
        I/O thread and 8 ms in one thread alone). The caller has nothing to do for a chunk
        but note where it came from; the I/O threads hand chunks to the sink themselves.
        """
        if fut.done():
            return None if stop is not None and stop.is_set() else fut.result()
        pending = {fut, *(f for f in later if f is not None and not f.done())}  # once per load, as a rule
        deadline = time.monotonic() + self._read_timeout_s
        while not fut.done():
            if stop is not None and stop.is_set():
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise cf.TimeoutError
            _, pending = cf.wait(pending, timeout=left if stop is None else min(STOP_POLL_S, left),
                                 return_when=cf.FIRST_EXCEPTION)
            if fut not in pending:
                break
        if stop is not None and stop.is_set():
            return None
        return fut.result()

    def _deliver(self, load: _Load, index: int, tier: Tier) -> str | None:
        """On ``tier``'s I/O thread: read chunk ``index`` there and hand it to the sink. Returns
        the tier's name, or None once the load has returned; raises ``_Gone`` when the tier did
        not deliver it. Adds the read's seconds to ``load.read_s[index]``."""
        if not load.gate.is_open:
            return None  # the load returned (or gave up on this chunk) before the read started
        t0 = time.perf_counter()
        got = self._read(load, index, tier)
        load.read_s[index] += time.perf_counter() - t0
        if got is None:
            raise _Gone
        load.from_cache[index] = got.from_cache
        if got.lease is None:  # read in place, validated there
            assert load.place is not None
            load.place.landed(index)
            return got.tier
        try:
            if not load.gate.enter():
                return None  # the load returned without this chunk: its buffers are not ours
            try:
                load.hand(index, got.lease.chunk.data)
            finally:
                load.gate.leave()
        finally:
            got.lease.release()
        return got.tier

    def _read(self, load: _Load, index: int, tier: Tier) -> _Loaded | None:
        """One tier's read of chunk ``index``, straight into a host DRAM slot (promotion without a
        copy); with no host DRAM, no free slot or ``promote=False``, into a recycled buffer, or
        into the load's ``Placement`` where the tier can read it there."""
        cid, spec, promote = load.ids[index], load.spec, load.promote
        pages = None
        if load.place is not None and getattr(tier, "reads_in_place", False):
            views = load.place.views(index)
            if views is not None:
                pages = Pages(views, load.gate.enter, load.gate.leave)
        host = self.host if promote else None
        slot = host.reserve() if host is not None else None
        into = host.slot_buffer(slot) if host is not None and slot is not None else self._buffers.take()

        def give_back() -> None:
            if host is not None and slot is not None:
                host.abandon(slot)
            else:
                self._buffers.give(into)

        try:
            result = tier.load(cid, spec, into) if pages is None else tier.load(cid, spec, into, pages=pages)  # type: ignore[call-arg]
        except BaseException:
            give_back()
            raise
        if result.ok and result.in_place:
            give_back()
            return _Loaded(tier.name, None, result.from_cache)
        if result.ok and result.chunk is not None:
            if host is not None and slot is not None:
                return _Loaded(tier.name, host.commit(slot, cid), result.from_cache)
            return _Loaded(tier.name, Lease(result.chunk, partial(self._buffers.give, into)), result.from_cache)
        give_back()
        if result.status not in (Status.MISS, Status.STOPPED):
            log.info("chunk %s from %s: %s (%s)", cid.key.hex()[:12], tier.name, result.status.value, result.error)
        return None
