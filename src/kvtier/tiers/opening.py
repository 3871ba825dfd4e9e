"""The tiers below host DRAM that a ``StoreConfig`` names, opened: the local disk tier, then the
shared pool (an fs directory or a Redis / Valkey server)."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.config import StoreConfig
from kvtier.errors import TierUnavailableError
from kvtier.threads import ThreadInit
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import PoolTier
from kvtier.urls import is_redis_url, parse_pool_url


def open_pool_tier(config: StoreConfig, thread_init: ThreadInit | None = None) -> Tier | None:
    """The shared tier ``config.pool_url`` names (fs pool or Redis), or None when unset;
    ``thread_init`` runs first in the threads it starts (``threads.py``)."""
    if config.pool_url is None:
        return None
    if is_redis_url(config.pool_url):
        from kvtier.tiers.redis import RedisTier  # imports redis-py: optional

        return RedisTier(config.pool_url, prefix=config.redis_prefix, ttl_s=config.redis_ttl_s,
                         timeout_s=config.redis_timeout_s, cluster=config.redis_cluster,
                         username=config.redis_username, password=config.redis_password,
                         options=config.redis_options)
    pool = PoolTier(parse_pool_url(config.pool_url), config.pool_bytes, fsync=config.fsync,
                    direct_io=config.direct_io, group_access=config.group_access)
    pool.files.parallel_lookups(config.lookup_threads, config.lookup_negative_ttl_s, thread_init)
    return pool


def open_tiers(config: StoreConfig, unavailable: Callable[[str, TierUnavailableError], None] | None = None,
               thread_init: ThreadInit | None = None) -> list[Tier]:
    """The tiers below host DRAM that ``config`` names, fastest first.

    A disk or pool tier that cannot be used raises TierUnavailableError, unless
    ``unavailable(name, error)`` is given: then it is reported there and left out, so an
    engine keeps serving (with fewer tiers) when a mount is missing.
    """
    tiers: list[Tier] = []

    def optional(name: str, opener: Callable[[], Tier | None]) -> None:
        try:
            tier = opener()
        except TierUnavailableError as exc:
            if unavailable is None:
                raise
            unavailable(name, exc)
            return
        if tier is not None:
            tiers.append(tier)

    try:
        if config.disk_path is not None:
            disk_path = config.disk_path
            optional("disk", lambda: DiskTier(disk_path, config.disk_bytes, fsync=config.fsync,
                                              direct_io=config.direct_io,
                                              group_access=config.group_access))
        optional("pool", lambda: open_pool_tier(config, thread_init))
    except BaseException:
        # Release what opened before the failure (the disk tier's exclusive lock above all).
        for tier in tiers:
            tier.close()
        raise
    return tiers
