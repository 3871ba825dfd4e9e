"""The connector's worker role on real CPU KV tensors and a real store, without an engine.

Background loads, their completion through ``get_finished``, load errors, a request aborted
while loading, and the held blocks of a finished request. A disk tier with injected read
latency stands in for a slow pool. Real engines: tests/integration.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from kvtier.integrations.vllm.common import KVTierMetadata, Load, Save
from kvtier.integrations.vllm.config import ConnectorConfig, deployment, store_config
from kvtier.integrations.vllm.worker import WorkerRole
from kvtier.keys import ChunkId, Namespace, chunk_ids, tail_id
from test_vllm_roles import BS, CHUNK, full_spec, kv_config, vllm_config

NUM_BLOCKS = 64
BPC = CHUNK // BS


def worker(tmp_path: Any, extra: dict[str, Any] | None = None,
           fill: bool = False) -> tuple[WorkerRole, list[torch.Tensor]]:
    dep = deployment(vllm_config(), kv_config(full_spec()))
    cfg, rest = ConnectorConfig.split({"chunk_tokens": CHUNK, "host_bytes": 0, "disk_path": str(tmp_path),
                                       **(extra or {})})
    counters: dict[str, int] = dict.fromkeys(("loaded_tokens", "failed_blocks", "saved_chunks", "stopped_loads",
                                              "unavailable_tiers", "disabled"), 0)
    role = WorkerRole(cfg, store_config(cfg, rest, vllm_config(), dep, 0), dep, 0, counters)
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randint(-100, 100, (NUM_BLOCKS, 2, BS, 2, 8), generator=gen).to(torch.bfloat16) if fill
              else torch.zeros(NUM_BLOCKS, 2, BS, 2, 8, dtype=torch.bfloat16) for _ in dep.layer_names]
    role.register_kv_caches(dict(zip(dep.layer_names, caches, strict=True)), NUM_BLOCKS)
    assert role.mover is not None
    return role, caches


def ids(n: int) -> list[ChunkId]:
    dep = deployment(vllm_config(), kv_config(full_spec()))
    ns = Namespace("tiny", dep.layout, CHUNK, 0, 1, None, kv_format=dep.kv_format)
    return chunk_ids(ns, list(range(n * CHUNK)))


def populate(tmp_path: Any, chunks: int) -> list[torch.Tensor]:
    """Save ``chunks`` chunks from blocks 0.. of a writer's caches into the disk tier."""
    writer, caches = worker(tmp_path, fill=True)
    writer.wait_for_save(KVTierMetadata(saves=[Save("w", ids(chunks), list(range(chunks * BPC)))]))
    writer.close()
    return caches


def step(role: WorkerRole, finished: set[str] = frozenset()) -> tuple[set[str], set[str], set[int]]:
    sent, recved = role.get_finished(set(finished))
    return sent or set(), recved or set(), role.take_failed_blocks()


def wait_recved(role: WorkerRole, req_id: str, finished: set[str] = frozenset()) -> set[int]:
    for _ in range(500):
        _, recved, failed = step(role, finished)
        if req_id in recved:
            return failed
        assert not failed  # load errors come no later than completion, not before
        time.sleep(0.01)
    raise AssertionError(f"{req_id} never finished loading")


def test_a_background_load_fills_the_blocks_and_is_reported_once_done(tmp_path: Any) -> None:
    source = populate(tmp_path, 4)
    slow = {"disk": {"delay_prob": 1.0, "min_delay_s": 0.05, "max_delay_s": 0.05, "ops": ["load"]}}
    role, caches = worker(tmp_path, {"inject_faults": slow})
    blocks = list(range(20, 20 + 4 * BPC))
    role.start_load_kv(KVTierMetadata(loads=[Load("r", ids(4), blocks, background=True)]))
    assert step(role) == (set(), set(), set())  # still reading: the engine goes on
    assert wait_recved(role, "r") == set()
    for src, dst in zip(source, caches, strict=True):
        assert torch.equal(src[:4 * BPC], dst[blocks])
    assert role.counters["loaded_tokens"] == 4 * CHUNK
    role.close()


def test_a_tail_saved_from_its_blocks_loads_into_its_own_blocks_and_no_further(tmp_path: Any) -> None:
    dep = deployment(vllm_config(), kv_config(full_spec()))
    ns = Namespace("tiny", dep.layout, CHUNK, 0, 1, None, kv_format=dep.kv_format)
    tokens = list(range(2 * CHUNK))
    full = chunk_ids(ns, tokens)
    tail = tail_id(ns, tokens, CHUNK, BS, full[0].key)
    writer, source = worker(tmp_path, fill=True)
    writer.wait_for_save(KVTierMetadata(saves=[Save("w", full[:1], list(range(BPC))),
                                               Save("w", [tail], [7] * BPC)]))  # the tail's block, repeated
    writer.close()
    role, caches = worker(tmp_path)
    blocks: list[int | None] = [40 + b for b in range(BPC)] + [50] + [None] * (BPC - 1)
    role.start_load_kv(KVTierMetadata(loads=[Load("t", [full[0], tail], blocks, background=True)]))
    assert wait_recved(role, "t") == set()
    for src, dst in zip(source, caches, strict=True):
        assert torch.equal(src[:BPC], dst[40:40 + BPC]) and torch.equal(src[7], dst[50])
        assert not dst[51:].any()  # nothing past the tail's own block
    assert role.counters["loaded_tokens"] == CHUNK + BS
    role.close()


