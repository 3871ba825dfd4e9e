"""Calibration from any bench folder: no concurrency-1 level, prompts too alike to fit every
term, no recompute configuration. It never stops for want of a term, names what it could not
determine, and reports the rate's uncertainty."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.test_plan_cli import fake_bench

from kvtier.cli.main import main
from kvtier.plan.calibrate import calibrate, load_mode
from kvtier.plan.enginefit import shared_rate
from kvtier.plan.replay import fit_scalar, median_band


def test_without_a_concurrency_1_level_it_calibrates_on_the_lowest_by_replay(tmp_path: Path) -> None:
    cal = calibrate(fake_bench(tmp_path, levels=(4, 8)))
    engine_fit = cal.fit["engine"]
    assert cal.concurrency == 4
    assert engine_fit["method"] == "replay through the simulator"
    lo, hi = engine_fit["prefill_tokens_per_s_range"]
    assert lo <= cal.engine.prefill_tokens_per_s <= hi
    # At concurrency 4 each TTFT holds the wait behind the others: the replay credits the engine
    # with more than the 1000 tokens/s a single request's TTFT shows.
    assert cal.engine.prefill_tokens_per_s > 1000
    assert any("prefill_quadratic_s" in n for n in cal.notes)
    assert cal.fit["tiers"]["local-disk"]["method"] == "replay through the simulator"


def test_a_level_that_is_not_in_the_run_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no measured request at concurrency 3; the run has 1, 2"):
        calibrate(fake_bench(tmp_path), concurrency=3)


def test_prompts_too_alike_for_a_slope_fit_the_rate_alone_and_say_so(tmp_path: Path) -> None:
    cal = calibrate(fake_bench(tmp_path, lengths=(2000, 2010, 2020, 2030)))
    assert cal.engine.prefill_quadratic_s == 0.0
    assert cal.engine.request_overhead_s == pytest.approx(0.02)  # the stated default: no floor in this run
    assert any("request_overhead_s" in n and "default" in n for n in cal.notes)
    # TTFT = 0.01 + n/1000 read through a 0.02 s overhead: about 1005 tokens/s.
    assert cal.engine.prefill_tokens_per_s == pytest.approx(1005, rel=0.01)


def test_without_recompute_the_populate_turns_fit_the_engine(tmp_path: Path) -> None:
    cal = calibrate(fake_bench(tmp_path, configs=("local-disk",)))
    assert cal.fit["engine"]["source"] == "populate turns"
    assert cal.engine.prefill_tokens_per_s == pytest.approx(1000, rel=1e-6)


def test_check_json_carries_the_summary_and_p90(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--check", str(fake_bench(tmp_path, levels=(2, 4))), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calibration"]["calibrated_on_concurrency"] == 2
    assert out["summary"]["held_out"] == 2
    assert all(c["predicted_p90_s"] >= c["predicted_p50_s"] for c in out["cells"])


def test_bisection_and_the_median_band() -> None:
    x, inside = fit_scalar(lambda v: v * v, 9.0, 0.1, 100.0, increasing=True)
    assert inside and x == pytest.approx(3.0, rel=1e-4)
    assert fit_scalar(lambda v: v, 500.0, 1.0, 10.0, increasing=True) == (10.0, False)
    lo, hi = median_band([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    assert 2.0 <= lo <= 4.0 <= hi <= 6.0


def test_the_floor_tells_the_front_ends_per_token_cost_from_the_prefill(tmp_path: Path) -> None:
    folder = fake_bench(tmp_path)
    rows = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    # The floor's resumes: the whole prompt but 50 tokens in the engine's cache; their TTFT is
    # the overhead, 0.1 ms per prompt token in the front end, and the 50 tokens' prefill.
    floor = [{**r, "config": "engine-cache", "cached_tokens": r["prompt_tokens"] - 50,
              "ttft_s": 0.01 + 1e-4 * r["prompt_tokens"] + 50 / 1000}
             for r in rows if r["config"] == "recompute" and r["measured"]]
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + floor))
    cal = calibrate(folder)
    assert cal.engine.frontend_per_token_s == pytest.approx(1e-4, rel=1e-6)
    # Recompute's 1 ms per token was tokenizing (0.1 ms) and prefilling (0.9 ms).
    assert cal.engine.prefill_tokens_per_s == pytest.approx(1 / 9e-4, rel=1e-6)
    assert cal.engine.request_overhead_s == pytest.approx(0.01, abs=1e-9)


def test_a_tier_faster_than_its_measured_rate_gets_the_rate_its_resumes_show(tmp_path: Path) -> None:
    folder = fake_bench(tmp_path)
    env = json.loads((folder / "env.json").read_text())
    env["storage_probe"]["kvtier_read_gbps"] = 0.0005  # half what the resumes read at (1 MB/s)
    (folder / "env.json").write_text(json.dumps(env))
    cal = calibrate(folder)
    disk = cal.tiers["local-disk"]
    assert disk.latency_s == 0.0
    # The resumes read 8 bytes per cached token at 1 MB/s plus 2 ms: a bit under 1 MB/s in all.
    assert 0.8e6 < disk.read_bytes_per_s < 1e6
    assert any(n.startswith("local-disk: read faster") for n in cal.notes)


def test_resumes_faster_than_the_engine_alone_keep_the_measured_rate(tmp_path: Path) -> None:
    # Every local-disk resume took 1 ms: less than the engine's own figures (its overhead, the
    # suffix's prefill) allow. No read rate explains that; a median over the few resumes that
    # leave time would have picked a rate slower than the one measured.
    folder = fake_bench(tmp_path)
    rows = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    rows = [{**r, "ttft_s": 0.001} if r["config"] == "local-disk" and r.get("cached_tokens") else r for r in rows]
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cal = calibrate(folder)
    disk = cal.tiers["local-disk"]
    assert disk.latency_s == 0.0
    assert disk.read_bytes_per_s == pytest.approx(1e6)  # the probe's kvtier read figure (1 MB/s), kept
    assert any(n.startswith("local-disk: its resumes are faster than the engine") for n in cal.notes)


def test_the_front_end_shares_the_cores_of_a_cpu_engine_that_takes_them_all(tmp_path: Path) -> None:
    cpu = {"torch": "2.13.0+cpu", "cores": 2}
    # Two engine threads and the front end's on two cores: each gets two thirds of one.
    assert shared_rate({**cpu, "reserved_cpus": 0}) == (pytest.approx(2 / 3), None)
    assert shared_rate({**cpu, "cores": 32, "reserved_cpus": 0})[0] == pytest.approx(32 / 33)
    # A core reserved: the front end runs beside the engine's one thread.
    assert shared_rate({**cpu, "reserved_cpus": 1}) == (1.0, None)
    # vLLM reserves nothing when the reservation would take every core.
    assert shared_rate({**cpu, "reserved_cpus": 2})[0] == pytest.approx(2 / 3)
    rate, note = shared_rate(cpu)  # a run from before the suite recorded it: the suite's default, said so
    assert rate == pytest.approx(2 / 3) and note is not None and "reserved_cpus" in note
    assert shared_rate({"torch": "2.9.0+cu128", "cores": 2}) == (1.0, None)  # a GPU engine
    folder = fake_bench(tmp_path)
    env = json.loads((folder / "env.json").read_text())
    (folder / "env.json").write_text(json.dumps({**env, **cpu, "reserved_cpus": 0}))
    cal = calibrate(folder)
    assert cal.engine.shared_rate == pytest.approx(2 / 3)
    assert cal.fit["engine"]["shared_rate"] == pytest.approx(2 / 3)


def test_each_configuration_loads_as_its_connector_did() -> None:
    # kvtier's connector by its load_mode (auto unless the run set it), every other connector in
    # the step: what the simulator replays each configuration with.
    default = {"settings": {"kvtier_settings": {}}}
    synced = {"settings": {"kvtier_settings": {"load_mode": "sync"}}}
    assert load_mode("local-disk", default) == "auto"
    assert load_mode("shared-pool", {}) == "auto"
    assert load_mode("shared-pool", synced) == "sync"
    assert load_mode("example-connector", default) == "sync"
    # A run folder is only as trustworthy as whoever wrote it: an unknown value is the default.
    for hostile in ("later", None, ["sync"], {"mode": "sync"}, 1):
        assert load_mode("local-disk", {"settings": {"kvtier_settings": {"load_mode": hostile}}}) == "auto"
    assert load_mode("local-disk", {"settings": {"kvtier_settings": None}}) == "auto"
