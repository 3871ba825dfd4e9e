"""The connector's configuration checks and scheduler logic, without an engine (fast loop).

vLLM's own config types (KV cache specs and groups) are real; requests and scheduler outputs
are small stand-ins with the attributes the connector reads. Real engines: tests/integration.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from _pool import new_pool
from kvtier.config import StoreConfig
from kvtier.integrations.vllm.common import KVTierWorkerMeta, SyncLoad
from kvtier.integrations.vllm.config import (
    ConnectorConfig,
    Sharding,
    UnsupportedDeployment,
    deployment,
    store_config,
)
from kvtier.integrations.vllm.scheduler import SchedulerRole
from kvtier.integrations.vllm.views import request_extra
from kvtier.keys import ChunkId, shard_id, tail_id

BS, CHUNK, HEADS, HEAD = 16, 32, 2, 8


def full_spec(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16, **kw)


def kv_config(*specs: Any, layers: int = 2) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"g{g}.l{i}" for i in range(layers)], s) for g, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups, kv_cache_layout="LBHNC")


def vllm_config(tp: int = 1, pp: int = 1, policy: str = "recompute", extra: dict[str, Any] | None = None) -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy, kv_connector_extra_config=extra or {}),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        decode_context_parallel_size=1, rank=0),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout=None, block_size=BS),
        device_config=SimpleNamespace(device_type="cuda"), attention_config=None,
        model_config=SimpleNamespace(model="tiny", get_total_num_kv_heads=lambda: HEADS * tp),
        load_config=SimpleNamespace(load_format="dummy", download_dir=None))  # random weights: no files to identify


# ---------------------------------------------------------------- configuration


def test_a_bad_connector_setting_names_itself() -> None:
    with pytest.raises(ValueError, match="read_gbps: expected a number, got 'fast'"):
        ConnectorConfig.split({"read_gbps": "fast"})
    with pytest.raises(ValueError, match="load_policy: 'sometimes'"):
        ConnectorConfig.split({"load_policy": "sometimes"})
    with pytest.raises(ValueError, match="min_load_tokens"):
        ConnectorConfig.split({"min_load_tokens": -1})
    with pytest.raises(ValueError, match="load_coalesce_ms: at most 1000"):
        ConnectorConfig.split({"load_coalesce_ms": 60_000})  # it would hold up every step for a minute
    with pytest.raises(ValueError, match="load_coalesce_ms: must be >= 0"):
        ConnectorConfig.split({"load_coalesce_ms": -1})
    cfg, rest = ConnectorConfig.split({"read_gbps": "2.5", "pool_url": "fs:///p", "prefill_tokens_per_s": 0})
    assert cfg.read_gbps == 2.5 and cfg.prefill_tokens_per_s is None and rest == {"pool_url": "fs:///p"}


def test_vllms_default_fail_policy_is_refused_with_the_fix() -> None:
    with pytest.raises(UnsupportedDeployment, match='"kv_load_failure_policy": "recompute"'):
        deployment(vllm_config(policy="fail"), kv_config(full_spec()))


@pytest.mark.parametrize("config, match", [
    (lambda: kv_config(full_spec(), SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                                                      dtype=torch.bfloat16, sliding_window=64)),
     "one KV cache group; this model has 2"),
    (lambda: kv_config(SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                                         dtype=torch.bfloat16, sliding_window=64)), "SlidingWindowSpec"),
])
def test_hybrid_and_windowed_models_are_refused_at_start(config: Any, match: str) -> None:
    with pytest.raises(UnsupportedDeployment, match=match):
        deployment(vllm_config(), config())


def test_pipeline_parallel_is_refused() -> None:
    with pytest.raises(UnsupportedDeployment, match="pipeline_parallel_size"):
        deployment(vllm_config(pp=2), kv_config(full_spec()))


def test_deployment_names_layout_page_and_backend_and_sizes_chunks_in_page_bytes() -> None:
    dep = deployment(vllm_config(tp=2), kv_config(full_spec()))
    page = HEADS * BS * 2 * HEAD * 2  # heads x tokens x (K + V) x bf16
    assert dep.layer_block_bytes == page and dep.num_layers == 2
    # One KV head is one shard: the format names a head's page, not the rank's.
    assert dep.kv_format == f"vllm-cuda-auto-LBHNC-bs{BS}-auto-bfloat16-FullAttentionSpec-page{page // HEADS}"
    assert dep.sharding == Sharding(2, 2 * HEADS)
    assert [list(dep.sharding.shards_of(r)) for r in (0, 1)] == [[0, 1], [2, 3]]
    assert dep.layout.bytes_per_token * BS == dep.num_layers * page // HEADS  # a chunk is its pages' bytes


def test_the_same_model_at_tp1_tp2_and_tp4_makes_the_same_namespace_and_shard_files() -> None:
    """Parallelism-agnostic shards: a pool written at one TP size is read at another."""
    total = 4
    namespaces, shards = set(), []
    for tp in (1, 2, 4):
        config = vllm_config(tp=tp)
        config.model_config.get_total_num_kv_heads = lambda: total
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=total // tp, head_size=HEAD, dtype=torch.bfloat16)
        dep = deployment(config, kv_config(spec))
        cfg, rest = ConnectorConfig.split({"chunk_tokens": CHUNK})
        namespaces.add(store_config(cfg, rest, config, dep, None).namespace().digest)
        assert dep.sharding.by_heads and dep.sharding.num_shards == total
        shards.append([list(dep.sharding.shards_of(r)) for r in range(tp)])
    assert len(namespaces) == 1
    assert shards == [[[0, 1, 2, 3]], [[0, 1], [2, 3]], [[0], [1], [2], [3]]]


def test_fewer_kv_heads_than_ranks_are_replicas_and_written_once_each() -> None:
    config = vllm_config(tp=4)
    config.model_config.get_total_num_kv_heads = lambda: 2
    dep = deployment(config, kv_config(FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=HEAD,
                                                         dtype=torch.bfloat16)))
    assert dep.sharding == Sharding(4, 2)
    assert [list(dep.sharding.shards_of(r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [dep.sharding.writes_pool(r) for r in range(4)] == [True, False, True, False]


def test_heads_that_do_not_split_evenly_fall_back_to_rank_shards_named_by_tp() -> None:
    config = vllm_config(tp=2)
    config.model_config.get_total_num_kv_heads = lambda: 3  # not what the spec's heads per rank say
    dep = deployment(config, kv_config(full_spec()))
    assert dep.sharding == Sharding(2, 2, by_heads=False) and dep.kv_format.endswith("-tp2")
    cfg, rest = ConnectorConfig.split({})
    assert store_config(cfg, rest, config, dep, 1).world_size == 2  # the namespace names the TP size


def test_mla_kv_is_one_shard_replicated_on_every_rank() -> None:
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=72, dtype=torch.uint8, max_tp_shards=1,
                           cache_dtype_str="fp8")
    dep = deployment(vllm_config(tp=4), kv_config(mla))
    assert dep.sharding == Sharding(4, 1)
    assert [list(dep.sharding.shards_of(r)) for r in range(4)] == [[0], [0], [0], [0]]
    assert [dep.sharding.writes_pool(r) for r in range(4)] == [True, False, False, False]
    assert dep.layer_block_bytes == BS * 72  # one latent "head", not doubled into K and V


def test_bf16_and_fp16_caches_never_share_a_namespace() -> None:
    """Before: the page dtype was not in kv_format; bf16 and fp16 pages are the same size."""
    bf16 = deployment(vllm_config(), kv_config(full_spec()))
    fp16 = deployment(vllm_config(), kv_config(FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                                                                 dtype=torch.float16)))
    assert bf16.layer_block_bytes == fp16.layer_block_bytes and bf16.kv_format != fp16.kv_format


@pytest.mark.parametrize("spec, match", [
    (lambda: full_spec(non_causal=True), "non-causal"),
    (lambda: __import__("vllm.v1.kv_cache_interface", fromlist=["RSWASpec"]).RSWASpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16, rswa_window=64), "zeros"),
])
def test_specs_that_look_like_full_attention_but_are_not_are_refused(spec: Any, match: str) -> None:
    with pytest.raises(UnsupportedDeployment, match=match):
        deployment(vllm_config(), kv_config(spec()))


def test_prefill_context_parallel_is_refused() -> None:
    config = vllm_config()
    config.parallel_config.prefill_context_parallel_size = 2
    with pytest.raises(UnsupportedDeployment, match="prefill_context_parallel_size"):
        deployment(config, kv_config(full_spec()))


def test_data_parallel_engines_on_one_host_never_share_a_disk_directory(tmp_path: Any) -> None:
    """Before: the second DP engine's disk tier was left out (the first held its lock), but its
    scheduler still looked in the first engine's directory and offered hits no load delivered."""
    cfg, rest = ConnectorConfig.split({"disk_path": str(tmp_path), "chunk_tokens": CHUNK, "host_bytes": 0})
    paths = {}
    for dp in (0, 1):
        config = vllm_config(tp=2)
        config.parallel_config.data_parallel_size = 2
        config.parallel_config.data_parallel_index = dp
        dep = deployment(config, kv_config(full_spec()))
        worker_paths = {store_config(cfg, rest, config, dep, r).disk_path for r in (0, 1)}
        role = SchedulerRole(cfg, store_config(cfg, rest, config, dep, None), dep, {})
        seen = {t.files.root.as_posix() for tiers in role.rank_tiers.values() for t in tiers if t.name == "disk"}
        role.close()
        assert seen == worker_paths  # the scheduler looks exactly where its own workers write
        paths[dp] = worker_paths
    assert paths[0].isdisjoint(paths[1])
    assert paths[1] == {str(tmp_path / "dp1-of-2" / "tp0-of-2"), str(tmp_path / "dp1-of-2" / "tp1-of-2")}


