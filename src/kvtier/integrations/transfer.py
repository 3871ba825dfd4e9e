"""The data path between an engine's paged KV cache and a ``TieredStore``, without the engine.

``PageMover`` moves whole chunks (``blocks_per_chunk`` blocks each) of a ``PagedKV`` in and
out of the store. The vLLM worker uses it, and ``benchmarks/gpu_path.py`` drives the same
object with torch alone. Its contracts:

* **Loads** (``load``, or ``submit_load`` for one that runs in the background) read the cached
  prefix of a list of chunk ids into the given blocks, in parallel on the store's I/O threads:
  on CPU, a chunk file the page cache holds is read straight into the blocks
  (``PagedKV.page_views``); any other is read into a buffer and copied into them. A background
  load (``LoadJob``) can be stopped; once its ``done()`` is true no byte is written to its
  blocks any more, whether it finished, failed or was stopped.
* **Saves** (``save``) copy a chunk's blocks into a host DRAM slot and publish it, then queue
  its write-down to disk and pool; they never wait for I/O.
* **On an accelerator** (CUDA) nothing here synchronizes the engine: host memory (the host
  slab and the read buffers) is page-locked; loads copy on a load stream, saves gather on a
  save stream that first waits for the compute stream (the step that wrote the KV); a saved
  chunk is published only once its copy's event has completed (``poll_saves``); and ``fence``
  makes the compute stream wait for the saves' gathers before the engine's next step, so a
  block freed and reused by the next step is never overwritten while it is being copied. No
  copy runs on the default stream from a background thread. Loads and saves have a stream
  each, so a save never queues behind a long load.
* **On CPU** the same calls are plain copies: a save's gather runs in the caller's thread
  (a memcpy that another thread would only take from the same cores), a load's copies run on
  the I/O threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.integrations.paged import PagedKV
from kvtier.keys import ChunkId
from kvtier.store import PendingPut, Placement, TieredStore
from kvtier.threads import ThreadInit, executor

log = logging.getLogger(__name__)


class PinningError(RuntimeError):
    """Host memory for accelerator copies could not be page-locked (refused at start)."""


@dataclass(frozen=True)
class Loaded:
    """What a load delivered: its first ``num_chunks`` chunks (every shard of each), and the tier
    each of their shards came from (``chunk_tiers``, ``shards`` per chunk, in order)."""

    num_chunks: int
    chunk_tiers: tuple[str, ...]
    seconds: float
    stopped: bool = False
    started: float = 0.0
    """``time.monotonic()`` when the load began reading (after any wait for a loader thread)."""
    read_s: float = 0.0
    """Seconds reading and validating the delivered chunks, summed over them (``PrefixLoad``)."""
    copy_s: float = 0.0
    """Seconds copying them into the blocks, summed over them."""


class LoadProgress:
    """How far a load has come: written by the threads that copy its chunks, read by others.

    An estimate for scheduling decisions only (``LoadJob.eta_s``), never for correctness."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.started = 0.0  # time.monotonic() at the load's first read; 0.0 until then
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:  # sinks run on several I/O threads at once
            self.done += 1

    def eta_s(self, now: float) -> float | None:
        """Seconds left at the rate of the chunks copied so far; None before the first one."""
        done, started = self.done, self.started
        if not done or not started:
            return None
        return max(0.0, (now - started) * (self.total - done) / done)


class LoadJob:
    """A load running in the background (``PageMover.submit_load``)."""

    def __init__(self, future: cf.Future[Loaded], stop: threading.Event, progress: LoadProgress) -> None:
        self._future = future
        self._stop = stop
        self.progress = progress
        self.submitted = time.monotonic()

    def stop(self) -> None:
        """Ask the load to end at the next chunk; ``done()`` tells when it has."""
        self._stop.set()

    def done(self) -> bool:
        return self._future.done()

    def eta_s(self, now: float) -> float | None:
        """Seconds until it is done at its rate so far (0 once done); None while no chunk is in."""
        return 0.0 if self.done() else self.progress.eta_s(now)

    @staticmethod
    def wait_any(jobs: Collection[LoadJob], timeout: float) -> None:
        """Return once any of ``jobs`` is done, or after ``timeout`` seconds."""
        cf.wait([j._future for j in jobs], timeout=timeout, return_when=cf.FIRST_COMPLETED)

    @staticmethod
    def wait_all(jobs: Collection[LoadJob], timeout: float) -> None:
        """Return once all of ``jobs`` are done, or after ``timeout`` seconds."""
        cf.wait([j._future for j in jobs], timeout=timeout, return_when=cf.ALL_COMPLETED)

    def result(self, timeout: float | None = None) -> Loaded:
        """What it delivered (blocks until done). A load that raised delivered nothing usable."""
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            raise
        except Exception as exc:  # a bug or an unexpected error: report a failed load, not a crash
            log.error("kvtier: a background load failed: %r", exc)
            return Loaded(0, (), 0.0)


