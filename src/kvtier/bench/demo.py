"""The scenarios of ``kvtier demo``: the seed's cold resume with real vLLM engines, and a store
round trip without one.

* ``real_scenario`` (the default): SmolLM2-135M-Instruct (``real_model.py``) and coding-assistant
  sessions of real text (``coding.py``). Instance A answers each session (recompute), then each
  again from its own prefix cache (the floor: what the engine itself can do at best), and
  exits; instance B, a new process on the same pool, answers them by resuming. B must answer
  exactly as A's own prefix cache does (the same KV, the same computation after it), and as
  A's recompute or differing first at a tie one bf16 step wide (``offline.REAL_TIE_NATS``): a
  fresh prefill and a prefix-cache hit are not bit-identical in vLLM itself.
* ``toy_scenario`` (``--toy``): the tiny random-weight model and random token ids; faster, and
  its answers mean nothing (a near tie flips more often).
* ``round_trip``: a store's put in one instance and get in another, bytes compared.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.poolroot import scratch_pool

SESSIONS = 8
SESSION_TOKENS = 4096 + 100  # a partial trailing chunk, as real prompts have


def round_trip(root: Path) -> dict[str, Any]:
    """Instance A stores sessions into a pool; instance B (a new store) finds and reads them."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    rng = np.random.default_rng(0)
    sessions = [rng.integers(0, 32000, SESSION_TOKENS).astype(np.uint32) for _ in range(SESSIONS)]
    kvs = [torch.randn(layout.shape(SESSION_TOKENS)).to(torch.bfloat16) for _ in range(SESSIONS)]
    common = {"model_id": "demo-tiny-llama", "layout": layout, "chunk_tokens": 256,
              "pool_url": scratch_pool(root / "pool"), "pool_bytes": 1 << 30}
    t0 = time.perf_counter()
    with TieredStore.open(host_bytes=64 << 20, disk_path=root / "disk-a", **common) as a:  # type: ignore[arg-type]
        for tokens, kv in zip(sessions, kvs, strict=True):
            a.put(tokens, kv)
    put_s = time.perf_counter() - t0
    with TieredStore.open(host_bytes=256 << 20, disk_path=root / "disk-b", **common) as b:  # type: ignore[arg-type]
        t0 = time.perf_counter()
        hits = [b.lookup(tokens) for tokens in sessions]
        lookup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = [b.get(tokens[:hit.num_tokens]) for tokens, hit in zip(sessions, hits, strict=True)]
        get_s = time.perf_counter() - t0
        identical = all(torch.equal(g, kv[:, :, :g.shape[2]]) for g, kv in zip(got, kvs, strict=True))
        again = [b.lookup(tokens).tokens_by_tier() for tokens in sessions[:1]]
        metrics = b.metrics_snapshot()
    hit_tokens = sum(h.num_tokens for h in hits)
    by_tier: dict[str, int] = {}
    for h in hits:
        for tier, n in h.tokens_by_tier().items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    read_bytes = hit_tokens * layout.bytes_per_token
    return {
        "sessions": SESSIONS, "tokens_per_session": SESSION_TOKENS, "stored_tokens": SESSIONS * SESSION_TOKENS,
        "hit_tokens": hit_tokens, "hit_tokens_by_tier": by_tier, "identical": identical,
        "put_s": put_s, "lookup_ms_per_session": lookup_s / SESSIONS * 1e3, "get_s": get_s,
        "get_gbps": read_bytes / get_s / 1e9, "second_lookup_tiers": again[0],
        "pool_corrupt_chunks": metrics["tiers"]["pool"]["corrupt_chunks"],
    }


def _engine(spec: dict[str, Any], root: Path, name: str) -> dict[str, Any]:
    """Run an engine; attach its worker's kvtier metrics (written at shutdown)."""
    from kvtier.bench.offline import run_engine

    result = run_engine({**spec, "extra": {**spec["extra"], "disk_path": str(root / f"disk-{name}"),
                                           "metrics_file": str(root / f"{name}.metrics")}}, root, name)
    metrics = root / f"{name}.metrics.worker.json"
    result["metrics"] = json.loads(metrics.read_text()) if metrics.exists() else {}
    return result


def _ttft(result: dict[str, Any]) -> float:
    """vLLM's own time to the first token where it measured it, else the request's wall time."""
    return float(result.get("first_token_s") or result["ttft_s"])


