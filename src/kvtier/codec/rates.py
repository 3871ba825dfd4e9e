"""``kv_codec: auto``: code a tier's chunk files only where decoding costs less than the bytes it saves.

Per tier (``ChunkFiles.codec_rates``), two rates are learnt from its own reads: the device's
(stored bytes per second of I/O, from coded and uncoded reads alike: a page-cache hit counts,
since that is what the next read of a warm file sees) and the codec's decoding (decoded bytes
per second). A chunk of ``raw`` bytes then reads in ``raw / device`` uncoded and in
``raw / (ratio * device) + raw / decode`` coded, so coding pays while
``device < decode * (1 - 1 / ratio)``. Until a rate is measured it is taken as
``DEFAULT_DEVICE`` (a network filesystem's) or ``DEFAULT_DECODE`` (one CPU core's), so a new
tier codes its first chunks and learns from reading them.
"""

from __future__ import annotations

import threading

DEFAULT_DEVICE = 0.2e9
"""Bytes per second of a tier not yet measured: about a network filesystem's single stream."""
DEFAULT_DECODE = 1.0e9
"""Decoded bytes per second not yet measured: about one CPU core's (benchmarks/codec_speed.py)."""
SMOOTHING = 0.2
"""Weight of each new read in the moving averages."""


class CodecRates:
    """Thread-safe; every method is O(1)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.device: float | None = None
        self.decode: float | None = None

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + SMOOTHING * (new - old)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self.device = self._mix(self.device, nbytes / seconds)

    def observe_decode(self, raw_bytes: int, seconds: float) -> None:
        if raw_bytes > 0 and seconds > 0:
            with self._lock:
                self.decode = self._mix(self.decode, raw_bytes / seconds)

    def worth_coding(self, ratio: float) -> bool:
        """Whether a chunk that codes ``ratio`` times smaller reads back sooner coded."""
        device = DEFAULT_DEVICE if self.device is None else self.device
        decode = DEFAULT_DECODE if self.decode is None else self.decode
        return ratio > 1 and device < decode * (1 - 1 / ratio)
