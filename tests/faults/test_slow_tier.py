"""A slow or hung pool costs at most read_timeout_s, once per tier_cooldown_s.

The pool is wrapped in a FaultyTier whose lookups and/or reads sleep far longer than the
timeout (a hung NFS server); the host tier stays healthy. Every call must return within
about one timeout, the pool must be skipped without waiting while tripped, and served once
it answers again.
"""

from __future__ import annotations

import time

import pytest

from kvtier import TieredStore
from kvtier.tiers.faulty import FaultyTier
from kvtier.tiers.host import HostCache
from kvtier.tiers.pool import PoolTier

C = 16
SLOT = 8192
TIMEOUT = 0.3


def _store(tiny, tmp_path, ops, cooldown_s):
    pool = PoolTier(tmp_path / "pool", None, create=True)
    faulty = FaultyTier(pool, delay_prob=1.0, min_delay_s=60.0, max_delay_s=60.0, ops=ops)
    host = HostCache(16 * SLOT, tiny.layout, C)
    store = TieredStore(tiny.config(io_threads=2, read_timeout_s=TIMEOUT, tier_cooldown_s=cooldown_s),
                        host=host, tiers=[faulty])
    return store, host, pool, faulty


def _fill(store, host, pool, tiny, tokens, kv):
    """All chunks in the pool (written before the faults start), none in host DRAM."""
    for i, cid in enumerate(store.chunk_ids(tokens)):
        from kvtier.tiers.base import Chunk

        pool.store(Chunk(cid, kv[:, :, i * C:(i + 1) * C].contiguous()), tiny.spec())
    host.evict(0)


@pytest.mark.parametrize("ops", [["lookup"], ["lookup", "load"]])
def test_a_hung_pool_lookup_returns_within_the_timeout_and_then_is_skipped(tiny, tmp_path, ops):
    store, host, pool, faulty = _store(tiny, tmp_path, ops, cooldown_s=60)
    try:
        tokens, kv = tiny.tokens(64), tiny.kv(64)
        _fill(store, host, pool, tiny, tokens, kv)
        store.put(tokens[:16], kv[:, :, :16])  # chunk 0 in host DRAM too
        t0 = time.monotonic()
        found = store.lookup(tokens)
        assert time.monotonic() - t0 < TIMEOUT + 0.5
        assert found.chunk_tiers == ("host",)  # the pool could not answer: it holds nothing
        assert pool.metrics.snapshot().timeouts == 1
        t0 = time.monotonic()
        for _ in range(20):  # tripped: no more waiting, no more timeouts
            assert store.lookup(tokens).chunk_tiers == ("host",)
        assert time.monotonic() - t0 < 0.2
        assert pool.metrics.snapshot().timeouts == 1
        assert faulty.injected()["lookup"]["calls"] == 1
    finally:
        faulty.wake()
        store.close()


def test_a_hung_pool_read_trips_the_pool_and_it_serves_again_after_the_cooldown(tiny, tmp_path, bits_equal):
    store, host, pool, faulty = _store(tiny, tmp_path, ["load"], cooldown_s=1.0)
    try:
        tokens, kv = tiny.tokens(64), tiny.kv(64)
        _fill(store, host, pool, tiny, tokens, kv)
        t0 = time.monotonic()
        with pytest.raises(KeyError):
            store.get(tokens)  # the first read hangs: one timeout, then a miss
        assert time.monotonic() - t0 < TIMEOUT + 0.5
        assert pool.metrics.snapshot().timeouts == 1
        t0 = time.monotonic()
        for _ in range(10):  # tripped: each call skips the pool at once
            assert store.lookup(tokens).num_tokens == 0
            with pytest.raises(KeyError):
                store.get(tokens)
        assert time.monotonic() - t0 < 0.3
        assert pool.metrics.snapshot().timeouts == 1
        faulty.wake()  # the pool recovers...
        time.sleep(1.1)  # ...and after the cooldown it is probed and served again
        bits_equal(store.get(tokens), kv)
    finally:
        faulty.wake()
        store.close()


def test_cooldown_zero_probes_every_call(tiny, tmp_path):
    store, host, pool, faulty = _store(tiny, tmp_path, ["lookup"], cooldown_s=0)
    try:
        tokens, kv = tiny.tokens(32), tiny.kv(32)
        _fill(store, host, pool, tiny, tokens, kv)
        for _ in range(2):
            assert store.lookup(tokens).num_tokens == 0
        assert pool.metrics.snapshot().timeouts == 2
    finally:
        faulty.wake()
        store.close()


def test_tier_cooldown_s_is_validated(tiny):
    with pytest.raises(ValueError, match="tier_cooldown_s"):
        tiny.config(tier_cooldown_s=-1)
