"""The store against hostile inputs and broken tiers: it never hangs, never loses a thread, never
grows without bound (docs/reliability.md, "Never wrong, never stuck")."""

from __future__ import annotations

import threading
import time

import pytest

from _pool import new_pool
from kvtier import TieredStore
from kvtier.retention import Retention
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.faulty import FaultyTier
from kvtier.tiers.host import HostCache
from kvtier.tiers.pool import PoolTier


def _returns_within(fn, seconds: float) -> bool:
    """Whether ``fn()`` returns within ``seconds`` (run on a daemon thread: a hang fails, not blocks)."""
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds)


class RaisingRetainDisk(DiskTier):
    """A tier whose retain raises what os.utime raised for a huge time (OverflowError)."""

    def retain(self, key, until):  # type: ignore[no-untyped-def]
        raise OverflowError("timestamp out of range for platform time_t")


def test_a_huge_retention_is_refused_at_the_api(make_store, tiny, tmp_path):
    store = make_store(disk_path=str(tmp_path / "disk"))
    ids = store.chunk_ids(tiny.tokens(32))
    for bad in (1e20, float("inf"), float("nan"), -1.0, "soon", True):
        with pytest.raises(ValueError, match="retain until"):
            store.retain(ids, bad)


def test_a_raising_retention_hook_does_not_kill_the_writer(make_store, tiny, tmp_path):
    """Before: an OverflowError in the writer's landed hook ended the writer thread, so nothing
    more was written and flush() never returned."""
    disk = RaisingRetainDisk(tmp_path / "disk", 1 << 30)
    store = make_store(tiers=[disk], host=HostCache(1 << 20, tiny.layout, tiny.chunk_tokens))
    tokens = tiny.tokens(64)
    ids = store.chunk_ids(tokens)
    store.retain(ids, time.time() + 3600)  # recorded, so every chunk that lands calls disk.retain
    store.put(tokens[:32], tiny.kv(32))
    assert _returns_within(store.flush, 10.0), "flush hung: the writer thread died"
    store.put(tokens, tiny.kv(64))  # later writes still happen
    assert _returns_within(store.flush, 10.0)
    assert disk.lookup(ids) == 4
    assert store.store_metrics.snapshot().thread_errors >= 4


def test_a_raising_tier_lookup_or_load_is_a_miss_not_an_exception(make_store, tiny, tmp_path):
    class Broken(DiskTier):
        def load(self, chunk, spec, into=None):  # type: ignore[no-untyped-def]
            raise RuntimeError("tier bug")

    disk = Broken(tmp_path / "disk", 1 << 30)
    store = make_store(tiers=[disk], host=None)
    tokens = tiny.tokens(32)
    store.put(tokens, tiny.kv(32))
    store.flush()
    assert store.lookup(tokens).num_tokens == 32
    assert list(store.iter_chunks(store.chunk_ids(tokens))) == []
    assert store.store_metrics.snapshot().thread_errors == 1


class LosingHost(HostCache):
    """Host DRAM that loses every chunk between the lookup and the read (an eviction race)."""

    def acquire(self, cid):  # type: ignore[no-untyped-def]
        return None


def test_a_host_chunk_evicted_before_delivery_is_reread_under_the_timeout(tiny, tmp_path):
    """Before: the fallback read of a host chunk that was evicted since the lookup ran inline
    with no timeout: against a hung pool the caller blocked for the whole delay."""
    pool = PoolTier(tmp_path / "pool", None, create=True)
    faulty = FaultyTier(pool, delay_prob=1.0, min_delay_s=30.0, max_delay_s=30.0, ops=["load"])
    host = LosingHost(1 << 20, tiny.layout, tiny.chunk_tokens)
    store = TieredStore(tiny.config(read_timeout_s=0.5, tier_cooldown_s=60), host=host, tiers=[faulty])
    try:
        tokens = tiny.tokens(32)
        store.put(tokens, tiny.kv(32))
        store.flush()
        assert store.lookup(tokens).chunk_tiers == ("host", "host")
        t0 = time.monotonic()
        with pytest.raises(KeyError):
            store.get(tokens)
        assert time.monotonic() - t0 < 3.0  # one read_timeout_s, not the 30 s the pool hangs
        assert pool.metrics.snapshot().timeouts == 1  # the tier that hung is the one tripped
        t0 = time.monotonic()
        with pytest.raises(KeyError):
            store.get(tokens)  # tripped: skipped at once
        assert time.monotonic() - t0 < 0.5
    finally:
        faulty.wake()
        store.close()


def test_a_hung_tier_holds_only_its_own_io_threads(tiny, tmp_path, bits_equal):
    """Reads stuck in a hung pool never take the threads a healthy disk tier's reads need."""
    disk = DiskTier(tmp_path / "disk", 1 << 30)
    pool = PoolTier(tmp_path / "pool", None, create=True)
    faulty = FaultyTier(pool, delay_prob=1.0, min_delay_s=30.0, max_delay_s=30.0, ops=["load"])
    store = TieredStore(tiny.config(io_threads=2, read_timeout_s=0.5, tier_cooldown_s=0), host=None,
                        tiers=[disk, faulty])
    try:
        pooled = tiny.tokens(64, seed=1)
        disk_only = tiny.tokens(64, seed=2)
        kv = tiny.kv(64)
        store.put(pooled, kv)
        store.put(disk_only, kv)
        store.flush()
        for cid in store.chunk_ids(pooled):
            disk.files.remove(cid.key)
            disk._forget(cid.key)
        with pytest.raises(KeyError):
            store.get(pooled)  # both pool threads now stuck for 30 s
        t0 = time.monotonic()
        bits_equal(store.get(disk_only), kv)
        assert time.monotonic() - t0 < 2.0
    finally:
        faulty.wake()
        store.close()


