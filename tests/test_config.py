"""kvtier.config: YAML/dict settings, KVTIER_* overrides, sizes, LMCache aliases, clear errors."""

from __future__ import annotations

import logging

import pytest
import torch

from _pool import new_pool
from kvtier import KVLayout, StoreConfig, TieredStore
from kvtier.config import GiB, load_settings, parse_bytes

BASE = {"model_id": "tiny-llama", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "bfloat16"}
NO_ENV: dict[str, str] = {}


def test_dict_with_flat_layout():
    config = load_settings({**BASE, "chunk_tokens": 16, "host_bytes": "1MiB"}, environ=NO_ENV)
    assert config.layout == KVLayout(2, 2, 8, torch.bfloat16)
    assert (config.model_id, config.chunk_tokens, config.host_bytes) == ("tiny-llama", 16, 1 << 20)
    assert config.chunk_bytes == 16 * 128
    # Everything else keeps its documented default.
    defaults = (config.disk_path, config.pool_url, config.io_threads, config.read_timeout_s)
    assert defaults == (None, None, 8, 10.0)


def test_yaml_file_with_nested_section_and_layout_mapping(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text(
        "kvtier:\n"
        "  model_id: tiny-llama\n"
        "  layout: {num_layers: 4, num_kv_heads: 2, head_dim: 64, dtype: float16}\n"
        "  chunk_tokens: 32\n"
        "  host_bytes: 2GiB\n"
        f"  disk_path: {tmp_path}/disk\n"
        "  disk_bytes: 50GiB\n"
        "  pool_url: fs:///mnt/pool\n"
        "  pool_bytes: 1TiB\n"
        "  fsync: true\n"
    )
    config = load_settings(path, environ=NO_ENV)
    assert config.layout == KVLayout(4, 2, 64, torch.float16)
    assert (config.chunk_tokens, config.host_bytes, config.disk_bytes, config.pool_bytes) == (
        32, 2 * GiB, 50 * GiB, 1 << 40)
    assert (config.disk_path, config.pool_url, config.fsync) == (f"{tmp_path}/disk", "fs:///mnt/pool", True)
    assert load_settings(str(path), environ=NO_ENV) == config


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_settings(path, environ=NO_ENV)


def test_env_overrides_yaml_and_keywords_override_env():
    env = {"KVTIER_CHUNK_TOKENS": "32", "KVTIER_HOST_BYTES": "4GiB", "KVTIER_IO_THREADS": "3",
           "KVTIER_FSYNC": "yes", "KVTIER_READ_TIMEOUT_S": "2.5", "KVTIER_DIRECT_IO": "off",
           "KVTIER_MODEL_ID": "from-env", "PATH": "/usr/bin", "KVTIER_NOT_A_SETTING": "ignored"}
    source = {**BASE, "chunk_tokens": 16, "host_bytes": "1GiB", "io_threads": 8}
    config = load_settings(source, environ=env)
    assert (config.chunk_tokens, config.host_bytes, config.io_threads, config.fsync, config.read_timeout_s,
            config.direct_io, config.model_id) == (32, 4 * GiB, 3, True, 2.5, False, "from-env")
    config = load_settings(source, environ=env, chunk_tokens=64, host_bytes=0)
    assert (config.chunk_tokens, config.host_bytes, config.io_threads) == (64, 0, 3)


def test_env_alone_can_supply_every_setting():
    env = {"KVTIER_MODEL": "m", "KVTIER_NUM_LAYERS": "3", "KVTIER_NUM_KV_HEADS": "1",
           "KVTIER_HEAD_DIM": "16", "KVTIER_DTYPE": "float32", "KVTIER_POOL_URL": "fs:///p",
           "KVTIER_POOL_BYTES": "10GiB", "KVTIER_RANK": "1", "KVTIER_WORLD_SIZE": "2"}
    config = load_settings(None, environ=env)
    assert config.layout == KVLayout(3, 1, 16, torch.float32)
    assert (config.model_id, config.pool_url, config.pool_bytes, config.rank, config.world_size) == (
        "m", "fs:///p", 10 * GiB, 1, 2)


def test_env_none_turns_a_tier_off():
    config = load_settings({**BASE, "pool_url": "fs:///p", "disk_path": "/d"},
                           environ={"KVTIER_POOL_URL": "none", "KVTIER_DISK_PATH": ""})
    assert (config.pool_url, config.disk_path) == (None, None)


@pytest.mark.parametrize(("var", "value"), [("KVTIER_CHUNK_TOKENS", "lots"), ("KVTIER_FSYNC", "maybe"),
                                            ("KVTIER_READ_TIMEOUT_S", "soon"), ("KVTIER_IO_THREADS", "1.5")])
def test_bad_env_values_name_the_variable(var, value):
    with pytest.raises(ValueError, match=var):
        load_settings(BASE, environ={var: value})


@pytest.mark.parametrize(("value", "expected"), [
    (1073741824, GiB), (2.0, 2), ("2GiB", 2 * GiB), ("2G", 2 * GiB), ("2GB", 2 * GiB), ("2gib", 2 * GiB),
    ("512MB", 512 << 20), ("1.5G", 3 * GiB // 2), ("1k", 1024), (" 3 MiB ", 3 << 20), ("1TiB", 1 << 40),
    ("0", 0), ("123", 123),
])
def test_size_strings(value, expected):
    assert parse_bytes(value, "host_bytes") == expected


@pytest.mark.parametrize("value", ["2XB", "-1", "-1GiB", "", "GiB", True, 1.5, None, [1]])
def test_bad_sizes_name_the_setting(value):
    with pytest.raises(ValueError, match=r"^disk_bytes: "):
        parse_bytes(value, "disk_bytes")


def test_lmcache_aliases(tmp_path):
    config = load_settings({
        "model": "tiny-llama", "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "chunk_size": 16, "max_local_cpu_size": 5, "max_local_disk_size": 0.5,
        "local_disk": f"file://{tmp_path}/cache", "remote_url": "fs:///mnt/shared/kvpool",
    }, environ=NO_ENV)
    assert (config.model_id, config.chunk_tokens, config.host_bytes, config.disk_bytes) == (
        "tiny-llama", 16, 5 * GiB, GiB // 2)
    assert (config.disk_path, config.pool_url) == (f"{tmp_path}/cache", "fs:///mnt/shared/kvpool")
    assert config.layout.dtype is torch.bfloat16


def test_lmcache_aliases_from_env():
    config = load_settings(BASE, environ={"KVTIER_CHUNK_SIZE": "32", "KVTIER_MAX_LOCAL_CPU_SIZE": "2.5",
                                          "KVTIER_REMOTE_URL": "fs:///pool"})
    assert (config.chunk_tokens, config.host_bytes, config.pool_url) == (32, int(2.5 * GiB), "fs:///pool")


def test_precedence_holds_whichever_name_each_layer_uses():
    """yaml < env < keywords, even when one layer uses an alias and another the canonical name."""
    env = {"KVTIER_CHUNK_TOKENS": "32", "KVTIER_HOST_BYTES": "2GiB"}
    source = {**BASE, "chunk_size": 16, "max_local_cpu_size": 1}
    config = load_settings(source, environ=env)
    assert (config.chunk_tokens, config.host_bytes) == (32, 2 * GiB)
    config = load_settings(source, environ=env, chunk_size=64, max_local_cpu_size=3)
    assert (config.chunk_tokens, config.host_bytes) == (64, 3 * GiB)
    config = load_settings({**BASE, "chunk_tokens": 16}, environ={"KVTIER_CHUNK_SIZE": "48"})
    assert config.chunk_tokens == 48


@pytest.mark.parametrize("value", ["lots", "5GB", None])
def test_bad_lmcache_gb_size_names_the_setting(value):
    with pytest.raises(ValueError, match="max_local_cpu_size"):
        load_settings({**BASE, "max_local_cpu_size": value}, environ=NO_ENV)


def test_unknown_setting_is_named():
    with pytest.raises(ValueError, match=r"unknown setting.*chunk_tokenz"):
        load_settings({**BASE, "chunk_tokenz": 16}, environ=NO_ENV)


def test_missing_layout_is_named():
    with pytest.raises(ValueError, match="layout: missing num_kv_heads, head_dim"):
        load_settings({"model_id": "m", "num_layers": 2}, environ=NO_ENV)


@pytest.mark.parametrize(("change", "setting"), [
    ({"chunk_tokens": 0}, "chunk_tokens"), ({"model_id": ""}, "model_id"), ({"dtype": "int4"}, "dtype"),
    ({"num_layers": -1}, "num_layers"), ({"pool_url": "s3://x"}, "pool_url"),
    ({"rank": 1}, "rank"), ({"read_timeout_s": -1}, "read_timeout_s"),
    ({"disk_path": "/d", "disk_bytes": "0"}, "disk_bytes"),
])
def test_bad_values_raise_value_error_naming_the_setting(change, setting):
    with pytest.raises(ValueError, match=setting):
        load_settings({**BASE, **change}, environ=NO_ENV)


def test_config_is_frozen():
    config = load_settings(BASE, environ=NO_ENV)
    with pytest.raises(AttributeError):
        config.chunk_tokens = 1  # type: ignore[misc]
    assert isinstance(config, StoreConfig)


def test_from_config_reads_yaml_and_real_environment(tmp_path, monkeypatch):
    path = tmp_path / "kvtier.yaml"
    path.write_text("model_id: tiny-llama\nnum_layers: 2\nnum_kv_heads: 2\nhead_dim: 8\n"
                    f"chunk_tokens: 16\nhost_bytes: 1MiB\ndisk_path: {tmp_path}/disk\n")
    monkeypatch.setenv("KVTIER_CHUNK_SIZE", "32")
    monkeypatch.setenv("KVTIER_REMOTE_URL", new_pool(tmp_path / "pool"))
    monkeypatch.setenv("KVTIER_IO_THREADS", "2")
    with TieredStore.from_config(path, write_queue_chunks=7) as store:
        assert store.chunk_tokens == 32
        assert [t.name for t in store.levels] == ["host", "disk", "pool"]
        assert (store.config.io_threads, store.config.write_queue_chunks) == (2, 7)
        tokens = list(range(64))
        store.put(tokens, torch.zeros(store.layout.shape(64), dtype=torch.bfloat16))
        assert store.lookup(tokens).num_tokens == 64
    assert (tmp_path / "pool" / ".kvtier").is_file()


def test_from_config_dict(monkeypatch):
    monkeypatch.delenv("KVTIER_CHUNK_TOKENS", raising=False)
    with TieredStore.from_config({**BASE, "chunk_tokens": 16, "host_bytes": "1MiB"}) as store:
        assert (store.chunk_tokens, [t.name for t in store.levels]) == (16, ["host"])


def test_yaml_values_expand_environment_variables(tmp_path):
    from kvtier.config import read_settings_file

    path = tmp_path / "kvtier.yaml"
    path.write_text("pool_url: rediss://kvtier:${REDIS_PASSWORD}@cache:6380/0\n"
                    "tenant_salt: ${SALT:-fallback}\nredis_options: {ssl_ca_certs: '${CA}'}\n")
    got = read_settings_file(path, {"REDIS_PASSWORD": "hunter2", "CA": "/ca.pem"})
    assert got == {"pool_url": "rediss://kvtier:hunter2@cache:6380/0", "tenant_salt": "fallback",
                   "redis_options": {"ssl_ca_certs": "/ca.pem"}}
    with pytest.raises(ValueError, match="REDIS_PASSWORD is not set") as err:
        read_settings_file(path, {})
    assert "hunter2" not in str(err.value)


def test_a_misspelled_kvtier_variable_is_warned_about_once_with_the_setting_it_resembles(caplog):
    """6f37bba ignored KVTIER_HOST_BYTE without a word."""
    base = {"model_id": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
    env = {"KVTIER_HOST_BYTE": "1GiB", "KVTIER_REQUIRE_VLLM": "1", "KVTIER_LOAD_POLICY": "always"}
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        load_settings(base, environ=env)
        load_settings(base, environ=env)
    warned = [r.getMessage() for r in caplog.records if "not a kvtier setting" in r.getMessage()]
    assert len(warned) == 1 and "KVTIER_HOST_BYTE " in warned[0] and "KVTIER_HOST_BYTES?" in warned[0]


@pytest.mark.parametrize("value", ["0.5", "1.5", ".25"])
def test_a_fractional_size_without_a_unit_is_refused_not_rounded_to_zero(value):
    with pytest.raises(ValueError, match="no unit"):
        parse_bytes(value, "host_bytes")
    assert parse_bytes(f"{value}GiB", "host_bytes") == int(float(value) * GiB)


def test_connector_settings_are_read_from_the_environment_between_the_file_and_the_extra_config(
        tmp_path, monkeypatch):
    from kvtier.integrations.vllm.config import ConnectorConfig

    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text("load_policy: never\nretain_s: 10\nread_gbps: 1.5\n")
    monkeypatch.setenv("KVTIER_LOAD_POLICY", "always")
    monkeypatch.setenv("KVTIER_SAVE_DECODE", "off")
    monkeypatch.setenv("KVTIER_READ_GBPS", "2.5")
    connector, _ = ConnectorConfig.split({"config": str(cfg), "read_gbps": 4.0})
    assert (connector.load_policy, connector.save_decode, connector.retain_s, connector.read_gbps) == (
        "always", False, 10, 4.0)
    monkeypatch.setenv("KVTIER_EVENTS_MAX_CHUNKS", "many")
    with pytest.raises(ValueError, match="KVTIER_EVENTS_MAX_CHUNKS: expected int"):
        ConnectorConfig.split({})
