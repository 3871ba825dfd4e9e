"""kvtier.store: TieredStore put/lookup/get across tiers, bad chunk files, queueing, open errors."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from _pool import new_pool
from conftest import kvt_files
from kvtier import KVLayout, PutResult, TieredStore, TierUnavailableError
from kvtier.format import HEADER_BYTES, PAYLOAD_OFFSET, ChunkSpec, unpack_header
from kvtier.keys import FORMAT_VERSION, ChunkId
from kvtier.metrics import TierMetrics
from kvtier.tiers.base import Chunk, LoadResult, Status, StoreResult, TierBase
from kvtier.tiers.host import HostCache

C = 16       # chunk tokens
SLOT = 8192  # one tiny chunk file / host slot


class GateTier(TierBase):
    """An in-memory lower tier whose ``store`` waits until ``gate`` is set."""

    name = "slow"

    def __init__(self) -> None:
        self.metrics = TierMetrics(self.name)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.stored: list[bytes] = []
        self._chunks: dict[bytes, torch.Tensor] = {}

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        n = 0
        while n < len(ids) and ids[n].key in self._chunks:
            n += 1
        return n

    def load(self, chunk: ChunkId, spec: ChunkSpec, into: np.ndarray | None = None) -> LoadResult:
        data = self._chunks.get(chunk.key)
        return LoadResult(Status.MISS) if data is None else LoadResult(Status.HIT, Chunk(chunk, data.clone()))

    def store(self, chunk: Chunk, spec: ChunkSpec) -> StoreResult:
        self.entered.set()
        assert self.gate.wait(10), "test never opened the gate"
        self.stored.append(chunk.id.key)
        self._chunks[chunk.id.key] = chunk.data.clone()
        return StoreResult(Status.WRITTEN)

    def evict(self, target_bytes: int) -> int:
        return 0

    def close(self) -> None:
        self.gate.set()


@pytest.fixture
def gate_tier():
    tier = GateTier()
    yield tier
    tier.gate.set()  # never leave a writer thread blocked


# -- round trips ----------------------------------------------------------------------------------


def test_put_lookup_get_round_trip_in_host(make_store, tiny, bits_equal):
    store = make_store()
    tokens, kv = tiny.tokens(50), tiny.kv(50)  # 3 full chunks and 2 trailing tokens
    assert store.put(tokens, kv) == PutResult(stored_chunks=3, present_chunks=0, dropped_writes=0)
    hit = store.lookup(tokens)
    assert (hit.num_tokens, hit.chunk_tiers, hit.num_chunks) == (48, ("host",) * 3, 3)
    assert hit.tokens_by_tier() == {"host": 48}
    bits_equal(store.get(tokens[:48]), kv[:, :, :48])
    bits_equal(store.get(tokens[:16]), kv[:, :, :16])
    assert store.put(tokens, kv) == PutResult(0, 3, 0)
    assert store.put(tokens[:64] + tiny.tokens(14, seed=9), tiny.kv(64)).stored_chunks == 1


@pytest.mark.parametrize("tier", ["disk", "pool"])
def test_round_trip_through_each_lower_tier_alone(make_store, tiny, tmp_path, bits_equal, tier):
    where = {"disk": {"disk_path": str(tmp_path / "d")}, "pool": {"pool_url": new_pool(tmp_path / "p")}}[tier]
    store = make_store(host_bytes=0, **where)
    tokens, kv = tiny.tokens(64, seed=1), tiny.kv(64, seed=1)
    assert store.put(tokens, kv) == PutResult(4, 0, 0)
    store.flush()
    assert store.lookup(tokens).chunk_tiers == (tier,) * 4
    bits_equal(store.get(tokens), kv)
    loaded = list(store.iter_chunks(store.chunk_ids(tokens)))
    assert [(c.index, c.tier) for c in loaded] == [(i, tier) for i in range(4)]


def test_get_fills_out_in_place_warm_or_cold_and_a_strided_out_through_the_sink(make_store, tiny, tmp_path,
                                                                                 bits_equal):
    """With no host DRAM, ``get`` lands chunks in ``out`` itself: read there from the page cache,
    or copied there from the read buffer when cold; an ``out`` that is not contiguous gets copies."""
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "p"), io_threads=3)
    tokens, kv = tiny.tokens(C * 5, seed=11), tiny.kv(C * 5, seed=11)
    store.put(tokens, kv)
    store.flush()
    out = torch.full(tuple(kv.shape), 7.0, dtype=kv.dtype)
    bits_equal(store.get(tokens, out=out), kv)
    for path in (tmp_path / "p").rglob("*.kvt"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    out.fill_(7.0)
    assert store.get(tokens, out=out) is out
    bits_equal(out, kv)
    strided = torch.full((kv.shape[0], kv.shape[1], 2 * kv.shape[2], *kv.shape[3:]), 7.0,
                         dtype=kv.dtype)[:, :, :kv.shape[2]]
    assert not strided.is_contiguous()
    bits_equal(store.get(tokens, out=strided), kv)


def test_put_chunk_now_writes_every_tier_before_it_returns(make_store, tiny, tmp_path, bits_equal):
    """The synchronous write (SGLang's backup thread): no queue, no host DRAM, a true answer."""
    store = make_store(host_bytes=0, disk_path=str(tmp_path / "d"), pool_url=new_pool(tmp_path / "p"))
    tokens, kv = tiny.tokens(32, seed=6), tiny.kv(32, seed=6)
    first, second = store.chunk_ids(tokens)
    assert store.put_chunk_now(first, kv[:, :, :16]) is True
    assert store.write_queue == 0 and store.lookup(tokens).chunk_tiers == ("disk",)  # no flush needed
    assert len(kvt_files(tmp_path / "d")) == 1 and len(kvt_files(tmp_path / "p")) == 1
    assert store.put_chunk_now(first, kv[:, :, :16]) is True  # already there: still true
    assert store.put_chunk_now(second, lambda buf: buf.copy_(kv[:, :, 16:])) is True
    bits_equal(store.get(tokens), kv)
    assert make_store(host_bytes=0).put_chunk_now(first, kv[:, :, :16]) is False  # no tier to hold it


def test_begin_put_is_invisible_until_committed_and_abandon_frees_it(make_store, tiny, tmp_path, bits_equal):
    store = make_store(disk_path=str(tmp_path / "d"))
    tokens, kv = tiny.tokens(32, seed=4), tiny.kv(32, seed=4)
    first, second = store.chunk_ids(tokens)
    pending = store.begin_put(first)
    assert pending is not None
    pending.buffer.copy_(kv[:, :, :16])  # e.g. an asynchronous device copy, not yet known to be done
    assert store.lookup(tokens).num_chunks == 0
    assert pending.commit() == PutResult(1, 0, 0)
    store.flush()
    assert store.lookup(tokens).chunk_tiers == ("host",)
    assert store.begin_put(first) is None  # already held: nothing to do
    dropped = store.begin_put(second)
    assert dropped is not None
    dropped.abandon()
    store.flush()
    assert store.lookup(tokens).num_chunks == 1 and len(kvt_files(tmp_path / "d")) == 1
    bits_equal(store.get(tokens[:16]), kv[:, :, :16])


def test_a_stopped_load_into_ends_early_and_never_calls_the_sink_after(make_store, tiny, tmp_path):
    from kvtier.tiers.faulty import FaultyTier

    store = make_store(host_bytes=0, disk_path=str(tmp_path / "d"), io_threads=1)
    tokens = tiny.tokens(16 * 6, seed=5)
    store.put(tokens, tiny.kv(16 * 6, seed=5))
    store.flush()
    store.tiers = [FaultyTier(t, delay_prob=1.0, min_delay_s=0.2, max_delay_s=0.2, ops=("load",))
                   for t in store.tiers]
    stop, calls = threading.Event(), []
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    got = store.load_into(store.chunk_ids(tokens), lambda i, data: calls.append(i), stop=stop)
    assert time.monotonic() - t0 < 0.6 and got.num_chunks <= 2
    seen = len(calls)
    time.sleep(0.5)
    assert len(calls) == seen


def test_lookup_ignores_partial_trailing_chunk(make_store, tiny):
    store = make_store()
    tokens = tiny.tokens(64)
    store.put(tokens, tiny.kv(64))
    lengths = (0, 15, 16, 31, 47, 63, 64)
    assert [store.lookup(tokens[:n]).num_tokens for n in lengths] == [0, 0, 16, 16, 32, 48, 64]
    # Extra tokens past what was stored never count.
    assert store.lookup(tokens + tiny.tokens(40, seed=5)).num_tokens == 64


def test_lookup_is_the_longest_contiguous_prefix(make_store, tiny, tmp_path):
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "p"))
    tokens = tiny.tokens(80)
    store.put(tokens, tiny.kv(80))
    store.flush()
    ids = store.chunk_ids(tokens)
    os.unlink(store.tiers[0].files.path_for(ids[2].key))
    assert store.lookup(tokens).num_tokens == 32  # chunks 3 and 4 are there but unreachable
    assert store.lookup(tiny.tokens(80, seed=1)).num_tokens == 0
    # lookup_ids: the same answer from identities the caller already holds.
    assert store.lookup_ids(ids) == store.lookup(tokens)
    assert store.lookup_ids(ids[:2]).num_tokens == 32 and store.lookup_ids([]).num_tokens == 0


