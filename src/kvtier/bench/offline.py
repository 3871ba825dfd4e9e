"""One vLLM engine (offline ``LLM``) in a fresh process, through a plan of prompts; results as JSON.

    python -m kvtier.bench.offline SPEC.json

The one engine runner of the benchmarks (``benchmarks/vllm_resume.py``), ``kvtier demo``, the
integration tests and the fault harness. SPEC keys (all but ``model``, ``out`` and
``prompts`` optional):

* ``model``: the model directory; ``out``: the JSON file to write; ``prompts``: token id lists.
* ``connector``: null (plain vLLM), ``"kvtier"`` or ``"example"`` (vLLM's ExampleConnector),
  with its extra config in ``extra``; or a dict: kvtier with that extra config.
  ``failure_policy``: vLLM's ``kv_load_failure_policy`` (default ``recompute``).
* ``plan``: steps run one at a time, so a request sees what the ones before it stored:
  ``{"p": i, "salt": str, "cut": n, "tag": any}`` sends prompt i (its first n tokens; with a
  ``cache_salt``), ``{"reset": true}`` empties vLLM's prefix cache, ``{"sh": "cmd"}`` runs a
  shell command (the fault harness breaks the pool with these), ``{"batch": [i, ...],
  "max_tokens": n}`` sends those prompts at once (one ``generate`` call; ``max_tokens`` for this
  step only). Default: every prompt in order,
  with ``reset_prefix_cache_at: [i, ...]`` inserting resets. ``loop_s``: repeat the plan until
  that much time has passed (at least once). ``batch: true``: all prompts in one ``generate``
  call instead (concurrently).
* ``max_tokens`` (6), ``logprobs`` (5; null: none), ``log_stats`` (true: vLLM's metrics, e.g. the
  preemption count; false for timing), ``tensor_parallel_size`` (1),
  ``num_gpu_blocks_override``, ``max_model_len`` (default: the longest prompt + output + 16,
  at least 2048), ``kv_cache_gib`` (vLLM's CPU KV cache, default 1), ``dtype`` (the model's own
  by default; ``"float32"`` makes batched outputs exact on the CPU build, where bf16 is not
  batch-invariant).
* ``engine_core_in_process`` (false): run vLLM's engine core, and with it the connector's
  scheduler role, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) while the model
  worker keeps a process of its own (executor ``mp``), so the scheduler and worker roles still
  talk across a process boundary as in ``vllm serve``. It saves one process's start (about
  10 s of imports on 2 cores). An engine core in its own process goes on stepping while its
  scheduler holds finished requests (the connector's saves of their answers, which vLLM hands
  to the worker in a step); ``LLM`` in this process stops when the last output is back, so the
  runner steps it until the scheduler holds none, after each step of the plan.

Output: ``{"start_s", "preemptions", "passes", "actions": [{"sh", "rc", "err"}], "results":
[{"p", "cut", "salt", "tag", "pass", "prompt_tokens", "tokens", "top", "cached", "seconds",
"ttft_s", "first_token_s"}]}``: ``seconds`` (= ``ttft_s`` with ``max_tokens: 1``) is the wall time
of the request's ``generate`` call, ``first_token_s`` vLLM's own time from the request's arrival
to its first token (with ``log_stats``; else null), ``top`` the top ``logprobs`` log-probabilities
of each generated token (a comparison tells a near-tie that numerical noise flipped from a
different answer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.engines import EngineError

TIE_NATS = 0.02
"""About two bf16 steps of a log-probability near -10: two candidate tokens this close are a tie
that numerical noise (a loaded KV vs a recomputed one, another kernel's accumulation order) may
flip, not a different answer. For the tiny random model, whose logits are small."""
REAL_TIE_NATS = 0.13
"""The same for a real model: its top logits lie between 16 and 32, where bf16 values are 0.125
apart, so two tokens one bf16 step apart are a tie. Measured on SmolLM2-135M-Instruct with plain
vLLM: a fresh prefill and a prefix-cache hit of the same prompt answered differently on 2 of 6
coding sessions, each at a token whose top two logits were 0.125 apart in one run and equal in the
other."""


def run_engine(spec: dict[str, Any], workdir: Path, name: str, timeout_s: float = 1800) -> dict[str, Any]:
    """Run ``spec`` in a fresh process (``WORKDIR/NAME.json`` gets the results); return them.

    Raises EngineError with the tail of the engine's stderr when it fails.
    """
    spec = {**spec, "out": str(workdir / f"{name}.json")}
    path = workdir / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "kvtier.bench.offline", str(path)], capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise EngineError(f"vLLM engine {name} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads((workdir / f"{name}.json").read_text())
    return result


def first_difference(got: dict[str, Any], want: dict[str, Any]) -> int | None:
    """The first position where two results' tokens differ (one being shorter counts), or None."""
    j = next((i for i, (a, b) in enumerate(zip(got["tokens"], want["tokens"], strict=False)) if a != b), None)
    if j is None and len(got["tokens"]) != len(want["tokens"]):
        return min(len(got["tokens"]), len(want["tokens"]))
    return j


def near_tie(got: dict[str, Any], want: dict[str, Any], tie_nats: float = TIE_NATS) -> bool:
    """Two results (with ``top``) that differ where, at the first differing position, each run's
    token is among the other run's top five and within ``tie_nats`` of that run's most likely
    token: a flip by numerical noise, not a bug."""
    j = first_difference(got, want)
    if j is None or j >= min(len(got["tokens"]), len(want["tokens"])):
        return False
    got_top = {int(t): lp for t, lp in got["top"][j]}
    want_top = {int(t): lp for t, lp in want["top"][j]}
    a, b = got["tokens"][j], want["tokens"][j]
    return (a in want_top and want_top[b] - want_top[a] < tie_nats
            and b in got_top and got_top[a] - got_top[b] < tie_nats)


def same_answer(got: dict[str, Any], want: dict[str, Any], tie_nats: float = TIE_NATS) -> bool:
    """Equal greedy tokens, or a near tie (``near_tie``)."""
    return bool(got["tokens"] == want["tokens"]
                or (got.get("top") and want.get("top") and near_tie(got, want, tie_nats)))


def transfer_config(spec: dict[str, Any]) -> Any:
    """vLLM's KVTransferConfig for the spec's ``connector`` (None: plain vLLM)."""
    from vllm.config import KVTransferConfig

    connector = spec.get("connector")
    if connector is None:
        return None
    if connector == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config=spec["extra"])
    extra = connector if isinstance(connector, dict) else spec["extra"]
    return KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                            kv_role="kv_both", kv_load_failure_policy=spec.get("failure_policy", "recompute"),
                            kv_connector_extra_config=extra)


