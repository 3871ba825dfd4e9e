"""A pool that cannot be silently misconfigured (tiers/poolroot.py): it is never created by an
open, it records the one budget every instance holds, and it says where it lives."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from _pool import new_pool
from conftest import bytes_on_disk
from kvtier import TieredStore
from kvtier.cli.main import main
from kvtier.errors import TierUnavailableError
from kvtier.tiers import poolroot
from kvtier.tiers.pool import PoolTier, cap_bytes
from kvtier.tiers.poolroot import BUDGET_FILE, init_pool, mount_of, read_budget

FILE = 8192


def _cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _fill(pool: PoolTier, tiny: Any, n: int, seed: int = 0) -> TieredStore:
    """``n`` one-chunk sessions written through ``pool`` (the store, left open: closing it
    would close the pool)."""
    store = TieredStore(tiny.config(host_bytes=0, write_queue_chunks=4), tiers=[pool])
    for i in range(n):
        store.put(tiny.tokens(tiny.chunk_tokens, seed=seed * 1000 + i), tiny.kv(tiny.chunk_tokens, seed=i))
        store.flush()
    return store


@pytest.mark.parametrize("shape", ["missing", "missing-parent", "empty-unmarked", "a-file"])
def test_opening_a_pool_that_is_not_there_is_refused_and_creates_nothing(tmp_path: Path, shape: str) -> None:
    """6f37bba created every missing directory: an NFS export not mounted yet became a private
    pool on the root disk, with no error."""
    path = {"missing": tmp_path / "pool", "missing-parent": tmp_path / "mnt" / "pool",
            "empty-unmarked": tmp_path / "empty", "a-file": tmp_path / "file"}[shape]
    if shape == "empty-unmarked":
        path.mkdir()
    if shape == "a-file":
        path.write_bytes(b"x")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(TierUnavailableError, match=r"mounted.*kvtier pool init"):
        PoolTier(path, None)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_pool_init_creates_marks_records_the_budget_and_says_where(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "shared" / "pool"
    code, out = _cli_json(capsys, "pool", "init", str(path), "--max-bytes", "64MiB")
    assert code == 0 and (path / ".kvtier").is_file()
    assert out["budget_bytes"] == 64 << 20 == read_budget(path)
    mount = mount_of(path)
    assert (out["fstype"], out["device"], out["on_root_device"]) == (mount.fstype, mount.device, mount.on_root_device)
    assert out["fstype"] != "?" and out["mount_point"] != "?"
    # Again on the pool: idempotent, chunks kept; budget changed by `pool budget`.
    (path / "ab").mkdir()
    assert _cli_json(capsys, "pool", "init", str(path))[0] == 0 and (path / "ab").is_dir()
    assert _cli_json(capsys, "pool", "budget", str(path), "32MiB")[1]["budget_bytes"] == 32 << 20
    assert read_budget(path) == 32 << 20
    code, stats = _cli_json(capsys, "pool", "stats", str(path))
    assert code == 0 and stats["budget_bytes"] == 32 << 20


@pytest.mark.parametrize(("argv", "says"), [
    (["pool", "init", "relative/pool"], "relative"),
    (["pool", "init", "{tmp}/other", "--max-bytes", "0"], "must be > 0"),
    (["pool", "init", "{tmp}/notes"], "not empty and not a kvtier pool"),
    (["pool", "budget", "{tmp}/nowhere", "1GiB"], "does not exist"),
    (["pool", "gc", "{tmp}/nobudget"], "records no budget"),
])
def test_pool_init_and_budget_refuse_what_would_go_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         argv: list[str], says: str) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("not a pool")
    init_pool(tmp_path / "nobudget", None)
    code, out = _cli_json(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == 2 and says in out["error"]
    assert not (tmp_path / "notes" / ".kvtier").exists() and not (tmp_path / "other").exists()


def test_every_instance_holds_the_pools_budget_whatever_its_own_pool_bytes(tmp_path: Path, tiny: Any,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """6f37bba: each instance evicted against its own pool_bytes, so the smallest won for all."""
    path = tmp_path / "pool"
    new_pool(path, 40 * FILE)
    caplog.set_level(logging.WARNING, "kvtier")
    small = PoolTier(path, 4 * FILE, sync_bytes=FILE)  # asks for a tenth of the budget
    large = PoolTier(path, 400 * FILE, sync_bytes=FILE)
    plain = PoolTier(path, None, sync_bytes=FILE)
    try:
        assert small.capacity_bytes == large.capacity_bytes == plain.capacity_bytes == 40 * FILE
        assert large.cap_bytes == plain.cap_bytes == cap_bytes(40 * FILE, FILE)
        assert small.cap_bytes == cap_bytes(4 * FILE, FILE)  # lowers its own admissions only
        disagreements = [r.getMessage() for r in caplog.records if "differs from the budget" in r.getMessage()]
        assert len(disagreements) == 2 and "ignored" in disagreements[1] and "admits" in disagreements[0]
        assert tiny.file_bytes <= FILE
        _fill(plain, tiny, 30)
        assert plain.evictor.settle() and small.evictor.settle()
        # 30 files fit the pool's budget: the small instance's own 4 evicted nothing.
        assert bytes_on_disk(path) >= 30 * tiny.file_bytes
        # ... and it publishes nothing more while the pool holds more than its own cap allows.
        small.sync(), large.sync()
        _fill(small, tiny, 2, seed=1)
        _fill(large, tiny, 2, seed=2)
        assert small.metrics.snapshot().budget_refusals == 2 and small.metrics.snapshot().written_chunks == 0
        assert large.metrics.snapshot().written_chunks == 2
    finally:
        for p in (small, large, plain):
            p.close()


def test_a_budget_changed_with_pool_budget_reaches_running_instances(tmp_path: Path, tiny: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "pool"
    new_pool(path, 1 << 30)
    monkeypatch.setattr("kvtier.tiers.pool.BUDGET_REFRESH_S", 0.0)
    pool = PoolTier(path, None, sync_bytes=FILE)
    try:
        _fill(pool, tiny, 12)
        assert pool.evictor.settle()
        full = bytes_on_disk(path)
        assert full >= 12 * tiny.file_bytes
        assert main(["pool", "budget", str(path), str(4 * tiny.file_bytes)]) == 0
        pool.sync()
        assert pool.capacity_bytes == 4 * tiny.file_bytes
        deadline = time.monotonic() + 30
        while bytes_on_disk(path) > 4 * tiny.file_bytes and time.monotonic() < deadline:
            pool.evictor.settle()
        assert bytes_on_disk(path) <= 4 * tiny.file_bytes < full
    finally:
        pool.close()


def test_a_pool_with_no_budget_anywhere_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kvtier")
    PoolTier(new_pool(tmp_path / "a")[len("fs://"):], None).close()
    assert any("has no budget" in r.getMessage() for r in caplog.records)
    caplog.clear()
    PoolTier(new_pool(tmp_path / "b", 1 << 30)[len("fs://"):], None).close()
    PoolTier(new_pool(tmp_path / "c")[len("fs://"):], 1 << 30).close()
    assert not any("has no budget" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["nonsense", "negative", "symlink to /dev/zero", "fifo", "huge"])
def test_a_hostile_budget_file_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                         kind: str) -> None:
    path = tmp_path / "pool"
    new_pool(path)
    budget = path / BUDGET_FILE
    if kind == "nonsense":
        budget.write_text("{not json")
    elif kind == "negative":
        budget.write_text('{"max_bytes": -5}')
    elif kind == "symlink to /dev/zero":
        budget.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(budget)
    else:
        budget.write_text('{"max_bytes": 1' + "0" * 5000 + "}")
    caplog.set_level(logging.WARNING, "kvtier")
    t = time.monotonic()
    pool = PoolTier(path, 8 << 20)
    try:
        assert time.monotonic() - t < 5 and pool.capacity_bytes == 8 << 20 and pool.pool_budget is None
        assert any(BUDGET_FILE in r.getMessage() for r in caplog.records)
    finally:
        pool.close()


def test_where_the_pool_lives_is_logged_and_the_root_device_warned_about(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "pool"
    init_pool(path, 1 << 30)
    caplog.set_level(logging.INFO, "kvtier")
    PoolTier(path, None).close()
    mount = mount_of(path)
    opened = [r.getMessage() for r in caplog.records if "filesystem" in r.getMessage()]
    assert opened and mount.fstype in opened[0] and mount.device in opened[0]
    warned = [r for r in caplog.records if "same device" in r.getMessage()]
    assert len(warned) == int(mount.on_root_device)
    on_root = os.stat("/").st_dev == os.stat(path).st_dev
    assert mount.on_root_device == on_root


def test_a_root_device_pool_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever filesystem the test's tmp_path is on: a pool on /'s device is warned about."""
    path = tmp_path / "pool"
    init_pool(path, 1 << 30)
    real_stat = os.stat
    monkeypatch.setattr(poolroot.os, "stat", lambda p, *a, **k: real_stat(path) if p == "/" else real_stat(p, *a, **k))
    caplog.set_level(logging.WARNING, "kvtier")
    PoolTier(path, None).close()
    PoolTier(path, None).close()
    assert len([r for r in caplog.records if "same device" in r.getMessage()]) == 1  # once per pool and process


