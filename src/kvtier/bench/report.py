"""Tables, ``summary.json`` and plots from one or several benchmark result folders.

A result folder, written by the benchmark suite, holds ``requests.jsonl`` (one object per
request), ``configs.json`` (one object per engine configuration tried, with its status) and
``env.json`` (versions, machine, model shape, suite settings). This module only reads those
files and writes derived ones (``summary.json``, ``summary.md``, ``requests.csv``, PNG plots,
``comparison.md``); it never changes the recorded data, so a report can be rebuilt at any time.

Every figure is computed per group ``(config, instances, workload, concurrency)`` over the
rows marked ``measured`` (warm-up and populate rows are excluded). A configuration that failed
is never dropped: it keeps one entry per concurrency it was meant to run, with its error.
Ratios (against recompute, against local disk, between runs) are taken between figures of the
same run, or of runs on the same machine, never from a lone absolute time.

Over 400 lines on purpose: loading a run, grouping, tables, markdown and plots of one result
folder format; they change together when the format does.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.bench import profiles
from kvtier.bench.suite import CONFIGS
from kvtier.fileio import write_atomic
from kvtier.jsonl import json_objects

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Record = dict[str, Any]
GroupKey = tuple[str, int, str, int]  # (config, instances, workload, concurrency)
SectionKey = tuple[str, int]  # (workload, instances)

# Known names first, in the order a reader compares them (the suite's registry: baseline, then
# tiers, then peers); anything else follows alphabetically.
CONFIG_ORDER = CONFIGS
WORKLOAD_ORDER = ("cold-resume", "chat", "short-chat")
# requests.csv columns, in this fixed order; keys a newer suite adds are appended, sorted.
REQUEST_COLUMNS = (
    "config", "instances", "instance", "concurrency", "workload", "phase", "measured", "session", "turn",
    "start_s", "ttft_s", "itl_s", "e2e_s", "prompt_tokens", "output_tokens", "cached_tokens", "error", "status",
)
# A row without these cannot be grouped or timed, so load_run rejects it rather than guess.
_REQUIRED = ("config", "instances", "workload", "concurrency", "measured", "start_s")
_PLAIN_SECTION: SectionKey = ("cold-resume", 1)
_NONE = "—"


@dataclass
class Run:
    """One benchmark result folder as loaded by :func:`load_run`; read-only by convention."""

    path: Path
    records: list[Record]
    configs: list[Record] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The folder name: the column heading of this run in :func:`compare`."""
        return self.path.name


# ---------------------------------------------------------------- loading


def _load_json(path: Path, default: Any) -> Any:
    """Parsed JSON of ``path``, ``default`` if it does not exist; ValueError naming it if malformed."""
    if not path.exists():
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def load_run(path: str | os.PathLike[str]) -> Run:
    """Read a result folder. ``requests.jsonl`` is required; ``configs.json``/``env.json`` are optional.

    Raises ValueError naming the file (and line) if ``requests.jsonl`` is missing, a line is not a
    JSON object, a row lacks a field needed for grouping, or ``configs.json`` is not a list of
    objects with a ``config`` name.
    Blank lines are skipped (a suite killed mid-write leaves at most a trailing partial line,
    which is reported rather than ignored, so a truncated run is noticed).
    """
    folder = Path(path)
    requests = folder / "requests.jsonl"
    if not requests.is_file():
        raise ValueError(f"{requests}: missing; is {folder} a benchmark result folder?")
    records: list[Record] = []
    with requests.open(encoding="utf-8") as fh:
        for lineno, row in json_objects(fh, requests):
            missing = [k for k in _REQUIRED if k not in row]
            if missing:
                raise ValueError(f"{requests}:{lineno}: missing field(s) {', '.join(missing)}")
            records.append(row)
    configs = _load_json(folder / "configs.json", [])
    if not isinstance(configs, list) or not all(isinstance(c, dict) and "config" in c for c in configs):
        raise ValueError(f"{folder / 'configs.json'}: expected a list of objects, each with a \"config\" name")
    env = _load_json(folder / "env.json", {})
    if not isinstance(env, dict):
        raise ValueError(f"{folder / 'env.json'}: expected a JSON object")
    records = profiles.join(records, profiles.load_profiles(folder))  # profile_* fields, where written
    return Run(path=folder, records=records, configs=configs, env=env)


# ---------------------------------------------------------------- summary


def config_sort_key(name: str) -> tuple[int, str]:
    """Known configurations in :data:`CONFIG_ORDER`, then the others alphabetically."""
    return (CONFIG_ORDER.index(name), "") if name in CONFIG_ORDER else (len(CONFIG_ORDER), name)


