"""What one simulation returns: per-request arrays of the measured requests, the engine's time
by kind, and the planner's summary row (hit rates, TTFT percentiles, throughput, bottleneck)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class SimResult:
    """Per-request arrays (measured requests only) and engine time accounting."""

    config: str
    start_s: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    hbm_tokens: np.ndarray
    loaded_tokens: dict[str, np.ndarray]
    load_s: np.ndarray
    capacity_miss_tokens: int
    busy_s: dict[str, float]
    bytes_read: dict[str, int]
    evictions: dict[str, int] = field(default_factory=dict)
    dropped_writes: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The planner's row: hit rates, TTFT percentiles, throughput, read rate, bottleneck."""
        n = len(self.ttft_s)
        if n == 0:
            return {"config": self.config, "requests": 0}
        end = float(np.max(self.start_s + self.e2e_s))
        duration = end - float(np.min(self.start_s))
        prompt = float(self.prompt_tokens.sum())
        hit = {t: float(v.sum()) / prompt for t, v in self.loaded_tokens.items()}
        hbm = float(self.hbm_tokens.sum()) / prompt
        busy = self.busy_s
        total_busy = sum(busy.values()) or 1.0
        shares = {k: v / total_busy for k, v in busy.items()}
        capacity_share = self.capacity_miss_tokens / prompt
        if capacity_share > 0.2:
            bottleneck = "capacity"
        else:
            bottleneck = {"load": "storage bandwidth", "prefill": "prefill compute", "decode": "decode compute",
                          "overhead": "step overhead"}[max(shares, key=lambda k: shares[k])]
        return {
            "config": self.config,
            "requests": n,
            "ttft_p50_s": float(np.percentile(self.ttft_s, 50)),
            "ttft_p90_s": float(np.percentile(self.ttft_s, 90)),
            "ttft_p99_s": float(np.percentile(self.ttft_s, 99)),
            "e2e_p50_s": float(np.percentile(self.e2e_s, 50)),
            "output_tok_s": float(self.output_tokens.sum()) / duration if duration > 0 else None,
            "hit_rate": {"hbm": hbm, **hit},
            "recompute_share": 1.0 - hbm - sum(hit.values()),
            "read_bytes_per_s": sum(self.bytes_read.values()) / duration if duration > 0 else 0.0,
            "load_p50_s": float(np.percentile(self.load_s, 50)),
            "engine_time_share": shares,
            "capacity_miss_share": capacity_share,
            "bottleneck": bottleneck,
            "evictions": self.evictions,
            "dropped_writes": self.dropped_writes,
            "duration_s": duration,
        }
