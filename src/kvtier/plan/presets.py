"""Named starting points: the seed's deployment, with every assumption written beside it.

The seed (``shared/seed/SEED-en.md``) publishes TTFT p50 and tok/s for Qwen3-Coder-480B-FP8,
TP=8 on 8 x MI308X, long-context cold-resume, at concurrency 8/16/32, for a 100 GbE pool of 4
drives, one local PCIe Gen4 NVMe drive, and recompute (16 only). It does not publish context
lengths, output lengths, prefill rate or HBM left for KV; those are assumptions here, and the
prefill rate is the one figure fitted, to the seed's recompute anchor (149.5 s at 16).
"""

from __future__ import annotations

from typing import Any

from kvtier.plan.spec import ModelSpec

# Qwen3-Coder-480B-A35B config.json: 62 layers, 96 query heads, 8 KV heads, head_dim 128. The
# FP8 checkpoint keeps the KV cache in bf16 unless --kv-cache-dtype fp8 is set: bf16 assumed.
SEED_MODEL = ModelSpec(num_layers=62, num_kv_heads=8, head_dim=128, dtype="bfloat16", parallel_size=8,
                       name="Qwen3-Coder-480B-A35B")

SEED_HARDWARE: dict[str, Any] = {
    "engine": {
        # Fitted: recompute TTFT p50 at concurrency 16 = 149.5 s with the workload below.
        "prefill_tokens_per_s": 1658.0,
        # Attention's quadratic share folded into the linear rate (no per-context figure published).
        "prefill_quadratic_s": 0.0,
        # ~20 tok/s per sequence for a 35B-active MoE on 8 GPUs (assumed; it sets tok/s, not TTFT).
        "decode_step_s": 0.05,
        "max_batched_tokens": 8192,  # vLLM's default chunked-prefill budget
        # 8 x 192 GB HBM, ~60 GB/GPU of FP8 weights, 0.9 utilisation: ~100 GB/GPU for KV.
        "hbm_kv_bytes": 800 * 10**9,
        "block_tokens": 16,
        "chunk_tokens": 256,  # LMCache's chunk
        "tail_chunks": False,  # LMCache keeps whole chunks only (kvtier's vLLM connector adds tails)
    },
    "tiers": {
        # Host DRAM (LMCache L1): emptied by the restart of a cold resume, so it never hits here.
        "host": {"capacity_bytes": 1000 * 10**9, "read_bytes_per_s": 20e9, "write_bytes_per_s": 20e9,
                 "latency_s": 0.0, "persistent": False},
        # One PCIe Gen4 x4 NVMe drive: 7 GB/s read (a fast Gen4 drive's rated figure), 4 GB/s write, 2 TB.
        "disk": {"capacity_bytes": 2 * 10**12, "read_bytes_per_s": 7.0e9, "write_bytes_per_s": 4e9,
                 "latency_s": 0.001},
        # 4 drives RAID0 behind one 100 GbE RoCEv2 port: 12.5 GB/s line rate, 10 GB/s assumed after
        # protocol and filesystem overhead (80%); the seed's parallel-read patch gives 5.23 GB/s per
        # GPU, so 8 GPUs together exceed the port: the port is the limit. Capacity: 4 x 7.68 TB.
        "pool": {"capacity_bytes": 30 * 10**12, "read_bytes_per_s": 10e9, "write_bytes_per_s": 8e9,
                 "latency_s": 0.002, "shared": True},
    },
    "instances": 1,
}

# Long-context coding sessions: context uniform over a 32k-token-wide range whose centre is fitted
# to the pool anchor (11.85 s at 16); one resume per user at each concurrency level (all resumed at
# once after the restart), 64 question and 64 output tokens (assumed).
SEED_WORKLOAD: dict[str, Any] = {"kind": "cold-resume", "context": (5707, 38475), "turns": 2,
                                 "question_tokens": 64, "output_tokens": 64, "sessions_per_user": 1}

# The seed's published table: concurrency -> (pool, local NVMe, recompute) TTFT p50 in seconds.
SEED_TABLE = {8: (7.53, 10.17, None), 16: (11.85, 17.31, 149.48), 32: (26.35, 35.73, None)}
SEED_TOK_S = {8: (56.6, 43.9, None), 16: (74.9, 53.6, 4.1), 32: (71.6, 53.9, None)}

# Which of the table's cells the preset was fitted to (the rest are predictions).
SEED_FITTED = {("shared-pool", 16): "the context range's centre", ("recompute", 16): "the prefill rate"}
_SEED_COLUMNS = ("shared-pool", "local-disk", "recompute")


def seed_comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The plan's TTFT p50 and tok/s beside the seed's published table, per cell the seed gives
    (pool and local NVMe at 8/16/32, recompute at 16), with the error and whether the preset was
    fitted to that cell (``fitted``) or the cell is an independent prediction."""
    out = []
    for c, published in SEED_TABLE.items():
        for config, ttft, tok_s in zip(_SEED_COLUMNS, published, SEED_TOK_S[c], strict=True):
            row = next((r for r in rows if r["config"] == config and r["concurrency"] == c and r.get("requests")),
                       None)
            if ttft is None or row is None:
                continue
            plan_tok_s = row.get("output_tok_s")
            out.append({"concurrency": c, "config": config, "seed_ttft_p50_s": ttft, "plan_ttft_p50_s":
                        row["ttft_p50_s"], "ttft_error": row["ttft_p50_s"] / ttft - 1.0, "seed_tok_s": tok_s,
                        "plan_tok_s": plan_tok_s, "tok_s_error": plan_tok_s / tok_s - 1.0 if plan_tok_s else None,
                        "fitted": SEED_FITTED.get((config, c))})
    return out