def test_host_bytes_is_a_total_shared_by_the_tensor_parallel_ranks() -> None:
    dep = deployment(vllm_config(tp=4), kv_config(full_spec()))
    cfg, rest = ConnectorConfig.split({"chunk_tokens": CHUNK, "host_bytes": "8GiB"})
    assert {store_config(cfg, rest, vllm_config(tp=4), dep, r).host_bytes for r in range(4)} == {2 << 30}


def test_the_model_is_keyed_by_its_weights_not_its_path(tmp_path: Any) -> None:
    """Before: new weights behind the same path read the old weights' KV."""
    from kvtier.identity import content_digest, model_digest

    model = tmp_path / "current"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    weights = bytearray(range(256)) * (40 << 10)  # 10 MiB: sampled, not hashed whole
    (model / "model.safetensors").write_bytes(bytes(weights))
    config = vllm_config()
    config.model_config = SimpleNamespace(model=str(model), revision=None, quantization=None, hf_config=None)
    config.load_config = SimpleNamespace(load_format="auto", download_dir=None)
    first = model_digest(config)
    assert model_digest(config) == first and content_digest(model)
    weights[5 << 20] ^= 0xFF  # one byte in the middle, inside a sampled block? any retraining changes them all
    weights[: 64 << 10] = bytes(64 << 10)  # a different seed: the first bytes differ too
    (model / "model.safetensors").write_bytes(bytes(weights))
    second = model_digest(config)
    assert second != first
    config.model_config.quantization = "fp8"
    assert model_digest(config) != second
    dep = deployment(config, kv_config(full_spec()))
    cfg, rest = ConnectorConfig.split({"chunk_tokens": CHUNK})
    assert store_config(cfg, rest, config, dep, 0).namespace().digest != \
        store_config(cfg, rest, config, replace(dep, model_digest=first), 0).namespace().digest


