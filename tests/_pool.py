"""Test pools: a shared pool must exist and be marked before anything opens it
(``kvtier pool init``), so tests make theirs the way an operator would."""

from __future__ import annotations

from kvtier.tiers.poolroot import scratch_pool as new_pool

__all__ = ["new_pool"]
