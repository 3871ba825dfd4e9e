"""Run an engine in a fresh process (``kvtier.bench.offline``, or ``_async_engine.py`` for timed
submits and aborts) and compare greedy outputs the way the fault harness does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvtier.bench.offline import near_tie

ENGINE = ["-m", "kvtier.bench.offline"]
ASYNC_ENGINE = [str(Path(__file__).with_name("_async_engine.py"))]


class EngineFailed(AssertionError):
    def __init__(self, name: str, stderr: str) -> None:
        super().__init__(f"engine {name} failed:\n{stderr[-4000:]}")
        self.stderr = stderr


def run_engine(model: Path, tmp: Path, name: str, prompts: list[list[int]], connector: dict[str, Any] | None,
               timeout_s: float = 900, **options: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Results and ``{"preemptions": n, "scheduler": ..., "worker": ..., "worker1": ...}`` metrics.

    vLLM's engine core runs in the runner's process unless ``engine_core_in_process=False``:
    the model workers keep processes of their own, so the connector's scheduler and worker roles
    still meet only across a process boundary, and each engine starts one process fewer (the
    suite's time is mostly engine starts). ``vllm serve`` tests, ``run_async_engine`` and one
    offline test keep vLLM's default of three processes."""
    options.setdefault("engine_core_in_process", True)
    out, metrics = _spawn(ENGINE, model, tmp, name, prompts, connector, timeout_s, options)
    if "scheduler" in metrics and "worker" in metrics:  # the layout the docstring promises
        assert metrics["scheduler"]["pid"] != metrics["worker"]["pid"], "the worker ran in the engine core's process"
    return out["results"], {"preemptions": out["preemptions"], **metrics}


def run_async_engine(model: Path, tmp: Path, name: str, prompts: list[list[int]], connector: dict[str, Any],
                     actions: list[dict[str, Any]], timeout_s: float = 900) -> tuple[dict[str, Any], dict[str, Any]]:
    """``_async_engine.py`` (timed submits and aborts on vLLM's AsyncLLM): results by name, and metrics."""
    out, metrics = _spawn(ASYNC_ENGINE, model, tmp, name, prompts, connector, timeout_s, {"actions": actions})
    return out["results"], metrics


def _spawn(script: list[str], model: Path, tmp: Path, name: str, prompts: list[list[int]],
           connector: dict[str, Any] | None, timeout_s: float,
           options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run an engine script in a fresh process; its output JSON and the connector's metrics files."""
    if connector is not None:
        connector = {**connector, "metrics_file": str(tmp / f"{name}.metrics")}
    spec = {"model": str(model), "out": str(tmp / f"{name}.json"), "prompts": prompts, "connector": connector,
            "max_model_len": 8192, **options}
    spec_path = tmp / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, *script, str(spec_path)], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    if proc.returncode != 0:
        raise EngineFailed(name, proc.stderr)
    metrics: dict[str, Any] = {}
    for path in tmp.glob(f"{name}.metrics.*.json"):
        metrics[path.name.removeprefix(f"{name}.metrics.").removesuffix(".json")] = json.loads(path.read_text())
    return json.loads((tmp / f"{name}.json").read_text()), metrics


def mismatches(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> list[int]:
    """Indices of requests whose output is neither equal to the reference nor a near-tie flip."""
    assert len(got) == len(want)
    return [i for i, (g, w) in enumerate(zip(got, want, strict=True))
            if g["tokens"] != w["tokens"] and not near_tie(g, w)]
