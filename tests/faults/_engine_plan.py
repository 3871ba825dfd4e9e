"""Run one vLLM engine (CPU build) through a plan of prompts, cache resets and shell actions.

    python _engine_plan.py SPEC.json

SPEC: {"model": DIR, "out": FILE, "prompts": [[ids...], ...], "max_tokens": N,
       "connector": {KVTierConnector extra config},
       "plan": [{"p": i, "salt": str | null, "cut": n | absent, "tag": any} | {"reset": true}
                | {"sh": "shell command"}, ...],
       "loop_s": seconds | null}
``cut`` sends only the first n tokens of prompt i. Steps run one at a time (a request sees
what the ones before it stored). With ``loop_s`` the plan repeats until that much time has
passed (at least once). Results: one entry per request
with the prompt index, salt, tokens, cached tokens and seconds; shell actions with their rc.
A fault-harness helper: the actions inject faults (remount, rm -rf, fill a filesystem) while
the engine is serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=spec["connector"])
    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=8192, max_num_batched_tokens=8192,
              enable_prefix_caching=True, seed=0, kv_transfer_config=transfer)
    # The top-5 log-probabilities of each generated token let a comparison tell a near-tie that
    # numerical noise flipped from a different answer.
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 6), logprobs=5)
    results: list[dict[str, object]] = []
    actions: list[dict[str, object]] = []
    t_start = time.monotonic()
    passes = 0
    while True:
        for step in spec["plan"]:
            if step.get("reset"):
                assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
            elif "sh" in step:
                proc = subprocess.run(step["sh"], shell=True, capture_output=True, text=True)
                actions.append({"sh": step["sh"], "rc": proc.returncode, "err": proc.stderr[-500:]})
            else:
                ids = spec["prompts"][step["p"]]
                prompt: dict[str, object] = {"prompt_token_ids": ids[:step["cut"]] if "cut" in step else ids}
                if step.get("salt") is not None:
                    prompt["cache_salt"] = step["salt"]
                t0 = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0]  # type: ignore[list-item]
                results.append({"p": step["p"], "cut": step.get("cut"), "salt": step.get("salt"),
                                "tag": step.get("tag"), "pass": passes,
                                "tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                                "top": [sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: -x[1])[:5]
                                        for pos in out.outputs[0].logprobs or []],
                                "seconds": time.perf_counter() - t0})
        passes += 1
        if not spec.get("loop_s") or time.monotonic() - t_start >= spec["loop_s"]:
            break
        assert llm.reset_prefix_cache()
    with open(spec["out"], "w") as fh:
        json.dump({"results": results, "actions": actions, "passes": passes}, fh)
    del llm  # shuts the engine down: the connector flushes and writes its metrics file


if __name__ == "__main__":
    main()
