"""The suite's vLLM native offloading configurations (``vllm-offload-cpu``, ``vllm-offload-fs``).

No engine is started: the argv the suite would run is checked for the connector and its extra
config, and vLLM's own config classes (when vLLM is installed) build the scheduler side from it,
the part that runs on any platform (vLLM 0.32's offloading worker needs CUDA or XPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.engines import EngineError
from kvtier.bench.report import CONFIG_ORDER
from kvtier.bench.suite import (
    CONFIGS,
    DEFAULT_CONFIGS,
    ENGINES,
    ConfigRunner,
    SuiteSpec,
    failure_text,
    offloading_kv_config,
    presets,
    traceback_cause,
)

OFFLOAD = ("vllm-offload-cpu", "vllm-offload-fs")


def kv_transfer_config(argv: list[str]) -> dict[str, Any]:
    i = argv.index("--kv-transfer-config")
    return json.loads(argv[i + 1])


def runner(tmp_path: Path, config: str) -> ConfigRunner:
    spec = SuiteSpec(tmp_path / "out", model=tmp_path / "model", configs=(config,), host_bytes="1GiB")
    return ConfigRunner(spec, config, tmp_path / "model", max_len=8192)


def test_the_configurations_are_known_to_the_suite_and_the_report_in_the_same_order_and_opt_in() -> None:
    assert CONFIG_ORDER == CONFIGS
    assert tuple(ENGINES) == CONFIGS  # every registered configuration has an engine builder, in order
    assert set(OFFLOAD) <= set(CONFIGS)
    # Opt-in (--configs): the presets run what they ran before.
    assert not set(OFFLOAD) & set(DEFAULT_CONFIGS)
    assert all(not set(OFFLOAD) & set(presets(name, Path("out")).configs) for name in ("quick", "full", "seed"))


def test_the_cpu_tier_runs_vllms_openai_server_with_the_offloading_connector(tmp_path: Path) -> None:
    argv = list(runner(tmp_path, "vllm-offload-cpu").engines[0].argv)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-prefix-caching" in argv
    assert kv_transfer_config(argv) == {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 30,
                                      "block_size": 256}}


def test_the_fs_tier_keeps_its_directory_in_the_work_dir_across_the_restart(tmp_path: Path) -> None:
    r = runner(tmp_path, "vllm-offload-fs")
    kv = kv_transfer_config(list(r.engines[0].argv))
    root = tmp_path / "out" / "work" / "vllm-offload-fs" / "fs"
    assert kv == {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30,
                                      "block_size": 256,
                                      "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}}
    assert root.is_dir()
    # The restart starts the same Process again: the same argv, so the same root_dir.
    assert kv == kv_transfer_config(list(runner(tmp_path, "vllm-offload-fs").engines[0].argv))


def test_an_unknown_offloading_configuration_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a vLLM offloading configuration"):
        offloading_kv_config(SuiteSpec(tmp_path), "vllm-offload-nvme", tmp_path)


def test_a_start_failure_is_recorded_with_the_root_cause_from_the_log(tmp_path: Path) -> None:
    r = runner(tmp_path, "vllm-offload-cpu")
    log = r.engines[0].log
    log.parent.mkdir(parents=True)
    log.write_text("=== 17:08:02 start: python -m vllm...\n"
                   "(Worker pid=1) ERROR [x.py:1] Exception: CPU Offloading is currently only supported on CUDA\n"
                   "(EngineCore pid=2) ERROR [core.py:1] RuntimeError: Worker failed with error 'CPU Offloading "
                   "is currently only supported on CUDA'\n"
                   "RuntimeError: Engine core initialization failed. See root cause above.\n")
    exc = EngineError(f"{r.engines[0].name} exited with status 1 while starting; log {log}:\n(tail)")
    assert failure_text(exc, r) == (f"vllm-offload-cpu engine 0 exited with status 1 while starting: RuntimeError: "
                                    f"Worker failed with error 'CPU Offloading is currently only supported on CUDA'"
                                    f" (log: {log})")
    later = EngineError(f"vllm-offload-cpu engine 0 exited with status 1: RuntimeError: Worker failed with error "
                        f"'CPU Offloading is currently only supported on CUDA' (log: {log})")
    assert failure_text(later, r) == str(later)  # already led by its cause
    assert failure_text(ValueError("bad"), None) == "bad"


def test_an_exception_root_cause_does_not_name_is_taken_from_the_first_traceback(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("=== 17:00:00 start: old\n  File x\nKeyError: old\n=== 17:11:43 start: python -m kvtier ...\n"
                   "Traceback (most recent call last):\n  File \"registry.py\", line 51, in register\n"
                   "    raise DuplicateTimeseries(duplicates)\n"
                   "prometheus_client.registry.DuplicateTimeseries: Duplicated timeseries: {'kvtier_x'}\n"
                   "(Worker pid=3) ERROR 12-01 17:08:45 [multiproc_executor.py:1063]     raise Exception(\n"
                   "(Worker pid=3) ERROR 12-01 17:08:45 [multiproc_executor.py:1063] Exception: later\n")
    assert traceback_cause(log) == "prometheus_client.registry.DuplicateTimeseries: Duplicated timeseries: {'kvtier_x'}"
    log.write_text("=== 17:08:02 start: vllm\nINFO note: not raised\n"
                   "(Worker pid=3) ERROR 12-01 17:08:45 [multiproc_executor.py:1063]     raise Exception(\n"
                   "(Worker pid=3) ERROR 12-01 17:08:45 [multiproc_executor.py:1063] Exception: CPU Offloading\n")
    assert traceback_cause(log) == "Exception: CPU Offloading"
    assert traceback_cause(tmp_path / "missing.log") is None


@pytest.mark.parametrize("config", OFFLOAD)
def test_vllm_builds_the_scheduler_side_from_the_extra_config(tmp_path: Path, config: str) -> None:
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    work = tmp_path / config
    kv = KVTransferConfig(**offloading_kv_config(SuiteSpec(tmp_path, host_bytes="16MiB"), config, work))
    assert kv.kv_connector in KVConnectorFactory._registry
    # One 16-token block of a 2-layer, 2-head, 64-dim bf16 model (K and V); 256-token chunks.
    block_bytes = 16 * 2 * 2 * 2 * 64 * 2
    offloading = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=False,
        extra_config=kv.kv_connector_extra_config, engine_id=f"kvtier-test-{config}-{tmp_path.name}",
        model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=256 // 16),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))
    spec = OffloadingSpecFactory.create_spec(offloading)
    assert type(spec).__name__ == kv.kv_connector_extra_config["spec_name"]
    assert spec.num_chunks == (16 << 20) // (block_bytes * 16)
    manager = spec.get_manager()
    try:
        if config == "vllm-offload-fs":
            assert [t.tier_type for t in manager.secondary_tiers] == ["fs"]
            assert list((work / "fs").glob("*/config.json"))  # the fs tier wrote its run config there
    finally:
        manager.shutdown()


def test_kvtiers_configurations_take_the_suites_chunk_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from kvtier.cli.main import main

    for config in ("local-disk", "shared-pool"):
        spec = SuiteSpec(tmp_path / "out", model=tmp_path / "model", configs=(config,), chunk_tokens=128)
        argv = list(ConfigRunner(spec, config, tmp_path / "model", max_len=8192).engines[0].argv)
        settings = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
        assert settings["chunk_tokens"] == 128
    # Not a multiple of vLLM's smallest block size: refused before any engine starts.
    assert main(["bench", "suite", "--out", str(tmp_path / "o"), "--chunk-tokens", "100"]) != 0
    assert "--chunk-tokens: a positive multiple of 16, got 100" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_storage_budget_is_the_pools_and_each_disks_and_a_bad_one_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import yaml

    from kvtier.cli.main import main

    for config, key in (("local-disk", "disk_bytes"), ("shared-pool", "pool_bytes")):
        spec = SuiteSpec(tmp_path / "out", model=tmp_path / "model", configs=(config,), storage_bytes="96MiB")
        argv = list(ConfigRunner(spec, config, tmp_path / "model", max_len=8192).engines[0].argv)
        settings = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
        assert settings[key] == "96MiB"
        if config == "shared-pool":  # the pool's own budget, which every instance evicts against
            pool = Path(settings["pool_url"].removeprefix("fs://"))
            assert json.loads((pool / ".budget").read_text())["max_bytes"] == 96 << 20
    for bad in ("0", "lots"):
        assert main(["bench", "suite", "--out", str(tmp_path / "o"), "--storage-bytes", bad]) != 0
        assert "storage" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_more_kvtier_settings_reach_its_configurations_and_bad_ones_are_refused_before_any_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from kvtier.bench.configs import CONNECTOR_KEYS, kvtier_setting
    from kvtier.cli.main import main

    assert kvtier_setting("load_mode=sync") == ("load_mode", "sync")
    assert kvtier_setting("io_threads=4") == ("io_threads", 4)
    assert kvtier_setting("fsync=true") == ("fsync", True)
    spec = SuiteSpec(tmp_path / "out", model=tmp_path / "model", configs=("shared-pool",),
                     kvtier_settings=dict([kvtier_setting("load_mode=sync")]))
    argv = list(ConfigRunner(spec, "shared-pool", tmp_path / "model", max_len=8192).engines[0].argv)
    settings = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
    assert settings["load_mode"] == "sync" and settings["pool_url"].startswith("fs://")
    for bad, why in (("load_mode", "expected KEY=VALUE"), ("no_such=1", "unknown kvtier setting 'no_such'"),
                     ("pool_url=fs:///elsewhere", "pool_url is set by the suite itself"),
                     ("chunk_size=128", "use --chunk-tokens"), ("remote_url=fs:///x", "remote_url is set by the suite"),
                     ("max_local_cpu_size=2", "max_local_cpu_size is set by the suite"),
                     ("metrics_file=/tmp/m", "metrics_file is set by the suite"),
                     ("io_threads=[", "not a YAML value")):
        assert main(["bench", "suite", "--out", str(tmp_path / "o"), "--kvtier-setting", bad]) != 0
        assert why in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.config import ConnectorConfig

    assert set(CONNECTOR_KEYS) == set(ConnectorConfig.KEYS) - {"metrics_file", "profile_file", "config",
                                                               "inject_faults"}
