"""What ``TieredStore``'s methods return: named results, never tuples or sentinels.

``LookupResult`` (``lookup``), ``PrefixLoad`` (``load_into``), ``LoadedChunk``
(``iter_chunks``), ``PutResult`` (``put`` and friends), ``PendingPut`` (``begin_put``). The
tiers' own results (``LoadResult``, ``StoreResult``) are in ``tiers/base.py``. All are
re-exported by ``kvtier.store`` (and the public ones by ``kvtier``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LookupResult:
    """Longest cached prefix: ``num_tokens`` is a multiple of ``chunk_tokens``."""

    num_tokens: int
    chunk_tiers: tuple[str, ...]
    chunk_tokens: int

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_tiers)

    def tokens_by_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in self.chunk_tiers:
            out[name] = out.get(name, 0) + self.chunk_tokens
        return out


@dataclass(frozen=True)
class PutResult:
    stored_chunks: int
    """New chunks taken into the store (host DRAM and/or queued for disk and pool)."""
    present_chunks: int
    """Chunks host DRAM already held (not copied again)."""
    dropped_writes: int
    """Chunks whose write-down was dropped because the background queue was full."""


@dataclass(frozen=True)
class PendingPut:
    """A chunk being stored (``TieredStore.begin_put``): fill ``buffer``, then ``commit`` or ``abandon``."""

    buffer: torch.Tensor
    commit: Callable[[], PutResult]
    abandon: Callable[[], None]


@dataclass(frozen=True)
class PrefixLoad:
    """What ``load_into`` delivered: the first ``num_chunks`` chunks, and from which tiers.

    ``read_s`` and ``copy_s``: seconds spent, summed over the delivered chunks, reading and
    validating them (a tier's ``load``, checksums included) and in the caller's sink (the copy
    into its buffers); they overlap across the I/O threads, so they can exceed the wall time.
    """

    num_chunks: int
    chunk_tiers: tuple[str, ...]
    read_s: float = 0.0
    copy_s: float = 0.0


@dataclass(frozen=True)
class LoadedChunk:
    index: int
    tier: str
    data: torch.Tensor
    """``[num_layers, 2, chunk_tokens, num_kv_heads, head_dim]``; read-only, valid until the
    iterator that yielded it advances."""
