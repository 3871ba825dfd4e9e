"""The scheduler's lookup view of every rank's tiers, and the shard ids it asks them for.

Each rank's levels as the scheduler sees them: a mirror of its host DRAM keys (``HostView``),
its disk directory (``FileLookup``) and the shared pool (one ``Tier`` for all ranks, or Redis).
``RankTiers.locate`` is the blocking lookup a scheduler's lookup thread runs for one request:
the pool once per chunk for all ranks, each rank's own levels for its first shard.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, overload

from kvtier.config import StoreConfig
from kvtier.errors import TierUnavailableError
from kvtier.integrations.vllm.common import tier_unavailable
from kvtier.integrations.vllm.config import Deployment, disk_path_of_rank
from kvtier.integrations.vllm.views import FileLookup, HostView
from kvtier.keys import ChunkId, shard_id
from kvtier.tiers.base import Level, Tier
from kvtier.tiers.guard import TierGuard
from kvtier.tiers.kinds import slowest
from kvtier.tiers.locate import locate
from kvtier.tiers.opening import open_pool_tier

log = logging.getLogger(__name__)


class ShardIds(Sequence[ChunkId]):
    """One shard's ids of a request's chunks from ``start`` on, each made when first asked for
    (a hash): a lookup that stops at a miss never pays for the rest. Open-ended slices
    (``ids[n:]``) are views sharing the made ids; bounded ones are lists."""

    def __init__(self, logical: Sequence[ChunkId], shard: int, num_shards: int, start: int = 0,
                 made: list[ChunkId | None] | None = None) -> None:
        self.logical, self.shard, self.num_shards, self.start = logical, shard, num_shards, start
        self._made: list[ChunkId | None] = made if made is not None else [None] * len(logical)

    def __len__(self) -> int:
        return max(0, len(self.logical) - self.start)

    @overload
    def __getitem__(self, i: int) -> ChunkId: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ChunkId]: ...

    def __getitem__(self, i: int | slice) -> ChunkId | Sequence[ChunkId]:
        if isinstance(i, slice):
            first, stop, step = i.indices(len(self))
            if i.stop is None and step == 1:
                return ShardIds(self.logical, self.shard, self.num_shards, self.start + first, self._made)
            return [self[j] for j in range(first, stop, step)]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        j = self.start + i
        cid = self._made[j]
        if cid is None:
            cid = self._made[j] = shard_id(self.logical[j], self.shard, self.num_shards)
        return cid


class PoolAnswer:
    """The shared pool's answer for one request (it holds chunks ``first`` to ``first + count``),
    as a lookup-only ``Level`` over any rank's ``ShardIds``: no second metadata call."""

    may_hang = False  # answered already

    def __init__(self, pool: Level, first: int, count: int) -> None:
        self.name, self.metrics = pool.name, pool.metrics
        self.first, self.count = first, count

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        assert isinstance(ids, ShardIds), "answers by position: ShardIds only"
        if ids.start < self.first:
            return 0
        return max(0, min(len(ids), self.first + self.count - ids.start))

    def close(self) -> None:
        return


