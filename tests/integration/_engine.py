"""Run one vLLM engine (CPU build) over a list of prompts; write outputs as JSON. A test helper.

    python _engine.py SPEC.json

SPEC: {"model": DIR, "out": FILE, "prompts": [[ids...], ...], "max_tokens": N,
       "connector": null | {extra config for KVTierConnector},
       "reset_prefix_cache_at": [i, ...]}  (empty vLLM's own prefix cache before prompt i)
Prompts run one at a time, so each request sees what the ones before it stored.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"])
    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=8192, max_num_batched_tokens=8192,
              enable_prefix_caching=True, seed=0, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 6))
    results = []
    for i, prompt in enumerate(spec["prompts"]):
        if i in spec.get("reset_prefix_cache_at", []):
            assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        results.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                        "seconds": time.perf_counter() - t0})
    json.dump(results, open(spec["out"], "w"))
    del llm  # shuts the engine down: the connector flushes and writes its metrics file


if __name__ == "__main__":
    main()