def _section_sort_key(section: SectionKey) -> tuple[int, str, int]:
    workload, instances = section
    rank = WORKLOAD_ORDER.index(workload) if workload in WORKLOAD_ORDER else len(WORKLOAD_ORDER)
    return (rank, workload, instances)


def _group_sort_key(key: GroupKey) -> tuple[tuple[int, str, int], tuple[int, str], int]:
    config, instances, workload, concurrency = key
    return (_section_sort_key((workload, instances)), config_sort_key(config), concurrency)


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


# ---------------------------------------------------------------- markdown


def _sections(summary: Iterable[Record]) -> dict[SectionKey, list[Record]]:
    """Summary entries split by (workload, instances), in report order."""
    sections: dict[SectionKey, list[Record]] = {}
    for entry in summary:
        sections.setdefault((entry["workload"], entry["instances"]), []).append(entry)
    return {k: sections[k] for k in sorted(sections, key=_section_sort_key)}


def _configs_of(entries: Iterable[Record]) -> list[str]:
    return sorted({e["config"] for e in entries}, key=config_sort_key)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def _fmt(value: float | None, spec: str, failed: bool = False) -> str:
    if value is None:
        return "failed" if failed else _NONE
    return format(value, spec)


def format_speedup(baseline_s: float | None, value_s: float | None) -> str:
    """``baseline / value`` as ``12.6x`` (how many times faster than the baseline); — if either is missing."""
    if baseline_s is None or not value_s:
        return _NONE
    return f"{baseline_s / value_s:.1f}x"


def format_change(baseline_s: float | None, value_s: float | None) -> str:
    """Percent difference of ``value`` vs ``baseline`` (``-3%``: 3% lower); — if either is missing."""
    if not baseline_s or value_s is None:
        return _NONE
    pct = round((value_s / baseline_s - 1.0) * 100.0)
    return "0%" if pct == 0 else f"{pct:+d}%"


def _section_title(section: SectionKey) -> str:
    workload, instances = section
    return f"{workload}, {instances} instance{'s' if instances != 1 else ''}"


def _section_markdown(section: SectionKey, entries: list[Record]) -> list[str]:
    configs = _configs_of(entries)
    concurrencies = sorted({e["concurrency"] for e in entries})
    by_key = {(e["config"], e["concurrency"]): e for e in entries}

    def cell(config: str, concurrency: int, name: str, spec: str) -> str:
        entry = by_key.get((config, concurrency))
        if entry is None:
            return _NONE
        return _fmt(entry[name], spec, failed=entry["status"] == "failed" and entry["requests"] == 0)

    def p50(config: str, concurrency: int) -> float | None:
        entry = by_key.get((config, concurrency))
        return None if entry is None else entry["ttft_p50_s"]

    lines = [f"## {_section_title(section)}", ""]
    header = ["concurrency", *(f"{c} TTFT p50 (s)" for c in configs), *(f"{c} tok/s" for c in configs)]
    lines += _table(header, ([str(n), *(cell(c, n, "ttft_p50_s", ".3f") for c in configs),
                              *(cell(c, n, "output_tok_s", ".1f") for c in configs)] for n in concurrencies))
    def of_floor(config: str, concurrency: int, name: str) -> str:
        entry = by_key.get((config, concurrency))
        return _NONE if entry is None or entry.get(name) is None else f"{entry[name]:.2f}x"

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
    for section, entries in _sections(summary).items():
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
    names = _unique_names([r.name for r in runs])
    tables = [{(e["workload"], e["instances"], e["config"], e["concurrency"]): e for e in summarize(r)}
              for r in runs]
    keys = sorted({k for t in tables for k in t},
                  key=lambda k: (_section_sort_key((k[0], k[1])), config_sort_key(k[2]), k[3]))
    lines = ["# Benchmark comparison", "", "Runs: " + ", ".join(f"`{n}`" for n in names), ""]
    for section in sorted({(k[0], k[1]) for k in keys}, key=_section_sort_key):
        lines += [f"## {_section_title(section)}: TTFT p50 (s)", ""]
        header = ["config", "concurrency", *names, *(f"{n} / {names[0]}" for n in names[1:])]
        rows = []
        for key in (k for k in keys if (k[0], k[1]) == section):
            p50s = [t[key]["ttft_p50_s"] if key in t else None for t in tables]
            rows.append([key[2], str(key[3]), *(_fmt(v, ".3f") for v in p50s),
                         *(f"{v / p50s[0]:.2f}x" if v is not None and p50s[0] else _NONE for v in p50s[1:])])
        lines += _table(header, rows)
    return "\n".join(lines)


