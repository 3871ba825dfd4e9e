"""kvtier.tiers.disk: one file per chunk, exact LRU in a byte budget, restarts, exclusive lock."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from conftest import kvt_files
from kvtier import TierUnavailableError
from kvtier.tiers import files as files_mod
from kvtier.tiers.base import Chunk, Status, Tier
from kvtier.tiers.disk import DiskTier

FILE = 8192  # one tiny chunk on disk

WORKERS = Path(__file__).with_name("_workers.py")


@pytest.fixture
def open_disk(tmp_path):
    tiers: list[DiskTier] = []

    def factory(capacity_bytes: int = 1 << 20, path: Path | None = None) -> DiskTier:
        tier = DiskTier(path or tmp_path / "disk", capacity_bytes, direct_io=True)
        tiers.append(tier)
        return tier

    yield factory
    for tier in tiers:
        tier.close()


def test_speaks_the_tier_protocol(open_disk):
    assert isinstance(open_disk(), Tier)


def test_round_trip_and_file_naming(open_disk, tiny, tmp_path, bits_equal):
    disk = open_disk()
    a, b = tiny.chunks(2)
    assert disk.store(a, tiny.spec()).status is Status.WRITTEN
    assert disk.store(a, tiny.spec()).status is Status.EXISTS
    h = a.id.key.hex()
    path = tmp_path / "disk" / h[:2] / h[2:4] / f"{h}.kvt"
    assert kvt_files(tmp_path / "disk") == [path]
    assert path.stat().st_size == FILE
    assert (tmp_path / "disk" / ".kvtier").is_file()
    got = disk.load(a.id, tiny.spec())
    assert got.status is Status.HIT
    bits_equal(got.chunk.data, a.data)
    assert disk.load(b.id, tiny.spec()).status is Status.MISS
    snap = disk.metrics.snapshot()
    assert (snap.written_chunks, snap.bytes_written, snap.bytes_read, snap.chunks, snap.bytes) == (
        1, FILE, 2048, 1, FILE)


def test_lookup_counts_contiguous_prefix(open_disk, tiny):
    disk = open_disk()
    chunks = tiny.chunks(4)
    for i in (0, 1, 3):
        disk.store(chunks[i], tiny.spec())
    ids = [c.id for c in chunks]
    assert [disk.lookup(ids[i:]) for i in range(4)] == [2, 1, 0, 1]


def test_exact_lru_eviction_order_within_budget(open_disk, tiny, tmp_path):
    disk = open_disk(3 * FILE)
    a, b, c, d, e = tiny.chunks(5)
    spec = tiny.spec()
    for ch in (a, b, c):
        disk.store(ch, spec)
    assert disk.keys() == [a.id.key, b.id.key, c.id.key]
    assert disk.load(a.id, spec).ok
    assert disk.keys() == [b.id.key, c.id.key, a.id.key]
    disk.lookup([b.id])  # side-effect free
    disk.store(d, spec)  # evicts b
    assert disk.keys() == [c.id.key, a.id.key, d.id.key]
    assert disk.store(c, spec).status is Status.EXISTS  # refreshes c
    disk.store(e, spec)  # evicts a
    assert disk.keys() == [d.id.key, c.id.key, e.id.key]
    on_disk = {p.name for p in kvt_files(tmp_path / "disk")}
    assert on_disk == {f"{ch.id.key.hex()}.kvt" for ch in (c, d, e)}
    snap = disk.metrics.snapshot()
    assert (snap.evictions, snap.evicted_bytes, snap.chunks, snap.bytes) == (2, 2 * FILE, 3, 3 * FILE)


def test_chunk_larger_than_budget_is_refused(open_disk, tiny):
    disk = open_disk(FILE - 1)
    (a,) = tiny.chunks(1)
    assert disk.store(a, tiny.spec()).status is Status.FAILED
    assert disk.keys() == []


def _stored_by_a_closed_tier(open_disk, tiny, ages_s: Sequence[float]) -> list[Chunk]:
    """Chunks a disk tier stored and then closed, chunk ``i`` last used ``ages_s[i]`` seconds ago
    (the recency a restarted process sees)."""
    first = open_disk()
    chunks = tiny.chunks(len(ages_s))
    for ch in chunks:
        first.store(ch, tiny.spec())
    first.close()
    now = time.time()
    for ch, age in zip(chunks, ages_s, strict=True):
        os.utime(first.files.path_for(ch.id.key), (now - age, now - age))
    return chunks


def test_restart_serves_old_chunks_in_mtime_lru_order(open_disk, tiny, tmp_path, bits_equal):
    chunks = _stored_by_a_closed_tier(open_disk, tiny, (300, 100, 400, 200))  # 2 oldest, then 0, 3, 1
    # Litter a restart must ignore: a crashed writer's temp file and an unrelated file.
    h = chunks[0].id.key.hex()
    (tmp_path / "disk" / h[:2] / h[2:4] / f"{h}.kvt.123.abcd.tmp").write_bytes(b"partial")
    (tmp_path / "disk" / h[:2] / h[2:4] / "notes.txt").write_text("hi")

    second = open_disk()
    assert second.keys() == [chunks[i].id.key for i in (2, 0, 3, 1)]
    assert second.metrics.snapshot().bytes == 4 * FILE
    for ch in chunks:
        got = second.load(ch.id, tiny.spec())
        assert got.ok
        bits_equal(got.chunk.data, ch.data)


def test_restart_with_smaller_budget_evicts_oldest(open_disk, tiny, tmp_path):
    chunks = _stored_by_a_closed_tier(open_disk, tiny, (500, 400, 300, 200, 100))
    smaller = open_disk(2 * FILE + 100)
    assert smaller.keys() == [chunks[3].id.key, chunks[4].id.key]
    assert {p.name for p in kvt_files(tmp_path / "disk")} == {f"{c.id.key.hex()}.kvt" for c in chunks[3:]}
    snap = smaller.metrics.snapshot()
    assert (snap.evictions, snap.chunks, snap.bytes) == (3, 2, 2 * FILE)


def test_hit_refreshes_mtime_so_recency_survives_restart(open_disk, tiny):
    disk = open_disk()
    a, b = tiny.chunks(2)
    disk.store(a, tiny.spec())
    disk.store(b, tiny.spec())
    old = time.time() - 3600
    for ch in (a, b):
        os.utime(disk.files.path_for(ch.id.key), (old, old))
    assert disk.load(a.id, tiny.spec()).ok  # older than TOUCH_INTERVAL_S: mtime refreshed
    assert disk.files.path_for(a.id.key).stat().st_mtime > old + 3000
    assert disk.files.path_for(b.id.key).stat().st_mtime == pytest.approx(old)
    disk.close()
    assert open_disk(FILE).keys() == [a.id.key]


def test_new_process_serves_what_an_earlier_process_wrote(tiny, tmp_path, make_store, bits_equal):
    disk_path = tmp_path / "disk"
    seeds = [11, 12, 13, 14]
    proc = subprocess.run([sys.executable, str(WORKERS), "disk-write", str(disk_path), *map(str, seeds)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"written_chunks": 8}

    n = 2 * tiny.chunk_tokens
    store = make_store(host_bytes=0, disk_path=str(disk_path), disk_bytes=1 << 20)
    for seed in seeds:
        hit = store.lookup(tiny.tokens(n, seed))
        assert (hit.num_tokens, hit.chunk_tiers) == (n, ("disk", "disk"))
        bits_equal(store.get(tiny.tokens(n, seed)), tiny.kv(n, seed))
    store.close()

    # The budget still holds after a restart: the newest sequence fits, the 6 older chunks go.
    store = make_store(host_bytes=0, disk_path=str(disk_path), disk_bytes=2 * FILE + 100)
    assert [store.lookup(tiny.tokens(n, s)).num_tokens for s in seeds] == [0, 0, 0, n]
    assert len(kvt_files(disk_path)) == 2
    snap = store.tiers[0].metrics.snapshot()
    assert (snap.evictions, snap.chunks, snap.bytes) == (6, 2, 2 * FILE)


def test_second_instance_on_same_path_is_refused(open_disk, tmp_path):
    first = open_disk()
    with pytest.raises(TierUnavailableError, match="in use by another process"):
        DiskTier(tmp_path / "disk", 1 << 20)
    first.close()
    open_disk()  # free again once the owner closed


def test_second_store_on_same_disk_path_is_refused(make_store, tmp_path):
    make_store(disk_path=str(tmp_path / "disk"))
    with pytest.raises(TierUnavailableError):
        make_store(disk_path=str(tmp_path / "disk"))


def test_unusable_directory_is_refused_at_open(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(TierUnavailableError, match="cannot use"):
        DiskTier(blocker / "sub", 1 << 20)
    with pytest.raises(TierUnavailableError):
        DiskTier(blocker, 1 << 20)


def test_missing_directory_is_created(open_disk, tmp_path):
    open_disk(path=tmp_path / "x" / "y" / "z")
    assert (tmp_path / "x" / "y" / "z" / ".kvtier").is_file()


def test_file_deleted_behind_our_back_is_a_counted_miss(open_disk, tiny):
    disk = open_disk()
    (a,) = tiny.chunks(1)
    disk.store(a, tiny.spec())
    os.unlink(disk.files.path_for(a.id.key))
    assert disk.lookup([a.id]) == 1  # the index does not know yet
    assert disk.load(a.id, tiny.spec()).status is Status.MISS
    assert disk.lookup([a.id]) == 0
    snap = disk.metrics.snapshot()
    assert (snap.read_races, snap.chunks, snap.bytes) == (1, 0, 0)


def test_failed_write_is_counted_and_leaves_no_file(open_disk, tiny, tmp_path, monkeypatch):
    disk = open_disk()
    a, b = tiny.chunks(2)

    def no_space(fd, buffers):
        os.write(fd, b"x" * 100)  # a partial write, then the device fills up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files_mod.os, "writev", no_space)
    result = disk.store(a, tiny.spec())
    assert result.status is Status.FAILED and "No space" in result.error
    monkeypatch.undo()
    assert list((tmp_path / "disk").rglob("*/*/*")) == []  # neither a final nor a temp file
    assert disk.keys() == [] and disk.lookup([a.id]) == 0
    assert disk.store(b, tiny.spec()).status is Status.WRITTEN  # the tier still works
    snap = disk.metrics.snapshot()
    assert (snap.failed_writes, snap.written_chunks) == (1, 1)


def test_evict_to_target(open_disk, tiny):
    disk = open_disk()
    chunks = tiny.chunks(3)
    for ch in chunks:
        disk.store(ch, tiny.spec())
    assert disk.evict(FILE) == 2
    assert disk.keys() == [chunks[2].id.key]


def test_a_retained_chunk_is_evicted_last_and_stays_retained_after_a_restart(open_disk, tiny, tmp_path):
    disk = open_disk(3 * FILE)
    a, b, c, d, e = tiny.chunks(5)
    spec = tiny.spec()
    for ch in (a, b, c):
        disk.store(ch, spec)
    assert disk.retain(a.id.key, time.time() + 3600)
    assert not disk.retain(d.id.key, time.time() + 3600)  # not held
    disk.store(d, spec)  # evicts b, not the older but retained a
    assert set(disk.keys()) == {a.id.key, c.id.key, d.id.key}
    disk.close()
    disk = open_disk(3 * FILE)  # a restart: retention comes back from the file's mtime
    disk.store(e, spec)
    assert set(disk.keys()) == {a.id.key, d.id.key, e.id.key}
    disk.retain(d.id.key, time.time() + 3600)
    disk.retain(e.id.key, time.time() + 3600)
    disk.store(b, spec)  # the only unretained chunk is the one to go, new as it is
    assert set(disk.keys()) == {a.id.key, d.id.key, e.id.key}
