"""The connector's fleet features without an engine: its stats on vLLM's metrics API, KV events,
and session retention as the scheduler sends it (real engines: tests/integration/test_vllm_fleet.py)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtier.integrations.vllm.common import KVTierWorkerMeta, SyncLoad
from kvtier.integrations.vllm.events import ChunkEvents
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats, StatsSource, flatten
from kvtier.keys import shard_id
from kvtier.metrics import TierCounters
from test_vllm_roles import CHUNK, ask, blocks, held, make_scheduler, output, request

TYPES = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}


def scrape() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(REGISTRY).decode()
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "engine" and k != "model_name")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("kvtier_")}


# ---------------------------------------------------------------- stats


def test_a_source_reports_increments_once_and_nothing_when_nothing_changed() -> None:
    counters = {"loaded_tokens": 0.0}
    source = StatsSource("worker", lambda: ({"kvtier_loaded_tokens_total": counters["loaded_tokens"]}, {"g": 1.0}))
    first = source.take()
    assert first is not None and first.data == {"counters": {}, "gauges": {"worker": {"g": 1.0}}}
    assert source.take() is None
    counters["loaded_tokens"] = 512
    assert source.take().data["counters"] == {"kvtier_loaded_tokens_total": 512}  # type: ignore[union-attr]
    counters["loaded_tokens"] = 768
    assert source.take().data["counters"] == {"kvtier_loaded_tokens_total": 256}  # type: ignore[union-attr]


def test_only_the_first_rank_counts_request_tokens_and_every_rank_its_bytes() -> None:
    tiers = {"pool": TierCounters(bytes_read=100, failed_reads=2, timeouts=1, chunks=3)}
    counters = {"loaded_tokens": 256, "unavailable.disk": 1, "decision.load": 2}
    rank0, gauges = flatten(counters, tiers, first_rank=True)
    rank1, _ = flatten(counters, tiers, first_rank=False)
    assert rank0["kvtier_loaded_tokens_total"] == 256 and "kvtier_loaded_tokens_total" not in rank1
    assert rank0["kvtier_bytes_read_total|pool"] == rank1["kvtier_bytes_read_total|pool"] == 100
    assert rank0["kvtier_load_errors_total|pool|io_error"] == 2
    assert rank0["kvtier_load_errors_total|pool|timeout"] == 1
    assert rank0["kvtier_tier_unavailable_total|disk"] == 1 and rank0["kvtier_load_decisions_total|load"] == 2
    assert gauges == {"kvtier_tier_chunks|pool": 3, "kvtier_tier_bytes|pool": 0}


def test_prometheus_families_add_increments_and_merge_gauges_across_ranks() -> None:
    prom = KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), TYPES, ["model_name", "engine"],
                             {0: ["m", "0"]})
    rank0 = KVTierStats(data={"counters": {"kvtier_bytes_read_total|pool": 100, "kvtier_loaded_tokens_total": 256},
                              "gauges": {"worker": {"kvtier_tier_bytes|pool": 10, "kvtier_tier_bytes|host": 5}}})
    rank1 = KVTierStats(data={"counters": {"kvtier_bytes_read_total|pool": 100},
                              "gauges": {"worker1": {"kvtier_tier_bytes|pool": 12, "kvtier_tier_bytes|host": 7}}})
    prom.observe(rank0.aggregate(rank1).data)  # type: ignore[attr-defined]
    prom.observe({"counters": {"kvtier_loaded_tokens_total": 256}, "gauges": {}})
    got = scrape()
    assert got[("kvtier_bytes_read_total", frozenset({("tier", "pool")}))] == 200
    assert got[("kvtier_loaded_tokens_total", frozenset())] == 512
    assert got[("kvtier_tier_bytes", frozenset({("tier", "pool")}))] == 12  # one shared pool: max
    assert got[("kvtier_tier_bytes", frozenset({("tier", "host")}))] == 12  # each rank's own DRAM: sum
    # A second server or engine in the same process builds them again without a clash.
    KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), TYPES, ["model_name", "engine"], {0: ["m", "0"]})


def test_the_scheduler_counts_each_lookups_decision_once() -> None:
    role, counters = make_scheduler()
    req = request("r", list(range(1000, 1000 + 4 * CHUNK + 5)))
    held(role, req, 2)
    assert ask(role, req) == (2 * CHUNK, False)
    assert ask(role, req) == (2 * CHUNK, False)  # asked again (not schedulable yet): same lookup
    assert counters["decision.load"] == 1
    assert (counters["lookup_tokens"], counters["miss_tokens"]) == (4 * CHUNK, 2 * CHUNK)
    miss = request("m", list(range(5000, 5000 + 2 * CHUNK + 5)))
    assert ask(role, miss) == (0, False)
    assert counters["decision.miss"] == 1


# ---------------------------------------------------------------- KV events


def vllm_request(tokens: list[int], bs: int) -> Any:
    hashes = [bytes([i]) * 32 for i in range(len(tokens) // bs)]
    return SimpleNamespace(request_id="r", block_hashes=hashes, all_token_ids=tokens, lora_request=None,
                           mm_features=[], cache_salt=None, prompt_embeds=None)


def test_events_announce_a_chunk_once_per_tier_with_vllms_block_hashes() -> None:
    role, _ = make_scheduler()
    tokens = list(range(1000, 1000 + 3 * CHUNK))
    req = vllm_request(tokens, 16)
    ids = role._state(request("r", tokens)).chunk_ids
    events = ChunkEvents(CHUNK, 16, 1, max_chunks=8)
    events.remember(req, ids, 0, 3)
    key1 = shard_id(ids[1], 0, 1).key
    events.changed("host", True, key1)
    events.changed("host", True, key1)  # already announced there
    events.changed("pool", True, key1)
    events.changed("disk", True, b"unknown")  # a chunk this scheduler never saw: nothing
    events.changed("host", False, key1)
    stored_host, stored_pool, removed = events.take()
    assert isinstance(stored_host, BlockStored) and isinstance(stored_pool, BlockStored)
    # As vLLM publishes its own (ints unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]
    assert stored_host.block_hashes == hashes[2:4] and stored_host.parent_block_hash == hashes[1]
    assert stored_host.token_ids == tokens[CHUNK:2 * CHUNK] and stored_host.block_size == 16
    assert (stored_host.medium, stored_host.ownership, stored_pool.medium, stored_pool.ownership) == \
        ("CPU", "host", "STORAGE", "pool")
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == hashes[2:4]
    assert events.take() == []


def test_events_name_every_tier_kind_redis_included() -> None:
    role, _ = make_scheduler()
    tokens = list(range(1000, 1000 + CHUNK))
    ids = role._state(request("r", tokens)).chunk_ids
    events = ChunkEvents(CHUNK, 16, 1, max_chunks=8)
    events.remember(vllm_request(tokens, 16), ids, 0, 1)
    key = shard_id(ids[0], 0, 1).key
    for tier in ("host", "disk", "pool", "redis", "nvme-of-the-future"):
        events.changed(tier, True, key)
    got = [(e.ownership, e.medium) for e in events.take()]
    assert got == [("host", "CPU"), ("disk", "STORAGE"), ("pool", "STORAGE"), ("redis", "STORAGE")]


def test_events_remember_at_most_max_chunks() -> None:
    role, _ = make_scheduler()
    tokens = list(range(1000, 1000 + 4 * CHUNK))
    ids = role._state(request("r", tokens)).chunk_ids
    events = ChunkEvents(CHUNK, 16, 1, max_chunks=2)
    events.remember(vllm_request(tokens, 16), ids, 0, 4)
    events.changed("host", True, shard_id(ids[0], 0, 1).key)  # forgotten: the two oldest went
    events.changed("host", True, shard_id(ids[3], 0, 1).key)
    assert len(events.take()) == 1


# ---------------------------------------------------------------- retention


def test_a_request_asking_for_retention_sends_it_with_its_saves_and_what_it_already_had() -> None:
    role, _ = make_scheduler()
    tokens = list(range(1000, 1000 + 4 * CHUNK + 5))
    req = request("r", tokens, kv_transfer_params={"kvtier": {"retain_s": 600}})
    held(role, req, 2)
    assert ask(role, req) == (2 * CHUNK, False)
    role.update_state_after_alloc(req, blocks(list(range(10, 19))), 2 * CHUNK)
    now = time.time()
    meta = role.build_connector_meta(output(new=[SimpleNamespace(req_id="r", block_ids=(list(range(10, 19)),),
                                                                  num_computed_tokens=2 * CHUNK)],
                                            scheduled={"r": 2 * CHUNK + 5}))
    assert [len(t.chunk_ids) for t in meta.retains] == [2]  # the two chunks it loaded
    assert meta.saves == []  # computed over its synchronous load: saved once every rank reported it
    role.update_connector_output(KVTierWorkerMeta(sync_loads=[SyncLoad("r", True)]))
    later = role.build_connector_meta(output(cached=[("r", None, 4 * CHUNK + 5)], scheduled={"r": 1}))
    assert [len(t.chunk_ids) for t in later.saves] == [2]  # the two it computed
    for until in (*(t.until for t in meta.retains), *(t.retain_until for t in later.saves)):
        assert until is not None and now + 590 < until < now + 610


@pytest.mark.parametrize("params, server, want", [
    (None, 0.0, None), (None, 30.0, 30.0), ({"kvtier": {"retain_s": 5}}, 30.0, 5.0),
    ({"kvtier": {"retain_s": "long"}}, 30.0, 30.0), ({"kvtier": {"retain_s": 0}}, 30.0, None),
    # Hostile clients (before: 1e20 killed the writer threads): ignored or clamped, never an error.
    ({"kvtier": {"retain_s": 1e20}}, 30.0, 3600.0), ({"kvtier": {"retain_s": float("inf")}}, 30.0, 30.0),
    ({"kvtier": {"retain_s": float("nan")}}, 30.0, 30.0), ({"kvtier": {"retain_s": -5}}, 30.0, 30.0),
    ({"kvtier": {"retain_s": True}}, 30.0, 30.0), ({"kvtier": "forever"}, 30.0, 30.0),
])
def test_retention_comes_from_the_request_else_the_server(params: Any, server: float, want: float | None) -> None:
    role, counters = make_scheduler(extra={"retain_s": server, "max_retain_s": 3600})
    req = request("r", list(range(1000, 1000 + CHUNK + 5)), kv_transfer_params=params)
    assert ask(role, req) == (0, False)
    role.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
    meta = role.build_connector_meta(output(new=[SimpleNamespace(req_id="r", block_ids=([1, 2, 3],),
                                                                  num_computed_tokens=0)], scheduled={"r": CHUNK + 5}))
    (save,) = meta.saves
    if want is None:
        assert save.retain_until is None
    else:
        assert save.retain_until == pytest.approx(time.time() + want, abs=5)
    hostile = params is not None and (not isinstance(params["kvtier"], dict)
                                      or params["kvtier"]["retain_s"] not in (5, 0, "long"))
    assert counters["rejected_params"] == (1 if hostile or params == {"kvtier": {"retain_s": "long"}} else 0)


def test_a_client_may_retain_for_an_hour_unless_the_operator_allows_more() -> None:
    """6f37bba let any API client retain its session for 7 days by default."""
    from kvtier.integrations.vllm.config import ConnectorConfig

    assert ConnectorConfig().max_retain_s == 3600.0
    assert ConnectorConfig.split({"max_retain_s": 86400})[0].max_retain_s == 86400
