"""One tier as the planner's simulator sees it: per-session prefixes, LRU within a byte budget,
written through a bounded queue at the tier's write bandwidth (``plan.sim``)."""

from __future__ import annotations

from collections import OrderedDict

from kvtier.plan.spec import TierSpec


class LRUTier:
    """Per-session prefixes (tokens) in one tier, LRU within ``capacity_bytes``. With ``instances``
    engines sharing a shared tier, this one gets ``1/instances`` of its capacity and bandwidth.
    A write that would wait in the queue longer than ``write_queue_s`` is dropped; a prefix lost
    to an eviction or a dropped write is recorded in ``lost``."""

    def __init__(self, spec: TierSpec, instances: int, bytes_per_token: int, lost: dict[str, int]) -> None:
        share = instances if spec.shared else 1
        self.spec = spec
        self.capacity_bytes = spec.capacity_bytes // share
        self.read_bytes_per_s = spec.read_bytes_per_s / share
        self.write_bytes_per_s = spec.write_bytes_per_s / share
        self.bytes_per_token = bytes_per_token
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.used_bytes = 0
        self.write_free_at = 0.0
        self.evictions = 0
        self.dropped_writes = 0
        self.lost = lost  # session -> tokens it had before an eviction or a dropped write

    def get(self, session: str) -> int:
        tokens = self.entries.get(session, 0)
        if tokens:
            self.entries.move_to_end(session)
        return tokens

    def put(self, session: str, tokens: int, now: float) -> None:
        old = self.entries.get(session, 0)
        if tokens <= old:
            return
        nbytes = tokens * self.bytes_per_token
        if nbytes > self.capacity_bytes:
            return
        start = max(now, self.write_free_at)
        if start - now > self.spec.write_queue_s:
            self.dropped_writes += 1
            self.lost[session] = max(self.lost.get(session, 0), tokens)
            return
        self.write_free_at = start + (tokens - old) * self.bytes_per_token / self.write_bytes_per_s
        if old:
            del self.entries[session]
            self.used_bytes -= old * self.bytes_per_token
        while self.entries and self.used_bytes + nbytes > self.capacity_bytes:
            victim, evicted = self.entries.popitem(last=False)
            self.used_bytes -= evicted * self.bytes_per_token
            self.lost[victim] = max(self.lost.get(victim, 0), evicted)
            self.evictions += 1
        self.entries[session] = tokens
        self.used_bytes += nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.used_bytes = 0
        self.write_free_at = 0.0
