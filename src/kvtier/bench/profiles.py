"""The floor and the resume profile in a benchmark report.

**The floor.** A resume cannot beat the engine's own prefix-cache hit (``engine-cache``, the
suite's floor configuration) plus the chunk bytes read at the storage's best rate. Per
(workload, instances, concurrency), ``floor_s`` is engine-cache's TTFT p50 and ``bytes_s`` the
median resumed prompt's KV bytes (the model's bytes per token, from ``env.json``) over the
storage probe's best raw read (``env.json``'s ``storage_probe.best_raw_gbps``, same run). Each
configuration's TTFT p50 is reported as a multiple of ``floor_s`` and of ``floor_s + bytes_s``.

**The resume profile.** kvtier's connector writes one record per request (``profile_file``;
``kvtier.integrations.vllm.profile``); the suite gathers them into ``profiles.jsonl`` with the
configuration's name. They are joined to the client's records by the ``X-Request-Id`` the
client sent (vLLM builds its request id from it), and summarised as medians over the resumed
requests (cold-resume, phase resume, measured) of each configuration.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Record = dict[str, Any]
PROFILE_FIELDS = ("answer_s", "lookup_s", "alloc_s", "queue_s", "load_s", "read_s", "copy_s", "report_s",
                  "schedule_s", "wait_steps", "prefill_s", "total_s")
FLOOR = "engine-cache"
_CLIENT_ID = re.compile(r"kvtb-\d+-\d+-[0-9a-f]{8}")
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1}


def load_profiles(folder: Path) -> dict[tuple[str, str], Record]:
    """``(config, client request id)`` -> profile record, from ``profiles.jsonl`` ({} without one)."""
    path = folder / "profiles.jsonl"
    out: dict[tuple[str, str], Record] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        m = _CLIENT_ID.search(str(row.get("external_id", "")))
        if isinstance(row, dict) and m:
            out[(str(row.get("config")), m.group(0))] = row
    return out


def join(records: Iterable[Record], profiles: dict[tuple[str, str], Record]) -> list[Record]:
    """Each record with its profile's fields added as ``profile_<field>`` (records without one as is)."""
    out = []
    for r in records:
        profile = profiles.get((str(r.get("config")), str(r.get("request_id"))))
        if profile is None:
            out.append(r)
        else:
            out.append({**r, **{f"profile_{k}": profile.get(k) for k in (*PROFILE_FIELDS, "decision", "tier")}})
    return out


def _resumed(records: Iterable[Record]) -> list[Record]:
    return [r for r in records if r.get("workload") == "cold-resume" and r.get("phase") == "resume"
            and r.get("measured") is True and r.get("error") is None]


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 6) if values else None


def profile_summary(records: Iterable[Record]) -> list[Record]:
    """Per configuration with profiles: medians of each span over its resumed requests, the
    client's TTFT p50 over the same requests, and what the connector does not see (``outside_s``:
    TTFT minus ``total_s``, request by request: HTTP, tokenizing, detokenizing)."""
    by_config: dict[str, list[Record]] = {}
    for r in _resumed(records):
        if r.get("profile_total_s") is not None:
            by_config.setdefault(str(r["config"]), []).append(r)
    out = []
    for config, rows in sorted(by_config.items()):
        entry: Record = {"config": config, "requests": len(rows),
                         "loaded": sum(1 for r in rows if r.get("profile_decision") == "load"),
                         "ttft_s": _median([float(r["ttft_s"]) for r in rows if r.get("ttft_s") is not None])}
        for name in PROFILE_FIELDS:
            entry[name] = _median([float(r[f"profile_{name}"]) for r in rows if r.get(f"profile_{name}") is not None])
        entry["outside_s"] = _median([float(r["ttft_s"]) - float(r["profile_total_s"]) for r in rows
                                      if r.get("ttft_s") is not None])
        out.append(entry)
    return out


def bytes_per_token(env: Record) -> int | None:
    """KV bytes per token of the benchmarked model (all layers, K and V), from ``env.json``."""
    shape = env.get("model_shape") or {}
    try:
        layers, kv_heads = int(shape["num_hidden_layers"]), int(shape["num_key_value_heads"])
        head_dim = int(shape.get("head_dim") or int(shape["hidden_size"]) // int(shape["num_attention_heads"]))
    except (KeyError, TypeError, ValueError):
        return None
    return layers * 2 * kv_heads * head_dim * _DTYPE_BYTES.get(str(shape.get("torch_dtype")), 2)


def floor_figures(env: Record, summary: Iterable[Record], records: Iterable[Record]) -> dict[tuple[str, int, int],
                                                                                               Record]:
    """``(workload, instances, concurrency)`` -> ``{"floor_s", "bytes_s", "best_raw_gbps"}`` where the
    run has the floor configuration (see the module docstring)."""
    probe = env.get("storage_probe") or {}
    rate = probe.get("best_raw_gbps") if isinstance(probe, dict) else None
    per_token = bytes_per_token(env)
    prompts: dict[tuple[str, int, int], list[int]] = {}
    for r in _resumed(records):
        if r.get("prompt_tokens") is not None:
            prompts.setdefault((str(r["workload"]), int(r["instances"]), int(r["concurrency"])), []).append(
                int(r["prompt_tokens"]))
    out: dict[tuple[str, int, int], Record] = {}
    for e in summary:
        if e["config"] != FLOOR or e.get("ttft_p50_s") is None:
            continue
        key = (str(e["workload"]), int(e["instances"]), int(e["concurrency"]))
        tokens = prompts.get(key)
        bytes_s = (statistics.median(tokens) * per_token / (rate * 1e9)
                   if tokens and per_token and rate else None)
        out[key] = {"floor_s": e["ttft_p50_s"], "bytes_s": None if bytes_s is None else round(bytes_s, 6),
                    "best_raw_gbps": rate}
    return out


def profile_markdown(rows: list[Record]) -> list[str]:
    """The report's resume-profile section (empty when no configuration wrote profiles)."""
    if not rows:
        return []
    names = ("answer_s", "alloc_s", "queue_s", "load_s", "read_s", "copy_s", "report_s", "schedule_s", "prefill_s",
             "total_s", "outside_s", "ttft_s")
    lines = ["## Resume profile (medians over resumed requests, ms)", "",
             "| config | requests (loaded) | " + " | ".join(n.removesuffix("_s") for n in names) + " | wait steps |",
             "|" + "---|" * (len(names) + 3)]
    for e in rows:
        cells = ["—" if e.get(n) is None else f"{1e3 * e[n]:.1f}" for n in names]
        steps = "—" if e.get("wait_steps") is None else f"{e['wait_steps']:g}"
        lines.append(f"| {e['config']} | {e['requests']} ({e['loaded']}) | " + " | ".join(cells) + f" | {steps} |")
    lines += ["", "answer: arrival to the connector's answer (lookup included); alloc: to the load's dispatch; "
              "queue: to the first read; load: first read to last chunk in the blocks (read, copy: summed over "
              "chunks, overlapping); report: to every rank reporting it; schedule: to the step that prefills the "
              "suffix (— with load_mode sync: the load runs inside that step); prefill: that step, from the load's "
              "end on for a sync load; total: the connector's view of the time to first token; outside: the "
              "client's TTFT minus total (HTTP, tokenizing, detokenizing).", ""]
    return lines
