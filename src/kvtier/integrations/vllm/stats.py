"""kvtier's counters on vLLM's own ``/metrics``, through vLLM's connector stats API.

Each process of the connector (the scheduler, every worker rank) reports, once per engine
step and only when something changed, the *increments* of its counters since its last report
and the *current values* of its gauges (``StatsSource.take``). vLLM folds the workers' reports
and the scheduler's into one ``KVTierStats`` (``aggregate``), ships its ``data`` dict to the
API server process, and hands it to ``KVTierPromMetrics.observe``, which adds the increments
to Prometheus counters and sets the gauges.

Names follow Prometheus conventions: every name starts with ``kvtier_``, counters end in
``_total``, units are in the names, and per-tier series carry a ``tier`` label (``host``,
``disk``, ``pool``, ``redis``) beside vLLM's own ``model_name`` and ``engine`` labels. The
per-tier names are the store's own (``kvtier.metrics.tier_metric_name``), so a dashboard built
on ``TieredStore.registry`` reads the same series. ``METRICS`` is the list (docs/operations.md
explains each).

Which process counts what: lookups, hits and load/recompute decisions are the scheduler's;
bytes, seconds, errors, writes and evictions are every rank's own (summed: with tensor
parallelism every rank moves its shard); request-level counts (tokens loaded, chunks saved)
come from the first rank only, so that they count requests' tokens, not shards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client import REGISTRY, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvtier.integrations.vllm.counters import BY_KEY, COUNTERS
from kvtier.metrics import GAUGES, HELP, TierCounters, tier_metric_name
from kvtier.tiers.kinds import SHARED

LOOKUP_FIELDS = ("lookups", "lookup_tokens", "hit_chunks", "hit_tokens", "timeouts")
"""Tier counters the scheduler counts (its lookups); the workers count every other one."""
SEP = "|"  # data keys: "<metric name>|<label value>|..." (msgpack-friendly strings)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # "counter" or "gauge"
    help: str
    labels: tuple[str, ...] = ()


def _tier_metrics() -> list[Metric]:
    out = []
    for f in fields(TierCounters):
        if f.name in LOAD_ERROR_CAUSES:
            continue  # exported as kvtier_load_errors_total{cause}
        out.append(Metric(tier_metric_name(f.name), "gauge" if f.name in GAUGES else "counter", HELP[f.name],
                          ("tier",)))
    return out


LOAD_ERROR_CAUSES = {"failed_reads": "io_error", "timeouts": "timeout", "corrupt_chunks": "corrupt",
                     "read_races": "vanished"}

GAUGE_METRICS = [
    Metric("kvtier_write_queue_chunks", "gauge", "Chunks queued for background writes to disk and pool"),
    Metric("kvtier_loads_in_flight", "gauge", "Background loads running on the first rank"),
    Metric("kvtier_lookups_in_flight", "gauge", "Requests whose lookup runs in the background"),
    Metric("kvtier_disabled", "gauge", "1 when the connector turned itself off (see the engine log)"),
]

METRICS: list[Metric] = [
    *_tier_metrics(),
    Metric("kvtier_load_errors_total", "counter", "Chunks a load could not read, by cause: io_error, timeout, "
           "corrupt (bad checksum, truncated, foreign), vanished (evicted between lookup and read)",
           ("tier", "cause")),
    *(Metric(c.metric, "counter", c.help, (c.label,) if c.label else ()) for c in COUNTERS if c.metric),
    *GAUGE_METRICS,
]
_FIELD_NAMES = [(f.name, tier_metric_name(f.name)) for f in fields(TierCounters)]  # flatten runs every step


def key(name: str, *labels: str) -> str:
    return SEP.join((name, *labels))


def flatten(counters: Mapping[str, float], tiers: Mapping[str, TierCounters], *, first_rank: bool,
            tier_fields: Callable[[str], bool] = lambda name: True) -> tuple[dict[str, float], dict[str, float]]:
    """(counters, gauges) of one process, keyed as in ``KVTierStats.data``."""
    out: dict[str, float] = {}
    gauges: dict[str, float] = {}
    for name, value in counters.items():
        row_key, _, label = name.partition(".")
        row = BY_KEY.get(row_key)
        if row is None or row.metric is None or (row.first_rank_only and not first_rank):
            continue
        if row.label is None and not label:
            out[key(row.metric)] = value
        elif row.label is not None and label:
            out[key(row.metric, label)] = value
    for tier, snap in tiers.items():
        for name, metric in _FIELD_NAMES:
            if not tier_fields(name):
                continue
            value = getattr(snap, name)
            if name in GAUGES:
                gauges[key(metric, tier)] = value
            elif name in LOAD_ERROR_CAUSES:
                k = key("kvtier_load_errors_total", tier, LOAD_ERROR_CAUSES[name])
                out[k] = out.get(k, 0) + value
            else:
                out[key(metric, tier)] = value
    return out, gauges


class StatsSource:
    """One process's reports: increments since the last ``take`` and current gauges."""

    def __init__(self, source: str, read: Callable[[], tuple[dict[str, float], dict[str, float]]]) -> None:
        self.source = source
        self._read = read
        self._last: dict[str, float] = {}
        self._last_gauges: dict[str, float] = {}
        self._lock = threading.Lock()

    def take(self) -> KVTierStats | None:
        """This process's changes since the last call, or None when nothing changed."""
        with self._lock:
            counters, gauges = self._read()
            delta = {k: v - self._last.get(k, 0) for k, v in counters.items() if v != self._last.get(k, 0)}
            self._last = counters
            if not delta and gauges == self._last_gauges:
                return None
            self._last_gauges = gauges
            return KVTierStats(data={"counters": delta, "gauges": {self.source: gauges}})


