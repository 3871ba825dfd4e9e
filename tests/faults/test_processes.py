"""Process-level faults: gc after killed writers.
"""

from __future__ import annotations

import os
import time

from kvtier import admin
from kvtier.tiers.files import TMP_SUFFIX
from kvtier.tiers.pool import PoolTier


def test_gc_removes_temp_files_left_beside_the_usage_file_and_namespaces(tmp_path):
    """Regression: a writer killed while rewriting ROOT/.usage (every budget sync does) or a
    namespace description left ``*.tmp`` files that gc never looked for (it scanned only the
    shard directories), so they piled up forever."""
    pool = tmp_path / "pool"
    PoolTier(pool, None).close()
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
