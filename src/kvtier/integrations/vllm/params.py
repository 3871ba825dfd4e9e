"""What a request asks of kvtier through ``kv_transfer_params``: hostile until checked.

Any API client can send anything there. ``RequestParams.retain_s`` reads
``{"kvtier": {"retain_s": N}}``: a value that is not a finite number >= 0 is ignored, one over
``max_retain_s`` is clamped; both are counted (``rejected_params``) with one warning per kind,
never an exception (an unchecked 1e20 once killed the writer threads).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from kvtier.integrations.vllm.counters import count

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class RequestParams:
    """See the module docstring; ``default_s`` is the server's ``retain_s``."""

    def __init__(self, default_s: float, max_s: float, counters: dict[str, int]) -> None:
        self.default_s, self.max_s, self.counters = default_s, max_s, counters
        self._warned: set[str] = set()

    def retain_s(self, request: Request) -> float:
        """The request's ``kv_transfer_params: {"kvtier": {"retain_s": ...}}``, else the server's."""
        params = getattr(request, "kv_transfer_params", None) or {}
        mine: Any = params.get("kvtier") if isinstance(params, dict) else None
        if mine is None:
            return self.default_s
        if not isinstance(mine, dict):
            self._rejected(request, "kv_transfer_params kvtier must be a mapping", mine)
            return self.default_s
        if "retain_s" not in mine:
            return self.default_s
        value = mine["retain_s"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            self._rejected(request, "kvtier.retain_s must be a finite number >= 0", value)
            return self.default_s
        if value > self.max_s:
            self._rejected(request, f"kvtier.retain_s is over max_retain_s={self.max_s:g}; clamped", value)
            return self.max_s
        return float(value)

    def _rejected(self, request: Request, why: str, value: object) -> None:
        count(self.counters, "rejected_params")
        if why not in self._warned:  # once per kind: a hostile client repeats it a million times
            self._warned.add(why)
            shown = repr(value)
            log.warning("kvtier: request %s: %s, got %s (ignored; later ones are only counted in "
                        "kvtier_rejected_request_params_total)", request.request_id, why,
                        shown if len(shown) <= 80 else shown[:77] + "...")
