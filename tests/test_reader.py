"""kvtier.reader: which I/O threads read a prefix, and how torch runs on kvtier's threads.

Warm reads stay on one I/O thread (more threads only hand the GIL around), slow ones too when the
page cache served them, unless their chunks are large; the second slow read of the device calls
up the tier's other threads so that reads overlap, and a tier whose last read was slow starts its
next load on all of them. Every kvtier thread runs torch's CPU
ops on itself alone, without changing the engine's thread count.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

import kvtier.reader as reader
from _pool import new_pool
from conftest import require_cachestat
from kvtier.libc import openmp
from kvtier.threads import executor, thread
from kvtier.tiers.faulty import FaultyTier
from kvtier.tiers.pagecache import cache_hits_are_local, filesystem_type

C = 16  # the tiny model's chunk tokens


def _load_threads(store, tokens) -> tuple[int, set[str]]:
    names: set[str] = set()
    lock = threading.Lock()

    def sink(i: int, data: torch.Tensor) -> None:
        with lock:
            names.add(threading.current_thread().name)

    got = store.load_into(store.chunk_ids(tokens), sink, promote=False)
    return got.num_chunks, names


def test_fast_reads_stay_on_one_io_thread(make_store, tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "FAST_READ_S", 5.0)  # every read "fast", however loaded the machine
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "pool"), io_threads=4)
    tokens = tiny.tokens(C * 12, seed=3)
    store.put(tokens, tiny.kv(C * 12, seed=3))
    store.flush()
    for _ in range(3):
        n, names = _load_threads(store, tokens)
        assert n == 12
        assert len(names) == 1 and next(iter(names)).startswith("kvtier-io-pool")


def test_a_slow_read_calls_up_the_other_io_threads(make_store, tiny, tmp_path):
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "pool"), io_threads=4)
    tokens = tiny.tokens(C * 12, seed=4)
    store.put(tokens, tiny.kv(C * 12, seed=4))
    store.flush()
    # Every read 50 ms (FAST_READ_S is 0.5 ms): after the second (SLOW_READS), the reads spread.
    store.tiers = [FaultyTier(t, delay_prob=1.0, min_delay_s=0.05, max_delay_s=0.05, ops=("load",))
                   for t in store.tiers]
    t0 = time.monotonic()
    n, names = _load_threads(store, tokens)
    elapsed = time.monotonic() - t0
    assert n == 12
    assert len(names) >= 2, names
    assert elapsed < 12 * 0.05, elapsed  # in one thread: 0.6 s at least


class _SlowCPU:
    """A tier whose reads the page cache serves but which take 5 ms each: a machine whose cores
    are busy (the engine's threads), not a slow device."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load(self, cid, spec, into=None):
        time.sleep(0.005)
        return dataclasses.replace(self.inner.load(cid, spec, into), from_cache=True)


def test_slow_reads_from_the_page_cache_stay_on_one_io_thread(make_store, tiny, tmp_path):
    # More threads cannot make a read the page cache serves faster; on a busy machine they only
    # add runnable threads. The same 5 ms reads, reported as device reads, spread (below).
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "pool"), io_threads=4)
    tokens = tiny.tokens(C * 12, seed=6)
    store.put(tokens, tiny.kv(C * 12, seed=6))
    store.flush()
    pool = store.tiers[0]
    store.tiers = [_SlowCPU(pool)]
    n, names = _load_threads(store, tokens)
    assert n == 12
    assert len(names) == 1, names
    store.tiers = [FaultyTier(pool, delay_prob=1.0, min_delay_s=0.005, max_delay_s=0.005, ops=("load",))]
    n, names = _load_threads(store, tokens)
    assert n == 12
    assert len(names) >= 2, names


def test_slow_reads_of_large_chunks_from_the_page_cache_spread(make_store, tiny, tmp_path, monkeypatch):
    # A large chunk's page-cache read is a memory copy and a checksum that run without the GIL
    # for milliseconds: a second thread doubles what the cache delivers.
    monkeypatch.setattr(reader, "BIG_CACHED_READ_BYTES", tiny.payload_bytes)
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "pool"), io_threads=4)
    tokens = tiny.tokens(C * 12, seed=6)
    store.put(tokens, tiny.kv(C * 12, seed=6))
    store.flush()
    store.tiers = [_SlowCPU(store.tiers[0])]
    n, names = _load_threads(store, tokens)
    assert n == 12
    assert len(names) >= 2, names


