"""The resume profile: where each request's time to its prefill went, from the connector's own clocks.

With ``profile_file`` set, the scheduler keeps one ``Profile`` per request and appends it to
that file (one JSON object per line) once the step after its prefill begins. Times are
``time.monotonic()`` (one clock for every process of a machine), so the workers' reports
(``LoadTime``) line up with the scheduler's. A record's fields, all seconds:

* ``lookup_s``: the lookup of disk and pool metadata on a lookup thread;
* ``answer_s``: from the request's arrival to the connector's answer to vLLM (lookup included,
  and the scheduler steps that passed while vLLM asked again);
* ``alloc_s``: from the answer to the load's dispatch to the workers (vLLM allocating its blocks);
* ``queue_s``: from the dispatch to the first rank starting to read (a loader thread's wait);
* ``load_s``: from the first rank's start to the last rank's last chunk; ``read_s`` and
  ``copy_s``: the slowest rank's seconds reading-and-validating and copying into blocks, summed
  over its chunks (they overlap across I/O threads, so each may exceed ``load_s``; a chunk read
  straight into its blocks, ``PagedKV.page_views``, has no copy);
* ``report_s``: from the last chunk in to every rank having reported it to vLLM (get_finished);
* ``schedule_s``: from that report to the step that schedules the request's prefill; with
  ``wait_steps``, the engine steps the request spent waiting for its load (WAITING_FOR_REMOTE_KVS);
* ``prefill_s``: the step that prefills the suffix (until the next step begins); with a load
  in the step (``load_mode: sync``, or ``auto`` on an idle engine) the load runs inside that
  step, before its forward pass: then there is no ``schedule_s`` and ``prefill_s`` starts when
  the load was reported, so the spans still tile the request's time and ``prefill_s`` means
  the same either way;
* ``total_s``: arrival to the end of that step, the connector's view of the time to first token.

A request without a load (a miss, a short hit, a recompute decision) has only the fields that
apply. The file is for benchmarks (``kvtier bench suite`` joins it with the client's records by
the request id the client sent); nothing here is on by default.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvtier.integrations.vllm.common import LoadTime

log = logging.getLogger(__name__)

MAX_OPEN = 8192  # profiles of requests not yet prefilled; the oldest are dropped past it


@dataclass
class Profile:
    req_id: str
    external_id: str
    prompt_tokens: int
    arrived: float
    lookup_started: float | None = None
    lookup_done: float | None = None
    decision: str | None = None
    answered: float | None = None
    load_tokens: int = 0
    dispatched: float | None = None
    wait_steps: int = 0
    loads: list[LoadTime] = field(default_factory=list)
    scheduled: float | None = None
    scheduled_tokens: int = 0
    prefilled: float | None = None

    def record(self) -> dict[str, Any]:
        """The JSON line (see the module docstring)."""
        out: dict[str, Any] = {"req_id": self.req_id, "external_id": self.external_id,
                               "prompt_tokens": self.prompt_tokens, "decision": self.decision,
                               "load_tokens": self.load_tokens, "scheduled_tokens": self.scheduled_tokens}

        def span(name: str, start: float | None, end: float | None) -> None:
            if start is not None and end is not None:
                out[name] = round(end - start, 6)

        span("lookup_s", self.lookup_started, self.lookup_done)
        span("answer_s", self.arrived, self.answered)
        span("alloc_s", self.answered, self.dispatched)
        ready = self.answered
        if self.loads:
            started = min(t.started for t in self.loads)
            ended = max(t.ended for t in self.loads)
            reported = max(t.reported for t in self.loads)
            span("queue_s", self.dispatched, started)
            span("load_s", started, ended)
            span("report_s", ended, reported)
            out["read_s"] = round(max(t.read_s for t in self.loads), 6)
            out["copy_s"] = round(max(t.copy_s for t in self.loads), 6)
            out["chunks"] = min(t.chunks for t in self.loads)
            out["tier"] = max((t.tier for t in self.loads), key=len)
            out["ranks"] = len({t.rank for t in self.loads})
            out["wait_steps"] = self.wait_steps
            ready = reported
        if self.loads and ready is not None and self.scheduled is not None and ready > self.scheduled:
            span("prefill_s", ready, self.prefilled)  # a sync load: read within the prefill's own step
        else:
            span("schedule_s", ready, self.scheduled)
            span("prefill_s", self.scheduled, self.prefilled)
        span("total_s", self.arrived, self.prefilled)
        return out


class Profiler:
    """The scheduler's open profiles and the file they go to; called from vLLM's scheduler thread
    only (a lookup thread's end time arrives as a plain attribute write, ``lookup_done``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._open: OrderedDict[str, Profile] = OrderedDict()
        self._lock = threading.Lock()  # the file: shutdown may write from another thread
        self._failed = False

    def arrived(self, req_id: str, external_id: str, prompt_tokens: int) -> Profile:
        profile = self._open.get(req_id)
        if profile is None:
            profile = self._open[req_id] = Profile(req_id, external_id, prompt_tokens, time.monotonic())
            while len(self._open) > MAX_OPEN:
                self._open.popitem(last=False)
        return profile

    def get(self, req_id: str) -> Profile | None:
        return self._open.get(req_id)

    def loads(self, times: list[LoadTime]) -> None:
        for t in times:
            profile = self._open.get(t.req_id)
            if profile is not None:
                profile.loads.append(t)

    def step(self, scheduled: dict[str, int]) -> None:
        """A new engine step: the previous step's prefills are over (written out); requests whose
        load was dispatched and that are not ``scheduled`` now wait another step."""
        now = time.monotonic()
        done = [p for p in self._open.values() if p.scheduled is not None]
        for profile in done:
            profile.prefilled = now
            self._write(profile)
            del self._open[profile.req_id]
        for req_id, tokens in scheduled.items():
            waiting = self._open.get(req_id)
            if waiting is not None and waiting.scheduled is None:
                waiting.scheduled, waiting.scheduled_tokens = now, tokens
        for profile in self._open.values():
            if profile.dispatched is not None and profile.scheduled is None:
                profile.wait_steps += 1

    def finished(self, req_id: str) -> None:
        """A request that ended before its prefill step did (aborted): written with what is known."""
        profile = self._open.pop(req_id, None)
        if profile is not None:
            self._write(profile)

    def close(self) -> None:
        for profile in list(self._open.values()):
            self._write(profile)
        self._open.clear()

    def _write(self, profile: Profile) -> None:
        line = json.dumps(profile.record()) + "\n"
        with self._lock:
            try:
                with open(self.path, "a") as fh:
                    fh.write(line)
            except OSError as exc:
                if not self._failed:
                    self._failed = True
                    log.warning("kvtier: cannot write profile_file %s: %s (profiles are dropped)", self.path, exc)
