"""The planner's simulator on hand-checkable cases: exact load times, sharing, capacity, decisions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtier.plan.sim import simulate
from kvtier.plan.spec import EngineSpec, HardwareSpec, ModelSpec, PlanConfig, TierSpec
from kvtier.plan.workload import Phase, Turn, chat

# 1 layer x K,V x 1 head x dim 1 x float32 = 8 bytes per token: sizes are easy to check by hand.
MODEL = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")
ENGINE = EngineSpec(prefill_tokens_per_s=100.0, decode_step_s=0.01, max_batched_tokens=100_000)


def tier(name: str = "pool", *, read: float = 1000.0, capacity: int = 1 << 30, latency: float = 0.0,
         shared: bool = False) -> TierSpec:
    return TierSpec(name, capacity, read, 1e12, latency, persistent=True, shared=shared)


def resume(prompts: list[int], concurrency: int, grow: int = 76) -> tuple[Phase, ...]:
    """Populate each session with ``prompts[i]`` tokens, restart, resume with ``grow`` more tokens."""
    populate = tuple((Turn(f"s{i}", p, 1, measured=False),) for i, p in enumerate(prompts))
    again = tuple((Turn(f"s{i}", p + grow, 1),) for i, p in enumerate(prompts))
    return (Phase(populate, 1, False, "populate"), Phase(again, concurrency, True, "resume"))


def test_single_read_back_takes_bytes_over_bandwidth() -> None:
    hw = HardwareSpec(ENGINE, (tier(),))
    r = simulate(MODEL, hw, PlanConfig("pool", ("pool",)), resume([1024], 1))
    nbytes = 1024 * 8  # four whole 256-token chunks
    assert r.loaded_tokens["pool"].tolist() == [1024]
    assert r.load_s[0] == nbytes / 1000.0
    # TTFT = the read, then prefill of the 76-token suffix; the single output token is that first token.
    assert r.ttft_s[0] == pytest.approx(nbytes / 1000.0 + ENGINE.prefill_s(76, 1024), abs=1e-12)
    assert r.bytes_read == {"pool": nbytes}


def test_tail_extends_the_hit_past_the_last_chunk_and_reads_a_whole_chunk() -> None:
    # 1100 tokens store four chunks and a 64-token tail (steps of 256 / 4 over 16-token blocks):
    # 1088 tokens; the tail's file holds a full chunk, so its read costs 256 tokens' bytes.
    r = simulate(MODEL, HardwareSpec(ENGINE, (tier(),)), PlanConfig("pool", ("pool",)), resume([1100], 1, grow=100))
    assert r.loaded_tokens["pool"].tolist() == [1088]
    assert r.bytes_read == {"pool": 1280 * 8}
    assert r.ttft_s[0] == pytest.approx(1280 * 8 / 1000.0 + ENGINE.prefill_s(112, 1088), abs=1e-12)
    off = simulate(MODEL, HardwareSpec(replace(ENGINE, tail_chunks=False), (tier(),)), PlanConfig("pool", ("pool",)),
                   resume([1100], 1, grow=100))
    assert off.loaded_tokens["pool"].tolist() == [1024]
    assert off.bytes_read == {"pool": 1024 * 8}


@pytest.mark.parametrize(("again", "loaded"), [(1089, 1088), (1088, 1024), (1040, 1024)])
def test_a_tail_is_found_only_when_the_prompt_runs_past_it(again: int, loaded: int) -> None:
    # vLLM computes at least the prompt's last token: a resume of 1088 tokens can use 1072 (whole
    # blocks short of it); the 1088-token prefix's tail (64 tokens) is the only one stored, so it
    # then gets the four chunks alone.
    populate = Phase(((Turn("s", 1100, 1, measured=False),),), 1, False, "populate")
    resumed = Phase(((Turn("s", again, 1),),), 1, True, "resume")
    r = simulate(MODEL, HardwareSpec(ENGINE, (tier(),)), PlanConfig("pool", ("pool",)), (populate, resumed))
    assert r.loaded_tokens["pool"].tolist() == [loaded]


def test_latency_is_paid_once_per_read() -> None:
    hw = HardwareSpec(ENGINE, (tier(latency=0.5),))
    r = simulate(MODEL, hw, PlanConfig("pool", ("pool",)), resume([1024], 1))
    assert r.load_s[0] == pytest.approx(8.192 + 0.5)


def test_concurrent_read_backs_share_the_bandwidth() -> None:
    hw = HardwareSpec(ENGINE, (tier(),))
    r = simulate(MODEL, hw, PlanConfig("pool", ("pool",)), resume([1024, 1024], 2), arrival_stagger_s=0.0)
    assert r.load_s.tolist() == [2 * 8.192, 2 * 8.192]
    assert r.ttft_s[0] == pytest.approx(2 * 8.192 + 2 * ENGINE.prefill_s(76, 1024))


def test_pool_shared_by_two_instances_halves_bandwidth() -> None:
    hw = HardwareSpec(ENGINE, (tier(read=2000.0, shared=True),))
    alone = simulate(MODEL, hw, PlanConfig("pool", ("pool",)), resume([1024], 1))
    shared = simulate(MODEL, hw, PlanConfig("pool-x2", ("pool",), instances=2), resume([1024], 1))
    assert alone.load_s[0] == 4.096
    assert shared.load_s[0] == 8.192


def test_capacity_zero_recomputes_everything() -> None:
    hw = HardwareSpec(ENGINE, (tier(capacity=0),))
    r = simulate(MODEL, hw, PlanConfig("pool", ("pool",)), resume([1024, 2048], 1))
    assert r.loaded_tokens["pool"].tolist() == [0, 0]
    assert r.load_s.tolist() == [0.0, 0.0]
    assert r.ttft_s[0] == pytest.approx(ENGINE.prefill_s(1100, 0))
    assert r.summary()["hit_rate"] == {"hbm": 0.0, "pool": 0.0}


def test_recompute_chosen_when_the_tier_is_slower() -> None:
    # 8192 bytes at 10 B/s = 819 s to read; prefilling 1024 tokens at 100 tok/s takes 10.24 s.
    hw = HardwareSpec(ENGINE, (tier(read=10.0),))
    r = simulate(MODEL, hw, PlanConfig("pool", ("pool",)), resume([1024], 1))
    assert r.loaded_tokens["pool"].tolist() == [0]
    assert r.ttft_s[0] == pytest.approx(ENGINE.prefill_s(1100, 0))


def test_new_prompts_never_hit() -> None:
    hw = HardwareSpec(ENGINE, (tier("host"), tier("disk")))
    r = simulate(MODEL, hw, PlanConfig("local-disk", ("host", "disk")), chat(6, (300, 900), 2, turns=1))
    s = r.summary()
    assert s["hit_rate"] == {"hbm": 0.0, "host": 0.0, "disk": 0.0}
    assert s["recompute_share"] == 1.0


def test_lru_evicts_the_oldest_session() -> None:
    # Room for one 1024-token prefix: s1's write evicts s0. Without tails, so that s0's resume
    # (1100 tokens) stores 1024 again rather than 1088, too large for the tier.
    hw = HardwareSpec(replace(ENGINE, tail_chunks=False), (tier(capacity=1024 * 8),))
    populate = tuple((Turn(f"s{i}", 1024, 1, measured=False),) for i in range(2))
    again = ((Turn("s1", 1100, 1),), (Turn("s0", 1100, 1),))  # newest first: s1 hits, then s0 misses
    r = simulate(MODEL, hw, PlanConfig("pool", ("pool",)), (Phase(populate, 1), Phase(again, 1, True)))
    assert r.loaded_tokens["pool"].tolist() == [1024, 0]
    assert r.capacity_miss_tokens == 1024
    assert r.evictions == {"pool": 2}  # s1's populate evicts s0; s0's resume evicts s1 again


def test_engine_prefix_cache_serves_the_next_turn() -> None:
    hw = HardwareSpec(ENGINE)
    turns = (Turn("a", 500, 4), Turn("a", 600, 4))
    r = simulate(MODEL, hw, PlanConfig("recompute"), (Phase((turns,), 1),))
    # Block-granular (16): 504 tokens of turn 0 -> 496 cached.
    assert r.hbm_tokens.tolist() == [0, 496]


def test_restart_empties_host_but_not_disk() -> None:
    host = TierSpec("host", 1 << 30, 1e6, 1e12, persistent=False)
    hw = HardwareSpec(ENGINE, (host, tier("disk")))
    r = simulate(MODEL, hw, PlanConfig("local-disk", ("host", "disk")), resume([1024], 1))
    assert r.loaded_tokens["host"].tolist() == [0]
    assert r.loaded_tokens["disk"].tolist() == [1024]


def test_queued_prefills_wait_for_each_other() -> None:
    # Budget of one prompt per step: the second request's TTFT includes the first's prefill.
    eng = EngineSpec(prefill_tokens_per_s=100.0, decode_step_s=0.0, max_batched_tokens=1000)
    hw = HardwareSpec(eng)
    sessions = tuple((Turn(f"s{i}", 1000, 1),) for i in range(2))
    r = simulate(MODEL, hw, PlanConfig("recompute"), (Phase(sessions, 2),), arrival_stagger_s=0.0)
    assert sorted(r.ttft_s.tolist()) == pytest.approx([10.0, 20.0])


def test_the_front_end_takes_requests_one_at_a_time() -> None:
    # 50 ms per request and 1 ms per prompt token in the front end: two 100-token requests sent
    # together reach the engine at 0.15 s and 0.30 s, then prefill in 1 s each in turn.
    eng = EngineSpec(prefill_tokens_per_s=100.0, decode_step_s=0.0, max_batched_tokens=100,
                     request_overhead_s=0.05, frontend_per_token_s=0.001)
    sessions = tuple((Turn(f"s{i}", 100, 1),) for i in range(2))
    r = simulate(MODEL, HardwareSpec(eng), PlanConfig("recompute"), (Phase(sessions, 2),), arrival_stagger_s=0.0)
    assert sorted(r.ttft_s.tolist()) == pytest.approx([1.15, 2.15])


def test_a_front_end_on_the_engines_cores_slows_it_while_both_work() -> None:
    # 0.5 s of front-end work per request, 1 s of prefill each. Alone each runs at full speed;
    # sharing the cores (shared_rate 0.5) each runs at half speed while both work: request 2's
    # front-end work overlaps request 1's prefill from 0.5 s; it ends at 1.5 s (0.5 s of work at
    # half speed), by when the prefill has done half its work and ends alone at 2.0 s. Request 2
    # then prefills alone from 2.0 to 3.0 s. Apart (shared_rate 1): 1.5 and 2.5 s.
    eng = EngineSpec(prefill_tokens_per_s=100.0, decode_step_s=0.0, max_batched_tokens=100,
                     request_overhead_s=0.5)
    sessions = tuple((Turn(f"s{i}", 100, 1),) for i in range(2))

    def ttfts(rate: float) -> list[float]:
        r = simulate(MODEL, HardwareSpec(replace(eng, shared_rate=rate)), PlanConfig("recompute"),
                     (Phase(sessions, 2),), arrival_stagger_s=0.0)
        return sorted(r.ttft_s.tolist())

    assert ttfts(0.5) == pytest.approx([2.0, 3.0])
    assert ttfts(1.0) == pytest.approx([1.5, 2.5])


def test_decode_steps_leave_the_front_end_its_pace() -> None:
    # Session a decodes 40 tokens (0.1 s a step) from about 0.5 s; b arrives at 1 s and spends
    # 0.5 s in the front end meanwhile. Scheduling and a decode token run on one thread, so b's
    # front end keeps its full pace on the other core: b reaches the engine at 1.5 s whether
    # the cores are shared or not, and has its token one step (plus its prefill) later.
    eng = EngineSpec(prefill_tokens_per_s=100.0, decode_step_s=0.1, max_batched_tokens=100,
                     request_overhead_s=0.5)
    sessions = ((Turn("a", 1, 40, arrival_s=0.0),), (Turn("b", 1, 1, arrival_s=1.0),))

    def ttft_b(rate: float) -> float:
        r = simulate(MODEL, HardwareSpec(replace(eng, shared_rate=rate)), PlanConfig("recompute"),
                     (Phase(sessions),))
        return float(r.ttft_s.max())

    assert ttft_b(0.5) == pytest.approx(ttft_b(1.0))
    assert 0.5 < ttft_b(0.5) < 0.75


def test_background_loads_run_one_after_another_while_the_engine_goes_on() -> None:
    # Two resumes sent together, 8,192 bytes each at 1,000 B/s. In the step (sync) both wait for
    # both reads and prefill together: 16.384 + 2 x 76 tokens at 100 tokens/s. In the background
    # (async) the loader reads one, then the other; each is reported by the step after its read
    # and prefilled (0.76 s) in the next: 8.192 + 0.76, and 16.384 + 0.76.
    def ttfts(mode: str) -> list[float]:
        hw = HardwareSpec(replace(ENGINE, load_mode=mode), (tier(),))
        r = simulate(MODEL, hw, PlanConfig("pool", ("pool",)), resume([1024, 1024], 2), arrival_stagger_s=0.0)
        return sorted(r.ttft_s.tolist())

    assert ttfts("sync") == pytest.approx([17.904, 17.904])
    assert ttfts("async") == pytest.approx([8.952, 17.144])


@pytest.mark.parametrize(("read", "background"), [(1e6, False), (1000.0, True)])
def test_auto_loads_in_the_step_of_an_idle_engine_only_when_the_load_is_short(read: float, background: bool) -> None:
    # Alone (an idle engine), ``auto`` loads in the step when the read is predicted under 50 ms
    # (8 ms here): the TTFT of ``sync``. A longer one (8.2 s) goes to the background, and its
    # request pays one step more (0.1 s): the step that reports the read.
    eng = replace(ENGINE, step_overhead_s=0.1)

    def ttft(mode: str) -> float:
        hw = HardwareSpec(replace(eng, load_mode=mode), (tier(read=read),))
        return float(simulate(MODEL, hw, PlanConfig("pool", ("pool",)), resume([1024], 1)).ttft_s[0])

    assert ttft("auto") == pytest.approx(ttft("sync") + (0.1 if background else 0.0))


def test_deterministic() -> None:
    hw = HardwareSpec(ENGINE, (tier(shared=True),), instances=3)
    config = PlanConfig("x3", ("pool",), 3)
    w = chat(20, (500, 3000), 4, turns=3)
    a, b = simulate(MODEL, hw, config, w, seed=1), simulate(MODEL, hw, config, w, seed=1)
    assert a.ttft_s.tolist() == b.ttft_s.tolist()


def test_bad_figures_are_rejected() -> None:
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        EngineSpec(prefill_tokens_per_s=0.0, decode_step_s=0.01)
    with pytest.raises(ValueError, match="read_bytes_per_s"):
        TierSpec("disk", 1, -1.0, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec(1, 1, 1, "float13")
    for rate in (0.0, 1.5, True):
        with pytest.raises(ValueError, match="shared_rate"):
            EngineSpec(prefill_tokens_per_s=1.0, decode_step_s=0.01, shared_rate=rate)
    with pytest.raises(ValueError, match="load_mode"):
        EngineSpec(prefill_tokens_per_s=1.0, decode_step_s=0.01, load_mode="later")


def test_the_front_end_serves_open_loop_requests_in_the_order_they_were_sent() -> None:
    # Session a's second turn (sent at 10 s) must not queue behind session b's first turn (sent
    # at 50 s, but handed to the simulator first): each waits only for earlier sends.
    eng = replace(ENGINE, request_overhead_s=0.01)
    a = (Turn("a", 100, 1, arrival_s=0.0), Turn("a", 200, 1, arrival_s=10.0))
    b = (Turn("b", 100, 1, arrival_s=50.0),)
    r = simulate(MODEL, HardwareSpec(eng), PlanConfig("recompute"), (Phase((a, b)),))
    assert r.ttft_s.max() < 2.1  # at most 200 tokens at 100 tokens/s after 10 ms
