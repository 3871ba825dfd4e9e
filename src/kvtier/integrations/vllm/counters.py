"""The connector's own counters: one row each, read by both roles, the metrics file and /metrics.

The roles count into a plain ``dict[str, int]`` (one per process; cheap, picklable, and the
``connector`` section of the metrics file as it is). Its keys are the rows' ``key``s; a labelled
row (``label`` set) is counted as ``"<key>.<label value>"`` (``decision.load``,
``unavailable.pool``) when first seen. ``metric`` is the Prometheus name on vLLM's ``/metrics``
(None: in the metrics file only); ``first_rank_only`` rows count requests' tokens or chunks, so
only the first tensor-parallel rank exports them (every rank counts its own shards).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Counter:
    key: str
    metric: str | None
    help: str
    first_rank_only: bool = False
    label: str | None = None  # the Prometheus label of a labelled counter


COUNTERS: tuple[Counter, ...] = (
    Counter("matched_tokens", "kvtier_matched_tokens_total", "Tokens the scheduler decided to load from kvtier",
            first_rank_only=True),
    Counter("loaded_tokens", "kvtier_loaded_tokens_total", "Tokens loaded into vLLM's KV cache (first rank)",
            first_rank_only=True),
    Counter("failed_blocks", "kvtier_load_failed_blocks_total",
            "vLLM blocks a load could not fill (vLLM recomputed them; first rank)", first_rank_only=True),
    Counter("saved_chunks", "kvtier_saved_chunks_total",
            "Chunks copied out of vLLM's KV cache into kvtier (first rank)", first_rank_only=True),
    Counter("unavailable_tiers", None, "Tiers left out because they could not be opened (all tiers)"),
    Counter("skipped_requests", "kvtier_skipped_requests_total", "Requests kvtier cannot key (prompt embeddings)"),
    Counter("resumed_loads", "kvtier_preempted_loads_total", "Loads of preempted requests, back in new blocks"),
    Counter("disabled", None, "1 once the connector turned itself off (a KV layout it cannot handle)"),
    Counter("async_loads", "kvtier_background_loads_total",
            "Loads run in the background while the engine ran others"),
    Counter("step_loads", "kvtier_step_loads_total",
            "Loads run inside the step that schedules their request (load_mode sync, or auto on an idle engine)"),
    Counter("coalesced_loads", "kvtier_coalesced_loads_total",
            "Background loads reported in the same step as another one because the worker waited for "
            "them to end (load_coalesce_ms)", first_rank_only=True),
    Counter("stopped_loads", "kvtier_stopped_loads_total", "Loads stopped because their request was aborted",
            first_rank_only=True),
    Counter("lookup_timeouts", "kvtier_lookup_timeouts_total",
            "Requests scheduled without a hit: lookup_timeout_s passed"),
    Counter("cancelled_lookups", "kvtier_cancelled_lookups_total",
            "Queued lookups cancelled before they ran: their request finished, timed out or needed another"),
    Counter("lookup_overflows", "kvtier_lookup_overflows_total",
            "Requests scheduled without a lookup: 64 lookups were waiting for the lookup threads"),
    Counter("decode_saves", "kvtier_decode_saved_chunks_total",
            "Chunks of finished requests (prompt and generated tokens) queued for saving"),
    Counter("tail_loads", "kvtier_tail_loads_total",
            "Loads that included a tail: the full blocks after a prefix's last full chunk (keys.tail_id)"),
    Counter("tail_saves", "kvtier_tail_saves_total",
            "Tails queued for saving: the full blocks after a prompt's (or finished request's) last full chunk"),
    Counter("capped_loads", "kvtier_capped_loads_total",
            "Loads vLLM's scheduler cut short of the hit kvtier offered (vLLM 0.33+); the rest is recomputed"),
    Counter("cache_resets", "kvtier_cache_resets_total",
            "Times vLLM reset the connector's cache (new weights): nothing cached before is hit again"),
    Counter("failed_loads", "kvtier_failed_loads_total",
            "Background loads that delivered nothing (request recomputed)"),
    Counter("lookup_tokens", "kvtier_requested_tokens_total",
            "Full-chunk prompt tokens past vLLM's own prefix cache hit that were looked up"),
    Counter("miss_tokens", "kvtier_missed_tokens_total", "Looked-up tokens found in no tier"),
    Counter("rejected_params", "kvtier_rejected_request_params_total",
            "Per-request kv_transfer_params kvtier values ignored or clamped (not a number, not finite, "
            "over max_retain_s)"),
    Counter("unverified_saves", "kvtier_unverified_saves_total",
            "Save plans held back because the request's synchronous load had not yet been reported "
            "complete by every rank"),
    Counter("mm_trusted_ids", "kvtier_mm_trusted_identifiers_total",
            "Multimodal items keyed by their client-given identifier (trust_mm_identifiers) for lack of data"),
    Counter("decision", "kvtier_load_decisions_total",
            "What the scheduler did with a request's lookup: load, recompute (predicted slower than "
            "prefill), short (under min_load_tokens), miss (nothing past vLLM's own hit), timeout",
            label="decision"),
    Counter("unavailable", "kvtier_tier_unavailable_total",
            "Times a tier could not be opened or was left out (the engine served without it)", label="tier"),
)
BY_KEY: dict[str, Counter] = {c.key: c for c in COUNTERS}


def new_counters(counters: dict[str, int] | None = None) -> dict[str, int]:
    """``counters`` (a new dict when None) with every unlabelled row present at 0."""
    counters = {} if counters is None else counters
    for c in COUNTERS:
        if c.label is None:
            counters.setdefault(c.key, 0)
    return counters


def count(counters: dict[str, int], key: str, label: str | None = None, n: int = 1) -> None:
    """Add ``n`` to row ``key`` (``label``: the value of a labelled row's label)."""
    row = BY_KEY[key]  # a KeyError here is a typo in kvtier, not a runtime condition
    if (label is None) != (row.label is None):
        raise ValueError(f"counter {key!r}: label {'required' if row.label else 'not taken'}")
    name = key if label is None else f"{key}.{label}"
    counters[name] = counters.get(name, 0) + n
