"""Storage probes: how fast can a target feed KV back, raw and through kvtier's read path?

``run_probe(target, ...)`` probes a directory (``fs.py``) or a ``redis://`` / ``rediss://`` /
``valkey://`` server (``redis.py``); both return a ``ProbeResult`` (``result.py``) that
``probe_table`` shows and ``to_dict`` serializes (``kvtier probe --json``).
"""

from __future__ import annotations

import os
from typing import Any

from kvtier.probe.fs import FsProbeResult
from kvtier.probe.fs import run_probe as run_fs_probe
from kvtier.probe.result import DEFAULT_LAYOUT, ProbeResult, get_bandwidth, probe_table
from kvtier.tiers.redis import is_redis_url
from kvtier.urls import parse_pool_url

__all__ = ["DEFAULT_LAYOUT", "FsProbeResult", "ProbeResult", "get_bandwidth", "probe_table", "run_fs_probe",
           "run_probe"]


def run_probe(target: str | os.PathLike[str], **options: Any) -> ProbeResult:
    """Probe an existing directory (also as ``fs:///path``) or a Redis / Valkey URL (options:
    ``total_bytes``, ``threads``, ...). ValueError for a path that does not exist or a scheme
    there is no probe for: measuring the local disk in place of a missing mount would mislead."""
    if isinstance(target, str) and is_redis_url(target):
        from kvtier.probe.redis import run_redis_probe  # imports redis-py: optional

        return run_redis_probe(target, **options)
    if isinstance(target, str) and "://" in target:
        target = parse_pool_url(target)  # fs:///abs (ValueError for any other scheme)
    if not os.path.isdir(target):
        what = "is not a directory" if os.path.exists(target) else "does not exist"
        raise ValueError(f"probe: {target} {what}; give an existing directory on the filesystem to measure "
                         "(is it mounted?), or a redis:// URL")
    return run_fs_probe(target, **options)
