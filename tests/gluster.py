"""A real GlusterFS volume mounted twice, for the shared pool's tests (``scripts/glusterfs.sh``).

``gluster`` (session-scoped) starts one volume of two bricks on loopback and mounts it twice,
two FUSE clients with caches of their own standing for two machines; ``gluster_pool`` gives each
test a fresh directory as seen through both mounts, ``(path_on_a, same_path_on_b)``.

They skip, with one reason, where GlusterFS cannot run (not Linux, not root, no ``/dev/fuse``,
the packages missing); with ``KVTIER_REQUIRE_GLUSTER=1`` (``scripts/test.sh``'s full run, CI's)
they fail instead, and missing packages are installed by the script. Mark the tests that use
them ``@pytest.mark.gluster``.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REQUIRE_ENV = "KVTIER_REQUIRE_GLUSTER"
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "glusterfs.sh"
UP_TIMEOUT_S = 300.0  # an apt-get install included
DOWN_TIMEOUT_S = 120.0
_names = itertools.count()


@dataclass(frozen=True)
class Gluster:
    """One GlusterFS volume, mounted at ``mount_a`` and ``mount_b`` (two clients)."""

    mount_a: Path
    mount_b: Path
    volume: str
    host: str
    workdir: Path
    up_seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    """``up`` and, once the session ends, ``down`` (seconds): kept for reports."""

    def pair(self, name: str) -> tuple[Path, Path]:
        """A fresh directory ``name`` (owner-only, as kvtier wants its pool's parent) created on
        mount A: ``(its path on A, its path on B)``, visible on B before this returns."""
        a, b = self.mount_a / name, self.mount_b / name
        a.mkdir(mode=0o700)
        deadline = time.monotonic() + 10.0
        while not b.is_dir():
            if time.monotonic() > deadline:
                raise AssertionError(f"{a} made on mount A is not on mount B after 10 s")
            time.sleep(0.01)
        return a, b


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def _installed() -> bool:
    return all(shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") for tool in
               ("glusterd", "gluster", "mount.glusterfs"))


def unavailable() -> str | None:
    """Why GlusterFS cannot run here (one reason), or None. Missing packages do not count when
    the tests are required: the script installs them."""
    if not sys.platform.startswith("linux"):
        return "GlusterFS needs Linux"
    if os.geteuid() != 0:
        return "GlusterFS needs root (its daemons and the FUSE mounts)"
    if not os.path.exists("/dev/fuse"):
        return ("/dev/fuse is missing: FUSE mounts are impossible here (a container needs "
                "--device /dev/fuse --cap-add SYS_ADMIN)")
    if not required() and not _installed():
        return ("GlusterFS is not installed (apt-get install glusterfs-server glusterfs-client, or run "
                "scripts/test.sh, which installs it)")
    return None


def parse_env(text: str) -> dict[str, str]:
    """``export NAME=VALUE`` lines (shell-quoted) -> {NAME: VALUE}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(?:export\s+)?(KVTIER_GLUSTER_\w+)=(.*)", line.strip())
        if m:
            words = shlex.split(m.group(2))
            out[m.group(1)] = words[0] if words else ""
    return out


def _run(action: str, workdir: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), action, str(workdir)], capture_output=True, text=True,
                          timeout=timeout_s, check=False, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def gluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gluster]:
    reason = unavailable()
    if reason is not None:
        if required():
            pytest.fail(f"GlusterFS is required ({REQUIRE_ENV}=1) but cannot run: {reason}", pytrace=False)
        pytest.skip(f"GlusterFS: {reason} (set {REQUIRE_ENV}=1 to fail instead)")
    workdir = tmp_path_factory.mktemp("glusterfs")
    t0 = time.perf_counter()
    try:
        done = _run("up", workdir, UP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _run("down", workdir, DOWN_TIMEOUT_S)
        pytest.fail(f"scripts/glusterfs.sh up {workdir} took over {UP_TIMEOUT_S:.0f} s", pytrace=False)
    up_s = time.perf_counter() - t0
    env = parse_env(done.stdout)
    if done.returncode != 0 or "KVTIER_GLUSTER_MOUNT_B" not in env:
        _run("down", workdir, DOWN_TIMEOUT_S)
        pytest.fail(f"scripts/glusterfs.sh up {workdir} failed (exit {done.returncode}):\n{done.stderr[-3000:]}",
                    pytrace=False)
    g = Gluster(Path(env["KVTIER_GLUSTER_MOUNT_A"]), Path(env["KVTIER_GLUSTER_MOUNT_B"]),
                env["KVTIER_GLUSTER_VOLUME"], env["KVTIER_GLUSTER_HOST"], workdir, up_s, {"up": up_s})
    try:
        yield g
    finally:
        t0 = time.perf_counter()
        down = _run("down", workdir, DOWN_TIMEOUT_S)
        g.timings["down"] = time.perf_counter() - t0
        # Daemons or mounts left behind are an error of the run, not a footnote.
        assert down.returncode == 0, \
            f"scripts/glusterfs.sh down {workdir} failed (exit {down.returncode}):\n{down.stderr[-3000:]}"


@pytest.fixture
def gluster_pool(gluster: Gluster, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """A fresh directory for this test: ``(its path on mount A, the same directory on mount B)``."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:80]
    return gluster.pair(f"{next(_names):03d}-{name}")
