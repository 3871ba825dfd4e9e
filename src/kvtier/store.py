"""TieredStore: the public face of kvtier's storage (host DRAM -> local disk -> shared pool).

Contracts:

* ``put`` copies each new full chunk once into host DRAM and queues its write-down to disk
  and pool; it never waits for I/O (a full queue drops the write and counts it).
* ``lookup`` returns the longest contiguous prefix of full chunks held in any tier; it does
  file-system metadata calls for the pool, never data reads.
* ``load_into`` reads a prefix on each tier's I/O threads (one while reads are fast or served by
  the page cache, up to ``io_threads`` once device reads are slow: ``reader.py``) and hands
  each chunk to the caller's sink as it arrives. A chunk that turns out missing, corrupt, unreadable
  or slower than ``read_timeout_s`` in every tier ends the prefix there (counted); wrong bytes
  are never returned. Every read, a fallback to a lower tier included, runs on that tier's own
  I/O threads under ``read_timeout_s``: reads stuck in a hung tier never hold the threads of
  another, and never the caller's. The tier that timed out (a read, or a lookup of the pool) is
  skipped for ``tier_cooldown_s`` (``tiers/guard.py``): a hung pool costs one timeout per
  cooldown. Chunks read from a tier are promoted to host DRAM. An exception in a tier or the
  sink ends the prefix too (recorded in ``thread_errors``), never the caller's.
* ``get`` is ``load_into`` into one tensor, or ``KeyError`` if any chunk is gone;
  ``iter_chunks`` yields copies of the chunks ``load_into`` delivered, in order.
* ``retain`` keeps chunks of a session in the disk tier and the pool until a time: they are
  evicted after every unretained chunk (host DRAM and Redis ignore it). Chunks written later
  under a retained key are retained as they land.
* ``begin_put`` hands out room for one chunk (a host DRAM slot when one is free) that the
  caller fills, possibly later (an asynchronous device copy); the chunk is visible to readers
  and queued for disk and pool only once the caller commits it.

Host DRAM (``self.host``, a ``HostCache``) is a slot cache, not a tier: chunks are read from
disk or the pool straight into its slots, filled there by engines, and read where they lie.
The tiers below it (``self.tiers``: disk, then the pool or Redis) speak the ``Tier`` protocol;
``self.levels`` is both, fastest first, as lookups see them.

All methods are thread-safe. ``close`` flushes pending writes; use the store as a context
manager or call ``close`` before exit.

Over 400 lines on purpose: one class, the public API, whose reads and writes share host DRAM,
the tiers, the guard and the buffers. The work is done in modules of their own: ``reader``
(``PrefixReader``, the read pipeline), ``writer`` (write-downs), ``retention``, ``tiers.locate``;
``results`` holds what the methods return (all re-exported here).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict
from functools import partial
from typing import Any

import numpy as np
import torch
from prometheus_client.registry import CollectorRegistry

from kvtier.codec import KVGeometry
from kvtier.config import StoreConfig, load_settings, parse_bytes
from kvtier.errors import TierUnavailableError
from kvtier.format import PAYLOAD_OFFSET, ChunkSpec
from kvtier.keys import ChunkId, Namespace, TokenIds, as_token_array, chunk_ids
from kvtier.layout import KVLayout
from kvtier.metrics import TierMetrics, new_registry
from kvtier.reader import STOP_POLL_S, Placement, PrefixReader, Sink
from kvtier.results import LoadedChunk, LookupResult, PendingPut, PrefixLoad, PutResult
from kvtier.retention import Retention
from kvtier.specs import MAX_DESCRIBED, MAX_SPECS, Specs
from kvtier.threads import Failures, ThreadInit
from kvtier.tiers.base import Chunk, Level, Tier
from kvtier.tiers.guard import TierGuard
from kvtier.tiers.host import BufferPool, HostCache, Lease
from kvtier.tiers.locate import locate, locate_named
from kvtier.tiers.opening import Faults, open_tiers
from kvtier.writer import BackgroundWriter

log = logging.getLogger(__name__)
__all__ = ["MAX_DESCRIBED", "MAX_SPECS", "STOP_POLL_S", "BufferPool", "LoadedChunk", "LookupResult", "PendingPut",
           "Placement", "PrefixLoad", "PutResult", "TieredStore"]
ChunkData = torch.Tensor | Callable[[torch.Tensor], None]
"""A chunk to store: the tensor, or a function that fills the store's buffer with it."""