def build_llm(spec: dict[str, Any]) -> Any:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    # The same CPU binding with and without a KV connector (see kvtier.bench.suite).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    tp = int(spec.get("tensor_parallel_size", 1))
    if tp > 1:  # vLLM's CPU build needs a core per rank named, or it refuses tensor parallel (ranks
        # past the machine's cores share them: TP=3 of a 3-head model on 2 cores)
        cores = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % cores) for i in range(tp)))
    kwargs: dict[str, Any] = {}
    if spec.get("engine_core_in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when the engine is built
        kwargs["distributed_executor_backend"] = "mp"  # not "uni": the worker in its own process
    from vllm import LLM

    transfer = transfer_config(spec)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks_override"]
    if spec.get("dtype"):
        kwargs["dtype"] = spec["dtype"]
    longest = max(len(p) for p in spec["prompts"]) + spec.get("max_tokens", 6) + 16
    max_len = spec.get("max_model_len") or max(longest, 2048)
    return LLM(model=spec["model"], enforce_eager=True, max_model_len=max_len, max_num_batched_tokens=max_len,
               enable_prefix_caching=True, seed=0, tensor_parallel_size=tp,
               disable_log_stats=not spec.get("log_stats", True), **kwargs)


def _result(out: Any, seconds: float, prompt_tokens: int, step: dict[str, Any], passes: int) -> dict[str, Any]:
    comp = out.outputs[0]
    # vLLM's own time to the first token (with log_stats), for requests that generate more than one.
    first = getattr(getattr(out, "metrics", None), "first_token_latency", None)
    return {"p": step.get("p"), "cut": step.get("cut"), "salt": step.get("salt"), "tag": step.get("tag"),
            "pass": passes, "prompt_tokens": prompt_tokens, "tokens": list(comp.token_ids),
            "cached": out.num_cached_tokens or 0, "seconds": seconds, "ttft_s": seconds,
            "first_token_s": float(first) if first else None,
            "top": [sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: -x[1])
                    for pos in comp.logprobs or []]}


