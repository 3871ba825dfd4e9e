"""What a workload stores per tier (objects, files, inodes, bytes, budget, headroom) and hit
rate and TTFT against the pool's size. The count is checked against a pool a real bench run
filled in tests/integration/test_bench_suite.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.format import file_bytes_for
from kvtier.plan import presets
from kvtier.plan.capacity import StoreShape, capacity, capacity_curve, count_on_disk, footprint, session_objects
from kvtier.plan.spec import ModelSpec, PlanConfig, hardware_from_dict
from kvtier.plan.workload import cold_resume
from kvtier.tiers.pool import overshoot_bound


def test_a_session_stores_its_longest_chunks_once_and_each_distinct_tail() -> None:
    shape = StoreShape(chunk_tokens=256, block_tokens=16)  # tails in steps of 64 tokens
    # Turn 1: 1000 prompt tokens, 1009 computed by its end: 3 chunks; its prompt's tail (768,
    # 192) is also where the finished request's tail lies, so one tail. Turn 2 extends it to
    # 1109 computed tokens: a 4th chunk and a tail (1024, 64).
    assert session_objects([(1000, 10)], shape) == (3, 1)
    assert session_objects([(1000, 10), (1100, 10)], shape) == (4, 2)
    assert session_objects([(1000, 10)], StoreShape(256, 16, tails=False)) == (3, 0)
    assert session_objects([(1000, 100)], StoreShape(256, 16, save_decode=False)) == (3, 1)
    assert session_objects([(1000, 100)], shape) == (4, 2)  # 1099 computed: a 4th chunk, a tail at 1024


def test_an_answer_that_comes_back_as_other_tokens_is_stored_again() -> None:
    shape = StoreShape(chunk_tokens=256, block_tokens=16)
    turns = [(1000, 100), (1150, 10)]
    # Turn 1 saved chunk 4 (tokens 768-1023 hold the end of its prompt and the start of its
    # answer) and a tail (1024, 64). If turn 2's prompt re-tokenizes that answer differently,
    # its chunk 4 and its tail (1024, 64) are new files: the upper bound.
    assert session_objects(turns, shape) == (5, 4)
    # If it re-tokenizes to the same tokens, they are the same files: the lower bound.
    assert session_objects(turns, shape, answers_match=True) == (4, 3)


def test_footprint_is_files_per_head_with_headers() -> None:
    model = ModelSpec(num_layers=4, num_kv_heads=2, head_dim=64)
    out = footprint([[(1000, 10)], [(300, 1)]], model, StoreShape(256, 128))
    # 1000 tokens: 3 chunks, tail of 128 at 768 (232 left, in 128-token steps); 300: 1 chunk, no tail.
    assert (out["chunks"], out["tails"], out["files"]) == (4, 1, 10)
    assert out["bytes"] == 10 * file_bytes_for(256 * model.bytes_per_token // 2)
    assert out["inodes"] > out["files"]
    assert out["files_low"] == out["files"]  # one turn each: nothing re-tokenized


def test_capacity_per_tier_budget_headroom_and_host_per_rank() -> None:
    hw = hardware_from_dict(presets.SEED_HARDWARE)
    workload = cold_resume(8, (20000, 30000), 8, seed=0)
    cap = capacity(presets.SEED_MODEL, hw, workload)
    pool, disk, host = cap["tiers"]["pool"], cap["tiers"]["disk"], cap["tiers"]["host"]
    assert pool["sessions"] == 8 and pool["files"] == (pool["chunks"] + pool["tails"]) * 8
    assert pool["budget_bytes"] == pool["bytes"] == disk["bytes"]
    assert pool["filesystem_bytes"] == overshoot_bound(pool["bytes"], max(1 << 20, min(256 << 20, pool["bytes"] // 32)),
                                                       cap["writers"])
    assert pool["filesystem_bytes"] > pool["budget_bytes"] == disk["filesystem_bytes"]
    assert host["host_bytes_per_rank"] == 1000 * 10**9 // 8


def test_the_curve_reaches_every_hit_only_with_room_for_the_working_set() -> None:
    hw = hardware_from_dict(presets.SEED_HARDWARE)
    workload = cold_resume(8, (20000, 30000), 4, seed=0)
    curve = capacity_curve(presets.SEED_MODEL, hw, PlanConfig("shared-pool", ("host", "pool")), workload,
                           (0.05, 0.5, 1.0))
    points = {p["fraction"]: p for p in curve["points"]}
    assert points[1.0]["relative_hit"] == pytest.approx(1.0)
    assert points[1.0]["ttft_p50_s"] < points[0.05]["ttft_p50_s"]
    # Cold resume in the order the sessions were written is LRU's worst case: each miss rewrites
    # its session and evicts the next one, so half the room keeps almost nothing.
    assert points[0.5]["relative_hit"] < 0.95
    assert curve["bytes_for_95pct"] == points[1.0]["pool_bytes"] == curve["working_set_bytes"]


def test_count_on_disk_counts_chunk_files_only(tmp_path: Path) -> None:
    (tmp_path / "ab" / "cd").mkdir(parents=True)
    (tmp_path / "ab" / "cd" / "k1.kvt").write_bytes(b"x" * 8192)
    (tmp_path / "ab" / "cd" / "k2.kvt.12.ab.tmp").write_bytes(b"x" * 100)
    (tmp_path / ".usage").write_text("{}")
    assert count_on_disk(tmp_path) == {"files": 1, "bytes": 8192, "dirs": 2, "inodes": 3}


def test_plan_json_carries_capacity_and_the_curve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plan.png"
    assert main(["plan", "--preset", "seed", "--concurrency", "8", "--json", "--curve-points", "3",
                 "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    pool = out["capacity"]["8"]["tiers"]["pool"]
    assert {"bytes", "files", "inodes", "budget_bytes", "filesystem_bytes"} <= set(pool)
    assert out["capacity"]["8"]["tiers"]["host"]["host_bytes_per_rank"] > 0
    (curve,) = out["capacity_curves"]
    assert [p["fraction"] for p in curve["points"]] == [0.05, 0.525, 1.0]
    assert curve["bytes_for_95pct"] == pool["bytes"]
    assert png.stat().st_size > 0


def test_the_seed_preset_prints_the_seeds_table_beside_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "seed", "--json", "--curve-points", "0"]) == 0
    cells = {(c["config"], c["concurrency"]): c for c in json.loads(capsys.readouterr().out)["seed_table"]}
    assert set(cells) == {(cfg, c) for cfg in ("shared-pool", "local-disk") for c in (8, 16, 32)} | {("recompute", 16)}
    fitted = {k for k, c in cells.items() if c["fitted"]}
    assert fitted == {("shared-pool", 16), ("recompute", 16)}
    for key in fitted:  # the preset's two fitted figures still reproduce their anchors
        assert abs(cells[key]["ttft_error"]) < 0.05
    assert cells[("shared-pool", 8)]["seed_ttft_p50_s"] == 7.53
    # --sessions changes the workload the seed measured: no side-by-side then.
    assert main(["plan", "--preset", "seed", "--json", "--curve-points", "0", "--sessions", "4"]) == 0
    assert "seed_table" not in json.loads(capsys.readouterr().out)


def test_sessions_returning_in_random_order_keep_a_share_of_the_hits_in_a_smaller_pool() -> None:
    hw = hardware_from_dict(presets.SEED_HARDWARE)
    workload = cold_resume(40, (20000, 30000), 8, seed=0, resume_order="random")
    curve = capacity_curve(presets.SEED_MODEL, hw, PlanConfig("shared-pool", ("host", "pool")), workload,
                           (0.5, 0.9, 1.0))
    hits = [p["relative_hit"] for p in curve["points"]]
    assert 0.0 < hits[0] < hits[1] < hits[2] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="resume_order"):
        cold_resume(4, (1000, 2000), 1, resume_order="lifo")