class TieredStore:
    """KV chunks across host DRAM, local disk and a shared pool. See module docstring."""

    def __init__(self, config: StoreConfig, *, tiers: Sequence[Tier] | None = None, host: HostCache | None = None,
                 unavailable: Callable[[str, TierUnavailableError], None] | None = None,
                 thread_init: ThreadInit | None = None, faults: Faults | None = None) -> None:
        """Open host DRAM and the tiers ``config`` names; or, when ``tiers`` is given, use
        ``tiers`` (ordered fastest first) and ``host`` (None: no host DRAM) instead.
        ``faults``: tests only, faults to inject into the named tiers (``tiers.opening``).

        ``thread_init`` runs first in every thread the store starts (an engine's
        ``torch.cuda.set_device``: ``threads.py``). Raises TierUnavailableError when a directory
        cannot be used (unless ``unavailable`` is given: see ``tiers.opening.open_tiers``),
        ValueError on bad config.
        """
        self.config = config
        self.layout: KVLayout = config.layout
        self.chunk_tokens = config.chunk_tokens
        self.namespace: Namespace = config.namespace()
        if tiers is None and host is None and config.host_bytes > 0:
            host = HostCache(config.host_bytes, config.layout, config.chunk_tokens, prefault=config.host_prefault)
        self.host: HostCache | None = host
        self.tiers: list[Tier] = (list(tiers) if tiers is not None
                                  else open_tiers(config, unavailable, thread_init, faults))
        self.store_metrics = TierMetrics("store")
        self._failures = Failures(self.store_metrics)
        self._specs = Specs(config.layout, config.chunk_tokens, config.kv_codec, self.tiers, self._failures,
                            self.store_metrics)
        self._spec = self._specs.get
        spec = self._spec(self.namespace)  # describes the namespace in the disk and pool directories
        self._buffers = BufferPool(spec.file_bytes, 2 * config.io_threads)
        self._retention = Retention(self.store_metrics, self._failures, thread_init)
        self._writer = BackgroundWriter(config.write_queue_chunks or 1, config.write_threads,
                                        after_store=self._retention.landed, failures=self._failures,
                                        init=thread_init, nice=config.write_nice)
        self._guard = TierGuard(config.read_timeout_s, config.tier_cooldown_s, init=thread_init,
                                failures=self._failures)
        self._reader = PrefixReader(host, self._guard, self._buffers, self._failures, io_threads=config.io_threads,
                                    read_timeout_s=config.read_timeout_s, thread_init=thread_init)
        self._closed = False
        self.registry: CollectorRegistry = new_registry(
            {"store": self.store_metrics, **{t.name: t.metrics for t in self.levels}})

    @property
    def levels(self) -> list[Level]:
        """Where chunks are looked up, fastest first: host DRAM (if any), then the tiers."""
        return [self.host, *self.tiers] if self.host is not None else list(self.tiers)

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def open(cls, model_id: str, layout: KVLayout, chunk_tokens: int = 256, *,
             host_bytes: int | str = 1 << 30, disk_path: str | os.PathLike[str] | None = None,
             disk_bytes: int | str = 10 << 30, pool_url: str | None = None,
             pool_bytes: int | str | None = None, **options: Any) -> TieredStore:
        """Open a store; ``options`` are the other StoreConfig fields (io_threads, fsync, ...)."""
        config = StoreConfig(model_id=model_id, layout=layout, chunk_tokens=chunk_tokens,
                             host_bytes=parse_bytes(host_bytes, "host_bytes"),
                             disk_path=None if disk_path is None else os.fspath(disk_path),
                             disk_bytes=parse_bytes(disk_bytes, "disk_bytes"), pool_url=pool_url,
                             pool_bytes=None if pool_bytes is None else parse_bytes(pool_bytes, "pool_bytes"),
                             **options)
        return cls(config)

    @classmethod
    def from_config(cls, source: str | os.PathLike[str] | Mapping[str, Any] | None,
                    **overrides: Any) -> TieredStore:
        """Open from a YAML file or dict; ``KVTIER_*`` env vars and ``overrides`` win over it."""
        return cls(load_settings(source, **overrides))

    def set_codec_geometry(self, geometry: KVGeometry) -> None:
        """Where K and V sit in this store's chunks, for its ``kv_codec`` (an engine integration
        whose chunks are its pages as bytes states it once it has seen the pages)."""
        self._specs.set_geometry(geometry)

    def _namespace(self, tenant_salt: str | None) -> Namespace:
        return self.namespace if tenant_salt is None else self.namespace.with_salt(tenant_salt)

    def chunk_ids(self, tokens: TokenIds, *, extra: bytes = b"", tenant_salt: str | None = None,
                  max_chunks: int | None = None) -> list[ChunkId]:
        """Identities of the full chunks of ``tokens`` in this store's namespace."""
        return chunk_ids(self._namespace(tenant_salt), tokens, extra, max_chunks)

    # -- lookup -----------------------------------------------------------------------------

    def lookup(self, tokens: TokenIds, *, extra: bytes = b"", tenant_salt: str | None = None) -> LookupResult:
        """Longest prefix of ``tokens`` (whole chunks) held in any tier, and where each is."""
        return self.lookup_ids(self.chunk_ids(tokens, extra=extra, tenant_salt=tenant_salt))

    def lookup_ids(self, ids: Sequence[ChunkId]) -> LookupResult:
        """``lookup`` for chunk identities the caller already computed (``chunk_ids``)."""
        located = self._locate(ids, count_metrics=True)
        self.store_metrics.add(lookups=1, lookup_tokens=len(ids) * self.chunk_tokens,
                               hit_chunks=len(located), hit_tokens=len(located) * self.chunk_tokens)
        return LookupResult(len(located) * self.chunk_tokens, tuple(t.name for t in located),
                            self.chunk_tokens)

    def _locate(self, ids: Sequence[ChunkId], count_metrics: bool = False) -> list[Level]:
        """Host DRAM or the tier to read each chunk of the cached prefix from (``tiers.locate.locate``).

        Only public lookups count in the metrics, so a lookup-then-get counts once.
        """
        return locate(self.levels, self._guard, ids, count_metrics, self.chunk_tokens)

    # -- read -------------------------------------------------------------------------------

    def get(self, tokens: TokenIds, *, extra: bytes = b"", tenant_salt: str | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """KV of ``tokens`` (a whole number of chunks) as ``[layers, 2, len, heads, head_dim]``.

        ``out``: a tensor of exactly that shape and dtype to fill instead of allocating one
        (large fresh allocations cost page faults that can dominate a fast read).
        Raises KeyError if any chunk is no longer cached (or failed validation), ValueError if
        ``len(tokens)`` is not a multiple of ``chunk_tokens`` or ``out`` does not fit.
        """
        n_tokens = len(as_token_array(tokens))
        if n_tokens % self.chunk_tokens:
            raise ValueError(f"get() takes whole chunks: {n_tokens} tokens is not a multiple of "
                             f"chunk_tokens={self.chunk_tokens}; pass tokens[:lookup(tokens).num_tokens]")
        ids = self.chunk_ids(tokens, extra=extra, tenant_salt=tenant_salt)
        shape = self.layout.shape(n_tokens)
        if out is None:
            out = torch.empty(shape, dtype=self.layout.dtype)
        elif tuple(out.shape) != shape or out.dtype != self.layout.dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}; expected {shape} {self.layout.dtype}")
        c = self.chunk_tokens
        # The I/O threads copy with numpy (byte views): a single-threaded memcpy per call.
        # torch's copy_ would start OpenMP teams from every I/O thread at once, which
        # oversubscribes the cores the reads need (measured: 0.86 -> 0.91 of the raw device).
        target = out.view(torch.uint8).numpy() if out.device.type == "cpu" else None

        def sink(index: int, data: torch.Tensor) -> None:
            if target is None:
                out[:, :, index * c:(index + 1) * c].copy_(data)
            else:
                np.copyto(target[:, :, index * c:(index + 1) * c], data.view(torch.uint8).numpy())

        # With no host DRAM to promote into, a chunk the page cache holds is read straight into
        # ``out`` (one memory copy instead of two; its checksum verified there).
        place = None if target is None or self.host is not None or not out.is_contiguous() else Placement(
            partial(_chunk_views, target, c), lambda index: None)
        loaded = self.load_into(ids, sink, tenant_salt=tenant_salt, place=place, promote=place is None)
        if loaded.num_chunks < len(ids):
            raise KeyError(f"only {loaded.num_chunks} of {len(ids)} chunks are cached; call lookup() "
                           "again and recompute the rest")
        return out

    def load_into(self, ids: Sequence[ChunkId], sink: Sink, *,
                  tenant_salt: str | None = None, promote: bool = True,
                  stop: threading.Event | None = None, tiers: Sequence[str] | None = None,
                  place: Placement | None = None) -> PrefixLoad:
        """Hand the cached prefix of ``ids`` to ``sink(index, data)``, reading on the I/O threads.

        This is the fast path for callers that copy chunks somewhere (an output tensor, an
        engine's paged KV blocks): disk and pool chunks are read and handed over by the I/O
        threads themselves, so reads and copies of different chunks run at once once reads are
        slow enough for that to pay (``reader.FAST_READ_S``). ``sink`` may
        be called concurrently and in any order; ``data`` is valid only during the call.
        Returns the number of leading chunks delivered; a chunk after the first failure may
        have been handed over too and must be ignored. ``sink`` is never called after this
        returns, not even by a read that outlived ``read_timeout_s``. With ``promote=False`` disk and pool
        chunks are read into recycled buffers instead of host DRAM slots (for callers that keep
        the data themselves, like an engine's prefix cache: no page faults, no evictions).
        ``stop``: once set (e.g. the request was aborted), the load ends at the next chunk
        boundary (within ``STOP_POLL_S``) and returns what was delivered until then.
        ``tiers``: where a lookup already found each chunk (tier names, as ``LookupResult.chunk_tiers``):
        no lookup is repeated; each chunk is read from host DRAM if it holds it, else from that
        tier, and from the other tiers only when it is not there (at most ``len(tiers)`` chunks).
        ``place`` (with ``promote=False``): where chunks may be read straight into the caller's
        memory (``reader.Placement``); a chunk the disk tier or the pool serves from the page
        cache of a local filesystem lands there, validated, without a copy or a sink call, and
        the bytes of a chunk that failed there are garbage (as a sink's partial copies are).
        """
        self._check_open()
        spec = self._spec(self._namespace(tenant_salt))
        if tiers is None:
            located = self._locate(ids)
            self.store_metrics.add(load_lookups=len(ids))
        else:
            located = locate_named(self.host, self.tiers, self._guard, ids, tiers)
        return self._reader.load(ids, located, self.tiers, spec, sink, promote=promote, stop=stop, place=place)

    def iter_chunks(self, ids: Sequence[ChunkId], *, tenant_salt: str | None = None) -> Iterator[LoadedChunk]:
        """The cached prefix of ``ids`` as ``LoadedChunk``s, in order (a copy of each chunk).

        Built on ``load_into`` (the one read pipeline: parallel reads, timeouts, tier fallback),
        which it runs to the end before the first chunk is yielded; a caller that copies chunks
        somewhere should call ``load_into`` with its own sink instead and skip the copy.
        """
        copies: dict[int, torch.Tensor] = {}

        def keep(index: int, data: torch.Tensor) -> None:
            copies[index] = data.clone()  # ``data`` is only valid during the call

        loaded = self.load_into(ids, keep, tenant_salt=tenant_salt)
        for i, tier in enumerate(loaded.chunk_tiers):
            yield LoadedChunk(i, tier, copies[i])

    # -- write ------------------------------------------------------------------------------

    def put(self, tokens: TokenIds, kv: torch.Tensor, *, extra: bytes = b"",
            tenant_salt: str | None = None) -> PutResult:
        """Store the KV of every full chunk of ``tokens``; a trailing partial chunk is ignored.

        ``kv`` is ``[num_layers, 2, >= full-chunk tokens, num_kv_heads, head_dim]`` in the
        layout's dtype, on any device. The store copies what it keeps (once, into host DRAM);
        the caller keeps ``kv``. Never waits for disk or pool I/O.
        """
        self._check_open()
        namespace = self._namespace(tenant_salt)
        spec = self._spec(namespace)
        ids = chunk_ids(namespace, tokens, extra)
        self._check_kv(kv, len(ids) * self.chunk_tokens)
        c = self.chunk_tokens
        total = PutResult(0, 0, 0)
        for i, cid in enumerate(ids):
            one = self._put_chunk(cid, kv[:, :, i * c:(i + 1) * c], spec)
            total = PutResult(total.stored_chunks + one.stored_chunks, total.present_chunks + one.present_chunks,
                              total.dropped_writes + one.dropped_writes)
        return total

    def put_chunk(self, cid: ChunkId, data: ChunkData, *,
                  tenant_salt: str | None = None, skip_tiers: Collection[str] = ()) -> PutResult:
        """Store one chunk whose identity the caller computed (``chunk_ids``).

        ``data`` is the chunk (``[layers, 2, chunk_tokens, heads, head_dim]``, any device) or a
        function that fills the store's own buffer of that shape: engine integrations gather
        their paged KV straight into host DRAM that way, with no intermediate copy.
        ``skip_tiers``: names of lower tiers not to write it to (e.g. the shared pool, for a
        tensor-parallel rank whose KV another rank already writes there).
        """
        self._check_open()
        return self._put_chunk(cid, data, self._spec(self._namespace(tenant_salt)), skip_tiers)

    def put_chunk_now(self, cid: ChunkId, data: ChunkData, *,
                      tenant_salt: str | None = None) -> bool:
        """Write one chunk to every tier below host DRAM on the calling thread, bypassing host
        DRAM and the write queue: True once every tier holds it (stored now or already there).

        For integrations whose engine keeps its own host copy and calls from a background
        thread of its own (SGLang's HiCache backup thread): the answer is true, nothing is
        dropped, and a slow tier slows the caller (back-pressure) instead of filling a queue.
        ``data`` is as for ``put_chunk``; the retention of a session applies as it lands.
        """
        self._check_open()
        spec = self._spec(self._namespace(tenant_salt))
        raw = self._buffers.take()
        try:
            buffer = self._payload(raw, spec)
            _fill(buffer, data)
            return bool(self.tiers) and self._writer.write_now(Chunk(cid, buffer), spec, self.tiers)
        finally:
            self._buffers.give(raw)

    def begin_put(self, cid: ChunkId, *, tenant_salt: str | None = None,
                  skip_tiers: Collection[str] = ()) -> PendingPut | None:
        """Room for one chunk that the caller fills, possibly later (an asynchronous copy).

        Returns None when host DRAM already holds ``cid`` (nothing to do). Otherwise fill
        ``buffer`` (``[layers, 2, chunk_tokens, heads, head_dim]``, host memory; a host DRAM
        slot when one is free) and call ``commit`` once the bytes are there (the chunk becomes
        visible and its write-down is queued) or ``abandon``. Until then nobody reads it.
        """
        self._check_open()
        return self._begin_put(cid, self._spec(self._namespace(tenant_salt)), skip_tiers)

    def _begin_put(self, cid: ChunkId, spec: ChunkSpec, skip_tiers: Collection[str]) -> PendingPut | None:
        host = self.host
        slot: int | None = None
        if host is not None:
            if host.refresh(cid):  # not acquire: a save's presence check is not a read
                return None
            slot = host.reserve()
        lower = [t for t in self.tiers if t.name not in skip_tiers]
        if host is not None and slot is not None:
            buffer = host.slot_view(slot)

            def commit() -> PutResult:
                return PutResult(1, 0, 0 if self._write_down(host.commit(slot, cid), spec, lower) else 1)

            return PendingPut(buffer, commit, partial(host.abandon, slot))
        # No host tier, or every slot pinned by in-flight work: a recycled read buffer (page-locked
        # like the slab once ``pin_host_memory`` ran, so an accelerator's copy into it is
        # asynchronous too), back in the pool once written down or abandoned.
        raw = self._buffers.take()
        release = partial(self._buffers.give, raw)
        buffer = self._payload(raw, spec)

        def commit_own() -> PutResult:
            return PutResult(1, 0, 0 if self._write_down(Lease(Chunk(cid, buffer), release), spec, lower) else 1)

        return PendingPut(buffer, commit_own, release)

    def _put_chunk(self, cid: ChunkId, data: ChunkData,
                   spec: ChunkSpec, skip_tiers: Collection[str] = ()) -> PutResult:
        pending = self._begin_put(cid, spec, skip_tiers)
        if pending is None:
            return PutResult(0, 1, 0)
        try:
            _fill(pending.buffer, data)
        except BaseException:
            pending.abandon()
            raise
        return pending.commit()

    def _payload(self, raw: np.ndarray, spec: ChunkSpec) -> torch.Tensor:
        """The chunk tensor inside a ``BufferPool`` buffer (a chunk file's payload, after its header)."""
        return torch.from_numpy(raw[PAYLOAD_OFFSET:PAYLOAD_OFFSET + spec.payload_bytes]).view(
            self.layout.dtype).view(self.layout.shape(self.chunk_tokens))

    def _write_down(self, lease: Lease, spec: ChunkSpec, tiers: Sequence[Tier]) -> bool:
        """Queue a pinned chunk for ``tiers``; the pin is released once written or dropped."""
        if not tiers:
            lease.release()
            return True
        if self._writer.submit(lease.chunk, spec, tiers, on_done=lease.release):
            return True
        lease.release()
        return False

    def retain(self, ids: Sequence[ChunkId], until: float) -> None:
        """Keep ``ids`` in the disk tier and the pool ahead of unretained chunks until ``until``
        (epoch seconds), including any of them written later (``retention.py``). Never waits
        for I/O: the chunks already there are retained by a thread of their own, not queued
        behind (or dropped by) the write queue."""
        self._check_open()
        self._retention.retain(ids, until, self.tiers)

    def _check_kv(self, kv: torch.Tensor, min_tokens: int) -> None:
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        want = self.layout.shape(min_tokens)
        if kv.dim() != 5 or kv.shape[:2] != want[:2] or kv.shape[3:] != want[3:] or kv.shape[2] < min_tokens:
            raise ValueError(f"kv shape {tuple(kv.shape)} does not match the layout: expected "
                             f"[num_layers, 2, >= {min_tokens}, num_kv_heads, head_dim] = {list(want)}")
        if kv.dtype != self.layout.dtype:
            raise ValueError(f"kv dtype {kv.dtype} differs from the layout's {self.layout.dtype}")

    # -- lifecycle and metrics ----------------------------------------------------------------

    def pin_host_memory(self, register: Callable[[np.ndarray], bool]) -> bool:
        """Page-lock host DRAM and the read buffers with ``register`` (e.g. cudaHostRegister), so
        that an accelerator copies to and from them asynchronously. False if the slab was not."""
        self._buffers.register = register
        return self.host.pin_memory(register) if self.host is not None else True

    def flush(self) -> None:
        """Block until every queued background write (and retention) has been attempted."""
        self._writer.flush()
        self._retention.flush()

    def close(self) -> None:
        """Flush pending writes, stop threads, release tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._writer.flush()
        self._writer.close()
        self._reader.close()  # abandons reads still running: a hung filesystem must not hang exit
        self._retention.close()  # best effort, like a read: never hang exit
        self._guard.close()
        if self.host is not None:
            self.host.close()
        for tier in self.tiers:
            tier.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TieredStore is closed")

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def write_queue(self) -> int:
        """Chunks queued for background writes (not yet attempted)."""
        return self._writer.queued

    def metrics_snapshot(self) -> dict[str, Any]:
        """JSON-ready counters: ``{"store": {...}, "tiers": {name: {...}}, "write_queue": n}``."""
        return {
            "store": asdict(self.store_metrics.snapshot()),
            "tiers": {t.name: asdict(t.metrics.snapshot()) for t in self.levels},
            "write_queue": self._writer.queued,
        }


def _fill(buffer: torch.Tensor, data: ChunkData) -> None:
    if callable(data):
        data(buffer)
    else:
        buffer.copy_(data)


def _chunk_views(target: np.ndarray, chunk_tokens: int, index: int) -> list[memoryview]:
    """Chunk ``index``'s payload segments in a C-contiguous byte view of ``get``'s ``out``
    (``[layers, 2, tokens, heads, head_dim bytes]``), in payload order: one per layer and K/V.
    (Slices of one flat memoryview: a numpy view per segment costs several times as much.)"""
    layers, _, tokens = target.shape[:3]
    row = target.nbytes // (layers * 2 * tokens)  # bytes per token of one layer's K or V
    flat = target.reshape(-1).data
    size = chunk_tokens * row
    return [flat[(seg * tokens + index * chunk_tokens) * row:][:size] for seg in range(layers * 2)]