def test_chunks_that_cannot_be_read_are_load_errors_reported_with_completion(tmp_path: Any) -> None:
    populate(tmp_path, 2)
    role, _ = worker(tmp_path)
    blocks = list(range(30, 30 + 4 * BPC))
    role.start_load_kv(KVTierMetadata(loads=[Load("m", ids(4), blocks, background=True)]))
    assert wait_recved(role, "m") == set(blocks[2 * BPC:])
    assert role.counters["failed_blocks"] == 2 * BPC
    role.close()


def test_a_request_aborted_while_loading_is_reported_and_its_blocks_are_not_written_after(tmp_path: Any) -> None:
    populate(tmp_path, 6)
    slow = {"disk": {"delay_prob": 1.0, "min_delay_s": 0.2, "max_delay_s": 0.2, "ops": ["load"]}}
    role, caches = worker(tmp_path, {"inject_faults": slow, "io_threads": 1})
    blocks = list(range(40, 40 + 6 * BPC))
    role.start_load_kv(KVTierMetadata(loads=[Load("x", ids(6), blocks, background=True)]))
    t0 = time.monotonic()
    assert wait_recved(role, "x", finished={"x"}) == set()  # aborted: nothing to recompute
    assert time.monotonic() - t0 < 6 * 0.2  # it stopped early instead of reading everything
    seen = [c[blocks].clone() for c in caches]
    time.sleep(0.5)  # reads that were in flight must not land now
    assert all(torch.equal(s, c[blocks]) for s, c in zip(seen, caches, strict=True))
    assert role.counters["stopped_loads"] == 1
    role.close()


def test_a_finished_requests_held_blocks_are_released_once_copied(tmp_path: Any) -> None:
    role, _ = worker(tmp_path, fill=True)
    meta = KVTierMetadata(saves=[Save("f", ids(2), list(range(2 * BPC)))], finished=["f"])
    role.wait_for_save(meta)
    sent, recved, _ = step(role, {"f"})
    assert sent == {"f"} and recved == set() and role.counters["saved_chunks"] == 2
    role.close()


def test_a_disabled_worker_still_answers_every_load_and_held_request(tmp_path: Any) -> None:
    role, _ = worker(tmp_path)
    role._disable("test")
    role.start_load_kv(KVTierMetadata(loads=[Load("d", ids(1), list(range(BPC)), background=True)]))
    role.wait_for_save(KVTierMetadata(finished=["h"]))
    assert step(role) == ({"h"}, {"d"}, set(range(BPC)))
    role.close()


def test_a_salted_requests_chunks_load_in_an_instance_with_another_default_tenant(tmp_path: Any) -> None:
    """Files are written and checked under the request's namespace (its cache_salt), not the
    instance's default tenant: tenant A's chunks written by one instance load in another."""
    writer, source = worker(tmp_path, {"tenant_salt": "instance-a"}, fill=True)
    writer.wait_for_save(KVTierMetadata(saves=[Save("w", ids(2), list(range(2 * BPC)), salt="tenant-a")]))
    writer.close()
    reader, caches = worker(tmp_path, {"tenant_salt": "instance-b"})
    blocks = list(range(10, 10 + 2 * BPC))
    reader.start_load_kv(KVTierMetadata(loads=[Load("r", ids(2), blocks, background=True, salt="tenant-a")]))
    assert wait_recved(reader, "r") == set()
    assert all(torch.equal(s[:2 * BPC], c[blocks]) for s, c in zip(source, caches, strict=True))
    reader.close()


def test_a_sync_load_is_reported_with_whether_it_delivered_everything(tmp_path: Any) -> None:
    populate(tmp_path, 2)
    role, _ = worker(tmp_path)
    role.start_load_kv(KVTierMetadata(loads=[Load("ok", ids(2), list(range(20, 20 + 2 * BPC))),
                                             Load("short", ids(3), list(range(30, 30 + 3 * BPC)))]))
    report = role.report()
    assert report is not None and report.sync_loads == [("ok", True), ("short", False)]
    assert role.report() is None  # reported once
    role.close()


