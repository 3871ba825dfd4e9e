"""The scheduler's load decision for a hit: load it or recompute it, in the step or in the background.

``load_policy: auto`` loads a hit only when reading it is predicted faster than recomputing it
(``kvtier.policy``), from rates the workers measure in the running engine: the prefill rate of
steps that computed many tokens and loaded nothing, and each tier's read bandwidth from their
own loads. ``load_mode: auto`` loads in the step while the engine is idle and the load is short
(``SYNC_IDLE_MAX_S``), where it stalls no one and saves the request two engine steps; else in
the background.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.policy import SYNC_IDLE_MAX_S, Rates, Read, pays_off, predicted_load_s
from kvtier.tiers.kinds import HOST

__all__ = ["SYNC_IDLE_MAX_S", "LoadDecision"]


class LoadDecision:
    """See the module docstring. ``chunk_bytes``: one rank's bytes of one chunk (all its shards:
    ranks read theirs in parallel, and the rates they report were measured doing so)."""

    def __init__(self, config: ConnectorConfig, rates: Rates, chunk_tokens: int, chunk_bytes: int) -> None:
        self.config, self.rates = config, rates
        self.chunk_tokens, self.chunk_bytes = chunk_tokens, chunk_bytes

    def predicted_load_s(self, chunk_tiers: Sequence[str], start: int, end: int) -> float:
        """Seconds to read tokens [start, end) whose chunks sit in ``chunk_tiers``."""
        # Whole chunks are read even when only part of one is needed.
        chunks = range(start // self.chunk_tokens, -(-end // self.chunk_tokens))
        return predicted_load_s(Read(self.chunk_bytes, self.rates.read_rate(chunk_tiers[i])) for i in chunks)

    def pays_off(self, chunk_tiers: Sequence[str], start: int, end: int) -> bool:
        if self.config.load_policy == "always":
            return True
        return pays_off(self.predicted_load_s(chunk_tiers, start, end), self.rates.recompute_s(end - start))

    def in_background(self, chunk_tiers: Sequence[str], start: int, end: int, idle: bool) -> bool:
        """Whether to load in the background (``load_mode``; ``SYNC_IDLE_MAX_S``). ``auto`` trusts
        only measured read rates: on a prior (a tier not read from yet), a slow or stalling tier
        would hold the step, where an abort cannot stop it, for as long as its reads take."""
        mode = self.config.load_mode
        if mode != "auto":
            return mode == "async"
        if not idle:
            return True
        used = set(chunk_tiers[start // self.chunk_tokens:-(-end // self.chunk_tokens)]) - {"", HOST.name}
        if not used <= self.rates.measured.keys():
            return True
        return self.predicted_load_s(chunk_tiers, start, end) > SYNC_IDLE_MAX_S
