"""kvtier.tiers.pool: a directory shared by many processes; atomic publish, shared budget, races."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _pool import new_pool
from conftest import bytes_on_disk, kvt_files, within
from kvtier.format import PAYLOAD_OFFSET, ChunkError, payload_checksum, unpack_header
from kvtier.tiers import files as files_mod
from kvtier.tiers.base import Status, Tier
from kvtier.tiers.ledger import read_usage
from kvtier.tiers.pool import parse_pool_url

FILE = 8192
WORKERS = Path(__file__).with_name("_workers.py")


def _total(root: Path) -> int | None:
    """The pool's byte count as every instance reads it (base + ledgers)."""
    return read_usage(root).total


@pytest.mark.parametrize(("url", "path"), [("fs:///mnt/pool", "/mnt/pool"), ("/plain/path", "/plain/path"),
                                           ("fs://localhost:0/mnt/pool", "/mnt/pool"),  # LMCache's shape
                                           ("fs://127.0.0.1/mnt/pool", "/mnt/pool")])
def test_parse_pool_url(url, path):
    assert parse_pool_url(url) == path


@pytest.mark.parametrize(("url", "says"), [
    ("s3://bucket/x", "not supported"), ("nfs://server/export", "not supported"),
    ("lm://localhost:65432", "not supported"), ("fs://", "no path"), ("", "no path"),
    ("fs://mnt/pool", "absolute path"),  # one slash short: was a pool relative to the working directory
    ("rel/pool", "relative path"), ("fs://nas:2049/export/pool", "names the server")])
def test_parse_pool_url_rejects_what_is_not_an_absolute_local_path(url, says):
    with pytest.raises(ValueError, match=says):
        parse_pool_url(url)


def test_speaks_the_tier_protocol(open_pool):
    assert isinstance(open_pool(), Tier)


def test_round_trip_across_instances(open_pool, tiny, bits_equal):
    a_tier, b_tier = open_pool(), open_pool()
    chunks = tiny.chunks(3)
    for ch in chunks[:2]:
        assert a_tier.store(ch, tiny.spec()).status is Status.WRITTEN
    ids = [c.id for c in chunks]
    assert b_tier.lookup(ids) == 2  # another instance sees them at once
    for ch in chunks[:2]:
        got = b_tier.load(ch.id, tiny.spec())
        assert got.ok
        bits_equal(got.chunk.data, ch.data)
    assert b_tier.load(chunks[2].id, tiny.spec()).status is Status.MISS
    # Two writers of the same chunk: harmless, the second sees it is there.
    assert b_tier.store(chunks[0], tiny.spec()).status is Status.EXISTS
    assert len(kvt_files(a_tier.files.root)) == 2
    assert (a_tier.metrics.snapshot().written_chunks, b_tier.metrics.snapshot().bytes_read) == (2, 4096)


def test_publish_is_atomic_rename_of_a_complete_temp_file(open_pool, tiny, monkeypatch):
    pool = open_pool()
    (a,) = tiny.chunks(1)
    seen: list[tuple[str, str, int, bool]] = []
    real_replace = os.replace

    def spy(src, dst):
        src, dst = Path(src), Path(dst)
        seen.append((src.name, dst.name, src.stat().st_size, dst.exists()))
        image = src.read_bytes()
        header = unpack_header(image)  # the temp file is already a whole, valid chunk
        assert payload_checksum(image[PAYLOAD_OFFSET:PAYLOAD_OFFSET + 2048]) == header.payload_xxh3
        assert src.parent == dst.parent
        real_replace(src, dst)

    monkeypatch.setattr(files_mod.os, "replace", spy)
    pool.store(a, tiny.spec())
    h = a.id.key.hex()
    ((src, dst, size, existed),) = seen
    assert src.startswith(f"{h}.kvt.{os.getpid()}.") and src.endswith(".tmp")
    assert (dst, size, existed) == (f"{h}.kvt", FILE, False)


