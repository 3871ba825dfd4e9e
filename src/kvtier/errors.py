"""Exceptions kvtier raises to its callers (faults inside tiers are results, not exceptions)."""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of kvtier's own exceptions."""


class TierUnavailableError(KVTierError, OSError):
    """A tier cannot be opened (missing or unwritable directory, held by another process).

    Raised at open time only; at run time the same faults are counted misses or failed writes.
    """
