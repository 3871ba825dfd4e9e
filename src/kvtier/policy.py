"""Load or recompute: the one rule kvtier decides by, and the rates it decides with.

Engine-free: the vLLM connector's scheduler (per request, from rates its workers measure) and
the planner's simulator (per simulated request, from the hardware spec) both call it, so a plan
predicts the decisions a deployment will make.

A cached prefix is loaded when reading it is predicted to take less time than prefilling it:
``sum(bytes / rate + latency)`` over the reads, against ``tokens / prefill rate``. Before a
prefill rate is known a hit is presumed faster (reading KV is orders of magnitude cheaper than
computing it on every engine kvtier targets).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.tiers.kinds import KINDS

EWMA_WEIGHT = 0.3
"""The weight of a new measurement in a rate: rates drift with load and the page cache, and one
slow read (a cold file, a busy neighbour) must not flip every later decision."""

LOAD_MODES = ("auto", "async", "sync")
"""The connector's ``load_mode`` values, which the planner's simulator models too."""

SYNC_IDLE_MAX_S = 0.05
"""With ``load_mode: auto``, the longest predicted load run inside the step of an idle engine
(predicted from measured read rates: until a tier was read from, by a load or by the lookup's
timed first read, the vLLM connector's ``rateprobe.py``, its loads run in the background).
A background load costs its request two engine steps after the read (one reports it, the
next prefills it: measured 2-3 ms idle on the tiny model, a decode step each when busy); a
load in the step costs nothing when nothing else runs, but holds up a request that arrives
during it by up to its length. The planner's simulator decides by it too."""


@dataclass(frozen=True)
class Read:
    """One read a load would do: ``nbytes`` from a tier at ``bytes_per_s`` after ``latency_s``."""

    nbytes: float
    bytes_per_s: float
    latency_s: float = 0.0


def predicted_load_s(reads: Iterable[Read]) -> float:
    """Seconds to do ``reads`` one after another (each read's own rate already counts the
    parallelism it is measured or specified with)."""
    return sum(r.nbytes / r.bytes_per_s + r.latency_s for r in reads)


def pays_off(load_s: float, recompute_s: float | None) -> bool:
    """Load rather than recompute? ``recompute_s`` None: no prefill rate known yet, load."""
    return recompute_s is None or load_s < recompute_s


def ewma(prev: float | None, sample: float) -> float:
    return sample if prev is None else (1 - EWMA_WEIGHT) * prev + EWMA_WEIGHT * sample


@dataclass
class Rates:
    """Read rates per tier and the prefill rate, measured as they come, priors until then.

    ``read_bytes_per_s`` is the configured read rate (``read_gbps``); each tier kind's prior is
    that times its ``read_prior`` (host DRAM's is 10x). ``prefill_tokens_per_s`` None: not
    known until the first prefill is measured.
    """

    read_bytes_per_s: float
    prefill_tokens_per_s: float | None = None
    reads: dict[str, float] = field(default_factory=dict)
    measured: dict[str, int] = field(default_factory=dict)  # reads measured per tier

    def __post_init__(self) -> None:
        for name, kind in KINDS.items():
            self.reads.setdefault(name, kind.read_prior * self.read_bytes_per_s)

    def read_rate(self, tier: str) -> float:
        return self.reads.get(tier, self.read_bytes_per_s)

    def recompute_s(self, tokens: int) -> float | None:
        return None if self.prefill_tokens_per_s is None else tokens / self.prefill_tokens_per_s

    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load read ``nbytes`` from ``tier`` in ``seconds`` (nonsense samples are ignored)."""
        if seconds <= 0 or nbytes <= 0:
            return
        n = self.measured.get(tier, 0)
        self.reads[tier] = ewma(self.reads.get(tier) if n else None, nbytes / seconds)
        self.measured[tier] = n + 1

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self.prefill_tokens_per_s = ewma(self.prefill_tokens_per_s, tokens / seconds)

    def known(self) -> tuple[bool, int]:
        """What has been measured at all (changes when a rate is measured for the first time)."""
        return self.prefill_tokens_per_s is not None, len(self.measured)

    def snapshot(self) -> dict[str, object]:
        return {"read_gbps": {t: r / 1e9 for t, r in self.reads.items() if t in self.measured},
                "prefill_tokens_per_s": self.prefill_tokens_per_s}
