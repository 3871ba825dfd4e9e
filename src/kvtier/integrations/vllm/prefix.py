"""What the tiers hold of one request's prompt: the work of a scheduler's lookup thread.

``PrefixFinder.find`` walks the request's chunks from the first one past vLLM's own hit
(``lookup.RankTiers.locate``: the slowest tier any rank reads each from), then looks for the
longest *tail* after them (``keys.tail_id``: full blocks past the last full chunk), and, with
``load_mode: auto``, times one raw read in each tier of the hit whose read rate is not known yet
(``rateprobe.py``), so that tier's first load can run in the step.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.integrations.vllm.config import Deployment
from kvtier.integrations.vllm.lookup import RankTiers
from kvtier.integrations.vllm.rateprobe import RateProbe, Timed
from kvtier.integrations.vllm.requests import RequestState, Tail
from kvtier.keys import tail_id
from kvtier.policy import Rates
from kvtier.tiers.kinds import HOST


class PrefixFinder:
    """See the module docstring. ``tail_tokens`` 0: tails off; ``timed_reads``: time a tier's
    first read at its first hit (``load_mode: auto``)."""

    def __init__(self, views: RankTiers, dep: Deployment, chunk_tokens: int, tail_tokens: int, rates: Rates,
                 probe: RateProbe, timed_reads: bool) -> None:
        self.views, self.dep, self.rates, self.probe = views, dep, rates, probe
        self.chunk_tokens, self.block_size, self.tail_tokens = chunk_tokens, dep.block_size, tail_tokens
        self.timed_reads = timed_reads

    def lookable(self, state: RequestState) -> bool:
        """Whether a lookup could find anything: a full chunk, or a tail of a shorter prompt."""
        if state.chunk_ids:
            return True
        return bool(self.tail_tokens) and state.namespace is not None and self.usable(state) >= self.tail_tokens

    def usable(self, state: RequestState) -> int:
        """The prompt's tokens a load may cover: whole blocks, short of the last token (vLLM
        computes at least one token itself)."""
        return (state.prompt_len - 1) // self.block_size * self.block_size

    def locate(self, state: RequestState, first: int = 0) -> list[str]:
        """Tier names of chunks ``first..`` of the request's cached prefix (``RankTiers.locate``)."""
        return self.views.locate(state.chunk_ids, state.shard_ids, first)

    def find(self, state: RequestState, first: int) -> tuple[list[str], Tail | None]:
        """A lookup thread's work for one request: its chunks from ``first`` on, then its tail."""
        located = self.locate(state, first)
        tail = self._tail(state, first + len(located))
        if self.timed_reads:
            self._time_first_reads(state, first, located)
        return located, tail

    def _time_first_reads(self, state: RequestState, first: int, located: Sequence[str]) -> None:
        """Each tier of the hit with no measured read rate: time one read there (``RateProbe``),
        so ``auto`` can load in the step from the first hit on (rank 0's chunk stands for all)."""
        todo: dict[str, int] = {}  # tier name -> its first chunk in the hit
        for i, name in enumerate(located):
            if name != HOST.name and name not in self.rates.measured:
                todo.setdefault(name, i)
        if not todo:
            return
        levels = {level.name: level for level in self.views.by_rank.get(0, [])}
        ids = self.views.shard_ids(state.shard_ids, state.chunk_ids, self.dep.sharding.shards_of(0)[0])
        for name, i in todo.items():
            level = levels.get(name)
            if isinstance(level, Timed):
                self.probe.measure(level, ids[first + i])

    def _tail(self, state: RequestState, index: int) -> Tail | None:
        """The longest tail after full chunk ``index - 1`` that a load could use, or None.

        Looked for only when it can lengthen a hit: after a full chunk found (by this lookup or
        vLLM's own cache), or when every full chunk of the prompt was found; a new prompt that
        misses its first chunk costs no tail lookups."""
        step, request = self.tail_tokens, state.request
        if not step or state.namespace is None or request is None or request.prompt_token_ids is None:
            return None
        if index == 0 and state.chunk_ids:
            return None
        start = index * self.chunk_tokens
        usable = self.usable(state) - start
        parent = state.chunk_ids[index - 1].key if index else None
        for n in range(min(self.chunk_tokens - 1, usable) // step * step, 0, -step):
            tid = tail_id(state.namespace, request.prompt_token_ids, start, n, parent, state.extra)
            names = self.views.locate([tid], {}, 0, count_metrics=False)
            if names:
                return Tail(tid, index, n, names[0])
        return None