def _hf_snapshot(cache: Any, repo: str, files: dict[str, bytes]) -> Any:
    """A Hugging Face cache holding ``repo`` at one commit, as a download leaves it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return snapshot


def test_different_weights_under_download_dirs_never_share_keys_and_unknown_weights_skip_the_pool(
        tmp_path: Any, monkeypatch: Any, caplog: Any) -> None:
    """6f37bba looked the model up in the default HF cache, not vLLM's --download-dir: a
    config-only snapshot there gave two different checkpoints one digest, without a word."""
    import huggingface_hub.constants

    from kvtier.identity import model_identity

    config_json = b'{"hidden_size": 8}'
    default_cache = tmp_path / "hf-default"
    _hf_snapshot(default_cache, "org/m", {"config.json": config_json})  # what `AutoConfig` leaves behind
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(default_cache))
    for name, weights in (("a", b"A" * 8192), ("b", b"B" * 8192)):
        _hf_snapshot(tmp_path / name, "org/m", {"config.json": config_json, "model.safetensors": weights})
    config = vllm_config()
    config.model_config = SimpleNamespace(model="org/m", revision=None, quantization=None, hf_config=None)
    digests = {}
    for name in ("a", "b"):
        config.load_config = SimpleNamespace(load_format="auto", download_dir=str(tmp_path / name))
        digests[name] = model_identity(config)["weights"]
    assert digests["a"] and digests["b"] and digests["a"] != digests["b"]
    config.load_config = SimpleNamespace(load_format="auto", download_dir=None)  # only the config-only snapshot
    assert model_identity(config)["weights"] == ""
    dep = deployment(config, kv_config(full_spec()))
    assert not dep.weights_known
    cfg, rest = ConnectorConfig.split({"chunk_tokens": CHUNK, "pool_url": "fs:///mnt/pool", "disk_path": "/d"})
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        store = store_config(cfg, rest, config, dep, 0)
    assert store.pool_url is None and store.disk_path is not None
    assert any("does not use the shared pool" in r.getMessage() for r in caplog.records)


def test_each_tp_rank_gets_its_own_disk_directory(tmp_path: Any) -> None:
    dep = deployment(vllm_config(tp=2), kv_config(full_spec()))
    cfg, rest = ConnectorConfig.split({"disk_path": str(tmp_path), "chunk_tokens": CHUNK, "host_bytes": 0})
    paths = {store_config(cfg, rest, vllm_config(tp=2), dep, r).disk_path for r in (0, 1)}
    assert paths == {str(tmp_path / "tp0-of-2"), str(tmp_path / "tp1-of-2")}


def test_no_secret_reaches_a_repr_or_the_connectors_log(caplog: pytest.LogCaptureFixture) -> None:
    dep = deployment(vllm_config(), kv_config(full_spec()))
    cfg, rest = ConnectorConfig.split({"pool_url": "redis://app:hunter2@127.0.0.1:6379/0", "redis_password": "s3cr3t",
                                       "tenant_salt": "tenant-secret", "chunk_tokens": CHUNK})
    config = store_config(cfg, rest, vllm_config(), dep, 0)
    with caplog.at_level(logging.INFO):
        logging.getLogger("kvtier.test").info("kvtier connector: %s; %s; %s", cfg, config, dep)
    for text in (repr(config), str(config), caplog.text):
        assert "hunter2" not in text and "s3cr3t" not in text and "tenant-secret" not in text
        assert "redis://app:***@127.0.0.1:6379/0" in text
    assert isinstance(config, StoreConfig) and config.redis_password == "s3cr3t"  # kept, only hidden


# ---------------------------------------------------------------- keys of a request


def request(req_id: str, tokens: list[int] | None, **kw: Any) -> Any:
    fields = {"request_id": req_id, "prompt_token_ids": tokens, "prompt_embeds": None, "lora_request": None,
              "mm_features": [], "cache_salt": None}
    return SimpleNamespace(**{**fields, **kw})


def mm(ident: str, offset: int, length: int, pixels: int | None = 0) -> Any:
    """A multimodal item as the engine core has it: its identifier (a hash, or a client's UUID),
    its processed data (field -> element with ``data``; None: left out by vLLM's cache)."""
    data = None if pixels is None else {"pixel_values": SimpleNamespace(data=torch.full((3, 4), float(pixels)))}
    return SimpleNamespace(identifier=ident, modality="image", data=data,
                           mm_position=SimpleNamespace(offset=offset, length=length))


def test_lora_and_multimodal_inputs_enter_the_keys() -> None:
    tokens = list(range(100, 200))
    plain = request_extra(request("a", tokens))
    lora_a = request_extra(request("b", tokens, lora_request=SimpleNamespace(lora_name="a", lora_path="/a")))
    lora_b = request_extra(request("c", tokens, lora_request=SimpleNamespace(lora_name="b", lora_path="/b")))
    img_1 = request_extra(request("d", tokens, mm_features=[mm("img1", 10, 20, pixels=1)]))
    img_2 = request_extra(request("e", tokens, mm_features=[mm("img2", 10, 20, pixels=2)]))
    img_1_moved = request_extra(request("f", tokens, mm_features=[mm("img1", 30, 20, pixels=1)]))
    assert plain == b""  # plain prompts keep the keys they always had
    assert len({plain, lora_a, lora_b, img_1, img_2, img_1_moved}) == 6
    assert request_extra(request("g", None, prompt_embeds=torch.zeros(4, 8))) is None


def test_a_reused_client_uuid_never_keys_other_content() -> None:
    """Before: the client's multi_modal_uuids string was the key fleet-wide; another client
    sending other pixels under the same UUID was served the first one's KV."""
    tokens = list(range(100, 200))
    first = request_extra(request("a", tokens, mm_features=[mm("my-uuid", 10, 20, pixels=1)]))
    other = request_extra(request("b", tokens, mm_features=[mm("my-uuid", 10, 20, pixels=2)]))
    same = request_extra(request("c", tokens, mm_features=[mm("another-uuid", 10, 20, pixels=1)]))
    assert first != other  # the content decides
    assert first == same  # whatever the client called it
    counters: dict[str, int] = {}
    blind = request("d", tokens, mm_features=[mm("my-uuid", 10, 20, pixels=None)])
    assert request_extra(blind, counters=counters) is None  # no data to check: not served from kvtier
    trusted = request_extra(blind, trust_mm_identifiers=True, counters=counters)
    assert trusted is not None and trusted not in (first, other)
    assert counters["mm_trusted_ids"] == 1


def test_a_lora_adapter_is_keyed_by_its_content(tmp_path: Any) -> None:
    from kvtier.identity import AdapterIdentities

    adapters = AdapterIdentities()
    path = tmp_path / "adapter"
    path.mkdir()
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(b"weights-v1" * 1000)
    tokens = list(range(100, 200))
    lora = SimpleNamespace(lora_name="mine", lora_path=str(path))
    v1 = request_extra(request("a", tokens, lora_request=lora), adapters)
    assert request_extra(request("b", tokens, lora_request=lora), adapters) == v1  # cached, unchanged
    time.sleep(0.05)  # a new mtime (ext4 stamps in jiffies)
    (path / "adapter_model.safetensors").write_bytes(b"weights-v2" * 1000)  # same name, same path, new weights
    assert request_extra(request("c", tokens, lora_request=lora), adapters) != v1


# ---------------------------------------------------------------- the scheduler role


def make_scheduler(tp: int = 1, extra: dict[str, Any] | None = None) -> tuple[SchedulerRole, dict[str, int]]:
    dep = deployment(vllm_config(tp=tp), kv_config(full_spec()))
    cfg, rest = ConnectorConfig.split({"chunk_tokens": CHUNK, "host_bytes": "1MiB", "load_policy": "always",
                                       "load_mode": "sync", **(extra or {})})
    counters = dict.fromkeys(("matched_tokens", "unavailable_tiers", "skipped_requests", "resumed_loads",
                              "async_loads", "lookup_timeouts", "decode_saves", "failed_loads"), 0)
    return SchedulerRole(cfg, store_config(cfg, rest, vllm_config(tp=tp), dep, None), dep, counters), counters


def ask(role: SchedulerRole, req: Any, computed: int = 0) -> tuple[int, bool]:
    """``get_num_new_matched_tokens`` as vLLM's scheduler sees it: asked again while it says None."""
    for _ in range(500):
        got = role.get_num_new_matched_tokens(req, computed)
        if got[0] is not None:
            return got  # type: ignore[return-value]
        time.sleep(0.01)
    raise AssertionError("the lookup never finished")


def held(role: SchedulerRole, req: Any, chunks: int, rank: int = 0) -> None:
    """Tell the scheduler that ``rank``'s host tier holds the first ``chunks`` chunks of ``req``."""
    state = role._state(req)
    assert state is not None
    sharding = role.dep.sharding
    ids = [shard_id(c, sharding.shards_of(rank)[0], sharding.num_shards) for c in state.chunk_ids[:chunks]]
    role.update_connector_output(KVTierWorkerMeta(host_changes={rank: [(True, bytes(c.key)) for c in ids]}))


def blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def output(new: list[Any] = (), cached: list[tuple[str, list[int] | None, int]] = (), resumed: set[str] = frozenset(),
           scheduled: dict[str, int] | None = None) -> Any:
    cached = list(cached)
    return SimpleNamespace(
        total_num_scheduled_tokens=sum((scheduled or {}).values()), scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[c[0] for c in cached], resumed_req_ids=set(resumed),
                                              new_block_ids=[None if c[1] is None else (c[1],) for c in cached],
                                              num_computed_tokens=[c[2] for c in cached]),
        num_scheduled_tokens=scheduled or {}, finished_req_ids=set())


def test_a_preempted_request_rescheduled_with_a_hit_gets_its_load() -> None:
    role, counters = make_scheduler()
    req = request("r", list(range(1000, 1000 + 4 * CHUNK + 5)))  # 4 full chunks, 8 blocks
    held(role, req, 4)
    assert ask(role, req) == (4 * CHUNK, False)
    role.update_state_after_alloc(req, blocks(list(range(10, 19))), 4 * CHUNK)
    first = role.build_connector_meta(output(new=[SimpleNamespace(req_id="r", block_ids=(list(range(10, 19)),),
                                                                   num_computed_tokens=4 * CHUNK)],
                                             scheduled={"r": 5}))
    assert [t.block_ids for t in first.loads] == [list(range(10, 18))]
    # Preempted while decoding; vLLM frees its blocks, asks again, and reschedules it.
    assert ask(role, req) == (4 * CHUNK, False)
    role.update_state_after_alloc(req, blocks(list(range(40, 49))), 4 * CHUNK)
    again = role.build_connector_meta(output(cached=[("r", list(range(40, 49)), 4 * CHUNK)], resumed={"r"},
                                             scheduled={"r": 5}))
    assert [t.block_ids for t in again.loads] == [list(range(40, 48))]  # into its new blocks
    assert counters["resumed_loads"] == 1
    # A running (not resumed) request with new blocks gets no load.
    later = role.build_connector_meta(output(cached=[("r", [49], 4 * CHUNK + 5)], scheduled={"r": 1}))
    assert later.loads == []


def test_prompt_embeds_requests_are_skipped_and_counted() -> None:
    role, counters = make_scheduler()
    req = request("e", None, prompt_embeds=torch.zeros(600, 8))
    assert ask(role, req) == (0, False)
    assert counters["skipped_requests"] == 1
    role.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    meta = role.build_connector_meta(output(new=[SimpleNamespace(req_id="e", block_ids=([1, 2, 3, 4, 5],),
                                                                  num_computed_tokens=0)], scheduled={"e": 600}))
    assert meta.saves == [] and meta.loads == []


def test_another_lora_adapter_misses_the_same_prompts_chunks() -> None:
    role, _ = make_scheduler()
    tokens = list(range(500, 500 + 3 * CHUNK + 1))
    held(role, request("base", tokens), 3)
    assert ask(role, request("same", tokens)) == (3 * CHUNK, False)
    adapted = request("lora", tokens, lora_request=SimpleNamespace(lora_name="x", lora_path="/x"))
    assert ask(role, adapted) == (0, False)


def test_with_tp2_a_chunk_is_hit_only_when_every_ranks_shard_is_held() -> None:
    role, _ = make_scheduler(tp=2)
    req = request("t", list(range(2000, 2000 + 5 * CHUNK + 3)))
    held(role, req, 5, rank=0)
    assert ask(role, req) == (0, False)  # rank 1 holds nothing
    held(role, req, 3, rank=1)
    assert ask(role, request("t2", req.prompt_token_ids)) == (3 * CHUNK, False)


def test_a_disabled_worker_stops_hits() -> None:
    role, _ = make_scheduler()
    req = request("d", list(range(3000, 3000 + 2 * CHUNK + 1)))
    held(role, req, 2)
    role.update_connector_output(KVTierWorkerMeta(disabled=[0]))
    assert ask(role, req) == (0, False)


# ---------------------------------------------------------------- background lookups and loads


def test_an_async_hit_is_loaded_in_the_background_into_the_blocks_vllm_parks() -> None:
    role, counters = make_scheduler(extra={"load_mode": "async"})
    req = request("a", list(range(4000, 4000 + 3 * CHUNK + 7)))  # 3 full chunks, 7 blocks
    held(role, req, 3)
    assert ask(role, req) == (3 * CHUNK, True)
    role.update_state_after_alloc(req, blocks(list(range(20, 27))), 3 * CHUNK)
    # vLLM parks the request (WAITING_FOR_REMOTE_KVS): it is not scheduled in this step.
    meta = role.build_connector_meta(output())
    assert [(t.req_id, t.block_ids, t.background) for t in meta.loads] == [("a", list(range(20, 26)), True)]
    assert counters["async_loads"] == 1 and counters["matched_tokens"] == 3 * CHUNK
    # Loaded: vLLM schedules it with the loaded tokens computed; no second load, saves go on.
    after = role.build_connector_meta(output(new=[SimpleNamespace(req_id="a", block_ids=(list(range(20, 27)),),
                                                                   num_computed_tokens=3 * CHUNK)],
                                             scheduled={"a": 7}))
    assert after.loads == [] and after.saves == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_hit_vllm_caps_is_loaded_only_as_far_as_vllm_counts_it(mode: str) -> None:
    """vLLM 0.33+ may cut the hit short after it was offered (``cap_external_hit``): the load
    covers ``num_external_tokens``, the chunks past it are vLLM's to compute (and kvtier's to
    save), and no block past it is written."""
    role, counters = make_scheduler(extra={"load_mode": mode})
    req = request("c", list(range(5000, 5000 + 4 * CHUNK + 7)))  # 4 full chunks
    held(role, req, 4)
    assert ask(role, req) == (4 * CHUNK, mode == "async")
    role.update_state_after_alloc(req, blocks(list(range(30, 39))), CHUNK + BS)  # capped: 1.5 chunks
    new = SimpleNamespace(req_id="c", block_ids=(list(range(30, 39)),), num_computed_tokens=CHUNK + BS)
    rest = {"c": 3 * CHUNK - BS + 7}
    meta = role.build_connector_meta(output(new=[new], scheduled=rest) if mode == "sync" else output())
    (load,) = meta.loads
    assert load.block_ids == [30, 31, 32, None]  # the second chunk's first block only
    assert len(load.chunk_ids) == 2 and counters["capped_loads"] == 1
    assert counters["matched_tokens"] == CHUNK + BS
    if mode == "sync":  # the step ran with the load; its saves wait for the workers' report
        role.update_connector_output(KVTierWorkerMeta(sync_loads=[SyncLoad("c", True)]))
        later = role.build_connector_meta(output(cached=[("c", None, 4 * CHUNK + 7)], scheduled={"c": 1}))
    else:  # loaded in the background: vLLM schedules the rest
        later = role.build_connector_meta(output(new=[new], scheduled=rest))
    saved = [c for t in later.saves for c in t.chunk_ids]
    assert saved[:3] == role._requests["c"].chunk_ids[1:4]  # computed by vLLM past the cap: saved


def test_may_load_async_is_true_only_where_a_background_load_could_be_offered() -> None:
    """vLLM 0.34 asks as a request enters its waiting queues (``--max-num-inflight-kv-loads``)."""
    role, _ = make_scheduler(extra={"load_mode": "auto"})
    assert role.may_load_async(request("long", list(range(2 * CHUNK))))
    assert not role.may_load_async(request("short", list(range(BS))))  # no chunk, no tail to find
    assert not role.may_load_async(request("embeds", None, prompt_embeds=torch.zeros(4, 8)))
    sync, _ = make_scheduler(extra={"load_mode": "sync"})
    assert not sync.may_load_async(request("long", list(range(2 * CHUNK))))
    never, _ = make_scheduler(extra={"load_mode": "async", "load_policy": "never"})
    assert not never.may_load_async(request("long", list(range(2 * CHUNK))))


@pytest.mark.parametrize(("version", "known"), [("0.32.0", True), ("0.33.1", True), ("0.34.0", True),
                                                ("0.34.2.dev7+g1234", True), ("0.35.0", False), ("0.31.1", False),
                                                ("1.0.0", False), ("garbage", False)])
def test_a_vllm_release_the_connector_was_not_tested_with_is_refused_at_start(version: str, known: bool) -> None:
    from kvtier.integrations.vllm.releases import UntestedRelease, check

    if known:
        assert check(version) is None
        return
    with pytest.raises(UntestedRelease, match=r"tested with vLLM 0\.32\.x, 0\.33\.x, 0\.34\.x.*allow_untested_vllm"):
        check(version)
    assert "not a release the connector was tested with" in (check(version, allow_untested=True) or "")


def test_the_connector_itself_refuses_an_untested_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from kvtier.integrations.vllm import KVTierConnector
    from kvtier.integrations.vllm.releases import UntestedRelease

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(UntestedRelease, match=r"this is vLLM 0\.99\.0"):
        KVTierConnector(vllm_config(), None, kv_config(full_spec()))  # type: ignore[arg-type]


def test_auto_loads_in_the_step_only_while_the_engine_is_idle_and_the_load_is_short(monkeypatch: Any) -> None:
    import kvtier.integrations.vllm.decide as decide

    role, counters = make_scheduler(extra={"load_mode": "auto"})
    assert ConnectorConfig().load_mode == "auto"  # the default
    idle = request("i", list(range(7000, 7000 + 3 * CHUNK + 7)))
    held(role, idle, 3)
    assert ask(role, idle) == (3 * CHUNK, False)  # nothing ran in the last step: in the step
    role.update_state_after_alloc(idle, blocks(list(range(20, 27))), 3 * CHUNK)
    meta = role.build_connector_meta(output(new=[SimpleNamespace(req_id="i", block_ids=(list(range(20, 27)),),
                                                                  num_computed_tokens=0)], scheduled={"i": 7}))
    assert [(t.req_id, t.background) for t in meta.loads] == [("i", False)] and counters["async_loads"] == 0
    assert counters["step_loads"] == 1
    # The step just built scheduled tokens: the engine is busy, the next hit loads in the background.
    busy = request("b", list(range(8000, 8000 + 3 * CHUNK + 7)))
    held(role, busy, 3)
    assert ask(role, busy) == (3 * CHUNK, True)
    role.update_state_after_alloc(busy, blocks(list(range(30, 37))), 3 * CHUNK)
    assert counters["async_loads"] == 1 and counters["step_loads"] == 1
    role.build_connector_meta(output())  # an idle step again, but a load predicted too long for it:
    monkeypatch.setattr(decide, "SYNC_IDLE_MAX_S", 0.0)
    long = request("l", list(range(9000, 9000 + 3 * CHUNK + 7)))
    held(role, long, 3)
    assert ask(role, long) == (3 * CHUNK, True)


def test_auto_loads_from_a_tier_in_the_step_only_once_its_read_rate_was_measured() -> None:
    # On the prior rate a slow pool (or one about to stall) would hold the step, where an abort
    # cannot stop the load: its first loads run in the background, which measures it.
    role, _ = make_scheduler(extra={"load_mode": "auto"})
    assert role._idle
    assert role.decide.in_background(["pool"] * 3, 0, 3 * CHUNK, idle=True)
    assert not role.decide.in_background(["host"] * 3, 0, 3 * CHUNK, idle=True)  # host DRAM never stalls
    role.rates.observe_read("pool", 1 << 30, 0.5)  # 2 GiB/s, measured
    assert not role.decide.in_background(["pool"] * 3, 0, 3 * CHUNK, idle=True)
    assert role.decide.in_background(["host", "disk", "pool"], 0, 3 * CHUNK, idle=True)  # disk: still a prior


def test_auto_times_a_tiers_first_read_so_a_restarted_engines_first_hit_loads_in_the_step(tmp_path: Any) -> None:
    role, _ = make_scheduler(extra={"pool_url": new_pool(tmp_path), "host_bytes": 0, "load_mode": "auto"})
    req = request("r", list(range(9000, 9000 + 3 * CHUNK + 1)))
    publish_shards(tmp_path, role, req, 3, [0])
    assert "pool" not in role.rates.measured
    assert ask(role, req) == (3 * CHUNK, False)  # in the step: the probe measured the pool first
    assert role.rates.measured == {"pool": 1}
    files = list(tmp_path.glob("*/*/*.kvt"))
    assert len(files) == 3 and all(f.exists() for f in files)  # read, never removed or rewritten
    role.close()


def test_a_tier_whose_first_read_is_slow_loads_in_the_background_and_is_measured_when_the_read_ends(
        tmp_path: Any) -> None:
    slow = {"pool": {"delay_prob": 1.0, "min_delay_s": 0.3, "max_delay_s": 0.3, "ops": ["load"]}}
    role, _ = make_scheduler(extra={"pool_url": new_pool(tmp_path), "host_bytes": 0, "load_mode": "auto",
                                    "inject_faults": slow})
    req = request("s", list(range(9500, 9500 + 3 * CHUNK + 1)))
    publish_shards(tmp_path, role, req, 3, [0])
    t0 = time.monotonic()
    assert ask(role, req) == (3 * CHUNK, True)  # the probe outlasted PROBE_WAIT_S: background, as before
    assert time.monotonic() - t0 < 0.25
    deadline = time.monotonic() + 5
    while "pool" not in role.rates.measured and time.monotonic() < deadline:
        time.sleep(0.01)
    assert role.rates.measured == {"pool": 1}
    assert role.rates.read_rate("pool") < 1e6  # one small file (8 KiB) in >= 0.3 s; the prior was 1 GB/s
    again = request("s2", list(range(9500, 9500 + 3 * CHUNK + 1)))
    role.rates.observe_prefill(1, 1e-9)  # with no prefill rate known every hit pays off; keep that out
    assert ask(role, again) == (3 * CHUNK, True)  # measured slow: still the background
    role.close()


def test_a_failed_async_load_makes_its_chunks_saved_again_once_recomputed() -> None:
    role, _ = make_scheduler(extra={"load_mode": "async"})
    req = request("f", list(range(5000, 5000 + 3 * CHUNK + 7)))
    held(role, req, 3)
    ask(role, req)
    role.update_state_after_alloc(req, blocks(list(range(30, 37))), 3 * CHUNK)
    role.build_connector_meta(output())
    # The load delivered one chunk; vLLM recomputes from there and the recomputed chunks are saved.
    meta = role.build_connector_meta(output(new=[SimpleNamespace(req_id="f", block_ids=(list(range(30, 37)),),
                                                                  num_computed_tokens=CHUNK)],
                                            scheduled={"f": 2 * CHUNK + 7}))
    assert [len(t.chunk_ids) for t in meta.saves] == [2] and meta.saves[0].block_ids == list(range(32, 36))


def test_a_slow_lookup_answers_not_yet_then_gives_up_after_lookup_timeout_s(tmp_path: Any) -> None:
    slow = {"pool": {"delay_prob": 1.0, "min_delay_s": 1.0, "max_delay_s": 1.0, "ops": ["lookup"]}}
    role, counters = make_scheduler(extra={"pool_url": new_pool(tmp_path), "lookup_timeout_s": 0.2,
                                           "inject_faults": slow})
    req = request("s", list(range(6000, 6000 + 2 * CHUNK + 1)))
    t0 = time.monotonic()
    assert role.get_num_new_matched_tokens(req, 0) == (None, False)  # never blocks on the pool
    assert time.monotonic() - t0 < 0.5  # idle: LOOKUP_IDLE_WAIT_S at most, far from the 1 s lookup
    assert ask(role, req) == (0, False)
    assert 0.2 <= time.monotonic() - t0 < 1.0 and counters["lookup_timeouts"] == 1


def test_abandoned_lookups_are_cancelled_so_a_burst_never_starves_the_next_request(tmp_path: Any) -> None:
    """6f37bba kept every queued lookup: with a pool at 0.15 s per lookup, a burst of 40 left 30
    queued, and the next lone request timed out behind them (0% hits, +2 s TTFT)."""
    slow = {"pool": {"delay_prob": 1.0, "min_delay_s": 0.15, "max_delay_s": 0.15, "ops": ["lookup"]}}
    role, counters = make_scheduler(extra={"pool_url": new_pool(tmp_path), "lookup_timeout_s": 0.5,
                                           "inject_faults": slow, "tier_cooldown_s": 60})
    try:
        burst = [request(f"b{i}", list(range(1000 * i, 1000 * i + 2 * CHUNK + 1))) for i in range(40)]
        for req in burst:
            assert role.get_num_new_matched_tokens(req, 0) == (None, False)
        time.sleep(0.6)  # all past lookup_timeout_s: each is scheduled without a hit
        for req in burst:
            assert role.get_num_new_matched_tokens(req, 0) == (0, False)
        # Two lookup threads ran 4-8 lookups; the first timeouts tripped the pool, so the lookups
        # still queued then answered at once without it; the rest were cancelled unrun.
        timeouts = counters["lookup_timeouts"]
        assert 3 <= timeouts <= 40 and counters["cancelled_lookups"] >= 20
        assert role.lookups.queued == 0
        assert not role.guard.usable(role.views.pool)
        lone = request("lone", list(range(90_000, 90_000 + 2 * CHUNK + 1)))
        t0 = time.monotonic()
        assert ask(role, lone) == (0, False) and time.monotonic() - t0 < 0.5  # answered, not timed out
        assert counters["lookup_timeouts"] == timeouts
        # Finished requests cancel theirs too; at most MAX_QUEUED wait at once.
        for i in range(80):
            role.get_num_new_matched_tokens(request(f"q{i}", list(range(200_000 + 1000 * i,
                                                                         200_000 + 1000 * i + 2 * CHUNK + 1))), 0)
        assert role.lookups.queued <= 64
    finally:
        role.close()


def test_a_busy_engine_waits_for_a_fresh_lookup_once_and_never_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """While others run, the call that starts a lookup waits for it briefly (a local lookup
    answers in that call: no engine step lost); later calls for a lookup still pending do not
    (a slow pool's pending lookups must not add up to a stalled step)."""
    from kvtier.integrations.vllm import scheduler as scheduler_module

    waits: list[float] = []
    real_wait = scheduler_module.cf.wait

    me = threading.current_thread()
    waiting = threading.Event()

    def spy(fs: Any, timeout: float | None = None, **kw: Any) -> Any:
        if threading.current_thread() is me:  # not a thread an earlier test left waiting (cf.wait is global)
            waits.append(timeout or 0.0)
            waiting.set()
        return real_wait(fs, timeout=timeout, **kw)

    monkeypatch.setattr(scheduler_module.cf, "wait", spy)
    # A wait with room to spare: on a loaded CI machine the lookup thread may not run within 1 ms.
    monkeypatch.setattr(scheduler_module, "LOOKUP_BUSY_WAIT_S", 0.5)
    role, _ = make_scheduler()
    role.build_connector_meta(output(scheduled={"other": 1}))  # another request decodes: busy
    req = request("b", list(range(7500, 7500 + 3 * CHUNK + 1)))
    held(role, req, 3)
    # The lookup finishes only once the scheduler waits for it: a lookup that merely sleeps can
    # finish before a loaded machine's scheduler thread looks, and then no wait is needed.
    role.prefix.locate = lambda state, first=0: (waiting.wait(5), ["host"] * 3)[1]  # type: ignore[method-assign]
    assert role.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)  # answered in the first call
    assert waits == [scheduler_module.LOOKUP_BUSY_WAIT_S]

    slow = request("s", list(range(8500, 8500 + 3 * CHUNK + 1)))
    release = threading.Event()
    role.prefix.locate = lambda state, first=0: (release.wait(5), [])[1]  # type: ignore[method-assign]
    waits.clear()
    assert role.get_num_new_matched_tokens(slow, 0) == (None, False)
    assert role.get_num_new_matched_tokens(slow, 0) == (None, False)
    assert waits == [scheduler_module.LOOKUP_BUSY_WAIT_S]  # the second call did not wait
    release.set()
    assert ask(role, slow) == (0, False)