def test_a_steps_sync_loads_read_at_once_and_fill_their_blocks(tmp_path: Any) -> None:
    # Two requests that arrived together at an idle engine (load_mode auto): their loads run in
    # the same step. Each reads 4 files (2 chunks of 2 heads), 100 ms each: alone, a load reads
    # two, then spreads the other two over the I/O threads (0.3 s); one after the other, the
    # two loads would take 0.6 s, at once 0.3 s.
    source = populate(tmp_path, 2)
    slow = {"disk": {"delay_prob": 1.0, "min_delay_s": 0.1, "max_delay_s": 0.1, "ops": ["load"]}}
    role, caches = worker(tmp_path, {"inject_faults": slow, "io_threads": 4})
    t0 = time.monotonic()
    role.start_load_kv(KVTierMetadata(loads=[Load("a", ids(2), list(range(20, 20 + 2 * BPC))),
                                             Load("b", ids(2), list(range(40, 40 + 2 * BPC)))]))
    elapsed = time.monotonic() - t0
    report = role.report()
    assert report is not None and report.sync_loads == [("a", True), ("b", True)]
    for src, dst in zip(source, caches, strict=True):
        assert torch.equal(src[:2 * BPC], dst[20:20 + 2 * BPC]) and torch.equal(src[:2 * BPC], dst[40:40 + 2 * BPC])
    assert 0.3 <= elapsed < 0.5, elapsed
    role.close()


def test_handle_preemptions_fences_the_saves_before_vllm_touches_blocks(tmp_path: Any) -> None:
    role, _ = worker(tmp_path)
    calls: list[str] = []
    assert role.mover is not None
    role.mover.fence = lambda: calls.append("fence")  # type: ignore[method-assign]
    role.handle_preemptions()
    assert calls == ["fence"]
    role.close()


def test_on_a_gpu_every_kvtier_thread_sets_the_engines_device(tmp_path: Any, monkeypatch: Any) -> None:
    from types import SimpleNamespace

    role, _ = worker(tmp_path)
    assert role._thread_init() is None  # CPU: nothing to set
    role.paged = SimpleNamespace(device=torch.device("cuda", 3))  # type: ignore[assignment]
    seen: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_device", seen.append)
    init = role._thread_init()
    assert init is not None
    init()
    assert seen == [torch.device("cuda", 3)]
    role.close()


def test_pool_evictions_are_read_off_the_engine_thread(tmp_path: Any) -> None:
    import threading

    from kvtier.integrations.vllm.worker import EvictionReader

    class Hung:
        name = "pool"
        gate = threading.Event()
        calls = 0

        def read_evictions(self) -> list[bytes]:
            self.calls += 1
            if self.calls > 1:
                self.gate.wait(30)  # a hung shared filesystem
            return [b"k" * 32]

    hung = Hung()
    reader = EvictionReader([hung], 0.01)  # type: ignore[list-item]
    time.sleep(0.1)
    t0 = time.monotonic()
    assert reader.drain() == []  # the first read started at the log's end
    assert time.monotonic() - t0 < 0.05  # the engine thread never waits for the filesystem
    Hung.gate.set()
    time.sleep(0.1)
    assert reader.drain()[0] == ("pool", b"k" * 32)
    reader.close()


def _two_loads(tmp_path: Any, coalesce_ms: float, partner_chunks: int) -> tuple[list[set[str]], WorkerRole]:
    """Two background loads started in one step, ``a`` of 2 chunks and ``b`` of ``partner_chunks``,
    every read 60 ms: the sets of requests that ``get_finished`` reported, polled every 10 ms."""
    populate(tmp_path, 4)
    slow = {"disk": {"delay_prob": 1.0, "min_delay_s": 0.06, "max_delay_s": 0.06, "ops": ["load"]}}
    role, _ = worker(tmp_path, {"inject_faults": slow, "io_threads": 2, "load_coalesce_ms": coalesce_ms})
    role.start_load_kv(KVTierMetadata(loads=[Load("a", ids(2), list(range(20, 20 + 2 * BPC)), background=True),
                                             Load("b", ids(partner_chunks), list(range(40, 40 + partner_chunks * BPC)),
                                                  background=True)]))
    reports: list[set[str]] = []
    for _ in range(300):
        _, recved, _ = step(role)
        if recved:
            reports.append(recved)
        if sum(map(len, reports)) == 2:
            return reports, role
        time.sleep(0.01)
    raise AssertionError(f"loads never finished: {reports}")


def test_loads_that_end_together_are_reported_in_one_step(tmp_path: Any) -> None:
    # When a's load is over, b's has read 2 of 3 chunks in as long: about 60 ms left.
    reports, role = _two_loads(tmp_path, coalesce_ms=500, partner_chunks=3)
    assert reports == [{"a", "b"}]
    assert role.counters["coalesced_loads"] == 1
    role.close()


def test_without_coalescing_or_past_its_budget_each_load_is_reported_when_it_ends(tmp_path: Any) -> None:
    reports, role = _two_loads(tmp_path, coalesce_ms=0, partner_chunks=3)
    assert reports == [{"a"}, {"b"}]
    role.close()
    # b has 2 more chunks to read than a (about 120 ms): beyond a 30 ms budget, not waited for.
    t0 = time.monotonic()
    reports, role = _two_loads(tmp_path / "far", coalesce_ms=30, partner_chunks=4)
    assert reports == [{"a"}, {"b"}]
    assert role.counters["coalesced_loads"] == 0
    role.close()
    assert time.monotonic() - t0 < 5
