"""``kvtier bench report``: ``summary.json``, ``summary.md``, ``requests.csv`` and plots of result folders.

A result folder (kvtier.bench.results) is only read here; the derived files (``summary.json``,
``summary.md``, ``requests.csv``, PNG plots, ``comparison.md``) are written beside it or into
``--out``, never the recorded data, so a report can be rebuilt at any time. The figures are
kvtier.bench.summary's, the markdown kvtier.bench.tables', the plots kvtier.bench.plots'; their
public names stay importable from here.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench import profiles
from kvtier.bench.plots import plot_names, write_plots
from kvtier.bench.results import Record, Run, load_run
from kvtier.bench.summary import (
    CONFIG_ORDER,
    WORKLOAD_ORDER,
    GroupKey,
    SectionKey,
    config_sort_key,
    percentile,
    summarize,
)
from kvtier.bench.tables import compare, format_change, format_speedup, render_markdown, unique_names
from kvtier.fileio import write_atomic

__all__ = [  # this module's names, and those that moved out, for ``from kvtier.bench.report import ...``
    "CONFIG_ORDER", "REQUEST_COLUMNS", "WORKLOAD_ORDER", "GroupKey", "Record", "Run", "SectionKey", "compare",
    "config_sort_key", "format_change", "format_speedup", "load_run", "main", "percentile", "plot_names",
    "render_markdown", "summarize", "write_report",
]

# requests.csv columns, in this fixed order; keys a newer suite adds are appended, sorted.
REQUEST_COLUMNS = (
    "config", "instances", "instance", "concurrency", "workload", "phase", "measured", "session", "turn",
    "start_s", "ttft_s", "itl_s", "e2e_s", "prompt_tokens", "output_tokens", "cached_tokens", "error", "status",
)


def _csv_text(records: list[Record]) -> str:
    extra = sorted({k for r in records for k in r} - set(REQUEST_COLUMNS))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*REQUEST_COLUMNS, *extra])
    for row in records:
        # JSON spellings, so the CSV and the JSONL say the same thing: true/false and an empty null.
        writer.writerow(["" if (v := row.get(k)) is None else json.dumps(v) if isinstance(v, bool) else v
                         for k in (*REQUEST_COLUMNS, *extra)])
    return buf.getvalue()


def write_report(run: Run, out: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Write ``summary.json``, ``summary.md``, ``requests.csv`` and the PNG plots into ``out``.

    ``out`` defaults to the run folder and is created if needed; existing report files are
    replaced atomically, the recorded files are never touched. Returns the summary dict
    ``{"runs": summarize(run), "env": run.env}`` as written to ``summary.json``.
    """
    folder = Path(out) if out is not None else run.path
    folder.mkdir(parents=True, exist_ok=True)
    runs = summarize(run)
    summary = {"runs": runs, "env": run.env, "profile": profiles.profile_summary(run.records)}
    write_atomic(folder / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
    write_atomic(folder / "requests.csv", _csv_text(run.records).encode())
    write_atomic(folder / "summary.md", render_markdown(run, runs).encode())
    write_plots(run, runs, folder)
    return summary


def main(dirs: list[str], out: str | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``kvtier bench report DIR... [--out DIR]``.

    One dir: write its report into ``out`` (default: the dir), print the summary.md path on
    stdout and return the summary. Several: write each run's report into its own folder (or
    ``out/<name>``), write ``comparison.md`` into ``out`` (default: the first dir), print its
    path and return ``{"runs": {name: summary}, "comparison": path}``. Progress goes to stderr
    (or to ``log``). Raises ValueError for an unreadable folder, before writing anything.
    """
    if not dirs:
        raise ValueError("give at least one benchmark result folder")
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    runs = [load_run(d) for d in dirs]
    for run in runs:
        say(f"loaded {run.path}: {len(run.records)} requests, {len(run.configs)} configurations")
    if len(runs) == 1:
        target = Path(out) if out is not None else runs[0].path
        summary = write_report(runs[0], target)
        say(f"wrote report into {target}")
        print(target / "summary.md")
        return summary
    names = unique_names([r.name for r in runs])
    summaries: dict[str, Any] = {}
    for name, run in zip(names, runs, strict=True):
        target = Path(out) / name if out is not None else run.path
        summaries[name] = write_report(run, target)
        say(f"wrote report of {name} into {target}")
    comparison = (Path(out) if out is not None else runs[0].path) / "comparison.md"
    comparison.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(comparison, compare(runs).encode())
    say(f"wrote {comparison}")
    print(comparison)
    return {"runs": summaries, "comparison": str(comparison)}