def test_get_rejects_partial_chunks_and_missing_chunks(make_store, tiny):
    store = make_store()
    tokens = tiny.tokens(48)
    store.put(tokens[:32], tiny.kv(32))
    with pytest.raises(ValueError, match="chunk_tokens=16"):
        store.get(tokens[:40])
    with pytest.raises(KeyError, match="only 2 of 3 chunks"):
        store.get(tokens)
    with pytest.raises(KeyError):
        store.get(tiny.tokens(16, seed=77))
    assert store.get([]).shape == (2, 2, 0, 2, 8)


def test_get_raises_key_error_once_a_chunk_is_gone(make_store, tiny, tmp_path):
    store = make_store(pool_url=new_pool(tmp_path / "p"))
    tokens = tiny.tokens(32)
    store.put(tokens, tiny.kv(32))
    store.flush()
    assert store.lookup(tokens).num_tokens == 32
    store.host.evict(0)
    for f in kvt_files(tmp_path / "p"):
        f.unlink()
    assert store.lookup(tokens).num_tokens == 0
    with pytest.raises(KeyError):
        store.get(tokens)


def test_read_race_between_lookup_and_get_is_a_counted_miss(make_store, tiny, tmp_path, bits_equal):
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "p"))
    tokens, kv = tiny.tokens(48), tiny.kv(48)
    store.put(tokens, kv)
    store.flush()
    assert store.lookup(tokens).num_tokens == 48
    pool = store.tiers[0]
    # Chunk 1 vanishes after the lookup (another instance evicted it) but before the read.
    real_load = pool.load

    def load_after_eviction(cid, spec, into=None):
        if cid == store.chunk_ids(tokens)[1]:
            pool.files.path_for(cid.key).unlink(missing_ok=True)
        return real_load(cid, spec, into)

    pool.load = load_after_eviction
    with pytest.raises(KeyError):
        store.get(tokens)
    got = [(c.index, c.data.clone()) for c in store.iter_chunks(store.chunk_ids(tokens))]
    assert [i for i, _ in got] == [0]
    bits_equal(got[0][1], kv[:, :, :16])
    snap = store.metrics_snapshot()["tiers"]["pool"]
    assert (snap["read_races"], snap["corrupt_chunks"]) == (1, 0)  # the 2nd read stopped at lookup