def test_an_idle_engine_waits_for_lookups_up_to_one_budget_per_scheduling_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle, a lookup slower than a poll (cold metadata after a restart) is answered in the call
    that asked, so the request runs alone rather than batched with the next arrival; all calls
    of one pass together wait at most LOOKUP_IDLE_WAIT_S, the next pass has it again, and a pass
    that has scheduled a request to compute no longer waits (it would delay that request)."""
    from kvtier.integrations.vllm import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "LOOKUP_IDLE_WAIT_S", 0.3)
    role, _ = make_scheduler()
    role.build_connector_meta(output())  # nothing scheduled: idle, a fresh budget
    req = request("i", list(range(9500, 9500 + 3 * CHUNK + 1)))
    held(role, req, 3)
    role.prefix.locate = lambda state, first=0: (time.sleep(0.05), ["host"] * 3)[1]  # type: ignore[method-assign]
    assert role.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)  # 50 ms: answered in the call

    release = threading.Event()
    role.prefix.locate = lambda state, first=0: (release.wait(5), [])[1]  # type: ignore[method-assign]
    stuck = [request(f"s{i}", list(range(10_000 * (i + 2), 10_000 * (i + 2) + CHUNK + 1))) for i in range(2)]
    t0 = time.monotonic()
    assert role.get_num_new_matched_tokens(stuck[0], 0) == (None, False)  # spends what is left
    assert role.get_num_new_matched_tokens(stuck[1], 0) == (None, False)  # nothing left: no wait
    took = time.monotonic() - t0
    assert 0.2 <= took < 0.5, took  # about 0.3 - 0.05, not twice that
    role.build_connector_meta(output())  # the next pass, still idle
    t0 = time.monotonic()
    assert role.get_num_new_matched_tokens(stuck[1], 0) == (None, False)
    assert 0.25 <= time.monotonic() - t0 < 0.6

    # Once the pass has scheduled a request to compute, a fresh lookup waits only as when busy.
    role.build_connector_meta(output())
    role.update_state_after_alloc(req, blocks(list(range(13))), 0)
    late = request("late", list(range(90_000, 90_000 + CHUNK + 1)))
    t0 = time.monotonic()
    assert role.get_num_new_matched_tokens(late, 0) == (None, False)
    assert time.monotonic() - t0 < 0.2  # LOOKUP_BUSY_WAIT_S (1 ms), not the idle budget (0.3 s)
    release.set()
    assert ask(role, stuck[1]) == (0, False)


def test_the_lookup_starts_after_vllms_own_hit_and_is_cached_across_attempts() -> None:
    role, _ = make_scheduler()
    req = request("c", list(range(7000, 7000 + 4 * CHUNK + 3)))
    held(role, req, 4)
    calls: list[int] = []
    locate = role.prefix.locate
    role.prefix.locate = lambda state, first=0: calls.append(first) or locate(state, first)  # type: ignore[method-assign]
    assert ask(role, req, 2 * CHUNK) == (2 * CHUNK, False)  # chunks 2-3 past vLLM's 2
    assert ask(role, req, 2 * CHUNK) == (2 * CHUNK, False)  # asked again: no second lookup
    assert calls == [2]


def finished(req_id: str, tokens: list[int], computed: int, **kw: Any) -> Any:
    return request(req_id, tokens[:kw.pop("prompt")], all_token_ids=tokens, num_computed_tokens=computed, **kw)


def test_a_finished_requests_generated_tokens_are_saved_for_the_next_turn() -> None:
    role, counters = make_scheduler()
    tokens = list(range(8000, 8000 + 5 * CHUNK + 9))  # prompt: 2 chunks + 3; then generated tokens
    req = finished("d", tokens, len(tokens) - 1, prompt=2 * CHUNK + 3)
    assert ask(role, req) == (0, False)
    role.update_state_after_alloc(req, blocks(list(range(11))), 0)
    first = role.build_connector_meta(output(new=[SimpleNamespace(req_id="d", block_ids=(list(range(5)),),
                                                                   num_computed_tokens=0)],
                                             scheduled={"d": 2 * CHUNK + 3}))
    assert [len(t.chunk_ids) for t in first.saves] == [2]  # the prompt's chunks, as it ran
    assert role.request_finished(req, list(range(11))) is True  # vLLM holds the blocks for us
    meta = role.build_connector_meta(output())
    assert meta.finished == ["d"] and counters["decode_saves"] == 3
    (save,) = meta.saves
    assert save.block_ids == list(range(4, 10))
    # The next turn's prompt extends this conversation: its chunks are the ones saved.
    nxt = role._state(request("next", [*tokens, 1, 2, 3]))
    assert save.chunk_ids == nxt.chunk_ids[2:5]


def hold(role: SchedulerRole, logical: list[ChunkId], rank: int = 0) -> None:
    """Tell the scheduler that ``rank``'s host tier holds these logical chunks (or tails)."""
    sharding = role.dep.sharding
    keys = [shard_id(c, sharding.shards_of(rank)[0], sharding.num_shards).key for c in logical]
    role.update_connector_output(KVTierWorkerMeta(host_changes={rank: [(True, bytes(k)) for k in keys]}))


