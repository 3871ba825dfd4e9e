"""Resume TTFT through each KV codec, on a bandwidth-limited pool and on a fast one, side by side.

    python benchmarks/codec_resume.py [--codecs none,fp8,k8v4,lossless] [--tokens 8000]
                                      [--concurrency 8] [--repeats 3] [--slow DIR] [--gluster DIR]
                                      [--out FILE]

The model is SmolLM2-135M-Instruct (23 KB of KV per token: an 8k-token session is 184 MB). For
each codec, one engine (vLLM CPU build, the kvtier connector, no host DRAM) prefills
``--concurrency`` coding sessions of about ``--tokens`` tokens into a pool on the local disk,
and the pool is copied to each bandwidth-limited pool asked for: ``--slow DIR``, a loop device
whose reads a cgroup caps (``scripts/slowdisk.sh up DIR MBPS``; this process joins the cgroup),
and ``--gluster DIR``, a GlusterFS volume that ``scripts/glusterfs.sh up DIR`` started. Then a
fresh engine per pool resumes, ``--repeats`` times: one session alone, then all of them at once;
the limited pools' runs drop the page cache before each (``echo 3 > /proc/sys/vm/drop_caches``:
root), the local runs keep it (the fast pool: every chunk file in memory). TTFT is vLLM's own
first-token time of each request; the table gives medians over the repeats, and each codec's
ratio to ``none`` measured in the same run.

``auto`` decides per tier from the rates it measured reading (``kvtier.codec.rates``), and a tier
measures only what it reads, so its engine is filled on each pool itself, the way a long-running
engine would have learnt: it first writes one session of another file (a tier not yet
measured codes it), waits for those writes to land, reads it back (the limited pools after
dropping the page cache) and then writes the sessions. ``coded_files`` says how many chunk
files it coded on each pool.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DROP = "sync; echo 3 > /proc/sys/vm/drop_caches"


def env_lines(path: Path) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines a scripts/*.sh ``up`` wrote."""
    pairs = (line.removeprefix("export ").split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k: v.strip("'\"") for k, v in pairs}


def sessions(model: Path, n: int, tokens: int) -> tuple[list[list[int]], list[int]]:
    """``n`` coding sessions and a warm-up prompt (the last), and a prompt of another file that
    ``auto`` learns from, so that the warm-up stays new to every codec's pool."""
    from transformers import AutoTokenizer

    from kvtier.bench.coding import QUESTIONS, session, stdlib_files

    tokenizer = AutoTokenizer.from_pretrained(model)
    names = stdlib_files(n + 1, tokens * 5)
    spare = next(name for name in stdlib_files(n + 2, tokens * 5) if name not in names)
    prompts = [session(tokenizer, name, tokens, QUESTIONS[i % len(QUESTIONS)]).prompt for i, name in enumerate(names)]
    return prompts, session(tokenizer, spare, tokens, QUESTIONS[0]).prompt


