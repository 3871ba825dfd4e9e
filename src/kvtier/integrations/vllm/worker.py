"""The connector's worker role: moves KV bytes between vLLM's paged cache and kvtier's store.

Runs beside the KV tensors, one per tensor-parallel rank. It owns that rank's store: host DRAM
(a slab in this process), the rank's own local disk directory, and the shared pool. It stores
each of its shards of a chunk (each KV head it holds, ``config.Sharding``) under the shard's own
key (``keys.shard_id``), so any tensor-parallel size reads them; for KV that several ranks
replicate (MLA's latent, a KV head shared by ranks), only the first replica writes it to the
pool. The bytes move through ``PageMover`` (``integrations/transfer.py``: streams and events on GPU).

* ``register_kv_caches`` finds each layer's pages from the tensors' shapes and strides
  (``paged.block_runs``) and checks them against the page size vLLM's KV cache config states.
  A layout it cannot handle turns the connector off for this engine with one error line (the
  engine keeps serving, with no hits) instead of crashing or moving wrong bytes.
* Loads: a background load (``load_mode: async``) starts in ``start_load_kv`` and reads the
  chunks straight into the waiting request's blocks while the engine runs other requests, each
  from the tier the scheduler's lookup found it in (no second lookup; a lower tier only when it
  is gone from there);
  ``get_finished`` reports it once it is done (on every rank: vLLM waits for all; when one is
  done, it waits up to ``load_coalesce_ms`` for others about to be, so that their requests are
  prefilled in the same step), and its
  blocks that could not be read are reported through ``get_block_ids_with_load_errors`` in the
  same step (vLLM recomputes from there). A request aborted while loading stops its load; it
  is still reported finished, and only once no byte will be written to its blocks any more.
  A synchronous load (``load_mode: sync``) reads before the forward pass that needs it.
* Saves: after each forward pass ``wait_for_save`` copies every chunk that became complete
  into host DRAM; disk and pool writes happen in the background and never block the engine
  (a full queue drops and counts). Chunks of finished requests (their generated tokens too)
  arrive the same way; those requests are reported in ``get_finished`` once copied.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier.config import StoreConfig
from kvtier.integrations.paged import LayoutError, PagedKV, head_dim_of
from kvtier.integrations.transfer import Loaded, LoadJob, PageMover
from kvtier.integrations.vllm.common import (
    KVTierMetadata,
    KVTierWorkerMeta,
    Load,
    LoadTime,
    PrefillSample,
    ReadSample,
    SyncLoad,
    TierChange,
    tier_unavailable,
)
from kvtier.integrations.vllm.config import ConnectorConfig, Deployment
from kvtier.integrations.vllm.counters import count, new_counters
from kvtier.integrations.vllm.stats import LOOKUP_FIELDS, flatten
from kvtier.keys import ChunkId, shard_id
from kvtier.store import TieredStore
from kvtier.threads import Failures, ThreadInit, thread
from kvtier.tiers import kinds
from kvtier.tiers.base import Tier
from kvtier.tiers.kinds import SHARED

log = logging.getLogger(__name__)

MAX_EVICTIONS_QUEUED = 1 << 16  # keys read from the pool's eviction log, waiting for a report
IDLE_WAIT_S = 0.005  # how long a step without a forward pass waits for a background load to end
EVICTIONS_READ_S = 1.0  # how often the first rank reads the pool's eviction log (KV events on)


class WorkerRole:
    """See the module docstring."""

    def __init__(self, connector_config: ConnectorConfig, store_config: StoreConfig, dep: Deployment, rank: int,
                 counters: dict[str, int], events: bool = False) -> None:
        self.connector_config, self.store_config, self.dep, self.rank = connector_config, store_config, dep, rank
        self.counters = new_counters(counters)
        self.block_size = dep.block_size
        self.chunk_tokens = store_config.chunk_tokens
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        self.shards = dep.sharding.shards_of(rank)  # the head shards (or the one rank shard) it holds
        # Replicas of a shard (MLA's latent KV on every rank) reach the shared pool once.
        self.skip_tiers: tuple[str, ...] = () if dep.sharding.writes_pool(rank) else SHARED
        self.store: TieredStore | None = None
        self.paged: PagedKV | None = None
        self.mover: PageMover | None = None
        self.disabled = False
        self.asleep = False  # vLLM's sleep mode released the KV cache's memory (``sleep``)
        self._slept: set[str] = set()  # requests whose background load ``sleep`` stopped
        self._reported_disabled = False
        self._failed_blocks: set[int] = set()
        self._jobs: dict[str, tuple[LoadJob, Load]] = {}
        self._recved: set[str] = set()  # background loads done, to report
        self._idle = False  # the bound step runs no forward pass
        self._holding: set[str] = set()  # finished requests whose blocks vLLM holds for our saves
        self._forward: tuple[int, Any] | None = None  # (tokens, start) of a forward pass being timed
        self._timed: list[tuple[int, Any, Any]] = []  # CUDA: (tokens, start, end) events not yet complete
        self._prefill_samples: list[PrefillSample] = []
        self._reads: list[ReadSample] = []
        # KV events: the first rank reports its disk and pool changes (and the pool's evictions
        # by anyone) to the scheduler, which publishes them.
        self.events = events and rank == 0
        self._evictions: EvictionReader | None = None
        self._sync_loads: list[SyncLoad] = []  # this step's synchronous loads, to report
        self._unavailable: list[str] = []  # tiers this rank's store left out, to report once
        self.profiles = connector_config.profile_file is not None  # the scheduler keeps a resume profile
        self._load_times: list[LoadTime] = []
        self.coalesce_s = connector_config.load_coalesce_ms / 1e3

    def _disable(self, why: str) -> None:
        self.disabled = True
        self.counters["disabled"] = 1
        log.error("kvtier: connector disabled on rank %d, the engine serves without cache hits: %s", self.rank, why)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None) -> None:
        """Map vLLM's KV tensors (``num_blocks`` blocks each; None: their first dim) to pages and
        open this rank's store, or disable the connector (see the module docstring)."""
        names = [n for n in self.dep.layer_names if n in kv_caches] or list(kv_caches)
        missing = set(self.dep.layer_names) - set(kv_caches)
        if missing:
            self._disable(f"vLLM registered no KV cache for layers {sorted(missing)[:4]}")
            return
        if num_blocks is None:
            num_blocks = kv_caches[names[0]].shape[0]
        tensors = [kv_caches[n] for n in names]
        sharding = self.dep.sharding
        try:
            if sharding.by_heads:
                heads = sharding.rank_shards
                dims = [head_dim_of(t, heads) for t in tensors]
                if heads > 1 and None in dims:
                    raise LayoutError(f"no dimension of its {heads} KV heads in a tensor of shape "
                                      f"{tuple(tensors[dims.index(None)].shape)}")
                paged = PagedKV(tensors, num_blocks, heads=heads, head_dims=dims)
            else:
                paged = PagedKV(tensors, num_blocks)
        except LayoutError as exc:
            self._disable(f"KV cache layout not supported: {exc}")
            return
        if set(paged.layer_block_bytes) != {self.dep.shard_block_bytes}:
            self._disable(f"KV pages of {sorted(set(paged.layer_block_bytes))} bytes per block per layer and shard, "
                          f"but vLLM's KV cache config states {self.dep.shard_block_bytes} "
                          f"(layout {self.dep.kv_format})")
            return
        self.paged = paged
        log.info("kvtier: rank %d: %d layers, %d page runs per block, %d bytes per block, %s", self.rank,
                 len(names), len(paged.runs), paged.block_bytes, self.dep.kv_format)
        self.open_store()

    def _left_out(self, name: str, exc: Exception) -> None:
        tier_unavailable(self.counters, name, exc)
        self._unavailable.append(name)

    def _thread_init(self) -> Callable[[], None] | None:
        """Every thread kvtier starts in this process sets the engine's device first: without it a
        CUDA call there creates a context on GPU 0, whatever rank this is."""
        if self.paged is None or self.paged.device.type != "cuda":
            return None
        device = self.paged.device
        return lambda: torch.cuda.set_device(device)

    def open_store(self) -> None:
        init = self._thread_init()
        store = TieredStore(self.store_config, unavailable=self._left_out, thread_init=init,
                            faults=self.connector_config.inject_faults)
        if store.host is not None:
            store.host.track_changes()
        if self.events:
            for tier in store.tiers:
                if tier.journal is not None:
                    tier.journal.enable()
            # The pool's eviction log lives on a shared filesystem: read off the engine thread.
            self._evictions = EvictionReader(store.tiers, EVICTIONS_READ_S, init)
        self.store = store
        if self.paged is not None:
            self.mover = PageMover(self.paged, store, self.blocks_per_chunk, thread_init=init)
            if self.store_config.kv_codec != "none":
                geometry = self.paged.kv_geometry(self.dep.num_layers, self.dep.block_size, self.blocks_per_chunk)
                if geometry is None:
                    log.warning("kvtier: kv_codec %s needs bfloat16, float16 or float32 KV pages (layout %s): "
                                "chunks are stored as they are", self.store_config.kv_codec, self.dep.kv_format)
                else:
                    store.set_codec_geometry(geometry)

    def _usable(self) -> PageMover | None:
        return None if self.disabled or self.asleep else self.mover

    def sleep(self) -> None:
        """vLLM's sleep mode (0.33+) releases the KV cache's memory until ``wake``. vLLM has
        drained its own transfers; kvtier's that still touch the KV tensors end here: background
        loads are stopped and awaited (up to ``read_timeout_s``), save gathers are completed and
        published. A load stopped here is a failed load, every block of it (their memory is
        released: vLLM must recompute the request, not trust what was read before). Until
        ``wake`` no byte moves in or out of the KV cache: a load is a failed load, a save is
        skipped. Idempotent."""
        self.asleep = True
        jobs = [job for job, _ in self._jobs.values()]
        self._slept.update(self._jobs)
        for job in jobs:
            job.stop()
        LoadJob.wait_all(jobs, self.store_config.read_timeout_s)
        if self.mover is not None:
            self.mover.fence()
            self.mover.poll_saves(wait=True)
        log.info("kvtier: rank %d asleep (vLLM sleep mode): no KV moves until the wake-up", self.rank)

    def wake(self) -> None:
        """vLLM woke up and the KV cache's memory is back at the same addresses: moves resume."""
        self.asleep = False

    # ---------------------------------------------------------------- each step

    def bind(self, meta: KVTierMetadata) -> None:
        mover = self.mover
        if mover is not None:
            mover.fence()  # this step's kernels run after the last step's save gathers
            mover.poll_saves()
        # vLLM binds the metadata before the forward pass and calls wait_for_save after it: a
        # big step without loads times prefill from here (with events on an accelerator).
        self._idle = meta.num_tokens == 0
        big = meta.num_tokens >= 4 * self.block_size and not meta.loads and not self._jobs  # reads share the cores
        self._forward = (meta.num_tokens, self._mark()) if big else None

    def _mark(self) -> Any:
        if self.paged is not None and self.paged.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def handle_preemptions(self) -> None:
        """Called by vLLM's runner at the start of a step, before it touches any block (zeroing
        reused blocks, preempted requests' blocks going to others): the compute stream waits for
        the gathers of the saves issued so far, so none of them copies a block overwritten after."""
        if self.mover is not None:
            self.mover.fence()

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        # A step's synchronous loads run at once, each on a loader thread (two requests that
        # arrived together at an idle engine: their reads overlap instead of queueing); one
        # alone runs on this thread.
        together = sum(1 for load in meta.loads if not load.background) > 1
        in_step: list[tuple[Load, LoadJob]] = []
        for load in meta.loads:
            mover = self._usable()
            ids = self._shard_ids(load.chunk_ids)
            tiers = [t for t in load.chunk_tiers for _ in self.shards] if load.chunk_tiers else None
            if mover is not None and not load.background and together:
                in_step.append((load, mover.submit_load(ids, load.block_ids, tenant_salt=load.salt, tiers=tiers)))
            elif mover is not None and not load.background:
                self._sync_done(load, mover.load(ids, load.block_ids, tenant_salt=load.salt, tiers=tiers))
            elif mover is None:  # disabled: every block is a load error, and a background load is over
                self._finish_load(load, Loaded(0, (), 0.0), time.monotonic())
                if load.background:
                    self._recved.add(load.req_id)
                else:
                    self._sync_loads.append(SyncLoad(load.req_id, False))
            else:
                self._jobs[load.req_id] = (mover.submit_load(ids, load.block_ids, tenant_salt=load.salt,
                                                             tiers=tiers), load)
        for load, job in in_step:
            self._sync_done(load, job.result())

    def _sync_done(self, load: Load, got: Loaded) -> None:
        """A synchronous load is over: count it, and report whether it delivered every chunk."""
        self._finish_load(load, got, got.started)
        self._sync_loads.append(SyncLoad(load.req_id, got.num_chunks == len(load.chunk_ids)))

    def _shard_ids(self, ids: list[ChunkId]) -> list[ChunkId]:
        """This rank's shard ids of logical chunks ``ids``: each chunk's shards, in order."""
        n = self.dep.sharding.num_shards
        return [shard_id(c, s, n) for c in ids for s in self.shards]

    def _finish_load(self, load: Load, got: Loaded, submitted: float) -> None:
        """Count a load that is over; its blocks past the delivered chunks are load errors."""
        bpc, n = self.blocks_per_chunk, got.num_chunks
        slowest = functools.reduce(kinds.slowest, got.chunk_tiers) if n else ""
        if n:
            self._reads.append(ReadSample(slowest, n * len(self.shards) * self.store_config.chunk_bytes, got.seconds))
        if self.profiles:
            started = got.started or submitted
            self._load_times.append(LoadTime(load.req_id, self.rank, submitted, started, started + got.seconds,
                                             time.monotonic(), n, got.read_s, got.copy_s, slowest))
        slept = load.req_id in self._slept  # stopped by ``sleep``: nothing it read survives
        self._slept.discard(load.req_id)
        filled = sum(1 for b in load.block_ids[:n * bpc] if b is not None)
        count(self.counters, "loaded_tokens", n=0 if slept else filled * self.block_size)
        if got.stopped and not slept:
            count(self.counters, "stopped_loads")
            return  # an aborted request: vLLM frees its blocks, no recompute to ask for
        n = 0 if slept else n
        failed = [b for b in load.block_ids[n * bpc:] if b is not None]
        log.debug("kvtier: loaded %d of %d chunks of %s in %.1f ms", n, len(load.chunk_ids), load.req_id,
                  got.seconds * 1e3)
        if failed:
            count(self.counters, "failed_blocks", n=len(failed))
            log.warning("kvtier: %d of %d chunks of %s could not be loaded on rank %d; vLLM recomputes them",
                        len(load.chunk_ids) - n, len(load.chunk_ids), load.req_id, self.rank)
            self._failed_blocks.update(failed)

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        if self._forward is not None:
            tokens, start = self._forward
            self._forward = None
            if isinstance(start, float):
                self._prefill_samples.append(PrefillSample(tokens, time.perf_counter() - start))
            else:
                self._timed.append((tokens, start, self._mark()))
        self._collect_timings()
        mover = self._usable()
        self._holding.update(meta.finished)
        if mover is None:
            return
        bpc, num_shards = self.blocks_per_chunk, self.dep.sharding.num_shards
        finished = set(meta.finished)
        for save in meta.saves:
            tag = save.req_id if save.req_id in finished else None
            for i, cid in enumerate(save.chunk_ids):
                blocks = save.block_ids[i * bpc:(i + 1) * bpc]
                if any(b is None for b in blocks):
                    continue
                saved = [mover.save(shard_id(cid, s, num_shards), blocks, shard=j,  # type: ignore[arg-type]
                                    skip_tiers=self.skip_tiers, tag=tag, tenant_salt=save.salt)
                         for j, s in enumerate(self.shards)]
                if any(saved):
                    count(self.counters, "saved_chunks")
            if save.retain_until is not None:
                # Chunks host DRAM already had are not written again: retained where they are.
                mover.store.retain(self._shard_ids(save.chunk_ids), save.retain_until)
        for keep in meta.retains:
            mover.store.retain(self._shard_ids(keep.chunk_ids), keep.until)

    def _collect_timings(self) -> None:
        """Prefill times measured with CUDA events, once the GPU has run them."""
        while self._timed and self._timed[0][2].query():
            tokens, start, end = self._timed.pop(0)
            self._prefill_samples.append(PrefillSample(tokens, start.elapsed_time(end) / 1e3))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose held blocks were copied, requests whose background load is over)."""
        for req_id in finished_req_ids & self._jobs.keys():
            self._jobs[req_id][0].stop()  # aborted while loading: end it at the next chunk
        if self._idle and self._jobs:
            # No forward pass in this step: nobody decodes, and the engine would only spin
            # empty steps until a load is done. Waiting a little here reports it sooner.
            LoadJob.wait_any([job for job, _ in self._jobs.values()], IDLE_WAIT_S)
        if self._collect_loads() and self._jobs and self.coalesce_s:
            # Requests whose loads end together are prefilled together: wait a little for the
            # loads about to end rather than leave them a whole step (a prefill) behind.
            now = time.monotonic()
            soon = [job for job, _ in self._jobs.values()
                    if (eta := job.eta_s(now)) is not None and eta <= self.coalesce_s]
            if soon:
                LoadJob.wait_all(soon, self.coalesce_s)
                count(self.counters, "coalesced_loads", n=self._collect_loads())
        recved, self._recved = self._recved, set()
        mover = self.mover
        if mover is not None:
            mover.poll_saves()
        sent = {r for r in self._holding if mover is None or not mover.saves_pending(r)}
        self._holding -= sent
        return sent or None, recved or None

    def _collect_loads(self) -> int:
        """Move the background loads that are over to ``_recved``; how many there were."""
        done = [(req_id, job, load) for req_id, (job, load) in self._jobs.items() if job.done()]
        for req_id, job, load in done:
            del self._jobs[req_id]
            self._finish_load(load, job.result(), job.submitted)
            self._recved.add(req_id)
        return len(done)

    def _tier_changes(self) -> list[TierChange]:
        """The disk and pool tiers' changes since the last report (first rank, KV events on)."""
        if not self.events or self.store is None:
            return []
        out: list[TierChange] = []
        for tier in self.store.tiers:
            if tier.journal is not None:  # host DRAM's changes travel apart: host_changes
                out.extend(TierChange(tier.name, added, key) for added, key in tier.journal.drain())
        if self._evictions is not None:
            out.extend(TierChange(name, False, key) for name, key in self._evictions.drain())
        return out

    def report(self) -> KVTierWorkerMeta | None:
        """This step's report for the scheduler (None when there is nothing to say)."""
        changes = self.store.host.drain_changes() if self.store is not None and self.store.host else []
        tier_changes = self._tier_changes()
        disabled = self.disabled and not self._reported_disabled
        if not changes and not tier_changes and not self._reads and not self._prefill_samples and not disabled \
                and not self._sync_loads and not self._unavailable and not self._load_times:
            return None
        self._reported_disabled = self.disabled
        reads, self._reads = self._reads, []
        prefill, self._prefill_samples = self._prefill_samples, []
        sync_loads, self._sync_loads = self._sync_loads, []
        unavailable, self._unavailable = self._unavailable, []
        load_times, self._load_times = self._load_times, []
        return KVTierWorkerMeta(host_changes={self.rank: [(added, bytes(key)) for added, key in changes]},
                                reads=reads, prefill=prefill, disabled=[self.rank] if disabled else [],
                                tier_changes=tier_changes, sync_loads=sync_loads,
                                unavailable={self.rank: unavailable} if unavailable else {}, load_times=load_times)

    @property
    def loads_in_flight(self) -> int:
        return len(self._jobs)

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def stats(self) -> tuple[dict[str, float], dict[str, float]]:
        """(counters, gauges) for vLLM's /metrics (``stats.flatten``): every tier counter but the
        scheduler's lookups; request-level counters on the first rank only."""
        store = self.store
        tiers = {t.name: t.metrics.snapshot() for t in store.levels} if store is not None else {}
        out, gauges = flatten(dict(self.counters), tiers, first_rank=self.rank == 0,
                              tier_fields=lambda name: name not in LOOKUP_FIELDS)
        gauges["kvtier_write_queue_chunks"] = float(store.write_queue if store is not None else 0)
        if self.rank == 0:
            gauges["kvtier_loads_in_flight"] = float(self.loads_in_flight)
        gauges["kvtier_disabled"] = float(self.disabled)
        return out, gauges

    def snapshot(self) -> dict[str, Any]:
        return self.store.metrics_snapshot() if self.store is not None else {}

    def close(self) -> None:
        if self._evictions is not None:
            self._evictions.close()
        for job, _ in self._jobs.values():
            job.stop()
        if self.mover is not None:
            self.mover.close()
        if self.store is not None:
            self.store.close()


class EvictionReader:
    """Reads the tiers' eviction logs (the shared pool's ``.evicted``) every ``interval_s`` on a
    thread of its own, so a slow or hung shared filesystem never stalls the engine's step; keeps
    at most ``MAX_EVICTIONS_QUEUED`` keys (the oldest go first) until ``drain``."""

    def __init__(self, tiers: Sequence[Tier], interval_s: float, init: ThreadInit | None = None) -> None:
        self._tiers = list(tiers)
        self._interval_s = interval_s
        self._keys: collections.deque[tuple[str, bytes]] = collections.deque(maxlen=MAX_EVICTIONS_QUEUED)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failures = Failures()
        for tier in self._tiers:
            tier.read_evictions()  # start at the log's end (only later evictions are news)
        self._thread = thread(self._run, "kvtier-evictions", init)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            for tier in self._tiers:
                keys = self._failures.call(f"reading the {tier.name} tier's evictions", tier.read_evictions)
                if not keys:
                    continue
                with self._lock:
                    self._keys.extend((tier.name, key) for key in keys)

    def drain(self) -> list[tuple[str, bytes]]:
        with self._lock:
            out = list(self._keys)
            self._keys.clear()
        return out

    def close(self) -> None:
        self._stop.set()
