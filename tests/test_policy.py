"""kvtier.policy (the load-or-recompute rule) and kvtier.tiers.kinds (what each tier kind is)."""

from __future__ import annotations

import pytest

from kvtier.plan.spec import hardware_from_dict
from kvtier.policy import EWMA_WEIGHT, Rates, Read, pays_off, predicted_load_s
from kvtier.tiers.kinds import KINDS, SHARED, kind, slowest


def test_a_load_pays_off_only_when_predicted_faster_than_recomputing() -> None:
    reads = [Read(1e9, 2e9), Read(1e9, 1e9, latency_s=0.5)]
    assert predicted_load_s(reads) == pytest.approx(0.5 + 1.0 + 0.5)
    assert pays_off(1.9, 2.0) and not pays_off(2.0, 2.0) and not pays_off(3.0, 2.0)
    assert pays_off(1e9, None)  # no prefill rate yet: a hit is presumed faster


def test_rates_start_from_the_kinds_priors_and_follow_measurements() -> None:
    rates = Rates(1e9)
    assert rates.read_rate("host") == 10e9 and rates.read_rate("pool") == 1e9 and rates.read_rate("other") == 1e9
    assert rates.recompute_s(1000) is None and rates.known() == (False, 0)
    rates.observe_read("pool", 4_000_000_000, 1.0)  # the first sample replaces the prior
    assert rates.read_rate("pool") == 4e9
    rates.observe_read("pool", 2_000_000_000, 1.0)
    assert rates.read_rate("pool") == pytest.approx((1 - EWMA_WEIGHT) * 4e9 + EWMA_WEIGHT * 2e9)
    for bad in ((0, 1.0), (100, 0.0), (-5, 1.0), (100, -1.0)):  # a hostile or empty report changes nothing
        rates.observe_read("disk", *bad)
    assert rates.read_rate("disk") == 1e9 and "disk" not in rates.measured
    rates.observe_prefill(1000, 0.5)
    assert rates.recompute_s(1000) == pytest.approx(0.5) and rates.known() == (True, 1)
    assert rates.snapshot() == {"read_gbps": {"pool": pytest.approx(3.4)}, "prefill_tokens_per_s": 2000.0}


def test_every_kind_is_one_row() -> None:
    assert list(KINDS) == ["host", "disk", "pool", "redis"] and SHARED == ("pool", "redis")
    assert [k.order for k in KINDS.values()] == sorted(k.order for k in KINDS.values())
    assert slowest("host", "pool") == "pool" and slowest("disk", "host") == "disk" and slowest("pool", "x") == "x"
    assert kind("pool").may_hang and not kind("disk").shared and not kind("host").persistent
    with pytest.raises(KeyError, match="host, disk, pool, redis"):
        kind("tape")


def test_a_hand_written_hardware_file_gets_each_kinds_sharedness() -> None:
    hw = hardware_from_dict({"engine": {"prefill_tokens_per_s": 1000, "decode_step_s": 0.01},
                             "tiers": {n: {"capacity_bytes": 1, "read_bytes_per_s": 1, "write_bytes_per_s": 1}
                                       for n in ("host", "disk", "pool", "scratch")}})
    got = {t.name: (t.persistent, t.shared) for t in hw.tiers}
    assert got == {"host": (False, False), "disk": (True, False), "pool": (True, True), "scratch": (True, False)}


def test_one_counter_table_feeds_the_metrics_file_and_prometheus() -> None:
    from kvtier.integrations.vllm.counters import COUNTERS, count, new_counters
    from kvtier.integrations.vllm.stats import METRICS, flatten

    counters = new_counters()
    assert {c.key for c in COUNTERS if c.label is None} == set(counters)
    count(counters, "loaded_tokens", n=512)
    count(counters, "decision", "load")
    count(counters, "unavailable_tiers")
    with pytest.raises(ValueError, match="label required"):
        count(counters, "decision")
    with pytest.raises(KeyError):
        count(counters, "loaded_tokenz")
    names = {m.name for m in METRICS}
    assert {c.metric for c in COUNTERS if c.metric} <= names
    first, _ = flatten(counters, {}, first_rank=True)
    other, _ = flatten(counters, {}, first_rank=False)
    assert first["kvtier_loaded_tokens_total"] == 512 and "kvtier_loaded_tokens_total" not in other
    assert first["kvtier_load_decisions_total|load"] == other["kvtier_load_decisions_total|load"] == 1
    assert not any(k.startswith("unavailable_tiers") for k in first)  # metrics file only