def test_a_tier_whose_last_read_was_slow_starts_the_next_load_on_all_its_threads(make_store, tiny, tmp_path,
                                                                                   monkeypatch):
    """Two slow reads in one load: the old rule read both on one thread (the second called up
    the others with nothing left to read). After a slow load, the next starts spread."""
    monkeypatch.setattr(reader, "FAST_READ_S", 0.02)  # 50 ms reads are slow, the pool's own are not
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "pool"), io_threads=4)
    tokens = tiny.tokens(C * 2, seed=8)
    store.put(tokens, tiny.kv(C * 2, seed=8))
    store.flush()
    pool = store.tiers[0]
    store.tiers = [FaultyTier(pool, delay_prob=1.0, min_delay_s=0.05, max_delay_s=0.05, ops=("load",))]
    n, first = _load_threads(store, tokens)
    assert n == 2 and len(first) == 1, first
    n, second = _load_threads(store, tokens)
    assert n == 2 and len(second) == 2, second
    store.tiers = [pool]  # fast again: the load after a fast read keeps to one thread
    _load_threads(store, tokens)
    n, third = _load_threads(store, tiny.tokens(C * 2, seed=8))
    assert n == 2 and len(third) == 1, third


def test_the_file_tier_says_when_the_page_cache_served_a_read(make_store, tiny, tmp_path):
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "pool"))
    tokens = tiny.tokens(C * 2, seed=7)
    store.put(tokens, tiny.kv(C * 2, seed=7))
    store.flush()
    (path,) = list((tmp_path / "pool").rglob("*.kvt"))[:1]
    require_cachestat(path)
    pool = store.tiers[0]
    spec = store._spec(store._namespace(None))
    got = [pool.load(cid, spec) for cid in store.chunk_ids(tokens)]
    assert all(r.ok and r.from_cache for r in got)  # just written: every page in the cache


def test_chunks_after_the_end_of_a_prefix_are_never_read(make_store, tiny, tmp_path, monkeypatch):
    """A chunk gone from every tier ends the prefix; the queue's later chunks are dropped, not read."""
    monkeypatch.setattr(reader, "FAST_READ_S", 5.0)
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "pool"), io_threads=8)
    tokens = tiny.tokens(C * 40, seed=5)
    store.put(tokens, tiny.kv(C * 40, seed=5))
    store.flush()
    ids = store.chunk_ids(tokens)
    pool = store.tiers[0]
    before = pool.metrics.snapshot()
    # Chunk 1's file removed after the lookup found it: the load learns it only from the read.
    located = ("pool",) * 40
    (tmp_file,) = [p for p in (tmp_path / "pool").rglob("*.kvt") if ids[1].key.hex() in p.name]
    tmp_file.unlink()
    slow = FaultyTier(pool, delay_prob=1.0, min_delay_s=0.01, max_delay_s=0.01, ops=("load",))
    store.tiers = [slow]
    calls: list[int] = []
    got = store.load_into(ids, lambda i, data: calls.append(i), promote=False, tiers=located)
    assert got.num_chunks == 1
    time.sleep(0.2)  # any read still queued would run by now
    # One thread reads in order: chunk 0, the miss of chunk 1, maybe one more; never all 40.
    reads = slow.injected()["load"]["calls"]
    assert 2 <= reads <= 4, reads
    assert set(calls) <= {0, 2, 3}
    assert pool.metrics.snapshot().timeouts == before.timeouts


@pytest.mark.skipif(openmp() is None, reason="torch has no OpenMP runtime here")
def test_kvtier_threads_run_torch_on_one_cpu_thread_and_leave_the_engines_count_alone():
    main = torch.get_num_threads()
    seen: dict[str, int] = {}

    def record(key: str) -> None:
        torch.ones(4).add_(1)
        seen[key] = torch.get_num_threads()

    t = thread(lambda: record("thread"), "kvtier-test")
    t.start()
    t.join()
    with executor(2, "kvtier-test-pool") as pool:
        pool.submit(record, "executor").result()
    later = threading.Thread(target=record, args=("engine's later thread",))  # not kvtier's
    later.start()
    later.join()
    assert seen == {"thread": 1, "executor": 1, "engine's later thread": main}
    assert torch.get_num_threads() == main


def test_only_a_local_filesystems_page_cache_hits_count_as_memory_reads(tmp_path):
    mountinfo = "\n".join([
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw",
        "40 22 0:40 / /mnt/kv\\040pool rw,relatime shared:2 - fuse.glusterfs srv:/kv rw",
        "41 22 0:41 / /mnt/nfs rw,relatime - nfs4 srv:/export rw",
        "42 22 0:42 / /dev/shm rw - tmpfs tmpfs rw",
    ])
    assert cache_hits_are_local("/var/tmp/pool", mountinfo)
    assert cache_hits_are_local("/dev/shm/pool", mountinfo)
    assert not cache_hits_are_local("/mnt/kv pool/a/b", mountinfo)  # the longest mount point wins
    assert not cache_hits_are_local("/mnt/nfs", mountinfo)
    assert cache_hits_are_local("/mnt/nfsx", mountinfo)  # not under /mnt/nfs: the root's ext4
    assert filesystem_type(str(tmp_path)) is not None  # this machine's own mountinfo parses
