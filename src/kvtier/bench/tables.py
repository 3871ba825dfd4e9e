"""Markdown of one result folder's figures (``summary.md``) and of several side by side (``comparison.md``).

Ratios (against recompute, against local disk, between runs) are taken between figures of the
same run, or of runs on the same machine, never from a lone absolute time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.bench import profiles
from kvtier.bench.results import Record, Run
from kvtier.bench.summary import SectionKey, config_sort_key, configs_of, section_sort_key, sections, summarize

NONE = "—"  # a figure that is missing


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def _fmt(value: float | None, spec: str, failed: bool = False) -> str:
    if value is None:
        return "failed" if failed else NONE
    return format(value, spec)


def format_speedup(baseline_s: float | None, value_s: float | None) -> str:
    """``baseline / value`` as ``12.6x`` (how many times faster than the baseline); — if either is missing."""
    if baseline_s is None or not value_s:
        return NONE
    return f"{baseline_s / value_s:.1f}x"


def format_change(baseline_s: float | None, value_s: float | None) -> str:
    """Percent difference of ``value`` vs ``baseline`` (``-3%``: 3% lower); — if either is missing."""
    if not baseline_s or value_s is None:
        return NONE
    pct = round((value_s / baseline_s - 1.0) * 100.0)
    return "0%" if pct == 0 else f"{pct:+d}%"


def section_title(section: SectionKey) -> str:
    workload, instances = section
    return f"{workload}, {instances} instance{'s' if instances != 1 else ''}"


def _section_markdown(section: SectionKey, entries: list[Record]) -> list[str]:
    configs = configs_of(entries)
    concurrencies = sorted({e["concurrency"] for e in entries})
    by_key = {(e["config"], e["concurrency"]): e for e in entries}

    def cell(config: str, concurrency: int, name: str, spec: str) -> str:
        entry = by_key.get((config, concurrency))
        if entry is None:
            return NONE
        return _fmt(entry[name], spec, failed=entry["status"] == "failed" and entry["requests"] == 0)

    def p50(config: str, concurrency: int) -> float | None:
        entry = by_key.get((config, concurrency))
        return None if entry is None else entry["ttft_p50_s"]

    lines = [f"## {section_title(section)}", ""]
    header = ["concurrency", *(f"{c} TTFT p50 (s)" for c in configs), *(f"{c} tok/s" for c in configs)]
    lines += _table(header, ([str(n), *(cell(c, n, "ttft_p50_s", ".3f") for c in configs),
                              *(cell(c, n, "output_tok_s", ".1f") for c in configs)] for n in concurrencies))
    def of_floor(config: str, concurrency: int, name: str) -> str:
        entry = by_key.get((config, concurrency))
        return NONE if entry is None or entry.get(name) is None else f"{entry[name]:.2f}x"

    lines += ["### TTFT p50 vs baselines", ""]
    lines += _table(["config", "concurrency", "x vs recompute", "vs local-disk", "x of floor", "x of floor + bytes"],
                    ([c, str(n), format_speedup(p50("recompute", n), p50(c, n)),
                      format_change(p50("local-disk", n), p50(c, n)), of_floor(c, n, "x_floor"),
                      of_floor(c, n, "x_floor_bytes")] for c in configs for n in concurrencies))
    lines += ["### TTFT p90 (s)", ""]
    lines += _table(["concurrency", *configs],
                    ([str(n), *(cell(c, n, "ttft_p90_s", ".3f") for c in configs)] for n in concurrencies))
    lines += ["### Requests and cached tokens", ""]
    lines += _table(["config", "concurrency", "requests", "errors", "prompt tokens", "cached tokens"],
                    ([c, str(n), cell(c, n, "requests", "d"), cell(c, n, "errors", "d"),
                      cell(c, n, "prompt_tokens", "d"), cell(c, n, "cached_tokens", "d")]
                     for c in configs for n in concurrencies if (c, n) in by_key))
    lines += ["### Failures", ""]
    # Whole configurations that failed first, then groups that lost some requests.
    failed = {e["config"]: e["error"] for e in entries if e["status"] == "failed"}
    failures = [f"- **{c}** failed: {failed[c] or 'no error recorded'}" for c in configs if c in failed]
    failures += [f"- {e['config']} at concurrency {e['concurrency']}: {e['errors']} of {e['requests']} requests failed"
                 for e in entries if e["errors"]]
    lines += (failures or ["None."]) + [""]
    return lines


_HOW_TO_READ = (
    "How to read: TTFT is the time to the first streamed token (lower is better); `x vs recompute` is "
    "recompute's TTFT p50 divided by the configuration's (above 1x: faster than recomputing the prompt); "
    "`vs local-disk` is the TTFT p50 difference to local disk (negative: lower TTFT); `x of floor` is the "
    "TTFT p50 over engine-cache's (vLLM's own prefix-cache hit: the floor), `x of floor + bytes` over the floor "
    "plus the resumed prompt's KV bytes at the storage probe's best read rate; tok/s is output tokens "
    "of successful requests over the group's wall time; failed = the configuration never served that step."
)


def render_markdown(run: Run, summary: list[Record]) -> str:
    """The text of ``summary.md``: one section per (workload, instances), then how to read it."""
    measured = sum(1 for r in run.records if r["measured"] is True)
    lines = [f"# Benchmark report: {run.name}", "",
             f"{measured} measured requests of {len(run.records)} recorded; "
             f"{len({e['config'] for e in summary})} configurations.", ""]
    for section, entries in sections(summary).items():
        lines += _section_markdown(section, entries)
    lines += profiles.profile_markdown(profiles.profile_summary(run.records))
    return "\n".join([*lines, _HOW_TO_READ, ""])


def compare(runs: list[Run]) -> str:
    """Markdown comparing runs: TTFT p50 per run for every (config, concurrency) seen in any run.

    Columns are the run folder names (suffixed ``#2``, ``#3`` ... if two folders share a name),
    then, for each later run, its TTFT p50 divided by the first run's (``0.50x``: half the TTFT).
    """
    if not runs:
        raise ValueError("compare needs at least one run")
    names = unique_names([r.name for r in runs])
    tables = [{(e["workload"], e["instances"], e["config"], e["concurrency"]): e for e in summarize(r)}
              for r in runs]
    keys = sorted({k for t in tables for k in t},
                  key=lambda k: (section_sort_key((k[0], k[1])), config_sort_key(k[2]), k[3]))
    lines = ["# Benchmark comparison", "", "Runs: " + ", ".join(f"`{n}`" for n in names), ""]
    for section in sorted({(k[0], k[1]) for k in keys}, key=section_sort_key):
        lines += [f"## {section_title(section)}: TTFT p50 (s)", ""]
        header = ["config", "concurrency", *names, *(f"{n} / {names[0]}" for n in names[1:])]
        rows = []
        for key in (k for k in keys if (k[0], k[1]) == section):
            p50s = [t[key]["ttft_p50_s"] if key in t else None for t in tables]
            rows.append([key[2], str(key[3]), *(_fmt(v, ".3f") for v in p50s),
                         *(f"{v / p50s[0]:.2f}x" if v is not None and p50s[0] else NONE for v in p50s[1:])])
        lines += _table(header, rows)
    return "\n".join(lines)


def unique_names(names: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out
