"""Workloads for the planner: a session trace file, or a generated distribution.

A workload is a list of phases run one after the other on the same tiers. Within a phase each
session's turns run in order (a turn starts no earlier than the previous one's last token plus
``think_s``). A phase is either open-loop (every turn has an ``arrival_s``, from a trace) or
closed-loop (``concurrency`` users, each taking the next session when its last one is done, as
``kvtier bench`` drives a server). ``restart_before`` empties the engine's KV and the
non-persistent tiers first: the cold-resume case (populate, restart, resume).

Generated sessions follow kvtier.workload, the model ``kvtier bench`` renders as text: the same
seed gives the same context lengths here and there. ``Turn`` here is a request as the simulator
sees it (a whole prompt in tokens), not the load client's message (kvtier.bench.client.Turn).
"""

from __future__ import annotations

import csv
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvtier.jsonl import json_objects
from kvtier.workload import context_tokens as draw_context_tokens

TRACE_COLUMNS = ("session", "arrival_s", "prompt_tokens", "output_tokens")


@dataclass(frozen=True)
class Turn:
    """One request. ``prompt_tokens`` is the whole prompt (earlier turns included)."""

    session: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float | None = None
    think_s: float = 0.0
    measured: bool = True


@dataclass(frozen=True)
class Phase:
    sessions: tuple[tuple[Turn, ...], ...]
    concurrency: int | None = None
    restart_before: bool = False
    name: str = "run"

    def __post_init__(self) -> None:
        if self.concurrency is None:
            missing = [t.session for s in self.sessions for t in s if t.arrival_s is None]
            if missing:
                raise ValueError(f"phase {self.name!r}: open-loop turns need arrival_s (session {missing[0]!r})")
        elif self.concurrency < 1:
            raise ValueError(f"phase {self.name!r}: concurrency must be >= 1, got {self.concurrency}")


Workload = tuple[Phase, ...]


def load_trace(path: str | Path) -> list[tuple[Turn, ...]]:
    """Read a CSV (with a header) or JSONL trace: ``session, arrival_s, prompt_tokens, output_tokens``
    per request, optionally ``measured``. Rows of one session become its turns in arrival order.

    Raises ValueError naming the file and line for a missing column, a non-number, a negative
    value, or a session whose prompts shrink (a later turn must carry the earlier context).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"{p}: {exc}") from None
    rows: list[tuple[int, dict[str, object]]] = []
    if p.suffix in (".jsonl", ".json") or text.lstrip().startswith("{"):
        rows = list(json_objects(text.splitlines(), p))
    else:
        reader = csv.DictReader(text.splitlines())
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{p}: CSV header lacks {missing}; need {list(TRACE_COLUMNS)}")
        rows = [(i, dict(r)) for i, r in enumerate(reader, 2)]
    if not rows:
        raise ValueError(f"{p}: no requests")
    by_session: dict[str, list[Turn]] = {}
    for line_no, row in rows:
        try:
            session = str(row["session"])
            arrival = float(row["arrival_s"])  # type: ignore[arg-type]
            prompt = int(float(row["prompt_tokens"]))  # type: ignore[arg-type]
            output = int(float(row["output_tokens"]))  # type: ignore[arg-type]
        except KeyError as exc:
            raise ValueError(f"{p}:{line_no}: missing field {exc}; need {list(TRACE_COLUMNS)}") from None
        except (TypeError, ValueError):
            raise ValueError(f"{p}:{line_no}: arrival_s, prompt_tokens and output_tokens must be numbers") from None
        if arrival < 0 or prompt < 1 or output < 1:
            raise ValueError(f"{p}:{line_no}: need arrival_s >= 0, prompt_tokens >= 1, output_tokens >= 1")
        measured = str(row.get("measured", True)).lower() not in ("false", "0", "no")
        by_session.setdefault(session, []).append(Turn(session, prompt, output, arrival, 0.0, measured))
    out = []
    for session, turns in by_session.items():
        turns.sort(key=lambda t: t.arrival_s or 0.0)
        for a, b in itertools.pairwise(turns):
            if b.prompt_tokens < a.prompt_tokens:
                raise ValueError(f"{p}: session {session!r}: prompt_tokens shrink from {a.prompt_tokens} to "
                                 f"{b.prompt_tokens}; each turn's prompt must include the earlier turns")
        out.append(tuple(turns))
    return out


def trace_workload(sessions: Sequence[tuple[Turn, ...]]) -> Workload:
    return (Phase(tuple(sessions), None, False, "trace"),)


def make_sessions(num_sessions: int, context_tokens: tuple[int, int], turns: int, *, question_tokens: int = 32,
                  output_tokens: int = 32, think_s: float = 0.0, seed: int = 0, prefix: str = "s",
                  measured_from_turn: int = 0) -> list[tuple[Turn, ...]]:
    """Sessions as ``kvtier bench`` builds them: turn 0 = context + question; each later turn adds
    the previous answer and a new question. Context lengths are uniform in ``context_tokens``,
    drawn by kvtier.workload.context_tokens: the lengths ``kvtier bench`` uses for the same seed."""
    lo, hi = context_tokens
    if num_sessions < 1 or turns < 1 or lo < 1 or hi < lo:
        raise ValueError("need sessions >= 1, turns >= 1 and a context range 1 <= MIN <= MAX")
    out = []
    for i, context in enumerate(draw_context_tokens(seed, context_tokens, num_sessions)):
        prompt = context + question_tokens
        session = []
        for k in range(turns):
            session.append(Turn(f"{prefix}{i}", prompt, output_tokens, None, think_s if k else 0.0,
                                k >= measured_from_turn))
            prompt += output_tokens + question_tokens
        out.append(tuple(session))
    return out


def cold_resume(num_sessions: int, context_tokens: tuple[int, int], concurrency: int, *, turns: int = 2,
                question_tokens: int = 32, output_tokens: int = 32, seed: int = 0,
                resume_order: str = "written") -> Workload:
    """The seed's case: turn 0 of every session (unmeasured), an engine restart, then the later
    turns at ``concurrency`` (measured). The sessions come back in the order they were written
    (``kvtier bench``'s order, LRU's worst case), or with ``resume_order="random"`` shuffled
    (seeded), as returning users would."""
    if resume_order not in ("written", "random"):
        raise ValueError(f"resume_order: {resume_order!r}; use written or random")
    sessions = make_sessions(num_sessions, context_tokens, turns, question_tokens=question_tokens,
                             output_tokens=output_tokens, seed=seed)
    populate = tuple((replace(s[0], measured=False),) for s in sessions)
    resume = tuple(s[1:] for s in sessions if len(s) > 1)
    if resume_order == "random":
        order = list(resume)
        random.Random(f"{seed}:resume-order").shuffle(order)
        resume = tuple(order)
    if not resume:
        raise ValueError("cold-resume needs turns >= 2 (turn 0 populates, later turns resume)")
    return (Phase(populate, concurrency, False, "populate"), Phase(resume, concurrency, True, "resume"))


def chat(num_sessions: int, context_tokens: tuple[int, int], concurrency: int, *, turns: int = 2,
         question_tokens: int = 32, output_tokens: int = 32, think_s: float = 0.0, seed: int = 0) -> Workload:
    """Multi-turn sessions with think time, every turn measured, one engine lifetime."""
    sessions = make_sessions(num_sessions, context_tokens, turns, question_tokens=question_tokens,
                             output_tokens=output_tokens, think_s=think_s, seed=seed)
    return (Phase(tuple(sessions), concurrency, False, "chat"),)
