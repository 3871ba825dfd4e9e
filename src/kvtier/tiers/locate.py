"""Where each chunk of a cached prefix is: the one walk over host DRAM and the tiers, for stores
and lookup views (``locate``); and, for a load that follows a lookup, where to read each chunk the
lookup named (``locate_named``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from kvtier.keys import ChunkId
from kvtier.tiers.base import Level
from kvtier.tiers.guard import TierGuard

L = TypeVar("L", bound=Level)


def locate(tiers: Sequence[L], guard: TierGuard, ids: Sequence[ChunkId],
           count_metrics: bool = False, chunk_tokens: int = 0) -> list[L]:
    """The tier to read each chunk of the cached prefix of ``ids`` from (the fastest holding it).

    ``tiers`` are ordered fastest first. The prefix ends at the first chunk that no usable tier
    holds. Each tier is asked for runs (``lookup`` of the rest of the prefix), so a prefix held
    by one tier costs one call per tier. With ``count_metrics`` the lookups and hits are counted
    in each tier's metrics (``chunk_tokens`` per chunk).
    """
    located: list[L] = []
    missed_at: dict[int, int] = {}  # tier index -> position of its first miss
    pos = 0
    while pos < len(ids):
        for rank, tier in enumerate(tiers):
            if missed_at.get(rank) == pos:
                continue  # it just said it lacks this chunk: no second round trip
            count = guard.lookup(tier, ids[pos:])
            missed_at[rank] = pos + count
            if count_metrics:
                tier.metrics.add(lookups=1, lookup_tokens=(len(ids) - pos) * chunk_tokens)
            if count:
                faster = tiers[:rank]
                for cid in ids[pos:pos + count]:
                    # A run found low down may still have chunks in a faster tier.
                    located.append(next((t for t in faster if guard.usable(t) and t.lookup([cid])), tier))
                pos += count
                break
        else:
            break
    if count_metrics:
        for tier in tiers:
            hits = sum(1 for t in located if t is tier)
            if hits:
                tier.metrics.add(hit_chunks=hits, hit_tokens=hits * chunk_tokens)
    return located


def locate_named(host: Level | None, tiers: Sequence[Level], guard: TierGuard, ids: Sequence[ChunkId],
                 names: Sequence[str]) -> list[Level]:
    """The levels to read ``ids`` from, as a lookup named them (``TieredStore.load_into``'s
    ``tiers``): ``host`` (host DRAM) when it holds the chunk now (an in-memory check), else the
    named tier or, when that one is cooling down or gone, the first usable one below it in
    ``tiers``. Ends where none is left."""
    located: list[Level] = []
    for cid, name in zip(ids, names, strict=False):  # names may cover a prefix only
        if host is not None and (name == host.name or host.lookup([cid])):
            located.append(host)
            continue
        below = next((i for i, t in enumerate(tiers) if t.name == name), 0)
        tier = next((t for t in tiers[below:] if guard.usable(t)), None)
        if tier is None:
            break
        located.append(tier)
    return located
