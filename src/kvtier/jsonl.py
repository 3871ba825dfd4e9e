"""JSON Lines: one JSON object per line, blank lines skipped, errors naming file and line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


def json_objects(lines: Iterable[str], where: object) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line; ValueError ``WHERE:LINE: ...`` otherwise."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}:{lineno}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj
