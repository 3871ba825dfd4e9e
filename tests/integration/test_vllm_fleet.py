"""kvtier in a fleet, with real vLLM OpenAI servers (CPU build) started by ``kvtier serve``.

One server writes a session to the shared pool with vLLM's KV events on (a ZMQ subscriber
checks kvtier's ``BlockStored`` / ``BlockRemoved`` against the pool's files and against vLLM's
own block hashes, and ``kvtier pool gc`` evictions reach it). Then, at tensor parallel 2, one
server writes another session and a retained one (its chunks get mtimes in the future), and a
fresh server resumes the session: its ``/metrics`` must count exactly what vLLM says it served
from cache (``cached_tokens``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from _pool import new_pool

pytestmark = pytest.mark.engine  # starts vLLM engines: left out of the fast loop (-m "not engine")

if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

CHUNK = 256
PROMPT_TOKENS = 1500  # 5 full chunks


def _prompt(seed: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    """Token ids (the completions API takes them as the prompt): exact lengths, no tokenizer."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(tokens)]


class Server:
    def __init__(self, root: Path, model: Path, name: str, pool: Path, events_port: int | None, tp: int = 1) -> None:
        from kvtier.bench.engines import Process, free_port

        self.port = free_port()
        cfg = root / f"{name}.yaml"
        # Without tails: these tests match KV events (which announce chunks, not tails) against
        # the pool's files, and the pool's hit counters (whole chunks) against vLLM's cached
        # tokens. Tails in real engines: test_vllm_connector, test_vllm_deployment, test_gluster.
        cfg.write_text(json.dumps({"pool_url": new_pool(pool), "pool_bytes": "1GiB", "host_bytes": "256MiB",
                                   "chunk_tokens": CHUNK, "tail_chunks": False}))
        args = ["--model", str(model), "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(self.port),
                "--enforce-eager", "--max-model-len", "4096", "--max-num-batched-tokens", "4096",
                "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0",
                "--tensor-parallel-size", str(tp)]
        if events_port is not None:
            args += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                       "endpoint": f"tcp://*:{events_port}",
                                                       "topic": "kv"})]
        argv = [sys.executable, "-m", "kvtier.cli.main", "serve", "--config", str(cfg), "--", *args]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "PYTHONHASHSEED": "0",
               "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))}
        self.proc = Process(name, argv, root / f"{name}.log", env, ready_url=f"http://127.0.0.1:{self.port}/health")
        self.proc.start(timeout_s=600)

    def complete(self, prompt: list[int], **extra: Any) -> dict[str, Any]:
        body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, **extra}
        r = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=30).text
        return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> None:
        self.proc.stop()


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class Subscriber:
    def __init__(self, port: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.sock = zmq.Context.instance().socket(zmq.SUB)
        # The engine binds tcp://*:PORT (vLLM binds a wildcard endpoint); a router connects.
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []

    def drain(self, seconds: float) -> list[Any]:
        import zmq

        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.sock.poll(100, zmq.POLLIN):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events.extend(self.decoder.decode(payload).events)
        return self.events


def pool_keys(pool: Path) -> set[str]:
    return {p.name.removesuffix(".kvt") for p in pool.rglob("*.kvt")}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kvtier.bench.engines import free_port
    from kvtier.bench.model import make_model

    root = tmp_path_factory.mktemp("fleet")
    make_model(root / "model")
    pool = root / "pool"
    events_port = free_port()
    sub = Subscriber(events_port)
    a = Server(root, root / "model", "a", pool, events_port)
    out: dict[str, Any] = {"root": root, "pool": pool}
    try:
        first = a.complete(_prompt(1))
        # Writes to the pool land in the background; the journal reaches the scheduler with the
        # next engine steps, so keep the engine stepping a little.
        for i in range(3):
            time.sleep(1.0)
            a.complete(_prompt(100 + i, 20))
        out["stored"] = list(sub.drain(3.0))
        out["pool_after_a"] = pool_keys(pool)
        out["first"] = first
        gc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "pool", "gc", str(pool), "--max-bytes", "0"],
                            capture_output=True, text=True, timeout=120)
        out["gc"] = gc
        for i in range(3):  # evictions are read from the pool's log at most once a second, at a step
            time.sleep(1.2)
            a.complete(_prompt(200 + i, 20))
        sub.events = []
        out["removed"] = list(sub.drain(3.0))
    finally:
        a.stop()
    # Instances B and C at tensor parallel 2 (the reference deployment shards KV over ranks):
    # B writes a session (and a retained one), a fresh C resumes it from the pool.
    b_events = free_port()
    b_sub = Subscriber(b_events)
    b = Server(root, root / "model", "b", pool, b_events, tp=2)
    try:
        out["b_first"] = b.complete(_prompt(2))  # populates the pool from B itself
        for i in range(2):
            time.sleep(1.0)
            b.complete(_prompt(300 + i, 20))
        out["retained"] = b.complete(_prompt(3), kv_transfer_params={"kvtier": {"retain_s": 3600}})
        time.sleep(2.0)
        b.complete(_prompt(400, 20))
        out["retain_written_at"] = time.time()
        out["b_stored"] = list(b_sub.drain(3.0))
        out["pool_after_b"] = pool_keys(pool)
    finally:
        b.stop()
    c = Server(root, root / "model", "c", pool, None, tp=2)
    try:
        out["before"] = c.metrics()
        out["resume"] = c.complete(_prompt(2))
        deadline = time.monotonic() + 15
        while True:  # stats reach /metrics with engine steps; give the last ones time to arrive
            out["after"] = c.metrics()
            if value(out["after"], "kvtier_loaded_tokens_total") > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        c.stop()
    yield out


