"""What a KV codec (``kv_codec``) changes in a plan: the persistent tiers (disk, pool) hold
``ratio`` times the tokens in the same bytes, and move them at the rate of the device and the
codec together.

A chunk of ``n`` decoded bytes reads in ``n / (ratio * read) + n / decode`` (read, then decode on
the read threads: the sum, not the larger of the two, since one chunk's decode waits for its
bytes), and writes in ``n / encode + n / (ratio * write)``. Host DRAM keeps the engine's bytes.
The figures are per CPU core, from ``benchmarks/codec_speed.py`` (docs/codecs.md), times
``threads`` (the cores the read and write threads get; on a GPU server the codec would run on
the GPU, which this model does not describe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CodecFigures:
    ratio: float
    encode_bytes_per_s: float
    decode_bytes_per_s: float


FIGURES: dict[str, CodecFigures] = {
    # benchmarks/codec_speed.py --repeats 100: one core of a 2-core AMD EPYC (AVX-512), SmolLM2's
    # chunk with its keys channel by channel as vLLM's CPU build stores them (median of 3 runs;
    # docs/codecs.md, "Speed")
    "lossless": CodecFigures(1.50, 0.46e9, 1.73e9),
    "fp8": CodecFigures(1.97, 0.68e9, 2.36e9),
    "k8v4": CodecFigures(2.51, 0.75e9, 2.77e9),
    "k8v8": CodecFigures(1.91, 0.85e9, 2.88e9),
}


def apply(hardware: dict[str, Any], name: str, threads: int = 2, ratio: float | None = None) -> dict[str, Any]:
    """``hardware`` (``spec.hardware_to_dict`` form) as the codec ``name`` makes it; ``ratio``
    overrides the codec's measured one (what it reaches on another model's KV)."""
    if name not in FIGURES:
        raise ValueError(f"--kv-codec {name!r}: one of {', '.join(FIGURES)}")
    if threads < 1:
        raise ValueError("--codec-threads must be at least 1")
    fig = FIGURES[name]
    r = fig.ratio if ratio is None else ratio
    if r <= 0:
        raise ValueError("--codec-ratio must be positive")
    tiers = {}
    for tier_name, tier in (hardware.get("tiers") or {}).items():
        tier = dict(tier)
        if tier.get("persistent", True):
            tier["capacity_bytes"] = int(tier["capacity_bytes"] * r)
            tier["read_bytes_per_s"] = 1 / (1 / (r * tier["read_bytes_per_s"]) + 1 / (threads * fig.decode_bytes_per_s))
            tier["write_bytes_per_s"] = 1 / (1 / (r * tier["write_bytes_per_s"]) +
                                             1 / (threads * fig.encode_bytes_per_s))
        tiers[tier_name] = tier
    return {**hardware, "tiers": tiers}
