"""Lookups' presence checks: stats stay on the caller's thread while they are fast, and go to
the stat threads once one is a round trip (a network filesystem)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from kvtier.tiers import presence as presence_module
from kvtier.tiers.presence import Presence


@dataclass(frozen=True)
class _Id:
    key: bytes


def _ids(n: int) -> list[_Id]:
    return [_Id(i.to_bytes(4, "big")) for i in range(n)]


class _Stats:
    """A stat function over ``present`` keys that records the thread of each call and sleeps
    ``delay_s`` from the ``slow_from``-th call on."""

    def __init__(self, present: set[bytes], delay_s: float = 0.0, slow_from: int = 0) -> None:
        self.present, self.delay_s, self.slow_from = present, delay_s, slow_from
        self.threads: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, key: bytes) -> int | None:
        with self._lock:
            calls = len(self.threads)
            self.threads.append(threading.current_thread().name)
        if calls >= self.slow_from and self.delay_s:
            time.sleep(self.delay_s)
        return 4096 if key in self.present else None


def test_fast_stats_never_leave_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # "Fast" with room to spare: a shared CI machine can preempt this thread for a few ms.
    monkeypatch.setattr(presence_module, "SERIAL_STAT_S", 0.05)
    presence = Presence()
    presence.parallel(16, 0.0)
    ids = _ids(40)
    stats = _Stats({i.key for i in ids[:32]})
    assert presence.leading(ids, stats) == 32
    assert set(stats.threads) == {threading.current_thread().name}
    assert len(stats.threads) == 33  # the leading run and the first miss, nothing past it


@pytest.mark.parametrize("slow_from", [0, 5])
def test_a_slow_stat_sends_the_rest_to_the_stat_threads(monkeypatch: pytest.MonkeyPatch, slow_from: int) -> None:
    # Fast and slow far apart: a fast stat preempted on a loaded machine must still count as fast.
    monkeypatch.setattr(presence_module, "SERIAL_STAT_S", 0.01)
    presence = Presence()
    presence.parallel(16, 0.0)
    ids = _ids(64)
    stats = _Stats({i.key for i in ids[:50]}, delay_s=0.05, slow_from=slow_from)
    assert presence.leading(ids, stats) == 50
    me = threading.current_thread().name
    assert stats.threads[:slow_from + 1] == [me] * (slow_from + 1)  # up to and with the first slow one
    assert all(t != me for t in stats.threads[slow_from + 1:])  # then in flight on the stat threads
    assert all(t.startswith("kvtier-stat") for t in stats.threads[slow_from + 1:])


def test_without_stat_threads_a_slow_stat_stays_serial() -> None:
    presence = Presence()
    ids = _ids(6)
    stats = _Stats({i.key for i in ids[:4]}, delay_s=0.002)
    assert presence.leading(ids, stats) == 4
    assert set(stats.threads) == {threading.current_thread().name}
    assert len(stats.threads) == 5