def test_tiers_per_chunk_and_promotion_to_host(make_store, tiny, tmp_path, bits_equal):
    store = make_store(pool_url=new_pool(tmp_path / "p"))
    tokens, kv = tiny.tokens(64, seed=2), tiny.kv(64, seed=2)
    store.put(tokens, kv)
    store.flush()
    assert store.host.evict(2 * SLOT) == 2  # the two least recently used: chunks 0 and 1
    hit = store.lookup(tokens)
    assert hit.chunk_tiers == ("pool", "pool", "host", "host")
    assert hit.tokens_by_tier() == {"pool": 32, "host": 32}
    loaded = [(c.index, c.tier, c.data.clone()) for c in store.iter_chunks(store.chunk_ids(tokens))]
    assert [(i, t) for i, t, _ in loaded] == [(0, "pool"), (1, "pool"), (2, "host"), (3, "host")]
    bits_equal(torch.cat([d for _, _, d in loaded], dim=2), kv)
    # Chunks read from the pool were promoted into host DRAM.
    assert store.lookup(tokens).chunk_tiers == ("host",) * 4
    bits_equal(store.get(tokens), kv)
    assert store.metrics_snapshot()["tiers"]["pool"]["bytes_read"] == 2 * 2048


def test_lower_tier_hit_falls_back_past_a_corrupt_faster_copy(make_store, tiny, tmp_path, bits_equal):
    store = make_store(host_bytes=0, disk_path=str(tmp_path / "d"), pool_url=new_pool(tmp_path / "p"))
    tokens, kv = tiny.tokens(32), tiny.kv(32)
    store.put(tokens, kv)
    store.flush()
    assert store.lookup(tokens).chunk_tiers == ("disk", "disk")
    disk_file = store.tiers[0].files.path_for(store.chunk_ids(tokens)[0].key)
    with open(disk_file, "r+b") as f:
        f.seek(PAYLOAD_OFFSET + 3)
        f.write(b"\xff\xfe")
    loaded = [(c.index, c.tier, c.data.clone()) for c in store.iter_chunks(store.chunk_ids(tokens))]
    assert [(i, t) for i, t, _ in loaded] == [(0, "pool"), (1, "disk")]
    bits_equal(torch.cat([d for _, _, d in loaded], dim=2), kv)
    assert not disk_file.exists()
    assert store.metrics_snapshot()["tiers"]["disk"]["corrupt_chunks"] == 1


