"""The one workload model: what ``kvtier bench`` sends and ``kvtier plan`` simulates.

A :class:`WorkloadSpec` names the shape (``cold-resume``, ``chat`` or ``short-chat``), the number
of sessions, their context range in tokens and their turns. :func:`context_tokens` draws each
session's context length from the seed, and it is the only draw both sides share, so the same
spec and seed give sessions of the same lengths in both:

* kvtier.bench.workload renders them as text for the load client (kvtier.bench.client's
  ``Session``/``Turn``: messages to send, a conversation that grows as answers come back);
* kvtier.plan.workload turns them into token counts for the simulator (kvtier.plan.workload's
  ``Turn``: a request's whole prompt in tokens, and when it may start).

Those two ``Turn`` types are two renderings of one turn, not one type: the client's carries the
words of a user message, the planner's the token count of a whole prompt; each side owns its own.
Nothing here imports a dependency beyond the standard library.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

Workload = Literal["cold-resume", "chat", "short-chat"]
WORKLOADS: tuple[Workload, ...] = ("cold-resume", "chat", "short-chat")


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. ``context_tokens`` is a (min, max) range drawn uniformly per session."""

    workload: Workload = "cold-resume"
    sessions: int = 8
    context_tokens: tuple[int, int] = (4096, 16384)
    turns: int = 2
    question_tokens: int = 32
    output_tokens: int = 32
    think_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: {self.workload!r}; use one of {', '.join(WORKLOADS)}")
        lo, hi = self.context_tokens
        if not 0 < lo <= hi:
            raise ValueError(f"context_tokens: need 0 < min <= max, got {self.context_tokens}")
        if self.sessions < 1 or self.turns < 1 or self.output_tokens < 1:
            raise ValueError("sessions, turns and output_tokens must be >= 1")
        if self.workload == "cold-resume" and self.turns < 2:
            raise ValueError("cold-resume needs turns >= 2 (a populate turn, then resumed turns)")


def context_tokens(seed: int, tokens: tuple[int, int], sessions: int) -> list[int]:
    """The context lengths of ``sessions`` sessions, in order: ``random.Random(seed).randint(lo, hi)``
    drawn once per session. Session i's length depends only on the seed, the range and i (not on
    the workload, the turns or session ids), so every set of sessions of one seed opens with the
    same lengths: a concurrency level with more sessions extends a smaller one's."""
    lo, hi = tokens
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(sessions)]


def parse_range(text: str) -> tuple[int, int]:
    """``"4k-16k"`` -> (4096, 16384); ``"8192"`` -> (8192, 8192)."""

    def one(part: str) -> int:
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        try:
            return int(float(part.rstrip("k")) * scale)
        except ValueError:
            raise ValueError(f"not a token count: {part!r} (e.g. 4k-16k or 8192)") from None

    lo, _, hi = text.partition("-")
    return (one(lo), one(hi or lo))