class RankTiers:
    """Every rank's lookup levels (``by_rank``), the shared ``pool`` among them, and the host
    DRAM mirrors the workers' reports feed (``host_views``)."""

    def __init__(self, store_config: StoreConfig, dep: Deployment, guard: TierGuard, counters: dict[str, int],
                 faults: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.dep, self.guard = dep, guard
        self.chunk_tokens = store_config.chunk_tokens
        self.host_views: dict[int, HostView] = {}
        self.pool: Tier | None = None
        try:
            self.pool = open_pool_tier(store_config, faults=faults)
        except TierUnavailableError as exc:
            tier_unavailable(counters, "pool", exc)
        self.by_rank: dict[int, list[Level]] = {}
        for rank in range(dep.sharding.world_size):
            tiers: list[Level] = []
            if store_config.host_bytes > 0:
                tiers.append(self.host_views.setdefault(rank, HostView()))
            if store_config.disk_path is not None:
                tiers.append(FileLookup("disk", disk_path_of_rank(store_config.disk_path, rank, dep)))
            if self.pool is not None:
                tiers.append(self.pool)  # one view for all ranks: ``locate`` asks it once per chunk
            self.by_rank[rank] = tiers

    def shard_ids(self, made: dict[int, ShardIds], logical: Sequence[ChunkId], shard: int) -> ShardIds:
        """Shard ``shard``'s ids of a request's chunks, kept in ``made`` (the request's own
        cache: each id is made once per request, when needed)."""
        ids = made.get(shard)
        if ids is None:
            ids = made[shard] = ShardIds(logical, shard, self.dep.sharding.num_shards)
        return ids

    def locate(self, logical: Sequence[ChunkId], made: dict[int, ShardIds], first: int = 0,
               count_metrics: bool = True) -> list[str]:
        """Tier names of chunks ``first..`` of the cached prefix (the slowest any rank reads each from).

        Blocking (metadata calls to disk and pool): it runs on a lookup thread. Each rank's own
        levels (host DRAM, disk) are asked for that rank's first shard; the shared pool once per
        chunk, for shard 0, whatever the number of ranks. ``count_metrics`` False: the tiers'
        lookup metrics leave this lookup out (a tail's, which is not a prompt's chunk).
        """
        pool = self.pool
        shared: PoolAnswer | None = None
        if pool is not None:
            shared = PoolAnswer(pool, first, self.guard.lookup(pool, self.shard_ids(made, logical, 0)[first:]))
        # A rank whose only level is the pool (no host DRAM held, no disk) has the pool's answer:
        # no per-rank work, which at TP=8 would cost more than the pool's own answer.
        pool_only = [shared.name] * shared.count if shared is not None else []
        names: list[str] | None = None
        for rank, tiers in self.by_rank.items():
            local = [t for t in tiers if t is not pool and not (isinstance(t, HostView) and not t.keys)]
            if not local:
                located = pool_only if pool in tiers else []
                if rank == 0 and shared is not None and count_metrics:
                    self._count_shared(shared, len(logical) - first)
            else:
                ids = self.shard_ids(made, logical, self.dep.sharding.shards_of(rank)[0])
                levels: list[Level] = local + ([shared] if shared is not None and pool in tiers else [])
                located = [t.name for t in locate(levels, self.guard, ids[first:], count_metrics=count_metrics
                                                  and rank == 0, chunk_tokens=self.chunk_tokens)]
            if names is None or names is located:
                names = located
            else:
                names = [slowest(a, b) for a, b in zip(names, located, strict=False)]
            if not names:
                break
        return names or []

    def _count_shared(self, shared: PoolAnswer, asked: int) -> None:
        """Count a pool lookup that no rank's ``locate`` counted (rank 0 has no level of its own)."""
        c = self.chunk_tokens
        shared.metrics.add(lookups=1, lookup_tokens=asked * c, hit_chunks=shared.count,
                           hit_tokens=shared.count * c)

    def drop(self, rank: int, names: Sequence[str]) -> None:
        """Rank ``rank``'s store left these tiers out: stop finding chunks there for it (each such
        hit would cost a load that delivers nothing)."""
        tiers = self.by_rank.get(rank)
        if tiers is None:
            return
        kept = [t for t in tiers if t.name not in names]
        if len(kept) < len(tiers):
            log.warning("kvtier: worker rank %d serves without its %s tier(s); the scheduler no longer looks there",
                        rank, ", ".join(sorted(set(names))))
            self.by_rank[rank] = kept

    def close(self) -> None:
        closed: set[int] = set()
        for tiers in self.by_rank.values():
            for tier in tiers:
                if id(tier) not in closed:
                    closed.add(id(tier))
                    tier.close()