def test_every_thread_the_store_starts_runs_thread_init(tiny, tmp_path):
    seen: set[str] = set()
    lock = threading.Lock()

    def init() -> None:
        with lock:
            seen.add(threading.current_thread().name)

    before = set(threading.enumerate())
    store = TieredStore(tiny.config(disk_path=str(tmp_path / "disk"), pool_url=new_pool(tmp_path / "pool"),
                                    io_threads=2), thread_init=init)
    try:
        tokens = tiny.tokens(64)
        store.put(tokens, tiny.kv(64))
        store.flush()
        store.host.evict(0)
        store.get(tokens)
        store.retain(store.chunk_ids(tokens), time.time() + 60)
        store.flush()
        store.lookup(tiny.tokens(32, seed=9))
        started = {t.name for t in threading.enumerate() if t not in before and t.name.startswith("kvtier-")}
        assert {"kvtier-writer-0", "kvtier-retain_0", "kvtier-io-disk_0", "kvtier-lookup_0"} <= started
        assert started <= seen
    finally:
        store.close()


def test_retention_state_and_queue_are_bounded(tiny):
    class Slow:
        name = "slow"
        gate = threading.Event()

        def retain(self, key, until):  # type: ignore[no-untyped-def]
            self.gate.wait(10)
            return True

    retention = Retention(max_keys=100, max_pending=3)
    slow = Slow()
    try:
        until = time.time() + 3600
        for seed in range(20):
            retention.retain(tiny.ids(10, seed=seed), until, [slow])  # type: ignore[list-item]
        # The thread is stuck in a tier: the callers alone hold the table at max_keys + 1/8.
        assert len(retention._until) == 112
        newest = tiny.ids(10, seed=19)
        assert all(cid.key in retention._until for cid in newest)  # the oldest retentions went first
        Slow.gate.set()
        retention.flush()
        assert len(retention._until) == 100  # the sweep ran once the thread was free
        snap = retention._metrics.snapshot()
        # 100 of 200 keys forgotten; 17 of the 20 batches found the queue full (1 running, 2 queued).
        assert snap.dropped_retentions == 100 + 17 * 10
    finally:
        Slow.gate.set()
        retention.close()


def test_a_full_retention_table_is_swept_off_the_callers_thread_expired_keys_first(tiny, monkeypatch):
    """6f37bba rebuilt the whole table (2^18 keys: 18.8 ms) in every retain() once full, on the
    model runner's thread of every rank."""
    from kvtier import retention as retention_module

    swept_on: list[str] = []
    real_sweep = Retention._sweep

    def sweep(self):  # type: ignore[no-untyped-def]
        swept_on.append(threading.current_thread().name)
        real_sweep(self)

    monkeypatch.setattr(Retention, "_sweep", sweep)
    retention = Retention(max_keys=800)
    try:
        now = time.time()
        retention.retain(tiny.ids(400, seed=1), now + 0.2, [])  # expire soon
        retention.retain(tiny.ids(400, seed=2), now + 3600, [])
        time.sleep(0.3)
        passes = len(swept_on)
        for seed in range(3, 40):
            retention.retain(tiny.ids(10, seed=seed), now + 3600, [])
        retention.flush()
        assert all(cid.key in retention._until for cid in tiny.ids(400, seed=2))  # expired went instead
        assert not any(cid.key in retention._until for cid in tiny.ids(400, seed=1))
        assert len(retention._until) == 400 + 37 * 10
        # At most one pass per max_keys // 8 new keys, and never on this thread.
        assert 1 <= len(swept_on) - passes <= 1 + 370 // 100
        assert all(name.startswith("kvtier-retain") for name in swept_on)
        assert retention_module.MAX_KEYS == 1 << 18
    finally:
        retention.close()


def test_every_cache_salt_costs_a_bounded_spec_cache_and_namespace_files(make_store, tiny, tmp_path, monkeypatch):
    from kvtier import specs as specs_module
    from kvtier.store import MAX_DESCRIBED

    monkeypatch.setattr(specs_module, "MAX_SPECS", 64)  # reached by the salts below (4096 is too many here)
    store = make_store(pool_url=new_pool(tmp_path / "pool"))
    tokens = tiny.tokens(16)
    for i in range(MAX_DESCRIBED + 40):
        store.lookup(tokens, tenant_salt=f"tenant-{i}")
        store._spec(store._namespace(f"tenant-{i}"))
    assert len(store._specs) == 64  # least recently used dropped
    files = list((tmp_path / "pool" / "namespaces").glob("*.json"))
    assert len(files) == MAX_DESCRIBED  # the store's own namespace and the first salted ones
    assert store.store_metrics.snapshot().undescribed_namespaces == 41
    store.put(tokens, tiny.kv(16), tenant_salt="tenant-999")  # an undescribed namespace still works
    store.flush()
    assert store.lookup(tokens, tenant_salt="tenant-999").num_tokens == 16
