"""The protocol every tier speaks, and the named results it returns.

A tier holds whole chunks in kvtier's canonical layout. Misses, corrupt data, I/O errors and
timeouts are *results*, never exceptions: the store turns any of them into "this chunk and
everything after it is not cached", which costs at most a recompute.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from kvtier.format import ALIGN, ChunkSpec
from kvtier.keys import ChunkId, ChunkKey
from kvtier.metrics import TierMetrics


@dataclass(frozen=True)
class Chunk:
    """One chunk of KV in host memory.

    ``data`` is a contiguous CPU tensor ``[num_layers, 2, chunk_tokens, num_kv_heads,
    head_dim]``. Tiers never write into it once published: several readers may share it.
    """

    id: ChunkId
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def payload(self) -> memoryview:
        """The raw bytes of ``data`` (no copy)."""
        return self.data.reshape(-1).view(torch.uint8).numpy().data


class Status(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    CORRUPT = "corrupt"
    ERROR = "error"
    TIMEOUT = "timeout"
    WRITTEN = "written"
    EXISTS = "exists"
    FAILED = "failed"
    STOPPED = "stopped"
    """A load's read that began after the load was over (``Pages.enter`` refused): nothing was
    read, and nothing is known of the chunk (unlike MISS, which says it is gone)."""


@dataclass(frozen=True)
class LoadResult:
    status: Status
    chunk: Chunk | None = None
    error: str = ""
    from_cache: bool = False
    """The bytes came from memory (the page cache of a local filesystem), not a device or a
    server: a read that was slow anyway waited for a CPU, and more reader threads would not help
    it. False when unknown."""
    in_place: bool = False
    """The payload was read straight into the load's ``Pages`` (validated there); ``chunk`` is None."""

    @property
    def ok(self) -> bool:
        return self.status is Status.HIT


@dataclass(frozen=True)
class Pages:
    """The caller's memory that a tier may read one chunk's payload straight into, instead of
    reading the whole file into ``into`` and having it copied from there (``Tier.load``).

    ``views``: writable, C-contiguous byte buffers whose sizes add up to the spec's
    ``payload_bytes``, in payload order (an engine's KV pages: ``PagedKV.page_views``).
    ``enter`` before writing there, ``leave`` after: ``enter`` returning False means the load is
    over and the memory is no longer the caller's (write nothing). A tier writes there only what
    a plain memory copy delivers (a page-cache hit of a local filesystem), so ``leave`` is never
    far behind ``enter``. Bytes written there are validated afterwards: on any result but
    ``in_place`` HIT they are garbage the caller must not use.
    """

    views: Sequence[memoryview]
    enter: Callable[[], bool]
    leave: Callable[[], None]


@dataclass(frozen=True)
class StoreResult:
    status: Status
    error: str = ""


class Level(Protocol):
    """Where chunks can be found: the host DRAM cache or a tier. The store's lookup walk
    (``tiers.locate``) and its timeout guard need only this."""

    name: str
    metrics: TierMetrics
    may_hang: bool
    """Lookups may block (a network filesystem): the store bounds them with ``read_timeout_s``."""

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        """How many of ``ids``, from the first on, this level holds (stops at its first miss).

        Cheap and side-effect free apart from counters; a later read may still miss.
        """
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class Tier(Level, Protocol):
    """lookup / load / store / evict over whole chunks in storage below host DRAM (local disk,
    a shared pool, Redis), all thread-safe. Chunks are copied in and out; nobody holds a
    tier's memory (contrast ``tiers.host.HostCache``)."""

    def load(self, chunk: ChunkId, spec: ChunkSpec, into: np.ndarray | None = None) -> LoadResult:
        """Read one chunk, fully validated against ``chunk`` and ``spec``.

        ``into``: a 4096-aligned buffer of ``spec.file_bytes`` to read the chunk file into (the
        result's data is then a view of it); the tier allocates one when None. On a failed
        load the buffer's content is undefined.

        A tier whose ``reads_in_place`` is true also takes ``pages`` (a keyword, ``Pages``):
        where it can, it reads the payload straight there and answers ``in_place``.
        """
        ...

    def store(self, chunk: Chunk, spec: ChunkSpec) -> StoreResult:
        """Publish one chunk; EXISTS if already held. Never raises for I/O faults."""
        ...

    def evict(self, target_bytes: int) -> int:
        """Evict least recently used chunks until at most ``target_bytes`` remain; count them."""
        ...

    # Optional features: a tier without one inherits TierBase's default (may_hang too).

    @property
    def journal(self) -> ChangeJournal | None:
        """Its additions and removals, for KV events (None: it reports none)."""
        ...

    def retain(self, key: ChunkKey, until: float) -> bool:
        """Keep the chunk ahead of unretained ones until ``until`` (epoch s); False: not held, or
        this tier does not retain."""
        ...

    def read_evictions(self) -> list[bytes]:
        """Keys evicted by anyone sharing this tier since the last call (a shared pool)."""
        ...

    def describe_namespace(self, digest: bytes, info: dict[str, object]) -> None:
        """Record what a namespace is (model, layout, ...) where operators look (a directory)."""
        ...


class TierBase:
    """The defaults of the protocol's optional features, for tiers to inherit."""

    may_hang = False
    journal: ChangeJournal | None = None
    reads_in_place = False
    """``load`` takes ``pages`` (see ``Tier.load``)."""

    def retain(self, key: ChunkKey, until: float) -> bool:
        return False

    def read_evictions(self) -> list[bytes]:
        return []

    def describe_namespace(self, digest: bytes, info: dict[str, object]) -> None:
        return

    def time_read(self, chunk: ChunkId, max_bytes: int) -> tuple[int, float] | None:
        """Read ``chunk``'s bytes without validating, keeping or removing anything and return
        (bytes, seconds): a read rate before any load (None: this tier cannot, or the read failed)."""
        return None


class ChangeJournal:
    """``(added, key)`` changes of a tier, kept only once ``enable`` was called: an engine
    integration ships them to the process that publishes KV events. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changes: list[tuple[bool, bytes]] | None = None

    def enable(self, present: Iterable[bytes] = ()) -> None:
        with self._lock:
            if self._changes is None:
                self._changes = [(True, key) for key in present]

    def record(self, added: bool, key: bytes) -> None:
        if self._changes is not None:
            with self._lock:
                if self._changes is not None:
                    self._changes.append((added, key))

    def drain(self) -> list[tuple[bool, bytes]]:
        """The changes since the last call, oldest first (empty unless enabled)."""
        with self._lock:
            if not self._changes:
                return []
            out, self._changes = self._changes, []
            return out


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose address is ALIGN-aligned (for O_DIRECT reads)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    return raw[offset:offset + nbytes]


def leading_held(ids: Sequence[ChunkId], held: Container[bytes]) -> int:
    """How many of ``ids``, from the first on, have their key in ``held`` (a tier's index)."""
    n = 0
    for cid in ids:
        if cid.key not in held:
            break
        n += 1
    return n
