"""Engine-level fault scenarios: a real vLLM engine (CPU build) serving while the pool misbehaves.

Every scenario compares each request's greedy tokens with a reference run of the same prompt
in an engine that never loads (``load_policy: never``; the connector is still set, so vLLM's
CPU thread binding is the same), i.e. with recompute. A request counts as identical when its
tokens are the same, or when they first differ at a near-tie: each run's token is among the
other's five most likely, within ``TIE_NATS`` of its top. The random-weight test model is
close to uniform (top log-probabilities near -9.2, the leaders a bf16 step or two apart), and
computing from a cached prefix rather than from scratch reorders such leaders: vLLM's own
prefix cache reorders the same ones, to the same tokens. Anything else is wrong. Faults:

* the pool's filesystem fills up (ENOSPC), is remounted read-only (EROFS), or the pool
  directory is removed, while the engine serves (root: a size-limited tmpfs);
* every pool read (or lookup and read) hangs for 30 s (``inject_faults``): requests must fall
  back to recompute within ``read_timeout_s``, not wait;
* tenants: requests with another ``cache_salt`` (or another instance default
  ``tenant_salt``) must never hit a tenant's chunks, even for identical prompts;
* two engines share one pool half the size of their prompts' chunks while ``kvtier pool gc``
  evicts beside them.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _pool import new_pool
from faults.harness import FaultRow, Scale, is_root, scenario
from kvtier.bench.offline import near_tie

RUNNER = ["-m", "kvtier.bench.offline"]  # the one engine runner, through a plan of prompts and actions
CHUNK = 256
CHUNK_FILE = CHUNK * 2048 + 4096  # tiny-llama: 2048 KV bytes per token, plus the chunk header
READ_TIMEOUT_S = 1.0
HANG_S = 30.0


class EngineFailed(RuntimeError):
    pass


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def make_prompts(n: int, seed: int = 11) -> list[list[int]]:
    """``n`` unrelated prompts of 3-6 chunks (and a partial one), so each has several chunks."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 31000) for _ in range(rng.randrange(3 * CHUNK + 20, 6 * CHUNK + 200))]
            for _ in range(n)]


@dataclass
class Run:
    results: list[dict[str, Any]]
    actions: list[dict[str, Any]]
    metrics: dict[str, dict[str, Any]]  # role (worker, scheduler) -> the connector's metrics file
    seconds: float
    rc: int = 0
    stderr: str = ""


