"""Run one vLLM engine (CPU build) over a list of prompts; write outputs as JSON. A test helper.

    python _engine.py SPEC.json

SPEC: {"model": DIR, "out": FILE, "prompts": [[ids...], ...], "max_tokens": N,
       "connector": null | {extra config for KVTierConnector},
       "reset_prefix_cache_at": [i, ...],   (empty vLLM's own prefix cache before prompt i)
       "batch": false,                      (true: all prompts in one generate call, concurrently)
       "tensor_parallel_size": 1, "num_gpu_blocks_override": null, "max_model_len": 8192,
       "failure_policy": "recompute"}
Prompts run one at a time unless ``batch``, so each request sees what the ones before it
stored. Each result has the greedy tokens, their top-5 log-probabilities, the cached tokens
and the seconds; the output file also holds the engine's preemption count.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _result(out: Any, seconds: float) -> dict[str, Any]:
    comp = out.outputs[0]
    return {"tokens": list(comp.token_ids), "cached": out.num_cached_tokens or 0, "seconds": seconds,
            "top": [sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: -x[1])[:5]
                    for pos in comp.logprobs or []]}


def _preemptions(llm: Any) -> int:
    for metric in llm.get_metrics():
        if metric.name == "vllm:num_preemptions":
            return int(getattr(metric, "value", 0))
    return 0


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    tp = spec.get("tensor_parallel_size", 1)
    if tp > 1:  # one core per rank (vLLM's CPU build refuses TP without a binding)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy=spec.get("failure_policy", "recompute"),
            kv_connector_extra_config=spec["connector"])
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks_override"]
    max_len = spec.get("max_model_len", 8192)
    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=max_len, max_num_batched_tokens=max_len,
              enable_prefix_caching=True, seed=0, tensor_parallel_size=tp, disable_log_stats=False, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 6), logprobs=5)
    results = []
    if spec.get("batch"):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
        results = [_result(o, time.perf_counter() - t0) for o in outs]
    else:
        for i, prompt in enumerate(spec["prompts"]):
            if i in spec.get("reset_prefix_cache_at", []):
                assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            results.append(_result(out, time.perf_counter() - t0))
    json.dump({"results": results, "preemptions": _preemptions(llm)}, open(spec["out"], "w"))
    del llm  # shuts the engine down: the connector flushes and writes its metrics file


if __name__ == "__main__":
    main()
