"""The connector in the deployment shapes users run, on the tiny model: KV memory pressure
(preemption, synchronous loads), tensor parallel 2, and vLLM's default failure policy. Real
vLLM engines (CPU build), fresh processes. The same shapes on a real model, where answers mean
something: test_real_model.py (background loads under preemption, TP 1 and 3, conversations).

Outputs are compared with plain vLLM (no connector) under the same configuration. The tiny
random model is nearly uniform, so a run that computes the same prefix in another order can
flip a token where its top two log-probabilities are within ~0.02 nats; such a mutual near-tie
counts as equal (``kvtier.bench.offline.near_tie``), a jump to an unrelated distribution does not.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from _pool import new_pool
from integration import _runs

pytestmark = pytest.mark.engine  # starts vLLM engines: left out of the fast loop (-m "not engine")

if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

BLOCK, CHUNK = 128, 256
ALWAYS = {"load_policy": "always"}


def long_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 31000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def own_cache_hit(prompt: list[int]) -> int:
    """What vLLM's own prefix cache would serve of ``prompt`` (every full block but the one
    holding its last token): a fresh engine's hit when the prompt's chunks and tail are pooled
    (with 256-token chunks and 128-token blocks a tail is the block after the last full chunk)."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def stored_chunks(prompt_len: int, generated: int) -> int:
    """Chunk files per shard an engine stores for one request: the full chunks of every token
    with KV, the prompt's tail, and the finished request's tail when it ends later."""
    computed = prompt_len + generated - 1  # the last sampled token has no KV
    full = computed // CHUNK
    prompt_tail = prompt_len % CHUNK // BLOCK * BLOCK
    prompt_tail_end = prompt_len // CHUNK * CHUNK + prompt_tail if prompt_tail else 0
    final_tail = computed % CHUNK // BLOCK * BLOCK
    return full + bool(prompt_tail) + bool(final_tail and full * CHUNK + final_tail > prompt_tail_end)


