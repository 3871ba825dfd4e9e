"""``kv_codec: auto``: code a tier's chunk files only where decoding costs less than the bytes it saves.

Per tier (``ChunkFiles.codec_rates``), two rates are learnt from its own reads: the device's
(stored bytes per second of I/O, from coded and uncoded reads alike: a page-cache hit counts,
since that is what the next read of a warm file sees) and the codec's decoding (decoded bytes
per second). A chunk of ``raw`` bytes then reads in ``raw / device`` uncoded and in
``raw / (ratio * device) + raw / decode`` coded, so coding pays while
``device < decode * (1 - 1 / ratio)``. Until a rate is measured it is taken as
``DEFAULT_DEVICE`` (a network filesystem's) or ``DEFAULT_DECODE`` (one CPU core's), so a new
tier codes its first chunks and learns from reading them.

Each rate is a moving average of seconds per byte, not of bytes per second: what a chunk costs
is the time its bytes take, and a tier whose reads are mostly slow with a few page-cache hits
is a slow tier. Averaged as rates, the last few hits (each tens of times faster) outweighed
dozens of device reads and flipped such a tier to uncoded.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

DEFAULT_DEVICE = 0.2e9
"""Bytes per second of a tier not yet measured: about a network filesystem's single stream."""
DEFAULT_DECODE = 1.0e9
"""Decoded bytes per second not yet measured: about one CPU core's (benchmarks/codec_speed.py)."""
SMOOTHING = 0.2
"""Weight of each new read in the moving averages."""


class CodecRates:
    """Thread-safe; every method is O(1). ``where`` names the tier in the log line that says
    when its decision changes (INFO)."""

    def __init__(self, where: str = "") -> None:
        self._lock = threading.Lock()
        self.where = where
        self.device: float | None = None
        self.decode: float | None = None
        self._coding: bool | None = None

    @staticmethod
    def _mix(old: float | None, nbytes: int, seconds: float) -> float:
        """The moving average, as a rate, of ``old`` and a new sample, mixed as seconds per byte."""
        if old is None:
            return nbytes / seconds
        cost = 1 / old + SMOOTHING * (seconds / nbytes - 1 / old)
        return 1 / cost

    def observe_read(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self.device = self._mix(self.device, nbytes, seconds)

    def observe_decode(self, raw_bytes: int, seconds: float) -> None:
        if raw_bytes > 0 and seconds > 0:
            with self._lock:
                self.decode = self._mix(self.decode, raw_bytes, seconds)

    def worth_coding(self, ratio: float) -> bool:
        """Whether a chunk that codes ``ratio`` times smaller reads back sooner coded."""
        device = DEFAULT_DEVICE if self.device is None else self.device
        decode = DEFAULT_DECODE if self.decode is None else self.decode
        coding = ratio > 1 and device < decode * (1 - 1 / ratio)
        if coding != self._coding:  # unlocked: two writers may both log one change, never miss one
            self._coding = coding
            log.info("kvtier: kv_codec auto: %s %s: reads %.3f GB/s%s, decoding %.3f GB/s%s, %.2fx fewer bytes",
                     self.where or "a tier", "codes its chunk files" if coding else "writes the engine's bytes",
                     device / 1e9, "" if self.device is not None else " (not measured yet)", decode / 1e9,
                     "" if self.decode is not None else " (not measured yet)", ratio)
        return coding