def engine(model: Path, work: Path, name: str, prompts: list[list[int]], pool: str, codec: str,
           plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from kvtier.bench.offline import run_engine

    spec = {"model": str(model), "prompts": prompts, "plan": plan, "max_tokens": 1, "logprobs": None,
            "kv_cache_gib": 4, "max_model_len": max(len(p) for p in prompts) + 32,
            "connector": {"host_bytes": 0, "pool_url": pool, "kv_codec": codec, "load_policy": "always",
                          "io_threads": 8}}
    out: list[dict[str, Any]] = run_engine(spec, work, name, timeout_s=3600)["results"]
    return out


def fill(model: Path, work: Path, name: str, prompts: list[list[int]], learn: list[int], pool: str, codec: str,
         drop: bool) -> None:
    """Write every session but the warm-up prompt to ``pool``; ``auto`` first learns from
    ``learn`` (module doc)."""
    n = len(prompts) - 1
    plan: list[dict[str, Any]] = []
    if codec == "auto":  # the read waits for the writes to land: a chunk still queued is a miss
        plan += [{"p": n + 1, "tag": "learn-write"}, {"sh": settled(pool)}, {"reset": True},
                 *([{"sh": DROP}] if drop else []), {"p": n + 1, "tag": "learn-read"}]
    results = engine(model, work, name, [*prompts, learn], pool, codec,
                     [*plan, {"batch": list(range(n)), "tag": "fill"}])
    if any(x["tag"] == "learn-read" and not resumed(x) for x in results):
        raise SystemExit(f"{name}: the session written to learn from was not read back whole")


def resumed(result: dict[str, Any]) -> bool:
    """Whether a request found at least 90% of its prompt cached: a resume, not a recompute."""
    return bool(result["cached"] >= 0.9 * result["prompt_tokens"])


def settled(pool: str) -> str:
    """A shell command that returns once the pool's chunk files have stopped changing for 2 s."""
    root = shlex.quote(pool.removeprefix("fs://"))
    count = f"find {root} -name '*.kvt' | wc -l"
    return f"prev=-1; n=$({count}); while [ $n != $prev ]; do prev=$n; sleep 2; n=$({count}); done"


def coded_files(root: Path) -> tuple[int, int]:
    """(coded, all) chunk files under ``root``, from each file's header."""
    from kvtier.format import CODEC_RECORD_END, unpack_header

    coded = total = 0
    for path in root.rglob("*.kvt"):
        with path.open("rb") as f:
            coded += unpack_header(f.read(CODEC_RECORD_END)).codec is not None
        total += 1
    return coded, total


def resume(model: Path, work: Path, name: str, prompts: list[list[int]], pool: str, codec: str, repeats: int,
           drop: bool) -> dict[str, list[float]]:
    n = len(prompts) - 1  # the last prompt is the warm-up (new to the pool)
    plan: list[dict[str, Any]] = [{"p": n, "tag": "warmup"}]
    for r in range(repeats):
        for tag, step in (("single", {"p": 0}), ("batch", {"batch": list(range(n))})):
            plan += [{"reset": True}] + ([{"sh": DROP}] if drop else []) + [{**step, "tag": f"{tag}-{r}"}]
    results = engine(model, work, name, prompts, pool, codec, plan)
    out: dict[str, list[float]] = {"single": [], "batch_p50": []}
    for r in range(repeats):
        single = [x for x in results if x["tag"] == f"single-{r}"]
        batch = [x for x in results if x["tag"] == f"batch-{r}"]
        out["single"].append(single[0]["first_token_s"])
        out["batch_p50"].append(statistics.median(x["first_token_s"] for x in batch))
        if not all(map(resumed, single + batch)):
            raise SystemExit(f"{name}: a request was not resumed whole")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", default="none,fp8,k8v4,lossless",
                        help="comma-separated kv_codec values, auto included; none is the baseline")
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slow", type=Path, default=None, help="a scripts/slowdisk.sh DIR that is up")
    parser.add_argument("--gluster", type=Path, default=None, help="a scripts/glusterfs.sh DIR that is up")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from kvtier.bench.real_model import make_real_model
    from kvtier.tiers.poolroot import init_pool, scratch_pool

    limited: dict[str, Path] = {}
    if args.slow is not None:
        env = env_lines(args.slow / "slowdisk.env")
        Path(env["KVTIER_SLOW_PROCS"]).write_text(str(os.getpid()))  # the engines inherit the limit
        limited["slow"] = Path(env["KVTIER_SLOW_MOUNT"])
    if args.gluster is not None:
        limited["gluster"] = Path(env_lines(args.gluster / "gluster.env")["KVTIER_GLUSTER_MOUNT_A"])
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-codec-resume-") as tmp:
        work = Path(tmp)
        model = make_real_model(work / "smollm2").dir
        prompts, learn = sessions(model, args.concurrency, args.tokens)
        print(f"{args.concurrency} sessions of {min(len(p) for p in prompts[:-1])}-"
              f"{max(len(p) for p in prompts[:-1])} tokens", flush=True)
        for codec in args.codecs.split(","):
            local = work / f"pool-{codec}"
            url = scratch_pool(local)
            t0 = time.perf_counter()
            fill(model, work, f"fill-{codec}", prompts, learn, url, codec, False)
            size = sum(f.stat().st_size for f in local.rglob("*.kvt"))
            row = rows[codec] = {"pool_bytes": size, "fill_s": time.perf_counter() - t0}
            row["page_cache_coded_files"] = coded_files(local)
            row["page_cache"] = resume(model, work, f"local-{codec}", prompts, url, codec, args.repeats, False)
            for where, mount in limited.items():
                remote = mount / f"codec-resume-{codec}"
                shutil.rmtree(remote, ignore_errors=True)
                init_pool(remote, 16 << 30)
                if codec == "auto":  # learns this pool's rates (module doc)
                    fill(model, work, f"fill-{where}-{codec}", prompts, learn, f"fs://{remote}", codec, True)
                else:
                    shutil.copytree(local, remote, dirs_exist_ok=True)
                row[f"{where}_coded_files"] = coded_files(remote)
                row[where] = resume(model, work, f"{where}-{codec}", prompts, f"fs://{remote}", codec,
                                    args.repeats, True)
                shutil.rmtree(remote, ignore_errors=True)
            shutil.rmtree(local)
            print(f"{codec}: {size / 2**20:.0f} MiB; " + "; ".join(
                f"{where} single {statistics.median(r['single']):.3f} s, c={args.concurrency} p50 "
                f"{statistics.median(r['batch_p50']):.3f} s" for where in ("page_cache", *limited)
                if (r := row.get(where))), flush=True)
    base = rows.get("none")
    for codec, row in rows.items():
        for where in ("page_cache", *limited):
            if base and where in row:
                row[f"{where}_vs_none"] = {k: statistics.median(row[where][k]) / statistics.median(base[where][k])
                                           for k in ("single", "batch_p50")}
        print(codec, {k: v for k, v in row.items() if k.endswith("_vs_none")}, flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                        "cpus": os.cpu_count()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