def test_failed_publish_leaves_nothing_behind(open_pool, tiny, monkeypatch):
    pool = open_pool()
    (a,) = tiny.chunks(1)

    def crash(fd, buffers):
        os.write(fd, b"half a chunk")
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(files_mod.os, "writev", crash)
    assert pool.store(a, tiny.spec()).status is Status.FAILED
    monkeypatch.undo()
    assert list(pool.files.root.rglob("*/*/*")) == []
    assert pool.lookup([a.id]) == 0
    assert pool.metrics.snapshot().failed_writes == 1


def test_temp_files_are_ignored_by_lookup_load_and_scan(open_pool, tiny):
    pool = open_pool()
    a, b = tiny.chunks(2)
    pool.store(b, tiny.spec())
    final = pool.files.path_for(a.id.key)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".4242.deadbeef.tmp")
    # A killed writer's temp file, even a complete one, is not a chunk until renamed.
    tmp.write_bytes(pool.files.path_for(b.id.key).read_bytes())
    assert pool.lookup([a.id]) == 0
    assert pool.load(a.id, tiny.spec()).status is Status.MISS
    assert [f.key for f in pool.files.scan()] == [b.id.key]
    assert [p for p, _ in pool.files.temp_files()] == [tmp]


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.fsync(fd)  # dirty pages stay cached
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "direct_io_cold"])
def test_unlink_while_reader_has_file_open_does_not_break_the_reader(open_pool, tiny, monkeypatch,
                                                                    bits_equal, direct_io):
    reader, evictor = open_pool(direct_io=direct_io), open_pool()
    (a,) = tiny.chunks(1)
    reader.store(a, tiny.spec())
    path = reader.files.path_for(a.id.key)
    _drop_from_page_cache(path)  # a cold file: the O_DIRECT path, where it is supported
    real_open = os.open
    evicted: list[int] = []

    def open_then_evict(file, flags, *args, **kwargs):
        fd = real_open(file, flags, *args, **kwargs)
        if Path(file) == path and not evicted:
            # Another instance evicts the chunk right after this reader opened it.
            evicted.append(evictor.evict(0))
            assert not path.exists()
        return fd

    monkeypatch.setattr(files_mod.os, "open", open_then_evict)
    got = reader.load(a.id, tiny.spec())
    monkeypatch.undo()
    assert evicted == [1]
    assert got.status is Status.HIT, got
    bits_equal(got.chunk.data, a.data)
    assert reader.metrics.snapshot().read_races == 0


def test_file_gone_before_open_is_a_counted_read_race(open_pool, tiny):
    pool = open_pool()
    (a,) = tiny.chunks(1)
    pool.store(a, tiny.spec())
    assert pool.lookup([a.id]) == 1
    os.unlink(pool.files.path_for(a.id.key))  # evicted by someone else after our lookup
    assert pool.load(a.id, tiny.spec()).status is Status.MISS
    snap = pool.metrics.snapshot()
    assert (snap.read_races, snap.corrupt_chunks, snap.failed_reads) == (1, 0, 0)


