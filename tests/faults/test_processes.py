"""Process-level faults at the ci scale: writers SIGKILLed mid-write, processes sharing a pool.

About 40 s on two cores: 2 x 40 kills, then 2 x 8 s of 2 and 4 processes beside a gc loop.
"""

from __future__ import annotations

import os
import time

from kvtier import admin
from kvtier.fileio import TMP_SUFFIX
from kvtier.tiers.pool import PoolTier

from .harness import SCALES
from .harness.concurrency import processes_share_pool
from .harness.crash import assert_nothing_lost, writer_sigkill


def test_writer_sigkill_mid_write_loses_nothing_and_leaves_only_temp_files(tmp_path):
    rows = writer_sigkill(SCALES["ci"], tmp_path)
    assert [r.extra["fsync"] for r in rows] == [False, True]
    for row in rows:
        assert_nothing_lost(row)
    # Proof the kills landed inside publish: some left their temp file (with fsync on, most do).
    assert sum(int(r.extra["kills_with_temp"]) for r in rows) >= 5


def test_processes_sharing_one_pool_never_see_a_wrong_or_corrupt_chunk(tmp_path):
    rows = processes_share_pool(SCALES["ci"], tmp_path)
    assert [r.extra["processes"] for r in rows] == [2, 4]
    for row in rows:
        row.check()
        x = row.extra
        assert x["corrupt_chunks"] == 0 and x["failed_reads"] == 0
        assert x["final_verify_bad"] == [] and x["final_wrong"] == 0 and x["final_unknown"] == 0
        assert x["final_identical"] == x["final_chunks"]
        # The run exercised what it claims: hits on other processes' chunks, eviction, gc.
        assert int(x["full_hits"]) > 0 and int(x["evictions"]) > 0 and int(x["gc_runs"]) > 0


def test_gc_removes_temp_files_left_beside_the_usage_file_and_namespaces(tmp_path):
    """Regression: a writer killed while rewriting ROOT/.usage (every budget sync does) or a
    namespace description left ``*.tmp`` files that gc never looked for (it scanned only the
    shard directories), so they piled up forever."""
    pool = tmp_path / "pool"
    PoolTier(pool, None, create=True).close()
    (pool / "namespaces").mkdir(exist_ok=True)
    stale = [pool / f".usage.4242.deadbeef{TMP_SUFFIX}", pool / "namespaces" / f"ab.json.4242.cafe{TMP_SUFFIX}",
             pool / "00" / "11" / f"{'0011' + '0' * 60}.kvt.4242.0123456789ab{TMP_SUFFIX}"]
    stale[2].parent.mkdir(parents=True)
    fresh = pool / f".usage.4343.feedface{TMP_SUFFIX}"
    old = time.time() - 7200
    for path in stale:
        path.write_bytes(b"")
        os.utime(path, (old, old))
    fresh.write_bytes(b"")

    report = admin.gc(pool, max_bytes=1 << 40, tmp_age_s=3600)

    assert report.removed_temp_files == 3
    assert not any(p.exists() for p in stale)
    assert fresh.exists()  # a live writer's, younger than tmp_age_s
    assert (pool / ".usage").exists() and (pool / ".kvtier").exists()


def test_verify_beside_an_evictor_skips_chunks_that_vanish_instead_of_calling_them_bad(
        tmp_path, monkeypatch, tiny):
    """Regression: a chunk evicted between verify's listing and its check was reported
    "truncated", so `kvtier pool verify` beside live engines exited 1 for nothing."""
    pool = PoolTier(tmp_path / "pool", None, create=True)
    for chunk in tiny.chunks(6):
        pool.store(chunk, tiny.spec())
    pool.close()
    real = admin.check_file
    evicted = []

    def evict_then_check(path):
        if not evicted:  # an evictor removes the first chunk verify is about to check
            evicted.append(path)
            os.unlink(path)
        return real(path)

    monkeypatch.setattr(admin, "check_file", evict_then_check)
    report = admin.verify(tmp_path / "pool")
    assert (report.checked, report.ok, report.bad) == (5, 5, [])
    # A chunk that is really damaged is still reported.
    victim = next((tmp_path / "pool").glob("??/??/*.kvt"))
    victim.write_bytes(victim.read_bytes()[:100])
    monkeypatch.setattr(admin, "check_file", real)
    assert [b["fault"] for b in admin.verify(tmp_path / "pool").bad] == ["truncated"]
