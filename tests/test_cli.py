"""The `kvtier` command: probe, pool stats / verify / gc, demo's round trip; --json contracts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _pool import new_pool
from kvtier.bench.demo import round_trip
from kvtier.cli.main import main

PROBE_KEYS = {"file_bytes", "serial_gbps", "parallel_gbps", "best_raw_gbps", "kvtier_read_gbps"}
TINY_PROBE = ["--total", "4MiB", "--repeats", "1", "--threads", "2", "--layers", "2", "--kv-heads", "2",
              "--head-dim", "8", "--chunk-tokens", "16", "--session-chunks", "4"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def fill_pool(make_store: Any, tiny: Any, pool: Path, sessions: int = 3, chunks: int = 4) -> None:
    store = make_store(host_bytes=0, pool_url=new_pool(pool))
    for s in range(sessions):
        store.put(tiny.tokens(chunks * tiny.chunk_tokens, seed=s), tiny.kv(chunks * tiny.chunk_tokens, seed=s))
    store.close()


def test_probe_json_has_the_contract_keys_and_cleans_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_json(capsys, "probe", str(tmp_path), *TINY_PROBE)
    assert code == 0
    assert PROBE_KEYS <= out.keys()
    assert out["file_bytes"] == 4096 + 4096  # header page + 2048 B payload padded to 4096
    assert out["files"] * out["file_bytes"] == out["total_bytes"]
    assert all(out[k] > 0 for k in PROBE_KEYS - {"file_bytes"})
    assert out["best_raw_gbps"] == max(v for k, v in out.items() if k in {
        "serial_gbps", "parallel_gbps", "direct_serial_gbps", "direct_parallel_gbps"} and v is not None)
    assert list(tmp_path.iterdir()) == []  # scratch directory removed


def test_probe_of_a_missing_parent_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, out = run_json(capsys, "probe", str(blocker / "sub"), *TINY_PROBE)
    assert code == 2
    assert "error" in out


def test_pool_stats_counts_chunks_bytes_and_names_the_model(
        tmp_path: Path, make_store: Any, tiny: Any, capsys: pytest.CaptureFixture[str]) -> None:
    fill_pool(make_store, tiny, tmp_path / "pool")
    code, out = run_json(capsys, "pool", "stats", str(tmp_path / "pool"))
    assert code == 0
    assert out["chunks"] == 12
    assert out["bytes"] == 12 * tiny.file_bytes
    assert out["temp_files"] == 0
    (ns,) = out["namespaces"].values()
    assert ns["chunks"] == 12 and ns["model_id"] == tiny.model_id and ns["chunk_tokens"] == tiny.chunk_tokens


def test_pool_verify_finds_and_fixes_exactly_the_bad_chunks(
        tmp_path: Path, make_store: Any, tiny: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pool = tmp_path / "pool"
    fill_pool(make_store, tiny, pool)
    files = sorted(pool.glob("??/??/*.kvt"))
    flipped, truncated, swapped = files[0], files[1], files[2]
    data = bytearray(flipped.read_bytes())
    data[5000] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:100])
    swapped.write_bytes(files[3].read_bytes())  # a valid chunk under another chunk's name
    code, out = run_json(capsys, "pool", "verify", str(pool))
    assert code == 1
    assert out["checked"] == 12 and out["ok"] == 9
    assert {(Path(b["path"]).name, b["fault"]) for b in out["bad"]} == {
        (flipped.name, "payload_checksum"), (truncated.name, "truncated"), (swapped.name, "identity")}
    code, out = run_json(capsys, "pool", "verify", "--fix", str(pool))
    assert code == 0 and out["removed"] == 3
    code, out = run_json(capsys, "pool", "verify", str(pool))
    assert code == 0 and out["checked"] == 9 and out["bad"] == []


def test_pool_gc_evicts_oldest_down_to_budget_and_stale_temps(
        tmp_path: Path, make_store: Any, tiny: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pool = tmp_path / "pool"
    fill_pool(make_store, tiny, pool)
    files = sorted(pool.glob("??/??/*.kvt"))
    for age, f in enumerate(files):
        os.utime(f, (1_000_000 + age, 1_000_000 + age))  # files[0] oldest
    stale = files[0].with_name(files[0].name + ".123.abc.tmp")
    stale.write_bytes(b"partial")
    os.utime(stale, (1, 1))
    fresh = files[1].with_name(files[1].name + ".124.abd.tmp")
    fresh.write_bytes(b"in progress")
    code, out = run_json(capsys, "pool", "gc", str(pool), "--max-bytes", str(5 * tiny.file_bytes))
    assert code == 0
    assert out["evicted_chunks"] == 7 and out["bytes_after"] == 5 * tiny.file_bytes
    assert out["removed_temp_files"] == 1
    assert sorted(pool.glob("??/??/*.kvt")) == sorted(files[7:])
    assert fresh.exists() and not stale.exists()


def test_pool_commands_refuse_a_directory_that_is_not_a_pool(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for action in (["stats"], ["verify"], ["gc", "--max-bytes", "1GiB"]):
        code, out = run_json(capsys, "pool", action[0], str(tmp_path), *action[1:])
        assert code == 2
        assert "not a kvtier pool" in out["error"]


def test_demo_round_trip_reads_back_identical_kv_from_the_pool(tmp_path: Path) -> None:
    trip = round_trip(tmp_path)
    assert trip["identical"] is True
    assert trip["hit_tokens"] == trip["sessions"] * 4096
    assert trip["hit_tokens_by_tier"] == {"pool": trip["sessions"] * 4096}
    assert trip["second_lookup_tiers"] == {"host": 4096}
    assert trip["pool_corrupt_chunks"] == 0


def test_help_lists_every_command() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("probe", "pool", "demo"):
        assert command in out


def test_serve_builds_vllms_server_command_from_a_kvtier_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"pool_url: {new_pool(tmp_path / 'pool')}\nhost_bytes: 2GiB\n")
    assert main(["serve", "--config", str(cfg), "--print-command", "--", "--model", "/m", "--port", "8001"]) == 0
    cmd = json.loads(capsys.readouterr().out)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[3:9] == ["--model", "/m", "--port", "8001", "--shutdown-timeout", "30"]
    assert cmd[9] == "--kv-transfer-config"
    ktc = json.loads(cmd[10])
    assert ktc["kv_connector"] == "KVTierConnector" and ktc["kv_connector_module_path"] == "kvtier.integrations.vllm"
    assert ktc["kv_load_failure_policy"] == "recompute"
    # The file's path only: its settings (secrets among them) never reach a command line.
    assert ktc["kv_connector_extra_config"] == {"config": str(cfg)}


def test_serve_refuses_an_untested_vllm_before_starting_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import serve_cmd

    monkeypatch.setattr(serve_cmd, "installed_vllm", lambda: "0.35.1")
    monkeypatch.setattr(serve_cmd.os, "execve", lambda *a: pytest.fail("vLLM was started"))
    assert main(["serve", "--", "--model", "/m"]) == 2
    assert "tested with vLLM 0.32.x, 0.33.x, 0.34.x; this is vLLM 0.35.1" in capsys.readouterr().err
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text("allow_untested_vllm: true\n")
    serve_cmd.check_vllm(str(cfg))  # allowed: no error
    monkeypatch.setattr(serve_cmd, "installed_vllm", lambda: "0.34.0")
    serve_cmd.check_vllm(None)


@pytest.mark.parametrize(("args", "machine", "reserved"), [
    (["--model", "/m"], "x86_64", 1),
    (["--model", "/m", "-tp", "2"], "x86_64", 2),
    (["--tensor-parallel-size=4", "--pipeline-parallel-size", "2"], "aarch64", 8),
    (["-tp=2", "--port", "8000"], "x86_64", 2),
    (["-tp", "2"], "ppc64le", 1),  # vLLM reserves one core in all on other architectures
    (["-tp", "two"], "x86_64", None),  # vLLM reports the bad argument itself
    (["-tp", "0"], "x86_64", None),
])
def test_serve_reserves_the_cores_plain_vllm_would(args: list[str], machine: str, reserved: int | None) -> None:
    from kvtier.cli import serve_cmd

    assert serve_cmd.reserved_cpus(args, machine) == reserved


def test_serve_starts_vllm_with_plain_vllms_core_reservation_unless_one_is_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.cli import serve_cmd

    started: list[dict[str, str]] = []
    monkeypatch.setattr(serve_cmd, "check_vllm", lambda config: None)
    monkeypatch.setattr(serve_cmd.os, "execve", lambda path, argv, env: started.append(env))
    monkeypatch.setattr(serve_cmd.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(serve_cmd.RESERVED_CPU_ENV, raising=False)
    main(["serve", "--", "--model", "/m", "-tp", "2"])
    assert started[-1][serve_cmd.RESERVED_CPU_ENV] == "2"
    monkeypatch.setenv(serve_cmd.RESERVED_CPU_ENV, "0")  # the operator's choice stands
    main(["serve", "--", "--model", "/m", "-tp", "2"])
    assert started[-1][serve_cmd.RESERVED_CPU_ENV] == "0"


def test_serve_refuses_a_second_kv_transfer_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--print-command", "--", "--kv-transfer-config", "{}"]) == 2
    assert "set by kvtier serve" in capsys.readouterr().err


def test_bench_is_rewritten_only_as_the_command_not_inside_other_arguments():
    from kvtier.cli.main import with_default_action as normalize

    assert normalize(["bench", "--preset", "quick"]) == ["bench", "run", "--preset", "quick"]
    assert normalize(["-v", "bench", "--url", "u"]) == ["-v", "bench", "run", "--url", "u"]
    assert normalize(["bench", "suite", "--out", "x"]) == ["bench", "suite", "--out", "x"]
    # The suite starts `kvtier serve -- ... --served-model-name bench`: an engine's argument.
    serve = ["serve", "--config", "c.yaml", "--", "--served-model-name", "bench", "--port", "8000"]
    assert normalize(serve) == serve


@pytest.mark.parametrize(("text", "says"), [
    ("pool_url: fs:///{rel}/not-mounted\n", "kvtier pool init"),
    ("pool_url: fs://{rel}/pool\n", "absolute path"),  # one slash short
    ("pool_url: nfs://server/export\n", "not supported"),
    ("host_bytes: -1GiB\n", "host_bytes"),
    ("host_bytes: '0.5'\n", "no unit"),  # was 0 bytes: the host cache silently off
    ("pool_bytes: 1GiB\nhost_byte: 2GiB\n", "unknown setting(s) host_byte"),
    ("load_policy: sometimes\n", "load_policy"),
    ("pool_url: [unclosed\n", "not valid YAML at line"),
])
def test_serve_refuses_a_config_the_connector_would_not_run_before_vllm_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, says: str) -> None:
    """6f37bba started vLLM with each of these (a YAML error was a traceback, even with --json)."""
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(text.replace("{rel}", str(tmp_path).lstrip("/")))
    assert main(["serve", "--config", str(cfg), "--print-command", "--", "--model", "/m"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def test_version_is_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"kvtier {__version__}"
