"""How every ``kvtier`` command prints machine-readable results (``--json``)."""

from __future__ import annotations

import json
from typing import Any


def emit_json(obj: dict[str, Any]) -> None:
    """One indented JSON object on stdout (keys sorted; anything else as its ``str``)."""
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))
