"""One SGLang engine process on CPU (the opt-in engine test's helper; see test_hicache_engine.py).

    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=tests/hicache/engine \\
        python tests/hicache/engine/_engine.py write|read|recompute --model DIR --pool DIR

``write`` and ``read`` serve with HiCache and kvtier as its L3 storage backend on ``--pool``;
``recompute`` without HiCache. Each serves the same prompts (greedy, 8 new tokens) and prints
one JSON line: per prompt its token count, output ids and logprobs and the cached tokens by
level. ``write`` waits, before it exits, until the pool holds every full page of its prompts
(SGLang's backup to storage runs behind the answer).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import sglang as sgl

from kvtier.admin import init_pool

PAGE = 16
PROMPTS = [" ".join(f"word{i}" for i in range(300)),
           " ".join(f"token{i % 97} item{i}" for i in range(200))]


def engine(model: str, pool: Path, mode: str) -> sgl.Engine:
    hicache = {}
    if mode != "recompute":
        extra = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                 "class_name": "KVTierHiCacheStorage", "interface_v1": 1, "pool_url": f"fs://{init_pool(pool, None)}"}
        hicache = {"enable_hierarchical_cache": True, "hicache_ratio": 2.0, "hicache_write_policy": "write_through",
                   "hicache_io_backend": "direct", "hicache_mem_layout": "layer_first",
                   "hicache_storage_prefetch_policy": "wait_complete", "hicache_storage_backend": "dynamic",
                   "hicache_storage_backend_extra_config": json.dumps(extra)}
    return sgl.Engine(model_path=model, device="cpu", attention_backend="torch_native", page_size=PAGE,
                      max_total_tokens=8192, disable_cuda_graph=True, enable_cache_report=True,
                      log_level="warning", **hicache)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["write", "read", "recompute"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--pool", type=Path, required=True)
    args = ap.parse_args()
    llm = engine(args.model, args.pool, args.mode)
    try:
        outs = llm.generate(PROMPTS, {"max_new_tokens": 8, "temperature": 0}, return_logprob=True)
        result = [{"prompt_tokens": o["meta_info"]["prompt_tokens"], "output_ids": o["output_ids"],
                   "logprobs": [lp[0] for lp in o["meta_info"]["output_token_logprobs"]],
                   "cached": o["meta_info"].get("cached_tokens_details") or {}} for o in outs]
        if args.mode == "write":
            want = sum(r["prompt_tokens"] // PAGE for r in result)
            deadline = time.monotonic() + 120
            while len(list(args.pool.rglob("*.kvt"))) < want and time.monotonic() < deadline:
                time.sleep(0.2)
        print(json.dumps({"mode": args.mode, "pages_in_pool": len(list(args.pool.rglob("*.kvt"))),
                          "prompts": result}), flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
