"""kvtier.bench.profiles: the floor figures and the resume profile joined into a report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtier.bench import profiles
from kvtier.bench.report import load_run, summarize

ENV = {"model_shape": {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256,
                       "num_attention_heads": 4, "torch_dtype": "bfloat16"},
       "storage_probe": {"best_raw_gbps": 2.0}}


def row(config: str, session: int, ttft: float, phase: str = "resume", prompt: int = 4096) -> dict[str, Any]:
    return {"config": config, "instances": 1, "workload": "cold-resume", "concurrency": 2, "measured": True,
            "start_s": float(session), "phase": phase, "session": session, "turn": 1, "ttft_s": ttft, "e2e_s": ttft,
            "prompt_tokens": prompt, "output_tokens": 4, "cached_tokens": 0, "error": None,
            "request_id": f"kvtb-{session}-1-{session:08x}"}


def write_run(folder: Path) -> None:
    folder.mkdir()
    rows = [row("engine-cache", i, round(0.10 + 0.01 * i, 3)) for i in range(3)]
    rows += [row("shared-pool", i, round(0.20 + 0.01 * i, 3)) for i in range(3)]
    rows += [{**row("shared-pool", 9, 5.0, phase="populate"), "measured": False}]  # never in the figures
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "env.json").write_text(json.dumps(ENV))
    profile = [{"config": "shared-pool", "external_id": f"cmpl-kvtb-{i}-1-{i:08x}-0-3f2a1b0c", "decision": "load",
                "answer_s": 0.01, "alloc_s": 0.0, "queue_s": 0.001, "load_s": round(0.05 + 0.01 * i, 3), "read_s": 0.04,
                "copy_s": 0.01, "report_s": 0.002, "schedule_s": 0.02, "wait_steps": 3, "prefill_s": 0.05,
                "total_s": round(0.15 + 0.01 * i, 3), "tier": "pool"} for i in range(3)]
    profile.append({"config": "recompute", "external_id": "cmpl-kvtb-0-1-00000000-0-aaaa", "total_s": 9.0})
    (folder / "profiles.jsonl").write_text("".join(json.dumps(p) + "\n" for p in profile) + '{"cut')


def test_the_floor_and_floor_plus_bytes_are_in_every_entry(tmp_path: Path) -> None:
    write_run(tmp_path / "run")
    run = load_run(tmp_path / "run")
    assert profiles.bytes_per_token(ENV) == 4 * 2 * 2 * 64 * 2
    entry = next(e for e in summarize(run) if e["config"] == "shared-pool")
    bytes_s = 4096 * 2048 / 2e9  # the median resumed prompt's KV at the probe's best rate
    assert entry["floor_s"] == 0.11 and entry["floor_bytes_s"] == round(bytes_s, 6)
    assert entry["x_floor"] == round(0.21 / 0.11, 4)
    assert entry["x_floor_bytes"] == round(0.21 / (0.11 + round(bytes_s, 6)), 4)


def test_profiles_join_by_the_clients_request_id_and_summarise_medians(tmp_path: Path) -> None:
    write_run(tmp_path / "run")
    run = load_run(tmp_path / "run")
    pool = [r for r in run.records if r["config"] == "shared-pool" and r["phase"] == "resume"]
    assert [r["profile_load_s"] for r in pool] == [0.05, 0.06, 0.07]
    floor = [r for r in run.records if r["config"] == "engine-cache"]
    assert all("profile_total_s" not in r for r in floor)  # another config's profile never joins
    (summary,) = profiles.profile_summary(run.records)
    assert (summary["config"], summary["requests"], summary["loaded"]) == ("shared-pool", 3, 3)
    assert summary["load_s"] == 0.06 and summary["total_s"] == 0.16 and summary["ttft_s"] == 0.21
    assert summary["outside_s"] == 0.05  # the client's TTFT minus the connector's total, per request
    text = "\n".join(profiles.profile_markdown([summary]))
    assert "| shared-pool | 3 (3) |" in text and "60.0" in text


def test_without_a_floor_or_a_probe_the_figures_are_absent_not_invented(tmp_path: Path) -> None:
    write_run(tmp_path / "run")
    (tmp_path / "run" / "env.json").write_text(json.dumps({"model_shape": ENV["model_shape"]}))
    entry = next(e for e in summarize(load_run(tmp_path / "run")) if e["config"] == "shared-pool")
    assert entry["floor_s"] == 0.11 and entry["floor_bytes_s"] is None and entry["x_floor_bytes"] is None
    rows = (tmp_path / "run" / "requests.jsonl").read_text().splitlines()
    (tmp_path / "run" / "requests.jsonl").write_text("\n".join(r for r in rows if "engine-cache" not in r) + "\n")
    entry = next(e for e in summarize(load_run(tmp_path / "run")) if e["config"] == "shared-pool")
    assert "floor_s" not in entry