def _a_and_b(root: Path, model: Path, prompts: list[list[int]], warmup: list[int], max_tokens: int,
             floor: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Instance A: a warm-up request, every prompt (recompute), with ``floor`` every prompt again
    (A's own prefix cache); then instance B, a new process on A's pool: the warm-up, every prompt.
    The warm-up (its first sampling costs seconds) is never reported."""
    n = len(prompts)
    base = {"model": str(model), "prompts": [warmup, *prompts], "max_tokens": max_tokens, "connector": "kvtier",
            "kv_cache_gib": 2, "logprobs": 5, "log_stats": True,
            "extra": {"pool_url": scratch_pool(root / "engine-pool"), "host_bytes": "512MiB"}}
    again = [{"p": i, "tag": "floor"} for i in range(1, n + 1)] if floor else []
    a = _engine({**base, "plan": [{"p": i} for i in range(n + 1)] + again}, root, "a")
    b = _engine(base, root, "b")
    return a, b


def _tokens_by_tier(b: dict[str, Any], bytes_per_token: int) -> dict[str, int]:
    tiers = b["metrics"].get("tiers", {})
    return {name: t["bytes_read"] // bytes_per_token for name, t in tiers.items()}


def real_scenario(root: Path, sessions: int = 3, max_tokens: int = 3500, answer_tokens: int = 48) -> dict[str, Any]:
    """The cold resume on SmolLM2-135M-Instruct with coding sessions of real text (module docstring)."""
    from transformers import AutoTokenizer

    from kvtier.bench.coding import chat
    from kvtier.bench.coding import sessions as coding_sessions
    from kvtier.bench.offline import REAL_TIE_NATS, first_difference, same_answer
    from kvtier.bench.real_model import NAME, make_real_model

    model = make_real_model(root / "model").dir
    tokenizer = AutoTokenizer.from_pretrained(model)
    chosen = coding_sessions(tokenizer, sessions, max_tokens)
    warmup = chat(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    a, b = _a_and_b(root, model, [s.prompt for s in chosen], warmup, answer_tokens, floor=True)
    recompute, floor = a["results"][1:sessions + 1], a["results"][sessions + 1:]
    resumed = b["results"][1:]
    rows = []
    for s, ra, rf, rb in zip(chosen, recompute, floor, resumed, strict=True):
        rows.append({"file": s.name, "question": s.question, "prompt_tokens": ra["prompt_tokens"],
                     "recompute_ttft_s": _ttft(ra), "floor_ttft_s": _ttft(rf), "resume_ttft_s": _ttft(rb),
                     "resume_cached_tokens": rb["cached"], "answer_a": tokenizer.decode(ra["tokens"]),
                     "answer_b": tokenizer.decode(rb["tokens"]), "same_tokens": ra["tokens"] == rb["tokens"],
                     "first_difference": first_difference(rb, ra), "same_as_floor": rf["tokens"] == rb["tokens"],
                     "floor_same_as_recompute": rf["tokens"] == ra["tokens"],
                     "same_answer": rf["tokens"] == rb["tokens"] and same_answer(rb, ra, REAL_TIE_NATS)})
    return {"model": NAME, "sessions": rows,
            "warmup": {"question": "What is the capital of France?",
                       "answer_a": tokenizer.decode(a["results"][0]["tokens"]),
                       "answer_b": tokenizer.decode(b["results"][0]["tokens"])},
            "tokens_by_tier": _tokens_by_tier(b, 30 * 2 * 3 * 64 * 2),  # SmolLM2's KV per token
            "engine_start_s": [a["start_s"], b["start_s"]]}


TOY_SESSIONS = 3
TOY_SESSION_TOKENS = 6144 + 37


def toy_scenario(root: Path) -> dict[str, Any]:
    """The cold resume on the tiny random-weight model with random token ids (``--toy``)."""
    from kvtier.bench.model import make_model
    from kvtier.bench.offline import same_answer

    model = root / "tiny-llama"
    make_model(model)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(100, 31000, TOY_SESSION_TOKENS).tolist() for _ in range(TOY_SESSIONS)]
    # A short first request warms each engine up; shorter than a chunk, nothing of it is stored.
    a, b = _a_and_b(root, model, prompts, rng.integers(100, 31000, 64).tolist(), 1, floor=False)
    rows = [{"file": None, "prompt_tokens": ra["prompt_tokens"], "recompute_ttft_s": _ttft(ra),
             "floor_ttft_s": None, "resume_ttft_s": _ttft(rb), "resume_cached_tokens": rb["cached"],
             "same_tokens": ra["tokens"] == rb["tokens"], "first_difference": None, "same_as_floor": None,
             "same_answer": same_answer(rb, ra)}
            for ra, rb in zip(a["results"][1:], b["results"][1:], strict=True)]
    return {"model": "tiny-llama", "sessions": rows, "warmup": None,
            "tokens_by_tier": _tokens_by_tier(b, 4 * 2 * 2 * 64 * 2), "engine_start_s": [a["start_s"], b["start_s"]]}
