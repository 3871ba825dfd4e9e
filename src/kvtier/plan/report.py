"""Run the planner over configurations x concurrency levels and present the rows: a rich table,
one JSON object, and a PNG of TTFT p50 vs concurrency drawn the way ``kvtier bench`` draws it."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.plan.sim import simulate
from kvtier.plan.spec import HardwareSpec, ModelSpec, PlanConfig
from kvtier.plan.workload import Workload


def run_plan(model: ModelSpec, hw: HardwareSpec, configs: Sequence[PlanConfig], concurrency: Sequence[int],
             make_workload: Callable[[int], Workload], *, seed: int = 0) -> list[dict[str, Any]]:
    """One summary row per (configuration, concurrency); ``make_workload(c)`` builds each workload."""
    rows = []
    for c in concurrency:
        workload = make_workload(c)
        for config in configs:
            row = simulate(model, hw, config, workload, seed=seed).summary()
            rows.append({"concurrency": c, "instances": config.instances, "tiers": list(config.tiers), **row})
    return rows


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


def write_png(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "kvtier plan: predicted TTFT p50") -> None:
    """TTFT p50 (log scale) vs concurrency, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
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
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
