"""Misconfigurations an operator makes when setting up a fleet, each refused or warned.

Every row is one mistake made the way a new user would make it, through kvtier's real entry
points (called in this process: a process each would spend seconds importing torch):
``kvtier serve`` (its check before vLLM starts; with ``--print-command`` no engine starts, which
is what the check precedes), ``kvtier probe``, and a pool opened as an engine opens it, with
what kvtier writes to stderr and logs captured. A row passes when kvtier refuses with one line naming the
setting (and creates nothing), or warns at open while serving on; ``wrong`` counts a mistake
accepted in silence (on 6f37bba, issue 39: `kvtier serve` started vLLM with each of the serve
rows but the YAML one, a traceback; the rest went unsaid). No mistake
here can produce a wrong answer, because nothing is served from a pool that was refused.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

from faults.harness import FaultRow, Scale, scenario


@dataclass(frozen=True)
class Outcome:
    rc: int
    err: str


@contextmanager
def _environment(env: dict[str, str] | None) -> Iterator[None]:
    """Only ``env``'s ``KVTIER_*`` variables, for the duration."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVTIER_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("KVTIER_")]:
            del os.environ[k]
        os.environ.update(saved)


def _call(fn: Callable[[], int], env: dict[str, str] | None = None) -> Outcome:
    """``fn``'s exit status and everything it wrote to stderr or logged through kvtier's loggers."""
    err = io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("kvtier")
    logger.addHandler(handler)
    try:
        with _environment(env), redirect_stderr(err), redirect_stdout(io.StringIO()):
            try:
                rc = fn()
            except SystemExit as exc:  # argparse
                rc = exc.code if isinstance(exc.code, int) else 2
    finally:
        logger.removeHandler(handler)
    return Outcome(rc, err.getvalue())


def _run(argv: list[str], env: dict[str, str] | None = None) -> Outcome:
    from kvtier.cli.main import main

    return _call(lambda: main(argv), env)


def _open_pool(path: Path, own_bytes: int | None) -> Outcome:
    from kvtier.tiers.pool import PoolTier

    def open_and_close() -> int:
        PoolTier(path, own_bytes).close()
        return 0

    return _call(open_and_close)


def _serve(workdir: Path, name: str, yaml_text: str, env: dict[str, str] | None = None) -> Outcome:
    config = workdir / f"{name}.yaml"
    config.write_text(yaml_text)
    return _run(["serve", "--print-command", "--config", str(config), "--", "--model", "m"], env)


def _row(fault: str, ok: bool, outcome: Outcome, note: str, t0: float) -> FaultRow:
    """One attempt; served and identical when kvtier handled it as it must."""
    line = next((ln for ln in outcome.err.splitlines() if "kvtier" in ln or "error" in ln.lower()), "")
    return FaultRow(fault, injected=1, requests=1, served=int(ok), identical=int(ok), wrong=int(not ok),
                    seconds=time.perf_counter() - t0, notes=f"{note}: exit {outcome.rc}; says: {line[:160]!r}",
                    extra={"rc": outcome.rc, "stderr": outcome.err[-2000:]})


def _refused(outcome: Outcome, *words: str) -> bool:
    """Exit 2 with the reason on one line that names every one of ``words``; no traceback."""
    lines = [ln for ln in outcome.err.splitlines() if ln.strip()]
    return (outcome.rc == 2 and "Traceback" not in outcome.err
            and any(all(w in ln for w in words) for ln in lines))


