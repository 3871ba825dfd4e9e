"""A fault-injecting proxy tier (random delays, errors, misses) in front of the pool.

Whatever the pool does, the store's caller gets exactly the right KV or a clean miss
(KeyError / a shorter prefix), never wrong bytes, and a slow read ends the prefix in bounded time.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from _pool import new_pool
from kvtier import TieredStore
from kvtier.tiers.base import Chunk, Status, Tier
from kvtier.tiers.faulty import FaultyTier
from kvtier.tiers.host import HostCache
from kvtier.tiers.pool import PoolTier

C = 16
SLOT = 8192


@pytest.fixture
def pool(tmp_path) -> PoolTier:
    tier = PoolTier(tmp_path / "pool", None, create=True)
    yield tier
    tier.close()


# -- the proxy itself ----------------------------------------------------------------------------


def test_faulty_tier_speaks_the_protocol_and_shares_the_inner_counters(pool):
    faulty = FaultyTier(pool)
    assert isinstance(faulty, Tier)
    assert (faulty.name, faulty.metrics) == ("pool", pool.metrics)
    assert faulty.files is pool.files  # anything else is the inner tier's


def test_no_faults_configured_is_transparent(pool, tiny, bits_equal):
    faulty = FaultyTier(pool, seed=1)
    (a,) = tiny.chunks(1)
    assert faulty.store(a, tiny.spec()).status is Status.WRITTEN
    assert faulty.lookup([a.id]) == 1
    got = faulty.load(a.id, tiny.spec())
    assert got.ok
    bits_equal(got.chunk.data, a.data)
    injected = faulty.injected()
    assert [injected[op]["calls"] for op in ("lookup", "load", "store")] == [1, 1, 1]
    assert sum(injected[op][k] for op in injected for k in ("delays", "errors", "misses")) == 0


def test_injected_errors_are_results_not_exceptions(pool, tiny):
    healthy = FaultyTier(pool)
    (a,) = tiny.chunks(1)
    healthy.store(a, tiny.spec())
    faulty = FaultyTier(pool, error_prob=1.0)
    assert faulty.lookup([a.id]) == 0
    load = faulty.load(a.id, tiny.spec())
    assert load.status is Status.ERROR and "injected" in load.error
    store = faulty.store(a, tiny.spec())
    assert store.status is Status.FAILED and "Input/output error" in store.error
    snap = pool.metrics.snapshot()
    assert (snap.failed_reads, snap.failed_writes, snap.corrupt_chunks) == (1, 1, 0)
    assert {op: c["errors"] for op, c in faulty.injected().items()} == {"lookup": 1, "load": 1, "store": 1}


def test_injected_misses_count_as_read_races(pool, tiny):
    (a,) = tiny.chunks(1)
    pool.store(a, tiny.spec())
    faulty = FaultyTier(pool, miss_prob=1.0)
    assert faulty.load(a.id, tiny.spec()).status is Status.MISS
    assert faulty.lookup([a.id]) == 1  # misses are injected into loads only
    assert pool.metrics.snapshot().read_races == 1
    assert faulty.injected()["load"]["misses"] == 1


def test_delays_are_bounded_and_wake_ends_them(pool, tiny):
    (a,) = tiny.chunks(1)
    faulty = FaultyTier(pool, delay_prob=1.0, min_delay_s=0.05, max_delay_s=0.05, ops=["store"])
    t0 = time.monotonic()
    faulty.store(a, tiny.spec())
    assert 0.05 <= time.monotonic() - t0 < 1.0
    faulty.lookup([a.id])  # not in ops: no delay
    assert (faulty.injected()["lookup"]["delays"], faulty.injected()["store"]["delays"]) == (0, 1)
    slow = FaultyTier(pool, delay_prob=1.0, min_delay_s=60, max_delay_s=60)
    slow.wake()
    t0 = time.monotonic()
    assert slow.load(a.id, tiny.spec()).ok
    assert time.monotonic() - t0 < 1.0
    assert slow.injected()["load"]["delays"] == 1


def test_same_seed_same_faults(pool, tiny):
    (a,) = tiny.chunks(1)
    pool.store(a, tiny.spec())

    def run(seed: int) -> list[Status]:
        faulty = FaultyTier(pool, seed=seed, error_prob=0.3, miss_prob=0.3)
        return [faulty.load(a.id, tiny.spec()).status for _ in range(60)]

    first = run(7)
    assert run(7) == first
    assert run(8) != first
    assert set(first) == {Status.HIT, Status.MISS, Status.ERROR}


@pytest.mark.parametrize("options", [{"error_prob": 1.5}, {"delay_prob": -0.1}, {"miss_prob": 2},
                                     {"min_delay_s": 2, "max_delay_s": 1}, {"ops": ["evict"]}])
def test_bad_fault_settings(pool, options):
    with pytest.raises(ValueError):
        FaultyTier(pool, **options)


# -- the store behind a misbehaving pool ---------------------------------------------------------


class Truth:
    """Token sequences, some sharing prefixes, and the one right KV for every prefix."""

    def __init__(self, tiny, n_chunks: int = 6) -> None:
        n = n_chunks * C
        self.tokens: list[list[int]] = []
        self.kv: list[torch.Tensor] = []
        for seed in range(5):
            self.tokens.append(tiny.tokens(n, seed=seed))
            self.kv.append(tiny.kv(n, seed=seed))
        for seed, shared in ((50, 2), (51, 3)):  # branches off sequence 0 after `shared` chunks
            cut = shared * C
            self.tokens.append(self.tokens[0][:cut] + tiny.tokens(n - cut, seed=seed))
            self.kv.append(torch.cat([self.kv[0][:, :, :cut], tiny.kv(n - cut, seed=seed)], dim=2))


def test_random_operations_never_return_wrong_data(tiny, tmp_path, bits_equal):
    pool = PoolTier(tmp_path / "pool", None, create=True)
    faulty = FaultyTier(pool, seed=1234, delay_prob=0.3, max_delay_s=0.004, error_prob=0.15, miss_prob=0.1)
    host = HostCache(5 * SLOT, tiny.layout, C)  # small: most reads go through the faulty pool
    store = TieredStore(tiny.config(io_threads=2, write_queue_chunks=64, read_timeout_s=5.0),
                        host=host, tiers=[faulty])
    truth = Truth(tiny)
    rng = random.Random(99)
    outcomes = {"put": 0, "hit": 0, "full_get": 0, "key_error": 0, "iter_chunks": 0}
    try:
        for _ in range(300):
            s = rng.randrange(len(truth.tokens))
            tokens, kv = truth.tokens[s], truth.kv[s]
            op = rng.random()
            if op < 0.3:
                n = rng.randrange(0, len(tokens) + 1)
                store.put(tokens[:n], kv[:, :, :n])
                outcomes["put"] += 1
            elif op < 0.6:
                n = rng.randrange(0, len(tokens) + 1)
                hit = store.lookup(tokens[:n])
                assert hit.num_tokens % C == 0 and hit.num_tokens <= n // C * C
                assert len(hit.chunk_tiers) == hit.num_tokens // C
                assert set(hit.chunk_tiers) <= {"host", "pool"}
                outcomes["hit"] += hit.num_tokens > 0
                try:
                    got = store.get(tokens[:hit.num_tokens])
                except KeyError:
                    outcomes["key_error"] += 1
                else:
                    bits_equal(got, kv[:, :, :hit.num_tokens])
                    outcomes["full_get"] += hit.num_tokens > 0
            elif op < 0.85:
                m = rng.randrange(0, len(tokens) // C + 1) * C
                try:
                    got = store.get(tokens[:m])
                except KeyError:
                    outcomes["key_error"] += 1
                else:
                    bits_equal(got, kv[:, :, :m])
                    outcomes["full_get"] += m > 0
            elif op < 0.95:
                ids = store.chunk_ids(tokens)
                expected_index = 0
                for loaded in store.iter_chunks(ids):
                    assert loaded.index == expected_index
                    bits_equal(loaded.data, kv[:, :, loaded.index * C:(loaded.index + 1) * C])
                    expected_index += 1
                outcomes["iter_chunks"] += expected_index
            else:
                store.flush()
                host.evict(rng.choice([0, 2 * SLOT]))
        store.flush()
    finally:
        faulty.wake()
        store.close()
    injected = faulty.injected()
    # The run exercised every path: data served, misses taken, and faults of every kind injected.
    assert outcomes["full_get"] > 20 and outcomes["key_error"] > 5 and outcomes["iter_chunks"] > 10
    assert injected["load"]["errors"] > 0 and injected["load"]["misses"] > 0
    assert injected["store"]["errors"] > 0 and injected["lookup"]["errors"] > 0
    assert sum(c["delays"] for c in injected.values()) > 0
    snap = pool.metrics.snapshot()
    assert snap.failed_reads == injected["load"]["errors"]
    assert snap.failed_writes == injected["store"]["errors"]
    assert snap.corrupt_chunks == 0  # injected faults are never mistaken for bad files


def test_read_errors_are_misses_that_keep_the_file(tiny, tmp_path):
    pool = PoolTier(tmp_path / "pool", None, create=True)
    faulty = FaultyTier(pool, error_prob=1.0, ops=["load"])
    store = TieredStore(tiny.config(host_bytes=0), tiers=[faulty])
    try:
        tokens = tiny.tokens(32)
        store.put(tokens, tiny.kv(32))
        store.flush()
        assert store.lookup(tokens).num_tokens == 32
        with pytest.raises(KeyError):
            store.get(tokens)
        assert list(store.iter_chunks(store.chunk_ids(tokens))) == []
        assert store.lookup(tokens).num_tokens == 32  # an I/O error is not proof of a bad file
        snap = pool.metrics.snapshot()
        # Each read attempt failed (chunk 1 is read ahead in parallel, so 2 to 4 attempts).
        assert snap.failed_reads == faulty.injected()["load"]["errors"] >= 2
        assert snap.corrupt_chunks == 0
    finally:
        store.close()


def test_a_read_slower_than_read_timeout_ends_the_prefix_in_bounded_time(tiny, tmp_path, bits_equal):
    pool = PoolTier(tmp_path / "pool", None, create=True)
    faulty = FaultyTier(pool, delay_prob=1.0, min_delay_s=30.0, max_delay_s=30.0, ops=["load"])
    host = HostCache(16 * SLOT, tiny.layout, C)
    # tier_cooldown_s=0: every read probes the pool again (test_slow_tier.py covers the cooldown).
    store = TieredStore(tiny.config(io_threads=2, read_timeout_s=0.2, tier_cooldown_s=0), host=host, tiers=[faulty])
    try:
        tokens, kv = tiny.tokens(64), tiny.kv(64)
        store.put(tokens, kv)
        store.flush()
        host.evict(2 * SLOT)  # chunks 0 and 1 now only in the (very slow) pool
        assert store.lookup(tokens).chunk_tiers == ("pool", "pool", "host", "host")

        t0 = time.monotonic()
        with pytest.raises(KeyError):
            store.get(tokens)
        assert time.monotonic() - t0 < 2.0  # one read_timeout_s, not the 30 s delay
        assert pool.metrics.snapshot().timeouts == 1

        # Slow chunk later in the prefix: the chunks before it are served, then it stops.
        host.evict(0)
        store.put(tokens[:32], kv[:, :, :32])  # chunks 0 and 1 back in host DRAM
        store.flush()
        assert store.lookup(tokens).chunk_tiers == ("host", "host", "pool", "pool")
        t0 = time.monotonic()
        served = [(c.index, c.data.clone()) for c in store.iter_chunks(store.chunk_ids(tokens))]
        assert time.monotonic() - t0 < 2.0
        assert [i for i, _ in served] == [0, 1]
        bits_equal(torch.cat([d for _, d in served], dim=2), kv[:, :, :32])
        assert pool.metrics.snapshot().timeouts == 2
    finally:
        faulty.wake()  # let the abandoned reads finish so close() does not wait 30 s
        store.close()


def test_a_read_that_outlives_its_load_never_reaches_the_sink(tiny, tmp_path):
    """An engine reuses the KV blocks of a failed load at once: a late read must not write there."""
    pool = PoolTier(tmp_path / "pool", None, create=True)
    faulty = FaultyTier(pool, delay_prob=1.0, min_delay_s=30.0, max_delay_s=30.0, ops=["load"])
    store = TieredStore(tiny.config(io_threads=4, read_timeout_s=0.2), tiers=[faulty])
    try:
        tokens, kv = tiny.tokens(64), tiny.kv(64)
        for i in range(4):
            pool.store(Chunk(store.chunk_ids(tokens)[i], kv[:, :, i * C:(i + 1) * C].contiguous()),
                       tiny.spec())
        calls: list[int] = []
        t0 = time.monotonic()
        result = store.load_into(store.chunk_ids(tokens), lambda i, data: calls.append(i))
        assert time.monotonic() - t0 < 2.0
        assert result.num_chunks == 0 and pool.metrics.snapshot().timeouts == 1
        # The read in flight (chunk 0's: a tier's queue stays on one thread until reads
        # complete slowly) finishes now and finds the gate shut; the chunks queued behind it
        # were dropped when the load returned.
        faulty.wake()
        deadline = time.monotonic() + 5
        while faulty.inner.metrics.snapshot().bytes_read < tiny.payload_bytes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.metrics.snapshot().bytes_read >= tiny.payload_bytes  # the read did complete
        time.sleep(0.1)
        assert calls == []
    finally:
        faulty.wake()
        store.close()


def test_faults_enter_through_the_tier_factory_and_name_only_opened_tiers(tmp_path, tiny) -> None:
    from kvtier.tiers.opening import open_tiers

    config = tiny.config(disk_path=str(tmp_path / "d"), pool_url=new_pool(tmp_path / 'p'))
    tiers = open_tiers(config, faults={"pool": {"seed": 1, "error_prob": 1.0}})
    try:
        assert [type(t) for t in tiers][1] is FaultyTier and not isinstance(tiers[0], FaultyTier)
        assert [t.name for t in tiers] == ["disk", "pool"]
    finally:
        for t in tiers:
            t.close()
    with pytest.raises(ValueError, match=r"inject_faults: no tier named \['redis'\]"):
        open_tiers(config, faults={"redis": {"seed": 1}})
    assert open_tiers(config)[0].name == "disk"  # the failed open released the disk tier's lock
