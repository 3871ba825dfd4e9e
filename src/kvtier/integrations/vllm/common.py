"""What the scheduler and the workers tell each other, and the helpers both roles use.

The scheduler sends ``KVTierMetadata`` to every worker each step (vLLM pickles it); each
worker answers with ``KVTierWorkerMeta``, which vLLM folds over the ranks with ``aggregate``.
Chunk ids in the metadata are *logical*: each rank derives its own shard ids from them
(``keys.shard_id``, one per KV head it holds), so the metadata does not grow with the
tensor-parallel size.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.fileio import write_atomic
from kvtier.integrations.vllm.counters import count
from kvtier.keys import ChunkId

log = logging.getLogger(__name__)

METRICS_INTERVAL_S = 5.0  # how often a running connector rewrites its metrics_file


@dataclass(frozen=True)
class Load:
    """Chunks of one request to read into its blocks before the forward pass.

    ``block_ids[j]`` is the vLLM block of the j-th block covered by ``chunk_ids`` (None: leave
    that block alone, its tokens are already computed or beyond the load).
    """

    req_id: str
    chunk_ids: list[ChunkId]
    block_ids: list[int | None]
    background: bool = False
    """Read in the background and report completion through ``get_finished``."""
    salt: str | None = None
    """The request's ``cache_salt`` (None: the store's own tenant): chunk files are read and
    checked under the namespace their keys were made in."""
    chunk_tiers: tuple[str, ...] = ()
    """The tier the scheduler's lookup found each chunk in (the slowest any rank reads it from);
    the workers read from there without looking the chunks up again. Empty: look up."""


@dataclass(frozen=True)
class Save:
    """Chunks of one request to copy out of its blocks after the forward pass (``block_ids`` as
    in ``Load``; a chunk with any None block is not saved)."""

    req_id: str
    chunk_ids: list[ChunkId]
    block_ids: list[int | None]
    salt: str | None = None
    retain_until: float | None = None
    """Keep these chunks in the disk tier and the pool ahead of unretained ones until then
    (epoch seconds): the request's session asked for retention."""


@dataclass(frozen=True)
class Retain:
    """Chunks a retained session already had when it was scheduled (vLLM's own hit, its load):
    kept in the disk tier and the pool until ``until`` (epoch seconds) like its saves."""

    req_id: str
    chunk_ids: list[ChunkId]
    until: float


class ReadSample(NamedTuple):
    """One rank's load: ``nbytes`` in ``seconds``, from ``tier`` (the slowest it read from)."""

    tier: str
    nbytes: int
    seconds: float


class PrefillSample(NamedTuple):
    """A forward pass that computed ``tokens`` tokens in ``seconds``."""

    tokens: int
    seconds: float


class TierChange(NamedTuple):
    """The first rank's ``tier`` added (or removed) the chunk whose shard key is ``key``."""

    tier: str
    added: bool
    key: bytes


class SyncLoad(NamedTuple):
    """A synchronous load of ``req_id`` ran this step; ``complete``: it delivered every chunk."""

    req_id: str
    complete: bool


@dataclass(frozen=True)
class LoadTime:
    """Where one rank's load of one request spent its time (``time.monotonic()`` seconds, one
    clock for every process of the machine): for the resume profile (``profile.py``)."""

    req_id: str
    rank: int
    submitted: float  # the load was handed to a loader thread (= started for a synchronous load)
    started: float  # it began reading
    ended: float  # its last chunk was in the blocks
    reported: float  # the rank told vLLM (get_finished; a synchronous load: ended)
    chunks: int
    read_s: float  # reading and validating, summed over chunks (they overlap across I/O threads)
    copy_s: float  # copying into the blocks, summed over chunks
    tier: str  # the slowest tier a chunk came from ("" when none was delivered)


@dataclass
class KVTierMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One scheduler step's work for every worker: loads before the forward pass, saves after."""

    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    num_tokens: int = 0  # tokens this step computes (for the worker's prefill rate)
    retains: list[Retain] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    """Finished requests whose blocks vLLM holds for kvtier (``request_finished`` said so):
    each rank reports them in ``get_finished`` once this step's saves of them are copied."""


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What the workers tell the scheduler after a step.

    ``host_changes``: per rank, ``(added, key)`` events of that rank's host tier, oldest first
    (keys are the rank's shard keys). ``reads``: one ``ReadSample`` per load. ``prefill``: a
    ``PrefillSample`` of each forward pass that computed many tokens. ``disabled``: ranks whose
    connector turned itself off (a KV layout it cannot handle): the scheduler stops reporting
    hits. ``tier_changes``: ``TierChange``s of the first rank's disk and pool tiers (with KV
    events on), evictions by other instances too.
    ``sync_loads``: a ``SyncLoad`` for each synchronous load this step ran:
    until every rank reported it, the scheduler saves none of that request's chunks (they were
    computed over the loaded blocks). ``unavailable``: per rank, tiers its store left out (a
    directory it could not open): the scheduler stops looking there for that rank.
    """

    host_changes: dict[int, list[tuple[bool, bytes]]] = field(default_factory=dict)
    reads: list[ReadSample] = field(default_factory=list)
    prefill: list[PrefillSample] = field(default_factory=list)
    disabled: list[int] = field(default_factory=list)
    tier_changes: list[TierChange] = field(default_factory=list)
    sync_loads: list[SyncLoad] = field(default_factory=list)
    unavailable: dict[int, list[str]] = field(default_factory=dict)
    load_times: list[LoadTime] = field(default_factory=list)
    """One per load that ended this step, when the scheduler keeps a resume profile."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Fold another rank's report into this one (vLLM calls it over all ranks)."""
        if isinstance(other, KVTierWorkerMeta):
            for rank, changes in other.host_changes.items():
                self.host_changes.setdefault(rank, []).extend(changes)
            self.reads.extend(other.reads)
            self.prefill.extend(other.prefill)
            self.disabled.extend(other.disabled)
            self.tier_changes.extend(other.tier_changes)
            self.sync_loads.extend(other.sync_loads)
            for rank, names in other.unavailable.items():
                self.unavailable.setdefault(rank, []).extend(names)
            self.load_times.extend(other.load_times)
        return self


def tier_unavailable(counters: dict[str, int], name: str, exc: Exception) -> None:
    """A disk or pool directory that cannot be used: serve without it (recompute), loudly."""
    count(counters, "unavailable_tiers")
    count(counters, "unavailable", name)
    log.error("kvtier: the %s tier is unavailable and left out; the engine serves without it: %s", name, exc)


class MetricsFile:
    """``<base>.<role>.json``, rewritten every few seconds while serving and at shutdown.

    Every few seconds, not only at shutdown: vLLM 0.32 can kill the engine core before the
    scheduler's connector shuts down, and operators want live numbers. For the same reason the
    scheduler's connector also writes it whenever the engine drains (``request_finished``).
    """

    def __init__(self, base: str | None, role: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.path = f"{base}.{role}.json" if base else None
        self._snapshot = snapshot
        self._written = time.monotonic()

    def write(self) -> None:
        if self.path is None:
            return
        self._written = time.monotonic()
        try:
            write_atomic(self.path, json.dumps(self._snapshot()).encode())
        except OSError as exc:
            log.warning("kvtier: cannot write metrics_file %s: %s", self.path, exc)

    def maybe_write(self) -> None:
        if self.path is not None and time.monotonic() - self._written >= METRICS_INTERVAL_S:
            self.write()
