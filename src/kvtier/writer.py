"""Background write-down of chunks to the lower tiers, through a bounded queue.

``submit`` never blocks: when the queue is full the write is dropped and counted against
every tier it was meant for. A queued item keeps its chunk pinned (``on_done`` releases it
after the last tier), so a chunk leaving host DRAM before it reached disk is still written.
No exception in an item (a tier's, the ``after_store`` hook's, ``on_done``'s) ends a writer
thread: each is recorded (``threads.Failures``) and the next item is written.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.format import ChunkSpec
from kvtier.keys import ChunkKey
from kvtier.memory import lower_priority
from kvtier.threads import Failures, ThreadInit, thread
from kvtier.tiers.base import Chunk, Status, Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Write:
    chunk: Chunk
    spec: ChunkSpec
    tiers: Sequence[Tier]
    on_done: Callable[[], None] | None


class BackgroundWriter:
    """``after_store(tier, key)``, when given, runs after each chunk a tier stored or already had
    (the store applies a session's retention there)."""

    def __init__(self, max_queued: int, num_threads: int = 1,
                 after_store: Callable[[Tier, ChunkKey], None] | None = None,
                 failures: Failures | None = None, init: ThreadInit | None = None, nice: int = 0) -> None:
        self._after_store = after_store
        self._failures = failures or Failures()
        self._queue: queue.Queue[_Write | None] = queue.Queue(max_queued)
        self._nice = nice  # the threads' priority (memory.lower_priority): behind the engine's
        self._threads = [thread(self._run, f"kvtier-writer-{i}", init) for i in range(num_threads)]
        self._closed = False
        for t in self._threads:
            t.start()

    def submit(self, chunk: Chunk, spec: ChunkSpec, tiers: Sequence[Tier],
               on_done: Callable[[], None] | None = None) -> bool:
        """Queue ``chunk`` for ``tiers``; False (counted, ``on_done`` not called) if full."""
        if self._closed:
            raise RuntimeError("store is closed")
        try:
            self._queue.put_nowait(_Write(chunk, spec, tiers, on_done))
            return True
        except queue.Full:
            for tier in tiers:
                tier.metrics.add(dropped_writes=1)
            return False

    def write_now(self, chunk: Chunk, spec: ChunkSpec, tiers: Sequence[Tier]) -> bool:
        """Write ``chunk`` to ``tiers`` on the calling thread (no queue, nothing dropped): True
        when every tier stored it or already had it. For callers whose own thread is the
        background (SGLang's backup thread), which want back-pressure and a true answer."""
        # A list, not a generator: every tier is written, even after one fails.
        stored = [self._write(_Write(chunk, spec, tiers, None), tier) for tier in tiers]
        return all(stored)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def flush(self) -> None:
        """Wait until every queued write has been attempted."""
        self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        if self._nice:
            lower_priority(self._nice)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                for tier in item.tiers:
                    self._write(item, tier)
            finally:
                if item is not None and item.on_done is not None:
                    self._failures.call("the writer's release of a written chunk", item.on_done)
                self._queue.task_done()

    def _write(self, item: _Write, tier: Tier) -> bool:
        try:
            result = tier.store(item.chunk, item.spec)
        except Exception:  # a tier bug must not kill the writer thread
            tier.metrics.add(failed_writes=1)
            self._failures.record(f"the {tier.name} tier's store")
            return False
        if result.status is Status.FAILED:
            log.debug("write to %s failed: %s", tier.name, result.error)
            return False
        if self._after_store is not None:
            self._failures.call("the writer's after-store hook (retention)", self._after_store, tier,
                                item.chunk.id.key)
        return True