@pytest.fixture(scope="module")
def under_pressure(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """10 prompts of 1000-1333 tokens decode 300 tokens each in 44 blocks of 128 tokens."""
    tmp = tmp_path_factory.mktemp("pressure")
    prompts = long_prompts(10, 1000, 1334, seed=3)
    pressure = {"num_gpu_blocks_override": 44, "max_model_len": 4096, "batch": True, "max_tokens": 300}
    plain, metrics = _runs.run_engine(model, tmp, "plain", prompts, None, **pressure)
    assert metrics["preemptions"] > 0
    return {"tmp": tmp, "prompts": prompts, "pressure": pressure, "plain": plain}


def test_preempted_requests_resume_with_their_kv_loaded_before_their_step_and_outputs_match_plain_vllm(
        model: Path, under_pressure: dict[str, Any]) -> None:
    """vLLM preempts running requests and reschedules them. kvtier's host tier holds their
    prompt chunks by then, so each rescheduled request is a hit that must be loaded into its
    new blocks, here before its step (sync; in the background: test_real_model.py); finished
    requests hold their blocks until their generated tokens are copied (save_decode)."""
    got, metrics = _runs.run_engine(model, under_pressure["tmp"], "sync", under_pressure["prompts"],
                                    {"host_bytes": "256MiB", "chunk_tokens": CHUNK, "load_mode": "sync", **ALWAYS},
                                    **under_pressure["pressure"])
    assert metrics["preemptions"] > 0
    sched, worker = metrics["scheduler"]["connector"], metrics["worker"]["connector"]
    assert sched["resumed_loads"] > 0 and sched["async_loads"] == 0  # rescheduled requests loaded in their step
    assert worker["loaded_tokens"] == sched["matched_tokens"] > 0 and worker["failed_blocks"] == 0
    assert sched["decode_saves"] > 0  # 300 generated tokens: at least one chunk of each answer
    assert _runs.mismatches(got, under_pressure["plain"]) == []


@pytest.fixture(scope="module")
def tp2(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """TP=2 without the connector, then a writer and a fresh reader on one pool (and disk)."""
    tmp = tmp_path_factory.mktemp("tp2")
    prompts = long_prompts(3, 1300, 2600, seed=5)
    common = {"host_bytes": "64MiB", "chunk_tokens": CHUNK, "pool_url": new_pool(tmp / 'pool'),
              "disk_path": str(tmp / "disk"), **ALWAYS}
    out: dict[str, Any] = {"tmp": tmp, "prompts": prompts}
    for name, connector in (("plain", None), ("writer", common), ("reader", common)):
        out[name] = _runs.run_engine(model, tmp, name, prompts, connector, tensor_parallel_size=2)
    return out


def test_tp2_outputs_match_plain_vllm_and_a_fresh_engine_hits_every_full_chunk(tp2: dict[str, Any]) -> None:
    plain, _ = tp2["plain"]
    writer, _ = tp2["writer"]
    reader, metrics = tp2["reader"]
    assert _runs.mismatches(writer, plain) == []
    assert _runs.mismatches(reader, plain) == []
    for prompt, result in zip(tp2["prompts"], reader, strict=True):
        assert result["cached"] == own_cache_hit(prompt)  # the full chunks and the tail
    for rank in ("worker", "worker1"):  # both ranks loaded their own shards, none rejected
        tiers = metrics[rank]["tiers"]
        assert metrics[rank]["connector"]["loaded_tokens"] == sum(r["cached"] for r in reader)
        assert metrics[rank]["connector"]["failed_blocks"] == 0
        assert all(t["corrupt_chunks"] == 0 for t in tiers.values()), tiers


def test_tp2_stores_every_ranks_shard_and_never_deletes_one_as_foreign(tp2: dict[str, Any]) -> None:
    from kvtier.admin import check_file

    tmp, prompts = tp2["tmp"], tp2["prompts"]
    chunks = sum(stored_chunks(len(p), len(r["tokens"])) for p, r in zip(prompts, tp2["writer"][0], strict=True))
    pool_files = sorted((tmp / "pool").glob("??/??/*.kvt"))
    assert len(pool_files) == 2 * chunks  # one shard per rank per chunk
    assert [check_file(f) for f in pool_files] == [None] * len(pool_files)
    for rank in (0, 1):  # each rank has its own disk directory (and its lock)
        assert len(list((tmp / "disk" / f"tp{rank}-of-2").glob("??/??/*.kvt"))) == chunks
    for name in ("writer", "reader"):
        for rank in ("worker", "worker1"):
            assert all(t["corrupt_chunks"] == 0 for t in tp2[name][1][rank]["tiers"].values())


@pytest.fixture(scope="module")
def cross_tp(model: Path, tp2: dict[str, Any]) -> dict[str, Any]:
    """Head shards are the same at any TP size: a TP=1 engine resumes from the pool the TP=2
    writer filled, and a TP=2 engine from a pool a TP=1 writer filled (fresh disks each)."""
    import shutil

    tmp, prompts = tp2["tmp"], tp2["prompts"]
    shutil.copytree(tmp / "pool", tmp / "pool-of-tp2")  # the TP=2 tests count the original's files

    def connector(pool: str, disk: str) -> dict[str, Any]:
        return {"host_bytes": "64MiB", "chunk_tokens": CHUNK, "pool_url": new_pool(tmp / pool),
                "disk_path": str(tmp / disk), **ALWAYS}

    out: dict[str, Any] = {"prompts": prompts}
    out["tp1_reads_tp2"] = _runs.run_engine(model, tmp, "tp1-reads-tp2", prompts, connector("pool-of-tp2", "d1"))
    out["tp1_writer"] = _runs.run_engine(model, tmp, "tp1-writer", prompts, connector("pool-of-tp1", "d2"))
    out["tp2_reads_tp1"] = _runs.run_engine(model, tmp, "tp2-reads-tp1", prompts, connector("pool-of-tp1", "d3"),
                                            tensor_parallel_size=2)
    return out


def test_a_tp1_engine_resumes_what_a_tp2_engine_wrote_and_the_other_way_round(cross_tp: dict[str, Any],
                                                                              tp2: dict[str, Any]) -> None:
    plain_tp2, _ = tp2["plain"]
    tp1_writer, _ = cross_tp["tp1_writer"]  # computed every token itself: TP=1's recompute
    for name, reference, ranks in (("tp1_reads_tp2", tp1_writer, ("worker",)),
                                   ("tp2_reads_tp1", plain_tp2, ("worker", "worker1"))):
        results, metrics = cross_tp[name]
        assert _runs.mismatches(results, reference) == [], name
        assert [r["cached"] for r in results] == [own_cache_hit(p) for p in cross_tp["prompts"]], name
        for rank in ranks:
            connector = metrics[rank]["connector"]
            assert connector["loaded_tokens"] == sum(r["cached"] for r in results), (name, rank)
            assert connector["failed_blocks"] == 0, (name, rank)
            assert all(t["corrupt_chunks"] == 0 for t in metrics[rank]["tiers"].values()), (name, rank)
            assert metrics[rank]["store"]["load_lookups"] == 0, (name, rank)  # read where the lookup found them


def test_vllms_default_fail_policy_is_refused_at_start_with_the_fix(model: Path, tmp_path: Path) -> None:
    with pytest.raises(_runs.EngineFailed) as failed:
        _runs.run_engine(model, tmp_path, "fail-policy", [[1, 2, 3]], {"pool_url": new_pool(tmp_path / "pool")},
                         failure_policy="fail", timeout_s=300)
    assert "kv_load_failure_policy" in failed.value.stderr
    assert '"kv_load_failure_policy": "recompute"' in failed.value.stderr


def test_a_request_aborted_while_its_kv_loads_frees_its_blocks_and_the_engine_goes_on(
        model: Path, tmp_path: Path) -> None:
    """A 4k-token resume reads 16 chunks at 0.3 s each from a slow pool (one read in flight);
    it is aborted 0.6 s in. Its load stops early and vLLM gets its blocks back (the worker
    reports it finished), while a short request submitted meanwhile keeps decoding; then
    the same prompt again is served, from the pool, with outputs equal to plain vLLM."""
    rng = random.Random(13)
    long, short = [rng.randrange(100, 31000) for _ in range(4096 + 40)], [rng.randrange(100, 31000) for _ in range(200)]
    pool = {"chunk_tokens": CHUNK, "pool_url": new_pool(tmp_path / "pool"), "host_bytes": "64MiB", **ALWAYS}
    _runs.run_engine(model, tmp_path, "populate", [long], pool, max_tokens=1)
    slow = {"pool": {"delay_prob": 1.0, "min_delay_s": 0.3, "max_delay_s": 0.3, "ops": ["load"]}}
    actions = [{"at": 0.0, "submit": "resume", "prompt": 0, "max_tokens": 8},
               {"at": 0.1, "submit": "short", "prompt": 1, "max_tokens": 40},
               {"at": 0.6, "abort": "resume"},
               {"at": 1.5, "submit": "again", "prompt": 0, "max_tokens": 8}]
    got, metrics = _runs.run_async_engine(model, tmp_path, "aborted", [long, short],
                                          {**pool, "io_threads": 1, "inject_faults": slow}, actions)
    assert got["resume"]["finish"] == "abort" and got["resume"]["seconds"] < 2.0
    assert got["again"]["cached"] == 4096  # served from the pool after the abort
    worker = metrics["worker"]["connector"]
    assert worker["stopped_loads"] == 1 and worker["failed_blocks"] == 0
    plain, _ = _runs.run_engine(model, tmp_path, "plain", [long, short], None, max_tokens=40)
    first8 = {**plain[0], "tokens": plain[0]["tokens"][:8], "top": plain[0]["top"][:8]}
    assert _runs.mismatches([got["short"], got["again"]], [plain[1], first8]) == []
