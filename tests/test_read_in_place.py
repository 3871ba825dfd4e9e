"""Reads in place: a warm chunk file's payload read straight into the caller's memory (an
engine's KV pages), validated there, and never written there outside the load's gate.

``tiers.base.Pages`` at the tier, ``reader.Placement`` at the store. The bytes written are
checked against the chunk; every way a read can fail leaves a result the caller can act on
(a miss, a corrupt chunk removed), and a read that outlives its load writes nothing.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from pathlib import Path

import pytest
import torch

import kvtier.tiers.reads as reads_mod
from _pool import new_pool
from conftest import require_cachestat
from kvtier.format import PAYLOAD_OFFSET
from kvtier.reader import Placement
from kvtier.store import TieredStore
from kvtier.tiers.base import Chunk, Pages, Status
from kvtier.tiers.faulty import FaultyTier
from kvtier.tiers.pagecache import cache_hits_are_local, cached_bytes
from kvtier.tiers.pool import PoolTier

C = 16  # the tiny model's chunk tokens


class _Target:
    """Caller memory for one chunk in uneven pieces, with the gate's calls counted."""

    def __init__(self, nbytes: int, pieces: int = 3, admit: bool = True) -> None:
        cuts = [0, *sorted({nbytes * (i + 1) // (pieces + 1) + i for i in range(pieces - 1)}), nbytes]
        self.memory = [bytearray(b - a) for a, b in itertools.pairwise(cuts)]
        self.admit, self.entered, self.left = admit, 0, 0

    def enter(self) -> bool:
        self.entered += 1
        return self.admit

    def leave(self) -> None:
        self.left += 1

    def pages(self) -> Pages:
        return Pages([memoryview(m) for m in self.memory], self.enter, self.leave)

    def bytes(self) -> bytes:
        return b"".join(self.memory)


def _warm_local(pool: PoolTier, path: Path) -> None:
    """Skip unless reads there can be page-cache hits of a local filesystem, known as such."""
    if not cache_hits_are_local(str(path)):
        pytest.skip(f"{path} is not on a local filesystem")
    require_cachestat(path)


def _stored(open_pool, tiny) -> tuple[PoolTier, Chunk, Path]:
    pool = open_pool()
    (a,) = tiny.chunks(1, seed=5)
    pool.store(a, tiny.spec())
    path = pool.files.path_for(a.id.key)
    _warm_local(pool, path)
    return pool, a, path


def test_a_warm_chunk_lands_in_the_callers_memory_validated(open_pool, tiny):
    pool, a, _ = _stored(open_pool, tiny)
    target = _Target(tiny.payload_bytes)
    got = pool.load(a.id, tiny.spec(), pages=target.pages())
    assert got.status is Status.HIT and got.in_place and got.chunk is None and got.from_cache
    assert target.bytes() == bytes(a.payload())
    assert (target.entered, target.left) == (1, 1)
    assert pool.metrics.snapshot().bytes_read == tiny.payload_bytes


def test_a_corrupt_chunk_read_in_place_is_removed_and_reported(open_pool, tiny):
    pool, a, path = _stored(open_pool, tiny)
    with open(path, "r+b") as f:
        f.seek(PAYLOAD_OFFSET + tiny.payload_bytes - 3)
        byte = f.read(1)
        f.seek(PAYLOAD_OFFSET + tiny.payload_bytes - 3)
        f.write(bytes([byte[0] ^ 0x01]))
    target = _Target(tiny.payload_bytes)
    got = pool.load(a.id, tiny.spec(), pages=target.pages())
    assert got.status is Status.CORRUPT and "payload_checksum" in got.error
    assert not path.exists() and pool.lookup([a.id]) == 0
    assert (target.entered, target.left) == (1, 1)  # the gate is left on the failure too


def test_another_chunks_file_under_the_name_is_refused_in_place(open_pool, tiny):
    pool = open_pool()
    a, b = tiny.chunks(2, seed=6)
    pool.store(b, tiny.spec())
    path = pool.files.path_for(a.id.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(pool.files.path_for(b.id.key), path)  # a neighbour's file, valid in itself
    _warm_local(pool, path)
    got = pool.load(a.id, tiny.spec(), pages=_Target(tiny.payload_bytes).pages())
    assert got.status is Status.CORRUPT and "identity" in got.error


def test_a_load_that_is_over_gets_nothing_written(open_pool, tiny):
    pool, a, path = _stored(open_pool, tiny)
    target = _Target(tiny.payload_bytes, admit=False)
    got = pool.load(a.id, tiny.spec(), pages=target.pages())
    assert got.status is Status.STOPPED and not got.ok
    assert target.bytes() == bytes(tiny.payload_bytes) and target.left == 0
    snap = pool.metrics.snapshot()
    assert (snap.read_races, snap.corrupt_chunks, snap.failed_reads, snap.bytes_read) == (0, 0, 0, 0)
    assert path.exists()  # nothing wrong with the chunk


def test_the_disk_tier_keeps_a_chunk_whose_read_came_after_its_load_was_over(tiny, tmp_path):
    """A request aborted while its load ran: the reads still queued find the load over. The
    chunk is intact: the disk tier must still find it (it once forgot it as if deleted)."""
    from kvtier.tiers.disk import DiskTier

    disk = DiskTier(tmp_path / "disk", 1 << 20)
    try:
        (a,) = tiny.chunks(1, seed=5)
        disk.store(a, tiny.spec())
        path = disk.files.path_for(a.id.key)
        if not cache_hits_are_local(str(path)):
            pytest.skip(f"{path} is not on a local filesystem")
        require_cachestat(path)
        got = disk.load(a.id, tiny.spec(), pages=_Target(tiny.payload_bytes, admit=False).pages())
        assert got.status is Status.STOPPED
        assert disk.lookup([a.id]) == 1
        assert disk.metrics.snapshot().chunks == 1
        assert disk.load(a.id, tiny.spec()).status is Status.HIT
    finally:
        disk.close()


def _reads_inside_the_gate(target: _Target, monkeypatch) -> tuple[Pages, list[int]]:
    """``target``'s pages, and the offsets of every read that could wait for a device (a
    ``preadv`` without ``RWF_NOWAIT``) made while the gate was held."""
    inside = {"now": False}
    waited: list[int] = []

    def enter() -> bool:
        inside["now"] = True
        return target.enter()

    def leave() -> None:
        inside["now"] = False
        target.leave()

    real = os.preadv

    def watched(fd, buffers, offset, flags=0):
        if inside["now"] and not flags & getattr(os, "RWF_NOWAIT", 0):
            waited.append(offset)
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(reads_mod.os, "preadv", watched)
    return Pages(target.pages().views, enter, leave), waited


def test_a_device_read_never_holds_the_callers_memory(open_pool, tiny, bits_equal, monkeypatch):
    """Files a page-cache hit of a local filesystem does not serve (a network filesystem's, a
    cold one) are read whole outside the gate; only the copy into the pages runs inside."""
    pool, a, path = _stored(open_pool, tiny)
    pool.files._local = False  # a network filesystem: its page-cache hits are still round trips
    target = _Target(tiny.payload_bytes)
    pages, waited = _reads_inside_the_gate(target, monkeypatch)
    got = pool.load(a.id, tiny.spec(), pages=pages)
    assert got.ok and got.in_place and not got.from_cache and waited == []
    assert target.bytes() == bytes(a.payload()) and (target.entered, target.left) == (1, 1)
    pool.files._local = True
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        cold = (cached_bytes(fd) or 0) < os.fstat(fd).st_size
    finally:
        os.close(fd)
    if cold:
        target = _Target(tiny.payload_bytes)
        pages, waited = _reads_inside_the_gate(target, monkeypatch)
        got = pool.load(a.id, tiny.spec(), pages=pages)
        assert got.ok and got.in_place and not got.from_cache and waited == []
        assert target.bytes() == bytes(a.payload())


def test_a_corrupt_cold_chunk_is_refused_before_or_after_the_copy(open_pool, tiny):
    """A cold read copied into the pages is checked there: a foreign file writes nothing, a
    flipped payload bit is a counted corrupt chunk, removed."""
    pool = open_pool()
    pool.files._local = False  # every read is read whole, then copied
    a, b = tiny.chunks(2, seed=9)
    pool.store(a, tiny.spec())
    pool.store(b, tiny.spec())
    path = pool.files.path_for(a.id.key)
    os.replace(pool.files.path_for(b.id.key), path)  # b's file under a's name
    target = _Target(tiny.payload_bytes)
    got = pool.load(a.id, tiny.spec(), pages=target.pages())
    assert got.status is Status.CORRUPT and "identity" in got.error and target.entered == 0
    pool.store(a, tiny.spec())
    with open(path, "r+b") as f:
        f.seek(PAYLOAD_OFFSET + 5)
        byte = f.read(1)
        f.seek(PAYLOAD_OFFSET + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    got = pool.load(a.id, tiny.spec(), pages=target.pages())
    assert got.status is Status.CORRUPT and "payload_checksum" in got.error
    assert (target.entered, target.left) == (1, 1) and not path.exists()


def test_pages_of_the_wrong_size_are_a_bug_not_a_read(open_pool, tiny):
    pool, a, _ = _stored(open_pool, tiny)
    target = _Target(tiny.payload_bytes - 2)
    with pytest.raises(ValueError, match="pages of"):
        pool.load(a.id, tiny.spec(), pages=target.pages())
    assert target.entered == 0


def test_no_read_inside_the_gate_waits_for_a_device(open_pool, tiny, monkeypatch):
    """6f37bba read in place with a plain preadv: a page reclaimed between the cache check and
    the read was read from the device inside the gate, where read_timeout_s does not bound it
    (an injected 3 s stall took 3.0 s against 0.3 s). Now every read there asks RWF_NOWAIT; a
    page not cached fails it, and the file is read outside the gate."""
    pool, a, _ = _stored(open_pool, tiny)
    if not reads_mod._NOWAIT:
        pytest.skip("no RWF_NOWAIT here: reads in place are off")
    target = _Target(tiny.payload_bytes)
    inside = {"now": False}
    waited_inside: list[int] = []
    enter, leave = target.enter, target.leave

    def gated_enter() -> bool:
        inside["now"] = True
        return enter()

    def gated_leave() -> None:
        inside["now"] = False
        leave()

    real = os.preadv

    def evicted(fd, buffers, offset, flags=0):  # the cache dropped the file after cachestat looked
        if inside["now"] and not flags & os.RWF_NOWAIT:
            waited_inside.append(offset)
        if flags & os.RWF_NOWAIT:
            raise BlockingIOError(errno.EAGAIN, "would block")
        time.sleep(0.05)  # a device read
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(reads_mod.os, "preadv", evicted)
    got = pool.load(a.id, tiny.spec(), pages=Pages(target.pages().views, gated_enter, gated_leave))
    assert waited_inside == []
    assert got.status is Status.HIT and got.in_place and not got.from_cache
    assert target.bytes() == bytes(a.payload())  # read whole outside the gate, then copied in
    assert (target.entered, target.left) == (2, 2)  # the read in place that failed, and the copy


def test_a_read_split_over_many_system_calls_fills_every_piece(open_pool, tiny, monkeypatch):
    pool, a, _ = _stored(open_pool, tiny)
    monkeypatch.setattr(reads_mod, "_IOV_MAX", 2)  # the header and one piece per preadv
    real = os.preadv
    calls: list[int] = []

    def short(fd, buffers, offset, flags=0):  # and each call delivers at most 100 bytes less than asked
        calls.append(offset)
        want = sum(memoryview(b).nbytes for b in buffers)
        if want > 200:
            head, rest = 0, want - 100
            parts = []
            for b in buffers:
                n = min(memoryview(b).nbytes, rest - head)
                if n <= 0:
                    break
                parts.append(memoryview(b)[:n])
                head += n
            return real(fd, parts, offset, flags)
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(reads_mod.os, "preadv", short)
    target = _Target(tiny.payload_bytes, pieces=7)
    got = pool.load(a.id, tiny.spec(), pages=target.pages())
    assert got.ok and got.in_place
    assert target.bytes() == bytes(a.payload())
    assert len(calls) > 8


def test_load_into_places_warm_chunks_and_hands_the_rest_to_the_sink(make_store, tiny, tmp_path):
    store = make_store(host_bytes=0, pool_url=new_pool(tmp_path / "pool"))
    tokens, kv = tiny.tokens(C * 4, seed=8), tiny.kv(C * 4, seed=8)
    store.put(tokens, kv)
    store.flush()
    _warm_local(store.tiers[0], next((tmp_path / "pool").rglob("*.kvt")))
    memory = [torch.zeros(tiny.payload_bytes, dtype=torch.uint8) for _ in range(4)]
    sunk: list[int] = []
    landed: list[int] = []

    def views(i: int) -> list[memoryview] | None:
        return None if i == 2 else [memoryview(memory[i].numpy())]  # chunk 2: "not placeable"

    def sink(i: int, data: torch.Tensor) -> None:
        sunk.append(i)
        memory[i].copy_(data.reshape(-1).view(torch.uint8))

    got = store.load_into(store.chunk_ids(tokens), sink, promote=False, place=Placement(views, landed.append))
    assert got.num_chunks == 4 and got.chunk_tiers == ("pool",) * 4
    assert sorted(landed) == [0, 1, 3] and sunk == [2]
    for i in range(4):
        want = kv[:, :, i * C:(i + 1) * C].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(memory[i], want), i
    # promote=True wants the bytes in host DRAM: nothing is placed
    landed.clear()
    sunk.clear()
    assert store.load_into(store.chunk_ids(tokens), sink, place=Placement(views, landed.append)).num_chunks == 4
    assert landed == [] and sorted(sunk) == [0, 1, 2, 3]


def test_a_read_in_place_that_outlives_its_load_writes_nothing(tiny, tmp_path):
    """An engine reuses the KV blocks of a failed load at once: a late read must not write there."""
    pool = PoolTier(tmp_path / "pool", None, create=True)
    faulty = FaultyTier(pool, delay_prob=1.0, min_delay_s=30.0, max_delay_s=30.0, ops=["load"])
    store = TieredStore(tiny.config(io_threads=4, read_timeout_s=0.2, host_bytes=0), tiers=[faulty])
    try:
        tokens, kv = tiny.tokens(64), tiny.kv(64)
        ids = store.chunk_ids(tokens)
        for i in range(4):
            pool.store(Chunk(ids[i], kv[:, :, i * C:(i + 1) * C].contiguous()), tiny.spec())
        _warm_local(pool, pool.files.path_for(ids[0].key))
        memory = [bytearray(tiny.payload_bytes) for _ in range(4)]
        landed: list[int] = []
        place = Placement(lambda i: [memoryview(memory[i])], landed.append)
        t0 = time.monotonic()
        result = store.load_into(ids, lambda i, data: None, promote=False, place=place)
        assert time.monotonic() - t0 < 2.0
        assert result.num_chunks == 0 and pool.metrics.snapshot().timeouts == 1
        faulty.wake()  # chunk 0's read goes on now, and finds the load over
        time.sleep(0.3)
        assert landed == [] and all(m == bytes(tiny.payload_bytes) for m in memory)
        assert pool.metrics.snapshot().bytes_read == 0  # refused at the gate: nothing was read
    finally:
        faulty.wake()
        store.close()


def test_device_reads_are_admitted_in_the_order_asked_within_the_window():
    """A chunk directory on a local disk lets one window of bytes be read at once, first come
    first served: a small read that would fit does not overtake a larger one before it."""
    import threading

    from kvtier.tiers.reads import DeviceWindow

    window = DeviceWindow(100)
    admitted: list[str] = []
    release = {name: threading.Event() for name in "abcd"}

    def read(name: str, nbytes: int) -> None:
        with window.hold(nbytes):
            admitted.append(name)
            release[name].wait(5)

    threads = []
    for name, nbytes in (("a", 60), ("b", 60), ("c", 10), ("d", 500)):  # d: larger than the window
        threads.append(threading.Thread(target=read, args=(name, nbytes)))
        threads[-1].start()
        time.sleep(0.05)  # each asks after the one before
    assert admitted == ["a"]  # b waits for room; c, which would fit, waits its turn behind b
    release["a"].set()
    time.sleep(0.1)
    assert admitted == ["a", "b", "c"]
    release["b"].set()
    release["c"].set()
    time.sleep(0.1)
    assert admitted == ["a", "b", "c", "d"]  # alone, once the window is empty
    release["d"].set()
    for t in threads:
        t.join(5)
    with DeviceWindow(0).hold(1 << 40), DeviceWindow(0).hold(1 << 40):  # 0: nothing held back
        pass


def _evict(path: Path, offset: int = 0, length: int = 0) -> None:
    """Drop ``path``'s bytes ``offset:offset + length`` (all for 0) from the page cache; skip the
    test when nothing went (a large folio around a part of it stays whole)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages can be dropped
        before = cached_bytes(fd) or 0
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        if (cached_bytes(fd) or 0) >= before:
            pytest.skip(f"the page cache kept {path.name}'s bytes {offset}+{length} (large folios?)")
    finally:
        os.close(fd)


def _warm(path: Path) -> None:
    with open(path, "rb") as fh:
        fh.read()


def test_a_large_file_is_judged_whole_by_samples_of_it(tmp_path):
    """``holds_whole`` asks the kernel about every page of a small file and about four windows
    of a large one: a page missing from a window says not whole; one between them is not seen."""
    from kvtier.tiers import pagecache

    path = tmp_path / "f"
    path.write_bytes(os.urandom(8 << 20))
    require_cachestat(path)
    _warm(path)

    def whole() -> bool | None:
        fd = os.open(path, os.O_RDONLY)
        try:
            return pagecache.holds_whole(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    assert whole() is True
    _evict(path)
    assert whole() is False
    _warm(path)
    _evict(path, 7 << 20, 1 << 20)  # the last MiB: the last window with it
    assert whole() is False
    _warm(path)
    _evict(path, 1 << 20, 1 << 20)  # a MiB between the first window and the second
    assert whole() is True  # the documented blind spot: the read path copes (below)
    small = tmp_path / "small"
    small.write_bytes(os.urandom(4 << 20))
    _evict(small)  # read back, the cache holds it in the folios a read makes (a write's may be too large to split)
    _warm(small)
    _evict(small, 1 << 20, 1 << 20)
    fd = os.open(small, os.O_RDONLY)
    try:
        assert pagecache.holds_whole(fd, 4 << 20) is False  # a small file: every page asked
    finally:
        os.close(fd)


def test_a_hole_the_samples_miss_is_read_from_the_device_not_copied_from_nothing(tmp_path):
    """An 8 MiB chunk whose page cache lacks a MiB between the sampled windows: judged whole,
    read in place, the read in place meets the hole (``RWF_NOWAIT``) and the file is read
    outside the caller's memory; the caller gets the chunk's bytes."""
    from kvtier import KVLayout

    layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    store = TieredStore.open(model_id="m", layout=layout, chunk_tokens=256, host_bytes=0,
                             pool_url=new_pool(tmp_path / "pool"))
    try:
        tokens = list(range(256))
        kv = torch.randn(layout.shape(256)).to(torch.bfloat16)
        store.put(tokens, kv)
        store.flush()
        (path,) = (tmp_path / "pool").rglob("*.kvt")
        _warm_local(store.tiers[0], path)
        _evict(path)  # read back, the cache holds it in the folios a read makes
        _warm(path)
        _evict(path, 1 << 20, 1 << 20)  # between the first window (64 KiB) and the second (2.7 MiB)
        fd = os.open(path, os.O_RDONLY)
        try:
            from kvtier.tiers.pagecache import holds_whole
            assert holds_whole(fd, os.fstat(fd).st_size) is True
            assert (cached_bytes(fd) or 0) < os.fstat(fd).st_size
        finally:
            os.close(fd)
        out = torch.empty(layout.shape(256), dtype=torch.bfloat16)
        assert torch.equal(store.get(tokens, out=out).view(torch.int16), kv.view(torch.int16))
        assert store.tiers[0].metrics.snapshot().corrupt_chunks == 0
    finally:
        store.close()