def _unique_names(names: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


# ---------------------------------------------------------------- files


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


def plot_names(section: SectionKey, single: bool) -> dict[str, str]:
    """File names of a section's three plots; unsuffixed for cold-resume x1 or a lone section."""
    workload, instances = section
    suffix = ""
    if not single and section != _PLAIN_SECTION:
        suffix = f"-{workload}" + (f"-{instances}inst" if instances != 1 else "")
    return {kind: f"{kind}{suffix}.png" for kind in ("ttft_vs_concurrency", "ttft_cdf", "throughput")}


def _write_plots(run: Run, summary: list[Record], out: Path) -> list[Path]:
    """Three PNGs per (workload, instances); returns the paths written.

    matplotlib is imported here, not at module level, so importing this module stays cheap;
    figures are built with ``Figure`` (no pyplot global state) on the Agg backend (no display).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    # One colour per configuration across every figure of the run.
    colours = {c: f"C{i % 10}" for i, c in enumerate(_configs_of(summary))}
    sections = _sections(summary)
    written: list[Path] = []

    def save(fig: Figure, name: str) -> None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        write_atomic(out / name, buf.getvalue())
        written.append(out / name)

    for section, entries in sections.items():
        names = plot_names(section, single=len(sections) == 1)
        title = _section_title(section)
        configs = _configs_of(entries)
        concurrencies = sorted({e["concurrency"] for e in entries})

        def series(config: str, name: str, rows: list[Record] = entries) -> tuple[list[int], list[float]]:
            points = [(e["concurrency"], e[name]) for e in rows if e["config"] == config and e[name] is not None]
            return [p[0] for p in points], [p[1] for p in points]

        fig = Figure(figsize=(7, 4.5), layout="constrained")
        ax = fig.add_subplot()
        for config in configs:
            for stat, style in (("ttft_p50_s", "-o"), ("ttft_p90_s", "--x")):
                xs, ys = series(config, stat)
                if xs:
                    ax.plot(xs, ys, style, color=colours[config], label=f"{config} {stat[5:8]}")
        _finish(ax, f"TTFT p50 (solid) and p90 (dashed): {title}", "concurrency", "TTFT (s)", concurrencies, log=True)
        save(fig, names["ttft_vs_concurrency"])

        fig = Figure(figsize=(4 * max(1, len(concurrencies)), 4), layout="constrained")
        axes = fig.subplots(1, max(1, len(concurrencies)), squeeze=False, sharey=True)[0]
        for ax, concurrency in zip(axes, concurrencies, strict=False):
            for config in configs:
                ttfts = sorted(float(r["ttft_s"]) for r in run.records
                               if r["measured"] is True and r.get("error") is None and r.get("ttft_s") is not None
                               and (r["workload"], r["instances"]) == section
                               and r["config"] == config and r["concurrency"] == concurrency)
                if ttfts:
                    # A leading 0 so each curve rises from the axis at its fastest request.
                    ax.step([ttfts[0], *ttfts], [0.0, *(np.arange(1, len(ttfts) + 1) / len(ttfts))], where="post",
                            color=colours[config], label=config)
            _finish(ax, f"concurrency {concurrency}", "TTFT (s)", "fraction of requests", None, log=False)
            ax.set_xscale("log")
        fig.suptitle(f"TTFT CDF: {title}")
        save(fig, names["ttft_cdf"])

        fig = Figure(figsize=(7, 4.5), layout="constrained")
        ax = fig.add_subplot()
        for config in configs:
            xs, ys = series(config, "output_tok_s")
            if xs:
                ax.plot(xs, ys, "-o", color=colours[config], label=config)
        _finish(ax, f"Output throughput: {title}", "concurrency", "output tok/s", concurrencies, log=False)
        ax.set_ylim(bottom=0)
        save(fig, names["throughput"])
    return written


def _finish(ax: Axes, title: str, xlabel: str, ylabel: str, xticks: list[int] | None, log: bool) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if xticks:
        ax.set_xticks(xticks)
    if log:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    else:  # keep the file (callers expect it) but say why it is empty
        ax.text(0.5, 0.5, "no successful measured requests", ha="center", va="center", transform=ax.transAxes)


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
    _write_plots(run, runs, folder)
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
    names = _unique_names([r.name for r in runs])
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