@dataclass
class KVTierStats(KVConnectorStats):  # type: ignore[misc]
    """``data``: ``{"counters": {key: increment}, "gauges": {source: {key: value}}}``."""

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Fold in another rank's (or a later step's) report: increments add, gauges are the
        latest value of each source."""
        if isinstance(other, KVTierStats):
            counters = self.data["counters"]
            for k, v in other.data["counters"].items():
                counters[k] = counters.get(k, 0) + v
            self.data["gauges"].update(other.data["gauges"])
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals for vLLM's periodic log line (per metric, labels summed)."""
        totals: dict[str, float] = {"loaded_tokens": 0, "hit_tokens": 0}
        for k, v in self.data["counters"].items():
            name = k.split(SEP, 1)[0].removeprefix("kvtier_").removesuffix("_total")
            if name in ("hit_tokens", "loaded_tokens", "bytes_read", "bytes_written", "load_errors",
                        "load_failed_blocks", "saved_chunks"):
                totals[name] = totals.get(name, 0) + v
        return {k: round(v, 3) for k, v in sorted(totals.items())}

    def is_empty(self) -> bool:
        return not self.data["counters"] and not self.data["gauges"]


def gauge_value(tier: str | None, values: list[float]) -> float:
    """Gauges of one key across sources: a shared tier's is the same bytes seen by every rank
    (max); anything else each process holds on its own (sum)."""
    # A shared tier's gauges: every rank sees the same bytes (a maximum, not a sum).
    return max(values) if tier in SHARED else sum(values)


def _unregister(names: set[str]) -> None:
    """Drop kvtier collectors a previous build in this process registered (a second server or
    engine in one process): prometheus_client refuses duplicate names."""
    for collector in list(getattr(REGISTRY, "_collector_to_names", {})):
        if set(REGISTRY._collector_to_names.get(collector, ())) & names:
            REGISTRY.unregister(collector)


class KVTierPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Prometheus families for ``METRICS``, fed by ``observe`` with ``KVTierStats.data``."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = set()
        for m in METRICS:
            base = m.name.removesuffix("_total")
            names |= {m.name, base, base + "_created"}
        _unregister(names)
        self._families: dict[str, Any] = {}
        for m in METRICS:
            cls = self._counter_cls if m.kind == "counter" else self._gauge_cls
            kwargs: dict[str, Any] = {"name": m.name, "documentation": m.help,
                                      "labelnames": [*labelnames, *m.labels]}
            if m.kind == "gauge" and cls is Gauge:
                kwargs["multiprocess_mode"] = "mostrecent"
            self._families[m.name] = cls(**kwargs)
        self._gauges: dict[int, dict[str, dict[str, float]]] = {}  # engine -> source -> key -> value

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues.get(engine_idx, [])
        for k, inc in (transfer_stats_data.get("counters") or {}).items():
            name, *labels = k.split(SEP)
            family = self._families.get(name)
            if family is not None and inc > 0:
                family.labels(*engine, *labels).inc(inc)
        sources = self._gauges.setdefault(engine_idx, {})
        for source, values in (transfer_stats_data.get("gauges") or {}).items():
            sources[source] = values
        merged: dict[str, list[float]] = {}
        for values in sources.values():
            for k, v in values.items():
                merged.setdefault(k, []).append(v)
        for k, values in merged.items():
            name, *labels = k.split(SEP)
            family = self._families.get(name)
            if family is not None:
                family.labels(*engine, *labels).set(gauge_value(labels[0] if labels else None, values))
