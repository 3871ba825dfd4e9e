"""``kvtier bench suite`` end to end with real vLLM OpenAI servers (CPU build) on loopback.

Small on purpose (two configurations, one concurrency level, 1.5k-2.5k-token contexts): it
checks that the suite starts ``kvtier serve`` and plain vLLM, that a resumed session in the
restarted kvtier server is served from the pool (the server's own ``cached_tokens`` say so)
while recompute has nothing, that a configuration that cannot start is recorded as failed
with its error, and that the result folder holds what the issue names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine  # starts vLLM engines: left out of the fast loop (-m "not engine")

if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.bench.model import make_model
    from kvtier.bench.suite import SuiteSpec, run_suite
    from kvtier.bench.workload import WorkloadSpec

    root = tmp_path_factory.mktemp("suite")
    make_model(root / "model")
    spec = SuiteSpec(root / "out", model=root / "model",
                     configs=("engine-cache", "recompute", "shared-pool", "lmcache"),
                     concurrency=(2,), cold=WorkloadSpec("cold-resume", 2, (1536, 2560), 2, 16, 4),
                     sessions_per_concurrency=2,
                     extra=(WorkloadSpec("short-chat", 2, (64, 128), 1, 8, 4),), lmcache_python=str(root / "none"),
                     probe_total="32MiB", kv_cache_gib=1, floor_kv_cache_gib=1)
    run_suite(spec)
    return spec.out


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


def test_resumed_sessions_hit_the_pool_only_with_kvtier(suite_run: Path) -> None:
    resumed = {(r["config"]): [] for r in rows(suite_run)}
    for r in rows(suite_run):
        assert r["error"] is None, r
        if r["phase"] == "resume":
            resumed[r["config"]].append(r)
    assert len(resumed["recompute"]) == len(resumed["shared-pool"]) == 4
    # After the restart, vLLM's own cache is empty: recompute has nothing cached...
    assert all(r["cached_tokens"] == 0 for r in resumed["recompute"])
    # ...while kvtier restores most of each prompt from the pool (whole 256-token chunks).
    for r in resumed["shared-pool"]:
        assert r["cached_tokens"] >= r["prompt_tokens"] - 2 * 256 > 0, r
    metrics = json.loads((suite_run / "configs.json").read_text())[2]["kvtier_metrics"]
    assert any(m.get("tiers", {}).get("pool", {}).get("bytes_read", 0) > 0 for m in metrics.values())


def test_a_configuration_that_cannot_start_is_recorded_not_dropped(suite_run: Path) -> None:
    configs = {c["config"]: c for c in json.loads((suite_run / "configs.json").read_text())}
    assert configs["recompute"]["status"] == configs["shared-pool"]["status"] == "ok"
    assert configs["lmcache"]["status"] == "failed" and "LMCache's venv" in configs["lmcache"]["error"]
    summary = json.loads((suite_run / "summary.json").read_text())
    failed = [r for r in summary["runs"] if r["config"] == "lmcache"]
    assert failed and all(r["status"] == "failed" for r in failed)
    assert "lmcache" in (suite_run / "summary.md").read_text()


def test_the_result_folder_has_the_contract_files(suite_run: Path) -> None:
    for name in ("requests.jsonl", "requests.csv", "configs.json", "env.json", "summary.json", "summary.md",
                 "ttft_vs_concurrency.png", "ttft_cdf.png", "throughput.png"):
        assert (suite_run / name).exists(), name
    summary = json.loads((suite_run / "summary.json").read_text())
    runs = {(r["config"], r["workload"]): r for r in summary["runs"]}
    for key in ("config", "concurrency", "ttft_p50_s", "ttft_p90_s", "output_tok_s", "requests", "errors",
                "cached_tokens"):
        assert key in runs[("shared-pool", "cold-resume")]
    assert runs[("shared-pool", "cold-resume")]["requests"] == 4
    assert runs[("recompute", "short-chat")]["requests"] == 4
    env = summary["env"]
    assert env["vllm"] and env["model_shape"]["num_hidden_layers"] == 4


def test_the_floor_is_vllms_own_cache_and_every_ttft_is_reported_against_it(suite_run: Path) -> None:
    floor = [r for r in rows(suite_run) if r["config"] == "engine-cache" and r["phase"] == "resume"]
    assert len(floor) == 4  # never restarted: each resume is a hit in vLLM's own prefix cache
    # Whole 128-token blocks of the previous turn (its prompt and answer): all but the last ones.
    assert all(r["cached_tokens"] >= r["prompt_tokens"] - 2 * 256 > 0 for r in floor), \
        [(r["prompt_tokens"], r["cached_tokens"]) for r in floor]
    summary = json.loads((suite_run / "summary.json").read_text())
    pool = next(r for r in summary["runs"] if (r["config"], r["workload"]) == ("shared-pool", "cold-resume"))
    floor_p50 = next(r["ttft_p50_s"] for r in summary["runs"]
                     if (r["config"], r["workload"]) == ("engine-cache", "cold-resume"))
    assert pool["floor_s"] == floor_p50 and pool["floor_bytes_s"] > 0
    assert pool["x_floor"] == round(pool["ttft_p50_s"] / floor_p50, 4)
    assert pool["x_floor_bytes"] == round(pool["ttft_p50_s"] / (floor_p50 + pool["floor_bytes_s"]), 4)
    assert "x of floor + bytes" in (suite_run / "summary.md").read_text()


def test_each_resumed_request_has_its_profile_joined_and_summarised(suite_run: Path) -> None:
    from kvtier.bench.report import load_run

    resumed = [r for r in load_run(suite_run).records if r["config"] == "shared-pool" and r["phase"] == "resume"]
    assert len(resumed) == 4
    for r in resumed:
        assert r["profile_decision"] == "load" and r["profile_load_s"] > 0, r
        assert r["profile_total_s"] <= r["ttft_s"], r  # the connector sees part of the client's time
    (profile,) = [p for p in json.loads((suite_run / "summary.json").read_text())["profile"]
                  if p["config"] == "shared-pool"]
    assert profile["requests"] == profile["loaded"] == 4 and profile["read_s"] > 0
    assert "Resume profile" in (suite_run / "summary.md").read_text()
    assert "profile_load_s" in (suite_run / "requests.csv").read_text().splitlines()[0]


def test_the_planner_counts_the_storage_the_run_left_on_disk(suite_run: Path) -> None:
    """``kvtier plan --check --json``'s capacity for the pool, from the requests the run
    recorded, brackets what the run's pool holds (files and bytes counted on disk): the lower
    bound where every answer re-tokenized to the tokens generated, the upper where none did."""
    from kvtier.cli.main import main

    out_file = suite_run / "plan-check.json"
    with open(out_file, "w") as fh:
        import contextlib

        with contextlib.redirect_stdout(fh):
            assert main(["plan", "--check", str(suite_run), "--json"]) == 0
    capacity = json.loads(out_file.read_text())["capacity"]["shared-pool"]
    predicted, on_disk = capacity["predicted"], capacity["on_disk"]
    assert on_disk["files"] > 0
    assert predicted["files_low"] <= on_disk["files"] <= predicted["files"]
    assert predicted["bytes_low"] <= on_disk["bytes"] <= predicted["bytes"]
    assert predicted["files"] <= 1.1 * predicted["files_low"]
    assert predicted["inodes"] == pytest.approx(on_disk["inodes"], rel=0.1)
