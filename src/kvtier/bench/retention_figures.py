"""The retention benchmark's figures (benchmarks/retention.py), from its request records.

Per mode (every round pooled): for the long sessions' resumes, the hit rate (``cached_tokens /
prompt_tokens`` summed, and the fraction of resumes with any hit) and TTFT p50/p90; the same for
short sessions and their resumes; the pool's evictions and hits per run, from the ``/metrics``
counters read at each run's end (kvtier.bench.tokens.scrape_metrics's keys).
"""

from __future__ import annotations

from typing import Any

from kvtier.bench.summary import median, quantile

PREFIX_HITS = "vllm:prefix_cache_hits_total"
KVTIER_LOADED = "kvtier_loaded_tokens_total"
POOL_EVICTIONS = "kvtier_evictions_total{tier=pool}"
POOL_HIT_TOKENS = "kvtier_hit_tokens_total{tier=pool}"


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run of one mode together: rates over all requests, medians over all requests."""
    recs = [r for res in results for r in res["records"]]
    resumes = [r for r in recs if r["kind"] == "long" and r["turn"] > 0]
    firsts = [r for r in recs if r["kind"] == "long" and r["turn"] == 0]
    shorts = [r for r in recs if r["kind"] == "short"]
    again = [r for r in recs if r["kind"] == "short-resume"]

    def rate(rs: list[dict[str, Any]]) -> float | None:
        prompt = sum(r["prompt_tokens"] for r in rs)
        return sum(r["cached_tokens"] for r in rs) / prompt if prompt else None

    def any_hit(rs: list[dict[str, Any]]) -> float | None:
        return sum(r["cached_tokens"] > 0 for r in rs) / len(rs) if rs else None

    def per_run(key: str) -> list[float]:
        return [res["metrics"].get(key, 0.0) for res in results]

    return {
        "runs": len(results),
        "long_resumes": len(resumes),
        "long_resume_hit_rate": rate(resumes),
        "long_resume_any_hit_fraction": any_hit(resumes),
        "long_resume_ttft_p50_s": median([r["ttft_s"] for r in resumes]),
        "long_resume_ttft_p90_s": quantile([r["ttft_s"] for r in resumes], 0.9),
        "long_resume_kvtier_loaded_tokens": sum(r["kvtier_loaded_tokens"] for r in resumes),
        "long_resume_vllm_prefix_cache_tokens": sum(r["prefix_cache_hit_tokens"] for r in resumes),
        "long_first_turn_ttft_p50_s": median([r["ttft_s"] for r in firsts]),
        "short_sessions": len(shorts),
        "short_hit_rate": rate(shorts),
        "short_ttft_p50_s": median([r["ttft_s"] for r in shorts]),
        "short_ttft_p90_s": quantile([r["ttft_s"] for r in shorts], 0.9),
        "short_resumes": len(again),
        "short_resume_hit_rate": rate(again),
        "short_resume_any_hit_fraction": any_hit(again),
        "short_resume_ttft_p50_s": median([r["ttft_s"] for r in again]),
        "short_resume_kvtier_loaded_tokens": sum(r["kvtier_loaded_tokens"] for r in again),
        "short_resume_vllm_prefix_cache_tokens": sum(r["prefix_cache_hit_tokens"] for r in again),
        "pool_evictions_per_run": per_run(POOL_EVICTIONS),
        "pool_evictions_p50": median(per_run(POOL_EVICTIONS)),
        "pool_hit_tokens_per_run": per_run(POOL_HIT_TOKENS),
        "kvtier_loaded_tokens_per_run": per_run(KVTIER_LOADED),
        "vllm_prefix_cache_hit_tokens_per_run": per_run(PREFIX_HITS),
        "pool_files_retained_at_end_per_run": [res["pool"]["pool_files_retained_at_end"] for res in results],
        "pool_bytes_at_end_per_run": [res["pool"]["pool_bytes_at_end"] for res in results],
    }
