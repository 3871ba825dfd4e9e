"""argparse value types and flag groups shared by the ``kvtier`` sub-commands and the benchmarks.

The workload flags are defined once here (:func:`add_session_args`, :func:`add_load_args`), so
``kvtier bench run``, ``kvtier plan`` and benchmarks/soak.py spell and read them alike.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from argparse import _ActionsContainer

    from kvtier.workload import WorkloadSpec


def positive_ints(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; every value must be >= 1 (concurrency levels)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def token_range(text: str) -> tuple[int, int]:
    """``"4k-16k"`` -> (4096, 16384), as kvtier.workload.parse_range reads it; 0 < min <= max."""
    from kvtier.workload import parse_range

    try:
        lo, hi = parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"need 0 < min <= max: {text!r}")
    return lo, hi


def byte_size(value: str) -> int:
    """``"500GiB"``, ``"64MB"`` or a plain number of bytes."""
    from kvtier.config import parse_bytes

    try:
        return parse_bytes(value if not value.isdigit() else int(value), "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_session_args(group: _ActionsContainer, *, context: tuple[int, int] = (4096, 16384), turns: int = 2) -> None:
    """The flags of a session's shape, with the same names in ``kvtier bench``, ``kvtier plan``
    and benchmarks/soak.py: ``--context``, ``--turns``, ``--question-tokens``, ``--output-tokens``,
    ``--think`` and ``--seed``; ``context`` and ``turns`` are the command's defaults."""
    add = group.add_argument
    add("--context", type=token_range, default=context,
        help=f"context tokens per session, uniform in MIN-MAX (default {_tokens(context)})")
    add("--turns", type=int, default=turns, help=f"turns per session (default {turns})")
    add("--question-tokens", type=int, default=32, help="tokens in each user turn (default 32)")
    add("--output-tokens", type=int, default=32, help="tokens generated per turn (default 32)")
    add("--think", type=float, default=0.0, help="seconds before each later turn of a session (default 0)")
    # For kvtier bench and kvtier plan the same seed also gives the same context lengths (kvtier.workload).
    add("--seed", type=int, default=0, help="workload seed: the same seed gives the same sessions (default 0)")


def add_load_args(group: _ActionsContainer, *, workloads: Sequence[str], sessions: int | None,
                  concurrency: list[int]) -> None:
    """``--workload`` (one of ``workloads``, the first the default), ``--sessions`` (per
    concurrency level; None: the command picks) and ``--concurrency`` (levels), for the commands
    that run or simulate a workload at several concurrency levels."""
    add = group.add_argument
    add("--workload", choices=tuple(workloads), default=workloads[0],
        help="cold-resume: turn 0 populates, the cache is emptied, later turns are measured; chat: every turn "
             "measured, one engine lifetime; short-chat: one short prompt per session "
             f"(default {workloads[0]})")
    add("--sessions", type=int, default=sessions,
        help="sessions per concurrency level (default " + (f"{sessions})" if sessions else "2 x concurrency)"))
    add("--concurrency", type=positive_ints, default=concurrency,
        help=f"levels (sessions in flight), e.g. 1,2,4 (default {','.join(map(str, concurrency))})")


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The kvtier.workload.WorkloadSpec of :func:`add_session_args` and :func:`add_load_args`'s flags."""
    from kvtier.workload import WorkloadSpec

    return WorkloadSpec(args.workload, args.sessions, args.context, args.turns, args.question_tokens,
                        args.output_tokens, args.think, args.seed)


def _tokens(bounds: tuple[int, int]) -> str:
    """(4096, 16384) -> ``4k-16k``, as :func:`token_range` reads it."""
    return "-".join(f"{v // 1024}k" if v % 1024 == 0 else str(v) for v in bounds)