def _preemptions(llm: Any, spec: dict[str, Any]) -> int | None:
    if not spec.get("log_stats", True):
        return None  # vLLM keeps no metrics
    for metric in llm.get_metrics():
        if metric.name == "vllm:num_preemptions":
            return int(getattr(metric, "value", 0))
    return 0


def _plan(spec: dict[str, Any]) -> list[dict[str, Any]]:
    if "plan" in spec:
        return list(spec["plan"])
    resets = set(spec.get("reset_prefix_cache_at", []))
    steps: list[dict[str, Any]] = []
    for i in range(len(spec["prompts"])):
        if i in resets:
            steps.append({"reset": True})
        steps.append({"p": i})
    return steps


SETTLE_S = 120.0  # steps after a plan step before an engine that never lets go of a request fails the run


class _Runner:
    def __init__(self, spec: dict[str, Any], llm: Any) -> None:
        from vllm import SamplingParams

        self.spec, self.llm = spec, llm
        self.params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 6),
                                     logprobs=spec.get("logprobs", 5))
        self.results: list[dict[str, Any]] = []
        self.actions: list[dict[str, Any]] = []
        self.passes = 0

    def batch(self) -> None:
        prompts = self.spec["prompts"]
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False)
        self.results = [_result(o, time.perf_counter() - t0, len(p), {"p": i}, 0)
                        for i, (o, p) in enumerate(zip(outs, prompts, strict=True))]

    def step(self, step: dict[str, Any]) -> None:
        if step.get("reset"):
            assert self.llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
        elif "batch" in step:
            params = self.params.clone()
            params.max_tokens = step.get("max_tokens", params.max_tokens)
            prompts = [{"prompt_token_ids": self.spec["prompts"][i]} for i in step["batch"]]
            t0 = time.perf_counter()
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            self.results += [_result(o, time.perf_counter() - t0, len(p["prompt_token_ids"]),
                                     {"p": i, "tag": step.get("tag")}, self.passes)
                             for i, o, p in zip(step["batch"], outs, prompts, strict=True)]
        elif "sh" in step:
            proc = subprocess.run(step["sh"], shell=True, capture_output=True, text=True)
            self.actions.append({"sh": step["sh"], "rc": proc.returncode, "err": proc.stderr[-500:]})
        else:
            ids = self.spec["prompts"][step["p"]]
            ids = ids[:step["cut"]] if "cut" in step else ids
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if step.get("salt") is not None:
                prompt["cache_salt"] = step["salt"]
            t0 = time.perf_counter()
            out = self.llm.generate([prompt], self.params, use_tqdm=False)[0]
            self.results.append(_result(out, time.perf_counter() - t0, len(ids), step, self.passes))

    def settle(self) -> None:
        """With the engine core in this process: step it until its scheduler holds no request, as
        its own process's loop does (vLLM's ``has_requests``: finished requests whose blocks a
        connector still holds, e.g. for the saves of their answers, count)."""
        core = getattr(getattr(self.llm.llm_engine, "engine_core", None), "engine_core", None)
        if core is None:  # the engine core runs in its own process
            return
        deadline = time.monotonic() + SETTLE_S
        while core.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine still holds requests after {SETTLE_S:.0f} s of steps")
            self.llm.llm_engine.step()

    def run(self) -> None:
        if self.spec.get("batch"):
            self.batch()
            self.settle()
            return
        plan, loop_s = _plan(self.spec), self.spec.get("loop_s")
        t_start = time.monotonic()
        while True:
            for step in plan:
                self.step(step)
                self.settle()
            self.passes += 1
            if not loop_s or time.monotonic() - t_start >= loop_s:
                break
            assert self.llm.reset_prefix_cache()


def main(spec_path: str) -> None:
    with open(spec_path) as fh:
        spec = json.load(fh)
    t0 = time.perf_counter()
    llm = build_llm(spec)
    start_s = time.perf_counter() - t0
    runner = _Runner(spec, llm)
    runner.run()
    with open(spec["out"], "w") as fh:
        json.dump({"start_s": start_s, "preemptions": _preemptions(llm, spec), "passes": runner.passes,
                   "actions": runner.actions, "results": runner.results}, fh)
    del llm  # shuts the engine down: the connector flushes and writes its metrics file


if __name__ == "__main__":
    main(sys.argv[1])
