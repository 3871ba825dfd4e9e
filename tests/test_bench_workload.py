"""kvtier.workload, the one workload model: the bench's texts and the planner's token counts agree."""

from __future__ import annotations

import random

import pytest

from kvtier import workload
from kvtier.bench import workload as bench_workload
from kvtier.plan import workload as plan_workload


class CountingText(bench_workload.TextMaker):
    """A TextMaker that records the token counts it is asked for, in order."""

    def __init__(self) -> None:
        super().__init__(None)
        self.asked: list[int] = []

    def words(self, rng: random.Random, tokens: int) -> str:
        self.asked.append(tokens)
        return super().words(rng, tokens)


@pytest.mark.parametrize("kind", ["cold-resume", "chat"])
def test_the_bench_and_the_planner_draw_the_same_context_lengths_from_one_seed(kind: str) -> None:
    spec = workload.WorkloadSpec(kind, sessions=5, context_tokens=(1000, 9000), turns=3, question_tokens=20,
                                 output_tokens=7, seed=42)
    text = CountingText()
    sessions = bench_workload.make_sessions(spec, text, first_id=100)
    # Per session the first request is the context, then one question per turn.
    bench_lengths = text.asked[:: spec.turns + 1]
    maker = plan_workload.cold_resume if kind == "cold-resume" else plan_workload.chat
    phases = maker(5, (1000, 9000), 2, turns=3, question_tokens=20, output_tokens=7, seed=42)
    first_turns = [s[0] for s in phases[0].sessions]
    assert bench_lengths == [t.prompt_tokens - 20 for t in first_turns]
    assert bench_lengths == workload.context_tokens(42, (1000, 9000), 5)
    assert [s.id for s in sessions] == [100, 101, 102, 103, 104]


def test_distinct_ids_give_distinct_prompts_of_the_same_lengths() -> None:
    spec = workload.WorkloadSpec("chat", sessions=3, context_tokens=(200, 400), turns=2, seed=7)
    a, b = CountingText(), CountingText()
    first = bench_workload.make_sessions(spec, a, first_id=0)
    again = bench_workload.make_sessions(spec, CountingText(), first_id=0)
    other = bench_workload.make_sessions(spec, b, first_id=3)
    assert [s.context for s in first] == [s.context for s in again]  # seeded
    assert a.asked == b.asked
    assert not {s.context for s in first} & {s.context for s in other}


def test_a_larger_set_extends_a_smaller_one_and_the_old_import_paths_still_work() -> None:
    assert workload.context_tokens(3, (1, 10**6), 8)[:4] == workload.context_tokens(3, (1, 10**6), 4)
    assert bench_workload.WorkloadSpec is workload.WorkloadSpec
    assert bench_workload.parse_range is workload.parse_range and workload.parse_range("4k-16k") == (4096, 16384)
    with pytest.raises(ValueError, match="cold-resume needs turns >= 2"):
        workload.WorkloadSpec("cold-resume", turns=1)


def test_warmup_sessions_have_the_cold_shape_other_ids_and_only_unmeasured_turns(tmp_path: object) -> None:
    from pathlib import Path

    from kvtier.bench.configs import presets
    from kvtier.bench.suite import cold_sessions, warmup_sessions

    spec = presets("quick", Path(str(tmp_path)))
    spec.warmup_sessions = 2
    text = bench_workload.TextMaker(None)
    warm = warmup_sessions(spec, text)
    measured = [s for group in cold_sessions(spec, text).values() for s in group]
    assert len(warm) == 2 and not {s.id for s in warm} & {s.id for s in measured}
    assert not {s.context for s in warm} & {s.context for s in measured}  # no cache carries over
    assert all(len(s.turns) == spec.cold.turns for s in warm)
    assert [(t.phase, t.measured) for t in warm[0].turns] == [("populate", False)] + [
        ("warmup", False)] * (spec.cold.turns - 1)
    # The measured sessions keep their resume turns measured.
    assert all(t.measured for s in measured for t in s.turns[1:])
