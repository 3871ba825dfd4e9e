"""Coding-assistant sessions of real text, for a real model: Python's own standard library sources.

Every CPython install ships its standard library as source, so these contexts need no download
and are the same on every machine with the same Python. A session is one chat-templated user
turn: a source file (cut at a line so the prompt fits its token budget) and a question about
it. ``next_turn`` extends a conversation the way a token-aware client does: the previous
prompt, the answer's tokens, then the next user message.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILES = ("json/decoder.py", "textwrap.py", "heapq.py", "shlex.py", "fractions.py", "bisect.py", "string.py",
         "graphlib.py", "colorsys.py", "difflib.py", "calendar.py", "statistics.py", "ipaddress.py", "csv.py",
         "secrets.py", "queue.py")
"""Standard library modules every CPython 3.11+ has, in the order sessions take them."""
QUESTIONS = ("What does this module do? Answer in two sentences.",
             "Which function here would you test first, and why?",
             "Explain the first class or function defined in this file.",
             "What could go wrong when calling this code with unexpected input?")


@dataclass(frozen=True)
class Session:
    """One coding question: ``prompt`` is its token ids (chat template applied)."""

    name: str
    prompt: list[int]
    question: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(count: int, min_bytes: int) -> list[str]:
    """``count`` standard library sources (paths under ``stdlib_dir``) of ``min_bytes`` or more,
    spread evenly over the sorted list; no tests and no IDLE. SystemExit when there are fewer."""
    root = stdlib_dir()
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if "test" not in p.parts and "idlelib" not in p.parts and p.stat().st_size >= min_bytes)
    if len(files) < count:
        raise SystemExit(f"only {len(files)} standard library files of {min_bytes} bytes or more")
    step = len(files) / count
    return [files[int(i * step)] for i in range(count)]


def _ids(encoded: Any) -> list[int]:
    """Token ids of ``apply_chat_template(..., tokenize=True)`` (a list, or a mapping in newer
    transformers releases)."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """``messages`` with the model's chat template, ending with the assistant's turn to speak."""
    return _ids(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True))


def _message(name: str, source: str, question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Here is `{name}` from Python's standard library:\n\n```python\n"
                                        f"{source}\n```\n\n{question}"}]


def session(tokenizer: Any, name: str, max_tokens: int, question: str) -> Session:
    """The session about ``name`` (a path under the standard library), its source cut at the last
    line that keeps the prompt within ``max_tokens``."""
    lines = (stdlib_dir() / name).read_text(encoding="utf-8").splitlines()
    lo, hi = 1, len(lines)
    if len(chat(tokenizer, _message(name, "\n".join(lines), question))) <= max_tokens:
        lo = hi
    while lo < hi:  # the most lines that fit
        mid = (lo + hi + 1) // 2
        if len(chat(tokenizer, _message(name, "\n".join(lines[:mid]), question))) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    return Session(name, chat(tokenizer, _message(name, "\n".join(lines[:lo]), question)), question)


def sessions(tokenizer: Any, n: int, max_tokens: int, first: int = 0) -> list[Session]:
    """``n`` sessions about different files (``FILES[first:]``), each within ``max_tokens``."""
    if n + first > len(FILES):
        raise ValueError(f"at most {len(FILES) - first} sessions from FILES[{first}:], asked for {n}")
    return [session(tokenizer, FILES[first + i], max_tokens, QUESTIONS[(first + i) % len(QUESTIONS)])
            for i in range(n)]


def next_turn(tokenizer: Any, prompt: Sequence[int], answer: Sequence[int], message: str) -> list[int]:
    """The next turn's prompt: this turn's prompt, the answer's own tokens (ending with the end of
    turn, added if the answer was cut short), then the user's next ``message``."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tail = [] if answer and answer[-1] == end else [end]
    follow = tokenizer.encode(f"\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)
    return [*prompt, *answer, *tail, *follow]
