"""The planner's front end (vLLM's API server: HTTP, tokenizer), and the cores it may share with
the engine.

The front end is one process: it takes requests one at a time, in the order they were sent,
each for ``request_overhead_s + frontend_per_token_s * prompt tokens`` of work, and hands each
to the engine when it is done with it (``EngineSpec``).

Where it shares the engine's cores (vLLM's CPU build with the engine's threads on every core),
neither has the machine to itself while both have work: each then progresses at ``shared_rate``
of its speed alone (processor sharing), and works at full speed while the other idles. The
engine's work is handed over as whole jobs (a step's prefill and loads, or its scheduling and
decode: ``run_engine``), which returns when the job ends with the front end's progress
meanwhile; ``shared_rate = 1`` (the front end on cores of its own, as beside a GPU engine)
leaves both at full speed.
"""

from __future__ import annotations

import heapq
import math
from typing import Generic, TypeVar

R = TypeVar("R")

_EPS = 1e-12


class FrontEnd(Generic[R]):
    """Requests sent (``send``), worked through one at a time, FIFO by time sent; a finished one
    is appended to the ``done`` list the caller passes, as ``(time at the engine, seq, request)``.

    Its clock (``t``) only moves forward; ``advance`` and ``run_engine`` account its work up to
    a time, so a caller must not send a request earlier than the clock."""

    def __init__(self, shared_rate: float = 1.0) -> None:
        if not 0 < shared_rate <= 1:
            raise ValueError(f"shared_rate must be in (0, 1], got {shared_rate!r}")
        self.shared_rate = shared_rate
        self._sent: list[tuple[float, int, float, R]] = []  # (sent at, seq, work in seconds alone, request)
        self._left: float | None = None  # work left of the request at the head, once started
        self.t = 0.0

    def send(self, t: float, seq: int, work_s: float, request: R) -> None:
        heapq.heappush(self._sent, (t, seq, work_s, request))

    def busy(self, t: float) -> bool:
        """Whether the front end has a request to work on at ``t`` (its clock at or past it)."""
        return bool(self._sent) and self._sent[0][0] <= t

    def next_done(self) -> float:
        """When the request at the head is done if the engine stays idle (inf: nothing sent)."""
        if not self._sent:
            return math.inf
        sent, _, work, _ = self._sent[0]
        return max(sent, self.t) + (work if self._left is None else self._left)

    def advance(self, until: float, rate: float, done: list[tuple[float, int, R]]) -> None:
        """Work from the clock to ``until`` at ``rate`` of full speed (a request that is done at
        ``until`` is done)."""
        until = max(until, self.t)
        t = self.t
        while self._sent:
            sent, seq, work, request = self._sent[0]
            if sent > until:
                break
            t = max(t, sent)
            left = work if self._left is None else self._left
            finish = t + left / rate
            if finish > until + _EPS:
                self._left = left - (until - t) * rate
                break
            heapq.heappop(self._sent)
            self._left = None
            done.append((finish, seq, request))
            t = finish
        self.t = until

    def run_engine(self, start: float, work_s: float, done: list[tuple[float, int, R]], *,
                   shared: bool = True) -> float:
        """An engine job of ``work_s`` seconds (alone) from ``start`` (at or after the clock):
        when it ends, with the front end advanced to then; both at ``shared_rate`` while both
        have work. ``shared=False``: a job on one thread (the scheduler's step, a small model's
        decode), which leaves the front end a core of its own: both at full speed."""
        s = self.shared_rate if shared else 1.0
        if s >= 1:  # apart: the front end at full speed throughout
            self.advance(start + work_s, 1.0, done)
            return start + work_s
        self.advance(start, 1.0, done)  # the engine was idle until ``start``
        t, left = start, work_s
        while left > _EPS:
            if self.busy(t):
                _, _, work, _ = self._sent[0]
                head_done = t + (work if self._left is None else self._left) / s
                end = t + left / s
                t1 = min(head_done, end)
                self.advance(t1, s, done)
                left = 0.0 if t1 >= end else left - (t1 - t) * s
            else:
                nxt = self._sent[0][0] if self._sent else math.inf
                t1 = min(t + left, max(nxt, t))
                self.advance(t1, 1.0, done)
                left = 0.0 if t1 >= t + left else left - (t1 - t)
            t = t1
        return t
