"""Run the planner over configurations x concurrency levels and present the rows: a rich table,
one JSON object, and a PNG of TTFT p50 vs concurrency drawn the way ``kvtier bench`` draws it."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.plan.parallel import run_all, turns_of
from kvtier.plan.sim import simulate
from kvtier.plan.spec import HardwareSpec, ModelSpec, PlanConfig
from kvtier.plan.workload import Workload


def run_plan(model: ModelSpec, hw: HardwareSpec, configs: Sequence[PlanConfig], concurrency: Sequence[int],
             make_workload: Callable[[int], Workload], *, seed: int = 0) -> list[dict[str, Any]]:
    """One summary row per (configuration, concurrency); ``make_workload(c)`` builds each workload."""
    rows = []
    for c in concurrency:
        workload = make_workload(c)
        jobs = [(model, hw, config, workload, seed) for config in configs]
        for config, row in zip(configs, run_all(_summary, jobs, turns_of(workload)), strict=True):
            rows.append({"concurrency": c, "instances": config.instances, "tiers": list(config.tiers), **row})
    return rows


def _summary(job: tuple[ModelSpec, HardwareSpec, PlanConfig, Workload, int]) -> dict[str, Any]:
    model, hw, config, workload, seed = job
    return simulate(model, hw, config, workload, seed=seed).summary()


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f}"


def render_table(rows: Sequence[dict[str, Any]], title: str = "kvtier plan") -> str:
    """The rows as a text table (rich, no colour), ready to print."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for name in ("config", "conc.", "hit rate by tier", "TTFT p50 (s)", "p90", "p99", "tok/s", "read GB/s",
                 "bottleneck"):
        table.add_column(name, justify="left" if name in ("config", "hit rate by tier", "bottleneck") else "right")
    for r in rows:
        if not r.get("requests"):
            table.add_row(str(r["config"]), str(r["concurrency"]), "no measured requests", "", "", "", "", "", "")
            continue
        hits = ", ".join(f"{k} {v:.0%}" for k, v in r["hit_rate"].items() if v > 0) or "none"
        tok_s = r.get("output_tok_s")
        table.add_row(str(r["config"]), str(r["concurrency"] or "trace"), hits, f"{r['ttft_p50_s']:.3g}",
                      f"{r['ttft_p90_s']:.3g}", f"{r['ttft_p99_s']:.3g}", f"{tok_s:.1f}" if tok_s else "-",
                      _gb(r["read_bytes_per_s"]), str(r["bottleneck"]))
    buf = io.StringIO()
    Console(file=buf, width=160, no_color=True).print(table)
    return buf.getvalue()


def write_png(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "kvtier plan: predicted TTFT p50",
              curves: Sequence[dict[str, Any]] = ()) -> None:
    """TTFT p50 (log scale) vs concurrency, one line per configuration; with ``curves``, a second
    panel: tier hit rate and TTFT p50 against the tier's size, one line per concurrency level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(13 if curves else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for name in dict.fromkeys(r["config"] for r in rows):
        points = sorted((r["concurrency"], r["ttft_p50_s"]) for r in rows if r["config"] == name and r.get("requests"))
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    if curves:
        hit = axes[0][1]
        ttft = hit.twinx()
        for curve in curves:
            xs = [p["pool_bytes"] / 1e9 for p in curve["points"]]
            label = f"c={curve['concurrency'] or 'trace'}"
            hit.plot(xs, [100 * (p["relative_hit"] or 0.0) for p in curve["points"]], marker="o", label=f"hit, {label}")
            ttft.plot(xs, [p["ttft_p50_s"] for p in curve["points"]], linestyle="--", marker="x",
                      label=f"TTFT p50, {label}")
        hit.axhline(95, color="grey", linewidth=0.8)
        hit.set_ylim(0, 105)
        hit.set_xlabel(f"{curves[0]['tier']} size (GB on disk)")
        hit.set_ylabel("tier hits, % of the most (solid)")
        ttft.set_ylabel("TTFT p50 (s, dashed)")
        hit.set_title(f"{curves[0]['config']}: hits and TTFT vs storage")
        hit.grid(True, alpha=0.3)
        hit.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"


def render_capacity(capacity: dict[int, dict[str, Any]], curves: Sequence[dict[str, Any]]) -> str:
    """The storage each concurrency level's workload needs per tier, then hit rate and TTFT p50
    against the pool's size, as text tables."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="storage the workload needs (persistent tiers keep every session)")
    for name in ("conc.", "tier", "sessions", "bytes", "files", "inodes", "budget", "filesystem (headroom)",
                 "host per rank"):
        table.add_column(name, justify="left" if name == "tier" else "right")
    for c, cap in capacity.items():
        for tier, row in cap["tiers"].items():
            if "files" not in row:
                table.add_row(str(c or "trace"), tier, "", "", "", "", _size(row["budget_bytes"]), "",
                              _size(row["host_bytes_per_rank"]))
                continue
            table.add_row(str(c or "trace"), tier, str(row["sessions"]), _size(row["bytes"]), f"{row['files']:,}",
                          f"{row['inodes']:,}", _size(row["budget_bytes"]), _size(row["filesystem_bytes"]), "")
    buf = io.StringIO()
    console = Console(file=buf, width=160, no_color=True)
    console.print(table)
    for curve in curves:
        t = Table(title=f"{curve['config']} at concurrency {curve['concurrency'] or 'trace'}: hit rate and TTFT vs "
                        f"the {curve['tier']} tier's size (smallest for 95% of the hits: "
                        f"{_size(curve['bytes_for_95pct'])})")
        for name in ("share of the working set", "size", "tier hit rate", "of the most", "TTFT p50 (s)", "p90"):
            t.add_column(name, justify="right")
        for p in curve["points"]:
            relative = "-" if p["relative_hit"] is None else f"{p['relative_hit']:.0%}"
            t.add_row(f"{p['fraction']:.0%}", _size(p["pool_bytes"]), f"{p['tier_hit_rate']:.0%}", relative,
                      f"{p['ttft_p50_s']:.3g}", f"{p['ttft_p90_s']:.3g}")
        console.print(t)
        if curve.get("note"):
            console.print(curve["note"])
    return buf.getvalue()


def render_seed(cells: Sequence[dict[str, Any]]) -> str:
    """The plan beside the seed's published table (``presets.seed_comparison``)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="the seed's published table (Qwen3-Coder-480B, TP=8) vs this plan")
    for name in ("config", "conc.", "TTFT p50 seed / plan (s)", "error", "tok/s seed / plan", "error", "cell"):
        table.add_column(name, justify="left" if name in ("config", "cell") else "right")
    for c in cells:
        tok = f"{c['seed_tok_s']:.1f} / {c['plan_tok_s']:.1f}" if c["plan_tok_s"] else "-"
        table.add_row(c["config"], str(c["concurrency"]), f"{c['seed_ttft_p50_s']:.2f} / {c['plan_ttft_p50_s']:.3g}",
                      f"{c['ttft_error']:+.0%}", tok, f"{c['tok_s_error']:+.0%}" if c["tok_s_error"] is not None
                      else "-", f"fitted: {c['fitted']}" if c["fitted"] else "predicted")
    buf = io.StringIO()
    Console(file=buf, width=160, no_color=True).print(table)
    return buf.getvalue()
