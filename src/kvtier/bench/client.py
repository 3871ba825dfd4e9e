"""An async load client for OpenAI-compatible servers (vLLM, SGLang, ...): one record per request.

Sessions are conversations: a long first message (the context) and turns the client sends one
after the other, each with the whole conversation so far, so a server with a prefix cache (or
kvtier behind it) can reuse the KV of earlier turns. ``run`` drives up to ``concurrency``
sessions at once (a closed loop: a session holds its slot through its think time, like a user
reading an answer) and records, per request:

* ``ttft_s``: from sending the request to the first streamed chunk carrying text;
* ``itl_s``: mean time between later text chunks; ``e2e_s``: until the stream ended;
* ``prompt_tokens``, ``output_tokens`` and ``cached_tokens`` as the server reports them in the
  stream's final usage chunk (``cached_tokens`` is None when it reports none: vLLM needs
  ``--enable-prompt-tokens-details``);
* ``error`` and ``status``: a failed request (HTTP error, broken stream, timeout) is recorded
  with its error, never dropped, and its session goes on;
* ``request_id``: what the client sent as ``X-Request-Id`` (vLLM builds its own request id
  from it: the key to join a server-side record, such as kvtier's resume profile).

Records are plain dicts with the keys of ``RECORD_KEYS`` plus the caller's tags (config,
concurrency, ...); ``start_s`` counts from the client's ``origin``. :func:`closed_loop` runs
sessions for a set time instead of a set list (the soak run).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Api = Literal["completions", "chat"]
Record = dict[str, Any]
RECORD_KEYS = ("phase", "measured", "session", "turn", "instance", "start_s", "ttft_s", "itl_s", "e2e_s",
               "prompt_tokens", "output_tokens", "cached_tokens", "error", "status", "request_id")


@dataclass
class Turn:
    """One user message. ``think_s`` is waited before sending it (the user's reading time)."""

    text: str
    max_tokens: int
    phase: str = "turn"
    measured: bool = True
    think_s: float = 0.0


@dataclass
class Session:
    """A conversation: ``context`` opens it, ``turns`` follow; ``messages`` grows as it runs."""

    id: int
    context: str
    turns: list[Turn]
    messages: list[dict[str, str]] = field(default_factory=list)

    def conversation(self, user_text: str) -> list[dict[str, str]]:
        first = [{"role": "system", "content": self.context}] if self.context else []
        return [*first, *self.messages, {"role": "user", "content": user_text}]


@dataclass(frozen=True)
class Target:
    """One server: ``base_url`` like ``http://127.0.0.1:8000`` and the model name it serves."""

    base_url: str
    model: str


def render_prompt(messages: Sequence[dict[str, str]]) -> str:
    """The conversation as one completion prompt; each turn's prompt extends the previous one."""
    parts = []
    for m in messages:
        if m["role"] == "user":  # the answer cue goes with the question, so answers append verbatim
            parts.append(f"\n\nUser: {m['content']}\n\nAssistant:")
        else:
            parts.append(m["content"])
    return "".join(parts)


class LoadClient:
    """Streams requests to one or more targets and records each one (see the module docstring).

    ``route(session, turn_index)`` picks the target index for a request (default: target 0);
    the cross-instance benchmark sends a resumed session to the other instance with it.
    """

    def __init__(self, targets: Sequence[Target], *, api: Api = "completions", timeout_s: float = 600.0,
                 ignore_eos: bool = True, origin: float | None = None,
                 route: Callable[[Session, int], int] | None = None) -> None:
        if not targets:
            raise ValueError("LoadClient needs at least one target")
        if api not in ("completions", "chat"):
            raise ValueError(f"api: {api!r}; use completions or chat")
        self.targets = list(targets)
        self.api = api
        self.timeout_s = timeout_s
        self.ignore_eos = ignore_eos
        self.origin = time.perf_counter() if origin is None else origin
        self.route = route or (lambda session, turn: 0)

    async def run(self, sessions: Sequence[Session], turns: range, concurrency: int, *,
                  tags: dict[str, Any] | None = None,
                  on_record: Callable[[Record], None] | None = None) -> list[Record]:
        """Send turns ``turns`` of every session, ``concurrency`` sessions at a time."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, not {concurrency}")
        records: list[Record] = []
        slots = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=10.0), limits=limits) as http:

            async def drive(session: Session) -> None:
                async with slots:
                    for t in turns:
                        if t >= len(session.turns):
                            break
                        turn = session.turns[t]
                        if turn.think_s > 0:
                            await asyncio.sleep(turn.think_s)
                        record = await self._request(http, session, t, turn)
                        record.update(tags or {})
                        records.append(record)
                        if on_record is not None:
                            on_record(record)

            await asyncio.gather(*(drive(s) for s in sessions))
        return records

    async def _request(self, http: httpx.AsyncClient, session: Session, index: int, turn: Turn) -> Record:
        instance = self.route(session, index)
        target = self.targets[instance]
        messages = session.conversation(turn.text)
        body: dict[str, Any] = {"model": target.model, "max_tokens": turn.max_tokens, "temperature": 0.0,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True  # fixed output lengths (vLLM and SGLang accept it)
        if self.api == "chat":
            url = f"{target.base_url}/v1/chat/completions"
            body["messages"] = messages
        else:
            url = f"{target.base_url}/v1/completions"
            body["prompt"] = render_prompt(messages)
        request_id = f"kvtb-{session.id}-{index}-{uuid.uuid4().hex[:8]}"
        record: Record = {"phase": turn.phase, "measured": turn.measured, "session": session.id, "turn": index,
                          "instance": instance, "ttft_s": None, "itl_s": None, "e2e_s": None,
                          "prompt_tokens": None, "output_tokens": 0, "cached_tokens": None, "error": None,
                          "status": None, "request_id": request_id}
        t0 = time.perf_counter()
        record["start_s"] = t0 - self.origin
        text: list[str] = []
        try:
            await asyncio.wait_for(self._stream(http, url, body, t0, record, text, request_id), self.timeout_s)
        except TimeoutError:
            record["error"] = f"timeout: no complete response within {self.timeout_s:g} s"
        except httpx.HTTPError as exc:
            record["error"] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        record["e2e_s"] = time.perf_counter() - t0
        # The conversation goes on with whatever came back, as a user's would.
        session.messages += [messages[-1], {"role": "assistant", "content": "".join(text)}]
        return record

    async def _stream(self, http: httpx.AsyncClient, url: str, body: dict[str, Any], t0: float,
                      record: Record, text: list[str], request_id: str) -> None:
        first = last = None
        chunks = 0
        async with http.stream("POST", url, json=body, headers={"X-Request-Id": request_id}) as resp:
            record["status"] = resp.status_code
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                record["error"] = f"HTTP {resp.status_code}: {detail}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    record["error"] = f"bad stream chunk: {data[:120]}"
                    return
                if "error" in event and not event.get("choices"):
                    record["error"] = f"server error in stream: {json.dumps(event['error'])[:300]}"
                    return
                for choice in event.get("choices") or []:
                    piece = choice.get("text") if self.api == "completions" else (choice.get("delta") or {}).get(
                        "content")
                    if piece:
                        now = time.perf_counter()
                        first = now if first is None else first
                        last = now
                        chunks += 1
                        text.append(piece)
                usage = event.get("usage")
                if usage:
                    record["prompt_tokens"] = usage.get("prompt_tokens")
                    record["output_tokens"] = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    record["cached_tokens"] = details.get("cached_tokens")
        if first is None:
            record["error"] = "the stream ended without any text"
            return
        record["ttft_s"] = first - t0
        tokens = record["output_tokens"] or chunks
        if last is not None and tokens > 1:
            record["itl_s"] = (last - first) / (tokens - 1)
        if not record["output_tokens"]:
            record["output_tokens"] = chunks  # the server sent no usage: count text chunks


async def closed_loop(client: LoadClient, seconds: float, slots: int,
                      next_session: Callable[[], tuple[Session, dict[str, Any]]], *,
                      on_record: Callable[[Record], None] | None = None, interval: float = 10.0,
                      tick: Callable[[float], None] | None = None, stall_s: float = math.inf,
                      stalled: Callable[[float, float], None] | None = None, drain_s: float = 120.0,
                      say: Callable[[str], None] | None = None) -> float:
    """Run sessions in ``slots`` closed-loop slots for ``seconds``; returns the seconds it took.

    Each slot runs ``next_session()``'s session (every turn, tagged with its tags) after the
    other and starts none after the deadline; sessions in flight then get ``drain_s`` to finish
    and are cancelled (unrecorded; ``say`` hears how many). ``tick(t)`` (seconds since the
    start) runs every ``interval`` seconds and once at the deadline, while the load is on; an
    exception from it stops the load and is raised. ``stalled(t, gap)`` runs every second
    while no request has ended for ``stall_s`` seconds (``gap``: since the last end).
    """
    t0 = time.perf_counter()
    deadline = t0 + seconds
    last_end = t0

    def record(r: Record) -> None:
        nonlocal last_end
        last_end = time.perf_counter()
        if on_record is not None:
            on_record(r)

    async def watchdog() -> None:
        while stalled is not None:
            await asyncio.sleep(1.0)
            now = time.perf_counter()
            if now - last_end >= stall_s:
                stalled(now - t0, now - last_end)

    async def slot() -> None:
        while time.perf_counter() < deadline:
            session, tags = next_session()
            await client.run([session], range(len(session.turns)), 1, on_record=record, tags=tags)

    async def ticker() -> None:  # runs to the deadline even without ``tick``: the drain starts there
        for n in itertools.count(1):
            await asyncio.sleep(max(0.0, min(deadline, t0 + n * interval) - time.perf_counter()))
            if time.perf_counter() >= deadline - 0.5:
                return
            if tick is not None:
                tick(time.perf_counter() - t0)

    tasks = [asyncio.create_task(slot()) for _ in range(slots)]
    ticks, dog = asyncio.create_task(ticker()), asyncio.create_task(watchdog())
    await asyncio.wait([ticks], timeout=max(0.0, deadline - time.perf_counter()) + 1.0)
    if ticks.done() and not ticks.cancelled() and (exc := ticks.exception()) is not None:
        for task in [*tasks, dog]:
            task.cancel()
        await asyncio.gather(*tasks, dog, return_exceptions=True)
        raise exc
    ticks.cancel()
    if tick is not None:
        tick(time.perf_counter() - t0)  # the last call under load
    _, late = await asyncio.wait(tasks, timeout=drain_s)
    for task in [*late, dog]:
        task.cancel()
    await asyncio.gather(*tasks, dog, return_exceptions=True)
    if late and say is not None:
        say(f"  {len(late)} session(s) still running {drain_s:g} s after the deadline: cancelled")
    for task in tasks:
        if not task.cancelled() and (exc := task.exception()) is not None:
            raise exc
    return time.perf_counter() - t0
