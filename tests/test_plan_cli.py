"""Traces, specs, calibration from a bench folder, and the ``kvtier plan`` command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli.main import main
from kvtier.plan.calibrate import calibrate
from kvtier.plan.spec import ModelSpec, hardware_from_dict
from kvtier.plan.workload import load_trace


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_trace_csv_and_jsonl(tmp_path: Path) -> None:
    csv_trace = write(tmp_path / "t.csv", "session,arrival_s,prompt_tokens,output_tokens\n"
                                          "a,5,2000,10\nb,1,300,5\na,0,1000,10\n")
    sessions = load_trace(csv_trace)
    assert [[(t.session, t.prompt_tokens, t.arrival_s) for t in s] for s in sessions] == \
        [[("a", 1000, 0.0), ("a", 2000, 5.0)], [("b", 300, 1.0)]]
    jsonl = write(tmp_path / "t.jsonl", '{"session": 1, "arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2}\n')
    assert load_trace(jsonl)[0][0].session == "1"


@pytest.mark.parametrize(("text", "match"), [
    ("session,arrival_s,prompt_tokens\na,0,10\n", "lacks"),
    ("session,arrival_s,prompt_tokens,output_tokens\na,soon,10,1\n", r"t.csv:2: .*numbers"),
    ("session,arrival_s,prompt_tokens,output_tokens\na,0,0,1\n", "prompt_tokens >= 1"),
    ("session,arrival_s,prompt_tokens,output_tokens\na,0,900,1\na,1,500,1\n", "shrink"),
    ("session,arrival_s,prompt_tokens,output_tokens\n", "no requests"),
])
def test_trace_errors_name_the_problem(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_trace(write(tmp_path / "t.csv", text))


def test_model_from_hf_config_and_tp(tmp_path: Path) -> None:
    cfg = write(tmp_path / "config.json", json.dumps({"num_hidden_layers": 62, "num_attention_heads": 96,
                                                      "num_key_value_heads": 8, "head_dim": 128,
                                                      "hidden_size": 6144, "torch_dtype": "bfloat16"}))
    m = ModelSpec.from_hf_config(cfg, parallel_size=8)
    assert m.bytes_per_token == 62 * 2 * 8 * 128 * 2
    # 2 KV heads on 8 ranks: each rank holds a replica, so 8 heads' worth of bytes.
    assert ModelSpec(1, 2, 64, "bfloat16", 8).bytes_per_token == 1 * 2 * 8 * 64 * 2


def test_hardware_file_errors() -> None:
    with pytest.raises(ValueError, match="unknown key"):
        hardware_from_dict({"engine": {"prefill_tokens_per_s": 1.0, "decode_step_s": 0.0, "speed": 3}})
    with pytest.raises(ValueError, match="engine"):
        hardware_from_dict({"tiers": {}})
    hw = hardware_from_dict({"engine": {"prefill_tokens_per_s": 1.0, "decode_step_s": 0.0},
                             "tiers": {"disk": {"capacity_bytes": "2TiB", "read_bytes_per_s": 1e9,
                                                "write_bytes_per_s": 1e9}}})
    assert hw.tier("disk").capacity_bytes == 2 << 40


def fake_bench(tmp_path: Path, disk_entry: dict[str, Any] | None = None, settings: dict[str, Any] | None = None,
               *, levels: tuple[int, ...] = (1, 2), lengths: tuple[int, ...] = (500, 1000, 2000, 3000),
               configs: tuple[str, ...] = ("recompute", "local-disk")) -> Path:
    """A bench folder whose recompute TTFT is exactly 0.01 + n / 1000 s and whose ITL is 5 ms;
    ``disk_entry`` is merged into local-disk's configs.json entry, ``settings`` into env's."""
    rows: list[dict[str, Any]] = []
    for i, n in enumerate(lengths):
        for c in levels:
            for phase, turn, prompt in (("populate", 0, n), ("resume", 1, n + 50)):
                common = {"instances": 1, "concurrency": c, "workload": "cold-resume", "phase": phase,
                          "measured": phase == "resume", "session": i + 10 * c, "turn": turn, "start_s": 0.0,
                          "itl_s": 0.005, "e2e_s": 1.0, "prompt_tokens": prompt, "output_tokens": 4,
                          "error": None, "status": 200}
                if "recompute" in configs:
                    rows.append({**common, "config": "recompute", "cached_tokens": 0, "ttft_s": 0.01 + prompt / 1000})
                cached = n // 256 * 256 if phase == "resume" else 0
                ttft = 0.01 + (prompt - cached) / 1000 + cached * 8 / 1e6 + 0.002 if cached else 0.01 + prompt / 1000
                rows.append({**common, "config": "local-disk", "cached_tokens": cached, "ttft_s": ttft})
    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    entries = {"recompute": {"config": "recompute", "status": "ok"},
               "local-disk": {"config": "local-disk", "status": "ok", **(disk_entry or {})}}
    (folder / "configs.json").write_text(json.dumps([entries[c] for c in configs]))
    (folder / "env.json").write_text(json.dumps({
        "model_shape": {"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
                        "head_dim": 1, "torch_dtype": "float32"},
        "settings": {"cold": {"context_tokens": [500, 3000]}, "kv_cache_gib": 1, **(settings or {})},
        "storage_probe": {"kvtier_read_gbps": 0.001, "write_gbps": 0.001}}))
    return folder


def test_calibration_recovers_the_rates(tmp_path: Path) -> None:
    cal = calibrate(fake_bench(tmp_path))
    assert cal.engine.prefill_tokens_per_s == pytest.approx(1000.0, rel=1e-6)
    assert cal.engine.request_overhead_s == pytest.approx(0.01, abs=1e-9)
    assert cal.engine.prefill_quadratic_s == pytest.approx(0.0, abs=1e-12)
    disk = cal.tiers["local-disk"]
    assert disk.read_bytes_per_s == 1e6  # from the probe: this run has no kvtier metrics
    assert disk.latency_s == pytest.approx(0.002, abs=1e-9)


def test_cli_check_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = tmp_path / "check.md"
    assert main(["plan", "--check", str(fake_bench(tmp_path)), "--json", "--markdown", str(md)]) == 0
    out = json.loads(capsys.readouterr().out)
    cells = {(c["config"], c["concurrency"]): c for c in out["cells"]}
    assert cells[("recompute", 1)]["calibration"] is True
    assert set(cells) == {("recompute", 1), ("recompute", 2), ("local-disk", 1), ("local-disk", 2)}
    assert "| cold-resume | local-disk | 2" in md.read_text()


TAILS_RAN = {"kvtier_metrics": {"metrics-0.scheduler.json": {"connector": {"tail_saves": 8}}}}


@pytest.mark.parametrize(("entry", "settings", "cached"), [
    # Prompts of 500, 1000, 2000 and 3000 tokens stored, resumed 50 tokens longer. Whole chunks:
    # 256 + 768 + 1792 + 2816. With tails (steps of 128 tokens on the CPU build's 128-token
    # blocks) each also keeps 128 more: 384 + 896 + 1920 + 2944.
    ({}, {}, 5632),  # a run from before tails (its connector counts no tail saves)
    (TAILS_RAN, {}, 6144),
    (TAILS_RAN, {"kvtier_settings": {"tail_chunks": False}}, 5632),
])
def test_check_predicts_tails_where_the_run_kept_them(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       entry: dict[str, Any], settings: dict[str, Any],
                                                       cached: int) -> None:
    assert main(["plan", "--check", str(fake_bench(tmp_path, entry, settings)), "--json"]) == 0
    cells = {(c["config"], c["concurrency"]): c for c in json.loads(capsys.readouterr().out)["cells"]}
    assert cells[("local-disk", 2)]["predicted_cached"] == cached
    assert cells[("recompute", 2)]["predicted_cached"] == 0


def test_cli_preset_table_json_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plan.png"
    assert main(["plan", "--preset", "seed", "--concurrency", "2,4", "--json", "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    names = {(r["config"], r["concurrency"]) for r in out["rows"]}
    assert ("shared-pool", 4) in names and ("recompute", 2) in names
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["plan", "--preset", "seed", "--concurrency", "2"]) == 0
    assert "TTFT p50" in capsys.readouterr().out


def test_cli_trace_and_model_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write(tmp_path / "t.csv", "session,arrival_s,prompt_tokens,output_tokens\na,0,3000,4\na,5,3100,4\n")
    hw = write(tmp_path / "hw.yaml", "engine: {prefill_tokens_per_s: 1000, decode_step_s: 0.01}\n"
                                     "tiers:\n  disk: {capacity_bytes: 1GiB, read_bytes_per_s: 1e9, "
                                     "write_bytes_per_s: 1e9}\n")
    assert main(["plan", "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--hardware", str(hw),
                 "--trace", str(trace), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["config"] for r in rows] == ["recompute", "local-disk"]
    assert rows[1]["requests"] == 2


def test_cli_errors_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--layers", "4", "--concurrency", "2"]) == 2
    assert "kvtier: error" in capsys.readouterr().err


def test_generated_workloads_and_default_configs() -> None:
    from kvtier.plan.spec import default_configs
    from kvtier.plan.workload import cold_resume

    populate, resume = cold_resume(3, (1000, 1000), 2, turns=3, question_tokens=10, output_tokens=5)
    assert [s[0].prompt_tokens for s in populate.sessions] == [1010, 1010, 1010]
    assert not any(t.measured for s in populate.sessions for t in s)
    assert resume.restart_before and [t.prompt_tokens for t in resume.sessions[0]] == [1025, 1040]
    hw = hardware_from_dict({"engine": {"prefill_tokens_per_s": 1.0, "decode_step_s": 0.0},
                             "tiers": {n: {"capacity_bytes": 1, "read_bytes_per_s": 1, "write_bytes_per_s": 1}
                                       for n in ("host", "disk", "pool")}})
    assert [(c.name, c.tiers, c.instances) for c in default_configs(hw, 4)] == [
        ("recompute", (), 1), ("host-dram", ("host",), 1), ("local-disk", ("host", "disk"), 1),
        ("shared-pool", ("host", "pool"), 1), ("shared-pool-x4", ("host", "pool"), 4)]


def test_a_kv_codec_gives_persistent_tiers_its_capacity_and_its_rates_but_not_host_dram() -> None:
    from kvtier.plan.codecs import FIGURES, apply
    from kvtier.plan.presets import SEED_HARDWARE

    coded = apply(SEED_HARDWARE, "fp8", threads=4)
    fig = FIGURES["fp8"]
    for name in ("disk", "pool"):
        before, after = SEED_HARDWARE["tiers"][name], coded["tiers"][name]
        assert after["capacity_bytes"] == int(before["capacity_bytes"] * fig.ratio)
        read = 1 / (1 / (fig.ratio * before["read_bytes_per_s"]) + 1 / (4 * fig.decode_bytes_per_s))
        assert after["read_bytes_per_s"] == pytest.approx(read)
    assert coded["tiers"]["host"] == SEED_HARDWARE["tiers"]["host"]
    hardware_from_dict(coded)  # still a valid hardware description
    with pytest.raises(ValueError, match="kv-codec"):
        apply(SEED_HARDWARE, "zip")


def test_plan_with_a_codec_reports_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "seed", "--concurrency", "16", "--kv-codec", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_codec"]["name"] == "fp8"
    pool = [r for r in out["rows"] if r["config"] == "shared-pool"]
    assert pool and pool[0]["ttft_p50_s"] > 0
