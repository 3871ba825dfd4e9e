"""Where a round of pool eviction cuts (``tiers/evict.py``): from a sample of chunk files, the
mtime below which the bytes it must free lie, or the exact victims when the sample is the whole
pool. Pure functions of the sample: no I/O, tested with made-up files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.tiers.listing import ChunkFile

SLACK = 0.05  # the sampled cutoff aims at least this much further (see plan)


@dataclass(frozen=True)
class Plan:
    """What a sweep unlinks: chunks older than ``cutoff``, or exactly ``victims`` (paths)."""

    cutoff: float
    victims: frozenset[str] | None = None
    all_unretained: bool = False  # it takes every unretained chunk there is (or was sampled)


def plan(sample: Sequence[ChunkFile], need: int, total: int, now: float, *, exact: bool,
         retained: bool) -> Plan:
    """The plan for ``need`` bytes: ``exact`` (the sample is the whole pool): the oldest
    chunks worth ``need``; else a cutoff covering ``need``'s share of ``total`` in the sample
    plus a margin. Nothing newer than ``now`` (retained) unless ``retained``."""
    items = sorted(sample, key=lambda f: f.mtime)
    if exact:
        victims: list[ChunkFile] = []
        acc = 0
        for f in items:
            if acc >= need or (f.mtime > now and not retained):
                break
            victims.append(f)
            acc += f.size
        left = items[len(victims):]
        cutoff = math.nextafter(victims[-1].mtime, math.inf) if victims else -math.inf
        return Plan(cutoff, frozenset(os.fspath(f.path) for f in victims), not left or left[0].mtime > now)
    if need <= 0:
        return Plan(-math.inf)
    # Aim past the share by twice its sampling error (or SLACK): a cutoff that falls short
    # costs a second full pass, one that overshoots only stops the sweep a little sooner.
    share = min(1.0, need / max(total, 1))
    error = 2 * math.sqrt((1 - share) / max(share * len(items), 1e-9))
    goal = share * sum(f.size for f in items) * (1 + min(max(SLACK, error), 1.0))
    acc = 0
    for f in items:
        if f.mtime > now and not retained:
            return Plan(now, None, True)
        acc += f.size
        if acc >= goal:
            return Plan(math.nextafter(f.mtime, math.inf), None, f.mtime >= now)
    return Plan(math.inf if retained else now, None, True)
