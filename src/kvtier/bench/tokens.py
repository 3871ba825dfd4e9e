"""Token-id requests to a vLLM OpenAI server, and its Prometheus counters, for benchmarks that
need exact prompts and per-request deltas (benchmarks/retention.py).

Unlike kvtier.bench.client (text, asynchronous, many sessions at once), a request here sends
token ids and streams them back one request at a time, so a benchmark can read ``/metrics``
just before and after it (:func:`scrape_metrics`, :func:`metric_delta`) and know what served it.
:class:`TokenServer` starts a ``kvtier serve`` engine to send them to.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx


def stream_token_ids(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` (a streamed completion with ``return_token_ids``) to ``url``/v1/completions:
    ``ttft_s`` (to the first token id), ``e2e_s``, ``output`` (the ids), ``prompt_tokens`` and
    ``cached_tokens`` (from the final usage chunk; the prompt's length and 0 when it has none).
    Raises RuntimeError with the body of a non-200 answer."""
    t0 = time.perf_counter()
    ttft = None
    out: list[int] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[len("data: "):])
            for choice in msg.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                out.extend(ids)
            if msg.get("usage"):
                usage = msg["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "output": out,
            "prompt_tokens": usage.get("prompt_tokens", len(body["prompt"])),
            "cached_tokens": details.get("cached_tokens") or 0}


def scrape_metrics(client: httpx.Client, url: str, prefixes: Sequence[str]) -> dict[str, float]:
    """The samples of ``url``/metrics whose names start with one of ``prefixes``, keyed ``name`` or
    ``name{label=value,...}`` (labels sorted; vLLM's ``model_name`` and ``engine`` dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(tuple(prefixes)):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def metric_delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    """How much counter ``key`` grew between two :func:`scrape_metrics` (0 where absent)."""
    return after.get(key, 0.0) - before.get(key, 0.0)


class TokenServer:
    """A ``kvtier serve`` engine (vLLM's OpenAI server with kvtier's connector) on loopback,
    spoken to in token ids: :meth:`request` and :meth:`counters` above, one request at a time.

    It is started as the suite starts its engines (kvtier.bench.runner.kvtier_serve_argv), with
    kvtier's ``settings`` written to ``workdir/NAME.yaml``, the log in ``workdir/NAME.log``, and
    vLLM's flags for exact, cacheable prompts (eager, prefix caching, prompt token details, seed
    0) plus ``extra_args``; ``env`` goes over os.environ. Nothing starts before :meth:`start`.
    """

    def __init__(self, name: str, served_name: str, model: Path, max_len: int, settings: dict[str, Any],
                 workdir: Path, env: dict[str, str], extra_args: Sequence[str] = ()) -> None:
        from kvtier.bench.engines import Process, free_port
        from kvtier.bench.runner import kvtier_serve_argv

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        vllm_args = ["--model", str(model), "--served-model-name", served_name, "--host", "127.0.0.1",
                     "--port", str(self.port), "--enforce-eager", "--max-model-len", str(max_len),
                     "--max-num-batched-tokens", str(max_len), "--enable-prefix-caching",
                     "--enable-prompt-tokens-details", "--seed", "0", *extra_args]
        argv = kvtier_serve_argv(settings, workdir / f"{name}.yaml", vllm_args)
        self.log = workdir / f"{name}.log"
        self.proc = Process(name, argv, self.log, env, ready_url=f"{self.url}/health")
        self.client = httpx.Client(timeout=600)

    def start(self, timeout_s: float = 600.0) -> float:
        """Start the engine and wait until it is healthy; returns the seconds it took."""
        return self.proc.start(timeout_s=timeout_s)

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        """:func:`stream_token_ids` against this server."""
        return stream_token_ids(self.client, self.url, body)

    def counters(self, prefixes: Sequence[str]) -> dict[str, float]:
        """:func:`scrape_metrics` of this server."""
        return scrape_metrics(self.client, self.url, prefixes)

    def stop(self) -> None:
        self.client.close()
        self.proc.stop()
