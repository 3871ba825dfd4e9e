"""Per-tier counters, exported with prometheus_client and as a JSON snapshot.

Counters live in plain Python objects updated under a lock (tiers are used from I/O threads);
a custom prometheus Collector reads them at scrape time, so several stores in one process do
not fight over global metric names.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


@dataclass
class TierCounters:
    """Everything counted for one tier. Counters only grow; ``chunks``/``bytes`` are gauges."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_chunks: int = 0
    hit_tokens: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    bytes_written: int = 0
    written_chunks: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    dropped_writes: int = 0
    failed_writes: int = 0
    failed_reads: int = 0
    timeouts: int = 0
    corrupt_chunks: int = 0
    read_races: int = 0
    thread_errors: int = 0
    dropped_retentions: int = 0
    lock_failures: int = 0
    budget_refusals: int = 0
    undescribed_namespaces: int = 0
    chunks: int = 0
    load_lookups: int = 0
    bytes: int = 0


GAUGES = {"chunks", "bytes"}
HELP = {
    "lookups": "Lookups that reached this tier",
    "lookup_tokens": "Full-chunk tokens asked for by lookups that reached this tier",
    "hit_chunks": "Chunks found in this tier by lookups",
    "hit_tokens": "Tokens found in this tier by lookups",
    "bytes_read": "Payload bytes read from this tier",
    "read_seconds": "Seconds spent reading chunks from this tier",
    "bytes_written": "Bytes written to this tier",
    "written_chunks": "Chunks written to this tier",
    "evictions": "Chunks evicted from this tier",
    "evicted_bytes": "Bytes evicted from this tier",
    "dropped_writes": "Writes dropped because the background queue was full",
    "failed_writes": "Writes that failed (I/O error, disk full, ...)",
    "failed_reads": "Reads that failed with an I/O error",
    "timeouts": "Reads abandoned after read_timeout_s",
    "corrupt_chunks": "Chunks rejected as corrupt, truncated, foreign or mismatched",
    "read_races": "Chunks that vanished between lookup and read (counted as misses)",
    "thread_errors": "Exceptions raised by background work items (logged once per place; the thread went on)",
    "dropped_retentions": "Session retentions not kept: over the bound of retained keys or queued retentions",
    "lock_failures": "Times the pool's lock file could not be locked (the budget was kept without the lock)",
    "budget_refusals": "Chunks not published because the pool was over its budget cap (eviction behind writers)",
    "undescribed_namespaces": "Namespaces (one per cache_salt) not described in the directories: over the bound",
    "chunks": "Chunks held by this tier as known to this process",
    "bytes": "Bytes held by this tier as known to this process",
    "load_lookups": "Chunks a load looked up itself (no tier named by the lookup that found them)",
}


def tier_metric_name(field: str) -> str:
    """The Prometheus name of a ``TierCounters`` field (labelled ``tier``), wherever it is exported."""
    return f"kvtier_tier_{field}" if field in GAUGES else f"kvtier_{field}_total"


class TierMetrics:
    """Thread-safe counters of one tier."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._c = TierCounters()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._c, name, getattr(self._c, name) + delta)

    def set(self, **values: float) -> None:
        with self._lock:
            for name, value in values.items():
                setattr(self._c, name, value)

    def snapshot(self) -> TierCounters:
        with self._lock:
            return copy.copy(self._c)  # flat fields of numbers: a shallow copy is a snapshot


class StoreCollector(Collector):
    """Exposes the counters of every tier of a store as ``kvtier_<name>{tier=...}``."""

    def __init__(self, tiers: dict[str, TierMetrics]) -> None:
        self._tiers = tiers

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        snaps = {name: m.snapshot() for name, m in self._tiers.items()}
        for f in fields(TierCounters):
            family: CounterMetricFamily | GaugeMetricFamily
            if f.name in GAUGES:
                family = GaugeMetricFamily(tier_metric_name(f.name), HELP[f.name], labels=["tier"])
            else:  # the family adds _total
                family = CounterMetricFamily(tier_metric_name(f.name).removesuffix("_total"), HELP[f.name],
                                             labels=["tier"])
            for name, snap in snaps.items():
                family.add_metric([name], getattr(snap, f.name))
            yield family


def new_registry(tiers: dict[str, TierMetrics]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(StoreCollector(tiers))
    return registry