def test_a_load_told_where_its_chunks_are_looks_nothing_up_and_falls_back_only_on_a_miss(
        make_store, tiny, tmp_path, bits_equal):
    store = make_store(disk_path=str(tmp_path / "d"), pool_url=new_pool(tmp_path / "p"))
    tokens, kv = tiny.tokens(64, seed=4), tiny.kv(64, seed=4)
    store.put(tokens, kv)
    store.flush()
    ids = store.chunk_ids(tokens)
    assert store.host.evict(0) == 4
    pool_stats = store.tiers[1].files.lookup_stats
    found = store.lookup(tokens).chunk_tiers
    assert found == ("disk",) * 4
    stats = pool_stats.value
    store.tiers[0].files.remove(ids[1].key)  # gone from disk since the lookup: read from the pool
    out = torch.empty_like(kv)
    got: dict[int, torch.Tensor] = {}
    loaded = store.load_into(ids, lambda i, d: got.__setitem__(i, d.clone()), tiers=found, promote=False)
    assert loaded.chunk_tiers == ("disk", "pool", "disk", "disk")
    for i in range(4):
        out[:, :, i * C:(i + 1) * C] = got[i]
    bits_equal(out, kv)
    snap = store.metrics_snapshot()
    assert snap["store"]["load_lookups"] == 0 and pool_stats.value == stats  # no second lookup
    # A hint of host DRAM that no longer holds the chunk falls back to the tiers below.
    loaded = store.load_into(ids[:2], lambda i, d: None, tiers=("host", "host"))
    assert loaded.chunk_tiers == ("disk", "pool")
    # Without a hint the load looks its chunks up itself, and says so.
    store.load_into(ids, lambda i, d: None)
    assert store.metrics_snapshot()["store"]["load_lookups"] == 4


def test_pool_lookups_run_in_parallel_and_remember_misses_briefly(make_store, tiny, tmp_path):
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "p"), lookup_negative_ttl_s=0.3)
    pool = store.tiers[0]
    tokens = tiny.tokens(40 * C, seed=5)
    store.put(tokens[:30 * C], tiny.kv(30 * C, seed=5))
    store.flush()
    stats = pool.files.lookup_stats
    assert store.lookup(tokens).num_tokens == 30 * C
    time.sleep(0.05)  # stats still running past the miss (a window is asked at once) end
    assert 31 <= stats.value <= 40  # every hit and the miss, a few past it in the last window at most
    missing = store.chunk_ids(tokens)[30:31]
    before = stats.value
    assert pool.lookup(missing) == 0 and pool.lookup(missing) == 0
    assert stats.value - before <= 1  # remembered as absent: asked once at most (the first pass may have)
    time.sleep(0.35)
    before = stats.value
    assert pool.lookup(missing) == 0
    assert stats.value - before == 1  # forgotten after the ttl: asked again
    store.put(tokens, tiny.kv(40 * C, seed=5))  # this store's own write is seen at once
    store.flush()
    assert store.lookup(tokens).num_tokens == 40 * C


def test_tenant_salt_separates_and_round_trips_through_the_pool(make_store, tiny, tmp_path, bits_equal):
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "p"))
    tokens, kv = tiny.tokens(32), tiny.kv(32)
    store.put(tokens, kv, tenant_salt="tenant-a")
    store.flush()
    assert store.lookup(tokens).num_tokens == 0
    assert store.lookup(tokens, tenant_salt="tenant-b").num_tokens == 0
    assert store.lookup(tokens, tenant_salt="tenant-a").num_tokens == 32
    bits_equal(store.get(tokens, tenant_salt="tenant-a"), kv)
    assert store.metrics_snapshot()["tiers"]["pool"]["corrupt_chunks"] == 0


def test_extra_keys_separate_entries(make_store, tiny, bits_equal):
    store = make_store()
    tokens = tiny.tokens(32)
    store.put(tokens, tiny.kv(32, seed=1), extra=b"image-1")
    store.put(tokens, tiny.kv(32, seed=2), extra=b"image-2")
    assert store.lookup(tokens).num_tokens == 0
    bits_equal(store.get(tokens, extra=b"image-1"), tiny.kv(32, seed=1))
    bits_equal(store.get(tokens, extra=b"image-2"), tiny.kv(32, seed=2))


def test_put_copies_the_callers_tensor(make_store, tiny, bits_equal):
    store = make_store()
    tokens, kv = tiny.tokens(32), tiny.kv(32)
    expected = kv.clone()
    store.put(tokens, kv)
    kv.zero_()
    bits_equal(store.get(tokens), expected)


