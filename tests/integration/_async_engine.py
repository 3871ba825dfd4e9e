"""Drive one vLLM ``AsyncLLM`` (CPU build) through timed submits and aborts; write results as JSON. A test helper.

    python _async_engine.py SPEC.json

SPEC: {"model": DIR, "out": FILE, "prompts": [[ids...], ...], "connector": {extra config},
       "actions": [{"at": s, "submit": NAME, "prompt": i, "max_tokens": n}
                   | {"at": s, "abort": NAME}, ...]}
Times count from the first action. Each result: the greedy tokens, cached tokens, finish
reason (``abort`` for an aborted request) and seconds from submit to finish.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any


async def main(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config=spec["connector"])
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=spec["model"], enforce_eager=True, max_model_len=8192,
                                                       max_num_batched_tokens=8192, enable_prefix_caching=True,
                                                       seed=0, kv_transfer_config=transfer))
    results: dict[str, Any] = {}

    async def submit(name: str, prompt: list[int], max_tokens: int) -> None:
        t0 = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5)
        out = None
        async for step in engine.generate({"prompt_token_ids": prompt}, params, name):
            out = step  # cumulative: the last one holds every token
        comp = out.outputs[0] if out is not None else None
        results[name] = {
            "tokens": list(comp.token_ids) if comp else [], "cached": (out.num_cached_tokens or 0) if out else 0,
            "finish": comp.finish_reason if comp else None, "seconds": time.perf_counter() - t0,
            "top": [sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: -x[1])[:5]
                    for pos in (comp.logprobs or [])] if comp else []}

    try:
        tasks = []
        t0 = time.perf_counter()
        for action in spec["actions"]:
            await asyncio.sleep(max(0.0, t0 + action["at"] - time.perf_counter()))
            if "submit" in action:
                tasks.append(asyncio.create_task(submit(action["submit"], spec["prompts"][action["prompt"]],
                                                        action["max_tokens"])))
            else:
                await engine.abort(action["abort"])
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
    finally:
        engine.shutdown()
    return results


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    json.dump({"results": asyncio.run(main(spec))}, open(spec["out"], "w"))
