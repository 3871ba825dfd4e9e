"""kvtier.bench.soak_report: the soak run's request figures and the ramp's choice, from records."""

from __future__ import annotations

from kvtier.bench import soak_report


def test_an_empty_completion_is_not_a_failure_and_ttft_figures_leave_it_out() -> None:
    ok = {"error": None, "status": 200, "output_tokens": 4, "ttft_s": 0.5, "start_s": 0.0, "e2e_s": 1.0}
    empty = {**ok, "error": soak_report.EMPTY, "ttft_s": None}
    failed = {**ok, "error": "HTTP 500: boom", "status": 500, "ttft_s": None}
    assert soak_report.is_empty(empty) and not soak_report.is_failure(empty) and soak_report.is_failure(failed)
    assert soak_report.ttft_stats([ok, empty, failed]) == {"requests": 3, "errors": 1, "empty": 1,
                                                           "ttft_p50_s": 0.5, "ttft_p99_s": 0.5}


def test_the_ramp_stops_at_the_knee_and_stalls_are_gaps_between_events() -> None:
    levels = [{"concurrency": c, "errors": 0, "ttft_p99_s": 1.0, "requests_per_s": r}
              for c, r in ((4, 1.0), (8, 1.5), (16, 1.55))]
    assert soak_report.pick_level(levels, ttft_limit=10.0, min_gain=0.1) == 8
    assert [lv["verdict"] for lv in levels] == ["sustained", "sustained", "saturated (requests/s gain under 10%)"]
    records = [{"start_s": 0.0, "ttft_s": 1.0, "e2e_s": 2.0}, {"start_s": 10.0, "ttft_s": 1.0, "e2e_s": 2.0}]
    assert soak_report.stalls(records, took=20.0, threshold=6.0) == [{"t_s": 2.0, "seconds": 9.0}]
