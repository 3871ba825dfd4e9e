"""The kinds of storage level kvtier knows, and every property that differs between them.

One row per kind. The tables that once spelled tier names by hand (the lookup order, which
tiers are shared, the KV-event medium, the bandwidth priors, the planner's tiers) read these
rows, so a new tier is one row here plus its class; ``kind(name)`` names the rows there are
when asked for one that is not.

Host DRAM is a row although it is a slot cache in front of the tiers rather than a ``Tier``:
lookups, events, stats and the planner treat it as the fastest level all the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierKind:
    """What a level is, as every part of kvtier that cares needs to know it.

    ``order``: lookup order, fastest first; kinds of equal order are alternatives (a store has
    the shared pool or Redis below its disk, never both). ``medium``: the KV-event medium a
    router sees (vLLM's ``BlockStored.medium``; the kind's name is the event's ``ownership``).
    ``shared``: every instance and rank sees the same bytes, so only the ranks that write the
    pool write it and its byte gauges are a maximum over ranks, not a sum. ``may_hang``: a
    lookup can block for minutes (a network filesystem), so lookups are timed
    (``tiers/guard.py``). ``persistent``: it survives an engine restart. ``read_prior``: the
    read rate assumed before one is measured, as a multiple of the configured ``read_gbps``.
    """

    name: str
    order: int
    medium: str
    shared: bool
    may_hang: bool
    persistent: bool
    read_prior: float = 1.0


HOST = TierKind("host", 0, "CPU", shared=False, may_hang=False, persistent=False, read_prior=10.0)
DISK = TierKind("disk", 1, "STORAGE", shared=False, may_hang=False, persistent=True)
POOL = TierKind("pool", 2, "STORAGE", shared=True, may_hang=True, persistent=True)
REDIS = TierKind("redis", 2, "STORAGE", shared=True, may_hang=False, persistent=True)  # socket timeouts bound it

KINDS: dict[str, TierKind] = {k.name: k for k in (HOST, DISK, POOL, REDIS)}
SHARED: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.shared)
_ORDER: dict[str, int] = {n: k.order for n, k in KINDS.items()}  # slowest() runs per chunk of a lookup


def kind(name: str) -> TierKind:
    """The row of tier ``name``; KeyError naming the known kinds otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise KeyError(f"no tier kind {name!r}; kinds: {', '.join(KINDS)}") from None


def slowest(a: str, b: str) -> str:
    """Of two tier names, the one looked up later (unknown names count as slowest)."""
    return max(a, b, key=lambda n: _ORDER.get(n, len(KINDS)))