def test_put_validates_kv(make_store, tiny):
    store = make_store()
    tokens = tiny.tokens(32)
    with pytest.raises(ValueError, match="shape"):
        store.put(tokens, tiny.kv(16))                       # fewer tokens than full chunks
    with pytest.raises(ValueError, match="shape"):
        store.put(tokens, torch.zeros(2, 2, 32, 2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        store.put(tokens, tiny.kv(32).float())
    with pytest.raises(TypeError):
        store.put(tokens, np.zeros((2, 2, 32, 2, 8)))
    assert store.lookup(tokens).num_tokens == 0
    assert store.put(tokens[:10], tiny.kv(10)) == PutResult(0, 0, 0)  # no full chunk: nothing to do


def test_close_flushes_pending_writes_and_is_idempotent(make_store, tiny, tmp_path, bits_equal):
    pool = new_pool(tmp_path / "p")
    store = make_store(host_bytes=0, pool_url=pool)
    tokens, kv = tiny.tokens(160), tiny.kv(160)
    store.put(tokens, kv)
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put(tokens, kv)
    reopened = make_store(host_bytes=0, pool_url=pool)
    assert reopened.lookup(tokens).num_tokens == 160
    bits_equal(reopened.get(tokens), kv)


def test_context_manager_closes(tiny, tmp_path):
    with TieredStore(tiny.config(disk_path=str(tmp_path / "d"))) as store:
        store.put(tiny.tokens(16), tiny.kv(16))
    with TieredStore(tiny.config(disk_path=str(tmp_path / "d"))) as again:  # the disk lock was released
        assert again.lookup(tiny.tokens(16)).chunk_tiers == ("disk",)


# -- background writes ------------------------------------------------------------------------------


def test_full_write_queue_drops_and_counts(make_store, tiny, gate_tier, bits_equal):
    store = make_store(write_queue_chunks=1, write_threads=1,
                       host=HostCache(1 << 20, tiny.layout, C), tiers=[gate_tier])
    tokens, kv = tiny.tokens(64), tiny.kv(64)
    assert store.put(tokens[:16], kv[:, :, :16]) == PutResult(1, 0, 0)
    assert gate_tier.entered.wait(5)  # the writer holds chunk 0 and waits at the gate
    assert store.put(tokens, kv) == PutResult(stored_chunks=3, present_chunks=1, dropped_writes=2)
    snap = store.metrics_snapshot()
    assert snap["write_queue"] == 1
    assert snap["tiers"]["slow"]["dropped_writes"] == 2
    # Dropped write-downs do not lose the chunks from host DRAM.
    assert store.lookup(tokens).chunk_tiers == ("host",) * 4
    bits_equal(store.get(tokens), kv)
    gate_tier.gate.set()
    store.flush()
    ids = store.chunk_ids(tokens)
    assert gate_tier.stored == [ids[0].key, ids[1].key]
    assert store.metrics_snapshot()["write_queue"] == 0


def test_put_never_blocks_on_a_slow_tier(make_store, tiny, gate_tier):
    store = make_store(write_queue_chunks=4, host=HostCache(1 << 20, tiny.layout, C), tiers=[gate_tier])
    store.put(tiny.tokens(16, seed=99), tiny.kv(16))
    assert gate_tier.entered.wait(5)
    results: list[PutResult] = []
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: results.append(store.put(tiny.tokens(320), tiny.kv(320))))
    worker.start()
    worker.join(timeout=5)
    elapsed = time.monotonic() - t0
    assert not worker.is_alive(), "put blocked on the slow tier"
    assert elapsed < 2.0
    assert results == [PutResult(stored_chunks=20, present_chunks=0, dropped_writes=16)]
    assert store.lookup(tiny.tokens(320)).num_tokens == 320  # all of it is in host DRAM already


def test_put_without_host_tier_still_queues_copies(make_store, tiny, gate_tier, bits_equal):
    store = make_store(host_bytes=0, tiers=[gate_tier])
    tokens, kv = tiny.tokens(32), tiny.kv(32)
    expected = kv.clone()
    assert store.put(tokens, kv) == PutResult(2, 0, 0)
    kv.zero_()  # the queued write must not see the caller's later changes
    gate_tier.gate.set()
    store.flush()
    bits_equal(store.get(tokens), expected)


# -- bad chunk files ----------------------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))


def _foreign_file(tmp_path: Path, tiny, tokens, index: int, **config) -> Path:
    """Write ``tokens`` with another store configuration; return its file for chunk ``index``."""
    pool = tmp_path / "foreign"
    with TieredStore(tiny.config(host_bytes=0, pool_url=new_pool(pool), **config)) as other:
        other.put(tokens, torch.zeros(other.layout.shape(len(tokens)), dtype=other.layout.dtype))
        return other.tiers[0].files.path_for(other.chunk_ids(tokens)[index].key)


def _corrupt(fault: str, path: Path, store: TieredStore, tokens, index: int, tmp_path: Path, tiny) -> None:
    ids = store.chunk_ids(tokens)
    if fault == "truncated":
        os.truncate(path, 5000)
    elif fault == "zero_length":
        os.truncate(path, 0)
    elif fault == "bad_magic":
        _flip(path, 0)
    elif fault == "header_bit_flip":
        _flip(path, 100)
    elif fault == "payload_bit_flip":
        _flip(path, PAYLOAD_OFFSET + 1000)
    elif fault == "foreign_namespace":
        shutil.copyfile(_foreign_file(tmp_path, tiny, tokens, index, model_id="another-model"), path)
    elif fault == "foreign_layout":
        shutil.copyfile(_foreign_file(tmp_path, tiny, tokens, index,
                                      layout=KVLayout(3, 2, 8, torch.bfloat16)), path)
    elif fault == "wrong_version":
        image = bytearray(path.read_bytes())
        header = dataclasses.replace(unpack_header(image), version=FORMAT_VERSION + 1)
        image[:HEADER_BYTES] = header.pack()
        path.write_bytes(image)
    elif fault == "token_mismatch":
        # Another chunk's valid file copied under this chunk's name.
        shutil.copyfile(store.tiers[0].files.path_for(ids[index + 1].key), path)
    else:  # pragma: no cover
        raise AssertionError(fault)


FAULTS = ["truncated", "zero_length", "bad_magic", "header_bit_flip", "payload_bit_flip",
          "foreign_namespace", "foreign_layout", "wrong_version", "token_mismatch"]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("tier", ["disk", "pool"])
def test_bad_chunk_file_is_a_counted_miss_removed_and_ends_the_prefix(make_store, tiny, tmp_path,
                                                                    bits_equal, tier, fault):
    where = {"disk": {"disk_path": str(tmp_path / "d")}, "pool": {"pool_url": new_pool(tmp_path / "p")}}[tier]
    store = make_store(host_bytes=0, **where)
    tokens, kv = tiny.tokens(64, seed=4), tiny.kv(64, seed=4)
    store.put(tokens, kv)
    store.flush()
    ids = store.chunk_ids(tokens)
    path = store.tiers[0].files.path_for(ids[2].key)
    _corrupt(fault, path, store, tokens, 2, tmp_path, tiny)
    assert store.lookup(tokens).num_tokens == 64  # lookup reads metadata only

    with pytest.raises(KeyError):
        store.get(tokens)

    snap = store.metrics_snapshot()["tiers"][tier]
    assert snap["corrupt_chunks"] == 1
    assert not path.exists()
    assert store.lookup(tokens).num_tokens == 32  # a later lookup stops before it
    loaded = [(c.index, c.data.clone()) for c in store.iter_chunks(ids)]
    assert [i for i, _ in loaded] == [0, 1]
    bits_equal(torch.cat([d for _, d in loaded], dim=2), kv[:, :, :32])
    bits_equal(store.get(tokens[:32]), kv[:, :, :32])
    assert store.metrics_snapshot()["tiers"][tier]["corrupt_chunks"] == 1
    # The chunk can be stored again and then served.
    store.put(tokens, kv)
    store.flush()
    bits_equal(store.get(tokens), kv)


# -- open-time and run-time environment faults ------------------------------------------------------


@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A path no one can create, not even root: its parent is a regular file."""
    blocker = tmp_path / "regular-file"
    blocker.write_text("x")
    return blocker / "sub"


def test_unwritable_disk_path_fails_at_open(make_store, unwritable):
    with pytest.raises(TierUnavailableError, match="cannot use"):
        make_store(disk_path=str(unwritable))


def test_a_pool_that_is_not_there_fails_at_open_and_is_never_created(make_store, tmp_path, unwritable):
    for missing in (unwritable, tmp_path / "not-mounted" / "pool"):
        with pytest.raises(TierUnavailableError, match="kvtier pool init"):
            make_store(pool_url=f"fs://{missing}")
    assert not (tmp_path / "not-mounted").exists()


def test_failed_open_releases_what_it_already_opened(make_store, tmp_path, unwritable):
    disk = str(tmp_path / "d")
    with pytest.raises(TierUnavailableError):
        make_store(disk_path=disk, pool_url=f"fs://{unwritable}")
    # The disk tier opened before the pool failed must not keep its exclusive lock.
    store = make_store(disk_path=disk, pool_url=new_pool(tmp_path / "p"))
    assert [t.name for t in store.levels] == ["host", "disk", "pool"]


def test_unavailable_tiers_can_be_left_out_and_reported(tiny, tmp_path, unwritable, bits_equal):
    """What an engine integration uses: a missing mount costs that tier, not the engine."""
    reported: list[tuple[str, str]] = []
    config = tiny.config(disk_path=str(unwritable / "disk"), pool_url=f"fs://{unwritable / 'pool'}")
    with TieredStore(config, unavailable=lambda name, exc: reported.append((name, str(exc)))) as store:
        assert [t.name for t in store.levels] == ["host"] and store.tiers == []
        assert [name for name, _ in reported] == ["disk", "pool"]
        assert "cannot use" in reported[0][1] and "kvtier pool init" in reported[1][1]
        tokens, kv = tiny.tokens(3 * tiny.chunk_tokens), tiny.kv(3 * tiny.chunk_tokens)
        store.put(tokens, kv)
        bits_equal(store.get(tokens), kv)


def test_a_missing_disk_path_is_created_and_a_pool_only_by_init(make_store, tmp_path):
    make_store(disk_path=str(tmp_path / "a" / "b"), pool_url=new_pool(tmp_path / "c/d"))
    assert (tmp_path / "a" / "b" / ".kvtier").is_file()
    assert (tmp_path / "c" / "d" / ".kvtier").is_file()


@pytest.mark.parametrize(("options", "setting"), [
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"chunk_tokens": "16"}, "chunk_tokens"),
    ({"host_bytes": "lots"}, "host_bytes"),
    ({"host_bytes": -1}, "host_bytes"),
    ({"disk_path": "/tmp/x", "disk_bytes": 0}, "disk_bytes"),
    ({"pool_url": "s3://bucket"}, "pool_url"),
    ({"pool_bytes": "1 zillion"}, "pool_bytes"),
    ({"io_threads": 0}, "io_threads"),
    ({"write_queue_chunks": -3}, "write_queue_chunks"),
    ({"rank": 2, "world_size": 2}, "rank"),
    ({"world_size": 0}, "world_size"),
    ({"read_timeout_s": 0}, "read_timeout_s"),
])
def test_bad_options_raise_value_error_naming_the_setting(tiny, options, setting):
    with pytest.raises(ValueError, match=rf"^{setting}\b"):
        TieredStore.open(tiny.model_id, tiny.layout, **{"chunk_tokens": C, **options})


def test_open_with_bad_model_or_layout(tiny):
    with pytest.raises(ValueError, match="model_id"):
        TieredStore.open("", tiny.layout)
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout(0, 2, 8)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(2, 2, 8, "complex64")


def test_open_builds_the_named_tiers(tiny, tmp_path):
    with TieredStore.open(tiny.model_id, tiny.layout, C, host_bytes="1MiB", disk_path=tmp_path / "d",
                          disk_bytes="1MiB", pool_url=new_pool(tmp_path / "p"), pool_bytes="2MiB",
                          io_threads=2) as store:
        assert [t.name for t in store.levels] == ["host", "disk", "pool"]
        assert [t.name for t in store.tiers] == ["disk", "pool"]  # below host DRAM, the Tier protocol
        assert (store.config.host_bytes, store.config.disk_bytes, store.config.pool_bytes) == (
            1 << 20, 1 << 20, 2 << 20)
    with TieredStore.open(tiny.model_id, tiny.layout, C, host_bytes=0) as bare:
        assert bare.levels == [] and bare.host is None and bare.lookup(tiny.tokens(32)).num_tokens == 0


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only); skipped where mounting is not allowed."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.root
def test_disk_full_is_a_counted_failed_write_not_a_crash(tiny, tiny_tmpfs, bits_equal):
    n_chunks = 200  # 200 x 8 KiB files > 1 MiB
    tokens, kv = tiny.tokens(n_chunks * C), tiny.kv(n_chunks * C)
    store = TieredStore(tiny.config(host_bytes=0, disk_path=str(tiny_tmpfs), disk_bytes="64MiB"))
    try:
        assert store.put(tokens, kv) == PutResult(n_chunks, 0, 0)
        store.flush()
        snap = store.metrics_snapshot()["tiers"]["disk"]
        assert snap["failed_writes"] > 0
        assert snap["written_chunks"] + snap["failed_writes"] == n_chunks
        files = kvt_files(tiny_tmpfs)
        assert len(files) == snap["written_chunks"] == snap["chunks"]
        assert all(f.stat().st_size == SLOT for f in files)  # no partial chunk under a final name
        assert list(tiny_tmpfs.rglob("*.tmp")) == []
        hit = store.lookup(tokens).num_tokens
        assert hit == snap["written_chunks"] * C > 0  # one writer, in order: a prefix made it
        bits_equal(store.get(tokens[:hit]), kv[:, :, :hit])
    finally:
        store.close()


def test_put_chunk_fills_host_dram_in_place_and_writes_down(make_store, tiny, bits_equal, tmp_path):
    store = make_store(pool_url=new_pool(tmp_path / "pool"))
    tokens, kv = tiny.tokens(3 * 16), tiny.kv(3 * 16)
    ids = store.chunk_ids(tokens)
    filled: list[int] = []

    def fill(i: int):  # type: ignore[no-untyped-def]
        def write(buf: torch.Tensor) -> None:
            filled.append(i)
            buf.copy_(kv[:, :, i * 16:(i + 1) * 16])
        return write

    results = [store.put_chunk(cid, fill(i)) for i, cid in enumerate(ids)]
    assert [r.stored_chunks for r in results] == [1, 1, 1] and filled == [0, 1, 2]
    assert store.put_chunk(ids[0], fill(0)).present_chunks == 1 and filled == [0, 1, 2]  # not filled again
    store.flush()
    reader = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "pool"))
    bits_equal(reader.get(tokens), kv)


def test_load_into_without_promotion_leaves_host_dram_alone(make_store, tiny, bits_equal, tmp_path):
    writer = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "pool"))
    tokens, kv = tiny.tokens(4 * 16), tiny.kv(4 * 16)
    writer.put(tokens, kv)
    writer.flush()
    reader = make_store(pool_url=new_pool(tmp_path / "pool"))
    got = torch.zeros_like(kv)

    def sink(i: int, data: torch.Tensor) -> None:
        got[:, :, i * 16:(i + 1) * 16].copy_(data)

    assert reader.load_into(reader.chunk_ids(tokens), sink, promote=False).num_chunks == 4
    bits_equal(got, kv)
    assert reader.lookup(tokens).chunk_tiers == ("pool",) * 4  # not promoted
    reader.load_into(reader.chunk_ids(tokens), sink)
    assert reader.lookup(tokens).chunk_tiers == ("host",) * 4


def test_retention_reaches_the_disk_and_pool_copies_even_of_chunks_written_later(make_store, tiny, tmp_path):
    store = make_store(disk_path=str(tmp_path / "d"), pool_url=new_pool(tmp_path / "p"), write_threads=2)
    tokens = tiny.tokens(48)
    ids = store.chunk_ids(tokens)
    until = time.time() + 3600
    store.retain(ids[:1], until)  # before anything is written
    store.put(tokens, tiny.kv(48))
    store.flush()
    store.retain(ids[1:2], until)  # after
    store.flush()
    for tier in store.tiers:
        mtimes = [tier.files.path_for(cid.key).stat().st_mtime for cid in ids]
        assert mtimes[0] == mtimes[1] == pytest.approx(until) and mtimes[2] < until - 3000, tier.name


def test_retention_of_chunks_already_written_does_not_wait_behind_a_full_write_queue(make_store, tiny, tmp_path,
                                                                                    monkeypatch):
    store = make_store(pool_url=new_pool(tmp_path / "p"), write_queue_chunks=1)
    tokens = tiny.tokens(48)
    ids = store.chunk_ids(tokens)
    store.put(tokens[:16], tiny.kv(16))
    store.flush()
    pool = store.tiers[-1]
    stuck = threading.Event()
    store_chunk = pool.store
    monkeypatch.setattr(pool, "store", lambda chunk, spec: (stuck.wait(10), store_chunk(chunk, spec))[1])
    store.put(tokens, tiny.kv(48))  # chunk 1 blocks the writer, chunk 2 fills the queue
    until = time.time() + 3600
    store.retain(ids[:1], until)
    path = pool.files.path_for(ids[0].key)
    deadline = time.monotonic() + 5
    while path.stat().st_mtime < until - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.stat().st_mtime == pytest.approx(until)
    stuck.set()


def test_a_chunk_gone_from_the_named_tier_is_read_from_a_faster_one(make_store, tiny, tmp_path, bits_equal):
    """6f37bba fell back only on the tiers below the one named: a tensor-parallel rank told the
    pool (the slowest tier any rank found the chunk in) never tried its own disk, which held it
    (0 of 2 chunks delivered)."""
    pool_url = new_pool(tmp_path / "pool")
    tokens, kv = tiny.tokens(2 * tiny.chunk_tokens), tiny.kv(2 * tiny.chunk_tokens)
    writer = make_store(host_bytes=0, disk_path=str(tmp_path / "disk"))  # the rank's own disk only
    writer.put(tokens, kv)
    writer.close()
    store = make_store(host_bytes=0, disk_path=str(tmp_path / "disk"), pool_url=pool_url)
    ids = store.chunk_ids(tokens)
    out = torch.empty_like(kv)
    got = store.load_into(ids, lambda i, data: out[:, :, i * tiny.chunk_tokens:(i + 1) * tiny.chunk_tokens]
                          .copy_(data), promote=False, tiers=["pool", "pool"])
    assert got.num_chunks == 2 and list(got.chunk_tiers) == ["disk", "disk"]
    bits_equal(out, kv)