def test_corrupt_chunk_is_removed_for_every_instance(open_pool, tiny):
    a_tier, b_tier = open_pool(), open_pool()
    (a,) = tiny.chunks(1)
    a_tier.store(a, tiny.spec())
    path = a_tier.files.path_for(a.id.key)
    with open(path, "r+b") as f:
        f.seek(PAYLOAD_OFFSET + 7)
        byte = f.read(1)
        f.seek(PAYLOAD_OFFSET + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = b_tier.load(a.id, tiny.spec())
    assert result.status is Status.CORRUPT and "payload_checksum" in result.error
    assert not path.exists()
    assert a_tier.lookup([a.id]) == 0
    assert b_tier.metrics.snapshot().corrupt_chunks == 1


def test_timing_a_read_never_judges_a_file_and_refuses_what_is_not_a_chunk(open_pool, tiny, pool_dir):
    """``time_read`` (the scheduler's rate probe) reads raw bytes: a corrupt neighbour's file is
    timed and left in place (its load judges it), a symlink, FIFO or oversized file is not read."""
    pool = open_pool()
    a, b, c, d = tiny.chunks(4)
    for chunk in (a, b):
        pool.store(chunk, tiny.spec())
    size = pool.files.path_for(a.id.key).stat().st_size
    timed = pool.time_read(a.id, size)
    assert timed is not None and timed[0] == size and timed[1] > 0
    path = pool.files.path_for(b.id.key)
    path.write_bytes(b"\xff" * size)  # right size, wrong bytes
    assert pool.time_read(b.id, size) is not None and path.exists()
    assert pool.time_read(b.id, size - 1) is None  # over max_bytes: not read
    target = pool.files.path_for(c.id.key)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(path)
    fifo = pool.files.path_for(d.id.key)
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    assert pool.time_read(c.id, size) is None and pool.time_read(d.id, size) is None  # never followed, never waited on
    assert pool.time_read(tiny.chunks(5)[4].id, size) is None  # absent
    assert target.is_symlink() and fifo.exists() and path.exists()
    assert pool.metrics.snapshot().corrupt_chunks == 0


def test_evict_removes_least_recently_used_by_mtime(open_pool, tiny):
    pool = open_pool()
    chunks = tiny.chunks(5)
    now = time.time()
    for age, ch in zip((50, 10, 40, 20, 30), chunks, strict=False):
        pool.store(ch, tiny.spec())
        os.utime(pool.files.path_for(ch.id.key), (now - age, now - age))
    assert pool.evict(2 * FILE) == 3
    assert {f.key for f in pool.files.scan()} == {chunks[1].id.key, chunks[3].id.key}
    assert _total(pool.files.root) == 2 * FILE  # a pass that saw the whole pool anchored the count
    snap = pool.metrics.snapshot()
    assert (snap.evictions, snap.evicted_bytes, snap.chunks, snap.bytes) == (3, 3 * FILE, 2, 2 * FILE)


def test_budget_holds_across_instances_with_exact_lru(open_pool, tiny, pool_dir):
    """Two instances share a budget of 10 chunks, each syncing after every chunk; their
    evictors run beside the writes. The pool never holds more than the stated bound, and once
    the evictors settle what is left is the newest chunks, under budget."""
    capacity = 10 * FILE
    tiers = [open_pool(capacity, sync_bytes=FILE), open_pool(capacity, sync_bytes=FILE)]
    bound = tiers[0].cap_bytes + (len(tiers) - 1) * FILE  # cap + (instances - 1) x sync_bytes
    chunks = tiny.chunks(30, seed=7)
    base = time.time() - 1000
    written = []
    for i, ch in enumerate(chunks):
        result = tiers[i % 2].store(ch, tiny.spec())
        assert result.status in (Status.WRITTEN, Status.FAILED), result
        if result.status is Status.WRITTEN:
            written.append(ch)
            # Pin mtimes to write order so LRU is exact whatever the clock granularity.
            os.utime(tiers[0].files.path_for(ch.id.key), (base + i, base + i))
        else:
            assert "cap" in result.error  # refused, never blocked: eviction was behind
        assert bytes_on_disk(pool_dir) <= bound
    for tier in tiers:
        tier.sync()
    for tier in tiers:
        assert tier.evictor.settle()
    left = {f.key for f in tiers[0].files.scan()}
    assert 0 < len(left) <= 10 and bytes_on_disk(pool_dir) <= capacity
    assert left == {ch.id.key for ch in written[-len(left):]}  # the newest ones, exactly
    evicted = sum(t.metrics.snapshot().evictions for t in tiers)
    refused = sum(t.metrics.snapshot().budget_refusals for t in tiers)
    assert evicted == len(written) - len(left) and refused == len(chunks) - len(written)
    assert _total(pool_dir) == bytes_on_disk(pool_dir)


def test_budget_holds_across_two_stores(make_store, tiny, pool_dir):
    capacity = 10 * FILE
    stores = [make_store(host_bytes=0, pool_url=new_pool(pool_dir), pool_bytes=capacity) for _ in range(2)]
    n = tiny.chunk_tokens
    for seed in range(16):
        stores[seed % 2].put(tiny.tokens(n, seed), tiny.kv(n, seed))
    for store in stores:
        store.flush()
    for store in stores:
        store.tiers[0].sync()  # each instance's bytes into its ledger, the other's read
    for store in stores:
        assert store.tiers[0].evictor.settle()
    assert bytes_on_disk(pool_dir) <= capacity
    assert _total(pool_dir) == bytes_on_disk(pool_dir)
    evicted = sum(s.metrics_snapshot()["tiers"]["pool"]["evictions"] for s in stores)
    assert evicted == 16 - len(kvt_files(pool_dir)) == 7  # down to the 90% low watermark


def test_eviction_racing_readers_never_yields_corrupt_data(open_pool, tiny, bits_equal):
    """Readers and an evicting rewriter hammer the same 4 chunks: only HITs and MISSes."""
    writer, reader = open_pool(), open_pool()
    chunks = tiny.chunks(4, seed=3)
    stop = threading.Event()
    statuses: dict[Status, int] = {}
    errors: list[BaseException] = []

    def churn():
        while not stop.is_set():
            for ch in chunks:
                writer.store(ch, tiny.spec())
            writer.evict(2 * FILE)

    def read():
        try:
            while not stop.is_set():
                for ch in chunks:
                    got = reader.load(ch.id, tiny.spec())
                    statuses[got.status] = statuses.get(got.status, 0) + 1
                    if got.ok:
                        bits_equal(got.chunk.data, ch.data)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn), threading.Thread(target=read)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert set(statuses) <= {Status.HIT, Status.MISS}
    assert statuses.get(Status.HIT, 0) > 0
    assert reader.metrics.snapshot().corrupt_chunks == 0