def serve_refusals(workdir: Path) -> list[FaultRow]:
    """``kvtier serve`` refuses before vLLM starts, naming the setting."""
    workdir.mkdir(parents=True, exist_ok=True)
    missing = workdir / "not-mounted" / "pool"
    plain = workdir / "plain-dir"
    plain.mkdir(exist_ok=True)
    cases = [
        ("pool_url one slash short (fs://mnt/pool: a relative path)", "pool_url: fs://mnt/pool\n", ("pool_url",)),
        ("pool_url in LMCache's shape to a missing mount (fs://localhost:0/...)",
         f"pool_url: fs://localhost:0{missing}\n", ("pool_url",)),
        ("pool_url with a scheme kvtier has no tier for (nfs://)", "pool_url: nfs://filer/export/kv\n", ("pool_url",)),
        ("pool share not mounted (its directory missing)", f"pool_url: fs://{missing}\n", ("kvtier pool init",)),
        ("pool_url a plain directory, never made a pool", f"pool_url: fs://{plain}\n", ("kvtier pool init",)),
        ("a misspelled setting (pool_byte)", "pool_byte: 1G\n", ("pool_byte",)),
        ("a negative size (disk_bytes: -1G)", "disk_bytes: -1G\n", ("disk_bytes",)),
        ("a size without its unit (host_bytes: \"0.5\")", "host_bytes: \"0.5\"\n", ("host_bytes",)),
        ("a connector setting out of range (lookup_timeout_s: -1)", "lookup_timeout_s: -1\n", ("lookup_timeout_s",)),
        ("a YAML file that does not parse", "pool_url: [fs:///x\nhost_bytes: 1G\n", ("yaml",)),
    ]
    rows = []
    for i, (fault, text, words) in enumerate(cases):
        t0 = time.perf_counter()
        outcome = _serve(workdir, f"case{i}", text)
        ok = _refused(outcome, *words) or (words == ("yaml",) and _refused(outcome, "YAML"))
        if "missing" in fault or "not mounted" in fault:
            ok = ok and not (workdir / "not-mounted").exists()  # nothing made where the mount belongs
        rows.append(_row(f"kvtier serve: {fault}", ok, outcome, "refused before vLLM starts" if ok else "ACCEPTED", t0))
    return rows


def environment_typo(workdir: Path) -> list[FaultRow]:
    """A misspelled ``KVTIER_*`` variable is warned about (it would otherwise be ignored)."""
    t0 = time.perf_counter()
    outcome = _serve(workdir, "env", "{}\n", {"KVTIER_POOL_ULR": "fs:///mnt/kv"})
    ok = outcome.rc == 0 and "KVTIER_POOL_ULR" in outcome.err and "KVTIER_POOL_URL" in outcome.err
    return [_row("a misspelled environment setting (KVTIER_POOL_ULR)", ok, outcome,
                 "warned, with the right name" if ok else "IGNORED IN SILENCE", t0)]


def pool_warnings(workdir: Path) -> list[FaultRow]:
    """Pools that open but are set up wrong: each warned at open, naming the fix."""
    from kvtier.tiers.poolroot import init_pool

    rows = []
    # A pool each: a warning is said once per pool and process.
    no_budget, budgeted, on_root = workdir / "no-budget", workdir / "budgeted", workdir / "on-root"
    for path, budget in ((no_budget, None), (budgeted, 64 << 20), (on_root, 64 << 20)):
        if not path.exists():
            init_pool(path, budget)
    cases = [
        ("an fs pool with no budget anywhere", no_budget, None, ("kvtier pool budget",)),
        ("pool_bytes disagreeing with the pool's recorded budget", budgeted, 32 << 20, ("differs",)),
        ("a \"shared\" pool on the same device as /", on_root, None, ("same device",)),
    ]
    for fault, path, own, words in cases:
        t0 = time.perf_counter()
        outcome = _open_pool(path, own)
        ok = outcome.rc == 0 and any(all(w in ln for w in words) for ln in outcome.err.splitlines())
        rows.append(_row(fault, ok, outcome, "warned at open, serving on" if ok else "NOT WARNED", t0))
    return rows


def probe_refusals(workdir: Path) -> list[FaultRow]:
    """``kvtier probe`` measures nothing it was not pointed at: a missing path or a scheme it
    cannot measure is refused (6f37bba made a local directory, measured the local disk, exit 0)."""
    rows = []
    for fault, url in (("kvtier probe of a missing path", f"fs://{workdir / 'no-such-pool'}"),
                       ("kvtier probe of a URL it cannot measure (http://)", "http://filer/kv")):
        t0 = time.perf_counter()
        outcome = _run(["probe", url])
        ok = outcome.rc != 0 and "Traceback" not in outcome.err and not (workdir / "no-such-pool").exists()
        rows.append(_row(fault, ok, outcome, "refused" if ok else "MEASURED SOMETHING ELSE", t0))
    return rows


@scenario("misconfiguration: refused or warned before anything is served")
def misconfiguration_matrix(scale: Scale, workdir: Path) -> list[FaultRow]:
    del scale  # one attempt each: a misconfiguration is deterministic
    return serve_refusals(workdir) + environment_typo(workdir) + pool_warnings(workdir) + probe_refusals(workdir)
