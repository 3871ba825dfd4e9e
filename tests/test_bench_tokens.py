"""kvtier.bench.tokens and retention_figures: token-id streams, /metrics deltas, the retention figures."""

from __future__ import annotations

import json

import httpx
import pytest

from kvtier.bench import retention_figures, tokens


def server(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/metrics":
        return httpx.Response(200, text='kvtier_loaded_tokens_total{model_name="m",tier="pool"} 512.0\n'
                                         "vllm:prefix_cache_hits_total 7.0\nother_total 1.0\n")
    body = json.loads(request.content)
    if body["prompt"] == [0]:
        return httpx.Response(500, text="boom")
    chunks = [{"choices": [{"token_ids": [5, 6]}]}, {"choices": [{"token_ids": [7]}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}]
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=text)


def test_a_token_id_stream_and_the_counters_around_it() -> None:
    client = httpx.Client(transport=httpx.MockTransport(server))
    got = tokens.stream_token_ids(client, "http://x", {"prompt": [1, 2, 3]})
    assert got["output"] == [5, 6, 7] and (got["prompt_tokens"], got["cached_tokens"]) == (3, 2)
    assert got["ttft_s"] is not None and got["e2e_s"] >= got["ttft_s"]
    with pytest.raises(RuntimeError, match="HTTP 500: boom"):
        tokens.stream_token_ids(client, "http://x", {"prompt": [0]})
    after = tokens.scrape_metrics(client, "http://x", ("kvtier_", "vllm:prefix_cache"))
    assert after == {"kvtier_loaded_tokens_total{tier=pool}": 512.0, "vllm:prefix_cache_hits_total": 7.0}
    assert tokens.metric_delta(after, {}, "vllm:prefix_cache_hits_total") == 7.0


def test_the_retention_figures_pool_every_run_of_a_mode() -> None:
    def rec(kind: str, turn: int, cached: int) -> dict[str, object]:
        return {"kind": kind, "turn": turn, "prompt_tokens": 100, "cached_tokens": cached, "ttft_s": 0.1 * (1 + turn),
                "kvtier_loaded_tokens": cached, "prefix_cache_hit_tokens": 0}

    run = {"records": [rec("long", 0, 0), rec("long", 1, 100), rec("long", 2, 0), rec("short", 0, 0)],
           "metrics": {retention_figures.POOL_EVICTIONS: 4.0}, "pool": {"pool_files_retained_at_end": 1,
                                                                      "pool_bytes_at_end": 10}}
    s = retention_figures.summarize([run, run])
    assert (s["runs"], s["long_resumes"], s["long_resume_hit_rate"]) == (2, 4, 0.5)
    assert s["long_resume_any_hit_fraction"] == 0.5
    assert s["pool_evictions_per_run"] == [4.0, 4.0] and s["short_resume_hit_rate"] is None
    assert retention_figures.quantile([3.0, 1.0, 2.0], 0.9) == 3.0