@pytest.mark.parametrize(("target", "says"), [("{tmp}/nowhere", "does not exist"), ("fs://x", "absolute path"),
                                              ("http://server/pool", "not supported"),
                                              ("nfs://server/pool", "not supported")])
def test_probe_refuses_what_it_cannot_measure(tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str,
                                              says: str) -> None:
    """6f37bba's probe created a local directory for any of these, measured the local disk and
    exited 0."""
    code, out = _cli_json(capsys, "probe", target.replace("{tmp}", str(tmp_path)), "--total", "1MiB")
    assert code == 2 and says in out["error"]
    assert list(tmp_path.iterdir()) == [] and not Path("x").exists()


def _init_together(path: Path, start: object, errors: list[Exception]) -> None:
    start.wait()  # type: ignore[attr-defined]
    try:
        init_pool(path, None)
    except Exception as exc:  # any failure is the finding
        errors.append(exc)


def test_inits_of_one_new_pool_at_once_all_succeed(tmp_path: Path) -> None:
    """An init that met another one's marker temp file (the directory's only entry for a moment)
    took the directory for "not empty and not a pool": the test suite's two pool workers starting
    together failed 1 run in 3 under load."""
    import threading

    for attempt in range(20):
        path = tmp_path / f"pool-{attempt}"
        start, errors = threading.Barrier(8), []
        threads = [threading.Thread(target=_init_together, args=(path, start, errors)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and (path / ".kvtier").is_file()
