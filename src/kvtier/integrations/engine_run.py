"""Run one vLLM engine over prompts in this process and write per-request timings as JSON.

    python -m kvtier.integrations.engine_run SPEC.json

SPEC: ``{"model": DIR, "out": FILE, "prompts": [[token ids], ...], "max_tokens": 1,
"connector": null | "kvtier" | "example", "extra": {kv_connector_extra_config},
"tensor_parallel_size": 1}``.
Prompts run one at a time; TTFT is the wall time of a ``generate`` call with
``max_tokens=1`` (prefill plus the first token), with nothing else in the engine. Used by
``kvtier demo`` and benchmarks/vllm_resume.py, each configuration in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class EngineError(RuntimeError):
    """An engine process exited with an error; the message ends with its stderr."""


def run_engine(spec: dict[str, Any], workdir: Path, name: str, timeout_s: float = 1800) -> dict[str, Any]:
    """Run ``spec`` in a fresh process (``WORKDIR/NAME.json`` gets the results); return them.

    Raises EngineError with the tail of the engine's stderr when it fails.
    """
    spec = {**spec, "out": str(workdir / f"{name}.json")}
    path = workdir / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "kvtier.integrations.engine_run", str(path)],
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise EngineError(f"vLLM engine {name} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads((workdir / f"{name}.json").read_text())
    return result


def main(spec_path: str) -> None:
    with open(spec_path) as fh:
        spec = json.load(fh)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # Same CPU binding with and without a KV connector (see kvtier.bench.suite).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    tp = int(spec.get("tensor_parallel_size", 1))
    if tp > 1:  # vLLM's CPU build needs one core per rank named, or it refuses tensor parallel
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if spec.get("connector") == "kvtier":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=spec["extra"])
    elif spec.get("connector") == "example":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config=spec["extra"])
    longest = max(len(p) for p in spec["prompts"]) + spec.get("max_tokens", 1) + 16
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=max(longest, 2048),
              max_num_batched_tokens=max(longest, 2048), enable_prefix_caching=True, seed=0,
              tensor_parallel_size=tp, **kwargs)
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 1))
    results = []
    for prompt in spec["prompts"]:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        results.append({"ttft_s": time.perf_counter() - t, "cached": out.num_cached_tokens or 0,
                        "tokens": list(out.outputs[0].token_ids), "prompt_tokens": len(prompt)})
    with open(spec["out"], "w") as fh:
        json.dump({"start_s": start_s, "results": results}, fh)
    del llm  # shuts the engine down: the connector flushes and writes its metrics file


if __name__ == "__main__":
    main(sys.argv[1])