def _cuda_register(array: np.ndarray) -> bool:
    """Page-lock ``array`` (cudaHostRegister), so copies to and from it are asynchronous."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0)  # type: ignore[no-untyped-call]
    except (RuntimeError, AttributeError) as exc:
        log.warning("kvtier: cannot page-lock %d bytes of host memory: %s", array.nbytes, exc)
        return False
    ok = int(getattr(err, "value", err)) == 0
    if not ok:
        log.warning("kvtier: cudaHostRegister of %d bytes failed (%s); copies use pageable memory",
                    array.nbytes, err)
    return ok


@dataclass
class _Save:
    pending: PendingPut
    done: Any  # torch.cuda.Event, or None on CPU (then the bytes are already there)
    tag: str | None


class PageMover:
    """See the module docstring."""

    def __init__(self, paged: PagedKV, store: TieredStore, blocks_per_chunk: int, *, loaders: int = 2,
                 thread_init: ThreadInit | None = None) -> None:
        self.paged, self.store, self.blocks_per_chunk = paged, store, blocks_per_chunk
        self.shards = paged.shards  # store chunks per chunk of blocks: one per head shard
        self.cuda = paged.device.type == "cuda"
        self._loader = executor(loaders, "kvtier-load", thread_init)
        self._saves: deque[_Save] = deque()
        self._fence: Any = None
        self.load_stream: Any = None
        self.save_stream: Any = None
        if self.cuda:
            self.load_stream = torch.cuda.Stream(paged.device)  # type: ignore[no-untyped-call]
            self.save_stream = torch.cuda.Stream(paged.device)  # type: ignore[no-untyped-call]
            self.pinned = store.pin_host_memory(_cuda_register)
            if not self.pinned:
                # Pageable host memory makes every save's device-to-host copy synchronous: each
                # saving step would stall the engine. Refuse to start, with the fix.
                raise PinningError(
                    f"kvtier could not page-lock its host DRAM ({store.config.host_bytes} bytes on this rank, "
                    "cudaHostRegister failed: see the warning above); lower host_bytes (a total over all "
                    "tensor-parallel ranks) or raise the locked-memory limit (ulimit -l, the container's "
                    "memlock), or set host_bytes: 0")

    # ---------------------------------------------------------------- loads

    def _compute_done(self) -> Any:
        """An event after all the engine's work queued so far (e.g. its zeroing of new blocks)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.paged.device))
        return event

    def load(self, ids: Sequence[ChunkId], block_ids: Sequence[int | None],
             stop: threading.Event | None = None, after: Any = None, tenant_salt: str | None = None,
             tiers: Sequence[str] | None = None, progress: LoadProgress | None = None) -> Loaded:
        """Read the cached prefix of ``ids`` into ``block_ids`` (``blocks_per_chunk`` per chunk; a
        None entry leaves that block alone) and return what was delivered. Blocks after the
        delivered prefix may hold partial data and must be recomputed by the caller.

        With head shards, ``ids`` holds ``shards`` ids per chunk of blocks, in shard order (the
        chunk's first shard, its second, ..., then the next chunk's). ``tenant_salt``: the
        namespace the ids were made in (None: the store's own). ``tiers``: where a lookup found
        each id (``TieredStore.load_into``): no second lookup. ``progress``: counts each id
        copied into its blocks."""
        bpc, paged, k = self.blocks_per_chunk, self.paged, self.shards
        if after is None:
            after = self._compute_done()
        stream = self.load_stream
        if stream is not None and after is not None:
            stream.wait_event(after)

        def sink(index: int, data: torch.Tensor) -> None:
            chunk, shard = divmod(index, k)
            blocks = block_ids[chunk * bpc:(chunk + 1) * bpc]
            if stream is None:
                paged.scatter(data, blocks, shard)
            else:
                with torch.cuda.stream(stream):
                    paged.scatter(data, blocks, shard)
                    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    done.record(stream)
                done.synchronize()  # ``data`` is the store's only until this returns
            if progress is not None:
                progress.add()

        def views(index: int) -> list[memoryview] | None:
            chunk, shard = divmod(index, k)
            return paged.page_views(block_ids[chunk * bpc:(chunk + 1) * bpc], shard)

        def landed(index: int) -> None:
            if progress is not None:
                progress.add()

        # On CPU a chunk the page cache holds is read straight into its blocks (no buffer, no
        # scatter): a memory copy, as the scatter would be, but one instead of two.
        place = None if self.cuda else Placement(views, landed)
        started, t0 = time.monotonic(), time.perf_counter()
        if progress is not None:
            progress.started = started
        # vLLM's prefix cache keeps what is loaded: no need to promote it into host DRAM too.
        result = self.store.load_into(ids, sink, promote=False, stop=stop, tenant_salt=tenant_salt, tiers=tiers,
                                      place=place)
        whole = result.num_chunks // k  # a chunk counts once every one of its shards is in
        return Loaded(whole, result.chunk_tiers[:whole * k], time.perf_counter() - t0,
                      stop is not None and stop.is_set(), started, result.read_s, result.copy_s)

    def submit_load(self, ids: Sequence[ChunkId], block_ids: Sequence[int | None],
                    tenant_salt: str | None = None, tiers: Sequence[str] | None = None) -> LoadJob:
        """``load`` in the background; ordered after the engine's work queued so far."""
        stop = threading.Event()
        after = self._compute_done()
        progress = LoadProgress(len(ids))
        return LoadJob(self._loader.submit(self.load, list(ids), list(block_ids), stop, after, tenant_salt,
                                           None if tiers is None else list(tiers), progress), stop, progress)

    # ---------------------------------------------------------------- saves

    def save(self, cid: ChunkId, block_ids: Sequence[int], *, shard: int = 0, skip_tiers: Collection[str] = (),
             tag: str | None = None, tenant_salt: str | None = None) -> bool:
        """Copy one shard (``shard`` of ``shards``) of one chunk's blocks into the store as ``cid``;
        False when host DRAM already holds it.

        ``tag`` names the save for ``saves_pending`` (e.g. a finished request whose blocks
        are held until its saves are copied).
        """
        pending = self.store.begin_put(cid, skip_tiers=skip_tiers, tenant_salt=tenant_salt)
        if pending is None:
            return False
        try:
            if not self.cuda:
                self.paged.gather(block_ids, pending.buffer, shard)
                done = None
            else:
                done = self._gather_async(block_ids, pending.buffer, shard)
        except BaseException:
            pending.abandon()
            raise
        self._saves.append(_Save(pending, done, tag))
        self.poll_saves()
        return True

    def _gather_async(self, block_ids: Sequence[int], host: torch.Tensor, shard: int) -> Any:
        stream = self.save_stream
        stream.wait_event(self._compute_done())
        with torch.cuda.stream(stream):
            # Gather on the device (fast, reads the blocks), then one copy to host memory.
            staging = torch.empty(len(block_ids) * self.paged.block_bytes, dtype=torch.uint8,
                                  device=self.paged.device)
            self.paged.gather(block_ids, staging, shard)
            gathered = torch.cuda.Event()  # type: ignore[no-untyped-call]
            gathered.record(stream)
            host.view(-1).view(torch.uint8).copy_(staging, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        self._fence = gathered
        return done

    def fence(self) -> None:
        """Order the engine's next work after the gathers of the saves issued so far (CUDA)."""
        if self._fence is not None:
            torch.cuda.current_stream(self.paged.device).wait_event(self._fence)
            self._fence = None

    def poll_saves(self, wait: bool = False) -> int:
        """Publish saves whose copies completed (all of them with ``wait``); returns how many."""
        n = 0
        while self._saves:
            save = self._saves[0]
            if save.done is not None:
                if wait:
                    save.done.synchronize()
                elif not save.done.query():
                    break
            self._saves.popleft()
            save.pending.commit()
            n += 1
        return n

    def saves_pending(self, tag: str) -> bool:
        """Whether a save tagged ``tag`` is still being copied."""
        return any(s.tag == tag for s in self._saves)

    def close(self) -> None:
        """Stop taking loads, wait for running ones, publish the saves in flight."""
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.poll_saves(wait=True)
