"""kvtier.metrics: exact per-tier counters, the JSON snapshot and the prometheus exposition."""

from __future__ import annotations

import json
import threading
from dataclasses import fields

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from _pool import new_pool
from kvtier.metrics import TierCounters, TierMetrics, new_registry

SLOT = 8192


def _samples(registry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {(s.name, s.labels["tier"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if "tier" in s.labels}


def _scenario(make_store, tiny, tmp_path):
    """3 chunks put; chunk 0 then evicted from host; one lookup finds pool, host, host."""
    store = make_store(pool_url=new_pool(tmp_path / "p"))
    tokens = tiny.tokens(50)
    store.put(tokens, tiny.kv(50))
    store.flush()
    store.host.evict(2 * SLOT)
    hit = store.lookup(tokens)
    assert hit.chunk_tiers == ("pool", "host", "host")
    return store, tokens


def test_json_snapshot_counts_exactly(make_store, tiny, tmp_path):
    store, tokens = _scenario(make_store, tiny, tmp_path)
    snap = json.loads(json.dumps(store.metrics_snapshot()))  # JSON-ready as is
    assert set(snap) == {"store", "tiers", "write_queue"}
    assert snap["write_queue"] == 0
    s, host, pool = snap["store"], snap["tiers"]["host"], snap["tiers"]["pool"]
    assert (s["lookups"], s["lookup_tokens"], s["hit_chunks"], s["hit_tokens"]) == (1, 48, 3, 48)
    assert (host["lookups"], host["lookup_tokens"], host["hit_chunks"], host["hit_tokens"]) == (1, 48, 2, 32)
    assert (pool["lookups"], pool["lookup_tokens"], pool["hit_chunks"], pool["hit_tokens"]) == (1, 48, 1, 16)
    assert (host["written_chunks"], host["bytes_written"]) == (3, 3 * 2048)
    assert (host["evictions"], host["chunks"]) == (1, 2)
    assert (pool["written_chunks"], pool["bytes_written"], pool["bytes_read"]) == (3, 3 * SLOT, 0)

    store.get(tokens[:48])  # reads chunk 0 from the pool, 1 and 2 from host; promotes chunk 0
    snap = store.metrics_snapshot()
    s, host, pool = snap["store"], snap["tiers"]["host"], snap["tiers"]["pool"]
    assert s["lookups"] == 1  # get() does not count as a lookup
    assert pool["bytes_read"] == 2048 and pool["read_seconds"] > 0
    assert (host["written_chunks"], host["chunks"]) == (4, 3)
    faults = ("corrupt_chunks", "dropped_writes", "failed_writes", "failed_reads", "timeouts", "read_races")
    for name in faults:
        assert s[name] == host[name] == pool[name] == 0


def test_prometheus_exposition(make_store, tiny, tmp_path):
    store, _ = _scenario(make_store, tiny, tmp_path)
    text = generate_latest(store.registry).decode()
    assert 'kvtier_hit_tokens_total{tier="host"} 32.0' in text
    assert "# HELP kvtier_hit_tokens_total Tokens found in this tier by lookups" in text
    assert "# TYPE kvtier_tier_chunks gauge" in text
    samples = _samples(store.registry)
    assert samples[("kvtier_hit_tokens_total", "host")] == 32
    assert samples[("kvtier_hit_tokens_total", "pool")] == 16
    assert samples[("kvtier_hit_tokens_total", "store")] == 48
    assert samples[("kvtier_lookups_total", "store")] == 1
    assert samples[("kvtier_evictions_total", "host")] == 1
    assert samples[("kvtier_written_chunks_total", "pool")] == 3
    assert samples[("kvtier_tier_chunks", "host")] == 2
    # Every counter is exported for every tier, store included.
    for f in fields(TierCounters):
        name = f"kvtier_tier_{f.name}" if f.name in ("chunks", "bytes") else f"kvtier_{f.name}_total"
        assert {tier for (n, tier) in samples if n == name} == {"store", "host", "pool"}


def test_two_stores_in_one_process_have_separate_registries(make_store, tiny):
    a, b = make_store(), make_store()
    a.put(tiny.tokens(16), tiny.kv(16))
    a.lookup(tiny.tokens(16))
    assert _samples(a.registry)[("kvtier_hit_tokens_total", "host")] == 16
    assert _samples(b.registry)[("kvtier_hit_tokens_total", "host")] == 0


def test_counters_are_thread_safe():
    metrics = TierMetrics("t")
    threads = [threading.Thread(target=lambda: [metrics.add(lookups=1, bytes_read=3) for _ in range(5000)])
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = metrics.snapshot()
    assert (snap.lookups, snap.bytes_read) == (40_000, 120_000)


def test_set_gauges_and_snapshot_is_a_copy():
    metrics = TierMetrics("t")
    metrics.set(chunks=5, bytes=40960)
    snap = metrics.snapshot()
    metrics.add(chunks=1)
    assert (snap.chunks, metrics.snapshot().chunks) == (5, 6)
    registry = new_registry({"t": metrics})
    assert _samples(registry)[("kvtier_tier_bytes", "t")] == 40960
