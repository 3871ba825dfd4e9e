"""kvtier.bench.report: figures, tables, CSV, plots and comparisons from a recorded run.

The fixture in tests/data/bench_run is a hand-made run: recompute, local-disk and shared-pool
ok at concurrency 1 and 2 (cold-resume), each with populate rows (measured=false, TTFT 9.5 s,
so including them would change every figure), one shared-pool request that failed with HTTP
500, lmcache failed before serving anything, and a small chat workload. Expected values below
are worked out by hand from the rows; the fixture folder itself is never written to.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import report
from kvtier.bench.report import Run, compare, format_change, format_speedup, load_run, summarize, write_report

FIXTURE = Path(__file__).parent / "data" / "bench_run"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LMCACHE_ERROR = "engine did not become ready within 300 s: ModuleNotFoundError: No module named 'lmcache'"


def _entry(summary: list[dict[str, Any]], config: str, concurrency: int,
           workload: str = "cold-resume") -> dict[str, Any]:
    (entry,) = [e for e in summary if (e["config"], e["concurrency"], e["workload"]) == (config, concurrency, workload)]
    return entry


@pytest.fixture
def run() -> Run:
    return load_run(FIXTURE)


def _scaled_copy(tmp_path: Path, name: str, factor: float) -> Path:
    """The fixture copied to tmp_path/name with every TTFT multiplied by ``factor``."""
    folder = tmp_path / name
    shutil.copytree(FIXTURE, folder)
    rows = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    for row in rows:
        if row["ttft_s"] is not None:
            row["ttft_s"] *= factor
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_load_run_reads_all_three_files(run: Run) -> None:
    assert len(run.records) == 40
    assert len(run.configs) == 6
    assert run.env["vllm"] == "0.32.0"
    assert run.name == "bench_run"


def test_summary_keys_and_order(run: Run) -> None:
    summary = summarize(run)
    assert [(e["workload"], e["config"], e["concurrency"]) for e in summary] == [
        ("cold-resume", "recompute", 1), ("cold-resume", "recompute", 2),
        ("cold-resume", "local-disk", 1), ("cold-resume", "local-disk", 2),
        ("cold-resume", "shared-pool", 1), ("cold-resume", "shared-pool", 2),
        ("cold-resume", "lmcache", 1), ("cold-resume", "lmcache", 2),
        ("chat", "recompute", 1), ("chat", "shared-pool", 1),
    ]
    assert set(summary[0]) == {
        "config", "instances", "workload", "concurrency", "ttft_p50_s", "ttft_p90_s", "itl_p50_s", "e2e_p50_s",
        "output_tok_s", "requests", "errors", "prompt_tokens", "output_tokens", "cached_tokens", "duration_s",
        "status", "error",
    }


def test_percentiles_by_hand_and_populate_rows_excluded(run: Run) -> None:
    entry = _entry(summarize(run), "recompute", 1)
    # TTFTs 1.1, 1.2, 1.2, 1.3: p50 between the middle two; p90 at index 0.9 * 3 = 2.7.
    assert entry["requests"] == 4  # the two populate rows (TTFT 9.5 s) are not counted
    assert entry["ttft_p50_s"] == pytest.approx(1.2)
    assert entry["ttft_p90_s"] == pytest.approx(1.2 + 0.7 * 0.1)
    assert entry["e2e_p50_s"] == pytest.approx((1.6 + 1.7) / 2)
    assert entry["itl_p50_s"] == pytest.approx(0.02)
    assert entry["prompt_tokens"] == 4 * 1100
    assert entry["cached_tokens"] is None  # recompute's server reported no cache figure at all


def test_output_tok_s_by_hand(run: Run) -> None:
    summary = summarize(run)
    # Sequential resumes sent at 44, 46, 48, 50 s; the last ends at 50 + 1.8 s; 4 x 32 tokens.
    recompute = _entry(summary, "recompute", 1)
    assert recompute["duration_s"] == pytest.approx(50 + 1.8 - 44)
    assert recompute["output_tok_s"] == pytest.approx(4 * 32 / 7.8)
    # Pairs sent at 168 and 171 s; the failed request has no e2e and its tokens do not count.
    pool = _entry(summary, "shared-pool", 2)
    assert pool["output_tokens"] == 3 * 32
    assert pool["output_tok_s"] == pytest.approx(3 * 32 / (171 + 0.6 - 168))


def test_errors_counted_and_left_out_of_percentiles(run: Run) -> None:
    entry = _entry(summarize(run), "shared-pool", 2)
    assert (entry["requests"], entry["errors"]) == (4, 1)
    # Successful TTFTs 0.10, 0.12, 0.14: p90 at index 1.8.
    assert entry["ttft_p50_s"] == pytest.approx(0.12)
    assert entry["ttft_p90_s"] == pytest.approx(0.12 + 0.8 * 0.02)
    assert entry["cached_tokens"] == 3 * 1024
    assert entry["status"] == "ok"


def test_failed_config_without_rows_appears_per_concurrency(run: Run) -> None:
    summary = summarize(run)
    for concurrency in (1, 2):
        entry = _entry(summary, "lmcache", concurrency)
        assert entry["status"] == "failed"
        assert entry["error"] == LMCACHE_ERROR
        assert entry["requests"] == 0
        assert entry["ttft_p50_s"] is None
        assert entry["output_tok_s"] is None


def test_failed_config_with_some_rows_keeps_rows_and_error(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    shutil.copytree(FIXTURE, folder)
    configs = json.loads((folder / "configs.json").read_text())
    configs[2].update(status="failed", error="engine died at concurrency 2")  # shared-pool, cold-resume
    (folder / "configs.json").write_text(json.dumps(configs))
    entry = _entry(summarize(load_run(folder)), "shared-pool", 1)
    assert (entry["status"], entry["error"], entry["requests"]) == ("failed", "engine died at concurrency 2", 4)
    assert entry["ttft_p50_s"] == pytest.approx(0.1)


def test_write_report_files(run: Run, tmp_path: Path) -> None:
    summary = write_report(run, tmp_path / "out")
    out = tmp_path / "out"
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    assert on_disk["env"] == run.env
    assert _entry(on_disk["runs"], "lmcache", 1)["error"] == LMCACHE_ERROR

    with (out / "requests.csv").open(newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == list(report.REQUEST_COLUMNS)
    assert len(rows) == 1 + 40
    assert rows[1][rows[0].index("measured")] == "false"

    # Two sections (cold-resume x1 keeps the plain names, chat is suffixed), three plots each.
    for name in ("ttft_vs_concurrency", "ttft_cdf", "throughput"):
        for suffix in ("", "-chat"):
            assert (out / f"{name}{suffix}.png").read_bytes()[:8] == PNG_MAGIC
    assert not list(FIXTURE.glob("summary.*"))  # the fixture folder is untouched


def test_summary_md_tables_ratios_and_failures(run: Run, tmp_path: Path) -> None:
    write_report(run, tmp_path)
    md = (tmp_path / "summary.md").read_text()
    assert "## cold-resume, 1 instance" in md and "## chat, 1 instance" in md
    assert md.index("## cold-resume") < md.index("## chat")
    header = ("| concurrency | recompute TTFT p50 (s) | local-disk TTFT p50 (s) | shared-pool TTFT p50 (s) "
              "| lmcache TTFT p50 (s) | recompute tok/s | local-disk tok/s | shared-pool tok/s | lmcache tok/s |")
    assert header in md
    assert "| 1 | 1.200 | 0.125 | 0.100 | failed | 16.4 | 19.4 | 19.7 | failed |" in md
    # recompute 1.2 s / shared-pool 0.1 s = 12.0x; 0.1 vs local-disk's 0.125 is 20% lower.
    assert "| shared-pool | 1 | 12.0x | -20% |" in md
    assert "| lmcache | 1 | — | — |" in md
    # chat has no local-disk run: the baseline column is a dash, not a made-up figure.
    assert "| shared-pool | 1 | 2.8x | — |" in md
    assert f"- **lmcache** failed: {LMCACHE_ERROR}" in md
    assert "- shared-pool at concurrency 2: 1 of 4 requests failed" in md
    assert "How to read" in md


def test_ratio_formatting() -> None:
    assert format_speedup(1.2, 0.1) == "12.0x"
    assert format_speedup(None, 0.1) == "—"
    assert format_speedup(1.2, None) == "—"
    assert format_change(0.1, 0.097) == "-3%"
    assert format_change(0.1, 0.15) == "+50%"
    assert format_change(0.1, 0.1) == "0%"
    assert format_change(None, 0.1) == "—"


def test_config_order_known_then_alphabetical() -> None:
    names = ["zeta", "lmcache", "alpha", "recompute", "example-connector", "shared-pool", "local-disk"]
    assert sorted(names, key=report.config_sort_key) == [
        "recompute", "local-disk", "shared-pool", "example-connector", "lmcache", "alpha", "zeta"]


def test_compare_two_runs_shows_ratio(tmp_path: Path) -> None:
    base = _scaled_copy(tmp_path, "base", 1.0)
    faster = _scaled_copy(tmp_path, "faster", 0.5)
    md = compare([load_run(base), load_run(faster)])
    assert "| config | concurrency | base | faster | faster / base |" in md
    assert "| shared-pool | 1 | 0.100 | 0.050 | 0.50x |" in md
    assert "| lmcache | 1 | — | — | — |" in md  # failed in both: still listed


def test_main_several_dirs_write_reports_and_comparison(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _scaled_copy(tmp_path, "base", 1.0)
    slower = _scaled_copy(tmp_path, "slower", 2.0)
    result = report.main([str(base), str(slower)], str(tmp_path / "out"))
    assert set(result["runs"]) == {"base", "slower"}
    assert result["comparison"] == str(tmp_path / "out" / "comparison.md")
    assert "| recompute | 1 | 1.200 | 2.400 | 2.00x |" in Path(result["comparison"]).read_text()
    for name in ("base", "slower"):
        assert (tmp_path / "out" / name / "summary.json").is_file()
    captured = capsys.readouterr()
    assert captured.out.strip() == result["comparison"]  # stdout: the path only; progress on stderr
    assert "loaded" in captured.err


def test_main_one_dir_defaults_to_that_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _scaled_copy(tmp_path, "run", 1.0)
    summary = report.main([str(folder)], None)
    assert (folder / "summary.md").is_file()
    assert capsys.readouterr().out.strip() == str(folder / "summary.md")
    assert _entry(summary["runs"], "recompute", 1)["ttft_p50_s"] == pytest.approx(1.2)


def test_missing_requests_jsonl_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"requests\.jsonl"):
        load_run(tmp_path)


def test_bad_line_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "requests.jsonl").write_text((FIXTURE / "requests.jsonl").read_text().splitlines()[0] + "\n{oops\n")
    with pytest.raises(ValueError, match=r"requests\.jsonl:2"):
        load_run(tmp_path)


def test_import_does_not_load_matplotlib() -> None:
    import subprocess
    import sys

    code = "import sys, kvtier.bench.report; print('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_the_bench_modules_import_each_other_without_a_cycle() -> None:
    """report reads the configuration names from configs, never from suite, which imports report."""
    import ast

    package = Path(report.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvtier.bench"):
                # ``from kvtier.bench import profiles`` names the module in the imported names
                found |= {a.name for a in node.names} if node.module == "kvtier.bench" else {node.module.split(".")[2]}
        graph[path.stem] = found & {p.stem for p in package.glob("*.py")}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for dep in sorted(graph.get(name, ())):
                visit(dep, (*path, name))
            done.add(name)

    for name in sorted(graph):
        visit(name, ())