def test_kvtier_counters_on_vllm_metrics_match_what_vllm_served_from_cache(fleet: dict[str, Any]) -> None:
    cached = fleet["resume"]["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt = fleet["resume"]["usage"]["prompt_tokens"]
    assert cached >= prompt - 2 * CHUNK > 0  # a fresh engine: all of it came from the pool
    before, after = fleet["before"], fleet["after"]
    assert value(before, "kvtier_loaded_tokens_total") == 0
    assert value(after, "kvtier_loaded_tokens_total") == cached
    assert value(after, "kvtier_matched_tokens_total") == cached
    # The lookup found whole chunks in the pool, the load read them (bytes and seconds), on
    # both ranks: each read its own shard (half of a chunk's bytes), and the bytes add up.
    assert value(after, "kvtier_hit_tokens_total", tier="pool") >= cached
    chunk_file_payload = CHUNK * 2048  # the tiny model's KV: 2 KiB per token, split over 2 ranks
    assert value(after, "kvtier_bytes_read_total", tier="pool") >= cached // CHUNK * chunk_file_payload
    assert value(after, "kvtier_hit_chunks_total", tier="pool") * CHUNK == value(after, "kvtier_hit_tokens_total",
                                                                                  tier="pool")
    assert value(after, "kvtier_bytes_read_total", tier="pool") > 0
    assert value(after, "kvtier_read_seconds_total", tier="pool") > 0
    assert value(after, "kvtier_load_decisions_total", decision="load") == 1
    assert value(after, "kvtier_load_failed_blocks_total") == 0
    assert value(after, "kvtier_load_errors_total", tier="pool", cause="corrupt") == 0
    # The resumed request's own new chunk and the engine's gauges are there too.
    assert ("kvtier_write_queue_chunks", frozenset()) in after
    assert ("kvtier_tier_bytes", frozenset({("tier", "host")})) in after


def test_chunks_reaching_the_pool_are_announced_with_vllms_block_hashes(fleet: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import BlockStored

    stored = [e for e in fleet["stored"] if isinstance(e, BlockStored)]
    pool = [e for e in stored if e.ownership == "pool"]
    host = [e for e in stored if e.ownership == "host"]
    vllm_own = [e for e in stored if e.ownership is None]  # vLLM's block pool (medium GPU)
    assert pool and host and vllm_own
    assert all(e.medium == "STORAGE" for e in pool) and all(e.medium == "CPU" for e in host)
    # One event per chunk in the pool (each chunk is one file per KV head, announced once); every
    # hash is one vLLM itself published for that block.
    from kvtier.bench.model import KV_HEADS

    assert len(pool) * KV_HEADS == len(fleet["pool_after_a"])
    vllm_hashes = {h for e in vllm_own for h in e.block_hashes}
    for e in pool:
        assert len(e.token_ids) == CHUNK and len(e.block_hashes) == CHUNK // e.block_size
        assert set(e.block_hashes) <= vllm_hashes
    # The chain: each chunk's parent is the last block of the chunk before it.
    parents = {e.parent_block_hash for e in pool}
    assert None in parents and len(parents) == len(pool)


def test_gc_evictions_reach_subscribers_as_block_removed(fleet: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import BlockRemoved

    assert fleet["gc"].returncode == 0, fleet["gc"].stderr
    removed = [e for e in fleet["removed"] if isinstance(e, BlockRemoved) and e.ownership == "pool"]
    stored = {tuple(e.block_hashes) for e in fleet["stored"] if getattr(e, "ownership", None) == "pool"}
    # Every chunk A announced in the pool (the first prompt's, and the short ones' none) is withdrawn.
    assert {tuple(e.block_hashes) for e in removed} == stored
    assert all(e.medium == "STORAGE" for e in removed)


def test_a_request_asking_for_retention_keeps_its_chunks_ahead_of_lru(fleet: dict[str, Any]) -> None:
    written_at = fleet["retain_written_at"]
    mtimes = sorted(p.stat().st_mtime for p in fleet["pool"].rglob("*.kvt"))
    retained = [m for m in mtimes if m > written_at + 3000]
    # The retained prompt's full chunks (5 or more) got mtime = now + 3600 s; the others did not.
    assert len(retained) >= fleet["retained"]["usage"]["prompt_tokens"] // CHUNK - 1 >= 4
    assert len(retained) < len(mtimes)


def test_at_tensor_parallel_2_a_chunk_is_announced_once_for_its_two_shard_files(fleet: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import BlockStored

    pool = [e for e in fleet["b_stored"] if isinstance(e, BlockStored) and e.ownership == "pool"]
    assert len(pool) >= 8  # two 1,500-token prompts: 5 full chunks each
    assert 2 * len(pool) == len(fleet["pool_after_b"])  # each chunk is a shard file per rank
    assert len({tuple(e.block_hashes) for e in pool}) == len(pool)