def test_two_processes_write_and_read_one_pool_concurrently(tiny, tmp_path, pool_dir, make_store, bits_equal):
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    procs = [subprocess.Popen([sys.executable, str(WORKERS), "pool-rw", str(pool_dir), str(role), "2",
                               str(rendezvous)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in range(2)]
    # Meanwhile, every file under a final .kvt name must be a whole, valid chunk.
    checked_files = 0
    deadline = time.monotonic() + 90
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        for path in kvt_files(pool_dir) if pool_dir.exists() else []:
            image = path.read_bytes()
            assert len(image) == FILE, f"partial chunk visible: {path.name} has {len(image)} B"
            try:
                header = unpack_header(image)
            except ChunkError as exc:  # pragma: no cover - the failure message
                pytest.fail(f"{path.name}: {exc}")
            assert path.name == f"{header.chunk.key.hex()}.kvt"
            assert payload_checksum(image[PAYLOAD_OFFSET:PAYLOAD_OFFSET + 2048]) == header.payload_xxh3
            checked_files += 1
        time.sleep(0.002)
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    # Each read back 1 shared + 4 own + 4 peer sequences of 4 chunks, all bit-exact.
    assert results == [{"checked": 9, "corrupt": 0, "failed_writes": 0}] * 2
    assert checked_files > 0
    assert len(kvt_files(pool_dir)) == 9 * 4  # the shared sequence stored once
    assert list(pool_dir.rglob("*.tmp")) == []

    store = make_store(host_bytes=0, pool_url=new_pool(pool_dir))
    n = 4 * tiny.chunk_tokens
    for seed in [999, 100, 101, 102, 103, 110, 111, 112, 113]:
        assert store.lookup(tiny.tokens(n, seed)).chunk_tiers == ("pool",) * 4
        bits_equal(store.get(tiny.tokens(n, seed)), tiny.kv(n, seed))


def test_retained_chunks_go_after_every_unretained_one_across_instances_and_gc(open_pool, tiny, pool_dir):
    from kvtier.admin import gc

    a, b = open_pool(), open_pool()
    chunks = tiny.chunks(6)
    now = time.time()
    for i, ch in enumerate(chunks):
        a.store(ch, tiny.spec())
        os.utime(a.files.path_for(ch.id.key), (now - 100 + i, now - 100 + i))  # write order
    # The two oldest belong to a session that asked to be kept for an hour.
    assert a.retain(chunks[0].id.key, now + 3600) and a.retain(chunks[1].id.key, now + 3600)
    assert not a.retain(tiny.chunks(1, seed=9)[0].id.key, now + 3600)  # not in the pool
    # Another instance over budget evicts the four unretained ones first...
    assert b.evict(2 * FILE) == 4
    assert {f.key for f in b.files.scan()} == {chunks[0].id.key, chunks[1].id.key}
    # ...a hit does not reset a retained chunk's clock...
    assert b.load(chunks[0].id, tiny.spec()).ok
    assert b.files.path_for(chunks[0].id.key).stat().st_mtime == pytest.approx(now + 3600)
    # ...and gc takes a retained chunk only when nothing unretained is left.
    b.store(tiny.chunks(1, seed=3)[0], tiny.spec())
    assert gc(pool_dir, 2 * FILE).evicted_chunks == 1
    assert {f.key for f in b.files.scan()} == {chunks[0].id.key, chunks[1].id.key}
    assert gc(pool_dir, FILE).evicted_chunks == 1


def test_expired_retention_ages_like_any_chunk_used_then(open_pool, tiny):
    pool = open_pool()
    old, kept, new = tiny.chunks(3)
    now = time.time()
    for age, ch in zip((300, 200, 100), (old, kept, new), strict=True):
        pool.store(ch, tiny.spec())
        os.utime(pool.files.path_for(ch.id.key), (now - age, now - age))
    pool.retain(kept.id.key, now - 150)  # retained until 150 s ago: newer than `old`, older than `new`
    assert pool.evict(FILE) == 2
    assert {f.key for f in pool.files.scan()} == {new.id.key}


def test_every_eviction_is_logged_for_the_other_instances(open_pool, tiny, pool_dir):
    from kvtier.admin import gc

    writer, reader = open_pool(), open_pool()
    assert reader.read_evictions() == []  # starts at the log's end
    chunks = tiny.chunks(4)
    for ch in chunks:
        writer.store(ch, tiny.spec())
    writer.journal.enable()
    writer.evict(3 * FILE)
    assert gc(pool_dir, FILE).evicted_chunks == 2
    evicted = reader.read_evictions()
    assert len(evicted) == 3 and set(evicted) < {ch.id.key for ch in chunks}
    assert reader.read_evictions() == []
    assert [added for added, _ in writer.journal.drain()] == [False]  # its own eviction, not gc's


# -- hostile metadata files and a filesystem that cannot lock (docs/reliability.md) -----------

def test_a_fifo_planted_as_usage_never_blocks_sync(open_pool, tiny, pool_dir):
    """Before: sync() opened .usage for reading and blocked on the FIFO forever, holding the
    fleet-wide lock, so every instance's writer hung behind it."""
    pool = open_pool(capacity_bytes=3 * FILE)
    assert pool.evictor.settle()
    (pool_dir / ".usage").unlink()  # the base the first count anchored
    os.mkfifo(pool_dir / ".usage")
    for ch in tiny.chunks(5):
        pool.store(ch, tiny.spec())
    within(pool.sync, 5.0)
    assert within(pool.evictor.settle, 10.0)
    assert bytes_on_disk(pool_dir) <= 3 * FILE  # counted and evicted as if .usage were missing
    assert _total(pool_dir) == bytes_on_disk(pool_dir)
    assert not (pool_dir / ".usage").is_fifo()  # replaced by a real base


def test_a_symlink_planted_as_the_eviction_log_is_never_read(open_pool, tiny, pool_dir):
    """Before: .evicted -> /dev/zero was read without limit (MemoryError) on the engine thread."""
    reader = open_pool()
    reader.read_evictions()
    (pool_dir / ".evicted").symlink_to("/dev/zero")
    assert within(reader.read_evictions, 5.0) == []
    writer = open_pool()
    for ch in tiny.chunks(2):
        writer.store(ch, tiny.spec())
    writer.evict(0)  # the link is replaced by a real log, /dev/zero untouched
    assert not (pool_dir / ".evicted").is_symlink()
    assert len(reader.read_evictions()) == 2


def test_a_huge_eviction_log_is_read_in_bounded_pieces(open_pool, pool_dir):
    from kvtier.tiers.pool import EVICTION_READ_MAX_BYTES

    reader = open_pool()
    reader.read_evictions()
    line = b"ab" * 32 + b"\n"
    (pool_dir / ".evicted").write_bytes(line * (3 * EVICTION_READ_MAX_BYTES // len(line)))
    first = reader.read_evictions()  # a new inode: read from its start, at most one piece
    assert 0 < len(first) <= EVICTION_READ_MAX_BYTES // len(line)
    rest = reader.read_evictions() + reader.read_evictions() + reader.read_evictions()
    assert len(first) + len(rest) == 3 * EVICTION_READ_MAX_BYTES // len(line)


def test_a_fifo_planted_as_the_eviction_log_never_blocks_an_eviction(open_pool, tiny, pool_dir):
    pool = open_pool()
    for ch in tiny.chunks(3):
        pool.store(ch, tiny.spec())
    os.mkfifo(pool_dir / ".evicted")
    assert within(lambda: pool.evict(0), 5.0) == 3


@pytest.mark.parametrize("usage", [{"bytes": -10**18, "anchored_at": time.time()},
                                   {"bytes": 0, "anchored_at": 1e30},
                                   {"bytes": 0, "anchored_at": float("nan")},
                                   {"bytes": "x" * 100_000, "anchored_at": 0},
                                   {"bytes": 10**18, "anchored_at": time.time()}])
def test_nonsense_in_usage_means_a_recount(open_pool, tiny, pool_dir, usage):
    pool = open_pool(capacity_bytes=2 * FILE)
    assert pool.evictor.settle()
    (pool_dir / ".usage").write_text(json.dumps(usage))  # a neighbour's
    for ch in tiny.chunks(4):
        pool.store(ch, tiny.spec())
    pool.sync()
    assert pool.evictor.settle()
    assert bytes_on_disk(pool_dir) <= 2 * FILE
    assert _total(pool_dir) == bytes_on_disk(pool_dir)  # the count replaced the nonsense


def test_a_filesystem_that_cannot_lock_still_keeps_the_budget_and_no_bytes_are_lost(open_pool, tiny, pool_dir,
                                                                                   monkeypatch, caplog):
    """Before: sync() zeroed its pending bytes before taking the lock; a failing flock lost them
    and the pool never evicted."""
    import errno as errno_mod
    import fcntl

    from kvtier.tiers import poollock as poollock_mod

    def no_locks(fd, op):  # type: ignore[no-untyped-def]
        raise OSError(errno_mod.ENOLCK, "No locks available")

    monkeypatch.setattr(poollock_mod.fcntl, "flock", no_locks)
    pool = open_pool(capacity_bytes=3 * FILE, sync_bytes=1 << 40)
    assert not pool.lock_works
    assert "cannot lock" in caplog.text
    for ch in tiny.chunks(6):
        pool.store(ch, tiny.spec())  # over budget: the evictor runs, unlocked
    assert pool.evictor.settle()
    assert bytes_on_disk(pool_dir) <= 3 * FILE
    assert pool.metrics.snapshot().lock_failures >= 2
    pool.sync()  # the counts of a ledger never written before (sync_bytes is huge) are all there
    added, removed = pool.ledger.added, pool.ledger.removed
    assert (added, added - removed) == (6 * FILE, bytes_on_disk(pool_dir))
    monkeypatch.setattr(poollock_mod.fcntl, "flock", fcntl.flock)


def test_a_failed_sync_keeps_its_pending_bytes(open_pool, tiny, monkeypatch):
    pool = open_pool(sync_bytes=1 << 40)  # no budget: no evictor thread to write the ledger meanwhile
    for ch in tiny.chunks(3):
        pool.store(ch, tiny.spec())
    assert pool.ledger.unsynced() == (3 * FILE, 0)

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pool.files, "write_small", full)
    with pytest.raises(OSError):
        pool.sync()
    assert pool.ledger.unsynced() == (3 * FILE, 0)  # kept for the next sync
    monkeypatch.undo()
    assert pool.sync() == 3 * FILE
    assert pool.ledger.unsynced() == (0, 0)


def test_a_lock_file_replaced_by_a_symlink_or_fifo_is_not_used(open_pool, tiny, pool_dir, tmp_path):
    pool = open_pool(capacity_bytes=2 * FILE)
    target = tmp_path / "elsewhere"
    target.write_text("")
    (pool_dir / ".lock").unlink()
    (pool_dir / ".lock").symlink_to(target)
    for ch in tiny.chunks(4):
        pool.store(ch, tiny.spec())
    within(pool.sync, 5.0)
    assert within(pool.evictor.settle, 10.0)
    assert bytes_on_disk(pool_dir) <= 2 * FILE
    assert pool.metrics.snapshot().lock_failures >= 1  # the anchor's ROOT/.lock
    (pool_dir / ".lock").unlink()
    os.mkfifo(pool_dir / ".lock")
    for ch in tiny.chunks(4, seed=5):
        pool.store(ch, tiny.spec())
    within(pool.sync, 5.0)
    assert within(pool.evictor.settle, 10.0)
    assert bytes_on_disk(pool_dir) <= 2 * FILE


def test_a_rotation_of_the_eviction_log_loses_no_line_a_reader_had_not_read(open_pool, pool_dir, monkeypatch):
    """6f37bba started the log over by unlinking it: the lines appended after a reader's last
    read and before the rotation were never read (a router kept advertising those chunks)."""
    from kvtier.tiers import evictlog

    monkeypatch.setattr(evictlog, "EVICTION_LOG_MAX_BYTES", 10 * 65)
    pool = open_pool()
    log, reader = pool.eviction_log, open_pool()
    reader.read_evictions()
    keys = [bytes([i]) * 32 for i in range(40)]
    got: list[bytes] = []
    for i in range(0, 40, 4):  # the reader reads after every third append: behind across rotations
        log.append(keys[i:i + 4])
        if i % 12 == 8:
            got += reader.read_evictions()
    for _ in range(4):
        got += reader.read_evictions()
    assert got == keys
    assert (pool_dir / ".evicted.1").exists()


def test_the_rate_probe_never_times_the_page_cache_as_the_pool(open_pool, tiny):
    """6f37bba timed a chunk the page cache held whole (a memory copy, 10x a device's rate) as
    the tier's first read rate. Now such a read goes to the device (O_DIRECT), and where that
    is off, nothing is timed until the file is read from the device."""
    from kvtier.tiers.pagecache import cached_bytes

    pool = open_pool(direct_io=False)
    chunk = tiny.chunks(1, seed=4)[0]
    pool.store(chunk, tiny.spec())
    path = pool.files.path_for(chunk.id.key)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, size)  # the page cache holds it whole
        if cached_bytes(fd) is None:
            pytest.skip("the kernel cannot tell what the page cache holds (cachestat, Linux >= 6.5)")
        assert pool.time_read(chunk.id, size) is None
        os.fsync(fd)  # dirty pages stay cached
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if cached_bytes(fd):
            pytest.skip("this filesystem keeps its pages (tmpfs)")
    finally:
        os.close(fd)
    timed = pool.time_read(chunk.id, size)  # from the device
    assert timed is not None and timed[0] == size
    assert open_pool().time_read(chunk.id, size) is not None  # O_DIRECT: the device, cached or not
