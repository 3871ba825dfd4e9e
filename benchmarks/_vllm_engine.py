"""One vLLM engine process for benchmarks/vllm_resume.py: time each prompt, write JSON.

    python _vllm_engine.py SPEC.json
SPEC: {"model", "out", "prompts": [[ids]], "connector": null | "kvtier" | "example",
       "extra": {...}, "max_tokens": 1}
TTFT is the wall time of a generate() call with max_tokens=1 (prefill + first token), one
prompt at a time, so nothing else shares the engine.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if spec["connector"] == "kvtier":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=spec["extra"])
    elif spec["connector"] == "example":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config=spec["extra"])
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=16384, max_num_batched_tokens=16384,
              enable_prefix_caching=True, seed=0, **kwargs)
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 1))
    results = []
    for prompt in spec["prompts"]:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        results.append({"ttft_s": time.perf_counter() - t, "cached": out.num_cached_tokens or 0,
                        "tokens": list(out.outputs[0].token_ids), "prompt_tokens": len(prompt)})
    json.dump({"start_s": start_s, "results": results}, open(spec["out"], "w"))
    del llm


if __name__ == "__main__":
    main()
