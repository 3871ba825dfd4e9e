"""PNG plots of one result folder: per (workload, instances), TTFT vs concurrency, TTFT CDFs, throughput.

matplotlib is imported inside :func:`write_plots`, not at module level, so importing the report
stays cheap; figures are built with ``Figure`` (no pyplot global state) on the Agg backend.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvtier.bench.results import Record, Run
from kvtier.bench.summary import SectionKey, configs_of, sections
from kvtier.bench.tables import section_title
from kvtier.fileio import write_atomic

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_PLAIN_SECTION: SectionKey = ("cold-resume", 1)


def plot_names(section: SectionKey, single: bool) -> dict[str, str]:
    """File names of a section's three plots; unsuffixed for cold-resume x1 or a lone section."""
    workload, instances = section
    suffix = ""
    if not single and section != _PLAIN_SECTION:
        suffix = f"-{workload}" + (f"-{instances}inst" if instances != 1 else "")
    return {kind: f"{kind}{suffix}.png" for kind in ("ttft_vs_concurrency", "ttft_cdf", "throughput")}


def write_plots(run: Run, summary: list[Record], out: Path) -> list[Path]:
    """Three PNGs per (workload, instances) into ``out`` (replaced atomically); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")

    # One colour per configuration across every figure of the run.
    colours = {c: f"C{i % 10}" for i, c in enumerate(configs_of(summary))}
    by_section = sections(summary)
    written: list[Path] = []
    for section, entries in by_section.items():
        names = plot_names(section, single=len(by_section) == 1)
        for kind, fig in (("ttft_vs_concurrency", _ttft_figure(section, entries, colours)),
                          ("ttft_cdf", _cdf_figure(run, section, entries, colours)),
                          ("throughput", _throughput_figure(section, entries, colours))):
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=100)
            write_atomic(out / names[kind], buf.getvalue())
            written.append(out / names[kind])
    return written


def _series(entries: list[Record], config: str, name: str) -> tuple[list[int], list[float]]:
    """(concurrency levels, figure ``name``) of ``config``'s entries that have the figure."""
    points = [(e["concurrency"], e[name]) for e in entries if e["config"] == config and e[name] is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _ttft_figure(section: SectionKey, entries: list[Record], colours: dict[str, str]) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for config in configs_of(entries):
        for stat, style in (("ttft_p50_s", "-o"), ("ttft_p90_s", "--x")):
            xs, ys = _series(entries, config, stat)
            if xs:
                ax.plot(xs, ys, style, color=colours[config], label=f"{config} {stat[5:8]}")
    _finish(ax, f"TTFT p50 (solid) and p90 (dashed): {section_title(section)}", "concurrency", "TTFT (s)",
            sorted({e["concurrency"] for e in entries}), log=True)
    return fig


def _cdf_figure(run: Run, section: SectionKey, entries: list[Record], colours: dict[str, str]) -> Figure:
    from matplotlib.figure import Figure

    concurrencies = sorted({e["concurrency"] for e in entries})
    fig = Figure(figsize=(4 * max(1, len(concurrencies)), 4), layout="constrained")
    axes = fig.subplots(1, max(1, len(concurrencies)), squeeze=False, sharey=True)[0]
    for ax, concurrency in zip(axes, concurrencies, strict=False):
        for config in configs_of(entries):
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
    fig.suptitle(f"TTFT CDF: {section_title(section)}")
    return fig


def _throughput_figure(section: SectionKey, entries: list[Record], colours: dict[str, str]) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for config in configs_of(entries):
        xs, ys = _series(entries, config, "output_tok_s")
        if xs:
            ax.plot(xs, ys, "-o", color=colours[config], label=config)
    _finish(ax, f"Output throughput: {section_title(section)}", "concurrency", "output tok/s",
            sorted({e["concurrency"] for e in entries}), log=False)
    ax.set_ylim(bottom=0)
    return fig


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