def test_a_prompts_tail_is_saved_once_and_a_longer_prompt_loads_it_into_the_tails_own_block() -> None:
    role, counters = make_scheduler()
    tokens = list(range(7000, 7000 + 2 * CHUNK + BS + 5))  # 2 chunks, one more full block, 5 tokens
    req = request("p", tokens)
    assert ask(role, req) == (0, False)
    role.update_state_after_alloc(req, blocks(list(range(6))), 0)
    meta = role.build_connector_meta(output(new=[SimpleNamespace(req_id="p", block_ids=(list(range(6)),),
                                                                  num_computed_tokens=0)],
                                            scheduled={"p": len(tokens)}))
    full, tail = meta.saves
    assert len(full.chunk_ids) == 2 and full.block_ids == [0, 1, 2, 3]
    assert tail.chunk_ids == [tail_id(role.namespace, tokens, 2 * CHUNK, BS, full.chunk_ids[1].key)]
    assert tail.block_ids == [4] * (CHUNK // BS)  # its block, repeated to a chunk's payload
    assert counters["tail_saves"] == 1
    decoding = role.build_connector_meta(output(cached=[("p", [6], len(tokens))], scheduled={"p": 1}))
    assert decoding.saves == []  # saved once
    hold(role, [*full.chunk_ids, tail.chunk_ids[0]])
    # The next turn: its hit ends where vLLM's own cache would, after the tail's block.
    nxt = request("n", [*tokens, 1, 2, 3])
    assert ask(role, nxt) == (2 * CHUNK + BS, False)
    role.update_state_after_alloc(nxt, blocks(list(range(20, 26))), 2 * CHUNK + BS)
    step = role.build_connector_meta(output(new=[SimpleNamespace(req_id="n", block_ids=(list(range(20, 26)),),
                                                                  num_computed_tokens=2 * CHUNK + BS)],
                                            scheduled={"n": 8}))
    (load,) = step.loads
    assert load.chunk_ids == [*full.chunk_ids, tail.chunk_ids[0]]
    assert load.block_ids == [20, 21, 22, 23, 24, None]  # the tail fills its own block only
    assert counters["tail_loads"] == 1
    # A prompt shorter than one chunk has a tail too.
    hold(role, [tail_id(role.namespace, tokens, 0, BS)])
    assert ask(role, request("one-block", tokens[:BS + 5])) == (BS, False)
    assert ask(role, request("in-the-block", tokens[:BS])) == (0, False)
    # A prompt that ends inside the tail's block cannot use it (vLLM computes its last token).
    assert ask(role, request("short", tokens[:2 * CHUNK + BS])) == (2 * CHUNK, False)
    # Another continuation of the same two chunks misses the tail: its tokens differ.
    assert ask(role, request("fork", [*tokens[:2 * CHUNK], *range(BS + 9)])) == (2 * CHUNK, False)
    # With tails off, the hit ends at the last full chunk and no tail is saved.
    off, off_counters = make_scheduler(extra={"tail_chunks": False})
    hold(off, [*full.chunk_ids, tail.chunk_ids[0]])
    assert ask(off, request("n", [*tokens, 1, 2, 3])) == (2 * CHUNK, False)
    req = request("p", tokens)
    ask(off, req)
    off.update_state_after_alloc(req, blocks(list(range(6))), 0)
    meta = off.build_connector_meta(output(new=[SimpleNamespace(req_id="p", block_ids=(list(range(6)),),
                                                                 num_computed_tokens=0)],
                                           scheduled={"p": len(tokens)}))
    assert [len(t.chunk_ids) for t in meta.saves] == [2] and off_counters["tail_saves"] == 0


def test_a_finished_requests_tail_after_its_generated_tokens_is_saved_with_its_chunks() -> None:
    role, counters = make_scheduler()
    tokens = list(range(9500, 9500 + 2 * CHUNK + BS + 7))  # prompt: one chunk + 3; the rest generated
    req = finished("t", tokens, len(tokens) - 1, prompt=CHUNK + 3)
    assert ask(role, req) == (0, False)
    role.update_state_after_alloc(req, blocks(list(range(6))), 0)
    first = role.build_connector_meta(output(new=[SimpleNamespace(req_id="t", block_ids=(list(range(3)),),
                                                                   num_computed_tokens=0)],
                                             scheduled={"t": CHUNK + 3}))
    assert [len(t.chunk_ids) for t in first.saves] == [1]  # 3 tokens past the chunk: no tail yet
    assert role.request_finished(req, list(range(6))) is True
    meta = role.build_connector_meta(output())
    assert meta.finished == ["t"]  # once, for its chunk and its tail
    chunk, tail = meta.saves
    assert chunk.block_ids == [2, 3] and tail.block_ids == [4] * (CHUNK // BS)
    nxt = role._state(request("next", [*tokens, 1, 2]))
    assert chunk.chunk_ids == nxt.chunk_ids[1:2]
    assert tail.chunk_ids == [tail_id(role.namespace, tokens, 2 * CHUNK, BS, nxt.chunk_ids[1].key)]
    assert counters["tail_saves"] == 1 and counters["decode_saves"] == 1


def test_no_decode_save_when_turned_off_or_for_a_request_aborted_while_loading() -> None:
    tokens = list(range(9000, 9000 + 4 * CHUNK + 1))
    off, _ = make_scheduler(extra={"save_decode": False})
    req = finished("o", tokens, len(tokens) - 1, prompt=CHUNK + 1)
    ask(off, req)
    assert off.request_finished(req, list(range(9))) is False
    role, _ = make_scheduler(extra={"load_mode": "async"})
    req = finished("l", tokens, 3 * CHUNK, prompt=3 * CHUNK + 1)
    held(role, req, 3)
    assert ask(role, req) == (3 * CHUNK, True)
    role.update_state_after_alloc(req, blocks(list(range(7))), 3 * CHUNK)
    role.build_connector_meta(output())
    assert role.request_finished(req, list(range(6))) is False  # the load owns its blocks until it ends


def test_a_request_whose_background_load_failed_whole_is_not_offered_the_hit_again() -> None:
    """vLLM puts such a request back with nothing computed and asks again: offering the same
    hit (say, a pool the scheduler sees and the workers cannot read) would loop forever."""
    role, counters = make_scheduler(extra={"load_mode": "async"})
    req = request("w", list(range(9500, 9500 + 2 * CHUNK + 3)))
    held(role, req, 2)
    assert ask(role, req) == (2 * CHUNK, True)
    role.update_state_after_alloc(req, blocks(list(range(5))), 2 * CHUNK)
    role.build_connector_meta(output())
    assert ask(role, req) == (0, False)  # asked again before it ever ran: recompute
    assert ask(role, req) == (0, False) and counters["failed_loads"] == 1


def test_a_sync_loads_step_saves_nothing_until_every_rank_reported_it() -> None:
    """Before: with load_mode sync, a load that fell short was only recorded; the step's saves of
    the chunks computed over the unfilled blocks went to the pool under their correct keys."""
    role, counters = make_scheduler()
    req = request("s", list(range(11000, 11000 + 5 * CHUNK + 3)))
    held(role, req, 2)
    assert ask(role, req) == (2 * CHUNK, False)
    role.update_state_after_alloc(req, blocks(list(range(11))), 2 * CHUNK)
    step = role.build_connector_meta(output(new=[SimpleNamespace(req_id="s", block_ids=(list(range(11)),),
                                                                  num_computed_tokens=2 * CHUNK)],
                                            scheduled={"s": 3 * CHUNK + 3}))
    assert len(step.loads) == 1 and step.saves == []
    # No report yet (async scheduling runs the next step first): still nothing saved.
    nxt = role.build_connector_meta(output(cached=[("s", None, 5 * CHUNK + 3)], scheduled={"s": 1}))
    assert nxt.saves == [] and counters["unverified_saves"] == 2
    # A rank could not fill the second chunk: vLLM rolls back to block 2 (chunk 1) and recomputes.
    role.update_connector_output(KVTierWorkerMeta(sync_loads=[SyncLoad("s", True), SyncLoad("s", False)]))
    redo = role.build_connector_meta(output(cached=[("s", None, CHUNK)], scheduled={"s": 4 * CHUNK + 3}))
    (save,) = redo.saves
    assert save.chunk_ids == role._state(req).chunk_ids[1:5]  # recomputed chunks, from the rollback on
    assert save.block_ids == list(range(2, 10))


def test_a_sync_loads_request_that_finishes_unverified_is_not_decode_saved() -> None:
    role, _ = make_scheduler()
    tokens = list(range(12000, 12000 + 3 * CHUNK + 1))
    req = finished("u", tokens, 3 * CHUNK, prompt=3 * CHUNK + 1)
    held(role, req, 2)
    assert ask(role, req) == (2 * CHUNK, False)
    role.update_state_after_alloc(req, blocks(list(range(7))), 2 * CHUNK)
    role.build_connector_meta(output(new=[SimpleNamespace(req_id="u", block_ids=(list(range(7)),),
                                                           num_computed_tokens=2 * CHUNK)], scheduled={"u": CHUNK + 1}))
    assert role.request_finished(req, list(range(7))) is False


def test_a_tier_a_workers_store_left_out_is_no_longer_looked_up_for_that_rank(tmp_path: Any) -> None:
    role, _ = make_scheduler(tp=2, extra={"disk_path": str(tmp_path)})
    assert [t.name for t in role.rank_tiers[1]] == ["host", "disk"]
    role.update_connector_output(KVTierWorkerMeta(unavailable={1: ["disk"]}))
    assert [t.name for t in role.rank_tiers[1]] == ["host"] and [t.name for t in role.rank_tiers[0]] == ["host", "disk"]


def test_the_connector_reads_its_config_file_itself_secrets_from_the_environment(tmp_path: Any,
                                                                                  monkeypatch: Any) -> None:
    """kvtier serve passes only the file's path through vLLM (its argv and logs); the connector
    reads connector and store settings from it and expands ${VAR} from its own environment."""
    path = tmp_path / "kvtier.yaml"
    path.write_text("load_policy: never\nchunk_tokens: 64\ntenant_salt: ${TEST_KVTIER_SALT}\nhost_bytes: 1MiB\n")
    monkeypatch.setenv("TEST_KVTIER_SALT", "tenant-secret-42")
    cfg, rest = ConnectorConfig.split({"config": str(path), "host_bytes": "2MiB"})
    assert cfg.load_policy == "never" and "tenant-secret-42" not in repr(cfg)
    dep = deployment(vllm_config(), kv_config(full_spec()))
    config = store_config(cfg, rest, vllm_config(), dep, 0)
    assert (config.chunk_tokens, config.tenant_salt, config.host_bytes) == (64, "tenant-secret-42", 2 << 20)
    assert "tenant-secret-42" not in repr(config)


def publish_shards(pool: Any, role: SchedulerRole, req: Any, chunks: int, shards: Any) -> None:
    """Write shard files of the first ``chunks`` chunks of ``req`` into the fs pool ``pool``."""
    from kvtier.format import ChunkSpec
    from kvtier.layout import DTYPE_CODES
    from kvtier.tiers.base import Chunk
    from kvtier.tiers.files import ChunkFiles

    config, state = role.store_config, role._state(req)
    spec = ChunkSpec(config.namespace().digest, DTYPE_CODES[config.layout.dtype],
                     config.layout.shape(config.chunk_tokens), config.chunk_bytes)
    files = ChunkFiles(pool)
    for c in state.chunk_ids[:chunks]:
        for s in shards:
            cid = shard_id(c, s, role.dep.sharding.num_shards)
            files.publish(Chunk(cid, torch.zeros(config.layout.shape(config.chunk_tokens), dtype=torch.uint8)), spec)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_pool_is_asked_once_per_chunk_whatever_the_tp_size_and_loads_name_its_tier(tmp_path: Any, tp: int) -> None:
    role, _ = make_scheduler(tp=tp, extra={"pool_url": new_pool(tmp_path), "host_bytes": 0})
    req = request("p", list(range(7000, 7000 + 6 * CHUNK + 1)))
    publish_shards(tmp_path, role, req, 4, range(role.dep.sharding.num_shards))
    assert role.pool is not None
    stats = role.pool.files.lookup_stats  # type: ignore[attr-defined]
    before = stats.value
    assert ask(role, req) == (4 * CHUNK, False)
    # The 4 hits and the miss, one tail after the 4th chunk (tails step by one 16-token block here,
    # so only a 16-token one fits before a 32-token chunk), and at most the rest of the window:
    # one stat per chunk, not one per rank.
    assert 6 <= stats.value - before <= 7
    state = role._state(req)
    assert state.chunk_tiers == ["pool"] * 4
    role.update_state_after_alloc(req, blocks(list(range(13))), 4 * CHUNK)
    meta = role.build_connector_meta(output(new=[SimpleNamespace(req_id="p", block_ids=(list(range(13)),),
                                                                  num_computed_tokens=4 * CHUNK)], scheduled={"p": 5}))
    assert [t.chunk_tiers for t in meta.loads] == [("pool",) * 4]


def test_a_rank_that_holds_chunks_in_host_dram_and_one_that_reads_the_pool_agree_on_the_slowest() -> None:
    role, _ = make_scheduler(tp=2)
    req = request("h", list(range(8000, 8000 + 3 * CHUNK + 1)))
    held(role, req, 3, rank=0)
    held(role, req, 2, rank=1)
    assert ask(role, req) == (2 * CHUNK, False)
    assert role._state(req).chunk_tiers[:2] == ["host", "host"]


def test_the_resume_profile_follows_a_request_from_arrival_to_its_prefill_step(tmp_path: Any) -> None:
    import json

    from kvtier.integrations.vllm.common import LoadTime

    path = tmp_path / "profile.jsonl"
    role, _ = make_scheduler(extra={"load_mode": "async", "profile_file": str(path)})
    req = request("pr", list(range(9000, 9000 + 3 * CHUNK + 7)))
    held(role, req, 3)
    assert ask(role, req) == (3 * CHUNK, True)
    role.update_state_after_alloc(req, blocks(list(range(7))), 3 * CHUNK)
    meta = role.build_connector_meta(output())  # the load goes out; the request waits
    assert len(meta.loads) == 1
    role.build_connector_meta(output())  # one more step while it loads
    t = time.monotonic()
    role.update_connector_output(KVTierWorkerMeta(load_times=[
        LoadTime("pr", 0, t - 0.05, t - 0.04, t - 0.01, t, 3, 0.02, 0.005, "host")]))
    role.build_connector_meta(output(new=[SimpleNamespace(req_id="pr", block_ids=(list(range(7)),),
                                                          num_computed_tokens=3 * CHUNK)], scheduled={"pr": 7}))
    assert not path.exists()  # written once its prefill step is over
    role.build_connector_meta(output())
    (line,) = path.read_text().splitlines()
    got = json.loads(line)
    assert (got["req_id"], got["decision"], got["load_tokens"], got["scheduled_tokens"]) == ("pr", "load", 3 * CHUNK, 7)
    assert (got["chunks"], got["tier"], got["wait_steps"], got["read_s"], got["copy_s"]) == (3, "host", 2, 0.02, 0.005)
    assert abs(got["load_s"] - 0.03) < 1e-6 and abs(got["report_s"] - 0.01) < 1e-6
    for name in ("lookup_s", "answer_s", "alloc_s", "schedule_s", "prefill_s", "total_s"):
        assert got[name] >= 0, name
    parts = got["answer_s"] + got["alloc_s"] + got["queue_s"] + got["load_s"] + got["report_s"] + got["schedule_s"]
    assert abs(parts + got["prefill_s"] - got["total_s"]) < 1e-5  # the spans tile the request's time


def test_a_sync_loads_profile_puts_the_load_inside_its_prefill_step_and_still_tiles(tmp_path: Any) -> None:
    """Before: a sync load (read inside the step that prefills) gave a negative schedule_s
    (about -45 ms in the c=2 suite) and a prefill_s that counted the read twice."""
    import json

    from kvtier.integrations.vllm.common import LoadTime

    path = tmp_path / "profile.jsonl"
    role, _ = make_scheduler(extra={"profile_file": str(path)})  # load_mode sync
    req = request("ps", list(range(9500, 9500 + 2 * CHUNK + 5)))
    held(role, req, 2)
    assert ask(role, req) == (2 * CHUNK, False)
    role.update_state_after_alloc(req, blocks(list(range(5))), 2 * CHUNK)
    meta = role.build_connector_meta(output(new=[SimpleNamespace(req_id="ps", block_ids=(list(range(5)),),
                                                                  num_computed_tokens=2 * CHUNK)], scheduled={"ps": 5}))
    assert len(meta.loads) == 1
    t = time.monotonic() + 0.05  # the worker reads within the step, after it was scheduled
    role.update_connector_output(KVTierWorkerMeta(load_times=[
        LoadTime("ps", 0, t - 0.03, t - 0.03, t, t, 2, 0.02, 0.005, "host")]))
    time.sleep(0.06)
    role.build_connector_meta(output())
    got = json.loads(path.read_text().splitlines()[0])
    assert got["wait_steps"] == 0 and "schedule_s" not in got
    assert got["prefill_s"] >= 0
    parts = got["answer_s"] + got["alloc_s"] + got["queue_s"] + got["load_s"] + got["report_s"]
    assert abs(parts + got["prefill_s"] - got["total_s"]) < 1e-5