@dataclass
class Bench:
    """A model, the prompts and the reference tokens shared by every engine scenario."""

    workdir: Path
    n_prompts: int
    model: Path = field(init=False)
    prompts: list[list[int]] = field(init=False)
    _reference: Run | None = None

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        from kvtier.bench.model import ensure_model

        self.model = ensure_model(self.workdir / "tiny-llama")
        self.prompts = make_prompts(self.n_prompts)

    def base(self, name: str, **settings: Any) -> dict[str, Any]:
        """Connector settings: two host DRAM slots (so re-reads come from the pool), always load."""
        return {"host_bytes": 2 * CHUNK_FILE, "chunk_tokens": CHUNK, "load_policy": "always",
                "metrics_file": str(self.workdir / f"{name}.metrics"), **settings}

    def start(self, name: str, connector: dict[str, Any], plan: list[dict[str, Any]],
              loop_s: float | None = None) -> subprocess.Popen[str]:
        for stale in (self.workdir / f"{name}.json", *self.workdir.glob(f"{name}.metrics.*.json")):
            stale.unlink(missing_ok=True)  # an earlier run's, under the same name: never read as this one's
        spec = {"model": str(self.model), "out": str(self.workdir / f"{name}.json"), "prompts": self.prompts,
                "connector": connector, "plan": plan, "loop_s": loop_s, "max_model_len": 8192,
                "engine_core_in_process": True}  # one process fewer to start (tests/integration/_runs.py)
        path = self.workdir / f"{name}.spec.json"
        path.write_text(json.dumps(spec))
        log = open(self.workdir / f"{name}.log", "w")
        # Its own process group: a kill takes vLLM's EngineCore and workers with it.
        return subprocess.Popen([sys.executable, *RUNNER, str(path)], stdout=log, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    def finish(self, name: str, proc: subprocess.Popen[str], t0: float, timeout_s: float = 900) -> Run:
        try:
            rc = proc.wait(timeout=timeout_s)
        except BaseException:  # a timeout, or Ctrl-C: never leave an engine behind
            _kill_group(proc)
            rc = proc.wait()
            if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                raise
        seconds = time.monotonic() - t0
        log = (self.workdir / f"{name}.log").read_text(errors="replace")
        out = self.workdir / f"{name}.json"
        if rc != 0 or not out.exists():
            return Run([], [], {}, seconds, rc or -1, log[-3000:])
        data = json.loads(out.read_text())
        metrics = {role: json.loads(path.read_text()) for role in ("worker", "scheduler")
                   if (path := self.workdir / f"{name}.metrics.{role}.json").exists()}
        return Run(data["results"], data["actions"], metrics, seconds, 0, log[-3000:])

    def run(self, name: str, connector: dict[str, Any], plan: list[dict[str, Any]],
            loop_s: float | None = None) -> Run:
        t0 = time.monotonic()
        return self.finish(name, self.start(name, connector, plan, loop_s), t0)

    def reference(self) -> Run:
        """Each prompt once, in an engine that never loads: recompute tokens and times."""
        if self._reference is None:
            run = self.run("reference", self.base("reference", pool_url=new_pool(self.workdir / 'ref-pool'),
                                                  load_policy="never"),
                           [{"p": i} for i in range(len(self.prompts))])
            if run.rc != 0:
                raise EngineFailed(f"the reference engine failed:\n{run.stderr}")
            self._reference = run
        return self._reference

    def compare(self, results: list[dict[str, Any]]) -> tuple[int, int, int]:
        """(exact, near-tie, wrong) against each request's prompt in the reference run.

        Exact: the same greedy tokens. Near-tie: the first differing token is, in both runs,
        among the other run's five most likely and within ``TIE_NATS`` of its top (see the
        module docstring). Wrong: anything else.
        """
        ref = {r["p"]: r for r in self.reference().results}
        exact = tie = 0
        for r in results:
            want = ref[r["p"]]
            if r["tokens"] == want["tokens"]:
                exact += 1
            elif near_tie(r, want):
                tie += 1
        return exact, tie, len(results) - exact - tie


def _row(bench: Bench, fault: str, injected: int, results: list[dict[str, Any]], run: Run,
         notes: str, **extra: object) -> FaultRow:
    exact, tie, wrong = bench.compare(results)
    if tie:
        notes += f"; {tie} near-tie flips"
    return FaultRow(fault, injected, requests=len(results), served=len(results), identical=exact + tie, wrong=wrong,
                    crashes=int(run.rc != 0), seconds=run.seconds, notes=notes,
                    extra={"exact": exact, "near_tie": tie, **extra})


def _crashed(fault: str, run: Run, requests: int) -> FaultRow:
    return FaultRow(fault, 1, requests=requests, crashes=1, seconds=run.seconds,
                    notes=f"engine exited rc={run.rc}: {run.stderr.strip().splitlines()[-1:] }")


def _groups(n: int, k: int) -> list[list[int]]:
    size = max(1, n // k)
    return [list(range(i * size, (i + 1) * size)) for i in range(k)]


def _tier(run: Run, name: str, role: str = "worker") -> dict[str, Any]:
    return dict(run.metrics.get(role, {}).get("tiers", {}).get(name, {}))


def _hits(results: list[dict[str, Any]]) -> int:
    return sum(1 for r in results if r["cached"] > 0)


# -- the pool's filesystem breaks while serving ------------------------------------------------


def storage_faults(bench: Bench, workdir: Path) -> list[FaultRow]:
    """One engine; its pool on a 24 MiB tmpfs. Stages: healthy, full, read-only, removed.

    In each stage new prompts are served (their writes hit the fault) and then the healthy
    stage's prompts are served again after a prefix-cache reset (their reads come from the
    pool when it can still be read).
    """
    mnt = workdir / "poolfs"
    mnt.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True,
                           text=True)
    if mount.returncode != 0:
        raise EngineFailed(f"cannot mount a tmpfs at {mnt}: {mount.stderr.strip()}")
    pool = mnt / "pool"
    g0, g1, g2, g3 = _groups(len(bench.prompts), 4)
    q = shlex.quote
    stages = [
        ("healthy", None, g0),
        ("full", f"dd if=/dev/zero of={q(str(mnt / 'filler'))} bs=1M 2>/dev/null; sync", g1),
        ("read-only", f"rm -f {q(str(mnt / 'filler'))} && mount -o remount,ro {q(str(mnt))}", g2),
        ("removed", f"mount -o remount,rw {q(str(mnt))} && rm -rf {q(str(pool))}", g3),
    ]
    plan: list[dict[str, Any]] = []
    for stage, action, group in stages:
        if action:
            plan.append({"sh": action})
        plan += [{"p": i, "tag": f"{stage}:new"} for i in group]
        # Writers run below the engine's priority (write_nice): on a CPU engine they write while
        # it idles. Give them that idle time before the next stage's fault or re-read, so what a
        # row measures is the fault, not a write still queued.
        plan.append({"sh": "sleep 2"})
        plan.append({"reset": True})
        plan += [{"p": i, "tag": f"{stage}:again"} for i in g0]
    plan.append({"sh": f"test ! -e {q(str(pool))}"})  # the removed pool was not recreated
    try:
        run = bench.run("storage", bench.base("storage", pool_url=new_pool(pool)), plan)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    if run.rc != 0:
        return [_crashed("pool filesystem faults while serving", run, len(plan))]
    pool_m = _tier(run, "pool")
    counted = (f"pool failed_writes {pool_m.get('failed_writes', '?')}, corrupt_chunks "
               f"{pool_m.get('corrupt_chunks', '?')} for the whole run")
    not_recreated = run.actions[-1]["rc"] == 0
    titles = {"healthy": "(control) healthy pool", "full": "pool filesystem full (ENOSPC) while serving",
              "read-only": "pool remounted read-only (EROFS) while serving",
              "removed": "pool directory removed (rm -rf) while serving"}
    failed_actions = [a for a in run.actions[:-1] if a["rc"] != 0]
    rows = []
    for stage, _, _ in stages:
        results = [r for r in run.results if str(r["tag"]).startswith(f"{stage}:")]
        again = [r for r in results if r["tag"] == f"{stage}:again"]
        notes = f"old prompts re-read with hits: {_hits(again)}/{len(again)}"
        if stage == "removed":
            notes += f"; pool dir not recreated: {not_recreated}; {counted}"
        row = _row(bench, titles[stage], 0 if stage == "healthy" else 1, results, run, notes,
                   hits_again=_hits(again), requests_again=len(again), not_recreated=not_recreated, pool=pool_m)
        row.control = stage == "healthy"
        rows.append(row)
    if failed_actions:
        # A fault that could not be injected (e.g. remount refused) is reported, not passed.
        for row in rows[1:]:
            row.injected = 0
            row.notes += f"; injection failed: {failed_actions}"
    return rows[1:] + rows[:1]


# -- a pool that is not there -------------------------------------------------------------------


def unmounted_pool(bench: Bench) -> list[FaultRow]:
    """The pool's share is not mounted yet (its directory is missing): the engine says so, serves
    every request by recomputing, and creates nothing where the mount should be. (Before
    ``kvtier pool init`` existed, it made a private pool there on the root disk, silently.)"""
    missing = bench.workdir / "not-mounted" / "pool"
    group = list(range(min(4, len(bench.prompts))))
    plan = [{"p": i, "tag": "new"} for i in group] + [{"reset": True}] + [{"p": i, "tag": "again"} for i in group]
    run = bench.run("unmounted", bench.base("unmounted", pool_url=f"fs://{missing}", host_bytes=0), plan)
    if run.rc != 0:
        return [_crashed("pool not mounted (its directory missing)", run, len(plan))]
    log = (bench.workdir / "unmounted.log").read_text(errors="replace")
    said = sum(1 for line in log.splitlines() if "kvtier pool init" in line)
    created = (bench.workdir / "not-mounted").exists()
    hits = _hits(run.results)
    return [_row(bench, "pool not mounted (its directory missing)", 1, run.results, run,
                 f"hits {hits}; error lines naming `kvtier pool init`: {said}; directory created: {created}",
                 hits=hits, said=said, created=created)]


# -- a pool that hangs ---------------------------------------------------------------------------


def hanging_pool(bench: Bench, ops: tuple[str, ...] = ("load",)) -> list[FaultRow]:
    """Pool calls in ``ops`` sleep 30 s (a hung NFS server) in the worker and the scheduler;
    each gives up after read_timeout_s, and the pool is then skipped for tier_cooldown_s."""
    group = list(range(min(6, len(bench.prompts))))
    faults = {"pool": {"delay_prob": 1.0, "min_delay_s": HANG_S, "max_delay_s": HANG_S, "ops": list(ops)}}
    name = "hanging-" + "-".join(ops)
    # The faults start after the writes: the reference engine wrote every prompt through a
    # healthy pool of the same configuration; an engine on a copy of it (the files are all
    # there) sees it hang.
    ref_s = max(r["seconds"] for r in bench.reference().results)
    pool = bench.workdir / name
    shutil.rmtree(pool, ignore_errors=True)
    shutil.copytree(bench.workdir / "ref-pool", pool)
    run = bench.run(name, bench.base(name, pool_url=new_pool(pool), read_timeout_s=READ_TIMEOUT_S,
                                     inject_faults=faults), [{"p": i} for i in group])
    what = "read" if ops == ("load",) else "lookup and read"
    fault = f"every pool {what} hangs {HANG_S:.0f} s (read_timeout_s={READ_TIMEOUT_S})"
    if run.rc != 0:
        return [_crashed(fault, run, len(group))]
    bound = READ_TIMEOUT_S + 3 * ref_s + 2.0
    slowest = max(r["seconds"] for r in run.results)
    timeouts = int(_tier(run, "pool").get("timeouts", 0))
    sched_timeouts = int(_tier(run, "pool", role="scheduler").get("timeouts", 0))
    row = _row(bench, fault, timeouts + sched_timeouts, run.results, run,
               f"slowest request {slowest:.2f} s (bound {bound:.2f} s; slowest recompute {ref_s:.2f} s); "
               f"timeouts: worker {timeouts}, scheduler {sched_timeouts}; requests with hits {_hits(run.results)}",
               slowest_s=slowest, bound_s=bound, worker_timeouts=timeouts, scheduler_timeouts=sched_timeouts)
    if slowest > bound:
        row.wrong += 1  # a request that waited on the hung tier is the failure this row checks
        row.notes += "; EXCEEDED THE BOUND"
    return [row]


# -- tenants ----------------------------------------------------------------------------------


def tenant_isolation(bench: Bench) -> list[FaultRow]:
    """Tenant A fills the pool; in a second engine, other tenants send the same prompts."""
    group = list(range(min(6, len(bench.prompts))))
    pool = new_pool(bench.workdir / 'tenant-pool')
    a = bench.run("tenant-a", bench.base("tenant-a", pool_url=pool), [{"p": i, "salt": "tenant-a"} for i in group])
    plan = ([{"p": i, "salt": "tenant-b", "tag": "salt"} for i in group] + [{"reset": True}]
            + [{"p": i, "tag": "instance"} for i in group] + [{"reset": True}]
            + [{"p": i, "salt": "tenant-a", "tag": "owner"} for i in group])
    b = bench.run("tenant-b", bench.base("tenant-b", pool_url=pool, tenant_salt="instance-b"), plan)
    if a.rc != 0 or b.rc != 0:
        return [_crashed("tenant isolation", a if a.rc else b, len(plan))]
    rows = []
    for tag, fault in (("salt", "another tenant's cache_salt, same prompts"),
                       ("instance", "another instance's default tenant_salt, same prompts")):
        results = [r for r in b.results if r["tag"] == tag]
        leaked = _hits(results)
        row = _row(bench, fault, len(results), results, b,
                   f"requests that hit tenant A's chunks: {leaked} (must be 0)", leaked=leaked)
        row.wrong += leaked
        rows.append(row)
    owner = [r for r in b.results if r["tag"] == "owner"]
    control = _row(bench, "(control) tenant A's own cache_salt, from the other engine", 0, owner, b,
                   f"requests with hits: {_hits(owner)}/{len(owner)}", owner_hits=_hits(owner))
    control.control = True
    rows.append(control)
    return rows


# -- two engines and gc share one pool --------------------------------------------------------------


def shared_pool_with_gc(bench: Bench, minutes: float, pools: tuple[Path, Path, Path] | None = None,
                        where: str = "") -> list[FaultRow]:
    """Two engines loop over the prompts (opposite orders) for ``minutes`` on one pool that
    holds about half of the prompts' chunks, while ``kvtier pool gc`` evicts it to three
    quarters of that every second beside them. ``pools``: the pool's path as the first engine,
    the second engine and gc see it (one directory through three mounts of a shared
    filesystem); by default one local directory. ``where`` names that in the row."""
    pool = bench.workdir / "shared-pool"
    paths = pools or (pool, pool, pool)
    pool = paths[2]
    n = len(bench.prompts)
    pool_mib = max(8, round(1.2 * n))  # the prompts average about 4.5 chunks of 0.5 MiB
    gc_mib = pool_mib * 3 // 4
    loop_s = minutes * 60 if minutes > 0 else None
    t0 = time.monotonic()
    engines = {name: bench.start(name, bench.base(name, pool_url=new_pool(path), pool_bytes=f"{pool_mib}MiB"),
                                 [{"p": i} for i in order], loop_s)
               for name, order, path in (("shared-1", range(n), paths[0]), ("shared-2", reversed(range(n)), paths[1]))}
    gc_log = bench.workdir / "gc.log"
    kvtier = [sys.executable, "-m", "kvtier.cli.main"]
    gc_runs = 0
    gc_failures = 0
    try:
        with open(gc_log, "w") as log:
            while any(p.poll() is None for p in engines.values()):
                if time.monotonic() - t0 > 900 + (loop_s or 0):
                    for p in engines.values():
                        _kill_group(p)  # finish() reports them as crashed
                    break
                if (pool / ".kvtier").exists():
                    rc = subprocess.run([*kvtier, "pool", "gc", str(pool), "--max-bytes", f"{gc_mib}MiB",
                                         "--tmp-age", "30", "--json"], stdout=log, stderr=log).returncode
                    gc_runs += 1
                    gc_failures += rc != 0
                time.sleep(1.0)
    except BaseException:
        for p in engines.values():
            _kill_group(p)
        raise
    runs = {name: bench.finish(name, proc, t0) for name, proc in engines.items()}
    verify = subprocess.run([*kvtier, "pool", "verify", str(pool), "--json"], capture_output=True, text=True)
    bad = len(json.loads(verify.stdout)["bad"]) if verify.stdout.strip() else -1
    results = [r for run in runs.values() for r in run.results]
    crashed = sum(run.rc != 0 for run in runs.values())
    evictions = sum(int(_tier(run, "pool").get("evictions", 0)) for run in runs.values())
    fault = f"two engines share one {pool_mib} MiB pool{where}, gc to {gc_mib} MiB every 1 s"
    row = _row(bench, fault, gc_runs, results, next(iter(runs.values())),
               f"{sum(run.results[-1]['pass'] + 1 if run.results else 0 for run in runs.values())} passes, "
               f"requests with hits {_hits(results)}, pool evictions by engines {evictions}, gc runs {gc_runs} "
               f"(failed {gc_failures}), verify after: {bad} bad",
               gc_failures=gc_failures, verify_bad=bad, hits=_hits(results))
    row.crashes = crashed + gc_failures
    row.wrong += max(bad, 0) + (bad < 0)
    row.seconds = time.monotonic() - t0
    if crashed:
        row.notes += "; " + "; ".join(f"{name} rc={run.rc}" for name, run in runs.items() if run.rc)
    return [row]


@scenario("vLLM engine: pool filesystem faults, hangs, tenants, two engines + gc", needs_vllm=True)
def engine_matrix(scale: Scale, workdir: Path) -> list[FaultRow]:
    bench = Bench(workdir, scale.engine_prompts)
    bench.reference()
    rows: list[FaultRow] = []
    if is_root():
        rows += storage_faults(bench, workdir)
    rows += hanging_pool(bench, ("load",))
    rows += hanging_pool(bench, ("lookup", "load"))
    rows += tenant_isolation(bench)
    rows += unmounted_pool(bench)
    rows += shared_pool_with_gc(bench, scale.engine_minutes)
    return rows


def main() -> None:  # pragma: no cover - a debugging entry point
    import argparse

    from faults.harness import SCALES, markdown_table

    parser = argparse.ArgumentParser(description="Run the engine fault scenarios once.")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--scale", choices=sorted(SCALES), default="ci")
    args = parser.parse_args()
    print(markdown_table(engine_matrix(SCALES[args.scale], args.workdir)))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
