"""Seeded workloads for the load client: cold resume, multi-turn chat, short chat.

* ``cold-resume`` (the seed's case): each session has a long context. Turn 0 (phase
  ``populate``, not measured) puts it in the cache; then the caller evicts the engine's own
  cache (restarts it, floods it, or sends the session to another instance); turn 1 (phase
  ``resume``, measured) asks a follow-up question over the whole conversation.
* ``chat``: sessions of several turns with think time between them, a short system prompt;
  every turn is measured. Later turns reuse the earlier ones' KV inside one engine.
* ``short-chat``: one short prompt per session, nothing to resume: the "where it does not
  help" case, which shows the cost of having the connector in the path.

Texts are filler words of the kind the tiny model's tokenizer was trained on. With a
tokenizer (``tokenizer.json`` or a model directory holding one) contexts have the requested
number of tokens; without one, one word counts as ``WORDS_PER_TOKEN`` tokens (an estimate).
The same seed gives the same sessions, so every configuration sees the same prompts, and their
context lengths are those ``kvtier plan`` simulates for the same seed (kvtier.workload, the model
this module renders as text).
:class:`RecurringContexts` hands out sessions one at a time for a timed run (the soak), over
contexts that recur.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.bench.client import Session, Turn
from kvtier.bench.model import SYLLABLES, WORDS
from kvtier.workload import WORKLOADS, Workload, WorkloadSpec, context_tokens, parse_range

if TYPE_CHECKING:
    from tokenizers import Tokenizer

WORDS_PER_TOKEN = 0.75  # filler words per token without a tokenizer (about 1.3 tokens a word)

__all__ = [  # WorkloadSpec, parse_range and the names of workloads live in kvtier.workload
    "WORDS_PER_TOKEN", "WORKLOADS", "RecurringContexts", "TextMaker", "Workload", "WorkloadSpec", "make_sessions",
    "parse_range",
]


class TextMaker:
    """Seeded filler text of a given length in tokens (exact with a tokenizer)."""

    def __init__(self, tokenizer: str | Path | None = None) -> None:
        self.tokenizer: Tokenizer | None = None
        if tokenizer is not None:
            from tokenizers import Tokenizer

            path = Path(tokenizer)
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return round(len(text.split()) / WORDS_PER_TOKEN)
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def words(self, rng: random.Random, tokens: int) -> str:
        """About ``tokens`` tokens of words; exactly that many or fewer with a tokenizer."""
        n = max(1, int(tokens * WORDS_PER_TOKEN))
        words = [rng.choice(WORDS) if rng.random() < 0.3 else "".join(rng.choices(SYLLABLES, k=rng.randint(1, 3)))
                 for _ in range(n)]
        if self.tokenizer is None:
            return " ".join(words)
        while self.count(" ".join(words)) < tokens:  # too short: add words, then cut below
            words += words[: max(1, len(words) // 4)]
        lo, hi = 1, len(words)  # the most words that stay within ``tokens``
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count(" ".join(words[:mid])) <= tokens:
                lo = mid
            else:
                hi = mid - 1
        return " ".join(words[:lo])


def make_sessions(spec: WorkloadSpec, text: TextMaker, first_id: int = 0) -> list[Session]:
    """The sessions of ``spec``, ids from ``first_id`` (distinct ids for distinct session sets).

    Context lengths are kvtier.workload.context_tokens's, as the planner draws them, whatever
    ``first_id``; the words are drawn per session from the seed, the workload and the id, so
    sets with distinct ids have distinct prompts (a server's cache cannot carry between them)."""
    sessions = []
    for i, tokens in enumerate(context_tokens(spec.seed, spec.context_tokens, spec.sessions)):
        sid = first_id + i
        rng = random.Random(f"{spec.seed}:{spec.workload}:{sid}")
        if spec.workload == "cold-resume":
            context = text.words(rng, tokens)
            turns = [Turn(f"Session {sid}. Summarize the text above. {text.words(rng, spec.question_tokens)}",
                          spec.output_tokens, phase="populate", measured=False)]
            turns += [Turn(f"Follow-up {t}: {text.words(rng, spec.question_tokens)}", spec.output_tokens,
                           phase="resume", think_s=spec.think_s) for t in range(1, spec.turns)]
        elif spec.workload == "chat":
            context = f"Session {sid}. " + text.words(rng, tokens)
            turns = [Turn(text.words(rng, spec.question_tokens), spec.output_tokens, phase="turn",
                          think_s=spec.think_s if t else 0.0) for t in range(spec.turns)]
        else:
            context = ""
            turns = [Turn(f"Session {sid}. " + text.words(rng, tokens), spec.output_tokens, phase="turn")]
        sessions.append(Session(sid, context, turns))
    return sessions


class RecurringContexts:
    """Sessions, one at a time, over contexts that recur (the soak run's workload).

    A session opens a never-seen context of ``tokens`` (min, max) tokens with probability
    ``new_fraction``, else one of the last ``window`` new ones again (a cache has often evicted
    it by then); its questions are always fresh, so only the context is shared. ``sessions``
    and ``new`` count the sessions and the new contexts handed out. Seeded: the same seeds
    give the same sequence.
    """

    def __init__(self, text: TextMaker, tokens: tuple[int, int], window: int, new_fraction: float,
                 seed: int) -> None:
        self.text, self.tokens, self.window, self.new_fraction, self.seed = text, tokens, window, new_fraction, seed
        self.rng = random.Random(f"{seed}:soak:pick")
        self.recent: list[int] = []  # context ids, oldest first
        self.texts: dict[int, str] = {}  # the window's contexts only
        self.next_id = self.sessions = self.new = 0

    def pick(self) -> tuple[int, str]:
        """The next session's context: (id, text)."""
        if not self.recent or self.rng.random() < self.new_fraction:
            cid, self.next_id = self.next_id, self.next_id + 1
            rng = random.Random(f"{self.seed}:soak:context:{cid}")
            self.texts[cid] = f"Context {cid}. " + self.text.words(rng, rng.randint(*self.tokens))
            self.recent.append(cid)
            if len(self.recent) > self.window:
                self.texts.pop(self.recent.pop(0), None)
            self.new += 1
        else:
            cid = self.rng.choice(self.recent)
        self.sessions += 1
        return cid, self.texts[cid]

    def session(self, turns: int, question_tokens: int, output_tokens: int, think_s: float = 0.0,
                seed: int = 0) -> tuple[int, Session]:
        """(context id, session) of ``turns`` fresh questions (``think_s`` before each later one),
        the questions drawn from ``seed`` and the session number."""
        cid, context = self.pick()
        rng = random.Random(f"{seed}:soak:session:{self.sessions}")
        return cid, Session(self.sessions, context, [
            Turn(f"Question {t}: " + self.text.words(rng, question_tokens), output_tokens,
                 think_s=think_s if t else 0.0) for t in range(turns)])
