"""The tiers below host DRAM that a ``StoreConfig`` names, opened: the local disk tier, then the
shared pool (an fs directory or a Redis / Valkey server).

The one place tiers are made, so the one place a test's injected faults enter: ``faults``
(``{tier name: FaultyTier options}``, the connector's ``inject_faults`` setting) wraps the named
tiers in ``tiers.faulty.FaultyTier`` as they open; production code never names that class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kvtier.config import StoreConfig
from kvtier.errors import TierUnavailableError
from kvtier.threads import ThreadInit
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import PoolTier
from kvtier.urls import is_redis_url, parse_pool_url

log = logging.getLogger(__name__)

Faults = Mapping[str, Mapping[str, Any]]
"""Tests only: ``{tier name: FaultyTier options}``."""


def _with_faults(tier: Tier, faults: Faults | None) -> Tier:
    if not faults or tier.name not in faults:
        return tier
    from kvtier.tiers.faulty import FaultyTier  # test machinery: imported only when asked for

    log.warning("kvtier: injecting faults into the %s tier (a test setting)", tier.name)
    return FaultyTier(tier, **faults[tier.name])


def open_pool_tier(config: StoreConfig, thread_init: ThreadInit | None = None,
                   faults: Faults | None = None) -> Tier | None:
    """The shared tier ``config.pool_url`` names (fs pool or Redis), or None when unset;
    ``thread_init`` runs first in the threads it starts (``threads.py``)."""
    if config.pool_url is None:
        return None
    return _with_faults(_open_pool(config, thread_init), faults)


def _open_pool(config: StoreConfig, thread_init: ThreadInit | None) -> Tier:
    assert config.pool_url is not None
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
               thread_init: ThreadInit | None = None, faults: Faults | None = None) -> list[Tier]:
    """The tiers below host DRAM that ``config`` names, fastest first.

    A disk or pool tier that cannot be used raises TierUnavailableError, unless
    ``unavailable(name, error)`` is given: then it is reported there and left out, so an
    engine keeps serving (with fewer tiers) when a mount is missing. ``faults`` naming a tier
    that did not open is a ValueError (a test that would silently inject nothing).
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
            optional("disk", lambda: _with_faults(DiskTier(disk_path, config.disk_bytes, fsync=config.fsync,
                                                           direct_io=config.direct_io,
                                                           group_access=config.group_access), faults))
        optional("pool", lambda: open_pool_tier(config, thread_init, faults))
        unknown = sorted(set(faults or ()) - {t.name for t in tiers})
        if unknown:
            raise ValueError(f"kvtier setting inject_faults: no tier named {unknown}; tiers: {[t.name for t in tiers]}")
    except BaseException:
        # Release what opened before the failure (the disk tier's exclusive lock above all).
        for tier in tiers:
            tier.close()
        raise
    return tiers
