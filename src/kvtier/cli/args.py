"""argparse value types shared by the ``kvtier`` sub-commands."""

from __future__ import annotations

import argparse


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
    """``"4k-16k"`` -> (4096, 16384), as kvtier.bench.workload.parse_range reads it; 0 < min <= max."""
    from kvtier.bench.workload import parse_range

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
