"""kvtier.bench.client against a small fake OpenAI server on loopback (streams real SSE).

The fake server reads instructions from the prompt's last user message: ``wait=S`` delays the
first token, ``gap=S`` spaces later ones, ``status=N`` answers with an HTTP error, ``hang``
never answers, ``nousage`` leaves out the usage chunk.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvtier.bench.client import LoadClient, Session, Target, Turn, render_prompt

TOKENS = 5


class FakeOpenAI(BaseHTTPRequestHandler):
    bodies: list[dict[str, Any]]
    spans: list[tuple[float, float]]  # (start, end) of each request, server-side (the fixture resets it)
    active = 0
    peak = 0
    lock = threading.Lock()

    def log_message(self, *args: Any) -> None:
        return

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append({"path": self.path, **body})
        last = body["messages"][-1]["content"] if "messages" in body else body["prompt"].rsplit("User: ", 1)[-1]
        opts = dict(re.findall(r"(\w+)=([\d.]+)", last))
        with FakeOpenAI.lock:
            FakeOpenAI.active += 1
            FakeOpenAI.peak = max(FakeOpenAI.peak, FakeOpenAI.active)
        start = time.perf_counter()
        try:
            if "hang" in last:
                time.sleep(5)
                return
            if "status" in opts:
                self.send_response(int(opts["status"]))
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "engine died"}}')
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(float(opts.get("wait", 0)))
            chat = "messages" in body
            for i in range(body["max_tokens"]):
                if i:
                    time.sleep(float(opts.get("gap", 0)))
                choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
                self._event({"choices": [choice]})
            if "nousage" not in last:
                self._event({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": body["max_tokens"],
                                                      "prompt_tokens_details": {"cached_tokens": 64}}})
            self.wfile.write(b"data: [DONE]\n\n")
        finally:
            with FakeOpenAI.lock:
                FakeOpenAI.active -= 1
                FakeOpenAI.spans.append((start, time.perf_counter()))

    def _event(self, obj: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture
def server() -> Iterator[str]:
    FakeOpenAI.bodies, FakeOpenAI.spans, FakeOpenAI.active, FakeOpenAI.peak = [], [], 0, 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def one(text: str, max_tokens: int = TOKENS) -> list[Session]:
    return [Session(0, "context words", [Turn(text, max_tokens)])]


def run(client: LoadClient, sessions: list[Session], concurrency: int = 1,
        turns: range | None = None) -> list[dict[str, Any]]:
    return asyncio.run(client.run(sessions, turns or range(0, 10), concurrency, tags={"config": "fake"}))


def test_ttft_is_the_first_streamed_token_not_the_response(server: str) -> None:
    client = LoadClient([Target(server, "m")])
    [rec] = run(client, one("wait=0.3 gap=0.1"))
    assert rec["error"] is None and rec["status"] == 200
    # Bounds from the server's own timeline (first token at 0.3 s, the last at 0.3 + 4 x 0.1 s),
    # not from the client's reading of the first token: a busy machine can deliver that one late
    # and the rest in a burst, which shortens the client's gaps but never the server's.
    assert 0.3 <= rec["ttft_s"] < 0.6
    assert rec["e2e_s"] >= 0.3 + 4 * 0.1 > rec["ttft_s"]
    assert 0.05 <= rec["itl_s"] < 0.2
    assert (rec["prompt_tokens"], rec["output_tokens"], rec["cached_tokens"]) == (100, TOKENS, 64)
    assert rec["config"] == "fake" and rec["start_s"] >= 0
    body = FakeOpenAI.bodies[0]
    assert body["path"] == "/v1/completions" and body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_http_errors_refused_connections_and_timeouts_are_recorded(server: str) -> None:
    client = LoadClient([Target(server, "m")], timeout_s=1.0)
    sessions = [Session(0, "", [Turn("status=503", 3)]), Session(1, "", [Turn("hang", 3)]),
                Session(2, "", [Turn("fine", 3)])]
    recs = {r["session"]: r for r in run(client, sessions, concurrency=3)}
    assert len(recs) == 3
    assert recs[0]["status"] == 503 and "HTTP 503" in recs[0]["error"] and "engine died" in recs[0]["error"]
    assert recs[0]["ttft_s"] is None
    assert recs[1]["error"].startswith("timeout") and 1.0 <= recs[1]["e2e_s"] < 2.0
    assert recs[2]["error"] is None and recs[2]["output_tokens"] == 3
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    [rec] = run(LoadClient([Target(dead, "m")]), one("x"))
    assert rec["error"] and "Connect" in rec["error"] and rec["status"] is None


def test_concurrency_bounds_sessions_in_flight(server: str) -> None:
    client = LoadClient([Target(server, "m")])
    sessions = [Session(i, "", [Turn("wait=0.2", 2)]) for i in range(6)]
    t0 = time.perf_counter()
    recs = run(client, sessions, concurrency=2)
    took = time.perf_counter() - t0
    assert len(recs) == 6 and all(r["error"] is None for r in recs)
    assert FakeOpenAI.peak == 2
    assert took >= 0.6  # three waves of two at least
    # Two in flight nearly all the time, not one after another: the requests' summed time is
    # about twice the time any was in flight (a client that sent one at a time: once). Both
    # are the server's own clock, so a slow machine stretches them alike.
    spans = sorted(FakeOpenAI.spans)
    busy, end = 0.0, spans[0][0]
    for s0, s1 in spans:
        busy += max(0.0, s1 - max(s0, end))
        end = max(end, s1)
    assert sum(s1 - s0 for s0, s1 in spans) / busy >= 1.6


def test_turns_extend_the_conversation_so_prefixes_are_reused(server: str) -> None:
    client = LoadClient([Target(server, "m")])
    session = Session(0, "LONG CONTEXT", [Turn("first", 3, phase="populate", measured=False),
                                          Turn("second", 3, phase="resume")])
    populate = run(client, [session], turns=range(0, 1))
    resume = run(client, [session], turns=range(1, 2))
    first, second = (b["prompt"] for b in FakeOpenAI.bodies)
    assert first.startswith("LONG CONTEXT") and second.startswith(first + " t0 t1 t2")
    assert (populate[0]["phase"], populate[0]["measured"]) == ("populate", False)
    assert (resume[0]["phase"], resume[0]["turn"]) == ("resume", 1)
    assert render_prompt(session.messages[:1]).endswith("User: first\n\nAssistant:")


def test_chat_api_and_a_server_without_usage(server: str) -> None:
    client = LoadClient([Target(server, "m")], api="chat", ignore_eos=False)
    [rec] = run(client, one("nousage gap=0.01"))
    assert rec["error"] is None and rec["output_tokens"] == TOKENS  # counted from the stream
    assert rec["cached_tokens"] is None and rec["prompt_tokens"] is None
    body = FakeOpenAI.bodies[0]
    assert body["path"] == "/v1/chat/completions" and "ignore_eos" not in body
    assert body["messages"][0] == {"role": "system", "content": "context words"}


def test_route_sends_turns_to_other_targets(server: str) -> None:
    targets = [Target(server, "a"), Target(server, "b")]
    client = LoadClient(targets, route=lambda session, turn: (session.id + turn) % 2)
    sessions = [Session(i, "", [Turn("x", 1), Turn("y", 1)]) for i in range(2)]
    recs = run(client, sessions, concurrency=2)
    assert sorted((r["session"], r["turn"], r["instance"]) for r in recs) == [
        (0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0)]
    assert {b["model"] for b in FakeOpenAI.bodies} == {"a", "b"}


def test_bad_arguments_fail_clearly() -> None:
    with pytest.raises(ValueError, match="at least one target"):
        LoadClient([])
    with pytest.raises(ValueError, match="api"):
        LoadClient([Target("http://x", "m")], api="embeddings")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="concurrency"):
        asyncio.run(LoadClient([Target("http://x", "m")]).run([], range(1), 0))
