"""Figures of one result folder: one entry per (config, instances, workload, concurrency).

Every figure is computed per group over the rows marked ``measured`` (warm-up and populate rows
are excluded). A configuration that failed is never dropped: it keeps one entry per concurrency
it was meant to run, with its error. Entries are ordered as a reader compares them: by workload,
instances, the suite's configuration registry (kvtier.bench.configs), then concurrency.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import numpy as np

from kvtier.bench import profiles
from kvtier.bench.configs import CONFIGS
from kvtier.bench.results import Record, Run

GroupKey = tuple[str, int, str, int]  # (config, instances, workload, concurrency)
SectionKey = tuple[str, int]  # (workload, instances)

# Known names first, in the order a reader compares them (the suite's registry: baseline, then
# tiers, then peers); anything else follows alphabetically.
CONFIG_ORDER = CONFIGS
WORKLOAD_ORDER = ("cold-resume", "chat", "short-chat")


def config_sort_key(name: str) -> tuple[int, str]:
    """Known configurations in :data:`CONFIG_ORDER`, then the others alphabetically."""
    return (CONFIG_ORDER.index(name), "") if name in CONFIG_ORDER else (len(CONFIG_ORDER), name)


def section_sort_key(section: SectionKey) -> tuple[int, str, int]:
    workload, instances = section
    rank = WORKLOAD_ORDER.index(workload) if workload in WORKLOAD_ORDER else len(WORKLOAD_ORDER)
    return (rank, workload, instances)


def _group_sort_key(key: GroupKey) -> tuple[tuple[int, str, int], tuple[int, str], int]:
    config, instances, workload, concurrency = key
    return (section_sort_key((workload, instances)), config_sort_key(config), concurrency)


def quantile(values: list[float], q: float) -> float | None:
    """The value at rank ``int(q * n)`` of the sorted values (no interpolation); None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: list[float]) -> float | None:
    """statistics.median, None for no values."""
    return statistics.median(values) if values else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), interpolated linearly between order statistics (numpy's
    default method); None for no values."""
    return float(np.percentile(values, q)) if values else None


def _config_status(run: Run) -> dict[tuple[str, int, str], tuple[str, str | None]]:
    """(config, instances, workload) -> (status, error) from configs.json.

    If the suite tried the same configuration more than once, one failure marks it failed and
    the distinct errors are joined: a retry that succeeded must not hide that it crashed once.
    """
    merged: dict[tuple[str, int, str], tuple[str, list[str]]] = {}
    for entry in run.configs:
        key = (str(entry["config"]), int(entry.get("instances", 1)), str(entry.get("workload", "")))
        status, errors = merged.get(key, ("ok", []))
        if entry.get("status", "ok") != "ok":
            status = "failed"
        error = entry.get("error")
        if error and str(error) not in errors:
            errors.append(str(error))
        merged[key] = (status, errors)
    return {k: (status, "; ".join(errors) or None) for k, (status, errors) in merged.items()}


def _group_summary(rows: list[Record]) -> Record:
    """Figures of one group's measured rows (possibly none); see :func:`summarize`."""
    ok = [r for r in rows if r.get("error") is None]
    ttfts = [float(r["ttft_s"]) for r in ok if r.get("ttft_s") is not None]
    itls = [float(r["itl_s"]) for r in ok if r.get("itl_s") is not None]
    e2es = [float(r["e2e_s"]) for r in ok if r.get("e2e_s") is not None]
    cached = [int(r["cached_tokens"]) for r in ok if r.get("cached_tokens") is not None]
    prompt = [int(r["prompt_tokens"]) for r in ok if r.get("prompt_tokens") is not None]
    output_tokens = sum(int(r.get("output_tokens") or 0) for r in ok)
    # Wall time from the first request sent to the last one finished; a row that failed
    # without an e2e time still counts as having started.
    ends = [float(r["start_s"]) + float(r["e2e_s"]) for r in rows if r.get("e2e_s") is not None]
    duration = max(ends) - min(float(r["start_s"]) for r in rows) if ends else None
    figures: Record = {
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "itl_p50_s": percentile(itls, 50),
        "e2e_p50_s": percentile(e2es, 50),
        "output_tok_s": output_tokens / duration if duration else None,
        "prompt_tokens": sum(prompt) if prompt else None,
        "output_tokens": output_tokens,
        # None, not 0, when the server reported nothing: "no cache figure" is not "no hits".
        "cached_tokens": sum(cached) if cached else None,
        "duration_s": duration,
    }
    # Rounded so summary.json reads 0.179, not 0.17900000000000002; microseconds are far below noise.
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in figures.items()}


def summarize(run: Run) -> list[Record]:
    """One entry per (config, instances, workload, concurrency), over rows with ``measured`` true.

    Percentiles (linear interpolation) are over successful rows (``error`` null and ``ttft_s``
    set); ``errors`` counts rows with an error; token sums are over rows without an error;
    ``output_tok_s`` = successful output tokens / (last ``start_s + e2e_s`` - first ``start_s``)
    over the group's measured rows. Every concurrency listed in configs.json appears even
    without rows (``requests`` 0, figures null), so a configuration that failed before serving
    anything still shows, with ``status`` "failed" and its ``error``. Entries are ordered by
    workload, instances, :func:`config_sort_key`, concurrency.
    """
    groups: dict[GroupKey, list[Record]] = {}
    for entry in run.configs:
        levels = entry.get("concurrency") or []
        for concurrency in levels if isinstance(levels, list) else [levels]:
            key = (str(entry["config"]), int(entry.get("instances", 1)), str(entry.get("workload", "")),
                   int(concurrency))
            groups.setdefault(key, [])
    for row in run.records:
        if row["measured"] is True:
            key = (str(row["config"]), int(row["instances"]), str(row["workload"]), int(row["concurrency"]))
            groups.setdefault(key, []).append(row)
    statuses = _config_status(run)
    out: list[Record] = []
    for key in sorted(groups, key=_group_sort_key):
        config, instances, workload, concurrency = key
        status, error = statuses.get((config, instances, workload), ("ok", None))
        out.append({"config": config, "instances": instances, "workload": workload, "concurrency": concurrency,
                    **_group_summary(groups[key]), "status": status, "error": error})
    floors = profiles.floor_figures(run.env, out, run.records)
    for entry in out:
        floor = floors.get((entry["workload"], entry["instances"], entry["concurrency"]))
        p50 = entry["ttft_p50_s"]
        if floor is not None:
            entry.update(floor_s=floor["floor_s"], floor_bytes_s=floor["bytes_s"],
                         x_floor=round(p50 / floor["floor_s"], 4) if p50 is not None else None,
                         x_floor_bytes=round(p50 / (floor["floor_s"] + floor["bytes_s"]), 4)
                         if p50 is not None and floor["bytes_s"] is not None else None)
    return out


def sections(summary: Iterable[Record]) -> dict[SectionKey, list[Record]]:
    """Summary entries split by (workload, instances), in report order."""
    out: dict[SectionKey, list[Record]] = {}
    for entry in summary:
        out.setdefault((entry["workload"], entry["instances"]), []).append(entry)
    return {k: out[k] for k in sorted(out, key=section_sort_key)}


def configs_of(entries: Iterable[Record]) -> list[str]:
    return sorted({e["config"] for e in entries}, key=config_sort_key)
